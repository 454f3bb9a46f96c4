"""The engine loop's two per-step savings, on and off in one process, taking turns: bursts (runs of plain steps
committed on the compute thread, asyncpage/core/burst.py) and the LM head's own greedy search (the block kernel
finds each row's maximum as it writes the logits, GGUFLinear.with_max). One stream (200 greedy tokens, decode
tok/s as the reader sees it) and the 32-request mixed workload (`asyncpage bench`'s, tok/s), default model.

    python scripts/step_ab.py [--rounds 6] [--mixed-rounds 2]

Prints each setting's runs and median, and each setting's ratio to "neither" run by run (this VM's speed drifts
by ~15% within minutes: only the settings' turns within one process compare).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from asyncpage import AsyncEngine, SamplingParams
from asyncpage.bench.throughput import make_workload, run_engine

SETTINGS = {"neither": (False, False), "bursts": (True, False), "bursts + head search": (True, True)}


def use(engine: AsyncEngine, bursts: bool, head_search: bool, real: Any) -> None:
    engine._core.BURSTS = bursts
    model = engine.model
    model.compute_logits_max = real if head_search else (lambda h: (model.compute_logits(h), None))


async def one_stream(engine: AsyncEngine, prompt: list[int]) -> float:
    start, n = None, 0
    async for chunk in engine.stream(prompt, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)):
        start = start or time.perf_counter()
        n += len(chunk.token_ids)
    assert start is not None
    return (n - 1) / (time.perf_counter() - start)


def report(title: str, res: dict[str, list[float]]) -> None:
    print(title)
    for name, xs in res.items():
        print(f"  {name:22} {' '.join(f'{x:7.1f}' for x in xs)}   median {statistics.median(xs):.1f}")
    for name in list(res)[1:]:
        r = [a / b for a, b in zip(res[name], res["neither"], strict=True)]
        print(f"  {name:22} / neither: median {statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f})")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--mixed-rounds", type=int, default=2)
    args = ap.parse_args()
    engine = AsyncEngine.from_pretrained()
    real = engine.model.compute_logits_max
    bos = engine.tokenizer.bos_token_id
    prompt = make_workload("single", 1, engine.vocab_size, bos)[0].prompt
    single: dict[str, list[float]] = {name: [] for name in SETTINGS}
    mixed: dict[str, list[float]] = {name: [] for name in SETTINGS}
    async with engine:
        await run_engine(engine, make_workload("mixed", 32, engine.vocab_size, bos, 0), "mixed-32", False)  # warm
        for rnd in range(max(args.rounds, args.mixed_rounds)):
            turns = list(SETTINGS.items()) if rnd % 2 == 0 else list(reversed(SETTINGS.items()))
            for name, (bursts, head) in turns:
                use(engine, bursts, head, real)
                if rnd < args.rounds:
                    single[name].append(await one_stream(engine, prompt))
                if rnd < args.mixed_rounds:
                    items = make_workload("mixed", 32, engine.vocab_size, bos, 0)
                    mixed[name].append((await run_engine(engine, items, "mixed-32", False)).throughput_tok_s)
    report("one stream, decode tok/s", single)
    if args.mixed_rounds:
        report("32 requests, mixed, tok/s", mixed)


if __name__ == "__main__":
    asyncio.run(main())
