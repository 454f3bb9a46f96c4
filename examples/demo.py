"""`make demo`: stream one completion as it is generated, then a dozen concurrent requests, with
tokens/s and the KV pool's state."""

import asyncio
import time

from asyncpage import AsyncEngine, SamplingParams

QUESTIONS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Three facts about the Moon:\n1.",
    "A recipe for pancakes needs",
    "The largest planet in the solar system is",
    "Translate to French: Good morning, my friend.\nFrench:",
    "The three primary colors are",
    "Once upon a time, in a quiet town,",
    "Water boils at",
    "A haiku about autumn:\n",
    "The main ingredients of bread are",
    "import numpy as np\n# compute the mean of a list\n",
]


async def main() -> None:
    t0 = time.perf_counter()
    engine = AsyncEngine.from_pretrained()
    cfg = engine.config
    print(f"loaded {engine.model_source} in {time.perf_counter() - t0:.1f} s "
          f"[{cfg.dtype}, {cfg.num_threads} threads, KV pool {cfg.num_kv_blocks} blocks x {cfg.block_size} tokens]\n")
    async with engine:
        prompt = "Paged attention makes LLM serving efficient because"
        print(f"\033[1m{prompt}\033[0m", end="", flush=True)
        t = time.perf_counter()
        n = 0
        async for chunk in engine.stream(prompt, SamplingParams(max_tokens=64, temperature=0)):
            print(chunk.text, end="", flush=True)
            n += len(chunk.token_ids)
        print(f"\n\n[one stream: {n} tokens in {time.perf_counter() - t:.1f} s, "
              f"{n / (time.perf_counter() - t):.1f} tok/s]\n")

        params = SamplingParams(max_tokens=48, temperature=0.8, top_p=0.95, seed=1)
        t = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate(q, params) for q in QUESTIONS))
        dt = time.perf_counter() - t
        for q, o in zip(QUESTIONS, outs, strict=True):
            print(f"- {q!r} -> {o.text.strip()[:70]!r}")
        total = sum(len(o.token_ids) for o in outs)
        print(f"\n[{len(QUESTIONS)} concurrent requests: {total} tokens in {dt:.1f} s = {total / dt:.1f} tok/s; "
              f"median TTFT {sorted(o.metrics.ttft for o in outs)[len(outs) // 2] * 1000:.0f} ms]")
        st = engine.stats()
        print(f"[KV pool: {st.kv_blocks_used} used, {st.kv_blocks_cached} cached, {st.kv_blocks_free} free of "
              f"{st.kv_blocks_total}; {st.num_running} running, {st.num_waiting} waiting, "
              f"{st.num_preemptions} preemptions, {st.num_requests_finished} requests finished]")


if __name__ == "__main__":
    asyncio.run(main())
