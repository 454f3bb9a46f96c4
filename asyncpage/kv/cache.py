"""Block bookkeeping for the paged KV cache. No tensors here: the runner owns the K/V storage and
this module only decides which physical block holds which tokens.

BlockPool      ref-counted blocks, an O(1) queue of empty free blocks, the prefix-hash -> block map,
               and an eviction policy (eviction.py) ordering the free blocks that hold a prefix.
KVCacheManager the block table of each sequence: growing it, forking it (copy-on-write), freeing it,
               and finding a sequence's cached prefix.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from asyncpage.kv.block import Block
from asyncpage.kv.eviction import make_policy
from asyncpage.kv.retention import Retention


class BlockPool:
    """Fixed pool of `num_blocks` blocks.

    Invariants (tested with hypothesis): every block is either referenced (ref_count > 0) or free,
    never both; a free block is in the empty queue when it holds no prefix and in the eviction
    policy's keeping (eviction.py) when it does; a block in the hash map holds exactly the tokens of
    its digest. Empty blocks are reused before any block that still holds a prefix somebody may ask
    for again; which of those goes first is the policy's choice.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, eviction_policy: str | None = None) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # OrderedDict as an O(1) doubly-linked free list of blocks holding nothing worth keeping.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, Block] = {}
        self._evictable = make_policy(eviction_policy, self.blocks, self._cached)
        self.num_evictions = 0  # cached prefixes given up to make room

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a reusable prefix."""
        return len(self._evictable)

    def allocate(self) -> Block:
        if self._free:
            block = self.blocks[self._free.popitem(last=False)[0]]
        elif len(self._evictable):
            block = self._evictable.evict()
            assert block.digest is not None
            # Out of the map before the policy hears of it: it judges what is still reachable.
            del self._cached[block.digest]
            self._evictable.uncached(block)
            block.digest = None
            block.tokens = None
            self.num_evictions += 1
        else:
            raise RuntimeError("KV block pool exhausted (the scheduler must check num_free first)")
        block.ref_count = 1
        return block

    def ref(self, block: Block, hit: bool = False) -> None:
        """Take one more reference: a prefix-cache hit (`hit`, counted by the eviction policy) or a fork."""
        if block.ref_count == 0:
            if block.digest is None:
                del self._free[block.block_id]
            else:
                self._evictable.taken(block)
        if hit:
            self._evictable.hit(block)
        block.ref_count += 1

    def free(self, block: Block) -> None:
        if block.ref_count <= 0:
            raise RuntimeError(f"double free of KV block {block.block_id}")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.digest is None:
                self._free[block.block_id] = None
                self._free.move_to_end(block.block_id, last=False)
            else:
                self._evictable.freed(block)

    def lookup(self, digest: bytes, tokens: tuple[int, ...]) -> Block | None:
        block = self._cached.get(digest)
        if block is None or block.tokens != tokens:
            return None
        return block

    def register(self, block: Block, digest: bytes, tokens: tuple[int, ...], parent: bytes | None = None,
                 depth: int = 0) -> None:
        """Record that a full block holds `tokens` under `digest`, the `depth`-th block of a chain
        continuing `parent`, so later prompts can reuse it."""
        if not self.enable_caching or block.digest is not None:
            return
        if digest in self._cached:
            return  # another block already holds this prefix; this one stays private
        block.digest = digest
        block.tokens = tokens
        self._cached[digest] = block
        self._evictable.cached(block, parent, depth)
        if block.ref_count == 0:
            del self._free[block.block_id]
            self._evictable.freed(block)

    def check_invariants(self) -> None:
        """Raises AssertionError when the pool's own bookkeeping is inconsistent."""
        empty, kept = set(self._free), set(self._evictable.evictable_ids())
        assert len(empty) == len(self._free), "a block is twice in the free queue"
        assert len(kept) == len(self._evictable), "the eviction policy counts a block twice"
        assert not empty & kept, "a block is both empty and kept for its prefix"
        for b in self.blocks:
            assert b.ref_count >= 0, f"block {b.block_id} has ref count {b.ref_count}"
            free = b.block_id in empty or b.block_id in kept
            where = "free" if free else "not free"
            assert (b.ref_count == 0) == free, f"block {b.block_id}: ref count {b.ref_count} but {where}"
            if b.block_id in empty:
                assert b.digest is None, f"block {b.block_id} holds a prefix but sits in the empty queue"
            if b.digest is not None:
                assert self._cached.get(b.digest) is b, f"block {b.block_id} has a digest the map does not point back"
        for digest, b in self._cached.items():
            assert b.digest == digest, f"the prefix map points at block {b.block_id}, which holds another digest"
        self._evictable.check_invariants()

    def reset_prefix_cache(self) -> None:
        self._evictable.clear()
        for digest, block in list(self._cached.items()):
            del self._cached[digest]
            block.digest = None
            block.tokens = None
            if block.ref_count == 0:
                self._free[block.block_id] = None


def chain_digest(parent: bytes | None, tokens: Sequence[int], salt: str | None) -> bytes:
    """sha256 over the parent's digest, the block's token ids and the tenant salt."""
    h = hashlib.sha256(parent or b"")
    h.update(b"|".join(str(t).encode() for t in tokens))
    if salt:
        h.update(b"#salt#" + salt.encode())
    return h.digest()


@dataclass
class BlockTable:
    blocks: list[Block] = field(default_factory=list)
    # Digests of this sequence's full blocks, in order (computed lazily as blocks fill).
    digests: list[bytes] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


class KVCacheManager:
    """Owns the block tables. Every method takes the table it works on: no hidden per-request state."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 eviction_policy: str | None = None) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching, eviction_policy=eviction_policy)
        self.enable_prefix_caching = enable_prefix_caching
        self.query_tokens = 0
        self.hit_tokens = 0
        # An admission keeps this many blocks free, so a freshly admitted sequence does not force a
        # preemption on the very next decode step.
        self.watermark = max(1, num_blocks // 100)
        # Keyed conversations' blocks, kept between their turns (retention.py).
        self.retention = Retention(num_blocks, self.pool)

    def keep(self, key: str, table: BlockTable) -> None:
        """Keep a keyed conversation's full blocks past its request (call before freeing the table)."""
        if self.enable_prefix_caching:
            self.retention.keep(key, table.blocks)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ----------------------------------------------------------------------
    def find_cached_prefix(self, tokens: Sequence[int], salt: str | None,
                           digests: list[bytes] | None = None) -> list[Block]:
        """Longest run of cached full blocks that prefixes `tokens`. The last token is never
        covered: its logits are needed, so at least one token is always computed. `digests` is the
        caller's cache of the chained digests of `tokens`' full blocks, extended here as needed: a
        sequence waiting at the head of the queue is looked up every step and hashed once."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = (len(tokens) - 1) // bs
        digests = [] if digests is None else digests
        hits: list[Block] = []
        for i in range(max_blocks):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            if i == len(digests):
                digests.append(chain_digest(digests[-1] if digests else None, chunk, salt))
            block = self.pool.lookup(digests[i], chunk)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_query(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.query_tokens += num_prompt_tokens
        self.hit_tokens += num_hit_tokens

    # ---- growing, forking, freeing ---------------------------------------------------------
    def can_allocate(self, table: BlockTable, num_computed: int, num_tokens: int,
                     cached: Sequence[Block] = (), reserve: int = 0) -> bool:
        """Could `table` (plus `cached` hit blocks) cover `num_tokens` tokens, keeping `reserve` free?"""
        # Hit blocks with ref 0 sit in the free queue: taking them shrinks what is free.
        revived = sum(1 for b in cached if b.ref_count == 0)
        new = self.blocks_needed(num_tokens) - len(table.blocks) - len(cached)
        new += int(self._shared_write_block(table, num_computed) is not None)
        return new + revived + reserve <= self.pool.num_free

    def allocate(self, table: BlockTable, num_computed: int, num_tokens: int,
                 cached: Sequence[Block] = ()) -> list[tuple[int, int]]:
        """Grow `table` to cover `num_tokens` tokens, the first `num_computed` of which are already
        in the cache. Returns the (src, dst) block copies the runner must do before this step writes:
        copy-on-write of a shared, partly filled block."""
        for b in cached:
            self.pool.ref(b, hit=True)
            table.blocks.append(b)
            assert b.digest is not None
            table.digests.append(b.digest)
        copies: list[tuple[int, int]] = []
        idx = self._shared_write_block(table, num_computed)
        if idx is not None:
            old = table.blocks[idx]
            new = self.pool.allocate()
            copies.append((old.block_id, new.block_id))
            table.blocks[idx] = new
            self.pool.free(old)
        while len(table.blocks) < self.blocks_needed(num_tokens):
            table.blocks.append(self.pool.allocate())
        return copies

    def _shared_write_block(self, table: BlockTable, num_computed: int) -> int | None:
        """Index of the block the next write lands in, if another sequence references it too.
        Only a partly filled block can be both shared and written: full blocks are never written
        again, and a write at a block boundary starts a fresh block."""
        idx = num_computed // self.block_size
        if num_computed % self.block_size and idx < len(table.blocks) and table.blocks[idx].ref_count > 1:
            return idx
        return None

    def fork(self, table: BlockTable) -> BlockTable:
        """A new table sharing every block of `table` (n > 1 samples of one prompt)."""
        for b in table.blocks:
            self.pool.ref(b)
        return BlockTable(list(table.blocks), list(table.digests))

    def trim(self, table: BlockTable, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens (written only by rejected drafts)."""
        keep = self.blocks_needed(num_tokens)
        while len(table.blocks) > keep:
            self.pool.free(table.blocks.pop())
        del table.digests[keep:]

    def free(self, table: BlockTable) -> None:
        # Tail first: the tail of a prompt is the least likely part to be shared, so under "lru" it is
        # evicted first (the default policy evicts chain ends first whatever the order).
        for b in reversed(table.blocks):
            self.pool.free(b)
        table.blocks.clear()
        table.digests.clear()

    def check_invariants(self, tables: Sequence[tuple[BlockTable, int]]) -> None:
        """The pool agrees with the live block tables (each given with its owner, a request id):
        free + used == total, every block's ref count equals the tables holding it, and a block is in
        two tables only when shared by a prefix-cache hit (it holds a cached prefix) or by a fork (the
        tables belong to one request)."""
        self.pool.check_invariants()
        pool = self.pool
        assert pool.num_free + pool.num_used == pool.num_blocks
        holders: dict[int, list[int]] = {}
        kept = [(BlockTable(blocks), -1 - i) for i, blocks in enumerate(self.retention.tables())]
        for table, owner in [*tables, *kept]:
            assert len({b.block_id for b in table.blocks}) == len(table.blocks), "a table holds a block twice"
            for b in table.blocks:
                holders.setdefault(b.block_id, []).append(owner)
        for b in pool.blocks:
            owners = holders.get(b.block_id, [])
            assert b.ref_count == len(owners), \
                f"block {b.block_id}: ref count {b.ref_count}, held by {len(owners)} tables"
            if len(set(owners)) > 1:
                assert b.digest is not None, f"block {b.block_id} is shared by requests {owners} but caches no prefix"

    def cache_full_blocks(self, table: BlockTable, tokens: Sequence[int], num_computed: int,
                          salt: str | None) -> None:
        """Register every block whose tokens are all computed (their KV is in the cache)."""
        bs = self.block_size
        num_full = min(num_computed // bs, len(table.blocks))
        parent = table.digests[-1] if table.digests else None
        for i in range(len(table.digests), num_full):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            digest = chain_digest(parent, chunk, salt)
            table.digests.append(digest)
            self.pool.register(table.blocks[i], digest, chunk, parent, depth=i)
            parent = digest
