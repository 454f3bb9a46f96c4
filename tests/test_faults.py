"""Fault injection on a tiny random Llama: a forward that raises, a tokenizer that raises, a grammar
compile that hangs or raises, a finish callback that raises, a host loop blocked for a second, a NaN
logits row. Each fault reaches the callers it concerns as a typed error; everyone else keeps the
documented behaviour."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncpage import AsyncEngine, EngineDeadError, GrammarError, InvalidRequestError, SamplingParams
from asyncpage.errors import SamplingError
from asyncpage.guided import GuidedSpec
from asyncpage.outputs import FinishedRequest

from .conftest import fail_at_step

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = [f"Numbers: {i} {i + 1} and the quick brown fox " * (1 + i % 2) for i in range(6)]



def tiny_engine(path: Path, **kw: Any) -> AsyncEngine:
    opts: dict[str, Any] = dict(dtype="float32", block_size=4, num_kv_blocks=128, max_num_batched_tokens=32,
                                debug_checks=True)
    opts.update(kw)
    return AsyncEngine.from_pretrained(str(path), **opts)


async def until(done: Callable[[], bool], timeout: float = 10.0, every: float = 0.0005) -> None:
    """Wait for `done()`, asking every `every` seconds; a wait past `timeout` fails the test (never hangs the suite)."""
    with anyio.fail_after(timeout):
        while not done():
            await anyio.sleep(every)


async def idle(engine: AsyncEngine, timeout: float = 5.0) -> None:
    await until(lambda: not ((st := engine.stats()).num_running or st.num_waiting or st.kv_blocks_used), timeout, 0.01)


# ---- the forward pass --------------------------------------------------------------------------
async def test_a_forward_that_raises_fails_every_caller_calls_their_hooks_and_refuses_new_work(
        tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine = tiny_engine(tiny_llama)
    fail_at_step(engine, 4, "injected device failure")
    finished: list[FinishedRequest] = []
    engine.on_request_finished(finished.append)
    async with engine:
        parked = engine.stream("A parked reader", SamplingParams(max_tokens=40, ignore_eos=True))
        await parked.__anext__()  # submitted, then not read while the engine dies
        results = await asyncio.gather(*(engine.generate(p, GREEDY) for p in PROMPTS), return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        with pytest.raises(EngineDeadError):
            async for _ in parked:  # what it had received before the failure, then the error
                pass
        assert len(finished) == len(PROMPTS) + 1  # the hooks heard about every request the loop held
        assert all(set(f.finish_reasons) == {"abort"} for f in finished)
        for later in ("again", [5, 6, 7]):
            with pytest.raises(EngineDeadError):
                await engine.generate(later, GREEDY)
        assert not engine.healthy
        st = engine.stats()
        assert st.engine_error is not None and "injected device failure" in st.engine_error
        assert st.kv_blocks_used == 0 and st.num_running == 0 and st.num_waiting == 0
        # stats() answers from another thread as well.
        other: list[Any] = []
        t = threading.Thread(target=lambda: other.append(engine.stats()))
        t.start()
        t.join()
        assert other[0].engine_error == st.engine_error
    assert "injected device failure" in caplog.text


async def test_a_request_submitted_during_the_step_that_kills_the_engine_fails_too(tiny_llama: Path) -> None:
    """Queued while the failing step runs (the scheduler never took it): its caller gets the
    EngineDeadError like the running ones, and the engine closes cleanly."""
    engine = tiny_engine(tiny_llama)
    real = engine._core.runner.execute
    in_step, calls = threading.Event(), 0

    def slow_then_fail(batch: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:
            in_step.set()
            time.sleep(0.3)  # the compute thread: the host loop keeps taking submissions meanwhile
            raise RuntimeError("injected device failure")
        return real(batch)

    engine._core.runner.execute = slow_then_fail
    async with engine:
        running = [asyncio.create_task(engine.generate(p, GREEDY)) for p in PROMPTS[:3]]
        await anyio.to_thread.run_sync(in_step.wait)
        late = asyncio.create_task(engine.generate(PROMPTS[5], GREEDY))
        with anyio.fail_after(5):
            results = await asyncio.gather(*running, late, return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert engine.stats().kv_blocks_used == 0


# ---- the tokenizer -----------------------------------------------------------------------------
async def test_a_prompt_the_tokenizer_refuses_fails_alone_with_invalid_request(tiny_llama: Path) -> None:
    engine = tiny_engine(tiny_llama)
    real = engine.tokenizer

    class Raising:
        """The engine's tokenizer, except that it raises on prompts containing BOOM."""

        def __call__(self, text: str, *a: Any, **kw: Any) -> Any:
            if "BOOM" in text:
                raise RuntimeError("injected tokenizer failure")
            return real(text, *a, **kw)

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    engine.tokenizer = Raising()
    async with engine:
        running = asyncio.create_task(engine.generate("The quick brown fox", SamplingParams(max_tokens=30,
                                                                                           ignore_eos=True)))
        for bad in ("unpaired \ud800 surrogate", "BOOM", "BOOM " + "x" * 5000):  # inline and threaded paths
            with pytest.raises(InvalidRequestError) as e:
                await engine.generate(bad, GREEDY)
            assert e.value.field == "prompt"
        out = await running
        assert len(out.token_ids) == 30 and out.finish_reason == "length"
        assert len((await engine.generate("fine", GREEDY)).token_ids) == 16
        assert engine.healthy
        await idle(engine)


# ---- grammar compilation -----------------------------------------------------------------------
def patch_compile(engine: AsyncEngine, behave: Callable[[GuidedSpec], None]) -> list[GuidedSpec]:
    """Make the backend's compile run `behave(spec)` first; returns the list of specs compiled."""
    backend = engine.guided.backend()
    real = backend.compile
    seen: list[GuidedSpec] = []
    lock = threading.Lock()

    def compile(spec: GuidedSpec, *args: Any, **kw: Any) -> Any:
        with lock:
            seen.append(spec)
        behave(spec)
        return real(spec, *args, **kw)

    backend.compile = compile  # type: ignore[method-assign]
    return seen


async def test_a_hanging_grammar_compile_fails_its_callers_once_and_the_engine_keeps_serving(
        tiny_llama: Path) -> None:
    engine = tiny_engine(tiny_llama, grammar_compile_timeout=0.3)
    compile_ended = threading.Event()

    def behave(spec: GuidedSpec) -> None:
        if "SLOW" in spec.value:
            time.sleep(1.5)
            compile_ended.set()

    seen = patch_compile(engine, behave)
    slow = SamplingParams(regex="SLOW[a-c]{1,3}", max_tokens=8)
    async with engine:
        async def one_slow() -> BaseException | None:
            try:
                await engine.generate("x", slow)
            except BaseException as exc:
                return exc
            return None

        tasks = [asyncio.create_task(one_slow()) for _ in range(20)]
        await asyncio.sleep(0.05)
        # Meanwhile the engine serves others, compiled grammars included, well before the compile ends.
        free = await engine.generate("The quick brown fox", SamplingParams(max_tokens=10, ignore_eos=True))
        assert len(free.token_ids) == 10 and not compile_ended.is_set()
        errors = await asyncio.gather(*tasks)
        assert all(isinstance(e, GrammarError) and "longer than" in str(e) for e in errors), errors
        assert [s.value for s in seen].count("SLOW[a-c]{1,3}") == 1  # single flight: 20 callers, one compile
        assert engine.healthy
        await idle(engine)


async def test_a_grammar_compile_that_raises_fails_only_that_caller(tiny_llama: Path) -> None:
    engine = tiny_engine(tiny_llama)

    def behave(spec: GuidedSpec) -> None:
        if "BAD" in spec.value:
            raise RuntimeError("injected compiler crash")

    patch_compile(engine, behave)
    async with engine:
        running = asyncio.create_task(engine.generate("The quick brown fox", SamplingParams(
            max_tokens=20, ignore_eos=True)))
        with pytest.raises(GrammarError) as e:
            await engine.generate("x", SamplingParams(regex="BAD[a-c]", max_tokens=4))
        assert "injected compiler crash" in str(e.value)
        ok = await engine.generate("x", SamplingParams(choice=("yes", "no"), max_tokens=4, temperature=0))
        assert ok.text in ("yes", "no")
        assert len((await running).token_ids) == 20
        assert engine.healthy


async def test_many_distinct_slow_grammars_cost_one_compile_thread_and_never_stall_the_engine(
        tiny_llama: Path) -> None:
    engine = tiny_engine(tiny_llama, grammar_compile_timeout=0.2)
    active = 0
    peak = 0
    lock = threading.Lock()

    def behave(spec: GuidedSpec) -> None:
        nonlocal active, peak
        if "SLOW" in spec.value:
            with lock:
                active += 1
                peak = max(peak, active)
            time.sleep(0.6)
            with lock:
                active -= 1

    seen = patch_compile(engine, behave)
    async with engine:
        async def attempt(i: int) -> BaseException | None:
            try:
                await engine.generate("x", SamplingParams(regex=f"SLOW{i}[a-c]", max_tokens=4))
            except BaseException as exc:
                return exc
            return None

        errors = await asyncio.gather(*(attempt(i) for i in range(12)))
        assert all(isinstance(e, GrammarError) for e in errors), errors
        out = await engine.generate("The quick brown fox", SamplingParams(max_tokens=5, ignore_eos=True))
        assert len(out.token_ids) == 5
        assert peak == 1  # one compile at a time, whatever arrives
        # Compiles nobody waits for any more never start: at most the one that was running, plus one
        # that may have started just before its waiters gave up.
        assert len([s for s in seen if "SLOW" in s.value]) <= 2, seen
        assert engine.healthy


# ---- callbacks -----------------------------------------------------------------------------------
async def test_a_finish_callback_that_raises_is_logged_and_changes_nothing_else(
        tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine = tiny_engine(tiny_llama)
    seen: list[int] = []

    def bad(done: FinishedRequest) -> None:
        raise ValueError("injected callback failure")

    engine.on_request_finished(bad)
    engine.on_request_finished(lambda done: seen.append(done.request_id))
    with caplog.at_level(logging.ERROR, logger="asyncpage"):
        async with engine:
            outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in PROMPTS))
            assert all(len(o.token_ids) == 16 for o in outs)
            assert engine.healthy
            await idle(engine)
    assert len(seen) == len(PROMPTS)  # later callbacks still ran
    failures = [r for r in caplog.records if r.exc_info and "injected callback failure" in str(r.exc_info[1])]
    assert len(failures) == len(PROMPTS)


# ---- the host's event loop -----------------------------------------------------------------------
async def test_a_host_loop_blocked_for_a_second_delays_but_loses_nothing(tiny_llama: Path) -> None:
    engine = tiny_engine(tiny_llama)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    async with engine:
        expected = await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS))

        async def blocker() -> None:
            await asyncio.sleep(0.05)
            time.sleep(1.0)  # a host task that blocks the loop (a sync call in async code)

        b = asyncio.create_task(blocker())
        got = await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS))
        await b
        assert [o.token_ids for o in got] == [o.token_ids for o in expected]
        assert engine.healthy
        await idle(engine)


# ---- a NaN logits row --------------------------------------------------------------------------
async def test_a_nan_logits_row_fails_only_its_request_with_a_sampling_error(tiny_llama: Path) -> None:
    engine = tiny_engine(tiny_llama)
    core = engine._core
    model = core.runner.model
    real_execute = core.runner.execute
    real_logits = model.compute_logits
    victim_max_tokens = 17  # how the victim is recognised in a batch
    current: list[Any] = []
    poisoned = threading.Event()

    def execute(batch: Any) -> Any:
        current[:] = [batch]
        return real_execute(batch)

    def compute_logits(hidden: Any) -> Any:
        logits = real_logits(hidden)
        batch = current[0]
        if not poisoned.is_set() and not batch.forked:
            for row, spec in enumerate(batch.specs):
                if spec.params.max_tokens == victim_max_tokens and row < logits.shape[0]:
                    logits[row] = float("nan")
                    poisoned.set()
        return logits

    core.runner.execute = execute  # type: ignore[method-assign]
    model.compute_logits = compute_logits  # type: ignore[method-assign]  # the weights are shared with no other engine in this test
    finished: list[FinishedRequest] = []
    engine.on_request_finished(finished.append)
    try:
        async with engine:
            victim = asyncio.create_task(engine.generate("The victim", SamplingParams(
                max_tokens=victim_max_tokens, ignore_eos=True, temperature=0.8)))
            others = [asyncio.create_task(engine.generate(p, GREEDY)) for p in PROMPTS]
            with pytest.raises(SamplingError):
                await victim
            outs = await asyncio.gather(*others)
            assert all(len(o.token_ids) == 16 and o.finish_reason == "length" for o in outs)
            assert poisoned.is_set() and engine.healthy
            await idle(engine)
    finally:
        del model.compute_logits
    assert len(finished) == len(PROMPTS) + 1


# ---- aborting through the public abort() -----------------------------------------------------------
async def test_a_reader_of_a_request_aborted_with_engine_abort_is_told_instead_of_hanging(
        tiny_llama: Path) -> None:
    engine = tiny_engine(tiny_llama)
    async with engine:
        stream = engine.stream("The quick brown fox", SamplingParams(max_tokens=100, ignore_eos=True))
        await stream.__anext__()
        assert stream.request is not None
        engine.abort(stream.request)  # e.g. an admin endpoint cancelling a request by handle
        with anyio.fail_after(3):
            rest = [c async for c in stream]
        assert rest and rest[-1].finish_reason == "abort"


async def test_a_dead_engine_answers_openai_clients_with_503_not_a_crash(tiny_llama: Path) -> None:
    import openai

    engine = tiny_engine(tiny_llama)
    fail_at_step(engine, 2, "injected device failure")
    async with engine:
        client = engine.openai_client()
        with pytest.raises(openai.APIStatusError) as e:  # EOS ignored: the request reaches the failing step
            await client.completions.create(model="m", prompt="Hello there", max_tokens=8,
                                            extra_body={"ignore_eos": True})
        assert e.value.status_code == 503
        with pytest.raises(openai.APIStatusError) as e:  # every later request, and the model list, say so
            await client.completions.create(model="m", prompt="again", max_tokens=2)
        assert e.value.status_code == 503
        with pytest.raises(openai.APIStatusError) as e:
            await client.models.list()
        assert e.value.status_code == 503 and not engine.healthy


@pytest.mark.parametrize("where", ["accept", "fill_bitmask"])
async def test_a_grammar_matcher_that_raises_fails_only_its_request(tiny_llama: Path, where: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A grammar backend raising in one sequence's step (taking its token, or filling its mask) fails
    that request with a SamplingError; the free request beside it and the engine go on."""
    from asyncpage.guided.llg import LLGuidanceMatcher

    def boom(*args: Any) -> Any:
        raise RuntimeError("matcher exploded")

    async with tiny_engine(tiny_llama) as engine:
        free = asyncio.create_task(engine.generate(PROMPTS[0], GREEDY))
        monkeypatch.setattr(LLGuidanceMatcher, where, boom)
        with pytest.raises(SamplingError, match="matcher exploded"):
            await engine.generate("Hello", SamplingParams(regex="[a-z]{4}", max_tokens=8, budget_close=False))
        monkeypatch.undo()
        assert len((await free).token_ids) == GREEDY.max_tokens
        out = await engine.generate("Hello", SamplingParams(regex="[a-z]{4}", max_tokens=8))
        assert len(out.text) == 4 and engine.healthy
        await idle(engine)
