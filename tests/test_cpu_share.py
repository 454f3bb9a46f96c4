"""The compute thread follows the cores other processes leave free (the OpenMP barrier collapse)."""

from __future__ import annotations

from asyncpage.runtime.cpu_share import PERIOD_S, CpuShare


def _share(samples: list[tuple[float, float, float]]) -> CpuShare:
    it = iter(samples)
    share = CpuShare.__new__(CpuShare)
    share.max_threads = 2
    share._sample = lambda: next(it)  # type: ignore[method-assign]
    share._last = share._sample()
    return share


def test_another_busy_process_takes_a_thread_and_gives_it_back() -> None:
    w = PERIOD_S
    # (machine busy s, own cpu s, wall s): others use 1 core, then nothing.
    share = _share([(0, 0, 0), (2 * w, w, w), (4 * w, 2 * w, 2 * w), (5 * w, 3 * w, 3 * w)])
    assert share.threads(2) == 1  # busy 2 cores' worth, ours 1: one core left
    assert share.threads(1) == 1  # still shared
    assert share.threads(1) == 2  # the other process ended


def test_no_decision_inside_a_window() -> None:
    share = _share([(0, 0, 0), (0.1, 0.1, PERIOD_S / 4)])
    assert share.threads(2) is None
