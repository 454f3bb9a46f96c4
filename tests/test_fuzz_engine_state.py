"""Stateful fuzzing of the real engine (a tiny random Llama) with a hypothesis RuleBasedStateMachine.

The engine runs on a background event loop (an anyio blocking portal, asyncio or trio, drawn per
example); every engine call hops onto that loop, as an application thread would. Rules submit
requests with random parameters (n > 1, stop strings, seeds, greedy and sampled, top-k/top-p/min-p,
penalties, logprobs, guided regex/choice/JSON schema), read them to the end, cancel their consumers,
park them unread, drop them (plainly, inside reference cycles, on another thread, in the middle of
a step on the compute thread), abort them mid-step, and let the engine run. The pool is small, so
preemption happens in every example.

After every rule: the engine is healthy and the KV pool agrees with the block tables (checked on the
loop, and by `debug_checks=True` after every step). At the end of every example: each request the
test did not give up on completed with stop/length and the output the caller saw obeys its
parameters (n samples, max_tokens, no stop string in the text, logprobs per token, the grammar),
every request was reported once to `on_request_finished`, the pool is back to 0 used and no stream
is kept alive by the engine.

ASYNCPAGE_FUZZ_EXAMPLES / ASYNCPAGE_FUZZ_STEPS select a heavier profile (defaults: make test's).
"""

from __future__ import annotations

import gc
import json
import os
import re
import threading
import time
import weakref
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
import jsonschema
import pytest
from anyio.abc import TaskStatus
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from asyncpage import AsyncEngine, SamplingParams, StreamChunk
from asyncpage.core.stream import RequestStream
from asyncpage.errors import EngineLoopError
from asyncpage.outputs import FinishedRequest

T = TypeVar("T")

EXAMPLES = int(os.environ.get("ASYNCPAGE_FUZZ_EXAMPLES", "10"))
STEPS = int(os.environ.get("ASYNCPAGE_FUZZ_STEPS", "25"))
# Shrinking a failing interleaving can take minutes; off unless asked for (the failing steps are printed anyway).
SHRINK = os.environ.get("ASYNCPAGE_FUZZ_SHRINK", "") not in ("", "0")
TIMEOUT = 30.0  # seconds any single wait may take before the example fails (a hang is a defect)

_BASE: AsyncEngine | None = None  # the tiny engine every example clones (set by the test function)
_PREEMPTIONS: list[int] = []  # per example, to show that the small pool did preempt

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "def add(a, b):\n    return a + b\n",
    "héllo wörld ✓ 日本語 🙂",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10",
    "x",
]
REGEXES = [r"[a-c]{1,4}", r"(yes|no|maybe)", r"[0-9]{2}-[0-9]{2}", r"x+y?"]
CHOICES = [("yes", "no"), ("red", "green", "blue"), ("a", "ab", "abc")]
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["a"], "additionalProperties": False},
    {"enum": ["x", 1, None, True]},
    {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}, "b": {"type": "boolean"}},
     "required": ["s", "b"], "additionalProperties": False},
]
STOPS = ["e", "the", " ", "x y", "\n", "ox"]


@st.composite
def sampling_params(draw: st.DrawFn) -> SamplingParams:
    guided = draw(st.sampled_from([None, None, None, "regex", "choice", "json_schema"]))
    kw: dict[str, Any] = dict(
        max_tokens=draw(st.integers(1, 24)),
        temperature=draw(st.sampled_from([0.0, 0.0, 0.5, 1.0, 1.7])),
        n=draw(st.sampled_from([1, 1, 2, 3])),
        seed=draw(st.none() | st.integers(0, 2**40)),
        top_k=draw(st.sampled_from([0, -1, 1, 5, 50])),
        top_p=draw(st.sampled_from([1.0, 0.9, 0.3])),
        min_p=draw(st.sampled_from([0.0, 0.1])),
        presence_penalty=draw(st.sampled_from([0.0, 0.5, -1.0])),
        frequency_penalty=draw(st.sampled_from([0.0, 1.0])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.3, 0.8])),
        logprobs=draw(st.none() | st.integers(0, 4)),
        ignore_eos=draw(st.booleans()),
    )
    if guided is None:
        kw["stop"] = draw(st.lists(st.sampled_from(STOPS), max_size=2, unique=True))
        kw["stop_token_ids"] = draw(st.lists(st.integers(3, 319), max_size=2))
    elif guided == "regex":
        kw["regex"] = draw(st.sampled_from(REGEXES))
    elif guided == "choice":
        kw["choice"] = draw(st.sampled_from(CHOICES))
    else:
        kw["json_schema"] = draw(st.sampled_from(SCHEMAS))
    return SamplingParams(**kw)


prompts = st.one_of(st.sampled_from(TEXTS), st.lists(st.integers(3, 319), min_size=1, max_size=40))


@dataclass(eq=False)
class Rec:
    """One request as its caller sees it."""

    num: int
    prompt: str | list[int]
    params: SamplingParams
    chunks: list[StreamChunk] = field(default_factory=list)
    stream: RequestStream | None = None  # held while parked (not being read)
    stream_ref: weakref.ref[RequestStream] | None = None
    request: Any = None
    scope: anyio.CancelScope | None = None
    future: Future[None] | None = None
    error: BaseException | None = None
    done: bool = False
    given_up: bool = False  # cancelled, dropped or aborted by the test: no outcome is owed


class EngineMachine(RuleBasedStateMachine):
    parked = Bundle("parked")
    consuming = Bundle("consuming")

    def __init__(self) -> None:
        super().__init__()
        self.recs: list[Rec] = []
        self.finished: Counter[int] = Counter()
        self.midstep: list[Callable[[], None]] = []  # run on the compute thread inside the next step
        self.midstep_lock = threading.Lock()
        self.steps = 0
        self.portal: BlockingPortal | None = None
        self._portal_cm: AbstractContextManager[BlockingPortal] | None = None
        self._host: Future[None] | None = None
        self._stop: anyio.Event | None = None
        self._old_gc = gc.get_threshold()
        self.engine: AsyncEngine | None = None

    # ---- plumbing ----------------------------------------------------------------------------
    def eng(self) -> AsyncEngine:
        assert self.engine is not None
        return self.engine

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run `fn(*args)` on the engine's loop, bounded in time."""
        async def bounded() -> T:
            with anyio.fail_after(TIMEOUT):
                return await fn(*args)

        assert self.portal is not None
        return self.portal.call(bounded)

    def call_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the engine's loop, bounded in time (a loop that never gets to it has hung)."""
        assert self.portal is not None
        try:
            return self.portal.start_task_soon(fn, *args).result(TIMEOUT)
        except TimeoutError:
            raise AssertionError(f"the engine's loop did not run {fn!r} within {TIMEOUT} s") from None

    async def _run_engine(self, *, task_status: TaskStatus[None]) -> None:
        async with self.eng():
            self._stop = anyio.Event()
            task_status.started()
            await self._stop.wait()

    def _execute_hook(self, real: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def execute(batch: Any) -> Any:
            with self.midstep_lock:
                actions, self.midstep = self.midstep, []
            for action in actions:  # on the compute thread, while the loop awaits this step
                action()
            self.steps += 1
            return real(batch)

        return execute

    # ---- setup -------------------------------------------------------------------------------
    @initialize(backend=st.sampled_from(["asyncio", "trio"]), blocks=st.integers(24, 40),
                seqs=st.integers(4, 6), budget=st.sampled_from([16, 24, 32]),
                burst=st.lists(st.tuples(st.lists(st.integers(3, 319), min_size=16, max_size=36), sampling_params()),
                               min_size=3, max_size=5))
    def start(self, backend: str, blocks: int, seqs: int, budget: int,
              burst: list[tuple[list[int], SamplingParams]]) -> None:
        assert _BASE is not None
        # Frequent automatic collections: reference cycles holding streams are collected at arbitrary
        # points of the loop (inside schedule(), prepare(), commit) and on the compute thread.
        gc.set_threshold(100, 5, 5)
        self.blocks = blocks
        self.engine = _BASE.clone(num_kv_blocks=blocks, max_num_seqs=seqs, max_num_batched_tokens=budget,
                                  debug_checks=True)
        core = self.engine._core
        core.runner.execute = self._execute_hook(core.runner.execute)  # type: ignore[method-assign, assignment]
        self.engine.on_request_finished(self._on_finished)
        self._portal_cm = start_blocking_portal(backend)
        self.portal = self._portal_cm.__enter__()
        self._host, _ = self.portal.start_task(self._run_engine)
        # A burst of long requests at once: the small pool preempts in every example.
        for prompt, params in burst:
            long = SamplingParams(**{**_fields(params), "max_tokens": 24, "ignore_eos": True, "stop": (),
                                     "stop_token_ids": ()})
            self._start_consumer(Rec(len(self.recs), prompt, long))

    def _on_finished(self, done: FinishedRequest) -> None:
        self.finished[done.request_id] += 1

    # ---- requests ----------------------------------------------------------------------------
    def _start_consumer(self, rec: Rec, priority: int = 0) -> Rec:
        self.recs.append(rec)

        async def consume() -> None:
            with anyio.CancelScope() as scope:
                rec.scope = scope
                stream = self.eng().stream(rec.prompt, rec.params, priority=priority)
                rec.stream_ref = weakref.ref(stream)
                try:
                    async for chunk in stream:
                        rec.request = stream.request
                        rec.chunks.append(chunk)
                    rec.done = True
                except Exception as exc:
                    rec.error = exc
                finally:
                    rec.request = stream.request

        assert self.portal is not None
        rec.future = self.portal.start_task_soon(consume)
        return rec

    # Priorities mixed in (lower first): admission by rank, preemption by a higher one; none of it may
    # break the pool's invariants or what a request sees.
    @rule(target=consuming, prompt=prompts, params=sampling_params(), priority=st.integers(-2, 2))
    def submit_and_read_to_the_end(self, prompt: str | list[int], params: SamplingParams, priority: int) -> Rec:
        return self._start_consumer(Rec(len(self.recs), prompt, params), priority)

    @rule(target=parked, prompt=prompts, params=sampling_params(), reads=st.integers(1, 3), priority=st.integers(-2, 2))
    def submit_read_a_little_then_park(self, prompt: str | list[int], params: SamplingParams, reads: int,
                                       priority: int) -> Rec:
        rec = Rec(len(self.recs), prompt, params)
        self.recs.append(rec)

        async def park() -> None:
            stream = self.eng().stream(prompt, params, priority=priority)
            rec.stream, rec.stream_ref = stream, weakref.ref(stream)
            try:
                for _ in range(reads):
                    rec.chunks.append(await stream.__anext__())
                    rec.request = stream.request
            except StopAsyncIteration:
                rec.done = True
            except Exception as exc:
                rec.error = exc
            rec.request = stream.request

        self.call(park)
        return rec

    @rule(rec=consumes(parked))
    def resume_a_parked_stream(self, rec: Rec) -> None:
        async def rest() -> None:
            stream = rec.stream
            assert stream is not None
            if not rec.done and rec.error is None:
                try:
                    async for chunk in stream:
                        rec.chunks.append(chunk)
                    rec.done = True
                except Exception as exc:
                    rec.error = exc
            rec.stream = None

        self.call(rest)

    @rule(rec=consumes(parked), how=st.sampled_from(["loop", "cycle", "other-thread", "mid-step"]))
    def drop_a_parked_stream_without_closing_it(self, rec: Rec, how: str) -> None:
        rec.given_up = True
        stream, rec.stream = rec.stream, None
        assert stream is not None
        if how == "loop":  # the last reference goes on the engine's own loop
            holder = [stream]
            del stream
            self.call_sync(holder.clear)
        elif how == "cycle":  # kept alive by a reference cycle until some later collection
            cycle: list[Any] = [stream]
            cycle.append(cycle)
            del stream, cycle
        elif how == "other-thread":  # the finalizer runs on this (the test's) thread
            del stream
        else:  # the finalizer runs on the compute thread, in the middle of a step
            box = [stream]
            del stream
            with self.midstep_lock:
                self.midstep.append(box.clear)

    @rule(rec=consumes(parked))
    def aclose_a_parked_stream(self, rec: Rec) -> None:
        rec.given_up = True
        stream, rec.stream = rec.stream, None
        assert stream is not None

        async def close() -> None:
            await stream.aclose()
            if stream.request is not None:
                assert stream.request.released, "aclose() returned before the request's blocks were freed"

        self.call(close)

    @rule(rec=consumes(parked))
    def abort_a_parked_request_mid_step_from_the_compute_thread(self, rec: Rec) -> None:
        rec.given_up = True
        stream, rec.stream = rec.stream, None
        assert stream is not None
        request, engine = stream.request, self.eng()
        if request is not None:
            with self.midstep_lock:
                self.midstep.append(lambda: engine.abort(request))
        box = [stream]
        del stream
        self.call_sync(box.clear)

    @rule(rec=consumes(consuming), mid_step=st.booleans())
    def cancel_a_consumer_task(self, rec: Rec, mid_step: bool) -> None:
        rec.given_up = True
        scope = rec.scope
        if scope is None:  # not started yet: cancel the future, which cancels the task when it starts
            assert rec.future is not None
            rec.future.cancel()
            return
        if mid_step:
            loop = self.eng()._core.loop
            if loop is not None:
                with self.midstep_lock:
                    self.midstep.append(lambda: loop.call_soon_threadsafe(scope.cancel))
                return
        self.call_sync(scope.cancel)

    @rule(steps=st.integers(1, 8))
    def let_the_engine_run(self, steps: int) -> None:
        async def wait() -> None:
            target = self.steps + steps
            while self.steps < target:
                st_ = self.eng().stats()
                if not (st_.num_running or st_.num_waiting):
                    return
                await anyio.sleep(0.002)

        self.call(wait)

    @rule(where=st.sampled_from(["here", "loop"]))
    def collect_garbage(self, where: str) -> None:
        if where == "here":
            gc.collect()
        else:
            self.call_sync(gc.collect)

    @rule()
    def calling_from_another_thread_is_refused_and_stats_still_answer(self) -> None:
        engine = self.eng()

        async def elsewhere() -> None:
            await engine.generate("hi", SamplingParams(max_tokens=1))

        with pytest.raises(EngineLoopError):
            anyio.run(elsewhere)
        assert engine.stats().kv_blocks_total == self.blocks  # a snapshot, off the loop

    # ---- after every rule --------------------------------------------------------------------
    @invariant()
    def engine_is_healthy_and_the_pool_agrees_with_the_block_tables(self) -> None:
        if self.engine is None:
            return
        assert self.engine.healthy, self.engine.stats().engine_error
        # Not while a burst holds the state (it returns False then): the burst checks its own steps (debug_checks).
        self.call_sync(self.engine._core.check_invariants)

    # ---- the end of an example ---------------------------------------------------------------
    def teardown(self) -> None:
        try:
            if self.engine is not None:
                self._finish_example()
        finally:
            gc.set_threshold(*self._old_gc)
            if self.portal is not None and self._portal_cm is not None:
                if self._stop is not None:
                    self.call_sync(self._stop.set)
                if self._host is not None:
                    self._host.result(TIMEOUT)
                self._portal_cm.__exit__(None, None, None)

    def _finish_example(self) -> None:
        engine = self.eng()
        for rec in self.recs:  # parked streams nobody gave up on: read them to the end
            if rec.stream is not None:
                self.resume_a_parked_stream(rec)
        for rec in self.recs:
            if rec.future is not None and not rec.future.cancelled():
                try:
                    rec.future.result(TIMEOUT)
                except TimeoutError:
                    raise AssertionError(f"request {rec.num} ({rec.params}) never completed") from None
        with self.midstep_lock:  # actions queued after the last step: run them here
            actions, self.midstep = self.midstep, []
        for action in actions:
            action()
        gc.collect()

        async def idle() -> None:
            while True:
                st_ = engine.stats()
                if not (st_.num_running or st_.num_waiting or st_.kv_blocks_used):
                    return
                await anyio.sleep(0.005)

        self.call(idle)
        assert self.call_sync(engine._core.check_invariants)  # idle: no burst holds the state
        st_ = self.call_sync(engine.stats)
        assert engine.healthy, st_.engine_error
        assert st_.kv_blocks_used == 0 and st_.num_running == 0 and st_.num_waiting == 0, st_
        core = engine._core
        assert not core._requests and not core._adds and not core._aborts
        _PREEMPTIONS.append(st_.num_preemptions)
        for rec in self.recs:
            if rec.request is not None:
                assert rec.request.released, f"request {rec.num} was never released"
                assert self.finished[rec.request.request_id] == 1, \
                    f"request {rec.num}: on_request_finished called {self.finished[rec.request.request_id]} times"
            if not rec.given_up:
                check_outcome(rec, engine.tokenizer)
        gc.collect()
        alive = [r for r in self.recs if r.stream is None and r.stream_ref is not None and r.stream_ref()]
        assert not alive, f"streams kept alive after their callers dropped them: {[_describe(r) for r in alive]}"


def _describe(rec: Rec) -> str:
    stream = rec.stream_ref() if rec.stream_ref is not None else None
    holders = [type(o).__name__ for o in gc.get_referrers(stream)] if stream is not None else []
    return f"request {rec.num} (done={rec.done}, given_up={rec.given_up}, error={rec.error!r}) held by {holders}"


def _fields(p: SamplingParams) -> dict[str, Any]:
    return {f: getattr(p, f) for f in p.__struct_fields__}


def check_outcome(rec: Rec, tokenizer: Any) -> None:
    """What a caller who read a request to the end must have seen."""
    p = rec.params
    assert rec.error is None, f"request {rec.num} ({p}) failed: {rec.error!r}"
    assert rec.done, f"request {rec.num} did not finish"
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    lps: dict[int, list[Any]] = {}
    reasons: dict[int, str] = {}
    for c in rec.chunks:
        assert c.index not in reasons, f"request {rec.num}: sample {c.index} got a chunk after its last one"
        texts[c.index] = texts.get(c.index, "") + c.text
        ids.setdefault(c.index, []).extend(c.token_ids)
        lps.setdefault(c.index, []).extend(c.logprobs or [])
        if c.finish_reason is not None:
            reasons[c.index] = c.finish_reason
    assert sorted(reasons) == list(range(p.n)), f"request {rec.num}: finish reasons {reasons} for n={p.n}"
    for i in range(p.n):
        text, toks, reason = texts.get(i, ""), ids.get(i, []), reasons[i]
        where = f"request {rec.num} sample {i} ({p}): {text!r} {toks} {reason}"
        assert reason in ("stop", "length"), where
        assert len(toks) <= p.max_tokens, where
        if reason == "length" and not (p.guided and getattr(p, "budget_close", False)):
            # (A value the budget closed early ends with "length" and may be shorter than max_tokens.)
            assert len(toks) == p.max_tokens, where
        assert all(0 <= t < 320 for t in toks), where
        assert not any(s in text for s in p.stop), where
        if p.logprobs is not None:
            assert [lp.token_id for lp in lps[i]] == toks, where
            assert all(lp.logprob <= 1e-6 and len(lp.top) == p.logprobs for lp in lps[i]), where
        if reason == "stop" and p.guided:
            # The grammar constrains tokens; the streamed text is checked too where the prompt is text (a
            # token-id prompt ending inside a character leaks into the text: see test_fuzz_inputs).
            check_guided(p, tokenizer.decode(toks, skip_special_tokens=True), where)
            if isinstance(rec.prompt, str):
                check_guided(p, text, where)


def check_guided(p: SamplingParams, text: str, where: str) -> None:
    if p.regex is not None:
        assert re.fullmatch(p.regex, text), where
    elif p.choice is not None:
        assert text in p.choice, where
    elif p.json_schema is not None:
        jsonschema.validate(json.loads(text), p.json_schema)


def test_random_interleavings_keep_the_engine_healthy_and_leak_nothing(tiny_llama: Path) -> None:
    global _BASE
    _BASE = AsyncEngine.from_pretrained(str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=32,
                                        max_num_batched_tokens=16)
    _PREEMPTIONS.clear()
    threads_before = threading.active_count()
    try:
        run_state_machine_as_test(EngineMachine, settings=settings(
            max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, print_blob=True,
            # `make test` replays the same examples every run; ASYNCPAGE_FUZZ_RANDOM=1 explores new ones.
            derandomize=not os.environ.get("ASYNCPAGE_FUZZ_RANDOM"),
            phases=list(Phase) if SHRINK else [Phase.explicit, Phase.reuse, Phase.generate],
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    finally:
        _BASE = None
    assert sum(_PREEMPTIONS) > 0, _PREEMPTIONS  # the small pools did make the scheduler preempt
    # Every clone's threads (grammar compiles, masks) end with the clone: nothing accumulates per engine.
    deadline = time.monotonic() + 5
    while threading.active_count() > threads_before + 1 and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert threading.active_count() <= threads_before + 1, [t.name for t in threading.enumerate()]
