"""Tiny reasoning models for the tests: the session's random tiny Qwen3 with `<think>` / `</think>`
added to its tokenizer (as Qwen3's own are: added tokens, not special), a Qwen3-style template that
opens the answer with `<think>`, and weights steered so that the model closes its thinking by
itself with a chosen probability per token (or never).

The steering: every embedding row gets one large constant component, so the final norm's output is
(nearly) the same direction at every position, and the LM head's column on that direction sets
each token's logit; the closing marker's entry sets its probability, the others stay near zero (a
near-uniform choice among the rest). The network still runs every layer as usual.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import torch

from tests.chat_templates import HERMES

# chat_templates.HERMES (tools rendered, <tool_call> calls) with a generation prompt that opens the
# thinking, as DeepSeek-R1's and Qwen3-Thinking's do.
THINKING_OPENED = HERMES.replace("assistant\n{% endif %}", "assistant\n<think>\n{% endif %}")

# The same without the opened section: the model may think (the template knows the markers) or not.
THINKING_OPTIONAL = THINKING_OPENED.replace("assistant\n<think>\n", "assistant\n").replace(
    "# Tools", "# Tools (think inside <think></think> first)")

PLAIN = """{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
<think>
{% endif %}"""


def build(src: Path, dst: Path, *, template: str | None, close_probability: float | None = None,
          marker_tokens: bool = True) -> Path:
    """A copy of the tiny Qwen3 at `src` under `dst`: `<think>`/`</think>` added as tokens (unless
    `marker_tokens` is False: then they are text the tokenizer spells piece by piece), `template` as
    its chat template, and with `close_probability` the weights steered (module docstring) so that
    `</think>` comes with that probability at every step (0: never; needs `marker_tokens`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    tok = AutoTokenizer.from_pretrained(src)
    if marker_tokens:
        tok.add_tokens(["<think>", "</think>"])
    tok.save_pretrained(dst)
    if template is not None:
        (dst / "chat_template.jinja").write_text(template)
    if close_probability is not None:
        close = tok.convert_tokens_to_ids("</think>")
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        steer(model, close, close_probability)
        model.save_pretrained(dst)
    return dst


def steer(model: Any, close: int, probability: float) -> None:
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb[:, 0] += 1000.0  # the constant component: the residual stream points along dimension 0
        model.model.norm.weight[0] = 1.0
        head = model.lm_head.weight
        vocab = head.shape[0]
        head[:, 0] = 0.0
        # After the final norm, dimension 0 is sqrt(hidden) (the RMS of a single large component).
        scale = math.sqrt(emb.shape[1])
        if probability <= 0:
            head[close, 0] = -30.0 / scale
        else:
            head[close, 0] = math.log(probability * (vocab - 1) / (1 - probability)) / scale
