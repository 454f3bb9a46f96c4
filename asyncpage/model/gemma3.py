"""Gemma 3 text (the default model): local sliding-window layers with their own RoPE base and
global layers, QK-norm, gelu-tanh gated MLP, embeddings scaled by sqrt(hidden), (1 + w) RMSNorm,
pre- and post-norms around both blocks, query_pre_attn_scalar, tied LM head."""

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
    GemmaRMSNorm,
    PagedSelfAttention,
    Rotary,
    embedding,
    layer_type_of,
    layer_windows,
    rope_inv_freq,
)
from asyncpage.model.native_step import NativeStep


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Any, window: int | None, rotary: Rotary) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = PagedSelfAttention(
            h, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=GemmaRMSNorm, eps=eps,
            scale=config.query_pre_attn_scalar**-0.5, window=window, rotary=rotary)
        self.mlp = GatedMLP(h, config.intermediate_size, False, "gelu_tanh")
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, meta, kv_cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def decode_layer(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        """forward() with cos/sin precomputed and attention as `attend(q, k, v, scale)` (compiled.py)."""
        x = x + self.post_attention_layernorm(self.self_attn.decode(self.input_layernorm(x), cos, sin, attend))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise NotImplementedError("attention logit soft-capping (Gemma 2) is not supported")
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        # One rotary per layer type: local layers have their own base (10k vs 1M).
        rotaries: dict[str | None, Rotary] = {}
        windows = layer_windows(config)
        layers = []
        for i in range(config.num_hidden_layers):
            lt = layer_type_of(config, i)
            if lt not in rotaries:
                rotaries[lt] = Rotary(*rope_inv_freq(config, lt))
            layers.append(Gemma3DecoderLayer(config, windows[i], rotaries[lt]))
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embed_scale = config.hidden_size**0.5


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = Gemma3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight  # tied
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        self.compiled: CompiledDecode | None = None  # compiled.enable(): small decode steps
        self.native: NativeStep | None = None  # native_step.enable(): GGUF-block decode steps in C

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        """input_ids/positions: [T] flat over the batch; kv_caches: one (K, V) pool per layer."""
        if self.native is not None and self.native.applies(meta, input_ids.shape[0], kv_caches):
            return self.native.forward(input_ids, positions, meta, kv_caches)
        x = self.model.embed_tokens(input_ids)
        # transformers multiplies by the scale cast to the weights' dtype; so do we (it matters in bf16).
        x = x * torch.tensor(self.model.embed_scale, dtype=x.dtype)
        if self.compiled is not None and self.compiled.applies(meta, x.shape[0], kv_caches):
            return self.model.norm(self.compiled.forward(x, positions, meta, kv_caches))
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, positions, meta, kv)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Through the module, not its .weight: quantization swaps in a packed layer (quant.py).
        logits = self.lm_head(hidden).float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def compute_logits_max(self, hidden: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """compute_logits, and each row's maximum and first index where the LM head's kernel found them."""
        got = logits_with_max(self.lm_head, hidden) if self.final_softcap is None else None
        return got if got is not None else (self.compute_logits(hidden), None)
