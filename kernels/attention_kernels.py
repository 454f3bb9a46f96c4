"""Triton kernels for paged attention: decode (one query per sequence) and prefill chunks that
continue cached context. Same contract as asyncpage.model.attention's torch backend: causal, sliding
window (key > query - window), GQA/MQA, K/V read through block tables. Both read everything from
the cache, so the new tokens' K/V are written first (write_kv)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, ctx_ptr, ks_ptr, vs_ptr,
                   stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_ob, stride_oh, stride_bt,
                   stride_sb, stride_st, scale, window, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                   BS: tl.constexpr, QUANT: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, BS)
    heads = kvh * G + offs_g
    gmask = offs_g < G
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=gmask[:, None], other=0.0)
    ctx = tl.load(ctx_ptr + b)
    first = ctx * 0  # ctx's type (int64): compiled Triton refuses a branch that changes a variable's type
    if window > 0:
        first = tl.maximum(ctx - window, 0)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for j in range(first // BS, tl.cdiv(ctx, BS)):
        block = tl.load(bt_ptr + b * stride_bt + j).to(tl.int64)
        pos = j * BS + offs_t
        valid = (pos < ctx) & (pos >= first)
        kv_off = block * stride_kb + offs_t[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :]
        k = tl.load(k_ptr + kv_off)
        v = tl.load(v_ptr + kv_off)
        if QUANT:  # one-byte pool: dequantized in registers with each token's scale
            s_off = block * stride_sb + offs_t * stride_st + kvh
            k = (k.to(tl.float32) * tl.load(ks_ptr + s_off)[:, None]).to(q.dtype)
            v = (v.to(tl.float32) * tl.load(vs_ptr + s_off)[:, None]).to(q.dtype)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # [G_PAD, BS]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, qstart_ptr, qlen_ptr, ncomp_ptr, ks_ptr, vs_ptr,
                    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_ot, stride_oh, stride_bt,
                    stride_sb, stride_st, scale, window, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                    BM: tl.constexpr, QUANT: tl.constexpr):
    c = tl.program_id(0)
    mt = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // G
    q_len = tl.load(qlen_ptr + c)
    if mt * BM >= q_len:
        return
    q_start = tl.load(qstart_ptr + c)
    n_comp = tl.load(ncomp_ptr + c)
    offs_m = mt * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, BS)
    rmask = offs_m < q_len
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=rmask[:, None], other=0.0)
    q_pos = n_comp + offs_m  # absolute positions of this tile's queries
    last = n_comp + tl.minimum(mt * BM + BM, q_len) - 1  # the tile's last query position
    first = n_comp * 0  # n_comp's type (int64), as in the decode kernel
    if window > 0:
        first = tl.maximum(n_comp + mt * BM - window + 1, 0)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for j in range(first // BS, last // BS + 1):
        block = tl.load(bt_ptr + c * stride_bt + j).to(tl.int64)
        k_pos = j * BS + offs_t
        kv_off = block * stride_kb + offs_t[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :]
        k = tl.load(k_ptr + kv_off)
        v = tl.load(v_ptr + kv_off)
        if QUANT:
            s_off = block * stride_sb + offs_t * stride_st + kvh
            k = (k.to(tl.float32) * tl.load(ks_ptr + s_off)[:, None]).to(q.dtype)
            v = (v.to(tl.float32) * tl.load(vs_ptr + s_off)[:, None]).to(q.dtype)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # [BM, BS]
        ok = k_pos[None, :] <= q_pos[:, None]
        if window > 0:
            ok = ok & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps m = -inf: subtract 0 there instead of -inf (no NaN).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int | None,
                 kv_scales: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D]; caches [num_blocks, block_size, KVH, D]; block_tables [B, max_blocks].
    `kv_scales` (k_scale, v_scale) [num_blocks, block_size, KVH]: an int8 / fp8 pool."""
    q = q.contiguous()
    b, h, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    g = h // kvh
    out = torch.empty_like(q)
    ks, vs = kv_scales if kv_scales else (context_lens, context_lens)  # unread placeholders
    _decode_kernel[(b, kvh)](
        q, k_cache, v_cache, out, block_tables, context_lens, ks, vs,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0), ks.stride(0), ks.stride(1) if kv_scales else 0,
        scale, window or 0, G=g, G_PAD=max(16, triton.next_power_of_2(g)), D=d, BS=bs,
        QUANT=bool(kv_scales))
    return out


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  q_starts: torch.Tensor, q_lens: torch.Tensor, num_computed: torch.Tensor, max_q_len: int,
                  scale: float, window: int | None, out: torch.Tensor,
                  kv_scales: tuple[torch.Tensor, ...] | None = None) -> None:
    """Chunks c: queries q[q_starts[c] : q_starts[c] + q_lens[c]] at positions num_computed[c] + i,
    attending over their cached context (their own K/V included). Writes into `out` [T, H, D]."""
    _, h, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    # Query tile: wide under the interpreter (fewer, larger numpy ops), register-sized on a GPU.
    bm = 64 if os.environ.get("TRITON_INTERPRET") == "1" else (32 if d > 128 else 64)
    grid = (q_starts.shape[0], triton.cdiv(max_q_len, bm), h)
    ks, vs = kv_scales if kv_scales else (q_lens, q_lens)  # unread placeholders
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, q_starts, q_lens, num_computed, ks, vs,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0), ks.stride(0), ks.stride(1) if kv_scales else 0,
        scale, window or 0, G=h // kvh, D=d, BS=bs, BM=bm, QUANT=bool(kv_scales))
