"""Model registry: transformers `model_type` -> asyncpage implementation."""

from __future__ import annotations

from typing import Any

from torch import nn

from asyncpage.models.gemma3 import Gemma3ForCausalLM
from asyncpage.models.llama import LlamaForCausalLM

MODEL_TYPES: dict[str, type[nn.Module]] = {
    "gemma3_text": Gemma3ForCausalLM,
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}


def model_class(config: Any) -> type[nn.Module]:
    try:
        return MODEL_TYPES[config.model_type]
    except KeyError:
        raise NotImplementedError(
            f"model_type {config.model_type!r} is not supported; supported: {sorted(MODEL_TYPES)}"
        ) from None
