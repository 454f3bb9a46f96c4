"""Time to the first token of a chat turn with tools against the same turn without, once the tool
grammar is cached (issue 34 item 7): the default model (gemma-3-270m GGUF, its shipped chat
template), three tools under tool_choice="auto", a conversation whose turns differ in their last
user message (the system prompt and the tools' prefix found in the prefix cache, as in an agent's
turns).

    OMP_NUM_THREADS=2 .venv/bin/python scripts/tool_ttft.py [--rounds 12] [--tools 3]

Each round runs, in turn order rotated round by round, to the first token of the turn (max_tokens 64,
the stream closed there):
  tools     prepare(..., tools, tool_choice="auto") (template, cached grammar text, tokenize) + submission
            (cached compile) + prefill + the first masked sample;
  no-tools  the same without tools: a shorter prompt (no tool instructions);
  same-ids  the tools turn prepared the same way, its prompt ids sent without the grammar: what the
            turn would cost if its grammar were free.
Prints the median of each, the ratios tools/no-tools and tools/same-ids, the first (cold) tools turn,
and the grammar caches' counts.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from asyncpage import AsyncEngine, SamplingParams
from asyncpage.chat import cache, prepare
from asyncpage.chat.messages import shipped_gemma3_template

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search_flights", "description": "Find flights between two airports on a date.",
        "parameters": {"type": "object", "properties": {
            "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "date": {"type": "string", "format": "date"},
            "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["origin", "destination", "date"]}}},
    {"type": "function", "function": {
        "name": "convert_currency", "description": "Convert an amount between currencies.",
        "parameters": {"type": "object", "properties": {
            "amount": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}},
            "required": ["amount", "from", "to"]}}},
]
SYSTEM = "You are a travel assistant. Use the tools when they help; answer briefly otherwise."
QUESTIONS = ["What's the weather like in Tokyo right now?", "Find me a flight from SFO to NRT on 2025-03-02.",
             "How much is 120 euros in yen?", "Say hello in one word.", "Is it raining in Oslo?",
             "Flights from LHR to JFK next Friday for two people?", "Convert 50 dollars to pounds.",
             "What should I pack for Lisbon in April?"]


def _msgs(i: int) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} "
                                                                                 f"(request {i})"}]


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--tools", type=int, default=3, help="how many of the three tools to offer")
    args = ap.parse_args()
    tools = TOOLS[: args.tools]
    engine = AsyncEngine.from_pretrained(chat_template=shipped_gemma3_template())
    one = SamplingParams(max_tokens=1, temperature=0)
    many = SamplingParams(max_tokens=64, temperature=0)
    async with engine:
        await engine.chat(_msgs(0), params=one)  # warm the model and the template
        t = time.perf_counter()
        await engine.chat(_msgs(1), tools=tools, params=one)
        cold = time.perf_counter() - t
        times: dict[str, list[float]] = {"tools": [], "no-tools": [], "same-ids": []}

        async def run(kind: str, i: int) -> None:
            # To the first token of a turn that may go on (max_tokens 64: max_tokens=1 would put budget
            # closing to work on the first token), then the stream is closed (the request aborted).
            t0 = time.perf_counter()
            turn = await prepare(engine, _msgs(i), tools=tools if kind != "no-tools" else None, params=many)
            params = turn.params if kind != "same-ids" else many  # same-ids: the tools turn, its grammar left out
            async with engine.stream(turn.prompt, params) as stream:
                async for _ in stream:
                    break
            times[kind].append(time.perf_counter() - t0)

        kinds = list(times)
        for r in range(args.rounds):
            for k in range(3):
                await run(kinds[(r + k) % 3], 100 + 3 * r + k)
        med = {k: statistics.median(v) * 1000 for k, v in times.items()}
        print(f"model {engine.model_source}  tools offered: {len(tools)}  rounds: {args.rounds}")
        print(f"first turn with tools (grammar built and compiled): {cold * 1000:.1f} ms")
        for k in kinds:
            lo, hi = min(times[k]) * 1000, max(times[k]) * 1000
            print(f"  {k:9s} median {med[k]:7.1f} ms   (min {lo:.1f}, max {hi:.1f})")
        print(f"ratio tools / no-tools: {med['tools'] / med['no-tools']:.3f}")
        print(f"ratio tools / same-ids (grammar's own cost): {med['tools'] / med['same-ids']:.3f}")
        # Free text under the auto grammar (every token masked) against the same prompt without it.
        free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        turn = await prepare(engine, _msgs(7), tools=tools, params=free)
        rates = {}
        for kind, params in (("auto grammar", turn.params), ("no grammar", free)):
            t0 = time.perf_counter()
            out = await engine.generate(turn.prompt, params)
            rates[kind] = len(out.token_ids) / (time.perf_counter() - t0)
        print("decode, 24 tokens of the same turn: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in rates.items()))
        print(f"turn grammar cache: {cache.stats(engine.tokenizer)}; compiled grammars cached: "
              f"{len(engine.guided._cache)}")


if __name__ == "__main__":
    asyncio.run(main())
