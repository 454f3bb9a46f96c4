"""Conversations that keep their KV (issue 34 item 2): with `cache_key`, a finished turn's blocks are
kept for the key's next turn through eviction pressure (a flood of other prompts in between), within
half the pool; without it they are evicted like any cached prefix. Kept blocks never deadlock the pool."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from asyncpage import InvalidRequestError, SamplingParams
from asyncpage.kv import retention
from tests.test_faults import tiny_engine

TURN = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


async def _flood(engine, n: int = 24) -> None:  # type: ignore[no-untyped-def]
    """Other callers' distinct prompts, enough to evict every unreferenced cached block."""
    await asyncio.gather(*(engine.generate([7 + i] * 40 + [3 + i], SamplingParams(max_tokens=2)) for i in range(n)))


async def _second_turn_cached(engine, key: str | None) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    system = list(range(10, 70))  # a 60-token "system prompt + history"
    first = await engine.generate(system, TURN, cache_key=key)
    await _flood(engine)
    second = system + first.token_ids + [5, 6, 7, 8]
    out = await engine.generate(second, TURN, cache_key=key)
    return out.metrics.num_cached_prompt_tokens, len(system + first.token_ids)


async def test_a_keyed_conversation_finds_its_previous_turn_after_a_flood(tiny_llama: Path) -> None:
    async with tiny_engine(tiny_llama, num_kv_blocks=64) as engine:
        cached, previous = await _second_turn_cached(engine, "conv-1")
        assert cached >= (previous // 4) * 4 - 4  # every full block of the previous turn but the last
        st = engine.stats()
        assert 0 < st.kv_blocks_kept <= 32 and st.kv_blocks_used == 0  # kept apart from live blocks
        assert engine._core.check_invariants()


async def test_without_a_key_the_flood_evicts_the_previous_turn(tiny_llama: Path) -> None:
    async with tiny_engine(tiny_llama, num_kv_blocks=64) as engine:
        cached, _ = await _second_turn_cached(engine, None)
        assert cached == 0
        assert engine.stats().kv_blocks_kept == 0


async def test_kept_blocks_stay_within_their_share_and_give_way_when_nothing_else_can(tiny_llama: Path) -> None:
    async with tiny_engine(tiny_llama, num_kv_blocks=64, max_num_seqs=4) as engine:
        for k in range(6):  # six conversations of ~17 blocks each: more than half the pool
            await engine.generate([20 + k] * 60, TURN, cache_key=f"c{k}")
            assert engine.stats().kv_blocks_kept <= 32
        # A prompt that needs more than the unkept half starts anyway: the oldest keys give way.
        big = await engine.generate([(9 + 7 * i) % 300 for i in range(230)], SamplingParams(max_tokens=2))
        assert len(big.token_ids) == 2
        assert engine._core.check_invariants()


async def test_an_idle_key_is_let_go(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retention, "IDLE_S", 0.05)
    async with tiny_engine(tiny_llama, num_kv_blocks=64) as engine:
        await engine.generate(list(range(10, 70)), TURN, cache_key="idle")
        assert engine.stats().kv_blocks_kept > 0
        await asyncio.sleep(0.1)
        await engine.generate([1, 2, 3], SamplingParams(max_tokens=1))  # a step runs the idle check
        assert engine.stats().kv_blocks_kept == 0


@pytest.mark.parametrize("bad", ["", 5, "k" * 300])
async def test_a_bad_cache_key_is_refused_naming_it(tiny_llama: Path, bad: object) -> None:
    async with tiny_engine(tiny_llama) as engine:
        with pytest.raises(InvalidRequestError) as info:
            await engine.generate("x", TURN, cache_key=bad)  # type: ignore[arg-type]
        assert info.value.field == "cache_key"
