"""The scheduler's priority half (a mixin of Scheduler): the waiting queue by rank, lower first (a
request's priority, less one level for every AGING_S it has waited: nothing starves), running
sequences by the rank they were admitted with, and a waiting sequence of a better rank preempting
the last running one when seats or blocks are short. With every priority 0 none of it runs: the
queue is first come, first served.

While sequences of the best priority present (the urgent class) share the engine with worse ones,
steps favour them: every urgent row runs; worse running rows join in turn up to URGENT_STEP_ROWS rows
in all (at least one, so nothing running stops) with their decodes, and with a prefill chunk or a forced
run (at most URGENT_STEP_TOKENS tokens) once in URGENT_HOLD_STEPS steps, so a worse prompt half-prefilled
still moves; worse waiting sequences are admitted only once they have aged to the urgent class. And
while interactive work (priority <= 0) has been seen in the last INTERACTIVE_WINDOW_S, a step whose work
is all background (priority > 0: `service_tier="flex"`, a job) takes at most BACKGROUND_STEP_TOKENS
tokens, so the next turn arriving waits for a short step (a job alone keeps its full steps).
So an interactive turn's steps cost about what they cost alone (a step of <= 8 decode rows is the fused
native step's) instead of carrying the whole background batch and its new prompts."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from asyncpage.core.groups import beam_group, partly_running, seat_count
from asyncpage.core.request import Sequence

if TYPE_CHECKING:
    from collections.abc import Callable

# Waiting this long lowers a request's rank by one priority level: a low priority waits, never forever.
AGING_S = 10.0
# While an urgent class runs: the rows of a step (urgent ones first), and tokens a worse row may compute.
URGENT_STEP_ROWS = 8
URGENT_STEP_TOKENS = 16
URGENT_HOLD_STEPS = 8
# The token budget of a background-only step near interactive work (512 tokens is ~0.25 s on 2 cores).
BACKGROUND_STEP_TOKENS = 64
INTERACTIVE_WINDOW_S = 30.0


def rank(seq: Sequence, now: float) -> float:
    return seq.request.priority - (now - seq.queued_at) // AGING_S


class Priorities:
    waiting: deque[Sequence]
    running: list[Sequence]
    _admitted: set[int]
    _rotation: int
    _prefill_rotation: int
    _held_steps: int
    _interactive_at: float
    _preempt: Callable[[Sequence], None]

    def _live_priorities(self) -> set[int]:
        """The priorities of the live sequences, once a step: any but 0 and the order is by rank (else
        first-come-first-served, exactly as without priorities); more than one and the best is urgent."""
        return {s.request.priority for s in self.running} | {s.request.priority for s in self.waiting}

    @staticmethod
    def _urgent_class(prios: set[int]) -> int | None:
        """The best of the live priorities when some live sequence has a worse one (the steps then
        favour it), else None. By priority, not aged rank: aging orders admission only."""
        return min(prios) if len(prios) > 1 else None

    def _step_tokens(self, budget: int, now: float, prios: set[int]) -> int:
        """This step's token budget: short when its work is all background and interactive work was
        seen lately (the next turn then waits for a short step), else `budget`."""
        if any(p <= 0 for p in prios):
            self._interactive_at = now
            return budget
        if now - self._interactive_at < INTERACTIVE_WINDOW_S:
            return min(budget, BACKGROUND_STEP_TOKENS)
        return budget

    def _worse_may_prefill(self) -> bool:
        """Whether worse rows' prefill chunks and forced runs join this step (one favouring an urgent
        class): once in URGENT_HOLD_STEPS steps."""
        self._held_steps += 1
        if self._held_steps >= URGENT_HOLD_STEPS:
            self._held_steps = 0
            return True
        return False

    def _favoured(self, urgent: int, prefill: bool) -> list[Sequence]:
        """Running sequences a step favouring `urgent` considers, in order: the urgent class's, then
        the worse ones' turn (a rotation over them, so each gets its share). A step where worse rows
        may prefill (`prefill`) turns its own rotation: with one shared by every step, the steps that
        prefill could meet the same few rows each time, and a worse prompt half-prefilled outside them
        would not move while the urgent class ran."""
        first = [s for s in self.running if s.request.priority <= urgent]
        worse = [s for s in self.running if s.request.priority > urgent]
        if not worse:
            return first
        coming = sum(1 for s in self.waiting if s.request.priority <= urgent)  # admitted after these, maybe
        room = max(1, URGENT_STEP_ROWS - len(first) - coming)
        at = (self._prefill_rotation if prefill else self._rotation) % len(worse)
        chosen: list[Sequence] = []
        counted: set[int] = set()
        for s in worse[at:] + worse[:at]:
            if len(counted) >= room:
                break
            if s.seq_id not in counted:  # a beam steps with its whole group: count each of its rows
                chosen.append(s)
                counted.update(b.seq_id for b in beam_group(s) or [s])
        if prefill:
            self._prefill_rotation = at + len(chosen)
        else:
            self._rotation = at + len(chosen)
        return first + chosen

    def _order(self, now: float) -> None:
        """Waiting by rank (priority, less one level for every AGING_S waited: nothing starves), ties
        by queue order; a beam group partly admitted stays first (its running beams wait for it).
        Running by the rank each was admitted with, admission order within one: the last is the one to
        preempt."""
        head = [s for s in self.waiting if partly_running(s)]
        rest = [s for s in self.waiting if not partly_running(s)]
        rest.sort(key=lambda s: rank(s, now))  # stable: arrival order among equals
        self.waiting = deque(head + rest)
        self.running.sort(key=lambda s: s.rank)

    def _make_room(self, seq: Sequence, now: float) -> bool:
        """A waiting sequence that does not fit (seats or blocks) may preempt the last running one when
        its rank now is strictly better than the rank that one was admitted with (so a request that aged
        its way in is not thrown out by the newer ones it passed), never one admitted in this step;
        returns whether it preempted one."""
        if not self.running:
            return False
        victim = self.running[-1]
        if victim.request is seq.request or victim.seq_id in self._admitted or not rank(seq, now) < victim.rank:
            return False
        self._preempt(victim)
        self._order(now)  # the victim waits at its own rank (its aging starts over), not at the head
        return True

    def counts_by_priority(self) -> tuple[dict[int, int], dict[int, int]]:
        """(running seats, waiting sequences) by request priority, for stats()."""
        running: dict[int, int] = {}
        waiting: dict[int, int] = {}
        for s in self.running:
            running[s.request.priority] = running.get(s.request.priority, 0) + seat_count(s)
        for s in self.waiting:
            waiting[s.request.priority] = waiting.get(s.request.priority, 0) + 1
        return running, waiting
