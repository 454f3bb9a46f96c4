"""Issue 34's acceptance for sessions under load: a six-turn keyed conversation (cache_key) with a
long system prompt, on a 224-block pool, once alone and once while a low-priority background job fills the pool: an
`extract_many` job, 16 records at a time (`--job generate`: plain generate streams instead).
The turns run at priority -1 (what `service_tier="priority"` maps to), the job at 10.
Prints, per turn, prompt tokens, cached tokens and their share, time to first token alone and
under the job, and the ratio; turns 2-6 should show >= 80% cached and a TTFT ratio <= 2.5.

    OMP_NUM_THREADS=2 HF_HUB_OFFLINE=1 .venv/bin/python scripts/session_under_load.py [--model PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from asyncpage import AsyncEngine, SamplingParams

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                                               "required": ["city"]}}}]
SYSTEM = ("You are a careful support agent for a travel company. " + " ".join(
    f"Rule {i}: answer briefly, cite the booking reference, and never invent prices or dates." for i in range(60)))
QUESTIONS = ["What is the weather in Paris?", "And in Tokyo?", "Which is warmer?", "Should I pack a coat?",
             "What about Oslo?", "Summarise the three cities."]


async def turn(engine: AsyncEngine, msgs: list[dict[str, Any]], key: str) -> tuple[float, int, int, str]:
    t0 = time.perf_counter()
    ttft = None
    text: list[str] = []
    usage = None
    async for d in engine.chat_stream(msgs, tools=TOOLS, cache_key=key, priority=-1,
                                      params=SamplingParams(max_tokens=24, temperature=0.0)):
        if ttft is None and (d.content or d.reasoning or d.tool_call):
            ttft = time.perf_counter() - t0
        text.append(d.content or "")
        if d.usage is not None:
            usage = d.usage
    assert usage is not None
    first = ttft if ttft is not None else time.perf_counter() - t0
    return first, usage.prompt_tokens, usage.cached_tokens, "".join(text)


async def conversation(engine: AsyncEngine, key: str, gap: float) -> list[tuple[float, int, int]]:
    # The key opens the system prompt: each run's first turn starts cold (no other run's prefix).
    msgs: list[dict[str, Any]] = [{"role": "system", "content": f"[{key}] {SYSTEM}"}]
    out = []
    for q in QUESTIONS:
        msgs.append({"role": "user", "content": q})
        ttft, prompt, cached, text = await turn(engine, msgs, key)
        out.append((ttft, prompt, cached))
        msgs.append({"role": "assistant", "content": text or "OK."})
        await asyncio.sleep(gap)  # the tool running; the background job allocates meanwhile
    return out


TICKET = {"type": "object", "properties": {
    "customer": {"type": "string"}, "product": {"type": "string"},
    "severity": {"enum": ["low", "medium", "high", "critical"]}, "refund": {"type": "boolean"}},
    "required": ["customer", "product", "severity", "refund"], "additionalProperties": False}


def record(n: int) -> dict[str, Any]:
    return {"id": n, "text": f"Ticket {n}: customer Dana Whitfield{n} writes that the Acme Router X{n % 7} "
            f"stopped working after {n % 5 + 1} days. " + " ".join(
                f"Detail {j}: the light blinks {j * n % 9} times; case {n}-{j} was opened." for j in range(12))
            + " She asks for a refund."}


async def extract_job(engine: AsyncEngine, stop: asyncio.Event, width: int) -> int:
    async def records() -> Any:
        n = 0
        while not stop.is_set():
            yield record(n)
            n += 1

    done = 0
    async for _ in engine.extract_many(records(), TICKET, concurrency=width, copy_fields="auto", priority=10):
        done += 1
    return done


async def background(engine: AsyncEngine, stop: asyncio.Event, width: int) -> int:
    done = 0

    async def worker(i: int) -> None:
        nonlocal done
        n = i
        while not stop.is_set():
            prompt = f"Document {n}: " + " ".join(f"field{n}_{j} value {j * n}" for j in range(60)) + "\nSummary:"
            await engine.generate(prompt, SamplingParams(max_tokens=48, temperature=0.8, seed=n), priority=10)
            done += 1
            n += width

    await asyncio.gather(*(worker(i) for i in range(width)))
    return done


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--blocks", type=int, default=224)
    ap.add_argument("--gap", type=float, default=2.0)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--job", choices=["extract", "generate"], default="extract")
    a = ap.parse_args()
    async with AsyncEngine.from_pretrained(a.model, num_kv_blocks=a.blocks) as engine:
        await conversation(engine, "warmup", 0.0)  # grammar compiled, kernels warm
        alone = await conversation(engine, "alone", a.gap)
        stop = asyncio.Event()
        job = asyncio.create_task((extract_job if a.job == "extract" else background)(engine, stop, a.width))
        await asyncio.sleep(a.gap)
        loaded = await conversation(engine, "loaded", a.gap)
        stop.set()
        jobs_done = await job
    print(f"pool {a.blocks} blocks, background {a.job} job, {a.width} at a time at priority 10 "
          f"({jobs_done} {'records' if a.job == 'extract' else 'requests'} done)")
    print("turn  prompt  cached(alone)  cached(load) share(load)  ttft_alone_ms  ttft_load_ms  ratio")
    for i, ((ta, _, ca), (tl, pl, cl)) in enumerate(zip(alone, loaded, strict=True), 1):
        print(f"{i:4d}  {pl:6d}  {ca:13d}  {cl:12d}  {cl / pl:10.1%}  {ta * 1e3:13.0f}  {tl * 1e3:12.0f}"
              f"  {tl / ta:5.2f}")
    later = list(zip(alone[1:], loaded[1:], strict=True))
    share = sum(c for _, (_, _, c) in later) / sum(p for _, (_, p, _) in later)
    worst = max(tl / ta for (ta, _, _), (tl, _, _) in later)
    print(f"turns 2-6 under load: {share:.1%} cached (>= 80% wanted), worst TTFT ratio {worst:.2f} (<= 2.5 wanted)")


if __name__ == "__main__":
    asyncio.run(main())
