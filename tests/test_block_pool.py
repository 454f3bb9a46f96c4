"""Block pool and block tables: allocate / grow / fork / copy-on-write / free / evict invariants."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from asyncpage.kv.cache import BlockPool, BlockTable, KVCacheManager

BS = 4
N = 24


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(N, BS, enable_prefix_caching=True)
        self.tables: list[tuple[BlockTable, list[int], int]] = []  # table, tokens, computed

    def _can(self, table: BlockTable, computed: int, total: int) -> bool:
        return self.kv.can_allocate(table, computed, total)

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=30))
    def admit(self, tokens: list[int]) -> None:
        table = BlockTable()
        cached = self.kv.find_cached_prefix(tokens, None)
        start = len(cached) * BS
        assert start < len(tokens)  # the last token is always computed
        if self.kv.can_allocate(table, start, len(tokens), cached):
            self.kv.allocate(table, start, len(tokens), cached)
            self.kv.cache_full_blocks(table, tokens, len(tokens), None)
            self.tables.append((table, tokens, len(tokens)))

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 100), k=st.integers(1, 9), tok=st.integers(0, 3))
    def grow(self, i: int, k: int, tok: int) -> None:
        table, tokens, computed = self.tables[i % len(self.tables)]
        new_tokens = tokens + [tok] * k
        if self._can(table, computed, len(new_tokens)):
            copies = self.kv.allocate(table, computed, len(new_tokens))
            for src, dst in copies:
                assert src != dst and self.kv.pool.blocks[dst].ref_count == 1
            if computed % BS:
                # The partly filled block about to be written is private: copy-on-write happened.
                assert table.blocks[computed // BS].ref_count == 1
            self.kv.cache_full_blocks(table, new_tokens, len(new_tokens), None)
            self.tables[i % len(self.tables)] = (table, new_tokens, len(new_tokens))

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 100))
    def fork(self, i: int) -> None:
        table, tokens, computed = self.tables[i % len(self.tables)]
        self.tables.append((self.kv.fork(table), list(tokens), computed))

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 100))
    def free(self, i: int) -> None:
        table, _, _ = self.tables.pop(i % len(self.tables))
        self.kv.free(table)

    @invariant()
    def free_plus_used_is_total(self) -> None:
        pool = self.kv.pool
        assert pool.num_free + pool.num_used == N
        assert pool.num_free == sum(1 for b in pool.blocks if b.ref_count == 0)

    @invariant()
    def ref_counts_equal_table_references(self) -> None:
        counts = [0] * N
        for table, _, _ in self.tables:
            for b in table.blocks:
                counts[b.block_id] += 1
        assert counts == [b.ref_count for b in self.kv.pool.blocks]

    @invariant()
    def cached_blocks_hold_their_tokens(self) -> None:
        for digest, block in self.kv.pool._cached.items():
            assert block.digest == digest and block.tokens is not None and len(block.tokens) == BS

    def teardown(self) -> None:
        for table, _, _ in self.tables:
            self.kv.free(table)
        assert self.kv.pool.num_used == 0


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_double_free_is_an_error() -> None:
    pool = BlockPool(2)
    b = pool.allocate()
    pool.free(b)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(b)


def test_uncached_free_blocks_are_reused_before_cached_ones() -> None:
    kv = KVCacheManager(4, 2)
    a, b = BlockTable(), BlockTable()
    kv.allocate(a, 0, 4)
    kv.cache_full_blocks(a, [1, 2, 3, 4], 4, None)  # a's two blocks now hold a cached prefix
    kv.allocate(b, 0, 3)  # b: one full block (registered), one partial
    kv.free(a)
    kv.free(b)
    fresh = BlockTable()
    kv.allocate(fresh, 0, 2)
    # The partial, uncached block of b is reused first; a's prefix is still findable.
    assert len(kv.find_cached_prefix([1, 2, 3, 4, 5], None)) == 2


def test_forked_tables_share_the_partial_block_until_one_writes() -> None:
    kv = KVCacheManager(8, 4)
    parent = BlockTable()
    kv.allocate(parent, 0, 6)  # 6-token prompt: one full block + a partial one
    kv.cache_full_blocks(parent, list(range(6)), 6, None)
    child = kv.fork(parent)
    assert [b.ref_count for b in parent.blocks] == [2, 2]
    copies = kv.allocate(child, 6, 7)  # the child writes token 7 into the shared partial block
    assert len(copies) == 1 and copies[0][0] == parent.blocks[1].block_id
    assert child.blocks[0] is parent.blocks[0] and child.blocks[1] is not parent.blocks[1]
    assert kv.allocate(parent, 6, 7) == []  # now private to the parent: written in place


def test_salted_prefixes_are_isolated() -> None:
    kv = KVCacheManager(8, 2)
    t = BlockTable()
    kv.allocate(t, 0, 5)
    kv.cache_full_blocks(t, [1, 2, 3, 4, 5], 5, "tenant-a")
    assert len(kv.find_cached_prefix([1, 2, 3, 4, 5], "tenant-a")) == 2
    assert kv.find_cached_prefix([1, 2, 3, 4, 5], "tenant-b") == []
    assert kv.find_cached_prefix([1, 2, 3, 4, 5], None) == []
