"""Model registry: transformers `model_type` -> asyncpage implementation."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from asyncpage.model.attention import AttentionMetadata
from asyncpage.model.gemma3 import Gemma3ForCausalLM
from asyncpage.model.llama import LlamaForCausalLM


class CausalLM(Protocol):
    """What the runner needs of a model: a flat-batch forward over the paged cache, and logits."""

    config: Any
    model: Any  # .layers[i].self_attn gives num_kv_heads / head_dim for sizing the pool

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def compute_logits_max(self, hidden: torch.Tensor) -> tuple[torch.Tensor,
                                                                tuple[torch.Tensor, torch.Tensor] | None]:
        """compute_logits, and each row's maximum and first index where the LM head's kernel found them as
        it wrote the logits (else None). What the runner's decode steps call: a wrapper that changes the
        logits (a test's fault, say) wraps this one, or returns None for the maxima."""
        ...


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
