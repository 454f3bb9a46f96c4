"""Paged attention over a flat batch of tokens from many sequences (no padding of prompts).

The batch is described by AttentionMetadata, built once per step by the runner and passed down the
model as an argument (no global context). Decode rows (query length 1) are attended together in one
call over their gathered blocks; each prefill chunk attends over its cached context plus itself.
This is the torch backend; the Triton kernels in asyncpage.kernels implement the same contract.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from asyncpage.model import native_attention


@dataclass
class PrefillChunk:
    start: int  # row range in the flat batch
    end: int
    num_computed: int  # tokens of this sequence already in the cache before this chunk
    block_table: torch.Tensor  # [num_blocks] int64

    @property
    def context_len(self) -> int:
        return self.num_computed + self.end - self.start


@dataclass
class AttentionMetadata:
    block_size: int
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot each new token's K/V is written to
    decode_rows: torch.Tensor | None = None  # [Bd] rows of the flat batch with query length 1
    decode_block_tables: torch.Tensor | None = None  # [Bd, max_blocks] (padded with block 0)
    decode_context_lens: torch.Tensor | None = None  # [Bd]
    # The same two on the host (the runner's lists, no copy): read per step without a tensor sync.
    decode_tables_host: list[list[int]] = field(default_factory=list)
    decode_lens_host: list[int] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    # The attention implementation of this engine (torch here, or asyncpage.kernels' Triton one):
    # chosen per runner and carried by the batch, never set on the (shareable) model modules.
    attention: Callable[..., torch.Tensor] | None = None
    # Masks depend only on the batch and the window size: built on first use in a step, shared by
    # every layer with that window.
    _masks: dict[tuple[str, int | None, int], torch.Tensor] = field(default_factory=dict)
    # Per-step tensors a backend derives once and reuses in every layer.
    scratch: dict[str, Any] = field(default_factory=dict)

    def decode_mask(self, window: int | None) -> torch.Tensor:
        key = ("decode", window, 0)
        mask = self._masks.get(key)
        if mask is None:
            assert self.decode_block_tables is not None and self.decode_context_lens is not None
            length = self.decode_block_tables.shape[1] * self.block_size
            pos = torch.arange(length, device=self.decode_context_lens.device)
            last = (self.decode_context_lens - 1)[:, None]
            mask = pos[None, :] <= last
            if window is not None:
                mask &= pos[None, :] > last - window
            mask = mask[:, None, None, :]  # [Bd, 1 (heads), 1 (query), L]
            self._masks[key] = mask
        return mask

    def prefill_mask(self, i: int, window: int | None) -> torch.Tensor | None:
        p = self.prefills[i]
        if window is None and p.num_computed == 0:
            return None  # plain causal: SDPA's is_causal path
        key = ("prefill", window, i)
        mask = self._masks.get(key)
        if mask is None:
            # On the batch's device: a CPU mask next to CUDA scores fails at the first prefill.
            dev = self.slot_mapping.device
            q_pos = torch.arange(p.num_computed, p.context_len, device=dev)[:, None]
            k_pos = torch.arange(p.context_len, device=dev)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window  # transformers' sliding_window_overlay
            self._masks[key] = mask
        return mask


# A quantized pool (kv_cache_dtype "int8" / "fp8") stores one byte a value and a float32 scale per
# token and KV head: (k, v, k_scale, v_scale), scales [num_blocks, block_size, kv_heads]. Per token, not
# per block: a block's scale would have to grow (and its tokens be requantized) as tokens arrive, and
# copy-on-write, prefix sharing and preemption need nothing new when a slot owns all it needs.
KV_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, KVH, D] -> (values in `dtype`, scale [T, KVH] float32), absmax per token and head."""
    xf = x.float()
    scale = (xf.abs().amax(-1) / KV_QMAX[dtype]).clamp(min=1e-8)
    y = xf / scale[..., None]
    return (y.round().clamp(-127, 127).to(dtype) if dtype == torch.int8 else y.to(dtype)), scale


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (x.to(torch.float32) * scale[..., None]).to(dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # index_copy_ has no float8 kernel on the CPU; the same bytes copied as uint8 are the same values.
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scales: tuple[torch.Tensor, ...] | None = None) -> None:
    """k_cache/v_cache: [num_blocks, block_size, kv_heads, head_dim]; k/v: [T, kv_heads, head_dim]."""
    kvh, d = k.shape[1], k.shape[2]
    if kv_scales:
        k, ks = quantize_kv(k, k_cache.dtype)
        v, vs = quantize_kv(v, v_cache.dtype)
        kv_scales[0].view(-1, kvh).index_copy_(0, slot_mapping, ks)
        kv_scales[1].view(-1, kvh).index_copy_(0, slot_mapping, vs)
    _bytes(k_cache).view(-1, kvh, d).index_copy_(0, slot_mapping, _bytes(k))
    _bytes(v_cache).view(-1, kvh, d).index_copy_(0, slot_mapping, _bytes(v))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    window: int | None, kv_scales: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, KVH, D] for the new tokens. Writes k/v to the cache, returns [T, H, D].
    `kv_scales` (k_scale, v_scale): the pool is quantized (see quantize_kv)."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping, kv_scales)
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    out = torch.empty_like(q)
    if meta.decode_rows is not None:
        out[meta.decode_rows] = _decode_attention(q[meta.decode_rows], k_cache, v_cache, meta, scale, window,
                                                  kv_scales)
    for i, p in enumerate(meta.prefills):
        qp = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, H, Tq, D]
        if p.num_computed == 0 and not kv_scales:
            # Nothing cached before this chunk: its own K/V are the whole context, no gather needed.
            # (A quantized pool is read back instead: every path then sees the same rounded K/V, so
            # chunking and recompute after preemption change nothing.)
            kp, vp = k[p.start : p.end], v[p.start : p.end]
        else:
            kp = k_cache.index_select(0, p.block_table).view(-1, kvh, d)[: p.context_len]
            vp = v_cache.index_select(0, p.block_table).view(-1, kvh, d)[: p.context_len]
            if kv_scales:
                ks, vs = (s.index_select(0, p.block_table).view(-1, kvh)[: p.context_len] for s in kv_scales)
                kp, vp = dequantize_kv(kp, ks, q.dtype), dequantize_kv(vp, vs, q.dtype)
        kp = kp.transpose(0, 1).unsqueeze(0)  # [1, KVH, Tk, D]
        vp = vp.transpose(0, 1).unsqueeze(0)
        mask = meta.prefill_mask(i, window)
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=True)
        out[p.start : p.end] = o[0].transpose(0, 1)
    return out


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float, window: int | None,
                      kv_scales: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """One query per sequence. On the CPU with an unquantized pool: the C kernel the fused decode step
    uses, reading the pool in place (native_attention.py). Elsewhere: plain batched matmuls over the
    gathered blocks. (CPU SDPA's flash path with a mask cost 4-5 ms a layer at batch 32 here, ten times
    these three matmuls.)"""
    assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
    if native_attention.takes(q, k_cache, v_cache, bool(kv_scales)):
        return native_attention.attend_rows(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                            window, scale)
    return _attend_blocks(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_mask(window), scale, kv_scales)


def decode_only_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                          mask: torch.Tensor, scale: float) -> torch.Tensor:
    """paged_attention for a batch of decode rows only (row i is sequence i, no padding rows), with
    its tensors passed as such (the compiled decode's operator, models/compiled.py)."""
    write_kv(k_cache, v_cache, k, v, slot_mapping)
    return _attend_blocks(q, k_cache, v_cache, block_tables, mask, scale)


def contiguous_span(meta: AttentionMetadata) -> tuple[int, int] | None:
    """(first slot, context length) of a step's one decode row whose blocks, up to its context,
    are consecutive in the pool (one stream on a pool it does not share: the allocator hands out
    free blocks in order); None otherwise. Its keys and values are then one slice of the pool."""
    if len(meta.decode_lens_host) != 1:
        return None
    ctx, table, bs = meta.decode_lens_host[0], meta.decode_tables_host[0], meta.block_size
    used = -(-ctx // bs)
    first = table[0]
    if any(table[i] != first + i for i in range(1, used)):
        return None
    return first * bs, ctx


def attend_span(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                span: tuple[int, int], window: int | None, scale: float) -> torch.Tensor:
    """One decode row (q [1, H, D], k/v [1, KVH, D]) whose context is the pool slice `span`
    (contiguous_span): writes k/v, attends to exactly the positions its window sees. No gather, no
    mask: in the compiled decode (models/compiled.py) the gather-and-mask path cost ~200 us a layer
    at one row here, most of a one-stream step's attention."""
    start, ctx = span
    _, _, kvh, d = k_cache.shape
    keys, values = k_cache.view(-1, kvh, d), v_cache.view(-1, kvh, d)
    keys[start + ctx - 1].copy_(k[0])
    values[start + ctx - 1].copy_(v[0])
    first = 0 if window is None else max(0, ctx - window)
    keys = keys[start + first : start + ctx].transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
    values = values[start + first : start + ctx].transpose(0, 1).unsqueeze(0)
    # One fused call (measured 0.3-0.9 ms a step faster here than matmul, softmax, matmul).
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, scale=scale, enable_gqa=True)
    return out.view(1, -1, d)


def _attend_blocks(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, bt: torch.Tensor,
                   mask: torch.Tensor, scale: float,
                   kv_scales: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """q [Bd, H, D] against the blocks of `bt` [Bd, blocks]; `mask` [Bd, 1, 1, L]: positions to attend."""
    bd, nb = bt.shape
    _, bs, kvh, d = k_cache.shape
    g = q.shape[1] // kvh
    flat = bt.reshape(-1)
    # index_select, not k_cache[bt]: the same gather, 6x faster on the CPU here.
    k = k_cache.index_select(0, flat).view(bd, nb * bs, kvh, d).permute(0, 2, 3, 1)  # [Bd, KVH, D, L]
    v = v_cache.index_select(0, flat).view(bd, nb * bs, kvh, d).transpose(1, 2)  # [Bd, KVH, L, D]
    qg = q.reshape(bd, kvh, g, d)  # query heads grouped by the KV head they share (GQA)
    if kv_scales:
        # Scales are per key position: applied to the scores and to the probabilities (q.(s k) =
        # s (q.k), sum p (s v) = sum (p s) v) instead of to every element of the gathered K and V.
        ks, vs = (sc.index_select(0, flat).view(bd, nb * bs, kvh).transpose(1, 2).unsqueeze(2) for sc in kv_scales)
        scores = torch.matmul(qg, k.to(q.dtype)).float() * (ks * scale)  # [Bd, KVH, G, L]
    else:
        scores = torch.matmul(qg, k) * scale  # [Bd, KVH, G, L]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if kv_scales:
        return torch.matmul((probs * vs).to(q.dtype), v.to(q.dtype)).reshape(bd, kvh * g, d)
    return torch.matmul(probs.to(q.dtype), v).reshape(bd, kvh * g, d)
