"""A Qwen2, Qwen3 or Llama HF checkpoint directory written as a .gguf file, the way llama.cpp's
convert_hf_to_gguf.py writes one (no llama.cpp checkout is available offline, so this follows its steps
with its own `gguf` package): the hyperparameters TextModel.set_gguf_parameters writes, the vocabulary
of get_vocab_base + _set_vocab_gpt2 (tokens, token types, merges, special ids, chat template through
gguf.SpecialVocab), and tensor names from gguf's TensorNameMap. Matrices are F16 (`--outtype f16`),
1-D tensors F32. Llama's Q/K rows are permuted to llama.cpp's RoPE layout (LlamaModel.permute) and a
Llama 3 RoPE scaling becomes the `rope_freqs` tensor of per-frequency factors
(LlamaModel.generate_extra_tensors); Qwen's rows are not permuted."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import quantize


def _vocab(hf_dir: Path, vocab_size: int) -> tuple[list[str], list[int]]:
    """get_vocab_base: every id up to the model's vocab_size, ids the tokenizer lacks as [PAD<i>]
    (UNUSED); added tokens CONTROL when special or special-looking (<|...|>), else USER_DEFINED."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    assert max(tok.get_vocab().values()) < vocab_size
    reverse = {i: t for t, i in tok.get_vocab().items()}
    added = tok.get_added_vocab()
    decoders = tok.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if token in added:
            if not decoders[i].normalized:
                token = tok.decode(tok.encode(token, add_special_tokens=False))
            looks_special = token.startswith("<|") and token.endswith("|>")
            types.append(gguf.TokenType.CONTROL if decoders[i].special or looks_special
                         else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    return tokens, types


ARCHS = {"qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3, "llama": gguf.MODEL_ARCH.LLAMA}
PRE = {"qwen2": "qwen2", "qwen3": "qwen2", "llama": "llama-bpe"}  # get_vocab_base_pre's names for the releases


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """LlamaModel.permute: each head's rotary halves interleaved, as llama.cpp's RoPE reads them."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(hp: dict[str, Any], rope: dict[str, Any]) -> np.ndarray:
    """LlamaModel.generate_extra_tensors: one factor per rotary frequency (llama.cpp divides by it)."""
    head_dim = int(hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"])
    base = float(rope.get("rope_theta", 10000.0))
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old = float(rope["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old / low, old / high
    factors = []
    for freq in 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(hf_dir: Path, out: Path, tokenizer_pre: str | None = None, *,
               formats: Callable[[str], gguf.GGMLQuantizationType | None] | None = None,
               rope_freqs: np.ndarray | None = None) -> Path:
    """`hf_dir` (a Qwen2, Qwen3 or Llama checkpoint: config.json, model.safetensors, tokenizer files,
    chat template) as the .gguf file `out`. `tokenizer_pre` is what get_vocab_base_pre names from the
    tokenizer's hash (default: the family's releases' name, PRE). `formats`: a matrix's format by its GGUF
    name (None: F16), quantized from the F16 values with gguf's own quantizers, as llama-quantize does from an
    F16 file; `rope_freqs`: the factors written as that tensor in place of a Llama 3 scaling's (a damaged file;
    any family's)."""
    from safetensors.torch import load_file

    hp = json.loads((hf_dir / "config.json").read_text())
    family = hp["model_type"]
    arch = ARCHS[family]
    n_layers = int(hp["num_hidden_layers"])
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(hf_dir.name)
    w.add_context_length(int(hp["max_position_embeddings"]))
    w.add_embedding_length(int(hp["hidden_size"]))
    w.add_block_count(n_layers)
    w.add_feed_forward_length(int(hp["intermediate_size"]))
    w.add_head_count(int(hp["num_attention_heads"]))
    w.add_head_count_kv(int(hp["num_key_value_heads"]))
    if hp.get("head_dim"):
        w.add_key_length(int(hp["head_dim"]))
        w.add_value_length(int(hp["head_dim"]))
    rope = hp.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", hp.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(float(hp["rms_norm_eps"]))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    tokens, types = _vocab(hf_dir, int(hp["vocab_size"]))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tokenizer_pre or PRE[family])
    w.add_token_list(tokens)
    w.add_token_types(types)
    # Merges, bos/eos/pad ids, add_bos_token and tokenizer.chat_template, read from the directory
    # exactly as the converter reads them.
    gguf.SpecialVocab(hf_dir, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)

    names = gguf.get_tensor_name_map(arch, n_layers)
    if rope_freqs is None and rope.get("rope_type") == "llama3":
        rope_freqs = _llama3_rope_factors(hp, rope)
    if rope_freqs is not None:
        w.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", rope_freqs.astype(np.float32))
    state: dict[str, torch.Tensor] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    for hf_name, t in state.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, f"no GGUF name for {hf_name}"
        data = t.to(torch.float32).numpy()
        if family == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = hp["num_attention_heads" if "attn_q" in name else "num_key_value_heads"]
            data = _permute(data, int(heads))
        qtype = formats(name) if formats is not None and data.ndim == 2 else None
        if qtype is not None:
            w.add_tensor(name, quantize(data.astype(np.float16).astype(np.float32), qtype), raw_dtype=qtype)
        elif data.ndim <= 1 or name.endswith("_norm.weight"):
            w.add_tensor(name, data.astype(np.float32))
        else:
            w.add_tensor(name, data.astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def round_matrices_to_half(hf_dir: Path) -> Path:
    """`hf_dir`'s matrices rounded to float16 in place (kept float32): the weights its F16 GGUF holds,
    so the checkpoint and the file give the same logits."""
    from safetensors.torch import load_file, save_file

    f = hf_dir / "model.safetensors"
    save_file({k: (v.half().float() if v.ndim == 2 else v) for k, v in load_file(str(f)).items()}, str(f),
              metadata={"format": "pt"})
    return hf_dir
