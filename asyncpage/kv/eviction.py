"""Which cached free KV block the pool gives up when it needs a block and none is empty.

No tensors and no ref counts here: the BlockPool (kv_cache.py) owns those and tells its policy what
happens to each block that holds a cached prefix (cached, hit, freed, taken again, evicted). A policy
only orders the blocks that are free and cached, and picks the next to lose.

    PrefixAwarePolicy   the default (eviction_policy=None): leaves of the prefix tree first, then the
                        least valuable by hits, depth and age (GreedyDual-Size-Frequency, see below)
    LRUPolicy           eviction_policy="lru": the oldest freed block first, for comparison
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Protocol

from asyncpage.kv.block import Block

EVICTION_POLICIES: tuple[str | None, ...] = (None, "lru")


class EvictionPolicy(Protocol):
    def __len__(self) -> int:
        """Blocks that are free and cached: the ones `evict()` may return."""
        ...

    def cached(self, block: Block, parent: bytes | None, depth: int) -> None:
        """`block` now holds a prefix: its chain continues `parent` (a digest) as its `depth`-th block."""

    def hit(self, block: Block) -> None:
        """A request reused `block` through the prefix cache."""

    def freed(self, block: Block) -> None:
        """A cached block's last reference went: it may be evicted from now on."""

    def taken(self, block: Block) -> None:
        """A free cached block is referenced again (a hit): it may not be evicted."""

    def evict(self) -> Block:
        """Pick a free cached block to lose and stop counting it as evictable."""
        ...

    def uncached(self, block: Block) -> None:
        """The pool dropped `block`'s digest (after `evict()`); forget it."""

    def clear(self) -> None:
        """Every digest is gone (reset_prefix_cache)."""

    def evictable_ids(self) -> Iterable[int]:
        """The evictable block ids, for invariant checks (O(n))."""
        ...

    def check_invariants(self) -> None:
        """Raises AssertionError when the policy's own records are inconsistent."""


def make_policy(name: str | None, blocks: list[Block], cached: Mapping[bytes, Block]) -> EvictionPolicy:
    if name is None:
        return PrefixAwarePolicy(blocks, cached)
    if name == "lru":
        return LRUPolicy(blocks)
    raise ValueError(f"eviction_policy must be None or 'lru', got {name!r}")


class LRUPolicy:
    """The oldest freed block first: an O(1) queue. Blind to sharing, so a system prompt that every
    few requests reuse leaves as readily as a one-off prompt's tail."""

    def __init__(self, blocks: list[Block]) -> None:
        self._blocks = blocks
        self._queue: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._queue)

    def cached(self, block: Block, parent: bytes | None, depth: int) -> None:
        pass

    def hit(self, block: Block) -> None:
        pass

    def freed(self, block: Block) -> None:
        self._queue[block.block_id] = None

    def taken(self, block: Block) -> None:
        del self._queue[block.block_id]

    def evict(self) -> Block:
        block_id, _ = self._queue.popitem(last=False)
        return self._blocks[block_id]

    def uncached(self, block: Block) -> None:
        pass

    def clear(self) -> None:
        self._queue.clear()

    def evictable_ids(self) -> Iterable[int]:
        return list(self._queue)

    def check_invariants(self) -> None:
        pass


# Hits beyond this say nothing new about a prefix, and the cap bounds how long an unused prefix that
# was once hot outlives its last use: about HIT_WEIGHT * HITS_CAP turnovers of the pool.
HITS_CAP = 4
# What one more hit is worth, in turnovers of the pool: a one-off round of prompts can turn a tight
# pool over more than once between two uses of a shared prefix, so one turnover per hit is too little.
HIT_WEIGHT = 2
# Depth (recomputing a deep block attends over everything before it) adds less than one hit's worth,
# growing up to DEPTH_CAP blocks: it orders blocks with equal hits and never outweighs one more hit
# (a 256-block one-off tail must not outlive a shared prefix hit twice).
DEPTH_CAP = 63
# Evicted digests whose hits are remembered, per pool block. One round of one-off prompts can evict
# several pools' worth before a shared prefix comes back; ~170 bytes an entry.
GHOSTS_PER_BLOCK = 8


class PrefixAwarePolicy:
    """Evict leaves first, then the block whose loss costs least.

    Leaves first: digests chain, so a block is reachable only through every block before it; losing
    an inner block strands its cached successors. A free block is a leaf when no cached block (free
    or in use) continues its digest; inner blocks are evicted only when no leaf is free.

    Among leaves, GreedyDual-Size-Frequency: a block freed when the clock reads L gets the value
    L + 1 + HIT_WEIGHT * hits + min(depth, DEPTH_CAP) / (DEPTH_CAP + 1), and the clock moves up to
    each victim's value. So a
    prefix that many requests reused outlives one-off prompts freed after it, recency still counts
    (later frees start from a higher clock), and a once-hot prefix nobody asks for any more sinks
    below fresh blocks after a few turnovers of the pool instead of pinning it. Ties: oldest first.
    `hits` counts the requests that reused the block, and outlives an eviction for a while: a digest
    computed again soon after it was evicted comes back with its old hits plus one (that request
    wanted it too), so a prefix that a tight pool loses between every two uses still gets noticed.

    A heap with lazy invalidation: a block's value is fixed when it is freed, and each change of its
    leaf status pushes a new entry and stales the old one, so every event costs O(log n).
    """

    def __init__(self, blocks: list[Block], cached: Mapping[bytes, Block]) -> None:
        n = len(blocks)
        self._blocks = blocks
        self._cached = cached  # the pool's digest -> block map, read only
        self._hits = [0] * n
        self._depth = [0] * n
        self._parent: list[bytes | None] = [None] * n
        # Parent digest -> ids of the cached blocks continuing it. Keyed by digest, not block: a
        # parent evicted and computed again later finds its successors still counted.
        self._children: dict[bytes, set[int]] = {}
        self._value = [0.0] * n
        self._stamp = [0] * n  # a heap entry whose stamp is not its block's latest is stale
        self._heap: list[tuple[bool, float, int, int]] = []  # (inner, value, stamp, block id)
        self._evictable: set[int] = set()
        self._clock = 0.0
        self._stamps = itertools.count(1)  # increasing, so equal values leave oldest first
        # Hits of the last GHOSTS_PER_BLOCK * num_blocks evicted digests, oldest dropped first. Without them a shared
        # prefix evicted between its uses comes back with no hits every time and never earns its
        # keep against one-off prompts (ARC's ghost lists, reduced to a count; ~170 bytes a block).
        self._ghosts: OrderedDict[bytes, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._evictable)

    def cached(self, block: Block, parent: bytes | None, depth: int) -> None:
        i = block.block_id
        assert block.digest is not None
        ghost = self._ghosts.pop(block.digest, None)
        # Computed again after an eviction: this request wanted it too, a miss that counts as a hit.
        self._hits[i] = 0 if ghost is None else ghost + 1
        self._depth[i] = depth
        self._parent[i] = parent
        if parent is not None:
            siblings = self._children.setdefault(parent, set())
            siblings.add(i)
            p = self._cached.get(parent)
            if len(siblings) == 1 and p is not None and p.block_id in self._evictable:
                self._push(p.block_id)  # no longer a leaf

    def hit(self, block: Block) -> None:
        self._hits[block.block_id] += 1

    def freed(self, block: Block) -> None:
        i = block.block_id
        depth = min(self._depth[i], DEPTH_CAP) / (DEPTH_CAP + 1)
        self._value[i] = self._clock + 1 + HIT_WEIGHT * min(self._hits[i], HITS_CAP) + depth
        self._evictable.add(i)
        self._push(i)

    def taken(self, block: Block) -> None:
        self._evictable.remove(block.block_id)  # its heap entries go stale

    def evict(self) -> Block:
        while self._heap:
            _, value, stamp, i = heapq.heappop(self._heap)
            if stamp == self._stamp[i] and i in self._evictable:
                self._evictable.remove(i)
                self._clock = max(self._clock, value)
                return self._blocks[i]
        raise RuntimeError("no evictable KV block (the pool must check its count first)")

    def uncached(self, block: Block) -> None:
        i = block.block_id
        assert block.digest is not None
        # Every victim, one-offs included: a prefix that was never hit before it went is exactly
        # the one whose second request must find out that it is shared.
        self._ghosts[block.digest] = self._hits[i]
        if len(self._ghosts) > GHOSTS_PER_BLOCK * len(self._blocks):
            self._ghosts.popitem(last=False)
        parent = self._parent[i]
        self._parent[i] = None
        if parent is not None:
            siblings = self._children[parent]
            siblings.discard(i)
            if not siblings:
                del self._children[parent]
                p = self._cached.get(parent)
                if p is not None and p.block_id in self._evictable:
                    self._push(p.block_id)  # a leaf now
        # Only when no leaf was free: its successors are unreachable now, so they go next.
        for c in self._children.get(block.digest, ()):
            if c in self._evictable:
                self._push(c)

    def clear(self) -> None:
        self._children.clear()
        self._ghosts.clear()
        self._evictable.clear()
        self._heap.clear()
        self._parent = [None] * len(self._blocks)

    def evictable_ids(self) -> Iterable[int]:
        return list(self._evictable)

    def _push(self, i: int) -> None:
        digest = self._blocks[i].digest
        assert digest is not None
        inner = bool(self._children.get(digest))
        parent = self._parent[i]
        value = self._value[i]
        if parent is not None and parent not in self._cached:
            value = min(value, self._clock)  # unreachable until its parent is computed again
        stamp = next(self._stamps)
        self._stamp[i] = stamp
        heapq.heappush(self._heap, (inner, value, stamp, i))
        if len(self._heap) > 2 * len(self._evictable) + 64:
            # Stale entries pile up at one per event at most: dropping them now and then keeps the
            # heap O(evictable) for O(1) amortized per event.
            self._heap = [e for e in self._heap if e[2] == self._stamp[e[3]] and e[3] in self._evictable]
            heapq.heapify(self._heap)

    def check_invariants(self) -> None:
        live = {e[3]: e for e in self._heap if e[2] == self._stamp[e[3]] and e[3] in self._evictable}
        for i in self._evictable:
            b = self._blocks[i]
            assert b.ref_count == 0 and b.digest is not None, f"block {i} is evictable but in use or not cached"
            assert i in live, f"evictable block {i} has no live heap entry"
            assert live[i][0] == bool(self._children.get(b.digest)), f"block {i}'s leaf status is stale"
        for parent, ids in self._children.items():
            assert ids, "an empty child set is kept"
            for c in ids:
                assert self._parent[c] == parent and self._blocks[c].digest is not None, \
                    f"block {c} is counted as a successor of a digest it does not continue"
        for b in self._blocks:
            p = self._parent[b.block_id]
            if p is not None:
                assert b.digest is not None and b.block_id in self._children.get(p, ()), \
                    f"cached block {b.block_id} is missing from its parent's successors"
