"""GrammarManager: one per engine. Adapts the tokenizer to the backend once, compiles off the event
loop under a time bound, and caches compiled grammars by spec (the tokenizer is fixed per manager).

A schema is untrusted input, so a hostile one must cost a bounded amount of CPU for a bounded time:
- one compile thread per manager: however many slow schemas arrive, at most one core compiles;
- single flight: N concurrent requests with the same new spec share one compile;
- llguidance's own resource limits (lexer fuel, grammar size) end any compile in bounded work;
- each compile's deadline starts when it is asked for, not when it runs: a queue of hostile specs
  costs at most one core until the last of their deadlines; a compile nobody waits for any more is
  cancelled before it starts, and at most MAX_QUEUED specs may wait (more are refused at once);
- refusals are cached like successes (a spec the engine refused is refused again instantly); a
  timeout is not (GrammarTimeoutError): it may be the load of the moment, so a later ask compiles again.
The cache and the in-flight table are touched on the event loop only; the compile thread only
compiles and reports back through the loop.

Budget closing needs each grammar's completion from its start state (budget.StartPlan). That search
runs on the compile thread too, right after the compile and outside its time bound (a slow search
must not fail a good grammar), so the compute thread never stalls a step on it. Compiles come first:
searches run in slices of START_SLICE seconds, and between two slices any compile asked meanwhile
runs; each search stops after budget.START_SECONDS of its own time, at most MAX_PLANS wait (more
are dropped), and one whose grammar nobody holds any more is skipped. Until a grammar's search is done
its sequences close without a start completion (budget.CloseState.adopt_anchor).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import anyio

from asyncpage.errors import GrammarError, GrammarTimeoutError, InvalidRequestError
from asyncpage.eventloop import LoopHandle
from asyncpage.guided.backend import (
    NO_DEADLINE,
    CompiledGrammar,
    CompileTimeout,
    Deadline,
    GrammarBackend,
    GuidedSpec,
)
from asyncpage.guided.budget import StartPlan
from asyncpage.guided.search import Steps

log = logging.getLogger("asyncpage")

BACKENDS = ("llguidance", "xgrammar")
MAX_QUEUED = 256
START_SLICE = 0.02  # seconds of start search between two looks for waiting compiles
MAX_PLANS = 256  # start searches waiting at once


def _ignore_errors(fn: Any) -> None:
    try:
        fn()
    except Exception:  # remembered by backend(); every compile re-raises it as a GrammarError
        pass


class _Flight:
    """One compile in progress and the callers waiting for it."""

    def __init__(self, future: Future[CompiledGrammar]) -> None:
        self.future = future
        self.waiters = 0


class GrammarManager:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], backend: str = "llguidance",
                 compile_timeout: float = 5.0, cache_size: int = 256) -> None:
        if backend not in BACKENDS:
            raise InvalidRequestError("guided_backend", f"must be one of {BACKENDS}, got {backend!r}")
        self.backend_name = backend
        self.compile_timeout = compile_timeout
        self.vocab_size = vocab_size  # the grammar engine's vocabulary: max(tokenizer, logits width)
        self._tokenizer = tokenizer
        self._stop = sorted(stop_token_ids)
        self._backend: GrammarBackend | None = None
        self._backend_error: GrammarError | None = None
        self._backend_lock = threading.Lock()
        self._cache: OrderedDict[GuidedSpec, CompiledGrammar | GrammarError] = OrderedDict()
        self._cache_size = cache_size
        self._flights: dict[GuidedSpec, _Flight] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="asyncpage-grammar")
        # Start searches (compile thread only, but for the count of compiles waiting, under the lock).
        self._plans: deque[weakref.ref[StartPlan]] = deque()
        self._plan_running: Steps | None = None
        self._pump_queued = False
        self._compiles_waiting = 0
        self._waiting_lock = threading.Lock()
        self._waiters: set[anyio.Event] = set()  # callers waiting for a compile (loop only)

    def backend(self) -> GrammarBackend:
        """Built on first use (a second or two for a 262k vocabulary), in whatever thread asks. A
        tokenizer the backend cannot adapt fails once, and every later call fails the same way."""
        with self._backend_lock:
            if self._backend_error is not None:
                raise self._backend_error
            if self._backend is None:
                try:
                    if self.backend_name == "llguidance":
                        from asyncpage.guided.llg import LLGuidanceBackend

                        self._backend = LLGuidanceBackend(self._tokenizer, self.vocab_size, self._stop)
                    else:
                        from asyncpage.guided.xgr import XGrammarBackend

                        self._backend = XGrammarBackend(self._tokenizer, self.vocab_size, self._stop)
                except Exception as exc:
                    self._backend_error = GrammarError(
                        "guided_backend", f"{self.backend_name} cannot use this tokenizer: {exc}")
                    raise self._backend_error from exc
            return self._backend

    def prepare(self, share_with: GrammarManager | None = None) -> None:
        """Build the backend now (at load, not under a running loop), or take `share_with`'s when it
        adapted the same tokenizer for the same backend. A tokenizer the backend cannot use does not
        fail the load: guided requests get the GrammarError instead."""
        if (share_with is not None and share_with._tokenizer is self._tokenizer
                and share_with.backend_name == self.backend_name and share_with.vocab_size == self.vocab_size):
            with share_with._backend_lock:
                self._backend, self._backend_error = share_with._backend, share_with._backend_error
            if self._backend is not None or self._backend_error is not None:
                return
        _ignore_errors(self.backend)

    def compile_sync(self, spec: GuidedSpec, deadline: Deadline = NO_DEADLINE) -> CompiledGrammar:
        """Compile in the calling thread, uncached (tools and tests; the engine uses `compile`)."""
        return self.backend().compile(spec, deadline)

    async def compile(self, spec: GuidedSpec) -> CompiledGrammar:
        """The compiled grammar for `spec`, from the cache or the compile thread. Past
        `compile_timeout` seconds the caller gets a GrammarError; the engine is unaffected."""
        hit = self._cache.get(spec)
        if hit is not None:
            self._cache.move_to_end(spec)
            if isinstance(hit, GrammarError):
                raise GrammarError(hit.field, hit.message)
            return hit
        loop = LoopHandle.current()
        if self._backend is None and self._backend_error is None:
            # Adapting the tokenizer (seconds for a 262k vocabulary) is not the grammar's time: built once,
            # on the compile thread, before any time bound starts.
            built = anyio.Event()
            self._executor.submit(_ignore_errors, self.backend).add_done_callback(
                lambda _: loop.call_soon_threadsafe(built.set))
            await built.wait()
        flight = self._flights.get(spec)
        if flight is None:
            if len(self._flights) >= MAX_QUEUED:
                raise GrammarError(spec.kind, f"{MAX_QUEUED} grammars are already compiling; try again shortly")
            with self._waiting_lock:
                self._compiles_waiting += 1
            try:
                flight = _Flight(self._executor.submit(self._compile_job, spec, Deadline(self.compile_timeout)))
            except BaseException:
                with self._waiting_lock:
                    self._compiles_waiting -= 1
                raise
            self._flights[spec] = flight
            flight.future.add_done_callback(lambda _: loop.call_soon_threadsafe(lambda: self._settle(spec, flight)))
        flight.waiters += 1
        done = anyio.Event()
        flight.future.add_done_callback(lambda _: loop.call_soon_threadsafe(done.set))
        self._waiters.add(done)
        try:
            with anyio.move_on_after(self.compile_timeout):
                await done.wait()
        finally:
            self._waiters.discard(done)
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.future.done() and flight.future.cancel():
                self._flights.pop(spec, None)  # nobody wants it and it never started: it never will
                with self._waiting_lock:
                    self._compiles_waiting -= 1
                self._executor.submit(self._schedule_plans)  # searches that gave way to it go on
        timeout = GrammarTimeoutError(spec.kind, f"compiling the {spec.kind} took longer than "
                                                 f"{self.compile_timeout:g} s")
        if done.is_set() and not flight.future.done():
            raise GrammarError(spec.kind, "the engine stopped while the grammar was compiling")
        if not flight.future.done() or flight.future.cancelled():
            log.warning("grammar compilation gave up after %.1f s (%s)", self.compile_timeout, spec.kind)
            raise timeout
        try:
            return flight.future.result()
        except CompileTimeout:
            raise timeout from None
        except GrammarError as exc:
            raise GrammarError(exc.field, exc.message) from None
        except Exception as exc:  # a backend bug must still reach the caller as a typed error
            raise GrammarError(spec.kind, f"the grammar could not be compiled: {exc!r}") from exc

    def interrupt(self) -> None:
        """On the loop, as the engine stops: every caller waiting for a compile stops waiting (with a
        GrammarError the engine turns into EngineNotRunningError), not at its compile timeout. The
        compiles themselves go on, and are cached as usual."""
        for done in list(self._waiters):
            done.set()

    def _compile_job(self, spec: GuidedSpec, deadline: Deadline) -> CompiledGrammar:
        """On the compile thread: the compile, then its start search queued behind any other compile."""
        with self._waiting_lock:
            self._compiles_waiting -= 1
        try:
            compiled = self.compile_sync(spec, deadline)
            plan: StartPlan | None = getattr(compiled, "start_plan", None)
            if plan is not None and not plan.done:
                if len(self._plans) < MAX_PLANS:
                    self._plans.append(weakref.ref(plan))
                else:
                    log.warning("%d start searches are waiting: one is dropped (its sequences close without it)",
                                MAX_PLANS)
            return compiled
        finally:
            self._schedule_plans()  # searches a slice left for this compile go on behind the next one

    def _schedule_plans(self) -> None:
        """On the compile thread: one _plan_slice job queued, behind whatever is queued now."""
        if not self._pump_queued and (self._plans or self._plan_running is not None):
            self._pump_queued = True
            self._executor.submit(self._plan_slice)

    def _plan_slice(self) -> None:
        """On the compile thread: advance the start searches for up to START_SLICE seconds, or until a
        compile is waiting (that compile queues the next slice when it ends)."""
        self._pump_queued = False
        end = time.monotonic() + START_SLICE
        while time.monotonic() < end:
            if self._compiles_waiting:
                return
            if self._plan_running is None:
                if not self._plans:
                    return
                plan = self._plans.popleft()()
                if plan is None or plan.done:
                    continue  # dropped with its grammar, or searched already (start_completion)
                self._plan_running = plan.steps()  # bounded by its own time (budget.START_SECONDS)
            try:
                next(self._plan_running)
            except StopIteration:
                self._plan_running = None
            except Exception:  # a backend bug: that grammar closes without a start completion
                log.exception("the start search of a grammar failed")
                self._plan_running = None
        self._schedule_plans()

    def _settle(self, spec: GuidedSpec, flight: _Flight) -> None:
        """On the loop, once a compile ends: cache its outcome (success or GrammarError)."""
        if self._flights.get(spec) is flight:
            del self._flights[spec]
        if flight.future.cancelled():
            return
        exc = flight.future.exception()
        if exc is None:
            self._remember(spec, flight.future.result())
        elif isinstance(exc, GrammarError):
            self._remember(spec, exc)

    def forget(self, spec: GuidedSpec | None) -> None:
        """Drop `spec` from the cache (on the loop): a grammar made for one record (grounded
        extraction embeds its text) is of no use once that record is done."""
        if spec is not None:
            self._cache.pop(spec, None)

    def _remember(self, spec: GuidedSpec, outcome: CompiledGrammar | GrammarError) -> None:
        self._cache[spec] = outcome
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

