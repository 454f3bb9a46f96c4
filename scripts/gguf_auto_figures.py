"""Figures for `quantization="auto"` (issue 33, stage 2), one setting per fresh process: resident memory
after load with a 64 MiB KV pool, one-stream greedy decode tok/s (128 tokens, warm), prefill of a
512-token prompt (tok/s, warm, prefix caching off so it is computed), and the greedy tokens of a few
prompts (for agreement between settings). Prints one JSON line.

    flock /tmp/ap-test.lock python scripts/gguf_auto_figures.py auto      # or none, int4, int8
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three laws of robotics are",
           "Water boils at", "In 1969, the first"]


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def _run(engine: object, out: dict[str, object]) -> None:
    from asyncpage import SamplingParams

    eng: object = engine
    async with eng as e:  # type: ignore[attr-defined]
        greedy = SamplingParams(max_tokens=32, temperature=0.0)
        out["greedy"] = [(await e.generate(p, greedy)).token_ids for p in PROMPTS]
        decode = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
        await e.generate("Warm up", SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        best = 0.0
        for _ in range(2):
            t0 = time.perf_counter()
            r = await e.generate("Tell me a story about a dragon.", decode)
            best = max(best, len(r.token_ids) / (time.perf_counter() - t0))
        out["decode_tok_s"] = round(best, 1)
        tok = e.tokenizer
        text = " ".join(f"Sentence number {i} talks about a different topic than the one before." for i in range(80))
        ids = tok(text)["input_ids"][:512]
        one = SamplingParams(max_tokens=1, temperature=0.0)
        await e.generate(ids[:64], one)
        best = 0.0
        for i in range(3):
            prompt = [ids[0], 100 + i, *ids[2:]]  # a different second token: no cached prefix
            t0 = time.perf_counter()
            await e.generate(prompt, one)
            best = max(best, len(prompt) / (time.perf_counter() - t0))
        out["prefill512_tok_s"] = round(best, 1)


def main() -> None:
    from asyncpage import AsyncEngine

    setting = sys.argv[1]
    q = None if setting == "none" else setting
    t0 = time.perf_counter()
    engine = AsyncEngine.from_pretrained(quantization=q, kv_cache_memory=64 << 20, enable_prefix_caching=False)
    out: dict[str, object] = {"setting": setting, "load_s": round(time.perf_counter() - t0, 1),
                              "rss_after_load_mib": round(_rss_mib(), 1)}
    asyncio.run(_run(engine, out))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
