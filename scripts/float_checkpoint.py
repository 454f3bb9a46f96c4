"""Write a GGUF model (default: the embedded gemma-3-270m) as a float Hugging Face directory (config, tokenizer,
one safetensors file): the float checkpoint that `quantization="int8" | "int4"` figures are measured on
(docs/performance.md).

    .venv/bin/python scripts/float_checkpoint.py /tmp/gemma-bf16 [--model FILE.gguf] [--dtype bfloat16]

The weights are the GGUF's dequantized (a Q4_K_M file's values, not the original training checkpoint's).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors.torch import save_file

from asyncpage.model.weights import load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()
    loaded = load(args.model, torch.float32, torch.device("cpu"), None)
    dtype = getattr(torch, args.dtype)
    tied = loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    state = {k: v.to(dtype).contiguous() for k, v in loaded.model.state_dict().items()
             if not (tied and k == "lm_head.weight")}
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    loaded.config.save_pretrained(args.out)
    loaded.tokenizer.save_pretrained(args.out)
    print(f"{args.out}: {len(state)} tensors, {args.dtype}")


if __name__ == "__main__":
    main()
