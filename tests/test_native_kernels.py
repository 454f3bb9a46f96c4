"""asyncpage.native: the C kernels of the one-stream decode step give what torch's ops give, and
where they cannot be built the torch ops serve."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncpage import native
from asyncpage.attention import AttentionMetadata, decode_only_attention


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block", "window"), [
    (4, 1, 256, 16, None),  # the default model's shape: 4 query heads on one KV head
    (4, 1, 256, 16, 16),  # a sliding window inside the context
    (8, 2, 64, 4, None),
    (4, 4, 32, 1, 7),  # no grouping, blocks of one slot
])
def test_decode_rows_attend_over_any_block_tables_as_torchs_gather_and_mask(
        heads: int, kv_heads: int, dim: int, block: int, window: int | None) -> None:
    """Rows of several lengths (1, one block exactly, a shared first block, scattered blocks)
    against the torch path that gathers each row's blocks and masks them."""
    kernels = native.load()
    assert kernels is not None
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(64, block, kv_heads, dim, generator=gen) for _ in range(2))
    lens = [1, block, 3 * block + 2, 2 * block + 1]
    need = [-(-n // block) for n in lens]
    free = iter([40, 41, 7, 30, 3, 44, 45, 46, 47, 48, 49, 50, 51])  # not in order: scattered blocks
    tables = [[5], [9]] + [[2] + [next(free) for _ in range(b - 1)] for b in need[2:]]  # rows 3, 4 share block 2
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(block_size=block, slot_mapping=torch.tensor(
        [t[(n - 1) // block] * block + (n - 1) % block for t, n in zip(tables, lens, strict=True)]))
    meta.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    meta.decode_context_lens = torch.tensor(lens)
    rows = len(lens)
    q = torch.randn(rows, heads, dim, generator=gen)
    k, v = (torch.randn(rows, kv_heads, dim, generator=gen) for _ in range(2))
    pools = (k_cache.clone(), v_cache.clone())
    want = decode_only_attention(q, k, v, k_cache, v_cache, meta.slot_mapping, meta.decode_block_tables,
                                 meta.decode_mask(window), dim ** -0.5)
    got = kernels.attend_rows(q, k, v, *pools, meta.decode_block_tables, meta.decode_context_lens,
                              meta.slot_mapping, window, dim ** -0.5)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert torch.equal(pools[0], k_cache) and torch.equal(pools[1], v_cache)  # the new K/V, at the same slots


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
    pool, table = torch.zeros(4, 2, 1, 8), torch.zeros(1, 2, dtype=torch.long)
    assert native.takes(torch.zeros(1, 8), (pool, pool), table)
    assert not native.takes(torch.zeros(1, 8, dtype=torch.bfloat16), (pool, pool), table)
    assert not native.takes(torch.zeros(1, 8), (pool, pool.transpose(0, 1)), table)
    assert not native.takes(torch.zeros(1, 8), (pool, pool, torch.zeros(4)), table)  # a quantized pool's scales
    assert not native.takes(torch.zeros(1, 8), (pool, pool), table.int())


def test_the_kernels_answer_in_float32_whatever_torchs_default_dtype() -> None:
    kernels = native.load()
    assert kernels is not None
    pool = torch.zeros(4, 2, 1, 8, dtype=torch.float32)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = kernels.attend_rows(torch.ones(1, 2, 8, dtype=torch.float32), torch.ones(1, 1, 8, dtype=torch.float32),
                                  torch.full((1, 1, 8), 3.0, dtype=torch.float32), pool, pool.clone(),
                                  torch.tensor([[1]]), torch.tensor([1]), torch.tensor([2]), None, 0.5)
    finally:
        torch.set_default_dtype(previous)
    assert out.dtype == torch.float32 and torch.equal(out, torch.full((1, 2, 8), 3.0))


def test_a_cached_library_that_does_not_load_is_rebuilt(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native.load.cache_clear()
    try:
        built = native._build()  # built, not loaded: a loaded library must never be rewritten in place
        built.write_bytes(built.read_bytes()[:100])  # a torn file at its cache key, as a killed build leaves
        assert native.load() is not None
        assert built.stat().st_size > 100
    finally:
        native.load.cache_clear()
