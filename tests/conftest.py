"""Shared fixtures. Tiny random-weight models of each architecture are built here, saved as HF
directories (safetensors + a small byte-level BPE tokenizer trained on the spot), and loaded by
asyncpage exactly as a user's checkpoint would be. The real default model is loaded once per session.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(2)

DATA = Path(__file__).parent / "data"

def _shared_data() -> Path:
    """The guided-decoding test data (../shared/data next to the checkout, as DESIGN.md places it);
    ASYNCPAGE_SHARED_DATA overrides it for a checkout elsewhere."""
    env = os.environ.get("ASYNCPAGE_SHARED_DATA")
    candidates = [Path(env)] if env else []
    candidates += [Path(__file__).resolve().parents[2] / "shared" / "data", Path("/work/shared/data")]
    return next((c for c in candidates if (c / "jsonschemabench-dev").is_dir()), candidates[0])


SHARED = _shared_data()

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Paged attention keeps the KV cache in fixed-size blocks mapped by block tables.",
    "def add(a, b):\n    return a + b\n",
    "Continuous batching lets requests join and leave at every step.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16",
    '{"name": "Alice", "age": 30, "tags": ["a", "b"]}',
]

TINY_VOCAB = 320


def tiny_config(arch: str) -> Any:
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=3, max_position_embeddings=512, bos_token_id=0,
                                  eos_token_id=1, pad_token_id=2)
    if arch == "llama":  # Llama 3 RoPE scaling, GQA 4:2, untied head
        return LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 64})
    if arch == "mistral":  # sliding window on every layer, MQA
        return MistralConfig(**common, num_attention_heads=4, num_key_value_heads=1, sliding_window=8,
                             tie_word_embeddings=False)
    if arch == "qwen2":  # QKV bias, tied embeddings
        return Qwen2Config(**common, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    if arch == "qwen3":  # per-head QK-norm, head_dim != hidden / heads
        return Qwen3Config(**common, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           tie_word_embeddings=False)
    if arch == "gemma3":  # local (window 8, base 10k) and global (base 1M) layers, MQA
        return Gemma3TextConfig(**common, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                                sliding_window=8, query_pre_attn_scalar=24, sliding_window_pattern=3,
                                rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                 "sliding_attention": {"rope_type": "default",
                                                                       "rope_theta": 1e4}})
    raise ValueError(arch)


ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]


def _tiny_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB - 8, special_tokens=["<bos>", "<eos>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(CORPUS * 4, trainer)
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(path)


def build_tiny(arch: str, path: Path, seed: int = 0) -> Any:
    """A random tiny HF model of `arch` saved under `path`; returns the transformers model (float32)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(arch)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Norm weights start at 0 or 1: perturb them so (1 + w) vs w mix-ups cannot hide.
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif "bias" in name:
                p.normal_(0, 0.1)
    model.save_pretrained(path)
    _tiny_tokenizer(path)
    (path / "asyncpage-test.json").write_text(json.dumps({"arch": arch}))
    return model


def fail_at_step(engine: Any, step: int, message: str = "injected device failure") -> Any:
    """Fault injection: the engine's `step`-th forward raises RuntimeError(message). Returns the real
    `execute`, to put back with `engine._core.runner.execute = real`."""
    real = engine._core.runner.execute
    calls = 0

    def flaky(batch: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == step:
            raise RuntimeError(message)
        return real(batch)

    engine._core.runner.execute = flaky
    return real


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: (root / arch, build_tiny(arch, root / arch)) for arch in ARCHS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models: dict[str, tuple[Path, Any]]) -> Path:
    return tiny_models["llama"][0]


@pytest.fixture(scope="session")
def reference() -> dict[str, Any]:
    return json.loads((DATA / "gemma3_270m_reference.json").read_text())


@pytest.fixture(scope="session")
def default_engine_unstarted() -> Any:
    """The real default model dequantized to float32 (`quantization=None`: the weights transformers' references
    were made with), loaded once for the session (start it with `async with`). The engine's own default
    (`quantization="auto"`, the GGUF's blocks) is checked against it in tests/test_gguf_auto.py."""
    from asyncpage import AsyncEngine

    return AsyncEngine.from_pretrained(dtype="float32", max_num_batched_tokens=256, quantization=None)


@pytest.fixture(scope="session")
async def default_engine(default_engine_unstarted: Any) -> Any:
    """Started once; tests share it (and must leave it idle: nothing running, no blocks used)."""
    async with default_engine_unstarted as engine:
        yield engine
