"""quantization="int8" | "int4" where the GGUF block kernels run (the CPU): float weights written as GGUF
blocks at load (gguf_quantize.py) and held as the only copy by the same layers a GGUF file's tensors get
(gguf_linear.py): Q8_0 for int8, Q4_K (Q5_0 where 256 does not divide a row) for int4's projections, Q8_0
for the head and embedding. The Q4_K writer is checked against gguf's own reader; a GGUF keeps its stored
blocks under either kind."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from asyncpage import AsyncEngine, SamplingParams
from asyncpage.errors import ModelLoadError
from asyncpage.model import gguf_kernels as gk
from asyncpage.model.gguf_kernels import GGMLType
from asyncpage.model.gguf_linear import GGUFEmbedding, GGUFFused, GGUFLinear, block_bytes
from asyncpage.model.gguf_quantize import LIMITS, quantize, target
from asyncpage.model.quant import dequantize_int4, quantize_int4
from asyncpage.model.weights import load
from tests.test_gguf_auto import tiny_quantized_gguf  # noqa: F401  (a fixture)
from tests.test_quantization import _prefill_logits

pytestmark = pytest.mark.skipif(not gk.available(), reason="the GGUF block kernels did not build")
Q = gguf.GGMLQuantizationType
CPU = torch.device("cpu")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _hard_rows(k: int) -> torch.Tensor:
    """Rows a quantizer gets wrong first: zeros, all positive, all negative, constant, tiny, huge, one outlier."""
    torch.manual_seed(1)
    rows = [torch.zeros(k), torch.rand(k) + 0.5, -(torch.rand(k) + 0.5), torch.full((k,), 0.25),
            torch.randn(k) * 1e-8, torch.randn(k) * 1e4, torch.randn(k) * 0.02]
    rows[-1][7] = 3.0
    return torch.stack(rows)


def test_int4_writes_q4_k_that_gguf_and_the_kernels_read_alike_and_as_close_as_min_max_groups() -> None:
    torch.manual_seed(0)
    w = torch.cat([torch.randn(33, 512) * 0.05, _hard_rows(512)])
    b = quantize(w, GGMLType.Q4_K)
    assert b.dtype == torch.uint8 and tuple(b.shape) == (40, 512 // 256 * 144)
    theirs = torch.from_numpy(gguf_dequantize(b.numpy(), Q.Q4_K)).reshape(w.shape)
    ours = gk.dequantize(b, int(GGMLType.Q4_K))
    assert torch.equal(ours, theirs)  # two readers of the same bytes
    # As close as the min/max groups of 32 int4 always used here (the 6-bit sub-block scales cost little).
    normal = slice(0, 33)
    ref_err = _rel(dequantize_int4(*quantize_int4(w[normal])), w[normal])
    assert _rel(ours[normal], w[normal]) < 1.1 * ref_err < 0.1
    zeros, pos, neg, const, tiny, huge, outlier = ours[33:]
    assert torch.equal(zeros, torch.zeros(512))
    for got, want in ((pos, w[34]), (neg, w[35]), (huge, w[38])):
        assert _rel(got, want) < 0.1
    assert torch.allclose(const, w[36], rtol=0.02)
    assert (tiny - w[37]).abs().max() < 1e-7  # fp16 has no d of ~1e-11: such a row reads as (about) zeros
    assert abs(float(outlier[7]) - 3.0) < 0.1 and _rel(outlier, w[39]) < 0.3


@pytest.mark.parametrize("std", [1e-5, 5e-6, 1e-6])
def test_q4_k_of_small_weights_and_of_quiet_sub_blocks_beside_a_loud_one_is_not_worse_than_zeros(std: float) -> None:
    torch.manual_seed(2)
    w = torch.randn(16, 512) * std  # fp16 holds no d of max-scale / 63 here: floored at its smallest subnormal
    assert _rel(gk.dequantize(quantize(w, GGMLType.Q4_K), int(GGMLType.Q4_K)), w) < 0.15
    loud = torch.randn(16, 256) * 0.01
    loud[:, :32] *= 300  # one sub-block 300x the others: theirs round to sc = 0 unless given a step
    got = gk.dequantize(quantize(loud, GGMLType.Q4_K), int(GGMLType.Q4_K))
    assert _rel(got[:, 32:], loud[:, 32:]) < 0.9 and _rel(got[:, :32], loud[:, :32]) < 0.1


@pytest.mark.parametrize(("fmt", "bound"), [(GGMLType.Q8_0, 0.01), (GGMLType.Q5_0, 0.05), (GGMLType.Q4_0, 0.1)])
def test_the_32_value_formats_are_ggufs_own_quantizers_bit_for_bit(fmt: GGMLType, bound: float) -> None:
    torch.manual_seed(0)
    ties = torch.tensor([1.0, -1.0, 0.5, -0.5] * 24)  # equal magnitudes (Q5_0 takes the first) and halves
    w = torch.cat([torch.randn(20, 96) * 0.1, _hard_rows(96), ties[None], torch.arange(96.0)[None] / 7 - 6])
    b = quantize(w, fmt)  # Q8_0 / Q5_0 in torch (multithreaded), Q4_0 gguf's numpy itself
    assert torch.equal(b, torch.from_numpy(gguf.quants.quantize(w.numpy(), Q(int(fmt)))))
    assert _rel(gk.dequantize(b, int(fmt))[:20], w[:20]) < bound


def test_a_weight_quantizers_refuse_name_what_is_wrong() -> None:
    w = torch.randn(8, 64)
    w[5, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite values"):
        quantize(w, GGMLType.Q8_0)
    for fmt in (GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.Q4_K):  # past the fp16 scales: it would read back as NaN
        big = torch.randn(4, 256)
        big[2, 9] = 1.01 * LIMITS[fmt]
        with pytest.raises(ValueError, match=f"past the .* that {fmt.name}'s fp16 scales hold"):
            quantize(big, fmt)
        big[2, 9] = 0.99 * LIMITS[fmt]
        assert bool(torch.isfinite(gk.dequantize(quantize(big, fmt), int(fmt))).all())
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(torch.randn(4, 96), GGMLType.Q4_K)
    with pytest.raises(ValueError, match="int8"):
        target("int2", 64)
    assert target("int4", 512) == GGMLType.Q4_K and target("int4", 96) == GGMLType.Q5_0
    assert target("int4", 512, edge=True) == target("int8", 512) == GGMLType.Q8_0
    assert target("int8", 40) is None  # no block divides a 40-value row: the tensor stays float


def _tiny_dir(tmp_path: Path, arch: str, intermediate: int) -> Path:
    """A tiny HF model whose down projection has rows of `intermediate` values (256: Q4_K under int4)."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import _tiny_tokenizer, tiny_config

    torch.manual_seed(3)
    config = tiny_config(arch)
    config.intermediate_size = intermediate
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.save_pretrained(tmp_path)
    _tiny_tokenizer(tmp_path)
    (tmp_path / "asyncpage-test.json").write_text(json.dumps({"arch": arch}))
    return tmp_path


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # untied head; tied head and QKV bias
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_float_checkpoint_quantized_at_load_holds_gguf_blocks_and_no_dense_projection(
        arch: str, kind: str, tmp_path: Path) -> None:
    path = _tiny_dir(tmp_path, arch, 256)
    ids = [0, 5, 9, 13, 40, 41, 42, 7, 100, 101, 3, 17]
    ref = _prefill_logits(load(path, torch.float32, CPU).model, ids)
    model: Any = load(path, torch.float32, CPU, quantization=kind).model
    r8 = gk.default_form() != "portable"  # the 32-value formats' rows repacked by eight for the SIMD forms
    q8 = GGMLType.Q8_0_R8 if r8 else GGMLType.Q8_0
    assert isinstance(model.model.embed_tokens, GGUFEmbedding) and isinstance(model.lm_head, GGUFLinear)
    assert model.lm_head.ggml_type == q8
    # An untied embedding keeps the stored layout (its lookups read rows; repacking serves products).
    assert model.model.embed_tokens.ggml_type == (q8 if arch == "qwen2" else GGMLType.Q8_0)
    assert (model.lm_head.qweight is model.model.embed_tokens.qweight) == (arch == "qwen2")  # tied: one copy
    down = GGMLType.Q4_K if kind == "int4" else q8  # rows of 256
    rest = (GGMLType.Q5_0_R8 if r8 else GGMLType.Q5_0) if kind == "int4" else q8  # rows of 64
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(attn.qkv, GGUFFused) and attn.qkv.merged is not None
        assert isinstance(mlp.gate_up, GGUFFused) and mlp.gate_up.merged is not None
        assert attn.qkv.merged.ggml_type == mlp.gate_up.merged.ggml_type == attn.o_proj.ggml_type == rest
        assert mlp.down_proj.ggml_type == down
        assert (attn.qkv.merged.bias is not None) == (arch == "qwen2")
    assert all(p.dim() == 1 for p in model.parameters())  # norms (and biases): no float matrix anywhere
    sizes = block_bytes(model)
    assert sizes["dense"] < 0.05 * sizes["blocks"]
    got = _prefill_logits(model, ids)
    rel = ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    print(f"\n{arch} {kind}: logits within {rel:.3f} of float32")
    assert rel < (0.05 if kind == "int8" else 0.6), rel  # as tests/test_quantization.py's torch layers


def test_a_gguf_keeps_its_stored_blocks_and_int8_writes_only_what_has_no_kernel(
        tiny_quantized_gguf: Path) -> None:  # noqa: F811
    auto: Any = load(tiny_quantized_gguf, torch.float32, CPU, quantization="auto").model
    int8: Any = load(tiny_quantized_gguf, torch.float32, CPU, quantization="int8").model
    for a, b in zip(auto.model.layers, int8.model.layers, strict=True):
        assert isinstance(a.mlp.down_proj, torch.nn.Linear)  # Q4_1 in the file: no kernel, dense under auto
        assert isinstance(b.mlp.down_proj, GGUFLinear)  # int8: written as Q8_0 instead
        for pa, pb in zip(a.self_attn.qkv.parts, b.self_attn.qkv.parts, strict=True):
            assert pa.ggml_type == pb.ggml_type and torch.equal(pa.qweight, pb.qweight)  # as stored
    assert torch.equal(auto.lm_head.qweight, int8.lm_head.qweight)


def test_a_non_finite_weight_in_a_checkpoint_is_a_load_error(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = _tiny_dir(tmp_path, "llama", 128)
    f = next(path.glob("*.safetensors"))
    state = load_file(str(f))
    state["model.layers.1.mlp.up_proj.weight"][3, 2] = float("inf")
    save_file(state, str(f), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"up_proj.*non-finite"):
        load(path, torch.float32, CPU, quantization="int8")


async def test_an_int4_engine_on_a_float_checkpoint_decodes_alike_alone_and_batched(tmp_path: Path) -> None:
    path = _tiny_dir(tmp_path, "llama", 256)
    engine = AsyncEngine.from_pretrained(path, quantization="int4", num_kv_blocks=64)
    prompts = ["The quick brown", "def add(a, b):", "Numbers: 0 1 2", "Paged attention keeps"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    async with engine:
        alone = [(await engine.generate(p, params)).token_ids for p in prompts]
        together = [o.token_ids for o in await asyncio.gather(*(engine.generate(p, params) for p in prompts))]
    assert together == alone and all(len(t) == 12 for t in alone)
