"""EngineCore: the state only the engine loop may touch, and the loop itself.

Everything here (scheduler, block pool, runner, the live requests) is read and written by one task
on one thread. Code outside the loop (the facade, streams, finalizers, other threads) reaches the
core through two methods, `add()` and `abort()`, which only queue; the loop applies the queues at its
safe points:

    apply aborts, then adds  ->  schedule  ->  prepare  ->  execute (compute thread)
                             ->  apply aborts  ->  commit (update + outputs)  ->  repeat

So no abort, however it arrives (a finalizer run by the garbage collector in the middle of
`schedule()`, a stream dropped on another thread), can change the scheduler between those points.
This is mini-sglang's "one point per iteration", and vLLM V1's EngineCore.

Runs of plain steps stay on the compute thread (`_burst`, core/burst.py), so that one stream's
decode steps cross no thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from typing import Any

import anyio
import msgspec
import torch

from asyncpage.core.burst import Posted, burstable, plain
from asyncpage.core.config import EngineConfig
from asyncpage.core.draft import DraftGate, DraftProposer, propose
from asyncpage.core.mailbox import Mailbox
from asyncpage.core.output import OutputProcessor
from asyncpage.core.request import Request, SeqStatus, Sequence
from asyncpage.core.runner import ModelRunner, StepBatch, StepResult
from asyncpage.core.scheduler import Scheduler, SchedulerOutput
from asyncpage.core.stats import engine_stats
from asyncpage.decoding.beam import BeamParams, BeamSearch
from asyncpage.decoding.ngram import TokenForms
from asyncpage.errors import (
    AsyncPageError,
    EngineDeadError,
    EngineNotRunningError,
    RequestFailedError,
    SamplingError,
)
from asyncpage.guided import CompiledGrammar
from asyncpage.kv.cache import BlockTable, KVCacheManager
from asyncpage.model.registry import CausalLM
from asyncpage.outputs import EngineStats, TokenLogprob
from asyncpage.params import SamplingParams
from asyncpage.runtime.compute import ComputeThread
from asyncpage.runtime.eventloop import LoopHandle

log = logging.getLogger("asyncpage")

# How stale a stats() read from another thread may be (the loop publishes a snapshot at most this often).
STATS_PERIOD_S = 0.05
# Consecutive failed draft proposals after which the draft model is given up (speculation off).
DRAFT_FAILURES = 3


class EngineCore:
    # Whether runs of plain steps stay on the compute thread (`_burst`); subclasses whose other threads
    # post work onto the event loop that touches the pool (disagg/cores.py) turn it off.
    BURSTS = True

    def __init__(self, config: EngineConfig, model: Any, tokenizer: Any, compute: ComputeThread,
                 mask_vocab_size: int, draft_model: CausalLM | None = None) -> None:
        """`draft_model`: the speculative "draft" method's model (its KV pool is made here)."""
        self.config = config
        self.compute = compute
        self.kv = KVCacheManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching,
                                 config.eviction_policy)
        self.runner = ModelRunner(model, config.num_kv_blocks, config.block_size, getattr(torch, config.dtype),
                                  torch.device(config.device), mask_vocab_size,
                                  kv_cache_dtype=getattr(torch, config.kv_cache_dtype or config.dtype),
                                  attention_backend=config.attention_backend)
        self.draft = None if draft_model is None else DraftProposer(
            draft_model, config.num_kv_blocks, config.block_size, getattr(torch, config.dtype),
            torch.device(config.device), self.runner.vocab_size, config.max_num_batched_tokens,
            config.enable_prefix_caching, config.attention_backend)
        spec = config.speculative
        self.draft_gate = DraftGate() if self.draft is not None and spec is not None and spec.auto_disable else None
        self.output = OutputProcessor(tokenizer)
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs,
                                   config.max_model_len, self.output.stop_strings(),
                                   config.speculative,
                                   TokenForms(tokenizer, self.runner.vocab_size) if spec is not None else None)
        # The two queues outside code may touch (deque append/popleft are atomic in CPython).
        self._adds: deque[Request] = deque()
        self._aborts: deque[Request] = deque()
        self.posted = Posted(self.output)  # bursts' output on its way to the event loop
        self._bursting = False  # a burst holds the loop's state (on the compute thread)
        self._requests: dict[int, Request] = {}
        self._ids = itertools.count(1)
        self._wake_event: anyio.Event | None = None
        self.loop: LoopHandle | None = None  # set while the loop runs
        self.stopping = False
        self.dead: EngineDeadError | None = None
        self._draft_failures = 0  # draft proposals that failed in a row (_propose_drafts)
        self._stats: EngineStats = self._compute_stats()
        self._stats_at = 0.0
        self._stats_dirty = False  # an add, abort or release since the last snapshot

    # ---- the only entry points from outside the loop -----------------------------------------
    def new_request(self, ids: list[int], params: SamplingParams, mailbox: Mailbox | None,
                    stop_token_ids: frozenset[int], compiled: CompiledGrammar | None,
                    beam: BeamParams | None = None, priority: int = 0, cache_key: str | None = None) -> Request:
        """A request object, not yet known to the scheduler (pure construction)."""
        req = Request(next(self._ids), ids, params, mailbox or Mailbox(),
                      frozenset() if params.ignore_eos else stop_token_ids, priority=priority, cache_key=cache_key)
        if beam is not None:
            req.beam = BeamSearch(beam, params.max_tokens, len(req.stop_ids))
        seq = Sequence(
            seq_id=self.scheduler.new_seq_id(), index=0, request=req, token_ids=list(ids),
            generator=self.scheduler.generator(req, 0), detokenizer=self.output.detokenizer(ids, params),
            num_prompt_tokens=len(ids), matcher=compiled.new_matcher() if compiled is not None else None)
        req.seqs.append(seq)
        return req

    def add(self, req: Request) -> None:
        self._adds.append(req)
        self.wake()

    def num_queued(self) -> int:
        """Requests handed over but not yet started: queued as adds, or waiting in the scheduler (a
        preempted sequence waits again, and counts)."""
        return len(self._adds) + len(self.scheduler.waiting)

    def abort(self, req: Request) -> None:
        """Safe from any thread and any code path (finalizers included): only queues."""
        if req.released or req.abort_requested:
            return
        req.abort_requested = True
        self._aborts.append(req)
        self.wake()

    def wake(self) -> None:
        loop, event = self.loop, self._wake_event
        if loop is None or event is None:
            return
        if loop.is_current():
            event.set()
        else:
            loop.call_soon_threadsafe(event.set)

    def stats(self) -> EngineStats:
        """Fresh on the loop's own thread, but while a burst holds the loop's state (core/burst.py): then
        the pool and queue figures are the snapshot published at the burst's start or since (at most
        STATS_PERIOD_S old), the request and token counts live. Elsewhere (a metrics scrape thread) the
        snapshot the loop last published, never state read while the loop changes it. Fresh too while
        no loop runs."""
        if self.loop is not None and not self.loop.is_current():
            return self._stats
        if self._bursting:  # the output processor's counters are the event loop's own
            return msgspec.structs.replace(self._stats, num_generated_tokens=self.output.num_generated,
                                           num_requests_finished=self.output.num_finished)
        return self._compute_stats()

    # ---- the loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        self.loop = LoopHandle.current()
        self.posted.open(self.loop)
        try:
            while True:
                self._apply_aborts()
                self._apply_failed()
                self._apply_adds()
                if self.stopping:
                    break
                if not self.scheduler.has_work:
                    if self.draft is not None:
                        self.draft.release_all()
                    self._publish_stats(force=True)
                    self._wake_event = anyio.Event()
                    if not (self._adds or self._aborts or self.stopping):
                        await self._wake_event.wait()
                    self._wake_event = None
                    continue
                t_iter = time.perf_counter()
                gated = await self._propose_drafts(self.draft) if self.draft is not None else False
                out = self.scheduler.schedule()
                if not out:
                    await anyio.sleep(0.001)  # nothing fits yet; should not happen, but never spin
                    continue
                batch = self.runner.prepare(out)
                if self.BURSTS and self.draft is None and burstable(out):
                    if self._stats_dirty:  # what stats() reads meanwhile: fresh after an add, abort or release
                        self._publish_stats(force=True)
                    self._bursting = True
                    try:
                        step = await self.compute.arun(self._burst, out, batch, interrupt=self._stop_burst)
                    finally:
                        self._bursting = False
                        self.posted.flush()  # every step it committed reaches its reader before what follows
                    if step is None:
                        continue
                    out, result = step
                else:
                    result = await self.compute.arun(self.runner.execute, batch)
                self._apply_aborts()  # aborts that arrived during the step land before it commits
                self._apply_failed()
                spec = self.scheduler.spec
                before = (spec.verify_steps, spec.accepted)
                self._commit(out, result)
                if gated and self.draft_gate is not None:
                    self.draft_gate.record(time.perf_counter() - t_iter, spec.verify_steps - before[0],
                                           spec.accepted - before[1])
                if self.config.debug_checks:
                    self.check_invariants()
                self._publish_stats()
        except Exception as exc:
            self._die(exc)
        finally:
            self.posted.close()
            self._close_all()
            self._publish_stats(force=True)
            self.loop = None

    async def _propose_drafts(self, draft: DraftProposer) -> bool:
        """The draft model's guesses (core/draft.py `propose`): after DRAFT_FAILURES in a row it is off."""
        sched = self.scheduler
        used = await propose(draft, self.draft_gate, self.compute, sched.spec, sched.running, sched.waiting)
        self._draft_failures = 0 if used is not None else self._draft_failures + 1
        if self._draft_failures >= DRAFT_FAILURES:
            log.error("the draft model failed %d steps in a row: speculation is off", self._draft_failures)
            self.draft = None
        return bool(used)

    # ---- bursts: on the compute thread, while the event loop's coroutine waits on them ---------------
    def _burst(self, out: SchedulerOutput, batch: StepBatch) -> tuple[SchedulerOutput, StepResult] | None:
        """Execute `batch`, then, as long as each step is plain and nothing waits, commit it here, post
        its output to the event loop and run the next. Returns a step executed but not committed (it
        may end a request, or something arrived meanwhile), or None when the burst stopped between steps."""
        while True:
            # The last step's output goes to the event loop as this one starts (burst.Posted.wake).
            self.posted.wake()
            result = self.runner.execute(batch)
            if self._interrupted() or not plain(self.scheduler, out, batch, result):
                return out, result
            now, logprobs, updates, failed = self._advance(out, result)
            self.posted.post(updates, logprobs, now)
            self.posted.failed.extend((seq.request, self._as_error(reason)) for seq, reason in failed)
            if self.config.debug_checks:
                self.check_invariants()
            self._publish_stats()
            if self._interrupted():
                return None
            self.compute.adapt()
            out = self.scheduler.schedule()
            if not out:
                return None
            batch = self.runner.prepare(out)

    def _stop_burst(self) -> None:
        """The loop's task was cancelled while a burst ran (arun waits for it): it ends after this step."""
        self.stopping = True

    def _interrupted(self) -> bool:
        """Something the event loop must apply first: an add, an abort, a failed output, a close, or
        another job for the compute thread (an engine sharing it)."""
        return bool(self._adds or self._aborts or self.posted.failed or self.stopping or self.compute.pending())

    def _apply_failed(self) -> None:
        for req, error in self.posted.take_failed():
            self._fail(req, error)

    def _apply_aborts(self) -> None:
        while self._aborts:
            req = self._aborts.popleft()
            if req.request_id in self._requests:
                for seq in req.seqs:
                    self.scheduler.finish(seq, "abort")
                self._tell_aborted(req)
                self._release(req)
            # else: still queued as an add (dropped there) or already over

    @staticmethod
    def _tell_aborted(req: Request) -> None:
        """Whoever still reads the request (an abort() from elsewhere) gets each open sample's end."""
        for i in range(req.params.n):
            seq = req.seqs[i] if i < len(req.seqs) else None
            if seq is None or seq.finish_reason == "abort":
                req.mailbox.put(i, "", [], None, "abort")

    def _drop_queued(self, req: Request, error: BaseException | None = None) -> None:
        """End a request the scheduler never took (it holds no block): its reader hears 'abort', or
        `error` (the loop is ending)."""
        for seq in req.seqs:
            seq.status, seq.finish_reason = SeqStatus.FINISHED, "abort"
        if error is None:
            self._tell_aborted(req)
        else:
            req.mailbox.fail(error)
        self._release(req)

    def _apply_adds(self) -> None:
        while self._adds:
            req = self._adds.popleft()
            if req.abort_requested:  # cancelled while queued: never prefilled, never scheduled
                self._drop_queued(req)
                continue
            self._requests[req.request_id] = req
            self.scheduler.add(req.seqs[0])
            self._stats_dirty = True

    def _advance(self, out: SchedulerOutput, result: StepResult) -> tuple[
            float, dict[int, TokenLogprob | None], list[tuple[Sequence, list[int]]],
            list[tuple[Sequence, str | AsyncPageError]]]:
        """The scheduler's half of a commit: timings, prompt log-probabilities, tokens appended, stops
        applied. Returns (now, logprobs by sequence, Scheduler.update's updates and failures)."""
        now = time.monotonic()
        scored = result.prompt_logprobs or {}
        for sched in out.scheduled:
            req = sched.seq.request
            if req.times.first_scheduled is None:
                req.times.first_scheduled = now
            first, entries = scored.get(sched.seq.seq_id, (-1, []))
            if first == len(req.prompt_logprobs):  # in order, chunk after chunk (a recomputed chunk adds nothing twice)
                req.prompt_logprobs += entries
        sampled = dict(zip(result.seq_ids, result.sampled.tokens, strict=True))
        logprobs = dict(zip(result.seq_ids, result.sampled.logprobs, strict=True))
        updates, failed = self.scheduler.update(out, sampled, result.grammar_done, result.forced, result.failed,
                                                result.beams, result.accepted)
        return now, logprobs, updates, failed

    def _commit(self, out: SchedulerOutput, result: StepResult) -> None:
        now, logprobs, updates, failed = self._advance(out, result)
        failing = {seq.request.request_id for seq, _ in failed}  # its failure is its end (below), not its beams
        for sched in out.scheduled:
            req = sched.seq.request
            if req.beam is not None and sched.samples and req.request_id in self._requests and \
                    req.request_id not in failing:
                req.times.first_token = req.times.first_token or now
                req.times.last_token = now
                if req.beam.done:
                    try:
                        self.output.beams(req)
                    except Exception as exc:
                        self._fail(req, exc)
                        continue
                    self._release(req)
        failed_here: set[int] = set()
        for seq, tokens in updates:
            req = seq.request
            if req.request_id in failed_here:
                continue  # another of its samples failed just now: the request is over
            try:
                # Logprobs exist only for sampled tokens; fast-forward is off for requests that ask for them.
                dropped = self.output.process(seq, tokens, logprobs.get(seq.seq_id), now)
                if dropped is not None:  # a stop string ended it
                    self.scheduler.stop(seq, dropped)
            except Exception as exc:
                failed_here.add(req.request_id)
                self._fail(req, exc)
                continue
            # (Released after its first sample when all ended in this step; its other samples still post.)
            if req.finished and req.request_id in self._requests:
                self._release(req)
        for seq, reason in failed:
            req = seq.request
            if req.request_id in self._requests:
                self._fail(req, self._as_error(reason))

    @staticmethod
    def _as_error(reason: str | AsyncPageError) -> AsyncPageError:
        return reason if isinstance(reason, AsyncPageError) else SamplingError(reason)

    def _fail(self, req: Request, error: BaseException) -> None:
        """End one request whose own work failed (its detokenizer, stop strings, grammar, sampling):
        its blocks are freed, its reader gets a typed error, and nothing else in the step is touched.
        This is the fence that keeps a per-request fault from becoming the engine's death."""
        if not isinstance(error, AsyncPageError):
            log.error("request %d failed on the engine loop; the engine goes on", req.request_id, exc_info=error)
            wrapped = RequestFailedError(f"this request failed while its output was processed "
                                         f"({type(error).__name__}); the engine goes on")
            wrapped.__cause__ = error
            error = wrapped
        if req.request_id not in self._requests:
            # Released in this step after another sample ended it (n > 1): its blocks are free and its hooks
            # have run, but this sample's reader still waits for an end; the error is that end.
            req.mailbox.fail(error)
            return
        for s in req.seqs:
            self.scheduler.finish(s, "abort")
        req.mailbox.fail(error)
        self._release(req)

    def _release(self, req: Request) -> None:
        """The loop is done with `req`: its blocks are free; tell whoever waits, then the hooks."""
        self._requests.pop(req.request_id, None)
        req.released = True
        self._stats_dirty = True
        if req.released_event is not None:
            req.released_event.set()
        self.output.report(req)

    def _die(self, exc: BaseException) -> None:
        log.error("asyncpage engine loop failed; failing every request", exc_info=exc)
        dead = EngineDeadError(f"the engine loop failed: {exc!r}")
        dead.__cause__ = exc
        self.dead = dead

    def _close_all(self) -> None:
        """The loop is ending (closed or dead): every request still here or queued hears why."""
        error: BaseException = self.dead or EngineNotRunningError("the engine was closed")
        self._apply_aborts()
        self._apply_failed()
        if self.draft is not None:
            self.draft.release_all()  # the compute thread is idle: its calls are awaited, shielded
        for req in list(self._requests.values()):
            for seq in req.seqs:
                self.scheduler.finish(seq, "abort")
            req.mailbox.fail(error)
            self._release(req)
        # Submitted during the last step (a step that failed, say): the scheduler never took them.
        while self._adds:
            self._drop_queued(self._adds.popleft(), error)

    # ---- helpers -----------------------------------------------------------------------------
    def _publish_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._stats_at >= STATS_PERIOD_S:
            self._stats = self._compute_stats()
            self._stats_at, self._stats_dirty = now, False

    def _compute_stats(self) -> EngineStats:
        return engine_stats(self.scheduler, self.kv, self.output, self.dead)

    def check_invariants(self) -> bool:
        """The pool agrees with the block tables (AssertionError otherwise): after every step with `debug_checks`,
        and by the tests when idle. False, nothing read, on the loop's thread while a burst holds the state (a
        sequence may be between the scheduler's lists; the burst checks its own steps)."""
        if self._bursting and self.loop is not None and self.loop.is_current():
            return False
        self.kv.check_invariants(self._live_tables())
        if self.draft is not None:
            self.draft.check_invariants()
        for s in [*self.scheduler.running, *self.scheduler.waiting]:
            assert s.request.request_id in self._requests, f"sequence {s.seq_id} of a released request is live"
        return True

    def _live_tables(self) -> list[tuple[BlockTable, int]]:
        """The block tables check_invariants counts, each with its owner's request id."""
        return [(s.table, s.request.request_id) for s in [*self.scheduler.running, *self.scheduler.waiting]]
