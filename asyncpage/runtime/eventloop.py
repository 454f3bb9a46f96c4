"""LoopHandle: the event loop an engine runs on, captured when its loop starts.

Why it exists: the engine's state belongs to one loop on one thread. Two things need to know that
loop from elsewhere: a worker thread (or a finalizer on another thread) that must wake it without
touching its state, and a caller that must be told clearly when it uses the engine from a different
thread or event loop (instead of racing or hanging). asyncio and trio spell both differently.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import sniffio


class LoopHandle:
    def __init__(self, library: str, loop: Any, thread_id: int) -> None:
        self.library = library
        self._loop = loop  # the asyncio loop, or trio's token
        self.thread_id = thread_id

    @classmethod
    def current(cls) -> LoopHandle:
        """The loop this coroutine runs on (call from async code)."""
        library = sniffio.current_async_library()
        if library == "asyncio":
            import asyncio

            loop: Any = asyncio.get_running_loop()
        elif library == "trio":
            import trio

            loop = trio.lowlevel.current_trio_token()
        else:  # pragma: no cover - anyio supports only these two
            raise RuntimeError(f"unsupported async library {library!r}")
        return cls(library, loop, threading.get_ident())

    def is_current(self) -> bool:
        """True when called on this loop's thread, from code running in this loop."""
        if threading.get_ident() != self.thread_id:
            return False
        if self.library == "asyncio":
            import asyncio

            # Not through sniffio: a plain callback on the loop (call_soon_threadsafe) has no current
            # task, which sniffio needs, yet runs on the loop between its steps as a task would.
            try:
                return asyncio.get_running_loop() is self._loop
            except RuntimeError:
                return False
        try:
            return LoopHandle.current()._loop is self._loop
        except (sniffio.AsyncLibraryNotFoundError, RuntimeError):
            return False

    def call_soon_threadsafe(self, fn: Callable[[], object]) -> None:
        """Schedule `fn` on the loop from any thread; a no-op once the loop has closed."""
        try:
            if self.library == "asyncio":
                self._loop.call_soon_threadsafe(fn)
            else:
                self._loop.run_sync_soon(fn)
        except RuntimeError:
            pass  # the loop is gone: nobody is left to wake
