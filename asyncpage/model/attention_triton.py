"""The Triton attention backend: paged attention, KV writes and block copies through the kernels of
asyncpage.kernels (raw kernels over tensors). The runner (core/runner.py) takes `paged_attention` and
`copy_blocks` from here when its config says attention_backend="triton"; the torch backend is
model/attention.py, with the same signature."""

from __future__ import annotations

import torch

from asyncpage.kernels.cache_ops import copy_blocks
from asyncpage.model.attention import AttentionMetadata

__all__ = ["copy_blocks", "paged_attention"]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    window: int | None, kv_scales: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """Drop-in for asyncpage.model.attention.paged_attention, with every step in Triton (a quantized
    pool's writes excepted: quantizing the new tokens is elementwise torch work)."""
    from asyncpage.kernels.attention_kernels import paged_decode, paged_prefill
    from asyncpage.kernels.cache_ops import write_kv

    if kv_scales:
        from asyncpage.model.attention import write_kv as write_quantized

        write_quantized(k_cache, v_cache, k, v, meta.slot_mapping, kv_scales)
    else:
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    if meta.decode_rows is not None:
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        out[meta.decode_rows] = paged_decode(q[meta.decode_rows], k_cache, v_cache, meta.decode_block_tables,
                                             meta.decode_context_lens, scale, window, kv_scales)
    if meta.prefills:
        t = meta.scratch.get("triton_prefill")
        if t is None:
            width = max(p.block_table.numel() for p in meta.prefills)
            dev = q.device
            t = {
                "bt": torch.stack([torch.nn.functional.pad(p.block_table, (0, width - p.block_table.numel()))
                                   for p in meta.prefills]),
                "start": torch.tensor([p.start for p in meta.prefills], dtype=torch.int64, device=dev),
                "len": torch.tensor([p.end - p.start for p in meta.prefills], dtype=torch.int64, device=dev),
                "comp": torch.tensor([p.num_computed for p in meta.prefills], dtype=torch.int64, device=dev),
                "max": max(p.end - p.start for p in meta.prefills),
            }
            meta.scratch["triton_prefill"] = t
        paged_prefill(q, k_cache, v_cache, t["bt"], t["start"], t["len"], t["comp"], t["max"], scale, window, out,
                      kv_scales)
    return out
