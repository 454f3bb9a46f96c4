"""Decode rows' paged attention in C for the eager forward (kernels/cpu_forward.c `fwd_attend_rows`).

The fused decode step (native_step.py) takes steps of decode rows only. A step that also holds a prefill
chunk (a new prompt, a probe scoring a few tokens after a cached record), or more rows than the fused
step takes, runs the model's eager forward, whose decode rows went through attention.py's torch form:
each row's whole context gathered out of the pool, then bf16 matmuls. Here those rows read the pool in
place through the fused step's own per-head kernel (float32 arithmetic, bf16/f16/f32 pools), threaded
over rows and heads. Used by attention.paged_attention for CPU pools that are not quantized, when the
native kernels built (`ASYNCPAGE_NATIVE=0` turns it off with every other native kernel).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from asyncpage.model import native

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_KV = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ERRORS = {-1: "out of memory", -2: "a shape it does not take", -5: "a block index or length out of range"}


@functools.cache
def _fn() -> Any:
    lib = native.library("cpu_forward.c", ("fwd_attend_rows",))
    if lib is None:
        return None
    f = lib.fwd_attend_rows
    f.argtypes = [_P, _I, _I, _I, _I, _P, _P, _I, _L, _P, _L, _P, _L, _L, _F, _I, _P]
    f.restype = _I
    return f


def takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, quantized: bool) -> bool:
    """Whether these rows can go through the C kernel: a CPU pool of float32, bfloat16 or float16
    (not a quantized one), contiguous, and the kernels built here."""
    return (not quantized and q.device.type == "cpu" and k_cache.device.type == "cpu"
            and k_cache.dtype in _KV and v_cache.dtype == k_cache.dtype
            and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dim() == 4
            and _fn() is not None)


def attend_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                lens: torch.Tensor, window: int | None, scale: float) -> torch.Tensor:
    """q [rows, H, D] (any float dtype) against each row's blocks (`tables` [rows, width], `lens` [rows]
    the context including the row itself); returns [rows, H, D] in q's dtype. `takes()` was true."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape or tables.dim() != 2 \
            or lens.dim() != 1 or tables.shape[0] != q.shape[0] or lens.shape[0] != q.shape[0] \
            or q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"paged attention rows of mismatched shapes: q {tuple(q.shape)}, pools {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}, tables {tuple(tables.shape)}, lens {tuple(lens.shape)}")
    rows, heads, dim = q.shape
    blocks, block, kv_heads, _ = k_cache.shape
    qf = q.to(torch.float32).contiguous()
    tables = tables.to(torch.long).contiguous()
    lens = lens.to(torch.long).contiguous()
    out = torch.empty(rows, heads, dim, dtype=torch.float32)
    rc = _fn()(qf.data_ptr(), rows, heads, kv_heads, dim, k_cache.data_ptr(), v_cache.data_ptr(), _KV[k_cache.dtype],
               blocks, tables.data_ptr(), int(tables.shape[1]), lens.data_ptr(), block, int(window or 0), scale,
               torch.get_num_threads(), out.data_ptr())
    if rc != 0:
        raise RuntimeError(f"native paged attention refused these rows: {_ERRORS.get(rc, f'code {rc}')}")
    return out.to(q.dtype)
