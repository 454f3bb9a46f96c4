"""A second-family GGUF for the CPU-path checks where no real one can be fetched (no network here):
random weights in Qwen2.5-0.5B-Instruct's shapes (24 layers, hidden 896, 14 heads / 2 KV heads, FFN
4864, vocabulary 151,936, tied embeddings, QKV bias), written F16 as llama.cpp's convert_hf_to_gguf.py
writes one (tests/gguf_writer.py), with a byte-level BPE tokenizer trained on the spot. Quantize it
with llama.cpp's own tool for the Q4_K_M file (its mix of Q4_K/Q6_K and, where 896 is not a multiple
of 256, Q5_0/Q8_0 fallbacks):

    python scripts/qwen2_shaped_gguf.py /tmp/qwen            # /tmp/qwen/qwen2-shaped-f16.gguf
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


def main(out: Path) -> Path:
    from transformers import AutoModelForCausalLM, Qwen2Config

    hf = out / "hf"
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=None,
                         eos_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name:
                p.normal_(0, 0.1)
    model.save_pretrained(hf)
    _tokenizer(hf)
    return write_gguf(hf, out / "qwen2-shaped-f16.gguf")


if __name__ == "__main__":
    print(main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/qwen")))
