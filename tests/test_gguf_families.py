"""A Llama, Qwen3 or Qwen2 checkpoint converted to GGUF the way llama.cpp's converter writes it
(tests/gguf_writer.py: Llama's Q/K rows permuted to llama.cpp's RoPE layout, Llama 3's RoPE scaling as
the `rope_freqs` tensor) gives the checkpoint's own log-probabilities and greedy tokens through the
engine; and its quantized blocks, kept as stored, compute what its dequantized weights compute."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from asyncpage import AsyncEngine, SamplingParams
from asyncpage.errors import ModelLoadError
from asyncpage.model import gguf_kernels
from asyncpage.model.gguf_linear import GGUFFused
from asyncpage.model.weights import load
from tests.conftest import TINY_VOCAB, build_tiny, tiny_config
from tests.gguf_writer import _llama3_rope_factors, round_matrices_to_half, write_gguf
from tests.test_prompt_logprobs import _reference, _scores

FAMILIES = ["llama", "qwen3", "qwen2"]  # conftest's tiny configs: Llama 3 RoPE scaling + GQA, QK-norm, QKV bias
PROMPT = [(i * 53 + 7) % (TINY_VOCAB - 3) + 3 for i in range(80)]  # past the original context (64) llama3 scales


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Each family's tiny checkpoint (matrices rounded to float16) as an F16 GGUF, with the checkpoint
    loaded by transformers."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("families")
    out = {}
    for arch in FAMILIES:
        build_tiny(arch, root / arch, seed=5)
        hf_dir = round_matrices_to_half(root / arch)
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
        out[arch] = (write_gguf(hf_dir, root / f"{arch}-f16.gguf"), hf)
    return out


@pytest.mark.parametrize("arch", FAMILIES)
async def test_a_converted_gguf_gives_its_checkpoints_log_probabilities_and_greedy_tokens(
        arch: str, converted: dict[str, tuple[Path, Any]]) -> None:
    path, hf = converted[arch]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=0)
    async with AsyncEngine.from_pretrained(path, dtype="float32", num_kv_blocks=64) as engine:
        out = await engine.generate(PROMPT, params)
    torch.testing.assert_close(_scores(out), _reference(hf, PROMPT), atol=1e-4, rtol=1e-4)
    want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(PROMPT):]
    assert out.token_ids == want.tolist()


def test_llama_3s_rope_scaling_is_read_from_the_rope_freqs_tensor(converted: dict[str, tuple[Path, Any]]) -> None:
    """Without the factors the file's frequencies are the unscaled ones: the log-probabilities differ."""
    path, hf = converted["llama"]
    rotary = load(path, torch.float32, torch.device("cpu")).model.model.layers[0].self_attn.rotary
    torch.testing.assert_close(rotary.inv_freq, hf.model.rotary_emb.inv_freq.float())


@pytest.mark.parametrize(("arch", "damage", "message"), [
    ("llama", lambda f: f[:-1], "it holds 7"), ("llama", lambda f: np.where(f > 1, np.nan, f), "not finite"),
    ("llama", lambda f: f * 0, "outside"), ("llama", lambda f: f * 1e30, "outside"),
    ("qwen2", lambda f: f, "Llama only")])
def test_a_rope_freqs_tensor_llama_cpp_would_not_read_so_is_refused_at_load(
        arch: str, damage: Any, message: str, tmp_path: Path) -> None:
    """The tiny llama's factors, damaged, in its own file; or whole in another family's file."""
    build_tiny(arch, tmp_path / arch)
    llama = tiny_config("llama").to_dict()
    wanted = damage(_llama3_rope_factors(llama, llama["rope_parameters"]))
    path = write_gguf(tmp_path / arch, tmp_path / f"{arch}-damaged.gguf", rope_freqs=wanted)
    with pytest.raises(ModelLoadError, match=f"rope_freqs.*{message}|{message}.*rope_freqs"):
        load(path, torch.float32, torch.device("cpu"))


@pytest.mark.skipif(not gguf_kernels.available(), reason="the GGUF block kernels did not build")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_converted_ggufs_attention_blocks_hold_its_dequantized_rows(arch: str, tmp_path: Path) -> None:
    """Every matrix Q8_0: with quantization="auto" the blocks stay as stored (Llama's Q/K rows moved back
    from llama.cpp's RoPE layout as whole rows of blocks) and dequantize to exactly the weights that
    quantization=None's dense load holds (which unpermutes after dequantizing)."""
    build_tiny(arch, tmp_path / arch, seed=6)
    path = write_gguf(tmp_path / arch, tmp_path / f"{arch}-q8_0.gguf", formats=lambda _: gguf.GGMLQuantizationType.Q8_0)
    dense = load(path, torch.float32, torch.device("cpu")).model
    auto = load(path, torch.float32, torch.device("cpu"), "auto").model
    for d, a in zip(dense.model.layers, auto.model.layers, strict=True):
        fused = a.self_attn.qkv
        assert isinstance(fused, GGUFFused)
        got = fused.merged.dequantized() if fused.merged is not None else torch.cat(
            [p.dequantized() for p in fused.parts])
        want = torch.cat([d.self_attn.q_proj.weight, d.self_attn.k_proj.weight, d.self_attn.v_proj.weight])
        torch.testing.assert_close(got, want, rtol=0, atol=0)


async def test_a_converted_tokenizer_holds_no_token_the_file_lacks(converted: dict[str, tuple[Path, Any]]) -> None:
    """transformers' byte-level conversion adds its class default "<|endoftext|>" where a vocabulary has
    none (Llama 3's, and these tiny ones): it is left out, so text spelling it is text, as in llama.cpp."""
    path, _ = converted["llama"]
    async with AsyncEngine.from_pretrained(path, dtype="float32", num_kv_blocks=64) as engine:
        assert len(engine.tokenizer) == TINY_VOCAB
        assert engine.tokenizer.convert_tokens_to_ids("<eos>") == 1  # the file's own specials stay
        out = await engine.generate("hello <|endoftext|> world", SamplingParams(max_tokens=2, ignore_eos=True))
    assert out.prompt_token_ids[0] == 0 and max(out.prompt_token_ids) < TINY_VOCAB
    assert len(out.prompt_token_ids) > 6  # the spelling came through as several text tokens


@pytest.mark.parametrize("pre", ["smollm", "starcoder"])
def test_a_digit_splitting_pre_tokenizer_splits_digits_as_llama_cpp_does(
        pre: str, converted: dict[str, tuple[Path, Any]], tmp_path: Path) -> None:
    """llama.cpp splits each digit alone before GPT-2's expression for these `tokenizer.ggml.pre` names (SmolLM's
    among them); transformers' conversion did not: "12" was one token of the tiny vocabulary's merges."""
    from transformers import AutoTokenizer

    hf_dir = converted["llama"][0].parent / "llama"
    path = write_gguf(hf_dir, tmp_path / f"llama-{pre}.gguf", tokenizer_pre=pre)
    tok = load(path, torch.float32, torch.device("cpu")).tokenizer
    text = "Numbers: 10 11 12 13"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert all(len(tok.decode([i]).strip()) <= 1 for i in ids if tok.decode([i]).strip().isdigit()), \
        [tok.decode([i]) for i in ids]
    assert tok.decode(ids) == text
    merged = AutoTokenizer.from_pretrained(hf_dir)(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(merged)  # the checkpoint's own tokenizer merges digits: the split is what changed
