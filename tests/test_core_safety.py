"""The engine core under rare paths: aborts that arrive mid-step (a finalizer run by the garbage
collector, another thread), sequence accounting with forks, stats read off the loop, the engine used
from the wrong thread or loop, threads and the loop's exit. Each test names the defect it guards."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncpage import AsyncEngine, SamplingParams
from asyncpage.errors import EngineLoopError, InvalidRequestError
from asyncpage.outputs import FinishedRequest

from .conftest import fail_at_step

LONG = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
PROMPTS = [f"Numbers: {i} {i + 1} {i + 2} and the quick brown fox " * (1 + i % 3) for i in range(12)]


def tiny_engine(path: Path, **kw: Any) -> AsyncEngine:
    opts: dict[str, Any] = dict(dtype="float32", block_size=4, num_kv_blocks=256, max_num_batched_tokens=32,
                                debug_checks=True)
    opts.update(kw)
    return AsyncEngine.from_pretrained(str(path), **opts)


async def _idle(engine: AsyncEngine, timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while (st := engine.stats()).num_running or st.num_waiting or st.kv_blocks_used:
            await anyio.sleep(0.01)


class _Cycle:
    """Holds a started stream in a reference cycle: only the cyclic GC can drop it."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.me = self


async def _cyclic_streams(engine: AsyncEngine, n: int) -> list[_Cycle]:
    out = []
    for p in PROMPTS[:n]:
        s = engine.stream(p, LONG)
        await s.__anext__()  # submitted and running
        out.append(_Cycle(s))
    return out


@pytest.mark.parametrize("where", ["schedule", "prepare", "commit"])
async def test_streams_collected_by_gc_mid_step_never_corrupt_the_scheduler(tiny_llama: Path, where: str) -> None:
    """Defect 1: an abort from a finalizer used to finish sequences in the middle of schedule(),
    prepare() or the commit: zombies that ran to max_tokens, a dropped neighbour, a dead engine."""
    engine = tiny_engine(tiny_llama, num_kv_blocks=96)
    core = engine._core
    async with engine:
        expected = await engine.generate(PROMPTS[5], LONG)
        victims = await _cyclic_streams(engine, 4)
        others = [asyncio.create_task(engine.generate(p, LONG)) for p in PROMPTS[5:9]]
        requests = [v.stream.request for v in victims]
        target = {"schedule": core.scheduler, "prepare": core.runner, "commit": core.output}[where]
        name = {"schedule": "schedule", "prepare": "prepare", "commit": "process"}[where]
        real = getattr(target, name)

        def collect_inside(*args: Any) -> Any:
            if victims:
                victims.pop()  # the last reference outside its own cycle
                gc.collect()  # RequestStream.__del__ -> engine.abort(), right here
            return real(*args)

        setattr(target, name, collect_inside)
        try:
            outs = await asyncio.gather(*others)
        finally:
            setattr(target, name, real)
        await _idle(engine)
        assert engine.healthy
        assert outs[0].token_ids == expected.token_ids
        assert all(len(o.token_ids) == 40 for o in outs)
        assert all(r is not None and r.released for r in requests)
        assert all(s.finish_reason == "abort" for r in requests if r is not None for s in r.seqs)
        assert core.check_invariants()


async def test_a_stream_dropped_on_another_thread_is_aborted_safely(tiny_llama: Path) -> None:
    """Defect 1, the thread variant: abort() from a foreign thread only queues."""
    engine = tiny_engine(tiny_llama)
    async with engine:
        victims = await _cyclic_streams(engine, 3)
        others = [asyncio.create_task(engine.generate(p, LONG)) for p in PROMPTS[3:6]]
        requests = [v.stream.request for v in victims]

        def drop_all() -> None:
            for _ in range(len(victims)):
                victims.pop()
                gc.collect()
                time.sleep(0.005)

        t = threading.Thread(target=drop_all)
        t.start()
        outs = await asyncio.gather(*others)
        t.join()
        await _idle(engine)
        assert all(len(o.token_ids) == 40 for o in outs)
        assert all(r is not None and r.released for r in requests)


async def test_a_request_cancelled_while_queued_is_never_prefilled(tiny_llama: Path) -> None:
    engine = tiny_engine(tiny_llama)
    real = engine._core.runner.execute
    in_step = threading.Event()

    def slow(batch: Any) -> Any:
        in_step.set()
        time.sleep(0.2)
        return real(batch)

    engine._core.runner.execute = slow  # type: ignore[method-assign]
    async with engine:
        first = asyncio.create_task(engine.generate(PROMPTS[0], SamplingParams(max_tokens=3)))
        await anyio.to_thread.run_sync(in_step.wait)  # a step is running: new requests wait in the queue
        s = engine.stream(PROMPTS[1], LONG)
        task = asyncio.create_task(s.__anext__())
        while s.request is None:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await first
        await _idle(engine)
        assert s.request.released and s.request.seqs[0].num_computed_tokens == 0
        n_first = len(await engine.tokenize(PROMPTS[0]))
        assert engine.stats().prefix_cache_query_tokens == n_first  # the cancelled prompt was never looked up


async def test_a_stream_closed_while_it_is_being_submitted_never_runs(tiny_llama: Path) -> None:
    engine = tiny_engine(tiny_llama)
    gate = asyncio.Event()
    real = engine.guided.compile

    async def slow_compile(spec: Any) -> Any:
        await gate.wait()
        return await real(spec)

    engine.guided.compile = slow_compile  # type: ignore[method-assign]
    async with engine:
        s = engine.stream("hello", SamplingParams(max_tokens=30, regex="[a-z ]+"))
        reader = asyncio.create_task(anext(s, None))
        await asyncio.sleep(0.05)  # the reader is inside submit(), compiling
        await s.aclose()
        gate.set()
        assert await reader is None  # ended, not a chunk of a request nobody wants
        await _idle(engine)
        assert engine.stats().num_generated_tokens == 0
        assert s.request is not None and s.request.released


async def test_forks_count_against_max_num_seqs(tiny_llama: Path) -> None:
    """Defect 5: every sample is a sequence; n-1 children used to be added past max_num_seqs."""
    engine = tiny_engine(tiny_llama, max_num_seqs=4)
    core = engine._core
    peak = 0
    real = core.runner.execute

    def watch(batch: Any) -> Any:
        nonlocal peak
        peak = max(peak, len(core.scheduler.running))
        return real(batch)

    core.runner.execute = watch  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=1, n=3, ignore_eos=True)
    async with engine:
        outs = await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS[:4]))
        assert all(len(o.choices) == 3 for o in outs)
        with pytest.raises(InvalidRequestError) as e:
            await engine.generate("x", SamplingParams(n=5))
        assert e.value.field == "n"
    assert 3 <= peak <= 4  # on main, 4 admitted parents forked into 12 sequences


async def test_stats_from_a_scrape_thread_never_race_the_loop(tiny_llama: Path) -> None:
    """Defect 8: stats() off the loop thread read the free list while the loop changed it."""
    engine = tiny_engine(tiny_llama)
    errors: list[BaseException] = []
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            try:
                st = engine.stats()
                assert st.kv_token_slots_occupied <= st.kv_token_slots_allocated
            except BaseException as exc:
                errors.append(exc)
            time.sleep(0.0002)  # a scrape every ~0.2 ms, not one holding the GIL against the loop

    t = threading.Thread(target=scrape)
    async with engine:
        t.start()
        await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=20, n=4, temperature=1, seed=3))
                               for p in PROMPTS[:8]))
        stop.set()
        t.join()
    assert not errors, errors[:3]


async def test_shared_prompt_blocks_count_once_in_occupied_slots(tiny_llama: Path) -> None:
    """Defect 8: occupied slots counted a shared prompt once per fork (and exceeded allocated)."""
    engine = tiny_engine(tiny_llama)
    seen = []
    async with engine:
        async for _ in engine.stream(PROMPTS[2], SamplingParams(max_tokens=8, n=6, temperature=1, seed=0)):
            seen.append(engine.stats())
    assert all(s.kv_token_slots_occupied <= s.kv_token_slots_allocated for s in seen)


async def test_using_the_engine_from_another_thread_or_loop_is_a_clear_error(tiny_llama: Path) -> None:
    """Defect 9: stream() from a second thread or event loop raced instead of raising."""
    engine = tiny_engine(tiny_llama)
    async with engine:
        def other_loop() -> BaseException | None:
            async def go() -> None:
                await engine.generate("hi", SamplingParams(max_tokens=2))
            try:
                asyncio.run(go())
            except BaseException as exc:
                return exc
            return None

        err = await anyio.to_thread.run_sync(other_loop)
        assert isinstance(err, EngineLoopError)
        assert len((await engine.generate("hi", SamplingParams(max_tokens=2))).token_ids) == 2


async def test_a_host_that_fills_anyio_thread_pool_does_not_stall_the_engine(tiny_llama: Path) -> None:
    """Defect 9: each step used to wait on anyio's process-wide default thread pool."""
    engine = tiny_engine(tiny_llama)
    limiter = anyio.to_thread.current_default_thread_limiter()
    old = limiter.total_tokens
    release = threading.Event()
    async with engine:
        limiter.total_tokens = 1
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(anyio.to_thread.run_sync, release.wait)  # the host holds the only token
                try:
                    with anyio.fail_after(20):  # > 2000 chars: tokenized off the loop as well
                        out = await engine.generate("The quick brown fox " * 110, LONG)
                finally:
                    release.set()
        finally:
            limiter.total_tokens = old
    assert len(out.token_ids) == 40


def test_engines_do_not_leak_threads(tiny_llama: Path) -> None:
    """Defect 9: compute and mask pools were never shut down."""

    async def use() -> None:
        engine = tiny_engine(tiny_llama)
        async with engine:
            await engine.generate("hi", SamplingParams(max_tokens=2, regex="[a-z]+"))

    asyncio.run(use())
    gc.collect()
    base = threading.active_count()
    for _ in range(3):
        asyncio.run(use())
    gc.collect()
    time.sleep(0.2)
    assert threading.active_count() <= base


async def test_closing_waits_for_the_step_in_flight(tiny_llama: Path) -> None:
    """Defect 9: on asyncio __aexit__ returned while a worker thread still ran the step."""
    engine = tiny_engine(tiny_llama)
    real = engine._core.runner.execute
    running = threading.Event()
    finished = threading.Event()

    def slow(batch: Any) -> Any:
        running.set()
        time.sleep(0.3)
        try:
            return real(batch)
        finally:
            finished.set()

    engine._core.runner.execute = slow  # type: ignore[method-assign]
    async with engine:
        task = asyncio.create_task(engine.generate("hi", LONG))
        await anyio.to_thread.run_sync(running.wait)
    assert finished.is_set()
    with pytest.raises(Exception, match="closed"):
        await task


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_an_error_inside_async_with_comes_out_unwrapped(tiny_llama: Path, backend: str) -> None:
    """Defect 9: under trio the body's exception came out wrapped in an ExceptionGroup."""
    engine = tiny_engine(tiny_llama)

    async def body() -> None:
        async with engine:
            await engine.generate("hi", SamplingParams(max_tokens=2))
            raise KeyError("mine")

    with pytest.raises(KeyError, match="mine"):
        anyio.run(body, backend=backend)


async def test_a_dead_engine_reports_every_request_to_the_hooks(tiny_llama: Path) -> None:
    """Defect 12: _die never called the finish hooks."""
    engine = tiny_engine(tiny_llama)
    reports: list[FinishedRequest] = []
    engine.on_request_finished(reports.append)
    fail_at_step(engine, 3, "injected")
    async with engine:
        results = await asyncio.gather(*(engine.generate(p, LONG) for p in PROMPTS[:4]), return_exceptions=True)
    assert all(isinstance(r, Exception) for r in results)
    assert len(reports) == 4 and all(r.finish_reasons == ["abort"] for r in reports)


async def test_an_n_request_aborted_before_it_forks_reports_n_reasons(tiny_llama: Path) -> None:
    """Defect 12: an n>1 request aborted before its fork reported one finish reason."""
    engine = tiny_engine(tiny_llama)
    reports: list[FinishedRequest] = []
    engine.on_request_finished(reports.append)
    async with engine:
        s = engine.stream(PROMPTS[0] * 4, SamplingParams(n=3, max_tokens=5))
        task = asyncio.create_task(s.__anext__())
        while s.request is None:
            await asyncio.sleep(0)
        await s.aclose()
        task.cancel()
        await _idle(engine)
    assert reports[-1].finish_reasons == ["abort", "abort", "abort"]


async def test_a_stop_string_completed_on_the_last_allowed_token_is_a_stop(tiny_llama: Path) -> None:
    """Defect 12: a stop string completed by the max_tokens-th token reported "length"."""
    engine = tiny_engine(tiny_llama)
    async with engine:
        free = await engine.generate(PROMPTS[1], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        last = engine.tokenizer.decode(free.token_ids[-1:])
        stop = (free.text[-len(last) - 2 :] if len(last) < 2 else last).strip() or last
        out = await engine.generate(PROMPTS[1], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                               stop=[stop]))
    assert stop in free.text
    assert out.finish_reason == "stop"
    assert stop not in out.text


def test_an_unread_stream_keeps_one_logprob_list() -> None:
    """Defect 12: the mailbox copied the logprob list on every put (quadratic for an unread stream)."""
    from asyncpage.core.mailbox import Mailbox
    from asyncpage.outputs import TokenLogprob

    box = Mailbox()
    box.put(0, "a", [1], TokenLogprob(1, -0.1, {}), None)
    first = box._pending[0].logprobs
    for i in range(1000):
        box.put(0, "a", [1], TokenLogprob(i, -0.1, {}), None)
    assert box._pending[0].logprobs is first and first is not None and len(first) == 1001


async def test_a_blocked_waiting_head_hashes_its_prompt_once(tiny_llama: Path, monkeypatch: Any) -> None:
    """Defect 12: a waiting head blocked by the pool re-hashed its whole prompt every step."""
    import asyncpage.kv.cache as kvc

    calls = 0
    real = kvc.chain_digest

    def counting(*a: Any) -> bytes:
        nonlocal calls
        calls += 1
        return real(*a)

    monkeypatch.setattr(kvc, "chain_digest", counting)
    engine = tiny_engine(tiny_llama, num_kv_blocks=40)
    async with engine:
        # The first request holds most of the pool for ~40 steps; the second waits at the head.
        long_prompt = PROMPTS[2] * 2
        await asyncio.gather(engine.generate(long_prompt, SamplingParams(max_tokens=40, ignore_eos=True)),
                             engine.generate(long_prompt + " tail", SamplingParams(max_tokens=2)))
        n_prompt = len(await engine.tokenize(long_prompt + " tail"))
    # Lookups plus registrations of both sequences: a few times the block count, not once per step.
    assert calls < 6 * (n_prompt // 4 + 12)
