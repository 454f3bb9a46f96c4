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
  timeout is not (GrammarTimeoutError): it may be the load of the moment, so a later ask compiles again;
- memory is bounded by bytes, not by count alone: a spec's text is at most MAX_SPEC_BYTES (MAX_GRAMMAR_BYTES
  for grammar text), the cache is keyed by a SHA-256 of the spec and never keeps its text, and holds
  outcomes up to `cache_bytes` of estimated size (entry_bytes); the specs compiling or waiting to
  hold at most MAX_FLIGHT_BYTES of text (more are refused at once, as past MAX_QUEUED).
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

import hashlib
import json
import logging
import threading
import time
import weakref
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import anyio

from asyncpage.errors import GrammarError, GrammarTimeoutError, InvalidRequestError
from asyncpage.guided.backend import NO_DEADLINE, CompiledGrammar, CompileTimeout, Deadline, GrammarBackend, GuidedSpec
from asyncpage.guided.budget import StartPlan
from asyncpage.guided.search import Steps
from asyncpage.runtime.eventloop import LoopHandle

log = logging.getLogger("asyncpage")

BACKENDS = ("llguidance", "xgrammar")
MAX_QUEUED = 256
START_SLICE = 0.02  # seconds of start search between two looks for waiting compiles
MAX_PLANS = 256  # start searches waiting at once
# One spec's text. A JSON Schema, regex or choice list past 256 KiB is no request's honest need. Grammar
# text is allowed more: grounded extraction's per-record grammar holds the record's words (about 2.5
# bytes of grammar per byte of text, so 2 MiB is a record of ~200k tokens), and it is dropped from the
# cache when its record ends.
MAX_SPEC_BYTES = 256 << 10
MAX_GRAMMAR_BYTES = 2 << 20
# A choice list's options are one alternation of literals: llguidance's lexer ran out of room ("too many
# expressions constructed") mid-output on one option of 200,000 characters and on four of 65,536; it took four
# of 16,384 and 20,000 options of 10. An option longer than this is refused at once.
MAX_CHOICE_OPTION_BYTES = 16 << 10
CACHE_BYTES = 64 << 20  # the default budget of the cache's outcomes (entry_bytes each)
MAX_FLIGHT_BYTES = 64 << 20  # spec text compiling or waiting to, all specs together
# A compiled grammar's size where its library does not say: about 3x its spec text with llguidance
# (measured: a 240 KB schema's grammar and matchers took 0.6 MB), plus what every entry costs anyway.
COMPILED_PER_BYTE = 4
ENTRY_OVERHEAD = 16 << 10


def spec_key(spec: GuidedSpec) -> bytes:
    """What the cache and the in-flight table key a spec by: a digest, never the text itself."""
    h = hashlib.sha256(spec.kind.encode())
    h.update(b"\0")
    h.update(spec.value.encode("utf-8", "surrogatepass"))  # a lone surrogate in a regex still hashes
    return h.digest()


def spec_bytes(spec: GuidedSpec) -> int:
    return len(spec.value.encode("utf-8", "surrogatepass"))


def check_spec_size(spec: GuidedSpec) -> None:
    """GrammarError naming the spec's kind (json_schema, regex, choice, grammar) when its text is
    larger than it may be."""
    limit = MAX_GRAMMAR_BYTES if spec.kind == "grammar" else MAX_SPEC_BYTES
    if len(spec.value) > limit or spec_bytes(spec) > limit:  # a str's length is at most its UTF-8 size
        raise GrammarError(spec.kind, f"the {spec.kind} is {spec_bytes(spec)} bytes; at most {limit} are accepted")
    if spec.kind == "choice" and len(spec.value) > MAX_CHOICE_OPTION_BYTES:
        longest = max((len(str(o).encode("utf-8", "surrogatepass")) for o in json.loads(spec.value)), default=0)
        if longest > MAX_CHOICE_OPTION_BYTES:
            raise GrammarError(spec.kind, f"a choice option is {longest} bytes; at most {MAX_CHOICE_OPTION_BYTES} "
                                          "are accepted")


def entry_bytes(spec: GuidedSpec, outcome: CompiledGrammar | GrammarError) -> int:
    """An estimate of what caching `outcome` keeps alive: a refusal its message; a compiled grammar
    its library's own figure where it gives one (xgrammar's memory_size_bytes), else COMPILED_PER_BYTE
    per byte of spec text."""
    if isinstance(outcome, GrammarError):
        return ENTRY_OVERHEAD + len(outcome.message) + len(outcome.field)
    reported = getattr(outcome, "memory_size_bytes", None)
    if isinstance(reported, int) and reported >= 0:
        return ENTRY_OVERHEAD + reported
    return ENTRY_OVERHEAD + COMPILED_PER_BYTE * spec_bytes(spec)


def _ignore_errors(fn: Any) -> None:
    try:
        fn()
    except Exception:  # remembered by backend(); every compile re-raises it as a GrammarError
        pass


class _Flight:
    """One compile in progress and the callers waiting for it."""

    def __init__(self, future: Future[CompiledGrammar], nbytes: int) -> None:
        self.future = future
        self.waiters = 0
        self.nbytes = nbytes  # its spec's text, counted against MAX_FLIGHT_BYTES


class GrammarManager:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], backend: str = "llguidance",
                 compile_timeout: float = 5.0, cache_size: int = 256, cache_bytes: int = CACHE_BYTES) -> None:
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
        # spec_key -> (outcome, entry_bytes): at most `cache_size` entries and `cache_bytes` of them.
        self._cache: OrderedDict[bytes, tuple[CompiledGrammar | GrammarError, int]] = OrderedDict()
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        self.cached_bytes = 0  # the estimated size of what the cache holds now
        self._flights: dict[bytes, _Flight] = {}
        self.flight_bytes = 0  # the spec text compiling or waiting to
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
        `compile_timeout` seconds the caller gets a GrammarError; the engine is unaffected. A spec
        larger than MAX_SPEC_BYTES (MAX_GRAMMAR_BYTES for grammar text) is refused at once."""
        check_spec_size(spec)
        key = spec_key(spec)
        entry = self._cache.get(key)
        if entry is not None:
            self._cache.move_to_end(key)
            hit = entry[0]
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
        flight = self._flights.get(key)
        if flight is None:
            if len(self._flights) >= MAX_QUEUED:
                raise GrammarError(spec.kind, f"{MAX_QUEUED} grammars are already compiling; try again shortly")
            nbytes = spec_bytes(spec)
            if self._flights and self.flight_bytes + nbytes > MAX_FLIGHT_BYTES:
                raise GrammarError(spec.kind, f"{self.flight_bytes} bytes of grammars are already compiling; "
                                              "try again shortly")
            with self._waiting_lock:
                self._compiles_waiting += 1
            try:
                flight = _Flight(self._executor.submit(self._compile_job, spec, Deadline(self.compile_timeout)),
                                 nbytes)
            except BaseException:
                with self._waiting_lock:
                    self._compiles_waiting -= 1
                raise
            self._flights[key] = flight
            self.flight_bytes += nbytes
            flight.future.add_done_callback(
                lambda _: loop.call_soon_threadsafe(lambda: self._settle(spec, key, flight)))
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
                self._unfly(key, flight)  # nobody wants it and it never started: it never will
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

    def _unfly(self, key: bytes, flight: _Flight) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]
            self.flight_bytes -= flight.nbytes

    def _settle(self, spec: GuidedSpec, key: bytes, flight: _Flight) -> None:
        """On the loop, once a compile ends: cache its outcome (success or GrammarError)."""
        self._unfly(key, flight)
        if flight.future.cancelled():
            return
        exc = flight.future.exception()
        if exc is None:
            self._remember(spec, key, flight.future.result())
        elif isinstance(exc, GrammarError):
            # A fresh one: the raised error's traceback holds the compile's frames, and with them the
            # spec's text and its parsed schema.
            self._remember(spec, key, GrammarError(exc.field, exc.message))

    def forget(self, spec: GuidedSpec | None) -> None:
        """Drop `spec` from the cache (on the loop): a grammar made for one record (grounded
        extraction embeds its text) is of no use once that record is done."""
        if spec is not None:
            entry = self._cache.pop(spec_key(spec), None)
            if entry is not None:
                self.cached_bytes -= entry[1]

    def _remember(self, spec: GuidedSpec, key: bytes, outcome: CompiledGrammar | GrammarError) -> None:
        cost = entry_bytes(spec, outcome)
        old = self._cache.pop(key, None)
        if old is not None:
            self.cached_bytes -= old[1]
        if cost > self._cache_bytes:
            return  # larger than the whole budget: it would only evict everything else
        self._cache[key] = (outcome, cost)
        self.cached_bytes += cost
        while len(self._cache) > self._cache_size or self.cached_bytes > self._cache_bytes:
            _, (_, gone) = self._cache.popitem(last=False)
            self.cached_bytes -= gone

