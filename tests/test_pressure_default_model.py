"""Holding under pressure on the real default model: a pool a third of what the load needs,
abandoned streams, trio, metrics."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import pytest

from asyncpage import AsyncEngine, SamplingParams


@pytest.mark.heavy  # `make test-heavy`: the default model end to end, slow on 2 cores
async def test_27_streams_on_80_blocks_preempt_and_still_match_the_reference(
        default_engine: AsyncEngine, reference: dict[str, Any]) -> None:
    cases = reference["cases"] * 3  # 27 streams needing ~240 blocks of 16 in all
    params = SamplingParams(max_tokens=reference["new_tokens"], temperature=0, ignore_eos=True)
    lags: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        loop = asyncio.get_running_loop()
        while not done.is_set():
            t = loop.time()
            await asyncio.sleep(0.01)
            lags.append(loop.time() - t - 0.01)

    async def one(case: dict[str, Any]) -> list[int]:
        ids: list[int] = []
        async for chunk in small.stream(case["prompt_token_ids"], params):
            ids += chunk.token_ids
        return ids

    async with default_engine.clone(num_kv_blocks=80, block_size=16, max_num_batched_tokens=256) as small:
        tick = asyncio.create_task(ticker())
        outs = await asyncio.gather(*(one(c) for c in cases))
        done.set()
        await tick
        st = small.stats()
    assert outs == [c["greedy_token_ids"] for c in cases]
    assert st.num_preemptions >= 1
    assert st.kv_blocks_used == 0 and st.num_running == 0 and st.num_waiting == 0
    lags.sort()
    print(f"event-loop lag p50 {lags[len(lags) // 2] * 1000:.1f} ms, p99 {lags[int(len(lags) * 0.99)] * 1000:.1f} ms")


async def test_abandoned_long_streams_free_everything(default_engine: AsyncEngine) -> None:
    long = SamplingParams(max_tokens=500, temperature=0.7, ignore_eos=True)

    async def by_break(i: int) -> None:
        n = 0
        async for _ in default_engine.stream(f"Story number {i}:", long):
            n += 1
            if n == 3:
                break

    async def by_cancel(i: int) -> None:
        async def consume() -> None:
            async for _ in default_engine.stream(f"Poem number {i}:", long):
                pass
        t = asyncio.create_task(consume())
        await asyncio.sleep(1.0)
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)

    await asyncio.gather(*(by_break(i) for i in range(4)), *(by_cancel(i) for i in range(4)))
    with anyio.fail_after(5):
        while (st := default_engine.stats()).num_running or st.kv_blocks_used:
            await asyncio.sleep(0.01)
    assert st.num_waiting == 0


def test_generate_under_trio(default_engine_unstarted: AsyncEngine, reference: dict[str, Any]) -> None:
    case = reference["cases"][0]
    engine = default_engine_unstarted.clone(num_kv_blocks=64)

    async def main() -> list[int]:
        async with engine:
            return (await engine.generate(case["prompt"], SamplingParams(max_tokens=8, temperature=0))).token_ids

    assert anyio.run(main, backend="trio") == case["greedy_token_ids"][:8]


async def test_prometheus_metrics_report_requests_and_pool(default_engine_unstarted: AsyncEngine) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from asyncpage.metrics import PrometheusMetrics

    registry = CollectorRegistry()
    engine = default_engine_unstarted.clone(num_kv_blocks=64)
    PrometheusMetrics(engine, registry=registry)
    async with engine:
        await asyncio.gather(*(engine.generate(f"Hello {i}", SamplingParams(max_tokens=5, ignore_eos=True))
                               for i in range(3)))
        text = generate_latest(registry).decode()
    assert 'asyncpage:request_success_total{finished_reason="length"} 3.0' in text
    assert "asyncpage:generation_tokens_total 15.0" in text
    assert "asyncpage:time_to_first_token_seconds_count 3.0" in text
    assert "asyncpage:kv_cache_usage_perc 0.0" in text
