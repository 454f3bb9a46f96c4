"""Prefix-cache eviction: what a tight pool gives up first, under the default policy and under "lru"."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis.stateful import invariant

from asyncpage import AsyncEngine, InvalidRequestError, SamplingParams
from asyncpage.bench.throughput import eviction_workload
from asyncpage.kv.cache import BlockPool, BlockTable, KVCacheManager
from tests.test_block_pool import N, PoolMachine

BS = 4


def serve(kv: KVCacheManager, tokens: list[int]) -> int:
    """One request through the pool as the scheduler runs it: look up, allocate, compute, cache,
    free. Returns the prompt tokens found in the cache."""
    table = BlockTable()
    cached = kv.find_cached_prefix(tokens, None)
    assert kv.can_allocate(table, len(cached) * BS, len(tokens), cached)
    kv.allocate(table, len(cached) * BS, len(tokens), cached)
    kv.cache_full_blocks(table, tokens, len(tokens), None)
    kv.pool.check_invariants()
    kv.free(table)
    return len(cached) * BS


def one_off(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(100, 10_000) for _ in range(n)]


def test_the_end_of_a_prefix_chain_is_evicted_before_the_blocks_it_continues() -> None:
    kv = KVCacheManager(6, BS)
    chain = list(range(100, 113))  # 3 full blocks + 1 token: a0 <- a1 <- a2
    serve(kv, chain)
    pool = kv.pool
    found = kv.find_cached_prefix(chain, None)
    assert len(found) == 3
    taken = [pool.allocate() for _ in range(6)]  # empty blocks first, then the cached ones
    # The root is the cheapest block to recompute, yet it goes last: until then the rest of the chain
    # stays reachable from it.
    assert taken[3:] == [found[2], found[1], found[0]]
    assert pool.num_evictions == 3


def test_what_is_left_of_a_chain_stays_reachable_while_it_is_evicted() -> None:
    kv = KVCacheManager(12, BS)
    rng = random.Random(0)
    chains = [one_off(rng, 4 * BS + 1) for _ in range(2)]
    for c in chains:
        serve(kv, c)
    cached = {b.digest for b in kv.pool.blocks if b.digest is not None}
    for _ in range(8):
        kv.pool.allocate()
        remaining = {b.digest for b in kv.pool.blocks if b.digest is not None}
        # Every block still cached is found by a prompt starting with its chain: no holes.
        assert sum(len(kv.find_cached_prefix(c, None)) for c in chains) == len(remaining)
        assert remaining <= cached


@pytest.mark.parametrize("policy", [None, "lru"])
def test_a_system_prompt_many_requests_reuse_survives_churn_that_lru_evicts(policy: str | None) -> None:
    kv = KVCacheManager(24, BS, eviction_policy=policy)
    rng = random.Random(1)
    system = one_off(rng, 4 * BS)
    for _ in range(4):  # four requests share it: three hits
        serve(kv, system + one_off(rng, 2))
    for _ in range(4):  # one-off prompts of 6 blocks: 24 blocks through a pool of 24
        serve(kv, one_off(rng, 6 * BS))
    found = serve(kv, system + one_off(rng, 2))
    assert kv.pool.num_evictions > 0
    assert found == (4 * BS if policy is None else 0)


def test_a_prefix_nobody_asks_for_any_more_does_not_pin_the_pool() -> None:
    kv = KVCacheManager(24, BS)
    rng = random.Random(2)
    system = one_off(rng, 4 * BS)
    for _ in range(10):
        serve(kv, system + one_off(rng, 2))
    for _ in range(60):  # ~15 turnovers of the pool without it
        serve(kv, one_off(rng, 6 * BS))
    assert kv.find_cached_prefix([*system, 1], None) == []
    # And a prefix that became popular since then is kept through the same kind of churn.
    fresh = one_off(rng, 4 * BS)
    for _ in range(4):
        serve(kv, fresh + one_off(rng, 2))
    for _ in range(4):
        serve(kv, one_off(rng, 6 * BS))
    assert len(kv.find_cached_prefix([*fresh, 1], None)) == 4


def test_a_shared_prompt_evicted_between_its_uses_is_noticed_when_it_comes_back() -> None:
    # Recency alone loses it every time; the default policy remembers that it was asked for before.
    workload = eviction_workload(random.Random(3), 1, rounds=6, every=4, system_tokens=8 * BS,
                                 prompt_tokens=8 * BS, question_tokens=2)
    found = {}
    for policy in (None, "lru"):
        kv = KVCacheManager(24, BS, eviction_policy=policy)
        served = [(shared, serve(kv, p)) for shared, p in workload]
        found[policy] = [n for shared, n in served if shared]
    assert found["lru"] == [0] * 6
    assert found[None][3:] == [8 * BS] * 3


@pytest.mark.parametrize(("system_blocks", "one_off_blocks", "pool"), [(8, 32, 64), (16, 64, 80), (8, 64, 80)])
def test_a_shared_prompt_survives_one_off_prompts_much_longer_than_it(system_blocks: int, one_off_blocks: int,
                                                                      pool: int) -> None:
    # One-offs 4-8x the system prompt, a pool about half of a round: the churn evicts more digests
    # per round than the pool holds, and a deep one-off tail must not outweigh a prefix hit twice.
    workload = eviction_workload(random.Random(7), 1, rounds=8, every=4, system_tokens=system_blocks * BS,
                                 prompt_tokens=one_off_blocks * BS, question_tokens=2)
    found = {}
    for policy in (None, "lru"):
        kv = KVCacheManager(pool, BS, eviction_policy=policy)
        found[policy] = [n for shared, n in ((s, serve(kv, p)) for s, p in workload) if shared]
    assert found["lru"] == [0] * 8
    assert sum(n == system_blocks * BS for n in found[None]) >= 4, found[None]  # from its 4th use on, or sooner


def test_allocation_succeeds_when_every_cached_free_block_continues_into_one_in_use() -> None:
    # Two requests computed the same prefix at once: the second's copy stayed private, and its next
    # block continues the first's. Once the first ends, no free cached block is a leaf.
    kv = KVCacheManager(6, BS)
    prefix = list(range(100, 108))
    first, second = BlockTable(), BlockTable()
    kv.allocate(first, 0, 8)
    kv.allocate(second, 0, 13)
    kv.cache_full_blocks(first, prefix, 8, None)
    kv.cache_full_blocks(second, [*prefix, 7, 7, 7, 7, 7], 13, None)
    held_by_first = set(first.ids)
    kv.free(first)
    pool = kv.pool
    pool.check_invariants()
    assert pool.num_free == 2 and pool.num_cached_free == 2
    got = [pool.allocate(), pool.allocate()]
    assert {b.block_id for b in got} == held_by_first
    pool.check_invariants()
    assert pool.num_evictions == 2 and pool.num_free == 0
    for b in got:
        pool.free(b)
    kv.free(second)
    pool.check_invariants()
    assert pool.num_used == 0


def test_reset_prefix_cache_empties_the_policy_too() -> None:
    kv = KVCacheManager(8, BS)
    serve(kv, list(range(100, 113)))
    kv.pool.reset_prefix_cache()
    kv.pool.check_invariants()
    assert kv.pool.num_cached_free == 0 and kv.pool.num_free == 8
    assert kv.find_cached_prefix(list(range(100, 113)), None) == []


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="eviction_policy"):
        BlockPool(4, eviction_policy="mru")
    with pytest.raises(InvalidRequestError) as err:
        AsyncEngine.from_pretrained(eviction_policy="lfu")  # refused before any loading
    assert err.value.field == "eviction_policy"


class DefaultPolicyMachine(PoolMachine):
    """test_block_pool's random allocate / grow / fork / free, with the policy's own records checked."""

    policy: str | None = None

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(N, 4, eviction_policy=self.policy)

    @invariant()
    def pool_and_policy_agree(self) -> None:
        self.kv.pool.check_invariants()


class LRUPolicyMachine(DefaultPolicyMachine):
    policy = "lru"


TestDefaultPolicyMachine = DefaultPolicyMachine.TestCase
TestDefaultPolicyMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestLRUPolicyMachine = LRUPolicyMachine.TestCase
TestLRUPolicyMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)


async def test_a_tight_pool_serves_the_same_tokens_under_either_policy_as_without_caching(
        default_engine: AsyncEngine) -> None:
    """Issue acceptance, scaled down: a 128-token system prompt every 4th request, one-off prompts
    churning a 24-block pool (a round needs ~36)."""
    workload = eviction_workload(random.Random(5), default_engine.tokenizer.bos_token_id, rounds=3, every=4,
                                 system_tokens=128, prompt_tokens=128)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    outputs, stats = {}, {}
    for name, options in (("off", {"enable_prefix_caching": False}), ("lru", {"eviction_policy": "lru"}),
                          ("default", {"eviction_policy": None})):
        async with default_engine.clone(num_kv_blocks=24, debug_checks=True, **options) as engine:
            outputs[name] = [(await engine.generate(p, params)).token_ids for _, p in workload]
            stats[name] = engine.stats()
    assert outputs["default"] == outputs["off"]
    assert outputs["lru"] == outputs["off"]
    assert stats["default"].prefix_cache_evictions > 0 and stats["lru"].prefix_cache_evictions > 0
    assert stats["default"].prefix_cache_hit_tokens > stats["lru"].prefix_cache_hit_tokens
    assert stats["off"].prefix_cache_evictions == 0
    assert stats["default"].kv_blocks_used == 0
