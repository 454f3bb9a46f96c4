"""ComputeThread: the one thread an engine runs torch on (loading, the KV pool, every step).

Why one dedicated thread: torch's CPU ops run on an OpenMP team that belongs to the calling thread.
Two threads issuing torch work means two teams on the same cores, and GNU OpenMP then throttles its
spin-waiting: a decode step measured 62 ms on one thread and 80-83 ms once a second thread had
issued torch work (batch 32, gemma-3-270m, bf16, 2 cores). So loading, pool allocation and the
forward all happen here, and the event loop's thread never runs a parallel torch op.
Engines made with `clone()` share their parent's thread (one team per process). The thread ends
when the last engine using it is garbage-collected (the executor goes with it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

import anyio
import torch

from asyncpage.runtime.cpu_share import CpuShare
from asyncpage.runtime.eventloop import LoopHandle

T = TypeVar("T")


class ComputeThread:
    def __init__(self, num_threads: int, adaptive: bool = True) -> None:
        """`adaptive`: follow the cores other processes leave free (cpu_share.py), up to `num_threads`."""
        self.num_threads = num_threads
        self.active_threads = num_threads
        self._share = CpuShare(num_threads) if adaptive and num_threads > 1 else None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="asyncpage-compute")
        # Jobs submitted and not started yet (a burst of steps gives way to them: `pending`).
        self._queued = 0
        self._lock = threading.Lock()
        # The thread count is per calling thread in OpenMP: set it where the work runs.
        self.run(torch.set_num_threads, num_threads)

    def adapt(self) -> None:
        """Follow the cores other processes leave free (on the compute thread: before each job, and
        between the steps of a burst)."""
        if self._share is not None:
            want = self._share.threads(self.active_threads)
            if want is not None and want != self.active_threads:
                torch.set_num_threads(want)
                self.active_threads = want

    def pending(self) -> bool:
        """Whether a job waits for this thread (a long-running job gives way between its steps)."""
        return self._queued > 0

    def _submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        with self._lock:
            self._queued += 1
        try:
            return self._executor.submit(self._started, fn, *args)
        except BaseException:  # shut down: nothing will start it
            with self._lock:
                self._queued -= 1
            raise

    def _started(self, fn: Callable[..., T], *args: object) -> T:
        with self._lock:
            self._queued -= 1
        return fn(*args)

    def _adapt_then(self, fn: Callable[..., T], *args: object) -> T:
        self.adapt()
        return fn(*args)

    def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn` on the compute thread and wait (from synchronous code, never from the compute thread)."""
        return self._submit(fn, *args).result()

    async def arun(self, fn: Callable[..., T], *args: object,
                   interrupt: Callable[[], None] | None = None) -> T:
        """Run `fn` on the compute thread without blocking the event loop and without borrowing a
        thread from anyio's shared pool (a host app that fills that pool must not stall the engine).
        Not cancellable midway: a step that has started finishes, so its results are never half-applied.
        A cancellation that reaches the task anyway (asyncio's own `task.cancel()` is not stopped by
        anyio's shield) calls `interrupt` (a long job's way to end soon), waits for the job to end,
        blocking, then goes on: nothing the job touches is touched by the caller meanwhile."""
        future: Future[T] = self._submit(self._adapt_then, fn, *args)
        done = anyio.Event()
        loop = LoopHandle.current()
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(done.set))
        try:
            with anyio.CancelScope(shield=True):
                await done.wait()
        except BaseException:
            if interrupt is not None:
                interrupt()
            wait([future])
            raise
        return future.result()
