"""asyncpage on its defaults as an AVX2-only CPU runs it, beside llama.cpp built for AVX2 only, on this machine.

    .venv/bin/python scripts/avx2_compare.py --llama-bench PATH --llama-server PATH [--model GGUF]
    .venv/bin/python scripts/avx2_compare.py            # asyncpage's figures alone

Some machines of the kind the figures are taken on have AVX2 and no AVX-512 (no VNNI, no native bf16). On one that
has them, this runs what such a machine would: the native kernels built for Haswell (`-march=haswell` in place of
`-march=native`, so no AVX-512 code is compiled), the block kernels' AVX2 form (ASYNCPAGE_GGUF_FORM=avx2), torch's
kernels held to AVX2 (ATEN_CPU_CAPABILITY=avx2, and its GEMM libraries: MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA),
and no native bf16, so `dtype="auto"` picks float32 as it does
there. llama.cpp's side: built with `-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
-DGGML_BMI2=ON -DGGML_AVX512=OFF` (docs/performance.md). The same figures as `asyncpage bench --llama-bench`: one
stream, prefill of 512 tokens, mixed-32, resident memory after load (64 MiB KV pool), load time. Memory bandwidth,
caches and clocks stay this machine's: an emulation of the instruction set, not of another CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from typing import Any


def emulate_avx2() -> None:
    """In this process, before the engine loads: what an AVX2-only CPU gives asyncpage (see the module doc)."""
    os.environ["ASYNCPAGE_GGUF_FORM"] = "avx2"
    os.environ["ATEN_CPU_CAPABILITY"] = "avx2"  # read when torch loads its kernels
    os.environ["MKL_ENABLE_INSTRUCTIONS"] = "AVX2"  # torch's float32 GEMM (MKL) would still pick AVX-512 / AMX
    os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"
    import torch

    torch.cpu._is_avx512_bf16_supported = lambda: False  # type: ignore[attr-defined]
    from asyncpage.model import native

    native.FLAGS = tuple("-march=haswell" if f == "-march=native" else f for f in native.FLAGS)
    native.SERIAL_FLAGS = tuple("-march=haswell" if f == "-march=native" else f for f in native.SERIAL_FLAGS)


def child(model: str | None, part: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", part] + (["--model", model] if model else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"asyncpage ({part}) failed:\n{proc.stderr[-2000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    ap.add_argument("--llama-bench", default=None)
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        emulate_avx2()
        from asyncpage.bench import cpu_path

        print(json.dumps(asyncio.run(cpu_path._child(args.model, "defaults", args.child, None))))
        return 0
    from asyncpage.bench import cpu_path

    ours = child(args.model, "single")
    ours["mixed_tok_s"] = child(args.model, "mixed")["mixed_tok_s"]
    print(f"asyncpage, AVX2 emulated: {json.dumps(ours)}", flush=True)
    if not args.llama_bench:
        return 0
    source = str(ours["source"])
    threads = len(os.sched_getaffinity(0))
    theirs: dict[str, Any] = cpu_path.run_llama_bench(args.llama_bench, source, threads)
    if args.llama_server:
        from asyncpage.model.weights import load_tokenizer

        tok, config, _ = load_tokenizer(source)
        theirs.update(asyncio.run(cpu_path.llama_server_figures(args.llama_server, source, threads, config.vocab_size,
                                                                tok.bos_token_id)))
    print(f"llama.cpp, AVX2 build: {json.dumps(theirs)}")
    for key in ("single_tok_s", "prefill_tok_s", "mixed_tok_s", "rss_mib", "load_s"):
        if key in ours and theirs.get(key):
            print(f"{key:>14}: {ours[key]:9.1f} vs {theirs[key]:9.1f}  ({ours[key] / theirs[key]:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
