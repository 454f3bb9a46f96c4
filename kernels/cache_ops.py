"""Triton kernels for the KV cache: write new K/V by slot mapping, copy blocks (copy-on-write)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_kt, stride_vt, N: tl.constexpr,
                     N_PAD: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.arange(0, N_PAD)
    m = offs < N
    tl.store(kc_ptr + slot * N + offs, tl.load(k_ptr + t * stride_kt + offs, mask=m), mask=m)
    tl.store(vc_ptr + slot * N + offs, tl.load(v_ptr + t * stride_vt + offs, mask=m), mask=m)


@triton.jit
def _copy_blocks_kernel(c_ptr, pairs_ptr, N: tl.constexpr, CHUNK: tl.constexpr):
    i = tl.program_id(0)
    src = tl.load(pairs_ptr + 2 * i).to(tl.int64)
    dst = tl.load(pairs_ptr + 2 * i + 1).to(tl.int64)
    for start in range(0, N, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        m = offs < N
        tl.store(c_ptr + dst * N + offs, tl.load(c_ptr + src * N + offs, mask=m), mask=m)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k/v [T, KVH, D] into the caches [num_blocks, block_size, KVH, D] at flat slots `slot_mapping`."""
    t = k.shape[0]
    if t == 0:
        return
    k = k.reshape(t, -1)
    v = v.reshape(t, -1)
    if k.stride(1) != 1:
        k = k.contiguous()
    if v.stride(1) != 1:
        v = v.contiguous()
    n = k.shape[1]
    _write_kv_kernel[(t,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), N=n,
                           N_PAD=triton.next_power_of_2(n))


def copy_blocks(caches: list[tuple[torch.Tensor, ...]], pairs: list[tuple[int, int]]) -> None:
    """Copy whole blocks src -> dst in every layer's K and V cache."""
    if not pairs:
        return
    device = caches[0][0].device
    idx = torch.tensor(pairs, dtype=torch.int64, device=device).reshape(-1)
    for layer in caches:
        for c in layer:  # K, V (and their scales in a quantized pool)
            c = c.view(torch.uint8) if c.dtype == torch.float8_e4m3fn else c  # copied as bytes
            _copy_blocks_kernel[(len(pairs),)](c, idx, N=c[0].numel(), CHUNK=1024)
