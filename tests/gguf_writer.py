"""A Qwen2 HF checkpoint directory written as a .gguf file, the way llama.cpp's convert_hf_to_gguf.py
writes one (no llama.cpp checkout is available offline, so this follows its steps with its own
`gguf` package): the hyperparameters TextModel.set_gguf_parameters writes, the vocabulary of
get_vocab_base + _set_vocab_gpt2 (tokens, token types, merges, special ids, chat template through
gguf.SpecialVocab), and tensor names from gguf's TensorNameMap. Matrices are F16 (`--outtype f16`),
1-D tensors F32; Qwen2's Q/K rows are not permuted (only Llama's are)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch


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


def write_qwen2_gguf(hf_dir: Path, out: Path, tokenizer_pre: str = "qwen2") -> Path:
    """`hf_dir` (a Qwen2ForCausalLM checkpoint: config.json, model.safetensors, tokenizer files, chat
    template) as the .gguf file `out`. `tokenizer_pre` is what get_vocab_base_pre names from the
    tokenizer's hash: "qwen2" for every Qwen2 release."""
    from safetensors.torch import load_file

    hp = json.loads((hf_dir / "config.json").read_text())
    assert hp["model_type"] == "qwen2", hp["model_type"]
    n_layers = int(hp["num_hidden_layers"])
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN2])
    w.add_name(hf_dir.name)
    w.add_context_length(int(hp["max_position_embeddings"]))
    w.add_embedding_length(int(hp["hidden_size"]))
    w.add_block_count(n_layers)
    w.add_feed_forward_length(int(hp["intermediate_size"]))
    w.add_head_count(int(hp["num_attention_heads"]))
    w.add_head_count_kv(int(hp["num_key_value_heads"]))
    rope = hp.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", hp.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(float(hp["rms_norm_eps"]))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)

    tokens, types = _vocab(hf_dir, int(hp["vocab_size"]))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tokenizer_pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    # Merges, bos/eos/pad ids, add_bos_token and tokenizer.chat_template, read from the directory
    # exactly as the converter reads them.
    gguf.SpecialVocab(hf_dir, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, n_layers)
    state: dict[str, torch.Tensor] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    for hf_name, t in state.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, f"no GGUF name for {hf_name}"
        data = t.to(torch.float32).numpy()
        if data.ndim <= 1 or name.endswith("_norm.weight"):
            w.add_tensor(name, data.astype(np.float32))
        else:
            w.add_tensor(name, data.astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
