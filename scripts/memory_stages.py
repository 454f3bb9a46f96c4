"""Resident memory of one engine's load, stage by stage (docs/performance.md, "Where the memory goes").

    .venv/bin/python scripts/memory_stages.py [MODEL] [--kv-mib 64]

Prints VmRSS (MiB) after importing torch and asyncpage, after the weights and tokenizer, after the
grammar backend's tokenizer, and after the engine (KV pool included), each after malloc_trim, so a
stage's figure is what it keeps. `asyncpage bench` prints the total beside llama.cpp's.
"""

from __future__ import annotations

import argparse
import ctypes
import time
from typing import Any


def rss_mib() -> float:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--kv-mib", type=int, default=64)
    args = ap.parse_args()
    t0 = time.perf_counter()
    print(f"{'python':32s} {rss_mib():7.0f} MiB")
    import torch  # noqa: F401

    print(f"{'+ torch':32s} {rss_mib():7.0f} MiB")
    from asyncpage import AsyncEngine
    from asyncpage.core import loading
    from asyncpage.guided.manager import GrammarManager

    print(f"{'+ asyncpage':32s} {rss_mib():7.0f} MiB")
    load, prepare = loading.load, GrammarManager.prepare

    def staged_load(*a: Any, **k: Any) -> Any:
        out = load(*a, **k)
        print(f"{'+ weights and tokenizer':32s} {rss_mib():7.0f} MiB")
        return out

    def staged_prepare(self: GrammarManager, *a: Any) -> None:
        prepare(self, *a)
        print(f"{'+ grammar tokenizer':32s} {rss_mib():7.0f} MiB")

    loading.load = staged_load  # type: ignore[assignment]
    GrammarManager.prepare = staged_prepare  # type: ignore[method-assign]
    engine = AsyncEngine.from_pretrained(args.model, kv_cache_memory=args.kv_mib << 20, enable_prefix_caching=False)
    print(f"{'+ engine (KV pool)':32s} {rss_mib():7.0f} MiB   ({engine.stats().kv_blocks_total} blocks, "
          f"{time.perf_counter() - t0:.1f} s in all)")


if __name__ == "__main__":
    main()
