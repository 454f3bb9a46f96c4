"""GPU engine check on tiny random models (the default model's GGUF cannot travel to the GPU machine).

For each tiny architecture (built by tests/conftest.py's build_tiny: random weights, a BPE tokenizer
trained on the spot), the same prompts are generated greedily (float32) by four engines:

    torch            attention_backend="torch"
    triton           attention_backend="triton"
    torch+ngram      attention_backend="torch",  speculative_config={"method": "ngram"}
    triton+ngram     attention_backend="triton", speculative_config={"method": "ngram"}

and every engine's tokens are compared with the torch engine's (and with transformers' own greedy tokens
on the CPU, float32, as a reference). Where two token lists part, transformers' logits at that point
tell whether it is a near-tie (the two tokens' logits within TIE of each other: a rounding difference,
TF32 dot products in the Triton kernels, another GEMM shape) or a real disagreement. Exit status 1 only
for a real disagreement (or an exception); near-ties are printed, not failed.

Usage:  python3 .gpu/engine_check.py                 (CUDA: all four engines)
        python3 .gpu/engine_check.py --cpu           (CPU, torch backend only: a local dry run)
        python3 .gpu/engine_check.py --cpu --interpret  (CPU, Triton under its interpreter too; slow)
Options: --archs llama,gemma3  --max-tokens 48  --json PATH  --bf16 (an informational bfloat16 pass)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())  # .gpu/ or scripts/

ap = argparse.ArgumentParser()
ap.add_argument("--cpu", action="store_true", help="run on the CPU (a local dry run of this script)")
ap.add_argument("--interpret", action="store_true", help="with --cpu: the triton backend under TRITON_INTERPRET=1")
ap.add_argument("--archs", default="llama,gemma3,qwen3,mistral,qwen2")
ap.add_argument("--max-tokens", type=int, default=48)
ap.add_argument("--bf16", action="store_true", help="also a bfloat16 torch-vs-triton pass (informational only)")
ap.add_argument("--json", default=None, help="write the results here as JSON")
ap.add_argument("--budget-s", type=float, default=170.0, help="skip what is left after this many seconds")
ARGS = ap.parse_args()

if ARGS.cpu and ARGS.interpret:
    os.environ["TRITON_INTERPRET"] = "1"  # before asyncpage.kernels is imported (@triton.jit reads it then)

sys.path.insert(0, str(ROOT))  # tests.conftest (build_tiny)

import torch  # noqa: E402

from asyncpage import AsyncEngine, SamplingParams  # noqa: E402
from tests.conftest import build_tiny  # noqa: E402

T0 = time.perf_counter()
# Logit gap (transformers, float32) under which a parting is called a near-tie. The tiny random models'
# logits have a std of ~0.17 and a median top-2 gap of ~3e-2 (min ~3e-4 over 62 positions), so partings
# from rounding (TF32 in the Triton kernels: ~1e-3 relative in attention, ~1e-4 absolute in the logits)
# do happen; a real bug (a wrong mask, block or position) moves logits by ~0.1.
TIE = 2e-3
DEVICE = "cpu" if ARGS.cpu else "cuda"
BACKENDS = ["torch"] + (["triton"] if (not ARGS.cpu or ARGS.interpret) else [])
CONFIGS = [(b, None) for b in BACKENDS] + [(b, "ngram") for b in BACKENDS]
PROMPTS = [
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16",
    "The quick brown fox jumps over the lazy dog. " * 6,  # past a block and the sliding window
    "def add(a, b):\n    return a + b\n" * 3,
    "Paged attention keeps the KV cache in fixed-size blocks mapped by block tables. " * 4,  # chunked prefill
]


def elapsed() -> str:
    return f"[{time.perf_counter() - T0:6.1f}s]"


def name(backend: str, spec: str | None) -> str:
    return backend + (f"+{spec}" if spec else "")


def hf_greedy(model: Any, prompt_ids: list[int], n: int) -> list[int]:
    """transformers' own greedy tokens (float32, CPU, the whole sequence each step: no cache API to depend
    on across transformers versions), EOS ignored like the engines'."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


def hf_gap(model: Any, prompt_ids: list[int], prefix: list[int], a: int, b: int) -> tuple[float, float, float]:
    """transformers' logit gap between tokens a and b after prompt + prefix, its top-2 gap and logit std there."""
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt_ids) + list(prefix)]), use_cache=False).logits[0, -1].float()
    top2 = logits.topk(2).values
    return abs(float(logits[a] - logits[b])), float(top2[0] - top2[1]), float(logits.std())


def compare(model: Any, prompt_ids: list[list[int]], ref: list[list[int]], got: list[list[int]]) -> dict[str, Any]:
    """Per prompt: same / first parting index and its kind."""
    same, ties, real, notes = 0, 0, 0, []
    for p, (r, g) in enumerate(zip(ref, got, strict=True)):
        if r == g:
            same += 1
            continue
        i = next((k for k in range(min(len(r), len(g))) if r[k] != g[k]), min(len(r), len(g)))
        if i >= min(len(r), len(g)):
            real += 1
            notes.append(f"prompt {p}: lengths {len(r)} vs {len(g)}")
            continue
        gap, top2, std = hf_gap(model, prompt_ids[p], r[:i], r[i], g[i])
        kind = "near-tie" if gap < TIE else "REAL"
        ties += kind == "near-tie"
        real += kind == "REAL"
        notes.append(f"prompt {p}: parts at token {i} ({r[i]} vs {g[i]}), transformers' logit gap "
                     f"{gap:.2e} (top-2 gap {top2:.2e}, logit std {std:.2f}; near-tie below {TIE:.0e}): {kind}")
    return {"same": same, "near_ties": ties, "real": real, "notes": notes}


async def run_engine(path: Path, backend: str, spec: str | None, dtype: str) -> dict[str, Any]:
    t = time.perf_counter()
    engine = AsyncEngine.from_pretrained(
        str(path), dtype=dtype, device=DEVICE, attention_backend=backend, block_size=16, num_kv_blocks=128,
        max_num_batched_tokens=64, debug_checks=True,
        speculative_config={"method": spec} if spec else None)
    assert engine.config.attention_backend == backend and engine.config.device == DEVICE, engine.config
    load_s = time.perf_counter() - t
    params = SamplingParams(max_tokens=ARGS.max_tokens, temperature=0, ignore_eos=True)
    async with engine:
        t = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS))
        gen_s = time.perf_counter() - t
        st = engine.stats()
    return {
        "tokens": [o.token_ids for o in outs],
        "prompt_ids": [o.prompt_token_ids for o in outs],
        "load_s": load_s, "gen_s": gen_s,
        "spec_proposed": sum(o.metrics.spec_proposed_tokens for o in outs),
        "spec_accepted": sum(o.metrics.spec_accepted_tokens for o in outs),
        "leaked_blocks": st.kv_blocks_used, "engine_error": st.engine_error,
    }


async def check_arch(arch: str, root: Path, results: dict[str, Any]) -> bool:
    path = root / arch
    model = build_tiny(arch, path)
    ok = True
    res: dict[str, Any] = results.setdefault(arch, {})
    runs: dict[str, dict[str, Any]] = {}
    for backend, spec in CONFIGS:
        n = name(backend, spec)
        try:
            runs[n] = r = await run_engine(path, backend, spec, "float32")
        except Exception as exc:
            traceback.print_exc()
            print(f"{elapsed()} {arch:8s} {n:13s} FAILED: {type(exc).__name__}: {exc}")
            res[n] = {"error": f"{type(exc).__name__}: {exc}"}
            ok = False
            continue
        ntok = sum(len(t) for t in r["tokens"])
        spec_s = (f", drafts kept {r['spec_accepted']}/{r['spec_proposed']}" if spec else "")
        print(f"{elapsed()} {arch:8s} {n:13s} load {r['load_s']:.2f}s, {len(PROMPTS)} prompts x "
              f"{ARGS.max_tokens} tokens in {r['gen_s']:.2f}s ({ntok / r['gen_s']:.0f} tok/s){spec_s}")
        if r["leaked_blocks"] or r["engine_error"]:
            print(f"    !! blocks still used after the run: {r['leaked_blocks']}, engine error: {r['engine_error']}")
            ok = False
        res[n] = {k: v for k, v in r.items() if k != "prompt_ids"}
    base = runs.get("torch")
    if base is None:
        return False
    prompt_ids = base["prompt_ids"]
    ref = [hf_greedy(model, ids, ARGS.max_tokens) for ids in prompt_ids]
    res["transformers_cpu"] = {"tokens": ref}
    for n, r in [("torch", base), *[(k, v) for k, v in runs.items() if k != "torch"]]:
        against = [("transformers(cpu)", ref)] + ([("torch", base["tokens"])] if n != "torch" else [])
        for label, target in against:
            c = compare(model, prompt_ids, target, r["tokens"])
            res[n][f"vs_{label}"] = c
            verdict = "SAME" if c["same"] == len(PROMPTS) else ("NEAR-TIE ONLY" if not c["real"] else "DIFFERENT")
            print(f"    {arch:8s} {n:13s} vs {label:17s}: {c['same']}/{len(PROMPTS)} prompts identical"
                  f" -> {verdict}")
            for note in c["notes"]:
                print(f"        {note}")
            if c["real"]:
                ok = False
    if ARGS.bf16 and not ARGS.cpu and time.perf_counter() - T0 < ARGS.budget_s:
        bf = {}
        for backend in BACKENDS:
            try:
                bf[backend] = await run_engine(path, backend, None, "bfloat16")
            except Exception as exc:
                print(f"    {arch:8s} bfloat16 {backend} FAILED: {type(exc).__name__}: {exc}")
        if len(bf) == 2:
            same = sum(a == b for a, b in zip(bf["torch"]["tokens"], bf["triton"]["tokens"], strict=True))
            agree = [sum(x == y for x, y in zip(a, b, strict=False)) / max(1, len(a))
                     for a, b in zip(bf["torch"]["tokens"], bf["triton"]["tokens"], strict=True)]
            print(f"    {arch:8s} bfloat16 torch vs triton (informational): {same}/{len(PROMPTS)} prompts identical, "
                  f"position-wise agreement {', '.join(f'{a:.0%}' for a in agree)}")
            res["bfloat16"] = {"identical_prompts": same, "agreement": agree}
    return ok


async def main() -> int:
    print(f"torch {torch.__version__}, device {DEVICE}"
          + (f" ({torch.cuda.get_device_name(0)})" if DEVICE == "cuda" else "")
          + f", engines: {', '.join(name(b, s) for b, s in CONFIGS)}; float32 greedy, {len(PROMPTS)} prompts "
          f"x {ARGS.max_tokens} tokens, block_size 16, max_num_batched_tokens 64 (chunked prefill)")
    try:
        import triton
        print(f"triton {triton.__version__}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}")
    except Exception as exc:
        print(f"triton not importable: {exc}")
    results: dict[str, Any] = {"device": DEVICE, "tie_threshold": TIE, "archs": {}}
    all_ok = True
    skipped = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARGS.archs.split(","):
            if time.perf_counter() - T0 > ARGS.budget_s:
                skipped.append(arch)
                continue
            try:
                ok = await check_arch(arch, Path(tmp), results["archs"])
            except Exception as exc:
                traceback.print_exc()
                print(f"{elapsed()} {arch}: FAILED: {type(exc).__name__}: {exc}")
                ok = False
            all_ok &= ok
            print(f"{elapsed()} {arch}: {'OK' if ok else 'FAILED'}")
    if skipped:
        print(f"skipped (past the {ARGS.budget_s:.0f}s budget): {', '.join(skipped)}")
    results["ok"] = all_ok
    results["skipped"] = skipped
    if ARGS.json:
        Path(ARGS.json).write_text(json.dumps(results, indent=1))
    verdict = "FAIL" if not all_ok else "PARTIAL" if skipped else "PASS"
    print(f"{elapsed()} ENGINE CHECK: {verdict} "
          f"(archs {', '.join(a for a in ARGS.archs.split(',') if a not in skipped)})")
    return 0 if verdict == "PASS" else 1  # a model skipped for time is not a pass


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
