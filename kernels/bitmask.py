"""Triton kernel: apply a guided-decoding token bitmask to logits in place."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _apply_bitmask_kernel(logits_ptr, mask_ptr, vocab, stride_l, stride_m, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < vocab
    words = tl.load(mask_ptr + row * stride_m + offs // 32, mask=m, other=0)
    allowed = ((words >> (offs % 32)) & 1) == 1
    x = tl.load(logits_ptr + row * stride_l + offs, mask=m)
    tl.store(logits_ptr + row * stride_l + offs, tl.where(allowed, x, float("-inf")), mask=m)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [N, V]; bitmask [N, ceil(V/32)] int32 (bit j of word i allows token 32*i + j). The
    logits width decides the vocabulary, never the tokenizer's length."""
    n, vocab = logits.shape
    block = 1024
    _apply_bitmask_kernel[(n, triton.cdiv(vocab, block))](logits, bitmask, vocab, logits.stride(0),
                                                          bitmask.stride(0), BLOCK=block)
