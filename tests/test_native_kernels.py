"""asyncpage.native: the C kernels of the one-stream decode step give what torch's ops give, and
where they cannot be built the torch ops serve."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncpage import native
from asyncpage.attention import attend_span


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block", "start_block", "ctx", "window"), [
    (4, 1, 256, 16, 3, 80, None),  # the default model's shape: 4 query heads on one KV head
    (4, 1, 256, 16, 3, 80, 16),  # a sliding window inside the context
    (8, 2, 64, 4, 0, 1, None),  # the first token: a context of one
    (4, 4, 32, 1, 7, 513, 512),  # no grouping, blocks of one slot, the window one short of the context
])
def test_one_row_attention_over_a_pool_slice_equals_torchs(heads: int, kv_heads: int, dim: int, block: int,
                                                          start_block: int, ctx: int, window: int | None) -> None:
    kernels = native.load()
    assert kernels is not None
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(600, block, kv_heads, dim, generator=gen) for _ in range(2))
    q = torch.randn(1, heads, dim, generator=gen)
    k, v = (torch.randn(1, kv_heads, dim, generator=gen) for _ in range(2))
    pools = (k_cache.clone(), v_cache.clone())
    span = (start_block * block, ctx)
    want = attend_span(q, k, v, k_cache, v_cache, span, window, dim ** -0.5)
    got = kernels.attend_span(q, k, v, *pools, span, window, dim ** -0.5)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert torch.equal(pools[0], k_cache) and torch.equal(pools[1], v_cache)  # the new K/V, at the same slot


def test_without_a_c_compiler_the_torch_ops_serve(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built there
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))
    native.load.cache_clear()
    try:
        assert native.load() is None
    finally:
        native.load.cache_clear()


def test_asyncpage_native_0_turns_them_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCPAGE_NATIVE", "0")
    native.load.cache_clear()
    try:
        assert native.load() is None
    finally:
        native.load.cache_clear()


def test_only_float32_cpu_tensors_and_contiguous_pools_are_taken() -> None:
    pool = torch.zeros(4, 2, 1, 8)
    assert native.takes(torch.zeros(1, 8), pool, pool)
    assert not native.takes(torch.zeros(1, 8, dtype=torch.bfloat16), pool, pool)
    assert not native.takes(torch.zeros(1, 8), pool, pool.transpose(0, 1))
