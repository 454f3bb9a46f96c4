"""Building blocks shared by the model families: norms, rotary embedding, paged self-attention.

Module names match transformers' so a checkpoint's state dict loads as is. Each numeric detail
(where a norm upcasts, in which dtype rotary runs) follows transformers, the correctness oracle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncpage.model.attention import AttentionMetadata, paged_attention

# Attention as compiled.py hands it to a layer: (q, k, v, scale) -> o, the KV pool bound inside.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def embedding(vocab_size: int, hidden_size: int) -> nn.Embedding:
    """An embedding table left uninitialised (a checkpoint's weights replace it). Its random init on the
    meta device runs a Python reference kernel that imports torch._dynamo, and with it Triton: 72 MiB
    resident and a second of load time for nothing on the CPU path."""
    return nn.Embedding(vocab_size, hidden_size, _weight=torch.empty(vocab_size, hidden_size))


class RMSNorm(nn.Module):
    """Llama-style: normalize in float32, cast back, then scale by w."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # transformers: normalize in float32, cast back, then scale (in the input dtype).
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma-style: scale by (1 + w), in float32, then cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.scale: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # transformers: everything in float32, (1 + w) included, then cast back. The float32 (1 + w)
        # is made once (fuse()), not every call.
        scale = self.scale if self.scale is not None else 1.0 + self.weight.float()
        return F.rms_norm(x.float(), (x.shape[-1],), weight=scale, eps=self.eps).type_as(x)

    def fuse(self) -> None:
        self.scale = 1.0 + self.weight.detach().float()


def rope_inv_freq(config: Any, layer_type: str | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scaling, from transformers' own RoPE initialisers so every
    scaling type it knows (llama3, linear, yarn, ...) is computed exactly as it does."""
    # Always on the CPU, even while the model is being built on the meta device.
    with torch.device("cpu"):
        return _rope_inv_freq(config, layer_type)


def _rope_inv_freq(config: Any, layer_type: str | None) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = config.rope_parameters
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        base = params["rope_theta"]
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
        factors = getattr(config, "rope_freq_factors", None)  # a GGUF's rope_freqs tensor (gguf.py)
        if factors is not None:
            inv = inv / torch.tensor(factors, dtype=torch.float32)
        return inv, 1.0
    fn = ROPE_INIT_FUNCTIONS[rope_type]
    if layer_type is not None and layer_type in config.rope_parameters:
        inv, scaling = fn(config, torch.device("cpu"), layer_type=layer_type)
    else:
        inv, scaling = fn(config, torch.device("cpu"))
    return inv.float(), float(scaling)


class Rotary(nn.Module):
    def __init__(self, inv_freq: torch.Tensor, scaling: float) -> None:
        super().__init__()
        # A plain attribute, not a buffer: models are built on the meta device and then filled with
        # weights, and these frequencies are computed, not loaded.
        self.inv_freq = inv_freq
        self.scaling = scaling

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                cache: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for these positions; computed once per step and rotary (not once per layer) when a
        per-step `cache` is given."""
        key = f"rotary-{id(self)}-{dtype}"
        if cache is not None and key in cache:
            return cache[key]
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        out = (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)
        if cache is not None:
            cache[key] = out
        return out


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, D]. The rotate-half (NeoX) layout transformers uses."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


class FusedLinear:
    """Several projections of the same input as one matmul (fewer, larger GEMMs: faster on the
    CPU). The original modules' weights become views into the fused weight, so state_dict() and
    the checkpoint names are unchanged."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.sizes = [lin.out_features for lin in linears]
        self.weight = torch.cat([lin.weight for lin in linears], 0)
        self.bias = torch.cat([lin.bias for lin in linears], 0) if linears[0].bias is not None else None
        start = 0
        for lin, n in zip(linears, self.sizes, strict=True):
            lin.weight = nn.Parameter(self.weight[start : start + n], requires_grad=False)
            if self.bias is not None:
                lin.bias = nn.Parameter(self.bias[start : start + n], requires_grad=False)
            start += n

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SiLU for the Llama family, tanh-approximated GELU for Gemma."""

    def __init__(self, hidden: int, inter: int, bias: bool, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act = act
        # FusedLinear, or quant.QuantFused once quantized: one matmul, split per projection.
        self.gate_up: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] | None = None

    def fuse(self) -> None:
        if self.gate_up is None:  # fused (and maybe quantized) already: the parts are gone
            self.gate_up = FusedLinear([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x) if self.gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        gate = F.gelu(gate, approximate="tanh") if self.act == "gelu_tanh" else F.silu(gate)
        return self.down_proj(gate * up)


class PagedSelfAttention(nn.Module):
    """q/k/v projections, optional per-head QK-norm, rotary, paged attention, output projection."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, *, qkv_bias: bool,
                 o_bias: bool, qk_norm: type[nn.Module] | None, eps: float, scale: float,
                 window: int | None, rotary: Rotary) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=o_bias)
        if qk_norm is not None:
            self.q_norm = qk_norm(head_dim, eps)
            self.k_norm = qk_norm(head_dim, eps)
        self.has_qk_norm = qk_norm is not None
        self.scale = scale
        self.window = window
        self.rotary = rotary
        self.qkv: Callable[[torch.Tensor], tuple[torch.Tensor, ...]] | None = None

    def fuse(self) -> None:
        if self.qkv is None:
            self.qkv = FusedLinear([self.q_proj, self.k_proj, self.v_proj])

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        cos, sin = self.rotary.cos_sin(positions, x.dtype, meta.scratch)
        q, k, v = self.project(x, cos, sin)
        attend = meta.attention or paged_attention
        if len(kv_cache) > 2:  # a quantized pool: (k, v, k_scale, v_scale), see attention.quantize_kv
            o = attend(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.window, kv_scales=kv_cache[2:])
        else:
            o = attend(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.window)
        return self.o_proj(o.reshape(x.shape[0], self.num_heads * self.head_dim))

    def project(self, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, KVH, D]: projected, QK-normed, q and k rotated."""
        t = x.shape[0]
        if self.qkv is not None:
            q, k, v = self.qkv(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               attend: Attend) -> torch.Tensor:
        """forward() with attention given as `attend(q, k, v, scale)` (compiled.py's opaque operator)."""
        q, k, v = self.project(x, cos, sin)
        return self.o_proj(attend(q, k, v, self.scale).reshape(x.shape[0], self.num_heads * self.head_dim))


def layer_windows(config: Any) -> list[int | None]:
    """Sliding window of each layer (None: full attention), from `layer_types` when the config has it."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" else None for t in types]
    return [window] * config.num_hidden_layers


def layer_type_of(config: Any, i: int) -> str | None:
    types = getattr(config, "layer_types", None)
    return types[i] if types else None
