"""A tiny random model steered to write a chosen text: a bigram chain laid into its weights.

Each token of the chain gets an embedding of one large component on a dimension of its own, so at a
position holding that token the final norm's output is (nearly) that dimension alone whatever the
layers add; the LM head's entry for (next token, that dimension) then makes the chain's next token
the model's greedy choice. Tokens off the chain keep their random embeddings (random choices, as
before). The chain's tokens must be distinct, but for its last one (whose successor is free).
"""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path
from typing import Any

import torch


def chain_ids(tok: Any, start: int, text: str) -> list[int]:
    """`start` (the prompt's last token) and `text`'s tokens: the chain the model will follow."""
    return [start, *tok(text, add_special_tokens=False)["input_ids"]]


def build(src: Path, dst: Path, chain: list[int], *, template: str | None = None) -> Path:
    """A copy of the tiny model at `src` (untied embeddings, norm weight * x) that writes `chain[1:]`
    greedily after `chain[0]` (an empty chain: the model unchanged), with `template` as its chat template."""
    from transformers import AutoModelForCausalLM

    if chain and len(set(chain[:-1])) != len(chain) - 1:
        raise ValueError(f"the chain's tokens must be distinct (but for its last): {chain}")
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    if template is not None:
        (dst / "chat_template.jinja").write_text(template)
    if not chain:
        return dst
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        emb, head, norm = model.model.embed_tokens.weight, model.lm_head.weight, model.model.norm.weight
        if len(chain) - 1 > emb.shape[1]:
            raise ValueError("the chain is longer than the model's hidden size")
        for d, (cur, nxt) in enumerate(itertools.pairwise(chain)):
            emb[cur] = 0.0
            emb[cur, d] = 1000.0
            norm[d] = 1.0
            head[:, d] = 0.0
            head[nxt, d] = 10.0
    model.save_pretrained(dst)
    return dst
