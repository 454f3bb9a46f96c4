"""Bursts: runs of plain steps that stay on the compute thread (EngineCore._burst), and which steps
are plain.

Without them each step crosses threads twice (the event loop hands the step to the compute thread,
and is woken for its result): 0.30-0.38 ms of a one-stream decode step, most of it waiting for the
GIL. In a burst, while no add, abort or other job waits and a step ends no request, the compute
thread commits the step's tokens to the scheduler itself, posts their output (detokenizer, mailbox)
to the event loop, and schedules, prepares and executes the next step. The event loop's coroutine
waits on the burst the whole time and touches no loop state meanwhile (`stats()` reads the snapshot
published before and during the burst), so the loop's state still has one owner at a time; what a
caller reads (the mailbox, a request's `finished`) changes on the event loop only, in step order.

A step whose commit may end a request (a stop token, a length, a grammar completing, a stop string,
a beam choosing, a failure) or that has other parts (drafts verified, prompt log-probabilities)
returns to the event loop uncommitted, and is committed there. A request whose output fails on the
event loop during a burst (its detokenizer, say) ends the burst and is failed alone at the loop's next
safe point. Engines whose other threads post work that touches the pool (disagg/cores.py) have no
bursts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from functools import partial

from asyncpage.core.output import OutputProcessor
from asyncpage.core.request import Request, Sequence
from asyncpage.core.runner import StepBatch, StepResult
from asyncpage.core.scheduler import Scheduler, SchedulerOutput
from asyncpage.outputs import TokenLogprob
from asyncpage.runtime.eventloop import LoopHandle


def burstable(out: SchedulerOutput) -> bool:
    """Whether the step's sequences could commit on the compute thread: none has a grammar, stop
    strings, a beam search, drafts or prompt log-probabilities (their commits stay on the event loop)."""
    for sched in out.scheduled:
        req = sched.seq.request
        if sched.draft or req.beam is not None or req.scoring_prompt:
            return False
        for seq in sched.samples:
            if seq.matcher is not None or seq.params.stop:
                return False
    return True


def plain(scheduler: Scheduler, out: SchedulerOutput, batch: StepBatch, result: StepResult) -> bool:
    """Whether committing this executed step ends no request and changes nothing but tokens (no stop
    token or length, failure, grammar, beam, draft or prompt log-probabilities)."""
    if not burstable(out) or batch.scored or batch.verifies or result.failed or result.forced or \
            result.grammar_done or result.beams or result.accepted:
        return False
    tokens = dict(zip(result.seq_ids, result.sampled.tokens, strict=True))
    try:
        return not any(scheduler.ends(seq, tokens[seq.seq_id]) for sched in out.scheduled for seq in sched.samples)
    except Exception:  # a sequence's own bookkeeping: the event loop's commit fails its request alone
        return False


class Posted:
    """Bursts' output on its way to the event loop, in step order, and the requests whose output failed
    there."""

    def __init__(self, output: OutputProcessor) -> None:
        self.output = output
        self._steps: deque[Callable[[], None]] = deque()  # each step's emit, not yet run
        self._loop: LoopHandle | None = None
        # (request, error): a request whose output failed during a burst (on the event loop, or its tokens'
        # bookkeeping on the compute thread), ended by the loop at its next safe point (take_failed).
        self.failed: deque[tuple[Request, BaseException]] = deque()
        self._failing: set[int] = set()  # their request ids (the event loop's own)

    def open(self, loop: LoopHandle) -> None:
        """On the event loop, as the engine loop starts."""
        self._loop = loop

    def close(self) -> None:
        """On the event loop, as the engine loop ends (no burst runs)."""
        self.flush()
        self._loop = None

    def post(self, updates: list[tuple[Sequence, list[int]]], logprobs: dict[int, TokenLogprob | None],
             now: float) -> None:
        """From the burst (compute thread): this step's output, emitted on the event loop after the next
        `wake()` (or when the burst returns: the loop flushes then)."""
        self._steps.append(partial(self.emit, updates, logprobs, now))

    def wake(self) -> None:
        """From the burst (compute thread): have the event loop run what was posted. Called as the next
        step starts: the event loop's thread, woken, takes the GIL as this thread's send to its self-pipe
        lets it go, and runs its part before the step's forward rather than inside it."""
        if self._steps and self._loop is not None:
            self._loop.call_soon_threadsafe(self.flush)

    def flush(self) -> None:
        """On the event loop: every step posted so far, in order (after `wake`, and the loop's own call as
        a burst returns, before it commits anything)."""
        while self._steps:
            self._steps.popleft()()

    def emit(self, updates: list[tuple[Sequence, list[int]]], logprobs: dict[int, TokenLogprob | None],
             now: float) -> None:
        """A burst step's output, on the event loop: detokenized, into each request's mailbox."""
        for seq, tokens in updates:
            req = seq.request
            if req.request_id in self._failing:
                continue  # failed in an earlier step of the burst: it is over
            try:
                self.output.process(seq, tokens, logprobs.get(seq.seq_id), now)
            except Exception as exc:
                self._failing.add(req.request_id)
                self.failed.append((req, exc))

    def take_failed(self) -> list[tuple[Request, BaseException]]:
        """The failed requests, for the loop to end (on the event loop, at a safe point)."""
        out = []
        while self.failed:
            req, error = self.failed.popleft()
            self._failing.discard(req.request_id)
            out.append((req, error))
        return out
