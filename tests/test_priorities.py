"""Priorities (issue 34): `priority=` on stream/generate/beam_search, lower first (vLLM's convention),
ties by arrival; a waiting request of a higher priority preempts running ones of a lower one when
the seats or the pool are short; waiting ages a request up one level every AGING_S, so none starves;
stats() counts by priority. All priorities 0 is first-come-first-served exactly as before."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from asyncpage import AsyncEngine, InvalidRequestError, SamplingParams
from asyncpage.core import priority as priorities
from tests.test_faults import idle, tiny_engine, until

LONG = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
HOLD = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
STEP_S = 0.01  # the least time a step takes once a test slows them (_slow_steps)


def _slow_steps(engine: AsyncEngine) -> None:
    """Every step from now on takes at least STEP_S, however fast the CPU runs the tiny model: what a test
    watches between steps stays there long enough to see (on one CPU, 400 steps once took ~0.1 s)."""
    runner = engine._core.runner
    real = runner.execute

    def slow(batch: Any) -> Any:
        time.sleep(STEP_S)
        return real(batch)

    runner.execute = slow  # type: ignore[method-assign]


async def _hold_the_seat(engine: AsyncEngine, priority: int = 0) -> Any:
    """A request that keeps the only seat until the test closes it: its 400 tokens take 400 slowed steps (4 s)."""
    _slow_steps(engine)
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
    await until(lambda: engine.stats().num_waiting >= len(jobs))
    await seat.aclose()
    await asyncio.gather(*tasks)
    return done


async def test_a_higher_priority_request_preempts_a_lower_one_and_both_get_their_own_tokens(tiny_llama: Path) -> None:
    async with tiny_engine(tiny_llama, max_num_seqs=1) as engine:
        alone = await engine.generate("a long background job", LONG)
        quick_alone = await engine.generate("an interactive turn", SHORT)
        _slow_steps(engine)  # its 24 steps outlast the interactive turn's arrival
        background = asyncio.ensure_future(engine.generate("a long background job", LONG, priority=5))
        await until(lambda: engine.stats().num_running > 0)
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
    monkeypatch.setattr(priorities, "AGING_S", 0.2)
    async with tiny_engine(tiny_llama, max_num_seqs=1) as engine:
        seat = await _hold_the_seat(engine, priority=-5)
        ended: list[str] = []  # shared: the order all three end in

        async def aged() -> None:
            await engine.generate("waited long", SHORT, priority=3)
            ended.append("aged")

        old = asyncio.ensure_future(aged())
        # 7 or 8 levels of aging: it ranks -4 or -5 against the newcomers' 0, and not yet better than the seat's
        # -5 (that takes 9 levels, 1.8 s): 0.2 s for the newcomers to queue and the seat to close.
        await asyncio.sleep(1.6)
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


# ---- steps while an interactive turn shares the engine with a background job ---------------------------
def _spy_steps(monkeypatch: pytest.MonkeyPatch) -> list[list[tuple[int, int]]]:
    """Each step's rows as (priority, tokens computed), in the order the scheduler makes them."""
    from asyncpage.core.scheduler import Scheduler
    steps: list[list[tuple[int, int]]] = []
    schedule = Scheduler.schedule

    def spy(self: Scheduler) -> Any:
        out = schedule(self)
        if out.scheduled:
            steps.append([(s.seq.request.priority, s.num_new_tokens) for s in out.scheduled])
        return out

    monkeypatch.setattr(Scheduler, "schedule", spy)
    return steps


async def test_an_interactive_turn_steps_with_a_bounded_share_of_a_background_job_and_every_token_is_right(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [f"background record {i}: " + "words " * (i % 5) for i in range(16)]
    async with tiny_engine(tiny_llama, max_num_seqs=32, num_kv_blocks=512, max_num_batched_tokens=256) as engine:
        alone = [await engine.generate(p, job) for p in prompts]
        turn_alone = await engine.generate("an interactive turn", LONG)
        late_alone = await engine.generate("a record that arrives during the turn", job)
        steps = _spy_steps(monkeypatch)
        streams = [engine.stream(p, job, priority=10) for p in prompts]
        firsts = await asyncio.gather(*(s.__anext__() for s in streams))  # every background prompt is in

        async def rest(stream: Any, first: Any) -> list[int]:
            ids = list(first.token_ids)
            async for chunk in stream:
                ids += chunk.token_ids
            return ids

        background = [asyncio.ensure_future(rest(s, f)) for s, f in zip(streams, firsts, strict=True)]
        turn = asyncio.ensure_future(engine.generate("an interactive turn", LONG, priority=-1))
        await until(lambda: any(p == -1 for step in steps for p, _ in step))
        late = asyncio.ensure_future(engine.generate("a record that arrives during the turn", job, priority=11))
        turn_out = await turn
        background_ids = await asyncio.gather(*background)
        late_out = await late
        await idle(engine)
    assert turn_out.token_ids == turn_alone.token_ids and late_out.token_ids == late_alone.token_ids
    assert background_ids == [out.token_ids for out in alone]
    with_turn = [step for step in steps if any(p == -1 for p, _ in step)]
    assert len(with_turn) >= LONG.max_tokens - 1
    for step in with_turn:
        # Every step of the turn has it, and at most URGENT_STEP_ROWS rows in all, background ones included.
        assert sum(1 for p, _ in step if p == -1) == 1 and len(step) <= priorities.URGENT_STEP_ROWS
        assert any(p == 10 for p, _ in step)  # the job moves meanwhile, a few rows at a time
    late_in = next(i for i, step in enumerate(steps) if any(p == 11 for p, _ in step))
    assert late_in > steps.index(with_turn[-1])  # the late record is admitted once the turn is done


async def test_near_interactive_work_a_background_only_step_is_short_and_a_job_alone_keeps_full_steps(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    long_prompt = "a long record for the job " * 16  # ~290 tokens
    async with tiny_engine(tiny_llama, num_kv_blocks=512, max_num_batched_tokens=256) as engine:
        steps = _spy_steps(monkeypatch)
        await engine.generate(long_prompt, job, priority=10)
        assert max(n for step in steps for _, n in step) == 256  # a job alone: full steps
        await engine.generate("an interactive turn", SHORT)  # priority 0: interactive
        steps.clear()
        out = await engine.generate("another record: " + long_prompt, job, priority=10)  # none of it cached
        assert max(n for step in steps for _, n in step) == priorities.BACKGROUND_STEP_TOKENS
        assert len(out.prompt_token_ids) > 256


async def test_a_background_prompt_half_prefilled_when_a_turn_arrives_finishes_while_the_turn_runs(
        tiny_llama: Path) -> None:
    # One turn beside 16 background rows (7 of them a step): the steps where the job may prefill used to
    # meet the same 7 rows every time, and a prompt outside them got no chunk until the turn ended.
    decode = SamplingParams(max_tokens=450, temperature=0, ignore_eos=True)
    turn = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    async with tiny_engine(tiny_llama, max_num_seqs=32, num_kv_blocks=2048) as engine:
        running = engine._core.scheduler.running
        decoders = [engine.stream(f"decoder {i}", decode, priority=11) for i in range(15)]
        firsts = await asyncio.gather(*(d.__anext__() for d in decoders))
        rest = [asyncio.ensure_future(_drain(d, f)) for d, f in zip(decoders, firsts, strict=True)]
        record = asyncio.ensure_future(engine.generate(list(range(3, 303)), SHORT, priority=10))
        await until(lambda: any(len(s.token_ids) > 200 and s.num_computed_tokens for s in running))
        seq = next(s for s in running if len(s.token_ids) > 200)
        assert 0 < seq.num_computed_tokens < 100  # half-prefilled when the turn arrives
        await engine.generate("an interactive turn", turn, priority=-1)
        assert record.done()  # its prompt moved (a chunk in turn) while the turn ran
        await asyncio.gather(*rest)
        await idle(engine)


async def _drain(stream: Any, first: Any) -> list[int]:
    ids = list(first.token_ids)
    async for chunk in stream:
        ids += chunk.token_ids
    return ids
