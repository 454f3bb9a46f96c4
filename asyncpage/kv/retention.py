"""Conversations that keep their KV between turns (`cache_key=`, OpenAI's `prompt_cache_key`).

When a keyed request ends, the full blocks of its sequence (prompt and output, the prefix of the
conversation's next turn) are kept referenced under its key, so no eviction can take them while the
tool runs and a batch job allocates; the next turn's prefix lookup finds them as any cached prefix.
A key's newer turn replaces its older one. Bounded: the kept blocks are at most SHARE of the pool (the
least recently used key goes first past it), a key idle for IDLE_S is let go, and the scheduler lets
go of the least recently used key when nothing is running and a request cannot otherwise start (a
kept conversation never deadlocks the pool). Integers only, as the rest of kv/.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Protocol

from asyncpage.kv.block import Block

SHARE = 0.5  # of the pool's blocks, at most, kept for keyed conversations
IDLE_S = 300.0  # a key not used for this long is let go


class RefCounter(Protocol):
    """What Retention needs of the pool (kv/cache.py's BlockPool)."""

    def ref(self, block: Block, hit: bool = False) -> None: ...

    def free(self, block: Block) -> None: ...


class Retention:
    """Kept blocks by key, least recently used first. The pool's ref counts count each kept block once."""

    def __init__(self, num_blocks: int, ref: RefCounter) -> None:
        self.budget = int(num_blocks * SHARE)
        self._ref = ref
        self._kept: OrderedDict[str, tuple[list[Block], float]] = OrderedDict()
        self.num_blocks = 0

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, key: str, blocks: list[Block], now: float | None = None) -> None:
        """Keep `blocks` (full blocks holding a cached prefix) under `key`, in place of what it kept."""
        now = time.monotonic() if now is None else now
        kept = [b for b in blocks[: self.budget] if b.digest is not None]
        for b in kept:  # the new turn's references first: blocks both turns share are never let go
            self._ref.ref(b)
        self.release(key)
        if kept:
            self._kept[key] = (kept, now)
            self.num_blocks += len(kept)
        while self.num_blocks > self.budget and self._kept:
            self.release(next(iter(self._kept)))

    def touch(self, key: str, now: float | None = None) -> None:
        """A turn of `key` started: it is the most recently used."""
        if key in self._kept:
            blocks, _ = self._kept.pop(key)
            self._kept[key] = (blocks, time.monotonic() if now is None else now)

    def release(self, key: str) -> bool:
        entry = self._kept.pop(key, None)
        if entry is None:
            return False
        for b in reversed(entry[0]):  # tail first, as a freed table goes
            self._ref.free(b)
        self.num_blocks -= len(entry[0])
        return True

    def release_oldest(self) -> bool:
        """Let go of the least recently used key (the pool is short and nothing else can give)."""
        return bool(self._kept) and self.release(next(iter(self._kept)))

    def release_idle(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for key in [k for k, (_, used) in self._kept.items() if now - used > IDLE_S]:
            self.release(key)

    def tables(self) -> list[list[Block]]:
        """What is kept, one block list per key (the pool's invariant checks count their references)."""
        return [blocks for blocks, _ in self._kept.values()]
