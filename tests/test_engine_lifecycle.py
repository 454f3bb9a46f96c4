"""Streaming, cancellation, preemption, back-pressure, failures, anyio/trio, several engines."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import anyio
import pytest

from asyncpage import AsyncEngine, EngineDeadError, SamplingParams

from .conftest import fail_at_step

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)



def tiny_engine(path: Path, **kw: object) -> AsyncEngine:
    opts: dict[str, object] = dict(dtype="float32", block_size=4, num_kv_blocks=256, max_num_batched_tokens=32)
    opts.update(kw)
    return AsyncEngine.from_pretrained(str(path), **opts)  # type: ignore[arg-type]


async def _idle(engine: AsyncEngine, timeout: float = 5.0) -> None:
    """Aborts that land while a step runs are applied when it ends: wait at most one step."""
    with anyio.fail_after(timeout):
        while (st := engine.stats()).num_running or st.num_waiting or st.kv_blocks_used:
            await anyio.sleep(0.01)


PROMPTS = [f"Numbers: {i} {i + 1} {i + 2} and the quick brown fox " * (1 + i % 3) for i in range(16)]


async def test_stream_yields_tokens_then_a_final_chunk(tiny_llama: Path) -> None:
    async with tiny_engine(tiny_llama) as engine:
        chunks = [c async for c in engine.stream("The quick brown", SamplingParams(max_tokens=5, ignore_eos=True))]
    # Tokens that arrive before the reader reads are one chunk (the mailbox merges them): the tiny model's
    # steps, a burst on the compute thread holding the GIL in short torch calls, can run ahead of the reader.
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert sum(len(c.token_ids) for c in chunks) == 5


async def test_preemption_under_a_small_pool_keeps_outputs_identical(tiny_llama: Path) -> None:
    async with tiny_engine(tiny_llama) as big:
        expected = await asyncio.gather(*(big.generate(p, GREEDY) for p in PROMPTS))
        # Each sequence needs up to ~22 blocks; 16 of them need ~300: give them a third.
        async with big.clone(num_kv_blocks=100) as small:
            got = await asyncio.gather(*(small.generate(p, GREEDY) for p in PROMPTS))
            st = small.stats()
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert st.num_preemptions > 0
    assert st.kv_blocks_used == 0 and st.num_running == 0


async def test_break_aclose_and_task_cancel_all_free_the_blocks(tiny_llama: Path) -> None:
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    async with tiny_engine(tiny_llama) as engine:
        async def by_break() -> None:
            n = 0
            async for _ in engine.stream("The quick brown fox", long):
                n += 1
                if n == 3:
                    break

        async def by_aclose() -> None:
            s = engine.stream("The quick brown fox", long)
            await s.__anext__()
            await s.aclose()

        async def consume_forever() -> None:
            async for _ in engine.stream("The quick brown fox", long):
                pass

        await asyncio.gather(*(by_break() for _ in range(4)), *(by_aclose() for _ in range(4)))
        tasks = [asyncio.create_task(consume_forever()) for _ in range(4)]
        await asyncio.sleep(0.2)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _idle(engine)


def slow_steps(engine: AsyncEngine, seconds: float) -> None:
    """Make each step take a while (the tiny model is faster than any real one)."""
    import time

    real = engine._core.runner.execute

    def slow(batch):  # type: ignore[no-untyped-def]
        time.sleep(seconds)
        return real(batch)

    engine._core.runner.execute = slow  # type: ignore[method-assign]


async def test_a_request_cancelled_while_queued_is_never_prefilled(tiny_llama: Path) -> None:
    engine = tiny_engine(tiny_llama, max_num_seqs=1)
    slow_steps(engine, 0.01)
    async with engine:
        blocker = asyncio.create_task(engine.generate("The quick", SamplingParams(max_tokens=60, ignore_eos=True)))
        await asyncio.sleep(0.05)
        queued = engine.stream("Paged attention", GREEDY)
        task = asyncio.create_task(queued.__anext__())
        await asyncio.sleep(0.05)
        assert engine.stats().num_waiting == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert queued.request is not None and queued.request.times.first_scheduled is None
        await blocker
        assert queued.request.times.first_scheduled is None
        await _idle(engine)


async def test_cancellation_storm_leaves_nothing_behind(tiny_llama: Path) -> None:
    rng = random.Random(7)
    async with tiny_engine(tiny_llama, num_kv_blocks=120, max_num_seqs=32) as engine:
        async def one(i: int) -> None:
            params = SamplingParams(max_tokens=rng.randint(1, 60), temperature=rng.choice([0, 0.8]), ignore_eos=True)
            how = rng.choice(["break", "aclose", "cancel", "finish", "queued-cancel"])
            stop_after = rng.randint(0, 5)
            stream = engine.stream(PROMPTS[i % len(PROMPTS)], params)
            if how == "queued-cancel":
                t = asyncio.create_task(stream.__anext__())
                await asyncio.sleep(rng.random() * 0.01)
                t.cancel()
                await asyncio.gather(t, return_exceptions=True)
                return
            if how == "cancel":
                async def consume() -> None:
                    async for _ in stream:
                        pass
                t = asyncio.create_task(consume())
                await asyncio.sleep(rng.random() * 0.3)
                t.cancel()
                await asyncio.gather(t, return_exceptions=True)
                return
            n = 0
            async for _ in stream:
                n += 1
                if n > stop_after and how == "break":
                    break
                if n > stop_after and how == "aclose":
                    await stream.aclose()
        results = await asyncio.gather(*(one(i) for i in range(200)), return_exceptions=True)
        assert [r for r in results if r is not None] == []
        await _idle(engine)
        assert engine.stats().num_preemptions >= 0


async def test_a_slow_consumer_gets_merged_chunks_and_does_not_slow_others(tiny_llama: Path) -> None:
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    async with tiny_engine(tiny_llama) as engine:
        reference = await engine.generate("The quick brown fox", params)
        chunks = []
        fast_done: list[float] = []

        async def slow() -> None:
            async for c in engine.stream("The quick brown fox", params):
                chunks.append(c)
                await asyncio.sleep(0.2)

        async def fast() -> None:
            await engine.generate("Paged attention keeps", params)
            fast_done.append(asyncio.get_running_loop().time())

        start = asyncio.get_running_loop().time()
        await asyncio.gather(slow(), fast())
    assert [t for c in chunks for t in c.token_ids] == reference.token_ids
    assert len(chunks) < 60  # pending tokens were merged while the reader slept
    assert fast_done[0] - start < len(chunks) * 0.2  # the fast request did not wait for the slow reader


async def test_a_failing_forward_fails_every_request_with_a_typed_error(tiny_llama: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    engine = tiny_engine(tiny_llama)
    real = fail_at_step(engine, 5, "injected device failure")
    async with engine:
        results = await asyncio.gather(*(engine.generate(p, GREEDY) for p in PROMPTS[:6]), return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "injected device failure" in str(results[0])
        with pytest.raises(EngineDeadError):
            await engine.generate("again", GREEDY)
        st = engine.stats()
        assert st.engine_error is not None and "injected" in st.engine_error
        assert st.kv_blocks_used == 0
    assert "injected device failure" in caplog.text
    # Reopening the engine starts a fresh loop that works again.
    engine._core.runner.execute = real  # type: ignore[method-assign]
    async with engine:
        assert len((await engine.generate("again", GREEDY)).token_ids) == 40


async def test_two_engines_run_at_once_and_agree(tiny_llama: Path) -> None:
    a = tiny_engine(tiny_llama)
    b = a.clone(num_kv_blocks=64)
    async with a, b:
        outs = await asyncio.gather(*(e.generate(p, GREEDY) for e in (a, b) for p in PROMPTS[:3]))
    assert [o.token_ids for o in outs[:3]] == [o.token_ids for o in outs[3:]]


def test_engine_works_under_trio_and_in_later_event_loops(tiny_llama: Path) -> None:
    engine = tiny_engine(tiny_llama)

    async def run() -> list[int]:
        async with engine:
            return (await engine.generate("The quick brown fox", GREEDY)).token_ids

    first = asyncio.run(run())
    assert anyio.run(run, backend="trio") == first
    assert asyncio.run(run()) == first  # a new loop after the old one closed


def test_internal_request_ids_never_collide(tiny_llama: Path) -> None:
    engine = tiny_engine(tiny_llama)

    async def run() -> set[int]:
        async with engine:
            streams = [engine.stream("hi", SamplingParams(max_tokens=2)) for _ in range(50)]
            ids = set()
            for s in streams:
                async for _ in s:
                    pass
                assert s.request is not None
                ids.add(s.request.request_id)
            return ids

    assert len(asyncio.run(run())) == 50


async def test_a_request_aborted_while_still_queued_tells_its_reader(tiny_llama: Path) -> None:
    """abort() of a request the loop has not admitted yet (it is busy with a step): whoever reads the
    request still gets its end, as for any abort."""
    async with tiny_engine(tiny_llama, max_num_batched_tokens=16) as engine:
        busy = await engine.submit([0, *range(3, 90)], SamplingParams(max_tokens=5, temperature=0))
        await asyncio.sleep(0.01)
        req = await engine.submit([0, 5, 6], SamplingParams(max_tokens=5, temperature=0))
        engine.abort(req)
        await engine.wait_released(req)
        chunks = await asyncio.wait_for(req.mailbox.get(), 2)
        assert [c.finish_reason for c in chunks] == ["abort"]
        await engine.wait_released(busy)
