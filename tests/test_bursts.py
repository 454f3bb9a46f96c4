"""Runs of plain decode steps stay on the compute thread (core/burst.py): one stream's steps cross no
thread, and nothing a caller sees changes: the same tokens, aborts and adds applied at once, one
request's failed output failing that request alone, stats readable throughout, engines sharing a
compute thread taking turns."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from asyncpage import AsyncEngine, RequestFailedError, SamplingParams
from tests.test_faults import idle, tiny_engine

LONG = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)


def count_handoffs(engine: AsyncEngine) -> list[int]:
    """How many jobs the engine's loop handed to its compute thread (one element per job)."""
    compute = engine._core.compute
    calls: list[int] = []
    real = compute.arun

    async def counted(fn: Any, *args: Any, **kw: Any) -> Any:
        calls.append(1)
        return await real(fn, *args, **kw)

    compute.arun = counted  # type: ignore[method-assign]
    return calls


async def test_one_stream_decodes_in_one_handoff_with_the_same_tokens(tiny_llama: Path) -> None:
    async with tiny_engine(tiny_llama) as engine:
        calls = count_handoffs(engine)
        streamed: list[int] = []
        async for chunk in engine.stream("The quick brown fox", LONG):
            streamed += chunk.token_ids
        # The prompt's chunks and the 48 decode steps: one job, ended by the step that finishes the request.
        assert len(streamed) == 48 and len(calls) <= 3
        engine._core.BURSTS = False  # the step-by-step loop gives the same tokens
        calls.clear()
        assert (await engine.generate("The quick brown fox", LONG)).token_ids == streamed
        assert len(calls) >= 48
        await idle(engine)


async def test_an_abort_during_a_burst_ends_that_request_and_the_other_goes_on(tiny_llama: Path) -> None:
    async with tiny_engine(tiny_llama) as engine:
        alone = (await engine.generate("Others keep going", LONG)).token_ids
        other = asyncio.ensure_future(engine.generate("Others keep going", LONG))
        got: list[int] = []
        stream = engine.stream("The victim", SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
        async for chunk in stream:
            got += chunk.token_ids
            if len(got) >= 5:
                break
        await stream.aclose()
        assert (await other).token_ids == alone
        await idle(engine)
        assert engine._core.check_invariants()


async def test_a_request_submitted_during_a_burst_starts_before_the_running_one_ends(tiny_llama: Path) -> None:
    async with tiny_engine(tiny_llama) as engine:
        done = asyncio.Event()
        first: list[int] = []

        async def long_one() -> None:
            async for chunk in engine.stream("A long one", SamplingParams(max_tokens=300, temperature=0,
                                                                          ignore_eos=True)):
                first.extend(chunk.token_ids)
            done.set()

        task = asyncio.ensure_future(long_one())
        while len(first) < 3:
            await asyncio.sleep(0.001)
        short = await engine.generate("A short one", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert len(short.token_ids) == 4 and not done.is_set()
        await task
        assert len(first) == 300
        await idle(engine)


async def test_a_detokenizer_that_fails_during_a_burst_fails_its_request_alone(tiny_llama: Path) -> None:
    async with tiny_engine(tiny_llama) as engine:
        alone = (await engine.generate("Others keep going", LONG)).token_ids
        other = asyncio.ensure_future(engine.generate("Others keep going", LONG))
        req = await engine.submit("The victim", SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        detok = req.seqs[0].detokenizer
        real, seen = detok.add, []

        def add(token: int, **kw: Any) -> str:
            seen.append(token)
            if len(seen) == 6:
                raise ValueError("injected decode error")
            return real(token, **kw)

        detok.add = add  # type: ignore[method-assign]
        with pytest.raises(RequestFailedError) as info:
            while True:
                await req.mailbox.get()
        assert isinstance(info.value.__cause__, ValueError)
        assert (await other).token_ids == alone
        assert engine.healthy
        await idle(engine)
        assert engine._core.check_invariants()


async def test_stats_read_during_bursts_only_move_forward(tiny_llama: Path) -> None:
    async with tiny_engine(tiny_llama) as engine:
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        task = asyncio.ensure_future(asyncio.gather(*(engine.generate(f"Prompt {i}", params) for i in range(3))))
        generated = []
        while not task.done():
            generated.append(engine.stats().num_generated_tokens)
            await asyncio.sleep(0)
        await task
        assert generated == sorted(generated) and len(set(generated)) > 2
        await idle(engine)
        assert engine.stats().num_generated_tokens == 3 * 200


async def test_engines_sharing_a_compute_thread_take_turns(tiny_llama: Path) -> None:
    """A burst gives way between its steps to another engine's job on the same thread."""
    async with tiny_engine(tiny_llama) as engine, engine.clone() as other:
        long = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
        first: list[int] = []

        async def long_one() -> None:
            async for chunk in engine.stream("A long one", long):
                first.extend(chunk.token_ids)

        task = asyncio.ensure_future(long_one())
        while len(first) < 3:
            await asyncio.sleep(0.001)
        short = await other.generate("A short one", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert len(short.token_ids) == 8 and len(first) < 300
        await task
        await idle(engine)
        await idle(other)


async def test_a_cancelled_engine_loop_waits_for_its_burst_and_leaves_the_pool_whole(tiny_llama: Path) -> None:
    """asyncio's own task.cancel() of the loop (what asyncio.run does to a task left running) gets through
    anyio's shield: the burst is told to stop and waited for, so nothing runs on the compute thread once the
    loop has ended and freed everything."""
    engine = tiny_engine(tiny_llama, debug_checks=False)
    core = engine._core
    await engine.__aenter__()
    req = await engine.submit("Nobody reads this", SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True))
    while core.output.num_generated < 5:
        await asyncio.sleep(0.001)
    steps: list[int] = []
    real = core.scheduler.schedule
    core.scheduler.schedule = lambda: steps.append(1) or real()  # type: ignore[method-assign]
    task = engine._loop_task
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    ended = len(steps)
    await asyncio.sleep(0.1)
    assert len(steps) == ended and core.loop is None and req.released
    assert not core.scheduler.running and core.kv.pool.num_used == 0
    assert core.check_invariants()
    await engine.__aexit__(None, None, None)
