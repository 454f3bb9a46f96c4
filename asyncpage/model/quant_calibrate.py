"""Which kernel a quantized layer calls, measured on this machine at load: torch's packed CPU
matmuls and their activation dtype, the packed / dense crossover by row count, and the int8 LM
head's row-by-row dynamic int8 linear (used by quant.py's `QuantLinear`).

Torch's kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`), measured here (2 cores,
AVX-512 bf16), LM head 262,144 x 640: bf16 22 ms at 1 row, int8 12 ms, int4 5.8 ms; at 32 rows bf16
26 ms, int8 185 ms, int4 79 ms: these kernels read the packed weight once per row group and lose to a
dense GEMM past a few rows. So each layer keeps the dequantized weight (the same values, in the
model dtype) for calls with more rows than its measured crossover: decode steps of a few sequences
read 2-4x fewer bytes, prefill and big batches run as fast as before, and every path computes with
the same quantized values.

The packed kernels also run at very different speeds by activation dtype: measured here at 1 row,
int8 LM head with float32 activations 66 ms, with bfloat16 15 ms (float32 dense: 28 ms). So a float32
model's quantized layers hand the kernel bfloat16 activations where that measures faster on this CPU
(`act_dtype`; on CPUs without native bf16 it will not), and the scales and the dense copy are rounded
the same way, so every path still computes with the same weights.

One layer differs: the int8 LM head's calls of a few rows (decode steps of one stream or a few) run
torch's dynamic int8 linear row by row (fbgemm / oneDNN: each row rounded to 8 bits, int8 dot
products) where that measures faster at one row, 2x here (`w8a8_for`): the same int8 weights, the
activation rounded to 8 bits.
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F


class QuantLinear(Protocol):
    """What calibration reads of a quantized layer (model/quant.py's QuantLinear, which imports this)."""

    kind: str
    out_features: int
    in_features: int
    dtype: torch.dtype
    act_dtype: torch.dtype
    packed: torch.Tensor
    scales: torch.Tensor
    dense: torch.Tensor | None
    max_rows: int
    one_row: Any
    q8: torch.Tensor | None
    q4: tuple[torch.Tensor, torch.Tensor] | None

    @property
    def native(self) -> bool: ...

    def kernel(self, x: torch.Tensor, /) -> torch.Tensor: ...

    def rowwise(self, x: torch.Tensor, /) -> torch.Tensor: ...

log = logging.getLogger("asyncpage")

GROUP = 32  # int4 group size: Q4_K's sub-block, so a GGUF's Q4_K tensors map exactly
CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32, 64)
_L2_FLUSH = 8 << 20  # bytes written between timed calls
_crossovers: dict[tuple[Any, ...], int] = {}  # measured once per process per kernel and shape


def packed_mm(kind: str, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    if kind == "int8":
        return torch.ops.aten._weight_int8pack_mm(x, packed, scales)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales)


def kernel_dtype(layer: QuantLinear, scales: torch.Tensor) -> torch.dtype:
    """The activation dtype the packed kernel runs fastest in at one row, for a float32 model:
    float32 or bfloat16, measured on this machine once per kernel and shape (a 16-bit model
    computes in its own dtype), except where torch's int8 kernel cannot take 16-bit activations."""
    if layer.packed.device.type != "cpu":
        return layer.dtype
    if layer.kind == "int8" and layer.in_features % 16:
        # torch's _weight_int8pack_mm with bfloat16 activations crashes the process (segfault, torch 2.13 on
        # AVX-512) when K is not a multiple of 16 (K = 72, 136, 200; 64, 80, 96 ran): float32 activations there.
        return torch.float32
    if layer.dtype != torch.float32:
        return layer.dtype
    key = ("act", layer.kind, layer.out_features, layer.in_features, torch.get_num_threads())
    if key not in _crossovers:
        x = torch.randn(1, layer.in_features)
        t = {dt: _time(packed_mm, layer.kind, x.to(dt), layer.packed, scales.to(dt))
             for dt in (torch.float32, torch.bfloat16)}
        # bfloat16 activations round the inputs to 8 bits of mantissa: only for a clear gain.
        _crossovers[key] = int(t[torch.bfloat16] < 0.8 * t[torch.float32])
    return torch.bfloat16 if _crossovers[key] else torch.float32


def w8a8_for(layer: QuantLinear) -> Any:
    """The layer's int8 weight prepacked for torch's dynamic int8 linear (fbgemm / oneDNN: activations
    quantized per call to 8 bits, int8 dot products), or None where that is not measurably faster at
    one row than the weight-only kernel (by 20%+) or this torch cannot build it.

    Measured here at one row, LM head 262,144 x 640: 7.0-7.5 ms against 14.9 for `_weight_int8pack_mm`
    (bf16 activations): the int8 dot products stream the weight at ~24 GB/s where the weight-only
    kernel widens each weight to bf16 first. Quality, default model: perplexity 22.997 -> 23.067
    (+0.3%). Used for the LM head only: it runs outside the compiled decode graph, whose tracing
    cannot take the prepacked weight object."""
    if layer.dense is not None and layer.max_rows < 1:
        return None  # forward() serves one row from the dense copy: a prepacked copy would go unused
    prepacked = prepack_w8a8(layer)
    if prepacked is None:
        return None
    key = ("w8a8", layer.out_features, layer.in_features, layer.act_dtype, layer.native,
           torch.get_num_threads())
    if key not in _crossovers:
        x = torch.randn(1, layer.in_features)
        t_w8a8 = _time(w8a8, x, prepacked)
        t_int8 = _time_packed(layer, x)
        _crossovers[key] = int(t_w8a8 < 0.8 * t_int8)
    return prepacked if _crossovers[key] else None


@functools.cache
def w8a8_reduce_range() -> bool:
    """`reduce_range` for quantized::linear_dynamic: True on a CPU without VNNI. fbgemm's AVX2 form
    sums pairs of u8 x s8 products into int16 (vpmaddubsw), which saturates on 8-bit activations:
    an LM head's row came back 5.5% off on average (12% at worst, 128 inputs) on an AVX2 machine,
    1.2% with 7-bit activations. VNNI sums into int32 and keeps all 8 bits."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return True
    return not ({"avx512_vnni", "avx_vnni"} & set(flags))


def w8a8(x: torch.Tensor, prepacked: Any) -> torch.Tensor:
    """One call of torch's dynamic int8 linear on a prepacked weight (prepack_w8a8)."""
    return torch.ops.quantized.linear_dynamic(x, prepacked, w8a8_reduce_range())


def prepack_w8a8(layer: QuantLinear) -> Any:
    """An int8 layer's weight prepacked for `quantized::linear_dynamic` (same int8 values and scales),
    or None off the CPU or where this torch cannot build or run it."""
    if layer.kind != "int8" or layer.packed.device.type != "cpu":
        return None
    try:
        with warnings.catch_warnings():
            # torch marks quantized tensors deprecated; this one lives only until linear_prepack
            # has copied it, and a torch without them takes the except below.
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
            qw = torch._make_per_channel_quantized_tensor(
                layer.packed, layer.scales.double(), torch.zeros(layer.out_features, dtype=torch.long), 0)
        prepacked = torch.ops.quantized.linear_prepack(qw, None)
        w8a8(torch.zeros(1, layer.in_features), prepacked)
    except (RuntimeError, AttributeError, NotImplementedError) as exc:  # a torch without the op or engine
        log.info("no dynamic int8 linear here (%s): the weight-only kernel serves", exc)
        return None
    return prepacked


def crossover(layer: QuantLinear) -> int:
    """The most rows at which the packed kernel still beats the dense matmul, measured on this
    machine once per kernel and shape (0 off the CPU: the packed kernels here are CPU ones)."""
    assert layer.dense is not None
    if layer.packed.device.type != "cpu":
        return 0
    rowwise = layer.one_row is not None
    key = (layer.kind, layer.out_features, layer.in_features, layer.dtype, layer.act_dtype, rowwise,
           layer.q8 is not None, layer.q4 is not None, torch.get_num_threads())
    if key in _crossovers:
        return _crossovers[key]
    best = 0
    dense = layer.dense
    for rows in CALIBRATION_ROWS:
        x = torch.randn(rows, layer.in_features).to(layer.dtype)
        # The kernel alone, its input already in act_dtype: the casts around it are dispatch cost
        # that compile=True fuses away (eager, they cost ~30 us a call here, more than the bytes
        # saved on a small weight at one row: both paths then run about even).
        t_q = _time(layer.rowwise, x) if rowwise else _time_packed(layer, x)
        t_d = _time(F.linear, x, dense)
        if t_q >= t_d:
            break
        best = rows
    _crossovers[key] = best
    return best


def _time_packed(layer: QuantLinear, x: torch.Tensor) -> float:
    """_time of the layer's packed kernel at x's rows: a native one as layers call it, torch's alone
    (x already in act_dtype)."""
    if layer.native:
        return _time(layer.kernel, x)
    return _time(packed_mm, layer.kind, x.to(layer.act_dtype), layer.packed, layer.scales)


def _time(fn: Callable[..., Any], *args: Any) -> float:
    """Median seconds of a call whose weight is not in the core's L2 cache, as in a decode step,
    where a whole model's weights pass between two calls of one layer. Timed hot, a small dense
    weight sat in L2 and beat the packed kernel that reads 4-8x fewer bytes (measured: an int4
    o_proj 640 x 1024 kept float32 at 1 row, 0.09 ms where the packed kernel takes 0.06 cold)."""
    flush = torch.ones(_L2_FLUSH // 4)
    fn(*args)  # the GEMM libraries build a kernel per new shape on the first call
    times = []
    for _ in range(5):
        flush.mul_(1.0)  # writes 8 MB: evicts the weight from L2 (2 MB a core here)
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
