"""CpuShare: how many cores the other processes on this machine leave to the engine.

Why: torch's CPU ops run on an OpenMP team whose every parallel region ends at a barrier. When another
process keeps one of two cores busy, the team's second thread gets half a core, and every barrier
waits for it: `asyncpage bench --workload mixed -n 16` fell from 125.8 to 14.7 tok/s (8.5x) with one
busy process beside it, where a fair share is about half. The compute thread asks this every couple
of seconds and runs as many threads as there are cores left (at least one), and back up when the
other work ends. Linux only (/proc/stat); elsewhere it never changes the thread count.
"""

from __future__ import annotations

import os
import time

# Re-decide at most this often: /proc/stat is cheap, a thread-count change costs a new OpenMP team.
PERIOD_S = 2.0


class CpuShare:
    def __init__(self, max_threads: int) -> None:
        self.max_threads = max_threads
        self._clk = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, float] | None:
        """(machine busy seconds, this process's CPU seconds, wall time), or None without /proc/stat."""
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:9]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + fields[4]  # idle + iowait
        t = os.times()
        return (sum(fields) - idle) / self._clk, t.user + t.system, time.monotonic()

    def threads(self, current: int) -> int | None:
        """The thread count to use now, or None while the window is not over (or no /proc)."""
        if self._last is None or time.monotonic() - self._last[2] < PERIOD_S:
            return None  # asked every step: the window is checked before reading /proc/stat (~10 us)
        now = self._sample()
        if now is None or now[2] - self._last[2] < PERIOD_S:
            return None
        busy, own, wall = (b - a for a, b in zip(self._last, now, strict=True))
        self._last = now
        others = max(0.0, busy - own) / wall  # cores' worth of CPU the rest of the machine used
        free = self.max_threads - others
        # Hysteresis: drop a thread when another process takes more than half a core, take it back only
        # when nearly all of it is free again.
        if free < current - 0.5:
            return max(1, int(free + 0.5))
        if free > current + 0.8:
            return min(self.max_threads, int(free + 0.2))
        return current
