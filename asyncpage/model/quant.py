"""Weight-only quantization in torch's layers: int8 per output channel, int4 in groups of 32 along the input.

`quantization="int8" | "int4"` loads these only where the GGUF block kernels do not run (CUDA, no C
compiler): on the CPU float weights become GGUF blocks (gguf_quantize.py) held by gguf_linear.py's layers
with no dense copy, where these layers keep one beside the packed weights (below).

Owns the quantized layers (`QuantLinear`, `QuantFused`, `QuantEmbedding`), the kernel chosen per
call by row count, and `quantize_model`, which swaps them into a loaded float model (LM head and
embeddings included). It touches nothing but the modules it replaces.

Kernels: int8 layers run the native `linear_q8` and int4 layers `linear_q4` (kernels/cpu_decode.c:
activations rounded to int8 in blocks of 32, integer dot products; 2-3x torch's int8 kernel at
decode row counts, see there) where they build, else torch's own packed CPU matmuls. Each layer
keeps the dequantized weight (the same values, in the model dtype) for calls with more rows than
its measured crossover, where a dense GEMM wins: quant_kernels.py measures which kernel a layer
calls, and why.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from asyncpage.model import native
from asyncpage.model.quant_calibrate import CALIBRATION_ROWS, GROUP, crossover, kernel_dtype, packed_mm, w8a8, w8a8_for

log = logging.getLogger("asyncpage")

QUANTIZATIONS: tuple[str | None, ...] = (None, "int8", "int4")
# The native kernels (linear_q8, linear_q4) serve at least the compiled decode steps' row counts
# (compiled.MAX_ROWS), whatever their calibration says. Timed alone, with the weight out of L2 but
# still in this machine's large L3, the dense copy beat linear_q8 at 1 row for two of the default
# model's four projections. In a decode step, where the whole model streams through, the packed
# kernel there was 4 ms a step faster (forward + head 22.5 -> 18.2 ms, same process and profiler):
# it reads a quarter of the bytes.
_NATIVE_ROWS = 8

# (q [N, K] int values 0..15, scale [N, K/GROUP], minimum [N, K/GROUP]): w = q * scale + minimum
Int4 = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per output channel: (int8 [N, K], scale [N] float32)."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(w: torch.Tensor, group: int = GROUP) -> Int4:
    """Asymmetric min/max per group of `group` inputs (as llama.cpp's Q4_1 / Q4_K sub-blocks)."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(n, k), scale, lo


def int4_from_q4_k(raw: np.ndarray, shape: tuple[int, int]) -> Int4:
    """A GGUF Q4_K tensor as it is: 256-value super-blocks of eight 32-value sub-blocks, each
    w = d*sc*q - dmin*m. Taken over exactly instead of requantizing the dequantized floats."""
    from gguf.quants import Q4_K

    n, k = shape
    blocks = raw.reshape(-1, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & np.uint8(0x0F)).reshape(n, k)
    scale = (d * sc.astype(np.float32)).reshape(n, k // GROUP)
    lo = -(dmin * m.astype(np.float32)).reshape(n, k // GROUP)
    return torch.from_numpy(q.copy()), torch.from_numpy(scale), torch.from_numpy(lo)


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    g = q.float().reshape(n, k // GROUP, GROUP)
    return (g * scale[..., None].float() + lo[..., None].float()).reshape(n, k)


def int4_supported(n: int, k: int) -> bool:
    """What `_convert_weight_to_int4pack_for_cpu` / `_weight_int4pack_mm_for_cpu` accept."""
    return n % 16 == 0 and k % GROUP == 0


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W stored int8 or int4; the packed kernel for calls of up to `max_rows`
    rows, the dequantized copy (`dense`, model dtype) above that."""

    def __init__(self, kind: str, n: int, k: int, dtype: torch.dtype, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.kind, self.out_features, self.in_features, self.dtype = kind, n, k, dtype
        self.bias = bias
        self.packed = torch.empty(0)
        self.scales = torch.empty(0)  # int8: [N]; int4 on torch's kernel: scales_and_zeros [K/GROUP, N, 2]
        self.dense: torch.Tensor | None = None
        self.max_rows = 0
        self.act_dtype = dtype  # what the packed kernel computes in (kernel_dtype)
        self.one_row: Any = None  # fbgemm / oneDNN prepacked int8 weight, used row by row (w8a8_for)
        self.q8: torch.Tensor | None = None  # float32 scales where native linear_q8 is the packed kernel
        # (scale, minimum) per group, bfloat16, where native linear_q4 is (`packed` then holds its nibbles)
        self.q4: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_float(cls, kind: str, w: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None,
                   int4: Int4 | None = None) -> QuantLinear:
        n, k = w.shape if int4 is None else int4[0].shape
        source = w if int4 is None else int4[0]
        kernels = native.load() if source.device.type == "cpu" else None
        q4_native = kernels is not None and kernels.takes_q4(k)
        if kind == "int4" and not int4_supported(n, k) and not q4_native:
            kind = "int8"  # torch's int4 kernel's shape rules (N % 16, K % 32); int8 takes any shape
        layer = cls(kind, n, k, dtype, None if bias is None else bias.detach().to(dtype))
        if kind == "int8":
            q8, s8 = quantize_int8(w)
            layer.packed = q8
            if kernels is not None and kernels.takes_q8(q8):
                # linear_q8 computes in float32 whatever the model dtype; the scales rounded to it
                # as the dense copy's are, so both paths hold the same weights.
                layer.scales = s8.to(dtype)
                layer.q8 = layer.scales.float()
            else:
                act = layer.act_dtype = kernel_dtype(layer, s8)
                layer.scales = s8.to(act)
            # The dense copy from the rounded scales: both paths compute with the same values.
            deq = q8.float() * layer.scales.float()[:, None]
        else:
            q4, s4, lo = int4 if int4 is not None else quantize_int4(w)
            if q4_native:
                # Scale and minimum rounded to bfloat16, 4 bytes a group (a GGUF's Q4_K values are
                # not bfloat16 exactly: up to 0.085 of a quantization step moves, measured; torch's
                # kernel rounded them so too where bfloat16 activations measured faster), and the
                # dense copy from the rounded values: both paths hold the same weights.
                layer.q4 = (s4.to(torch.bfloat16).contiguous(), lo.to(torch.bfloat16).contiguous())
                layer.packed = native.pack_q4(q4)
                layer.dense = dequantize_int4(q4, *layer.q4).to(dtype)
                return _with_rows(layer)
            layer.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4.to(torch.int32).contiguous(), 1)
            act = layer.act_dtype = kernel_dtype(layer, torch.stack([s4, lo], -1).transpose(0, 1).contiguous())
            s4, lo = s4.to(act).float(), lo.float()
            # The kernel computes (q - 8) * s + z: z = lo + 8 s, rounded to the dtype it runs in.
            zero = (lo + 8 * s4).to(act).float()
            layer.scales = torch.stack([s4, zero], -1).transpose(0, 1).contiguous().to(act)
            deq = dequantize_int4(q4, s4, zero - 8 * s4)
        layer.dense = deq.to(dtype)
        return _with_rows(layer)

    @property
    def native(self) -> bool:
        """Whether a native kernel (linear_q8 / linear_q4) is this layer's packed kernel."""
        return self.q8 is not None or self.q4 is not None

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """The packed matmul, in and out in the model dtype (computed in `act_dtype`, or by
        linear_q8 / linear_q4 with the activations rounded to int8 in blocks of 32)."""
        if self.q8 is not None:
            return torch.ops.asyncpage.linear_q8(x, self.packed, self.q8).to(self.dtype)
        if self.q4 is not None:
            return torch.ops.asyncpage.linear_q4(x, self.packed, *self.q4).to(self.dtype)
        return packed_mm(self.kind, x.to(self.act_dtype), self.packed, self.scales).to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.dense is not None and x2.shape[0] > self.max_rows:
            return F.linear(x, self.dense, self.bias)
        y = self.rowwise(x2) if self.one_row is not None else self.kernel(x2.contiguous())
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def rowwise(self, x2: torch.Tensor) -> torch.Tensor:
        """Each row on its own through torch's dynamic int8 linear (w8a8_for). One call per row, not
        one for the batch: the call rounds its input to 8 bits with one scale, so a batched call
        would make a row's logits depend on the other rows (a stream alone, beside others, or with
        its speculative drafts would decode differently). A row holding a NaN or inf takes the
        weight-only kernel: 8-bit rounding would turn it into finite logits the sampler cannot tell
        from real ones."""
        out = []
        for row in x2.float().split(1):
            if bool(torch.isfinite(row).all()):
                out.append(w8a8(row.contiguous(), self.one_row))
            else:
                # contiguous: the packed kernel takes no strided rows (a column slice, a transpose)
                out.append(self.kernel(row.to(self.dtype).contiguous()).float())
        return torch.cat(out).to(self.dtype)

    def dequantized(self) -> torch.Tensor:
        """The float weight these kernels compute with (tests; the embedding of a tied head)."""
        if self.dense is not None:
            return self.dense
        if self.kind == "int8":  # its rows as they are; the packed kernel on an identity took ~30 s for a head
            return (self.packed.float() * self.scales.float()[:, None]).to(self.dtype)
        if self.q4 is not None:
            return dequantize_int4(native.unpack_q4(self.packed), *self.q4).to(self.dtype)
        # In float32 (exact: the activations are 0 and 1), whatever the kernel's activation dtype.
        eye = torch.eye(self.in_features)
        return packed_mm(self.kind, eye, self.packed, self.scales.float()).t().to(self.dtype).contiguous()

    def extra_repr(self) -> str:
        one = ", w8a8 row by row" if self.one_row is not None else ""
        how = ("linear_q8" if self.q8 is not None else "linear_q4" if self.q4 is not None
               else str(self.act_dtype).removeprefix("torch."))
        return (f"{self.kind}, in={self.in_features}, out={self.out_features}, packed up to {self.max_rows} rows"
                f" in {how}{one}")


class QuantFused(nn.Module):
    """FusedLinear's contract (one matmul, split per projection) over a QuantLinear."""

    def __init__(self, linear: QuantLinear, sizes: list[int]) -> None:
        super().__init__()
        self.linear, self.sizes = linear, sizes

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(x).split(self.sizes, dim=-1)


class QuantEmbedding(nn.Module):
    """Rows of the quantized table, dequantized at lookup (a tied head's dense copy when it has one)."""

    def __init__(self, head: QuantLinear, scale_dtype: torch.dtype) -> None:
        super().__init__()
        self.head = head
        self.dtype = scale_dtype
        self.table: torch.Tensor | None = head.dense
        if self.table is None:  # no dense copy to read: rows come out of the packed kernel's weights
            self.table = head.dequantized()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        assert self.table is not None
        return F.embedding(ids, self.table)


def _with_rows(layer: QuantLinear) -> QuantLinear:
    """The layer with its packed / dense threshold set (crossover), its dense copy dropped where
    torch's packed kernel wins at every size measured (a native kernel's layer always keeps it)."""
    layer.max_rows = crossover(layer)
    if layer.native:
        # A dense copy always: the native kernels round activations to 8 bits, and past the rows
        # measured a dense GEMM wins again (1024 rows: 38 ms against 23 for a 4096 x 1024 int8 weight).
        layer.max_rows = min(max(layer.max_rows, _NATIVE_ROWS), CALIBRATION_ROWS[-1])
    elif layer.max_rows >= CALIBRATION_ROWS[-1]:
        layer.dense = None  # the packed kernel wins at every size measured: no copy needed
        layer.max_rows = 1 << 62
    return layer


@torch.inference_mode()
def quantize_model(model: nn.Module, kind: str, dtype: torch.dtype,
                   exact: dict[str, Int4] | None = None) -> None:
    """Replace every projection, the LM head and the embedding of a loaded (and fused) model with
    quantized layers, in place. `exact`: int4 weights taken over from the checkpoint (GGUF Q4_K), by
    state-dict name; a fused projection uses them only when all its parts have them."""
    exact = exact or {}
    t0 = time.perf_counter()
    lm: Any = model
    tied = lm.lm_head.weight is lm.model.embed_tokens.weight
    for name, mod in list(model.named_modules()):
        prefix = f"{name}." if name else ""
        for attr, parts in (("qkv", ("q_proj", "k_proj", "v_proj")), ("gate_up", ("gate_proj", "up_proj"))):
            fused = getattr(mod, attr, None)
            if fused is None or isinstance(fused, QuantFused):
                continue
            names = [f"{prefix}{p}.weight" for p in parts]
            int4 = None
            if kind == "int4" and all(n in exact for n in names):
                pieces = [exact[n] for n in names]
                int4 = (torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces]),
                        torch.cat([p[2] for p in pieces]))
            q = QuantLinear.from_float(_kind(kind, exact, int4), fused.weight, dtype, fused.bias, int4)
            setattr(mod, attr, QuantFused(q, fused.sizes))
            for p in parts:  # the float weights were views of the fused one: drop them with it
                setattr(mod, p, None)
        for child_name, child in list(mod.named_children()):
            if isinstance(child, nn.Linear) and not (mod is model and child_name == "lm_head"):
                full = f"{prefix}{child_name}.weight"
                int4 = exact.get(full) if kind == "int4" else None
                setattr(mod, child_name, QuantLinear.from_float(_kind(kind, exact, int4), child.weight, dtype,
                                                                child.bias, int4))
    # The LM head and the embedding stay int8 under int4, as llama.cpp's Q4_K_M keeps them at 6-8
    # bits: at 16 levels a group, the head alone raised the default model's perplexity by ~24%.
    edge = "int8" if kind == "int4" else kind
    head = QuantLinear.from_float(edge, lm.lm_head.weight, dtype, None)
    # Only beside a dense copy: rows go one call each, which many-row calls must not pay.
    head.one_row = w8a8_for(head) if head.dense is not None else None
    if head.one_row is not None:
        # Rows go one call each: the threshold against the dense copy is that path's own.
        packed_rows, head.max_rows = head.max_rows, crossover(head)
        if head.max_rows < 1:
            head.one_row, head.max_rows = None, packed_rows
    lm.lm_head = head
    if tied:
        lm.model.embed_tokens = QuantEmbedding(head, dtype)
    else:
        emb = QuantLinear.from_float(edge, lm.model.embed_tokens.weight, dtype)
        lm.model.embed_tokens = QuantEmbedding(emb, dtype)
    log.info("quantized weights to %s in %.1f s", kind, time.perf_counter() - t0)


def _kind(kind: str, exact: dict[str, Int4], int4: Int4 | None) -> str:
    """int4 from a GGUF keeps its mix, as llama.cpp's Q4_K_M does: 4 bits where the file has Q4_K,
    8 where it spent more (Q5/Q6/Q8). Requantizing those to 16 levels by min/max cost the default
    model ~19% perplexity; from float weights (no `exact`) every layer is int4."""
    return "int8" if kind == "int4" and exact and int4 is None else kind


def quantized_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes held by the packed weights and by the dense copies kept for many-row calls."""
    packed = dense = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            packed += m.packed.numel() * m.packed.element_size() + m.scales.numel() * m.scales.element_size()
            # q8 is `scales` itself in a float32 model (.float() of a float32 tensor), a copy otherwise
            own_q8 = m.q8 is not None and m.q8.data_ptr() != m.scales.data_ptr()
            native_scales = [*(m.q4 or ()), *([m.q8] if own_q8 and m.q8 is not None else [])]
            packed += sum(t.numel() * t.element_size() for t in native_scales)
            if m.one_row is not None:  # the prepacked copy: the same int8 values in fbgemm's / oneDNN's layout
                packed += m.out_features * m.in_features
            if m.dense is not None:
                dense += m.dense.numel() * m.dense.element_size()
    return {"packed": packed, "dense": dense}
