"""GPU check (CUDA machine): the engine on the default model with the torch and the Triton attention
backends (same greedy tokens), a decode-attention micro-benchmark (achieved GB/s) and the engine's
throughput. Run by scripts/gpu_check.sh after the kernel tests; prints figures, asserts only that
the two backends agree."""

from __future__ import annotations

import asyncio
import time

import torch

from asyncpage import AsyncEngine, SamplingParams
from asyncpage.bench.throughput import make_workload, run_engine


def decode_attention_bandwidth() -> None:
    from asyncpage.kernels.attention_kernels import paged_decode

    b, h, kvh, d, bs, ctx = 64, 4, 1, 256, 16, 2048
    nb = ctx // bs
    k = torch.randn(b * nb + 1, bs, kvh, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(b, h, d, device="cuda", dtype=torch.bfloat16)
    bt = torch.randperm(b * nb, device="cuda").view(b, nb)
    lens = torch.full((b,), ctx, device="cuda", dtype=torch.int64)
    for _ in range(3):
        paged_decode(q, k, v, bt, lens, d**-0.5, None)
    torch.cuda.synchronize()
    t = time.perf_counter()
    n = 50
    for _ in range(n):
        paged_decode(q, k, v, bt, lens, d**-0.5, None)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / n
    moved = 2 * b * ctx * kvh * d * 2  # K and V, bf16
    print(f"paged decode attention: batch {b}, context {ctx}, head dim {d}: {dt * 1e6:.0f} us, "
          f"{moved / dt / 1e9:.0f} GB/s")


async def engines() -> None:
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        engine = AsyncEngine.from_pretrained(dtype="float32", device="cuda", attention_backend=backend)
        async with engine:
            outs[backend] = [(await engine.generate(p, params)).token_ids for p in prompts]
    same = outs["torch"] == outs["triton"]
    print(f"torch vs triton attention, float32 greedy, 3 prompts x 32 tokens: {'same' if same else 'DIFFERENT'}")
    engine = AsyncEngine.from_pretrained(dtype="bfloat16", device="cuda")
    async with engine:
        items = make_workload("mixed", 64, engine.vocab_size, engine.tokenizer.bos_token_id)
        await run_engine(engine, items[:4], "warmup", progress=False)
        r = await run_engine(engine, items, "mixed", progress=False)
    print(f"engine (triton, bf16) mixed x64: {r.throughput_tok_s:.0f} tok/s, TTFT p50 {r.ttft_p50_ms:.0f} ms, "
          f"ITL p50 {r.itl_p50_ms:.1f} ms")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    decode_attention_bandwidth()
    asyncio.run(engines())
