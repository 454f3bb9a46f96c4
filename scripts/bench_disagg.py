"""Disaggregated prefill/decode vs one engine: steady decodes while long prompts arrive.

    python scripts/bench_disagg.py                  # default model, float32; prints a Markdown table
    python scripts/bench_disagg.py --model DIR --decodes 4 --long-tokens 1600

Workload: `--decodes` streams with short prompts decode `--decode-tokens` tokens each; once they run,
`--longs` prompts of `--long-tokens` tokens arrive `--gap` s apart (max_tokens=4 each). Measured
from the caller: inter-token latency (gap between consecutive chunks) p50/p99 of the steady decodes,
TTFT of the long prompts, total generated tok/s over the run. Configurations, each in its own process
with its cores fixed by os.sched_setaffinity: one engine on core 0; one engine on cores 0-1; the
pair with prefill on core 0 and decode on core 1 (standing for two machines; the front end is
not pinned). Also: the KV transfer rate (bytes packed and sent / time, as the prefill side measured
it) next to this machine's memory bandwidth (a large tensor copy on one core).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

CONFIGS = {"single-1core": [0], "single-2cores": [0, 1], "split-1+1": None}


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def workload(engine: Any, tokenize: Any, a: argparse.Namespace) -> dict[str, Any]:
    from asyncpage import SamplingParams

    text = " ".join(f"Record {i}: the scheduler gives each running sequence one token per step." for i in range(400))
    long_ids = (await tokenize(text))[: a.long_tokens]
    gaps: list[float] = []
    ttfts: list[float] = []
    generated = 0
    started = asyncio.Event()

    async def decode(i: int) -> None:
        nonlocal generated
        params = SamplingParams(max_tokens=a.decode_tokens, temperature=0, ignore_eos=True)
        last = None
        async for chunk in engine.stream(f"Story {i}: once upon a time, in a small town by the sea,", params):
            now = time.perf_counter()
            generated += len(chunk.token_ids)
            if last is not None:
                gaps.append(now - last)
            else:
                started.set()
            last = now

    async def long_prompt(k: int) -> None:
        nonlocal generated
        await started.wait()
        await asyncio.sleep(a.warmup + k * a.gap)
        ids = [long_ids[0], *long_ids[1 + k :], *long_ids[1 : 1 + k]]  # rotated: no prefix-cache hit
        t0 = time.perf_counter()
        async for chunk in engine.stream(ids, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)):
            if chunk.token_ids and len(ttfts) <= k and t0:
                ttfts.append(time.perf_counter() - t0)
                t0 = 0.0
            generated += len(chunk.token_ids)

    t = time.perf_counter()
    await asyncio.gather(*(decode(i) for i in range(a.decodes)), *(long_prompt(k) for k in range(a.longs)))
    wall = time.perf_counter() - t
    return {"itl_p50_ms": 1e3 * _pct(gaps, 0.5), "itl_p99_ms": 1e3 * _pct(gaps, 0.99),
            "itl_max_ms": 1e3 * max(gaps), "ttft_long_s": statistics.mean(ttfts), "tok_s": generated / wall,
            "wall_s": wall, "long_prompt_tokens": len(long_ids)}


async def run_config(name: str, a: argparse.Namespace) -> dict[str, Any]:
    opts = dict(dtype=a.dtype, max_num_batched_tokens=a.batch_tokens)
    if CONFIGS[name] is not None:
        os.sched_setaffinity(0, CONFIGS[name])
        from asyncpage import AsyncEngine

        engine = AsyncEngine.from_pretrained(a.model, **opts)
        async with engine:
            await engine.generate("warm up", None)
            return await workload(engine, engine.tokenize, a)
    from asyncpage.disagg import DisaggEngine
    from asyncpage.model.weights import load_tokenizer

    tok = load_tokenizer(a.model)[0]
    pair = DisaggEngine.from_pretrained(a.model, prefill_cpus=[0], decode_cpus=[1], **opts)
    try:
        async with pair:
            await pair.generate("warm up", None)
            before = pair.transfer_stats()
            out = await workload(pair, lambda s: _tok(tok, s), a)
            after = pair.transfer_stats()
            nbytes, secs = after["bytes"] - before["bytes"], after["seconds"] - before["seconds"]
            out["kv_mb"] = nbytes / 1e6
            out["kv_mb_s"] = nbytes / 1e6 / secs if secs else float("nan")
            return out
    finally:
        pair.close()


async def _tok(tok: Any, s: str) -> list[int]:
    return list(tok(s)["input_ids"])


def memory_bandwidth_gb_s() -> float:
    """Read + write GB/s of a 512 MB tensor copy on one core."""
    import torch

    os.sched_setaffinity(0, [0])
    torch.set_num_threads(1)
    src = torch.ones(128 * 1024 * 1024, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    return 3 * 2 * src.numel() * 4 / (time.perf_counter() - t) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--decodes", type=int, default=4)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--longs", type=int, default=2)
    p.add_argument("--long-tokens", type=int, default=1600)
    p.add_argument("--gap", type=float, default=4.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--batch-tokens", type=int, default=512)
    p.add_argument("--config", choices=[*CONFIGS, "membw"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.config == "membw":
        print(json.dumps({"membw": memory_bandwidth_gb_s()}))
        return
    if a.config:
        print(json.dumps(asyncio.run(run_config(a.config, a))))
        return
    rows = {}
    for name in [*CONFIGS, "membw"]:
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--config", name], capture_output=True,
                             text=True, check=False)
        if out.returncode:
            sys.exit(f"{name} failed:\n{out.stderr[-3000:]}")
        rows[name] = json.loads(out.stdout.strip().splitlines()[-1])
    bw = rows.pop("membw")["membw"]
    n = rows["split-1+1"]["long_prompt_tokens"]
    print(f"{a.decodes} decodes x {a.decode_tokens} tokens; {a.longs} prompts of {n} tokens, {a.gap} s apart; "
          f"{a.dtype}, max_num_batched_tokens={a.batch_tokens}\n")
    print("| config | ITL p50 ms | ITL p99 ms | ITL max ms | TTFT long s | total tok/s |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['itl_p50_ms']:.0f} | {r['itl_p99_ms']:.0f} | {r['itl_max_ms']:.0f} | "
              f"{r['ttft_long_s']:.2f} | {r['tok_s']:.1f} |")
    s = rows["split-1+1"]
    print(f"\nKV transfer: {s['kv_mb']:.0f} MB at {s['kv_mb_s']:.0f} MB/s (pack + gloo send, measured on the "
          f"prefill side); memory bandwidth (copy, one core): {bw:.1f} GB/s "
          f"-> transfer at {100 * s['kv_mb_s'] / 1e3 / bw:.0f}% of it")


if __name__ == "__main__":
    main()
