"""The scheduler's priority half (a mixin of Scheduler): the waiting queue by rank, lower first (a
request's priority, less one level for every AGING_S it has waited: nothing starves), running
sequences by the rank they were admitted with, and a waiting sequence of a better rank preempting
the last running one when seats or blocks are short. With every priority 0 none of it runs: the
queue is first come, first served."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from asyncpage.core.groups import partly_running, seat_count
from asyncpage.core.request import Sequence

if TYPE_CHECKING:
    from collections.abc import Callable

# Waiting this long lowers a request's rank by one priority level: a low priority waits, never forever.
AGING_S = 10.0


def rank(seq: Sequence, now: float) -> float:
    return seq.request.priority - (now - seq.queued_at) // AGING_S




class Priorities:
    waiting: deque[Sequence]
    running: list[Sequence]
    _admitted: set[int]
    _preempt: Callable[[Sequence], None]

    def _prioritized(self) -> bool:
        """Whether any live request has a priority of its own: only then is the order anything but
        first-come-first-served (which stays exactly as it was)."""
        return any(s.request.priority for s in self.waiting) or any(s.request.priority for s in self.running)

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
