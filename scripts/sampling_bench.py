"""The per-step searches over the logits, timed: each row's first maximum (runtime/reduce.py's
`first_max` against torch's `max(dim=-1)`) and a grammar mask (guided/backend.py's `apply_bitmask`
against the same mask through torch's masked_fill), at 1, 8 and 32 rows of a 262,144-token vocabulary.

    python scripts/sampling_bench.py [--vocab 262144] [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from asyncpage.guided.backend import apply_bitmask, bitmask_width
from asyncpage.runtime.reduce import first_max


def us(fn: Callable[[], object], n: int) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - t0) / n / 1e3


def torch_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> bits) & 1).reshape(logits.shape[0], -1)[:, : logits.shape[1]].bool()
    logits.masked_fill_(~allowed, float("-inf"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=262_144)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'rows':>4} {'max(dim) us':>12} {'first_max us':>13} {'ratio':>6} {'masked_fill us':>15} "
          f"{'apply_bitmask us':>17} {'ratio':>6}")
    for rows in (1, 8, 32):
        x = torch.randn(rows, args.vocab)
        mask = torch.randint(-(2**31), 2**31 - 1, (rows, bitmask_width(args.vocab)), dtype=torch.int32)
        n = max(5, 200 // rows)
        a, b = us(lambda x=x: x.max(dim=-1), n), us(lambda x=x: first_max(x), n)
        c = us(lambda x=x, m=mask: torch_mask(x.clone(), m), n) - us(x.clone, n)
        d = us(lambda x=x, m=mask: apply_bitmask(x.clone(), m), n) - us(x.clone, n)
        print(f"{rows:>4} {a:12.0f} {b:13.0f} {a / b:5.1f}x {c:15.0f} {d:17.0f} {c / d:5.1f}x")


if __name__ == "__main__":
    main()
