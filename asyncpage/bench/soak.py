"""`asyncpage soak`: thousands of requests with random params, random cancellations and abandoned
streams through the public API, then a verdict.

What it checks (and prints): every request that was not cancelled finished with "stop" or "length";
every output under a grammar satisfies it (regex, choice, JSON Schema via jsonschema); the pool ends
at 0 blocks used; RSS after the first quarter grows by less than `max_rss_growth`. What it prints
along the way: throughput, event-loop lag (p50 / p99), RSS over time, and the pool at the end.
Runs for minutes on the default model here, and for hours anywhere with `--requests`.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgspec

from asyncpage.engine import AsyncEngine
from asyncpage.errors import AsyncPageError
from asyncpage.params import SamplingParams

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "fox", "golf", "hotel", "the", "a", "of", "and")
STOPS = (".", "\n", " the", "ing", ", ")
GUIDES: list[dict[str, Any]] = [
    {"regex": r"[a-z]{1,8}( [a-z]{1,8}){0,3}"},
    {"choice": ["yes", "no", "maybe"]},
    {"json_schema": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                      "n": {"type": "integer", "minimum": 0, "maximum": 99}},
                     "required": ["name", "n"], "additionalProperties": False}},
    {"json_schema": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4}},
]


@dataclass
class SoakReport:
    requests: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    tokens: int = 0
    wall_s: float = 0.0
    lag_ms: list[float] = field(default_factory=list)
    rss_mb: list[tuple[int, float]] = field(default_factory=list)  # (requests done, MB)
    final_stats: Any = None
    rss_growth: float = 0.0

    def ok(self, max_rss_growth: float) -> bool:
        used = self.final_stats.kv_blocks_used if self.final_stats is not None else -1
        return not self.failures and used == 0 and self.rss_growth < max_rss_growth

    def lines(self) -> list[str]:
        lag = sorted(self.lag_ms) or [0.0]
        pct = lambda q: lag[min(len(lag) - 1, int(q * len(lag)))]  # noqa: E731
        st = self.final_stats
        return [
            f"requests: {self.requests} ({', '.join(f'{k} {v}' for k, v in sorted(self.outcomes.items()))})",
            f"throughput: {self.tokens / max(self.wall_s, 1e-9):.1f} generated tok/s over {self.wall_s:.1f} s",
            f"event-loop lag: p50 {pct(0.5):.1f} ms, p99 {pct(0.99):.1f} ms, max {lag[-1]:.1f} ms",
            "RSS (MB) by requests done: " + ", ".join(f"{n}: {mb:.0f}" for n, mb in self.rss_mb),
            f"RSS growth after the first quarter: {self.rss_growth * 100:+.2f}%",
            f"pool at the end: {st.kv_blocks_used} used, {st.kv_blocks_cached} cached, {st.kv_blocks_free} free "
            f"of {st.kv_blocks_total}; {st.num_running} running, {st.num_waiting} waiting; "
            f"{st.num_preemptions} preemptions",
            f"failures: {len(self.failures)}" + "".join(f"\n  {f}" for f in self.failures[:20]),
        ]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _random_request(rng: random.Random, max_tokens: int) -> tuple[str, SamplingParams]:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))
    kw: dict[str, Any] = dict(max_tokens=rng.randint(1, max_tokens), seed=rng.choice([None, rng.randint(0, 9)]))
    if rng.random() < 0.4:
        kw["temperature"] = 0.0
    else:
        kw.update(temperature=rng.choice([0.5, 1.0, 1.3]), top_k=rng.choice([0, 0, 5, 40]),
                  top_p=rng.choice([1.0, 0.9, 0.5]), min_p=rng.choice([0.0, 0.0, 0.05]))
    if rng.random() < 0.2:
        kw["n"] = rng.randint(2, 3)
    if rng.random() < 0.3:
        kw["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    if rng.random() < 0.15:
        kw["presence_penalty"] = rng.uniform(-1, 1)
        kw["repetition_penalty"] = rng.uniform(0.8, 1.3)
    if rng.random() < 0.1:
        kw["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.2:
        kw.update(rng.choice(GUIDES))
        kw.pop("stop", None)  # a stop string would cut a value short of its grammar
        kw["max_tokens"] = max(kw["max_tokens"], 48)
    return prompt, SamplingParams(**kw)


def _check_guided(params: SamplingParams, text: str, reason: str) -> str | None:
    if reason != "stop":
        return None  # cut at max_tokens: a prefix, not a value
    if params.regex is not None and not re.fullmatch(params.regex, text):
        return f"regex {params.regex!r} does not match {text!r}"
    if params.choice is not None and text not in params.choice:
        return f"{text!r} is not one of {params.choice}"
    if params.json_schema is not None:
        import jsonschema

        try:
            jsonschema.validate(json.loads(text), params.json_schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            return f"{text!r} is not valid: {str(exc)[:120]}"
    return None


async def soak(engine: AsyncEngine, num_requests: int = 2000, concurrency: int = 32, max_tokens: int = 24,
               seed: int = 0, progress: bool = True) -> SoakReport:
    """Run the soak on a started engine (`async with engine`)."""
    rng = random.Random(seed)
    report = SoakReport()
    cycles: list[Any] = []  # streams dropped inside reference cycles, collected from time to time
    sem = asyncio.Semaphore(concurrency)
    done = 0
    stop_lag = asyncio.Event()

    async def lag_monitor() -> None:
        while not stop_lag.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            report.lag_ms.append(max(0.0, (time.perf_counter() - t - 0.01) * 1000))

    async def one(i: int) -> None:
        nonlocal done
        prompt, params = _random_request(rng, max_tokens)
        fate = rng.random()
        async with sem:
            try:
                if fate < 0.12:  # cancelled at a random moment
                    task = asyncio.create_task(engine.generate(prompt, params))
                    await asyncio.sleep(rng.random() * 0.3)
                    task.cancel()
                    try:
                        await task
                        report.outcomes["completed before its cancel"] += 1
                    except asyncio.CancelledError:
                        report.outcomes["cancelled"] += 1
                elif fate < 0.22:  # abandoned mid-stream
                    async for _ in engine.stream(prompt, params):
                        if rng.random() < 0.5:
                            break
                    report.outcomes["abandoned"] += 1
                elif fate < 0.33:  # dropped inside a reference cycle, mid-stream
                    s = engine.stream(prompt, params)
                    await s.__anext__()
                    holder: dict[str, Any] = {"stream": s}
                    holder["self"] = holder
                    cycles.append(holder)
                    report.outcomes["dropped in a cycle"] += 1
                else:
                    out = await engine.generate(prompt, params)
                    report.outcomes["completed"] += 1
                    for c in out.choices:
                        if c.finish_reason not in ("stop", "length"):
                            report.failures.append(f"request {i}: finish_reason {c.finish_reason}")
                        if params.guided and (err := _check_guided(params, c.text, c.finish_reason)):
                            report.failures.append(f"request {i}: {err}")
            except StopAsyncIteration:
                report.outcomes["abandoned"] += 1
            except AsyncPageError as exc:
                report.failures.append(f"request {i}: {type(exc).__name__}: {exc}")
        done += 1
        if len(cycles) >= 10:
            del cycles[:]
            gc.collect()  # the finalizers run here, in the middle of whatever the engine is doing
        if done % max(1, num_requests // 8) == 0:
            report.rss_mb.append((done, _rss_mb()))
            if progress:
                st = engine.stats()
                print(f"  {done}/{num_requests} done, RSS {report.rss_mb[-1][1]:.0f} MB, "
                      f"{st.kv_blocks_used} blocks used, {st.num_running} running", flush=True)

    monitor = asyncio.create_task(lag_monitor())
    generated0 = engine.stats().num_generated_tokens
    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(num_requests)))
    report.wall_s = time.perf_counter() - t0
    del cycles[:]
    gc.collect()
    deadline = time.monotonic() + 30
    while (st := engine.stats()).kv_blocks_used or st.num_running or st.num_waiting:
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.02)
    stop_lag.set()
    await monitor
    report.requests = num_requests
    report.final_stats = engine.stats()
    report.tokens = report.final_stats.num_generated_tokens - generated0  # cancelled requests' tokens included
    if len(report.rss_mb) >= 3:
        base = report.rss_mb[1][1]  # after the first quarter: warm-up allocations are done
        report.rss_growth = (max(mb for _, mb in report.rss_mb[2:]) - base) / base
    return report


def report_json(report: SoakReport) -> str:
    return msgspec.json.encode({"requests": report.requests, "outcomes": dict(report.outcomes),
                                "failures": report.failures, "wall_s": report.wall_s,
                                "rss_mb": report.rss_mb, "rss_growth": report.rss_growth}).decode()
