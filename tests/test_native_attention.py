"""Decode rows of the eager forward read the pool through the fused step's C attention (model/native_attention.py):
the same output as attention.py's torch form (gathered blocks, matmuls) on scattered block tables, sliding windows,
GQA and every pool dtype it takes; a block table pointing outside the pool is refused, never read."""

from __future__ import annotations

import pytest
import torch

from asyncpage.model import native_attention
from asyncpage.model.attention import AttentionMetadata, _attend_blocks, paged_attention

pytestmark = pytest.mark.skipif(native_attention._fn() is None, reason="the native kernels did not build")


def _rows(dtype: torch.dtype, heads: int = 4, kv_heads: int = 2, dim: int = 64, block: int = 16,
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(30, block, kv_heads, dim, generator=g).to(dtype)
    vc = torch.randn(30, block, kv_heads, dim, generator=g).to(dtype)
    tables = torch.stack([torch.randperm(30, generator=g)[:12] for _ in range(5)])
    lens = torch.tensor([1, 16, 17, 100, 12 * block])
    q = torch.randn(5, heads, dim, generator=g).to(dtype)
    return q, kc, vc, tables, lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 20])
def test_decode_rows_attend_as_the_torch_form_does(dtype: torch.dtype, window: int | None) -> None:
    q, kc, vc, tables, lens = _rows(dtype)
    meta = AttentionMetadata(block_size=16, slot_mapping=torch.zeros(5, dtype=torch.long),
                             decode_block_tables=tables, decode_context_lens=lens)
    want = _attend_blocks(q.float(), kc.float(), vc.float(), tables, meta.decode_mask(window), 0.125)
    got = native_attention.attend_rows(q, kc, vc, tables, lens, window, 0.125)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_the_eager_forward_takes_the_native_form_for_its_decode_rows() -> None:
    # paged_attention's decode rows (beside a prefill chunk) equal the torch form's on the same pool.
    q, kc, vc, tables, lens = _rows(torch.float32)
    k, v = torch.randn(5, 2, 64), torch.randn(5, 2, 64)
    slots = torch.tensor([int(tables[r, (lens[r] - 1) // 16]) * 16 + int(lens[r] - 1) % 16 for r in range(5)])
    meta = AttentionMetadata(block_size=16, slot_mapping=slots, decode_rows=torch.arange(5),
                             decode_block_tables=tables, decode_context_lens=lens)
    got = paged_attention(q, k, v, kc, vc, meta, 0.125, None)
    want = _attend_blocks(q, kc, vc, tables, meta.decode_mask(None), 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_table_outside_the_pool_is_refused() -> None:
    q, kc, vc, tables, lens = _rows(torch.float32)
    bad = tables.clone()
    bad[3, 2] = 30  # one past the pool's last block, inside row 3's context
    with pytest.raises(RuntimeError, match="out of range"):
        native_attention.attend_rows(q, kc, vc, bad, lens, None, 0.125)
    with pytest.raises(RuntimeError, match="out of range"):
        native_attention.attend_rows(q, kc, vc, tables, torch.tensor([1, 16, 17, 100, 12 * 16 + 1]), None, 0.125)


def test_rows_of_mismatched_shapes_are_refused_before_the_kernel_reads_them() -> None:
    q, kc, vc, tables, lens = _rows(torch.float32)
    for args in ((q[:, :, :32], kc, vc, tables, lens), (q, kc, vc[:1], tables, lens), (q, kc, vc, tables[:1], lens),
                 (q, kc, vc, tables, lens[:2]), (q[:, :3], kc, vc, tables, lens)):
        with pytest.raises(ValueError, match="mismatched shapes"):
            native_attention.attend_rows(*args, None, 0.125)
