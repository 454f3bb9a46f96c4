"""Scheduler: which sequences run in the next step, and with how many tokens.

Each step has a token budget (`max_num_batched_tokens`). Running sequences come first, in admission
order: a decode takes one token, a partly prefilled prompt takes the next chunk. What budget is left
admits waiting sequences, first come first served, as prefill chunks in the same step. A sequence
that needs a block when none is free preempts the most recently admitted running sequence
(recompute: its blocks are freed and it goes back to the head of the queue).
The scheduler never touches tensors; the runner turns its output into a batch.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from asyncpage.kv_cache import KVCacheManager
from asyncpage.outputs import FinishReason
from asyncpage.request import Request, SeqStatus, Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    # Sequences sampled from this row's logits (more than one when an n > 1 request forks).
    samples: list[Sequence] = field(default_factory=list)


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


def _seats(seq: Sequence) -> int:
    """Slots of max_num_seqs a sequence takes: every sample counts, so a request that will fork
    into n sequences holds n seats from its admission on."""
    req = seq.request
    return req.params.n if seq.index == 0 and req.params.n > 1 and not req.forked else 1


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, make_generator: Callable[[Request, int], torch.Generator | None],
                 ) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.make_generator = make_generator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._next_seq_id = 0
        self._rng = random.Random()

    def new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id

    @property
    def num_seats(self) -> int:
        """Sequences running, counted as max_num_seqs counts them (an n > 1 request not yet forked: n)."""
        return sum(_seats(s) for s in self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        copies: list[tuple[int, int]] = []

        # A snapshot: children forked during this loop join `running` but have nothing to compute yet.
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted a moment ago to make room for an earlier sequence
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.can_allocate(seq.table, seq.num_computed_tokens,
                                           seq.num_computed_tokens + num_new):
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break  # it preempted itself: everything admitted after it is gone too
            copies += self.kv.allocate(seq.table, seq.num_computed_tokens, seq.num_computed_tokens + num_new)
            scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new

        seats = self.num_seats
        while self.waiting and budget > 0 and seats + _seats(self.waiting[0]) <= self.max_num_seqs:
            seq = self.waiting[0]
            cached = []
            if seq.num_computed_tokens == 0:
                cached = self.kv.find_cached_prefix(seq.token_ids, seq.params.cache_salt, seq.prefix_digests)
            start = len(cached) * self.kv.block_size
            num_new = min(seq.num_tokens - start, budget)
            if not self.kv.can_allocate(seq.table, start, start + num_new, cached,
                                        reserve=self.kv.watermark if self.running else 0):
                break  # FCFS: later sequences wait behind this one rather than starve it
            self.waiting.popleft()
            copies += self.kv.allocate(seq.table, start, start + num_new, cached)
            if start:
                seq.num_computed_tokens = start
            if seq.num_output_tokens == 0 and seq.index == 0 and not seq.request.times.first_scheduled:
                # Count the prompt once per request, not once per preemption.
                self.kv.record_query(seq.num_prompt_tokens, start)
                seq.request.num_cached_prompt_tokens = start
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            seats += _seats(seq)
            scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new
        # A child forked early in this step can be preempted later in it (a later sequence needed its
        # block): it must not be sampled, or its grammar matcher and generator would run ahead of it.
        for sched in scheduled:
            sched.samples = [s for s in sched.samples if s.status is SeqStatus.RUNNING]
        return SchedulerOutput(scheduled, copies, self.max_model_len)

    def _scheduled(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        sched = ScheduledSeq(seq, num_new)
        if seq.num_computed_tokens + num_new == seq.num_tokens:
            sched.samples.append(seq)
            req = seq.request
            if req.params.n > 1 and not req.forked:
                sched.samples += self._fork(seq, req, seq.num_computed_tokens + num_new)
        return sched

    def _fork(self, parent: Sequence, req: Request, num_computed: int) -> list[Sequence]:
        """Children share every block of the parent's prompt, the partly filled last one included;
        the first write to a shared block copies it (KVCacheManager.allocate)."""
        req.forked = True
        children = []
        for index in range(1, req.params.n):
            child = Sequence(
                seq_id=self.new_seq_id(), index=index, request=req, token_ids=list(parent.token_ids),
                generator=self.make_generator(req, index),
                detokenizer=parent.detokenizer.fork() if parent.detokenizer else None,
                num_prompt_tokens=parent.num_prompt_tokens, num_computed_tokens=num_computed,
                table=self.kv.fork(parent.table), status=SeqStatus.RUNNING,
                matcher=parent.matcher.fork() if parent.matcher is not None else None)
            req.seqs.append(child)
            self.running.append(child)
            children.append(child)
        return children

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq.table)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        seq.request.num_preemptions += 1

    # ---- after the step ------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[int, int], grammar_done: frozenset[int] = frozenset(),
               forced: dict[int, list[int]] | None = None, failed: dict[int, str] | None = None,
               ) -> tuple[list[tuple[Sequence, list[int]]], list[tuple[Sequence, str]]]:
        """Advance computed counts, append sampled tokens (and the tokens a grammar forces after
        them), apply token-level stops. `sampled` maps seq_id -> token; `grammar_done` holds the
        sequences whose grammar is complete; `failed` the sequences whose sampled token is invalid
        (no valid token, or one the grammar rejected): nothing is appended for them. Returns each
        sampled sequence with its new tokens, and the failed sequences with the reason."""
        new_tokens: list[tuple[Sequence, list[int]]] = []
        failures: list[tuple[Sequence, str]] = []
        for sched in out.scheduled:
            seq = sched.seq
            if seq.status is not SeqStatus.RUNNING:
                continue  # aborted while the step ran
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
                added: list[int] = []
                reason: FinishReason | None = None
                for token in [sampled[seq.seq_id], *(forced or {}).get(seq.seq_id, [])]:
                    seq.token_ids.append(token)
                    added.append(token)
                    reason = self._stop_reason(seq, token)
                    if reason is not None:
                        break
                new_tokens.append((seq, added))
                if reason is None and seq.seq_id in grammar_done:
                    reason = "stop"
                if reason == "stop" and getattr(seq.matcher, "budget_forced", False):
                    reason = "length"  # the value is complete because the budget closed it
                if reason is not None:
                    self.finish(seq, reason)
        return new_tokens, failures

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in seq.request.stop_token_ids):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence now: its blocks go back to the pool (cached prefixes stay reusable)."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.kv.free(seq.table)
