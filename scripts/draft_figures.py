"""Draft-model speculation on the default model, with and without, side by side in one run: the
figures in the README's "Speculative decoding" section.

    python scripts/draft_figures.py [--k 4] [--quantization int4] [--dtype float32]

The draft is the default model itself (optionally quantized): the only model here with its tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from asyncpage import AsyncEngine
from asyncpage.bench.spec import format_rows, speculative_figures
from asyncpage.model.weights import resolve


async def main(args: argparse.Namespace) -> None:
    base = AsyncEngine.from_pretrained(dtype=args.dtype)
    config: dict[str, Any] = {"method": "draft", "model": str(resolve(None)), "num_speculative_tokens": args.k}
    if args.quantization:
        config["quantization"] = args.quantization
    rows = await speculative_figures(base, config, args.num_requests)
    print(format_rows(rows, config))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=4, help="drafts per step at most")
    ap.add_argument("--quantization", choices=["int8", "int4"], default=None, help="the draft's weights")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("-n", "--num-requests", type=int, default=32, help="requests in the mixed workload")
    asyncio.run(main(ap.parse_args()))
