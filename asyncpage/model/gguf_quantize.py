"""Float weights written as GGUF blocks at load: `quantization="int8" | "int4"` on the CPU gives the same
formats a GGUF file holds, run by the same kernels (gguf_linear.py), with no dense copy kept beside them.

  - int8: every projection, the LM head and the embedding in Q8_0 (32 values, one fp16 scale);
  - int4: projections in Q4_K (256-value super-blocks of eight 32-value sub-blocks, each with its own
    6-bit scale and minimum), Q5_0 where a row's length is no multiple of 256 (llama.cpp's own fallback
    for Q4_K), and the LM head and embedding in Q8_0, as llama.cpp's Q4_K_M keeps them at 6-8 bits (at
    16 levels the head alone raised the default model's perplexity by ~24%, quant.py).

Q8_0, Q5_0 and Q4_0 are gguf's own quantizers (gguf.quants, llama.cpp's reference arithmetic, numpy);
gguf has no Q4_K quantizer, so `q4_k` writes one (torch): per sub-block min/max (the minimum clamped
at zero, as llama.cpp does), the sub-block scales and minimums rounded to 6 bits against the super-block's
fp16 `d` and `dmin`, then each value rounded against the stored, rounded scale and minimum. llama.cpp's
quantize_row_q4_K_ref searches each sub-block for a better scale (make_qkx2_quants); min/max is what the
int4 layers always did here (quant.py's quantize_int4).

A row length no block divides keeps the tensor float (said at load). A non-finite weight is refused, as is one
past what its format's fp16 scales hold (LIMITS).
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch
from torch import nn

from asyncpage.model.gguf_kernels import BLOCKS, GGMLType

log = logging.getLogger("asyncpage")

KINDS = ("int8", "int4")
_FP16_MAX = 65504.0
_FP16_TINY = 2.0**-24  # fp16's smallest subnormal: a nonzero scale below it would be stored as 0
# The largest |w| each format's fp16 scales hold (Q8_0: max / 127, Q5_0: / 16, Q4_0: / 8, Q4_K: a sub-block's
# minimum / 63 for dmin); past it gguf's quantizers store an infinite scale, and the weights read back as NaN.
LIMITS = {GGMLType.Q8_0: _FP16_MAX * 127, GGMLType.Q5_0: _FP16_MAX * 16, GGMLType.Q4_0: _FP16_MAX * 8,
          GGMLType.Q4_K: _FP16_MAX * 63}
_CHUNK = 1 << 22  # values quantized at a time (bounds the float32 temporaries: ~16 MB each)


def target(kind: str, k: int, edge: bool = False) -> GGMLType | None:
    """The block format a float weight of rows of `k` values becomes under `kind`; `edge`: the LM head or
    the embedding (Q8_0 under both kinds). None where no format's block divides k."""
    if kind not in KINDS:
        raise ValueError(f"quantization must be one of {KINDS}, got {kind!r}")
    if kind == "int4" and not edge and k % BLOCKS[GGMLType.Q4_K][0] == 0:
        return GGMLType.Q4_K
    if k % 32:
        return None
    return GGMLType.Q5_0 if kind == "int4" and not edge else GGMLType.Q8_0


def into_blocks(model: nn.Module, state: dict[str, torch.Tensor], blocks: dict[str, tuple[int, torch.Tensor, int]],
                kind: str, tied: bool) -> None:
    """Move each float weight of `state` that a GGUF-block layer would hold in `model` (built on the meta
    device: every nn.Linear's, the embedding's, an untied LM head's) into `blocks`, written in the format
    `kind` gives it (`target`), by state-dict name, as gguf_linear.install takes them. Tensors already in
    `blocks` (a GGUF's own) stay as stored; a weight no block format divides stays float in `state`."""
    t0 = time.perf_counter()
    wanted: dict[str, bool] = {}  # state-dict name -> is the head or the embedding
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and not (tied and name == "lm_head"):
            wanted[f"{name}.weight"] = name == "lm_head"
        elif isinstance(mod, nn.Embedding) and name == "model.embed_tokens":
            wanted[f"{name}.weight"] = True
    done: dict[str, int] = {}
    kept: list[str] = []
    for name, edge in wanted.items():
        w = state.get(name)
        if name in blocks or w is None or w.dim() != 2:
            continue
        fmt = target(kind, int(w.shape[1]), edge)
        if fmt is None:
            kept.append(name)
            continue
        try:
            blocks[name] = (int(fmt), quantize(w, fmt), int(w.shape[1]))
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from exc
        del state[name]
        done[fmt.name] = done.get(fmt.name, 0) + 1
    if kept:
        log.info("quantization=%r: %d weights keep their floats (rows no block divides), e.g. %s", kind,
                 len(kept), kept[0])
    if done:
        log.info("quantization=%r: %s written as GGUF blocks in %.1f s", kind,
                 ", ".join(f"{n} {f}" for f, n in sorted(done.items())), time.perf_counter() - t0)


def quantize(w: torch.Tensor, ggml_type: GGMLType) -> torch.Tensor:
    """A float weight [rows, k] as the GGUF stores it in `ggml_type`: uint8 [rows, bytes per row]."""
    if w.dim() != 2:
        raise ValueError(f"a weight to quantize is 2-D, got shape {tuple(w.shape)}")
    n, k = w.shape
    block, size = BLOCKS[ggml_type]
    if k % block:
        raise ValueError(f"{ggml_type.name} rows hold a multiple of {block} values; got k={k}")
    out = torch.empty(n, k // block * size, dtype=torch.uint8)
    step = max(1, _CHUNK // k)
    for i in range(0, n, step):
        rows = w[i : i + step].detach().to(torch.float32)
        top = float(rows.abs().amax()) if rows.numel() else 0.0  # NaN or inf where any value is: one pass for both
        if not math.isfinite(top):
            raise ValueError(f"the weight has non-finite values (rows {i}..{i + rows.shape[0] - 1})")
        if top > LIMITS[ggml_type]:
            raise ValueError(f"|w| reaches {top:.3g} (rows {i}..{i + rows.shape[0] - 1}), past the "
                             f"{LIMITS[ggml_type]:.3g} that {ggml_type.name}'s fp16 scales hold")
        out[i : i + rows.shape[0]] = _quantize_rows(rows, ggml_type)
    return out


def _quantize_rows(rows: torch.Tensor, ggml_type: GGMLType) -> torch.Tensor:
    if ggml_type == GGMLType.Q4_K:
        return q4_k(rows)
    if ggml_type == GGMLType.Q8_0:
        return q8_0(rows)
    if ggml_type == GGMLType.Q5_0:
        return q5_0(rows)
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    return torch.from_numpy(np.ascontiguousarray(gguf_quantize(rows.numpy(), GGMLQuantizationType(int(ggml_type)))))


def q8_0(rows: torch.Tensor) -> torch.Tensor:
    """float32 [n, k] as Q8_0 blocks: gguf.quants' Q8_0 (llama.cpp's reference arithmetic) bit for bit, in torch
    (multithreaded: gguf's numpy form quantizes ~30M values a second, minutes for a 7B model)."""
    n, k = rows.shape
    x = rows.reshape(-1, 32)
    d = x.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = _roundf(x * inv).to(torch.int8).view(torch.uint8)
    return torch.cat([d.to(torch.float16).view(torch.uint8), q], dim=1).reshape(n, k // 32 * 34)


def q5_0(rows: torch.Tensor) -> torch.Tensor:
    """float32 [n, k] as Q5_0 blocks: gguf.quants' Q5_0 bit for bit, in torch."""
    n, k = rows.shape
    x = rows.reshape(-1, 32)
    signed_max = x.gather(1, x.abs().argmax(-1, keepdim=True))  # the first of equal magnitudes, as numpy's
    d = signed_max / -16
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(x * inv + 16.5).to(torch.uint8).clamp(max=31)
    qs = (q[:, :16] & 0x0F) | (q[:, 16:] << 4)
    bits = ((q >> 4) & 1).reshape(-1, 4, 8).to(torch.int32) << torch.arange(8, dtype=torch.int32)
    qh = bits.sum(-1).to(torch.uint8)
    return torch.cat([d.to(torch.float16).view(torch.uint8), qh, qs], dim=1).reshape(n, k // 32 * 22)


def q4_k(rows: torch.Tensor) -> torch.Tensor:
    """float32 [n, k] (k a multiple of 256) as Q4_K blocks, uint8 [n, k / 256 * 144]."""
    n, k = rows.shape
    x = rows.reshape(-1, 8, 32)  # super-blocks x sub-blocks x values
    lo = x.amin(-1).clamp(max=0.0)
    hi = x.amax(-1)
    scale = (hi - lo) / 15.0
    mins = -lo  # >= 0: w = d * sc * q - dmin * m
    # Floored at fp16's smallest subnormal where nonzero: a super-block of values under ~1e-5 would otherwise
    # store d = 0 and read back as its minimums (worse than zeros).
    d = _fp16(_floor_nonzero(scale.amax(-1) / 63.0))
    dmin = _fp16(_floor_nonzero(mins.amax(-1) / 63.0))
    # A sub-block with any range gets a step: a quiet one beside a loud one (range under 1/126 of it) would
    # round to sc = 0 and read back as its minimum.
    sc = torch.where(scale > 0, _round_div(scale, d[:, None]).clamp(1, 63), torch.zeros_like(scale))
    m = _round_div(mins, dmin[:, None]).clamp(0, 63)
    step = d[:, None] * sc
    q = _round_div(x + (dmin[:, None] * m)[..., None], step[..., None]).clamp(0, 15).to(torch.uint8)
    sc8, m8 = sc.to(torch.uint8), m.to(torch.uint8)
    scales = torch.empty(x.shape[0], 12, dtype=torch.uint8)
    scales[:, 0:4] = sc8[:, :4] | ((sc8[:, 4:] >> 4) << 6)
    scales[:, 4:8] = m8[:, :4] | ((m8[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc8[:, 4:] & 0x0F) | ((m8[:, 4:] & 0x0F) << 4)
    q = q.reshape(-1, 4, 2, 32)  # 64-value chunks: the first 32 in the low nibbles, the next in the high
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    head = torch.stack([d, dmin], dim=1).to(torch.float16).view(torch.uint8)
    return torch.cat([head, scales, qs], dim=1).reshape(n, k // 256 * 144)


def _floor_nonzero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 0, x.clamp(min=_FP16_TINY), x)


def _fp16(x: torch.Tensor) -> torch.Tensor:
    """x as stored (fp16, clamped to its range), back in float32: what the kernels will read."""
    return x.clamp(max=_FP16_MAX).to(torch.float16).to(torch.float32)


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """gguf.quants.np_roundf: half away from zero, computed as it does (floor(a) + floor(2 * (a - floor(a))))."""
    a = x.abs()
    f = torch.floor(a)
    return torch.sign(x) * (f + torch.floor(2 * (a - f)))


def _round_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """round(a / b) half away from zero (llama.cpp's nearest_int), 0 where b is 0."""
    r = torch.where(b > 0, a / torch.where(b > 0, b, torch.ones_like(b)), torch.zeros_like(a))
    return torch.sign(r) * torch.floor(r.abs() + 0.5)
