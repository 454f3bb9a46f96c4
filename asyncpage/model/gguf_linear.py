"""`quantization="auto"` on a GGUF file: its quantized tensors kept in their block formats as the only
copy of the weights (`GGUFLinear`, `GGUFFused`, `GGUFEmbedding`), and `install`, which puts them
into a model built on the meta device before anything dense is allocated for them.

A projection of up to `GGUFLinear.kernel_rows` rows runs gguf_kernels' integer kernels on the blocks
(activations rounded to int8 blocks, as llama.cpp does): `KERNEL_ROWS` (8: decode steps, small batches)
where the kernels only tile rows four at a time (the portable form); in the VNNI and AVX2 forms any count for
the 32-element formats (repacked by eight) and up to 48 rows for the K-quants (the VNNI form's interleaved path
past 8 rows; gguf_kernels.Bound's max_rows says what it was measured against), but at most `AMX_ROWS` (48) for a
bfloat16 model where torch's GEMM runs on AMX tiles (`amx_bf16`). A call with more rows (prefill chunks, large batches)
dequantizes the weight to the model dtype in one transient tile
(gguf_kernels.dequantize, multithreaded; tiles of at most `TILE_BYTES` for the LM head) and runs
torch's GEMM on it (bfloat16 uses AMX / AVX-512 BF16 where the CPU has them); the tile is dropped
after the call. The embedding reads only the rows it is asked for (get_rows), and a tied LM head
reads the same bytes: one copy for both. Where a SIMD form (VNNI, AVX2) runs, the rows of every Q4_0, Q5_0 and
Q8_0 weight (the head's too) are repacked by eight in place at load (gguf_kernels.repack8; the lookups read them so
too): a verify's 8 activation rows then cost little more than one row (the Q8_0 head's 262k rows: 6.5 against 17
ms), each output the same bits at any row count.

The crossover of the four-row tiles (the portable form's, and the AVX2 form's before its wider steps; the SIMD forms'
own figures are in gguf_kernels.Bound), measured on the default model's tensors (2 shared cores, AVX-512 VNNI + AMX, 2
threads, bfloat16, best of 5; scripts/gguf_kernel_bench.py measures the kernels alone), kernel vs
dequantize + GEMM in ms: ffn_up Q5_0 [2048, 640] 8 rows 0.24 vs 0.44, 16 rows 0.50 vs 0.44, 32 rows 0.95 vs 0.79;
ffn_down Q6_K [640, 2048] 8 rows 0.26 vs 0.84, 16 rows 0.40 vs 0.48, 32 rows 0.81 vs 0.56; ffn_down
Q4_K 8 rows 0.21 vs 0.30, 16 rows 0.39 vs 0.33; attn_v Q8_0 [256, 640] 8 rows 0.069 vs 0.083, 16 rows
0.086 vs 0.066. Eight rows is where every format still wins with the kernel, and also the compiled
decode steps' largest row count (compiled.MAX_ROWS).

It imports nothing above the model layer and touches only the modules it replaces.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncpage.model import gguf_kernels as gk

log = logging.getLogger("asyncpage")

KERNEL_ROWS = 8  # the block kernels' tiles beat dequantize + dense GEMM up to this many rows (see above)
AMX_ROWS = 48  # the most rows the block kernels take where a bfloat16 GEMM runs on AMX (amx_bf16)
TILE_BYTES = 32 << 20  # the largest transient dense tile (the LM head is dequantized in such slices)

# A tensor as the GGUF stores it: (ggml type, uint8 [rows, bytes per row], values per row).
Blocks = tuple[int, torch.Tensor, int]


@functools.cache
def _amx() -> bool:
    """Whether the CPU has AMX tiles (torch's cpuinfo check; a private function, so guarded: any failure
    reads as no AMX, which costs speed only)."""
    try:
        probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
        return bool(probe()) if probe is not None else False
    except Exception:
        return False


def amx_bf16(dtype: torch.dtype) -> bool:
    """Whether a bfloat16 dense GEMM runs on AMX tiles here: then dequantize + GEMM overtakes the block
    kernels' interleaved path at 32-128 rows (GGUFLinear, default model's layer 0, 2-core Xeon VM with
    AMX, 2 threads, ms, kernels vs dense: attn_q Q5_0 32 rows 0.13 vs 0.30, 64 rows 0.23 vs 0.22, 512
    rows 1.72 vs 0.50; attn_output Q4_K 32 rows 0.19 vs 0.19, 64 rows 0.33 vs 0.20; gate+up Q5_0 64 rows
    0.78 vs 0.84, 128 rows 1.38 vs 1.15, 512 rows 5.25 vs 1.62; ffn_down Q6_K 32 rows 0.34 vs 0.42, 64 rows
    0.61 vs 0.45; the Q8_0 head 32 rows 41 vs 43, 64 rows 76 vs 63), where without AMX the interleaved
    path wins further (gguf_kernels.Bound.max_rows): AMX_ROWS there."""
    return dtype == torch.bfloat16 and _amx()


def available() -> bool:
    """Whether the block kernels run here (a C compiler, ASYNCPAGE_NATIVE not 0)."""
    return gk.available()


def has_kernel(ggml_type: int, shape: list[int]) -> bool:
    """Whether a GGUF tensor (its ggml type, its dims innermost first) can stay in its blocks."""
    return len(shape) == 2 and gk.supports(ggml_type) and shape[0] % gk.BLOCKS[gk.GGMLType(ggml_type)][0] == 0


class GGUFLinear(nn.Module):
    """y = x W^T (+ b) with W the GGUF's blocks (uint8 [out, row bytes], no float copy)."""

    def __init__(self, blocks: Blocks, dtype: torch.dtype, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        ggml_type, data, k = blocks
        self.ggml_type, self.in_features, self.out_features = int(ggml_type), int(k), int(data.shape[0])
        # Plain attributes, not buffers: to_empty() / .to(dtype) must never touch the blocks.
        self.qweight = data.contiguous()
        self.bound = gk.Bound(self.qweight, self.ggml_type)
        self.dtype = dtype
        self.out_dtype = out_dtype or dtype  # the LM head returns the kernel's float32 logits
        # Past this many rows: dequantize + dense GEMM (gguf_kernels.Bound.max_rows; never: 2**62), at most
        # AMX_ROWS where torch's bfloat16 GEMM runs on AMX tiles (amx_bf16).
        self.kernel_rows = self.bound.max_rows or 1 << 62
        if amx_bf16(dtype) and self.out_dtype == dtype:  # a head keeps its float32 logits at any row count
            self.kernel_rows = min(self.kernel_rows, AMX_ROWS)
        self.bias = None if bias is None else bias.detach().to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] <= self.kernel_rows:
            if torch.compiler.is_compiling():  # an opaque operator in compiled graphs
                y = torch.ops.asyncpage.gguf_matmul(x2, self.qweight, self.ggml_type)
            else:
                y = self.bound(x2)
            y = y.to(self.out_dtype)
        else:
            y = self.dense_matmul(x2)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def with_max(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """forward(x), and each row's maximum and first index where the block kernel finds them as it writes
        float32 outputs (gguf_kernels.Bound.with_max; an LM head's greedy search), else None."""
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] > self.kernel_rows or self.bias is not None or self.out_dtype != torch.float32 or \
                torch.compiler.is_compiling():
            return self.forward(x), None
        y, found = self.bound.with_max(x2)
        lead = x.shape[:-1]
        return y.view(*lead, self.out_features), None if found is None else (found[0].view(lead), found[1].view(lead))

    def dense_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 times the weight dequantized to the model dtype, tile by tile (each dropped after use)."""
        x2 = x2.to(self.dtype)
        tile = max(8, TILE_BYTES // (self.in_features * 4) // 8 * 8)  # whole groups of a head repacked by 8
        if self.out_features <= tile:
            return F.linear(x2, gk.dequantize(self.qweight, self.ggml_type, self.dtype))
        out = torch.empty(x2.shape[0], self.out_features, dtype=self.dtype)
        for i in range(0, self.out_features, tile):
            w = gk.dequantize(self.qweight[i : i + tile], self.ggml_type, self.dtype)
            out[:, i : i + w.shape[0]] = F.linear(x2, w)
        return out

    def dequantized(self) -> torch.Tensor:
        """The float weight these kernels compute with, float32 (tests)."""
        return gk.dequantize(self.qweight, self.ggml_type)

    def extra_repr(self) -> str:
        above = ("at any row count" if self.kernel_rows >= 1 << 62 else
                 f"up to {self.kernel_rows} rows, dequantized {str(self.dtype).removeprefix('torch.')} GEMM above")
        return (f"{gk.GGMLType(self.ggml_type).name}, in={self.in_features}, out={self.out_features}, "
                f"blocks {above}")


def logits_with_max(head: nn.Module, hidden: torch.Tensor) -> tuple[
        torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None] | None:
    """A block-kernel LM head's float32 logits, and each row's maximum and first index where the kernel
    found them as it wrote the logits (GGUFLinear.with_max); None for any other head (the model computes
    its logits as usual)."""
    if not isinstance(head, GGUFLinear):
        return None
    logits, found = head.with_max(hidden)
    return logits if logits.dtype == torch.float32 else logits.float(), found


def unpadded_rows(model: nn.Module) -> int:
    """Row counts up to which every projection of `model` (each module with `in_features`) is a
    GGUFLinear running its block kernel: a cost linear in the rows and no kernel built per shape, so
    the runner need not pad a step to a bucket (model/batch.py) below it. 0 when any projection is
    something else (nn.Linear, QuantLinear: their GEMMs want the buckets)."""
    rows = 1 << 62
    for m in model.modules():
        if isinstance(m, GGUFLinear):
            rows = min(rows, m.kernel_rows)
        elif hasattr(m, "in_features"):
            return 0
    return rows


class GGUFFused(nn.Module):
    """FusedLinear's contract (one call, a tuple per projection): one merged GGUFLinear where the parts
    share a format (their rows concatenated, the parts' own copies dropped), else each part in turn
    (the parts stay registered under their own names; this holds them in a plain list)."""

    def __init__(self, sizes: list[int], merged: GGUFLinear | None, parts: list[nn.Module]) -> None:
        super().__init__()
        self.sizes, self.merged = sizes, merged
        self.parts = [] if merged is not None else list(parts)  # merged: the parts' own blocks are freed

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.merged is not None:
            return tuple(self.merged(x).split(self.sizes, dim=-1))
        return tuple(p(x) for p in self.parts)


class GGUFEmbedding(nn.Module):
    """Rows of a GGUF table, dequantized at lookup: only the rows asked for are read."""

    def __init__(self, blocks: Blocks, dtype: torch.dtype) -> None:
        super().__init__()
        self.ggml_type, self.qweight, self.embedding_dim = int(blocks[0]), blocks[1].contiguous(), int(blocks[2])
        self.num_embeddings = int(self.qweight.shape[0])
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return gk.get_rows(ids, self.qweight, self.ggml_type).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{gk.GGMLType(self.ggml_type).name}, {self.num_embeddings} x {self.embedding_dim}, rows read at lookup"


_FUSED = (("qkv", ("q_proj", "k_proj", "v_proj")), ("gate_up", ("gate_proj", "up_proj")))


@torch.inference_mode()
def install(model: nn.Module, blocks: dict[str, Blocks], state: dict[str, torch.Tensor], dtype: torch.dtype,
            tied: bool) -> None:
    """Swap the GGUF-block layers into `model` (built on the meta device, not yet materialized), in
    place: every nn.Linear whose weight is in `blocks` (by state-dict name) becomes a GGUFLinear (its
    bias taken out of `state`), fused projections a GGUFFused, the embedding a GGUFEmbedding and, with
    `tied`, the LM head a GGUFLinear over the embedding's own bytes. Whatever is left (norms, tensors
    in formats without a kernel) stays for the caller to load densely."""
    lm: Any = model
    for name, mod in list(model.named_modules()):
        prefix = f"{name}." if name else ""
        for child_name, child in list(mod.named_children()):
            full = f"{prefix}{child_name}"
            if isinstance(child, nn.Linear) and f"{full}.weight" in blocks and full != "lm_head":
                _fits(f"{full}.weight", blocks[f"{full}.weight"], child.out_features, child.in_features)
                bias = state.pop(f"{full}.bias", None)
                setattr(mod, child_name, GGUFLinear(_repacked(blocks.pop(f"{full}.weight")), dtype, bias))
        for attr, names in _FUSED:
            parts = [getattr(mod, p, None) for p in names]
            if not all(isinstance(p, nn.Module) for p in parts) or not any(isinstance(p, GGUFLinear) for p in parts):
                continue
            sizes = [int(p.out_features) for p in parts]  # type: ignore[union-attr]
            setattr(mod, attr, GGUFFused(sizes, _merge(parts, dtype), parts))  # type: ignore[arg-type]
            if getattr(mod, attr).merged is not None:
                for p in names:
                    setattr(mod, p, None)
    emb_name = "model.embed_tokens.weight"
    if emb_name in blocks:
        table = lm.model.embed_tokens
        _fits(emb_name, blocks[emb_name], table.num_embeddings, table.embedding_dim)
        emb = blocks.pop(emb_name)
        if tied:
            emb = _repacked(emb)
            lm.lm_head = GGUFLinear(emb, dtype, out_dtype=torch.float32)
        lm.model.embed_tokens = GGUFEmbedding(emb, dtype)
    if "lm_head.weight" in blocks and not tied:
        _fits("lm_head.weight", blocks["lm_head.weight"], lm.lm_head.out_features, lm.lm_head.in_features)
        lm.lm_head = GGUFLinear(_repacked(blocks.pop("lm_head.weight")), dtype, out_dtype=torch.float32)
    blocks.clear()  # anything left has no place in this model (the caller has warned of unused tensors)


def _fits(name: str, blocks: Blocks, rows: int, cols: int) -> None:
    """ValueError (the load's ModelLoadError) where a tensor's declared shape is not the one its config gives:
    a file whose tensors disagree with its own metadata is refused at load, as a dense load refuses it, and
    never reaches a request."""
    if (int(blocks[1].shape[0]), int(blocks[2])) != (int(rows), int(cols)):
        raise ValueError(f"{name}: checkpoint shape {(int(blocks[1].shape[0]), int(blocks[2]))} != {(rows, cols)}")


def _repacked(blocks: Blocks) -> Blocks:
    """A 32-element format's rows repacked by eight in place where a SIMD form reads them so (gk.repack8); anything
    else as it is."""
    return gk.repack8(blocks[1], blocks[0]), blocks[1], blocks[2]


def _merge(parts: list[nn.Module], dtype: torch.dtype) -> GGUFLinear | None:
    """One GGUFLinear over the parts' rows where all are GGUFLinear of one format (None otherwise)."""
    if not all(isinstance(p, GGUFLinear) for p in parts):
        return None
    gl: list[GGUFLinear] = parts  # type: ignore[assignment]
    if len({(p.ggml_type, p.in_features) for p in gl}) != 1 or len({p.bias is None for p in gl}) != 1:
        return None
    data = torch.cat([p.qweight for p in gl])
    bias = None if gl[0].bias is None else torch.cat([p.bias for p in gl if p.bias is not None])
    return GGUFLinear((gl[0].ggml_type, data, gl[0].in_features), dtype, bias)


def block_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes held as GGUF blocks and as floating-point tensors (parameters and the layers' own)."""
    seen: set[int] = set()
    blocks = dense = 0
    for m in model.modules():
        tensors = [t for t in (getattr(m, "qweight", None),) if isinstance(t, torch.Tensor)]
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                blocks += t.numel() * t.element_size()
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            dense += p.numel() * p.element_size()
    return {"blocks": blocks, "dense": dense}
