"""The Llama family: Llama 2/3 (llama3 RoPE scaling), Mistral (sliding window), Qwen2 (QKV bias),
Qwen3 (per-head QK-norm). GQA/MQA through num_key_value_heads."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncpage.model.attention import AttentionMetadata
from asyncpage.model.compiled import CompiledDecode
from asyncpage.model.gguf_linear import logits_with_max
from asyncpage.model.layers import (
    Attend,
    GatedMLP,
    PagedSelfAttention,
    RMSNorm,
    Rotary,
    embedding,
    layer_type_of,
    layer_windows,
    rope_inv_freq,
)
from asyncpage.model.native_step import NativeStep


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, window: int | None, rotary: Rotary) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        mt = config.model_type
        head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
        attn_bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = PagedSelfAttention(
            h, config.num_attention_heads, config.num_key_value_heads, head_dim,
            qkv_bias=True if mt == "qwen2" else attn_bias,
            o_bias=False if mt == "qwen2" else attn_bias,
            qk_norm=RMSNorm if mt == "qwen3" else None, eps=eps,
            scale=head_dim**-0.5, window=window, rotary=rotary)
        self.mlp = GatedMLP(h, config.intermediate_size, bool(getattr(config, "mlp_bias", False)), "silu")
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, meta, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode_layer(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        """forward() with cos/sin precomputed and attention as `attend(q, k, v, scale)` (compiled.py)."""
        x = x + self.self_attn.decode(self.input_layernorm(x), cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        rotaries: dict[str | None, Rotary] = {}
        windows = layer_windows(config)
        layers = []
        for i in range(config.num_hidden_layers):
            lt = layer_type_of(config, i)
            key = lt if lt in (config.rope_parameters or {}) else None
            if key not in rotaries:
                rotaries[key] = Rotary(*rope_inv_freq(config, key))
            layers.append(LlamaDecoderLayer(config, windows[i], rotaries[key]))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.compiled: CompiledDecode | None = None  # compiled.enable(): small decode steps
        self.native: NativeStep | None = None  # native_step.enable(): GGUF-block decode steps in C

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        """input_ids/positions: [T] flat over the batch; kv_caches: one (K, V) pool per layer."""
        if self.native is not None and self.native.applies(meta, input_ids.shape[0], kv_caches):
            return self.native.forward(input_ids, positions, meta, kv_caches)
        x = self.model.embed_tokens(input_ids)
        if self.compiled is not None and self.compiled.applies(meta, x.shape[0], kv_caches):
            return self.model.norm(self.compiled.forward(x, positions, meta, kv_caches))
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, positions, meta, kv)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def compute_logits_max(self, hidden: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """compute_logits, and each row's maximum and first index where the LM head's kernel found them."""
        got = logits_with_max(self.lm_head, hidden)
        return got if got is not None else (self.compute_logits(hidden), None)
