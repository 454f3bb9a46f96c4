"""Sharing KV: prefix caching across requests and copy-on-write between the n samples of one."""

from __future__ import annotations

import asyncio
from pathlib import Path

from asyncpage import AsyncEngine, SamplingParams
from tests.test_engine_lifecycle import PROMPTS, tiny_engine

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SYSTEM = "You are a helpful assistant. Answer briefly and precisely. " * 4


async def test_greedy_outputs_are_identical_with_prefix_caching_on_and_off(tiny_llama: Path) -> None:
    prompts = [SYSTEM + p for p in PROMPTS[:8]]
    async with tiny_engine(tiny_llama, enable_prefix_caching=False) as off:
        expected = [await off.generate(p, GREEDY) for p in prompts]
        assert off.stats().prefix_cache_hit_tokens == 0
    async with tiny_engine(tiny_llama) as on:
        first = await on.generate(prompts[0], GREEDY)
        rest = await asyncio.gather(*(on.generate(p, GREEDY) for p in prompts[1:]))
        st = on.stats()
    assert [o.token_ids for o in [first, *rest]] == [o.token_ids for o in expected]
    system_tokens = len(on.tokenizer(SYSTEM).input_ids)
    # Every later request reuses the shared system prompt's full blocks.
    assert st.prefix_cache_hit_tokens >= 7 * (system_tokens // 4 * 4 - 4)
    assert all(o.metrics.num_cached_prompt_tokens > 0 for o in rest)
    assert st.kv_blocks_used == 0 and st.kv_blocks_cached > 0


async def test_cache_salt_keeps_tenants_apart(tiny_llama: Path) -> None:
    async with tiny_engine(tiny_llama) as engine:
        a = SamplingParams(max_tokens=4, temperature=0, cache_salt="tenant-a")
        b = SamplingParams(max_tokens=4, temperature=0, cache_salt="tenant-b")
        await engine.generate(SYSTEM, a)
        hit_b = await engine.generate(SYSTEM, b)
        hit_a = await engine.generate(SYSTEM, a)
    assert hit_b.metrics.num_cached_prompt_tokens == 0
    assert hit_a.metrics.num_cached_prompt_tokens > 0


async def test_parallel_samples_share_the_prompt_and_differ(tiny_llama: Path) -> None:
    prompt = SYSTEM + "Tell me a story."
    params = SamplingParams(n=6, max_tokens=20, temperature=1.0, seed=3, ignore_eos=True)
    async with tiny_engine(tiny_llama, enable_prefix_caching=False) as engine:
        out = await engine.generate(prompt, params)
        again = await engine.generate(prompt, params)
        chunks = [c async for c in engine.stream(prompt, params)]
        st = engine.stats()
    assert [c.index for c in out.choices] == list(range(6))
    assert all(len(c.token_ids) == 20 for c in out.choices)
    assert len({tuple(c.token_ids) for c in out.choices}) >= 5  # distinct samples
    assert [c.token_ids for c in again.choices] == [c.token_ids for c in out.choices]  # seeded per sample
    assert {c.index for c in chunks} == set(range(6))
    assert sum(1 for c in chunks if c.finish_reason is not None) == 6
    assert st.kv_blocks_used == 0 and st.num_running == 0


async def test_forked_group_fits_where_n_copies_of_the_prompt_would_not(tiny_llama: Path) -> None:
    prompt = SYSTEM * 2  # ~ 200 tokens = ~50 blocks of 4
    n_prompt = len((await _tok(tiny_llama))(prompt).input_ids)
    blocks_prompt = -(-n_prompt // 4)
    # Room for the prompt once plus each sample's own tail, far from n copies of the prompt.
    pool = blocks_prompt + 4 * 4 + 4
    assert pool < 4 * blocks_prompt
    params = SamplingParams(n=4, max_tokens=10, temperature=0.9, seed=1, ignore_eos=True)
    async with tiny_engine(tiny_llama, num_kv_blocks=pool, enable_prefix_caching=False) as engine:
        out = await engine.generate(prompt, params)
        st = engine.stats()
    assert st.num_preemptions == 0
    assert all(len(c.token_ids) == 10 for c in out.choices)
    assert st.kv_blocks_used == 0


async def test_greedy_samples_of_a_fork_are_all_equal_to_one_greedy_run(tiny_llama: Path) -> None:
    async with tiny_engine(tiny_llama) as engine:
        one = await engine.generate(PROMPTS[3], GREEDY)
        many = await engine.generate(PROMPTS[3], SamplingParams(n=3, max_tokens=24, temperature=0, ignore_eos=True))
    assert all(c.token_ids == one.token_ids for c in many.choices)


async def test_preempting_forked_samples_keeps_accounting_exact(tiny_llama: Path) -> None:
    params = SamplingParams(n=4, max_tokens=30, temperature=0, ignore_eos=True)
    async with tiny_engine(tiny_llama) as big:
        expected = await asyncio.gather(*(big.generate(p, params) for p in PROMPTS[:6]))
        async with big.clone(num_kv_blocks=60) as small:
            got = await asyncio.gather(*(small.generate(p, params) for p in PROMPTS[:6]))
            st = small.stats()
    assert [[c.token_ids for c in o.choices] for o in got] == [[c.token_ids for c in o.choices] for o in expected]
    assert st.num_preemptions > 0
    assert st.kv_blocks_used == 0 and st.num_running == 0 and st.num_waiting == 0


async def _tok(path: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


async def test_shared_prefix_on_the_default_model_hits_and_matches(default_engine: AsyncEngine) -> None:
    """Issue acceptance, scaled: requests sharing a 512-token prefix reuse it and give the same tokens
    as with caching off."""
    import random

    rng = random.Random(0)
    prefix = [2] + [rng.randint(1000, 200_000) for _ in range(511)]
    prompts = [prefix + [rng.randint(1000, 200_000) for _ in range(16)] for _ in range(4)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    async with default_engine.clone(enable_prefix_caching=False) as off:
        expected = [await off.generate(p, params) for p in prompts]
    before = default_engine.stats()
    cold = await default_engine.generate(prompts[0], params)
    warm = await asyncio.gather(*(default_engine.generate(p, params) for p in prompts[1:]))
    st = default_engine.stats()
    assert [o.token_ids for o in [cold, *warm]] == [o.token_ids for o in expected]
    assert st.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens >= 0.9 * 3 * 512


async def test_eight_samples_of_a_709_token_prompt_fit_80_blocks_without_preemption(
        default_engine: AsyncEngine) -> None:
    import random

    # Varied tokens, not the reference's repeated paragraphs: on those the model copies the next
    # sentence with near certainty, and most samples come out equal however they are drawn.
    rng = random.Random(3)
    prompt = [2] + [rng.randint(1000, 200_000) for _ in range(708)]
    params = SamplingParams(n=8, temperature=0.8, seed=7, max_tokens=32)
    async with default_engine.clone(num_kv_blocks=80, enable_prefix_caching=False) as small:
        out = await small.generate(prompt, params)
        st = small.stats()
    assert st.num_preemptions == 0 and st.kv_blocks_used == 0
    assert len(out.choices) == 8
    assert all(len(c.token_ids) == 32 or c.finish_reason == "stop" for c in out.choices)
    assert len({tuple(c.token_ids) for c in out.choices}) >= 6  # distinct samples
