"""`asyncpage bench --settings float32,int8,int4,...`: the same workload under several weight / KV
settings, one engine at a time, printed side by side with float32 (the first setting is the base of
the ratios); `--baseline llama.cpp` adds llama-cpp-python on the same GGUF in the same run,
`--baseline llama-server` llama.cpp's C++ server with one slot per request (bench_llama_server.py).

A setting is a dtype (`float32`, `bfloat16`, `float16`, `auto`: weights dequantized, `quantization=None`)
or a weight quantization (`int8`, `int4`: float weights written as GGUF blocks at load, a GGUF's own kept;
`gguf` = `quantization="auto"`, a GGUF's own blocks, float weights float: dtype "auto" for the activations;
`int4:float32` names the dtype), optionally `+kv=int8` /
`+kv=fp8` for the KV pool and `+compile` for compiled decode layers (`compile=True`).
"""

from __future__ import annotations

import gc
import sys
import time
from typing import Any

from asyncpage.bench.throughput import BenchResult, Item, format_result, make_workload, run_engine
from asyncpage.core.config import KV_CACHE_DTYPES, resolve_dtype
from asyncpage.errors import InvalidRequestError

# int8 / int4 change a float checkpoint's weights (--model DIR); a GGUF keeps its own blocks under them, as `gguf`.
DEFAULT_SETTINGS = "float32,bfloat16,gguf,gguf+kv=int8"


def parse_setting(s: str) -> dict[str, Any]:
    """from_pretrained's options for one setting; a suffix other than +compile / +kv=X is refused."""
    weights, *extras = s.split("+")
    opts: dict[str, Any] = {"kv_cache_dtype": "auto"}
    for extra in extras:
        if extra == "compile":
            opts["compile"] = True
        elif extra.startswith("kv=") and extra[3:]:
            opts["kv_cache_dtype"] = extra[3:]
        else:
            raise InvalidRequestError("settings", f"{s!r}: unknown suffix +{extra} (+compile, +kv=int8 or +kv=fp8)")
    weights, colon, dtype = weights.partition(":")
    if weights in ("int8", "int4"):
        opts.update(quantization=weights, dtype=dtype or "auto")
    elif weights == "gguf":  # quantization="auto": a GGUF's own blocks, the only copy
        opts.update(quantization="auto", dtype=dtype or "auto")
    elif colon:  # "float32:int8" would otherwise run unquantized float32 under that label
        raise InvalidRequestError("settings", f"{s!r}: QUANT:DTYPE takes int8, int4 or gguf before the colon")
    else:
        opts.update(quantization=None, dtype=weights)
    # Checked here, with from_pretrained's own rules, so a bad one is refused before any model loads.
    if opts["dtype"] != "auto":
        resolve_dtype(opts["dtype"], "cpu")
    if opts["kv_cache_dtype"] not in KV_CACHE_DTYPES:
        raise InvalidRequestError("settings", f"{s!r}: +kv= takes {', '.join(KV_CACHE_DTYPES[1:])}")
    return opts


async def compare_settings(args: Any) -> int:
    from asyncpage import AsyncEngine

    settings = [s.strip() for s in (args.settings or DEFAULT_SETTINGS).split(",") if s.strip()]
    try:
        parsed = {s: parse_setting(s) for s in settings}  # a bad one is refused before any model loads
    except InvalidRequestError as exc:
        print(f"asyncpage bench: {exc}", file=sys.stderr)
        return 2
    server_bin = None
    if args.baseline == "llama-server":
        from asyncpage.bench.llama_server import LlamaServerError, find_llama_server

        try:
            server_bin = find_llama_server(getattr(args, "llama_server", None))
        except LlamaServerError as exc:
            print(f"asyncpage bench: {exc}", file=sys.stderr)
            return 2
    rows: list[tuple[str, BenchResult, float]] = []
    items: list[Item] | None = None
    source = None
    for s in settings:
        opts = parsed[s]
        t0 = time.perf_counter()
        engine = AsyncEngine.from_pretrained(
            args.model, device=args.device, num_threads=args.threads, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
            enable_prefix_caching=not args.no_prefix_caching, **opts)
        load_s = time.perf_counter() - t0
        source = engine.model_source
        bos = engine.tokenizer.bos_token_id
        if items is None:
            items = make_workload(args.workload, args.num_requests, engine.vocab_size, bos, args.seed)
        async with engine:
            await run_engine(engine, make_workload("single", 1, engine.vocab_size, bos, 99)[:1], "warmup", False)
            res = await run_engine(engine, items, args.workload)
        res.engine = f"asyncpage {s}"
        print(format_result(res), flush=True)
        rows.append((s, res, load_s))
        del engine
        gc.collect()
    assert items is not None and source is not None
    base = rows[0][1].throughput_tok_s
    extra: list[tuple[str, BenchResult]] = []
    if args.baseline == "llama.cpp":
        lc = run_llama_cpp(source, items, args.threads)
        if lc is not None:
            print(format_result(lc), flush=True)
            extra.append(("llama.cpp", lc))
    if server_bin is not None:
        from asyncpage.bench.llama_server import LlamaServerError, run_llama_server

        try:
            ls = await run_llama_server(server_bin, source, items, args.threads)
            ls.workload = args.workload
            print(format_result(ls), flush=True)
            extra.append(("llama-server", ls))
        except LlamaServerError as exc:
            print(f"# --baseline llama-server: {exc}", file=sys.stderr)
    name = extra[0][0] if extra else ""
    print(f"\n{args.workload} workload, {len(items)} requests; ratios against {settings[0]}"
          + (f" and {name}" if extra else ""))
    print(f"{'setting':<22} {'tok/s':>8} {'ratio':>7} {'ITL p50':>9} {'TTFT p50':>9} {'load s':>7}"
          + (f" {'vs ' + name:>16}" if extra else ""))
    for s, r, load_s in rows + [(n, r, float("nan")) for n, r in extra]:
        line = (f"{s:<22} {r.throughput_tok_s:8.1f} {r.throughput_tok_s / base:6.2f}x "
                f"{_ms(r.itl_p50_ms):>9} {_ms(r.ttft_p50_ms):>9} {load_s:7.1f}")
        if extra:
            line += f" {r.throughput_tok_s / extra[0][1].throughput_tok_s:15.2f}x"
        print(line)
    return 0


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} ms"


def run_llama_cpp(model_path: str, items: list[Item], threads: int | None) -> BenchResult | None:
    """llama-cpp-python (an optional extra: `pip install llama-cpp-python`, built from source) on the
    same GGUF: one request after another, greedy, to each item's max_tokens (EOS ignored, as ours).
    In a child process of its own, as llama-bench would be: a crash inside llama.cpp (seen here: a
    segfault in llama_decode on this CPU) is reported instead of ending the bench. Its Python API has no
    batched server; llama-server's slots are measured outside (README)."""
    import importlib.util
    import json
    import os
    import subprocess

    if importlib.util.find_spec("llama_cpp") is None:
        print("# --baseline llama.cpp: llama-cpp-python is not installed (pip install llama-cpp-python; it "
              "builds from source, 10-20 minutes here); skipped", file=sys.stderr)
        return None
    if not model_path.endswith(".gguf"):
        print("# --baseline llama.cpp needs a .gguf model; skipped", file=sys.stderr)
        return None
    n_threads = threads or len(os.sched_getaffinity(0))
    job = json.dumps({"model": model_path, "threads": n_threads,
                      "items": [[it.prompt, it.max_tokens] for it in items]})
    proc = subprocess.run([sys.executable, "-m", "asyncpage.bench.quant"], input=job, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        print(f"# --baseline llama.cpp: llama-cpp-python failed (exit {proc.returncode}): "
              f"{proc.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    return BenchResult(workload="", engine=f"llama.cpp (llama-cpp-python, {n_threads} threads)", dtype="gguf",
                       num_requests=len(items), output_tokens=r["out"],
                       prompt_tokens=sum(len(it.prompt) for it in items), wall_s=r["wall"],
                       throughput_tok_s=r["out"] / r["wall"], ttft_p50_ms=r["ttft_p50"] * 1e3,
                       itl_p50_ms=r["itl_p50"] * 1e3 if r["itl_p50"] is not None else None)


def _llama_child() -> None:
    """The child side of run_llama_cpp: a job on stdin, one JSON line of figures on stdout."""
    import json

    from llama_cpp import Llama

    job = json.loads(sys.stdin.read())
    items = [(p, m) for p, m in job["items"]]
    ctx = max(len(p) + m for p, m in items) + 8
    llm = Llama(model_path=job["model"], n_ctx=ctx, n_threads=job["threads"], n_threads_batch=job["threads"],
                verbose=False)
    _llama_generate(llm, items[0][0][:8], 4)  # warm-up, not counted
    ttfts: list[float] = []
    itls: list[float] = []
    out = 0
    t0 = time.perf_counter()
    for prompt, max_tokens in items:
        first, gaps, n = _llama_generate(llm, prompt, max_tokens)
        ttfts.append(first)
        itls += gaps
        out += n
    wall = time.perf_counter() - t0
    ttfts.sort()
    itls.sort()
    print(json.dumps({"out": out, "wall": wall, "ttft_p50": ttfts[len(ttfts) // 2],
                      "itl_p50": itls[len(itls) // 2] if itls else None}))


def _llama_generate(llm: Any, prompt: list[int], max_tokens: int) -> tuple[float, list[float], int]:
    t0 = time.perf_counter()
    last = t0
    first = 0.0
    gaps: list[float] = []
    n = 0
    for _tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        now = time.perf_counter()
        if n == 0:
            first = now - t0
        else:
            gaps.append(now - last)
        last = now
        n += 1
        if n >= max_tokens:
            break
    return first, gaps, n


if __name__ == "__main__":
    _llama_child()
