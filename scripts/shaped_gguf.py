"""Second-family GGUFs for the CPU-path checks where no real one can be fetched (no network here):
random weights in a released model's shapes, written F16 as llama.cpp's convert_hf_to_gguf.py writes
one (tests/gguf_writer.py), with a byte-level BPE tokenizer trained on the spot:

- `qwen2`: Qwen2.5-0.5B-Instruct's (24 layers, hidden 896, 14 heads / 2 KV heads, FFN 4864, vocabulary
  151,936, tied embeddings, QKV bias);
- `llama3`: Llama-3.2-1B-Instruct's (16 layers, hidden 2048, 32 heads / 8 KV heads, FFN 8192, vocabulary
  128,256, tied embeddings, Llama 3 RoPE scaling written as the rope_freqs tensor).

Quantize it with llama.cpp's own tool for the Q4_K_M file (its mix of Q4_K/Q6_K and, where a row's
length is not a multiple of 256, as Qwen's 896, Q5_0/Q8_0 fallbacks):

    python scripts/shaped_gguf.py qwen2 /tmp/qwen            # /tmp/qwen/qwen2-shaped-f16.gguf
    llama-quantize /tmp/qwen/qwen2-shaped-f16.gguf /tmp/qwen/qwen2-shaped-q4_k_m.gguf Q4_K_M
    asyncpage bench --model /tmp/qwen/qwen2-shaped-q4_k_m.gguf --llama-bench ... --llama-server ...

Speed and memory only: random weights make perplexity a numerics check (auto against float32), not a
quality figure."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.gguf_writer import write_gguf


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    import asyncpage

    text = [p.read_text(errors="ignore") for p in Path(asyncpage.__file__).parent.rglob("*.py")]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8000, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(path)


def main(family: str, out: Path) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen2Config

    hf = out / "hf"
    config: PretrainedConfig
    if family == "qwen2":
        config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                             num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                             rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=None,
                             eos_token_id=0)
    elif family == "llama3":
        config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                             max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
                             bos_token_id=1, eos_token_id=0,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 8192})
    else:
        raise SystemExit(f"family {family!r}: one of qwen2, llama3")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name:
                p.normal_(0, 0.1)
    model.save_pretrained(hf)
    del model
    _tokenizer(hf)
    return write_gguf(hf, out / f"{family}-shaped-f16.gguf")


if __name__ == "__main__":
    print(main(sys.argv[1] if len(sys.argv) > 1 else "qwen2", Path(sys.argv[2] if len(sys.argv) > 2 else "/tmp/qwen")))
