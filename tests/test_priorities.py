"""Priorities (issue 34): `priority=` on stream/generate/beam_search, lower first (vLLM's convention),
ties by arrival; a waiting request of a higher priority preempts running ones of a lower one when
the seats or the pool are short; waiting ages a request up one level every AGING_S, so none starves;
stats() counts by priority. All priorities 0 is first-come-first-served exactly as before."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from asyncpage import AsyncEngine, InvalidRequestError, SamplingParams
from asyncpage.core import priority as priorities
from tests.test_faults import idle, tiny_engine

LONG = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
HOLD = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)


async def _hold_the_seat(engine: AsyncEngine, priority: int = 0) -> Any:
    """A request that keeps the only seat until the test closes it."""
    stream = engine.stream("hold the only seat", HOLD, priority=priority)
    await stream.__anext__()
    return stream


async def _finish_order(engine: AsyncEngine, jobs: list[tuple[str, str, int]], seat: Any,
                        done: list[str] | None = None) -> list[str]:
    """Submit `jobs` in order behind the request holding the seat, then free it: the order they end in
    (appended to `done`, which other requests may share)."""
    done = [] if done is None else done

    async def one(name: str, prompt: str, priority: int) -> None:
        await engine.generate(prompt, SHORT, priority=priority)
        done.append(name)

    tasks = []
    for name, prompt, priority in jobs:
        tasks.append(asyncio.ensure_future(one(name, prompt, priority)))
        await asyncio.sleep(0.02)  # arrival order is submission order
    while engine.stats().num_waiting < len(jobs):
        await asyncio.sleep(0.001)
    await seat.aclose()
    await asyncio.gather(*tasks)
    return done


async def test_a_higher_priority_request_preempts_a_lower_one_and_both_get_their_own_tokens(tiny_llama: Path) -> None:
    async with tiny_engine(tiny_llama, max_num_seqs=1) as engine:
        alone = await engine.generate("a long background job", LONG)
        quick_alone = await engine.generate("an interactive turn", SHORT)
        background = asyncio.ensure_future(engine.generate("a long background job", LONG, priority=5))
        while not engine.stats().num_running:
            await asyncio.sleep(0.001)
        quick = await engine.generate("an interactive turn", SHORT)  # priority 0: ahead of 5
        assert not background.done()  # it was preempted to make the seat, and still runs after
        assert quick.token_ids == quick_alone.token_ids
        out = await background
        assert out.token_ids == alone.token_ids  # recomputed after its preemption, same greedy tokens
        assert out.metrics.num_preemptions >= 1
        await idle(engine)


async def test_waiting_requests_start_by_priority_then_arrival(tiny_llama: Path) -> None:
    async with tiny_engine(tiny_llama, max_num_seqs=1) as engine:
        seat = await _hold_the_seat(engine, priority=-5)  # the best priority: nothing preempts it
        order = await _finish_order(engine, [("low", "a", 3), ("mid-1", "b", 1), ("high", "c", -2), ("mid-2", "d", 1)],
                                    seat)
        assert order == ["high", "mid-1", "mid-2", "low"]
        await idle(engine)


async def test_all_equal_priorities_are_first_come_first_served(tiny_llama: Path) -> None:
    async with tiny_engine(tiny_llama, max_num_seqs=1) as engine:
        seat = await _hold_the_seat(engine, priority=7)
        order = await _finish_order(engine, [(f"r{i}", f"prompt {i}", 7) for i in range(4)], seat)
        assert order == ["r0", "r1", "r2", "r3"]


async def test_a_low_priority_request_ages_past_newer_high_priority_ones(tiny_llama: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(priorities, "AGING_S", 0.05)
    async with tiny_engine(tiny_llama, max_num_seqs=1) as engine:
        seat = await _hold_the_seat(engine, priority=-5)
        ended: list[str] = []  # shared: the order all three end in

        async def aged() -> None:
            await engine.generate("waited long", SHORT, priority=3)
            ended.append("aged")

        old = asyncio.ensure_future(aged())
        await asyncio.sleep(0.4)  # 8 levels of aging: it now ranks as -5 against the newcomers' 0
        st = engine.stats()
        assert st.num_waiting_by_priority == {3: 1} and st.num_running_by_priority == {-5: 1}
        await _finish_order(engine, [("new-0", "fresh", 0), ("new-1", "fresher", 0)], seat, ended)
        await old
        assert ended == ["aged", "new-0", "new-1"]


@pytest.mark.parametrize("bad", [True, 1.5, "1", 1 << 40])
async def test_a_priority_that_is_not_a_small_integer_is_refused_naming_it(tiny_llama: Path, bad: object) -> None:
    async with tiny_engine(tiny_llama) as engine:
        with pytest.raises(InvalidRequestError) as info:
            await engine.generate("x", SHORT, priority=bad)  # type: ignore[arg-type]
        assert info.value.field == "priority"


@pytest.mark.parametrize("tier", [["priority"], {"a": 1}, 3, "fast"])
def test_a_service_tier_that_is_not_one_of_openais_names_is_a_400_naming_it(tier: object) -> None:
    from asyncpage.openai.convert import run_options

    with pytest.raises(InvalidRequestError) as info:
        run_options({"service_tier": tier})
    assert info.value.field == "service_tier"
