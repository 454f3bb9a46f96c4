"""Scheduler: which sequences run in the next step, and with how many tokens.

Each step has a token budget (`max_num_batched_tokens`). Running sequences come first, in admission
order: a decode takes one token, a partly prefilled prompt takes the next chunk. What budget is left
admits waiting sequences, first come first served, as prefill chunks in the same step. A sequence
that needs a block when none is free preempts the most recently admitted running sequence
(recompute: its blocks are freed and it goes back to the head of the queue). With priorities
(core/priority.py) the queue goes by rank, the one preempted is the worst-ranked, and while the best
priority present shares the engine with worse ones its rows come first and the worse ones' share of a
step is bounded (priority.URGENT_STEP_ROWS).
A beam search's beams step together: each step chooses among all their continuations at once
(core/beams.py), so their last tokens are scheduled in one step or not at all, a beam being recomputed
holds its last token until its siblings catch up, and preempting one beam preempts them all.
The scheduler never touches tensors; the runner turns its output into a batch.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from asyncpage.core.beams import BeamSteps
from asyncpage.core.groups import beam_group, beams_ready, partly_running, seat_count
from asyncpage.core.priority import URGENT_STEP_TOKENS, Priorities, rank
from asyncpage.core.request import Request, SeqStatus, Sequence
from asyncpage.core.speculation import FORCED_RUN, Speculation
from asyncpage.decoding.detokenizer import StopStrings
from asyncpage.decoding.ngram import TokenForms
from asyncpage.decoding.sampling import seeded_generator
from asyncpage.decoding.speculative import SpeculativeConfig
from asyncpage.errors import AsyncPageError, RequestFailedError
from asyncpage.kv.cache import KVCacheManager
from asyncpage.outputs import FinishReason

log = logging.getLogger("asyncpage")


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    # Sequences sampled from this row's logits (more than one when an n > 1 request forks).
    samples: list[Sequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # its copy-on-write, before the forward
    draft: list[int] = field(default_factory=list)  # speculated tokens computed after its last one


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    block_copies: list[tuple[int, int]]  # copy-on-write, done before the forward writes
    max_model_len: int = 1 << 62  # the context bound a sampled sequence's budget also counts against

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler(Priorities, BeamSteps):
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, stop_strings: StopStrings | None = None,
                 speculative: SpeculativeConfig | None = None, token_forms: TokenForms | None = None) -> None:
        """`stop_strings`: how beam search finds a stop string in a beam (none: beams ignore them);
        `token_forms`: the tokenizer's view of tokens, for the n-gram proposer (none: ids compared)."""
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.stop_strings = stop_strings
        self._seed_rng = random.SystemRandom()  # seeds of unseeded samples
        self.spec = Speculation(speculative, kv, max_model_len, token_forms)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._preempted: set[int] = set()  # this step's preempted sequences
        self._admitted: set[int] = set()  # ...and admitted ones
        self._seq_ids = itertools.count(1)  # next() is atomic
        self._rotation = 0  # whose turn among worse rows (Priorities._favoured)
        self._prefill_rotation = 0  # ...on the steps where they may prefill
        self._held_steps = 0  # steps favouring an urgent class without worse prefill chunks
        self._interactive_at = -1e9  # when a request of priority <= 0 was last live
        self._rng = random.Random()

    def new_seq_id(self) -> int:
        """Safe from any thread: a request is made on the event loop while a burst forks on the compute thread."""
        return next(self._seq_ids)

    @property
    def num_seats(self) -> int:
        """Sequences running, counted as max_num_seqs counts them (an n > 1 request not yet forked: n)."""
        return sum(seat_count(s) for s in self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        seq.queued_at = time.monotonic()
        self.waiting.append(seq)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        seen: set[int] = set()
        self._preempted.clear()
        self._admitted.clear()
        now = time.monotonic()
        self.kv.retention.release_idle(now)
        prios = self._live_priorities()
        prioritized = any(prios)
        urgent = self._urgent_class(prios)
        worse_prefill = urgent is None or self._worse_may_prefill()
        if prioritized:
            self._order(now)
        budget = self._step_tokens(budget, now, prios)

        speculate = self.spec.active(len(self.running))
        # A snapshot: children forked during this loop join `running` but have nothing to compute yet.
        for first in list(self.running) if urgent is None else self._favoured(urgent, worse_prefill):
            if budget <= 0:
                break
            if first.status is not SeqStatus.RUNNING or first.seq_id in seen:
                continue  # preempted a moment ago to make room for an earlier sequence, or a beam stepped
            beams = beam_group(first)
            draft: list[int] = []
            if beams is None:
                remaining = first.num_tokens - first.num_computed_tokens
                worse = urgent is not None and first.request.priority > urgent
                if worse and remaining > 1 and not worse_prefill:
                    continue  # a worse prompt chunk or forced run waits for a step that prefills anyway
                room = min(budget, URGENT_STEP_TOKENS) if worse else budget
                if speculate and remaining < room and remaining <= FORCED_RUN:
                    # A decode, or the short run a grammar forced: drafts may follow its last token.
                    draft = self.spec.propose(first, room - remaining)
                todo = [(first, min(remaining + len(draft), room))]
            elif beams_ready(beams) and budget >= len(beams):
                todo = [(b, 1) for b in beams]  # the step that chooses among all their continuations
            else:
                # Recomputing after a preemption: each beam computes all but its last token meanwhile.
                todo = [(b, b.num_tokens - b.num_computed_tokens - 1) for b in beams
                        if b.status is SeqStatus.RUNNING and b.num_tokens - b.num_computed_tokens > 1]
            if beams is not None:
                seen.update(b.seq_id for b in beams)
            for seq, want in todo:
                num_new = min(want, budget)
                copies = self._grow(seq, num_new) if num_new > 0 else None
                if copies is None:
                    break
                scheduled.append(self._scheduled(seq, num_new, copies, draft))
                budget -= num_new
            if first.status is not SeqStatus.RUNNING:
                break  # it preempted itself: everything admitted after it is gone too
        # A beam scheduled early and preempted with its siblings later in the loop computes nothing
        # now (it may even be admitted again below, from scratch).
        scheduled = [s for s in scheduled if s.seq.seq_id not in self._preempted]
        ran, before = len(scheduled), set(self._preempted)

        seats = self.num_seats
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seq.seq_id in self._preempted and seq.seq_id not in before:
                break  # preempted by a higher priority just now: not back in before the next step
            if (urgent is not None and seq.request.priority > urgent and rank(seq, now) > urgent
                    and not partly_running(seq)):  # a beam group partly in must finish coming in
                break  # a worse one waits while the urgent class runs, until it has aged to it
            if seats + seat_count(seq) > self.max_num_seqs:
                if prioritized and self._make_room(seq, now):
                    seats = self.num_seats
                    continue
                break
            cached = []
            if seq.num_computed_tokens == 0 and not seq.request.scoring_prompt:
                cached = self.kv.find_cached_prefix(seq.token_ids, seq.params.cache_salt, seq.prefix_digests)
            start = len(cached) * self.kv.block_size
            num_new = min(seq.num_tokens - start, budget)
            if beam_group(seq) is not None:
                num_new = min(num_new, seq.num_tokens - start - 1)  # the last token waits for its siblings
            # No watermark for the rest of a beam group partly admitted: its running beams cannot
            # move (nor free anything) until it is in, and the group fits the pool (validation).
            if not self.kv.can_allocate(seq.table, start, start + num_new, cached,
                                        reserve=self.kv.watermark if self.running and not partly_running(seq)
                                        else 0):
                if prioritized and self._make_room(seq, now):
                    seats = self.num_seats
                    continue
                if not self.running and self.kv.retention.release_oldest():
                    continue  # nothing runs and it cannot start: kept conversations give way
                break  # in order: later sequences wait behind this one rather than starve it
            self.waiting.popleft()
            copies = self.kv.allocate(seq.table, start, start + num_new, cached)
            if start:
                seq.num_computed_tokens = start
            if seq.num_output_tokens == 0 and seq.index == 0 and not seq.request.times.first_scheduled:
                # Count the prompt once per request, not once per preemption.
                self.kv.record_query(seq.num_prompt_tokens, start)
                seq.request.num_cached_prompt_tokens = start
                if seq.request.cache_key is not None:
                    self.kv.retention.touch(seq.request.cache_key, now)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._admitted.add(seq.seq_id)
            seq.rank = rank(seq, now)
            seats += seat_count(seq)
            if num_new:
                scheduled.append(self._scheduled(seq, num_new, copies))
                budget -= num_new
        # Running sequences a waiting one of a higher priority preempted just now: their part of this
        # step goes (what admission scheduled for them, if they came back in from scratch, stays).
        late = self._preempted - before
        if late:
            scheduled = [s for i, s in enumerate(scheduled) if i >= ran or s.seq.seq_id not in late]
        # A child forked early in this step can be preempted later in it (a later sequence needed its
        # block): it must not be sampled, or its grammar matcher and generator would run ahead of it.
        for sched in scheduled:
            sched.samples = [s for s in sched.samples if s.status is SeqStatus.RUNNING]
        return SchedulerOutput(scheduled, [c for s in scheduled for c in s.copies], self.max_model_len)

    def _grow(self, seq: Sequence, num_new: int) -> list[tuple[int, int]] | None:
        """Give a running sequence blocks for `num_new` more tokens, preempting the most recently
        admitted sequences as needed. Returns its copy-on-write pairs; None if `seq` was preempted."""
        while not self.kv.can_allocate(seq.table, seq.num_computed_tokens, seq.num_computed_tokens + num_new):
            self._preempt(self.running[-1])  # the most recently admitted
            if seq.status is not SeqStatus.RUNNING:
                return None
        return self.kv.allocate(seq.table, seq.num_computed_tokens, seq.num_computed_tokens + num_new)

    def _scheduled(self, seq: Sequence, num_new: int, copies: list[tuple[int, int]],
                   draft: list[int] | None = None) -> ScheduledSeq:
        sched = ScheduledSeq(seq, num_new, copies=copies, draft=draft or [])
        if seq.num_computed_tokens + num_new - len(sched.draft) == seq.num_tokens:
            sched.samples.append(seq)
            req = seq.request
            if req.params.n > 1 and not req.forked and req.beam is None:
                sched.samples += self._fork(seq, req, seq.num_computed_tokens + num_new)
        return sched

    def _fork(self, parent: Sequence, req: Request, num_computed: int) -> list[Sequence]:
        """Children share every block of the parent's prompt, the partly filled last one included;
        the first write to a shared block copies it (KVCacheManager.allocate)."""
        req.forked = True
        children = []
        for index in range(1, req.params.n):
            child = parent.fork(self.new_seq_id(), index, self.kv.fork(parent.table), self.generator(req, index))
            child.num_computed_tokens = num_computed
            req.seqs.append(child)
            self.running.append(child)
            children.append(child)
        return children

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: `seq` (and, for a beam, every running beam of its search, since they only
        step together) leaves `running` for the head of the queue with its blocks freed."""
        group = [b for b in (beam_group(seq) or [seq]) if b.status is SeqStatus.RUNNING]
        for b in group:
            self._preempted.add(b.seq_id)
            self.running.remove(b)
            self.kv.free(b.table)
            b.num_computed_tokens = 0
            b.status = SeqStatus.WAITING
            b.queued_at = time.monotonic()
        # Ahead of the queue, but behind the rest of a beam group partly admitted before `seq`: its
        # running beams wait for those to step, so nothing admitted after them may go first.
        at = 0
        while at < len(self.waiting) and partly_running(self.waiting[at]):
            at += 1
        for b in reversed(group):  # the queue keeps them in beam order
            self.waiting.insert(at, b)
        self.num_preemptions += 1
        seq.request.num_preemptions += 1

    # ---- after the step ------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[int, int], grammar_done: frozenset[int] = frozenset(),
               forced: dict[int, list[int]] | None = None, failed: dict[int, str] | None = None,
               beams: dict[int, tuple[list[int], list[float]]] | None = None,
               accepted: dict[int, int] | None = None,
               ) -> tuple[list[tuple[Sequence, list[int]]], list[tuple[Sequence, str | AsyncPageError]]]:
        """Advance computed counts, append sampled tokens (and the tokens a grammar forces after
        them), apply token-level stops. `sampled` maps seq_id -> token; `grammar_done` holds the
        sequences whose grammar is complete; `failed` the sequences whose sampled token is invalid
        (no valid token, or one the grammar rejected): nothing is appended for them; `accepted` how
        many drafts each speculating sequence kept (its tokens are sampled + forced); `beams` each
        beam's best continuations (beam search steps here). Returns each sampled sequence with its
        new tokens (beams excepted: they report once their search is done), and the failed
        sequences with the reason."""
        new_tokens: list[tuple[Sequence, list[int]]] = []
        failures: list[tuple[Sequence, str | AsyncPageError]] = []
        searches: dict[int, Request] = {}
        for sched in out.scheduled:
            seq = sched.seq
            if seq.status is not SeqStatus.RUNNING or sched.draft:
                continue  # aborted while the step ran; a speculating sequence is counted below
            seq.num_computed_tokens += sched.num_new_tokens
            self.kv.cache_full_blocks(seq.table, seq.token_ids, seq.num_computed_tokens,
                                      seq.params.cache_salt)
        for sched in out.scheduled:
            for seq in sched.samples:
                if seq.status is not SeqStatus.RUNNING or seq.seq_id not in sampled:
                    continue
                if failed and seq.seq_id in failed:
                    failures.append((seq, failed[seq.seq_id]))
                    continue
                if seq.request.beam is not None:
                    searches[seq.request.request_id] = seq.request
                    continue
                try:
                    new_tokens.append((seq, self._append(seq, sched, sampled, forced, grammar_done, accepted)))
                except Exception as exc:  # this sequence's own bookkeeping: its request fails alone
                    log.error("request %d failed while its tokens were appended; the engine goes on",
                              seq.request.request_id, exc_info=exc)
                    error = RequestFailedError(f"this request failed while its tokens were appended "
                                               f"({type(exc).__name__}); the engine goes on")
                    error.__cause__ = exc
                    failures.append((seq, error))
        failed_requests = {seq.request.request_id for seq, _ in failures}
        for req_id, req in searches.items():
            if req_id not in failed_requests:
                try:
                    failures += self._step_beams(req, beams or {})
                except Exception as exc:  # this search's own work (its grammars, its stop strings): it fails alone
                    log.error("beam search %d failed; the engine goes on", req_id, exc_info=exc)
                    error = RequestFailedError(f"this beam search failed while choosing its beams "
                                               f"({type(exc).__name__}); the engine goes on")
                    error.__cause__ = exc
                    failures.append((req.seqs[0], error))
        return new_tokens, failures

    def _append(self, seq: Sequence, sched: ScheduledSeq, sampled: dict[int, int], forced: dict[int, list[int]] | None,
                grammar_done: frozenset[int], accepted: dict[int, int] | None) -> list[int]:
        """One sampled sequence's tokens (the sampled one, then what its grammar forced) up to a stop;
        ends the sequence on a token, length or grammar stop. Returns the tokens appended."""
        added: list[int] = []
        reason: FinishReason | None = None
        for token in [sampled[seq.seq_id], *(forced or {}).get(seq.seq_id, [])]:
            seq.token_ids.append(token)
            added.append(token)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                break
        if sched.draft:
            self.spec.verified(seq, sched.num_new_tokens - len(sched.draft), len(sched.draft),
                               (accepted or {}).get(seq.seq_id, 0))
        if reason is None and seq.seq_id in grammar_done:
            reason = "stop"
        if reason == "stop" and getattr(seq.matcher, "budget_forced", False):
            reason = "length"  # the value is complete because the budget closed it
        if reason is not None:
            self.finish(seq, reason)
        return added

    def _stop_reason(self, seq: Sequence, token: int, ahead: int = 0) -> FinishReason | None:
        """Why `token`, just appended to `seq` (or, with ahead=1, about to be), ends it, if it does."""
        p = seq.params
        if token in seq.request.stop_ids:
            return "stop"
        if seq.num_output_tokens + ahead >= p.max_tokens or seq.num_tokens + ahead >= self.max_model_len:
            return "length"
        return None

    def ends(self, seq: Sequence, token: int) -> bool:
        """Whether appending the sampled `token` would end `seq` by a stop token or its length."""
        return self._stop_reason(seq, token, ahead=1) is not None

    def generator(self, req: Request, index: int) -> torch.Generator | None:
        """Sample `index`'s random stream (decoding.sampling.seeded_generator)."""
        return seeded_generator(req.params, index, self._seed_rng)

    def stop(self, seq: Sequence, dropped: int) -> None:
        """A stop string ended `seq` (OutputProcessor.process): the `dropped` tokens after it go, and the
        sequence finishes "stop" (one the budget had just ended as "length" becomes a stop too)."""
        if dropped:
            del seq.token_ids[len(seq.token_ids) - dropped :]
        if seq.status is SeqStatus.FINISHED:
            seq.finish_reason = "stop"
        else:
            self.finish(seq, "stop")

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence now: its blocks go back to the pool (cached prefixes stay reusable; a keyed
        conversation's are kept for its next turn, kv/retention.py)."""
        if seq.status is SeqStatus.FINISHED:
            return
        req = seq.request
        if req.cache_key is not None and seq.index == 0 and req.beam is None and seq.status is SeqStatus.RUNNING:
            self.kv.keep(req.cache_key, seq.table)
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.kv.free(seq.table)
