"""A one-byte KV pool under pressure, on the real default model: what the pool holds at equal
memory, and the 27-stream pressure workload (tests/test_pressure_default_model.py: the 9 reference
prompts three times, 48 greedy tokens each, on 80 blocks of 16, so streams are preempted and
recomputed) with each KV dtype, its tokens counted against transformers' float32 ones (up to each
stream's first difference) and against the unquantized pool's.

    python scripts/kv_pressure.py [--dtype float32] [--kv int8,fp8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import torch

from asyncpage import AsyncEngine, SamplingParams
from asyncpage.bench.quality import agreeing_prefix
from asyncpage.core.runner import kv_bytes_per_block

REFERENCE = Path(__file__).parents[1] / "tests/data/gemma3_270m_reference.json"


async def _pressure(engine: AsyncEngine, cases: list[dict[str, Any]], new_tokens: int) -> tuple[list[list[int]], int]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    async with engine:
        outs = await asyncio.gather(*(engine.generate(c["prompt_token_ids"], params) for c in cases))
        preemptions = engine.stats().num_preemptions
    return [o.token_ids for o in outs], preemptions


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv", default="int8,fp8")
    args = ap.parse_args(argv)
    reference = json.loads(REFERENCE.read_text())
    cases = reference["cases"] * 3
    base = AsyncEngine.from_pretrained(dtype=args.dtype, max_num_batched_tokens=256)
    model, block = base.model, 16
    bf16 = kv_bytes_per_block(model, block, torch.bfloat16)
    rows = []
    plain: list[list[int]] | None = None
    for kv in ["auto", *[k.strip() for k in args.kv.split(",") if k.strip()]]:
        engine = base.clone(num_kv_blocks=80, block_size=block, max_num_batched_tokens=256, kv_cache_dtype=kv)
        pool = getattr(torch, engine.config.kv_cache_dtype or engine.config.dtype)
        per_block = kv_bytes_per_block(model, block, pool)
        outs, preemptions = asyncio.run(_pressure(engine, cases, reference["new_tokens"]))
        plain = plain if plain is not None else outs
        vs_ref = sum(agreeing_prefix(o, c["greedy_token_ids"]) for o, c in zip(outs, cases, strict=True))
        vs_plain = sum(agreeing_prefix(o, p) for o, p in zip(outs, plain, strict=True))
        same = sum(o == p for o, p in zip(outs, plain, strict=True))
        rows.append((kv, bf16 / per_block, len(outs), preemptions, vs_ref, vs_plain, same))
    total = len(cases) * reference["new_tokens"]
    print(f"\n27 streams x {reference['new_tokens']} tokens on 80 blocks of {block}, {args.dtype} weights")
    print(f"{'KV pool':<8} {'tokens/bfloat16 at equal memory':>32} {'done':>5} {'preemptions':>12} "
          f"{'= transformers':>15} {'= unquantized pool':>19} {'streams identical':>18}")
    for kv, capacity, done, pre, vs_ref, vs_plain, same in rows:
        print(f"{kv:<8} {capacity:>31.2f}x {done:>5} {pre:>12} {vs_ref:>8}/{total} {vs_plain:>12}/{total} "
              f"{same:>15}/{len(cases)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
