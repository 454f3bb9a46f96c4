"""quantization="auto" on a GGUF file: its quantized tensors stay in their block formats as the only
copy (gguf_linear.py), compute what the dequantized model computes, and a format without a kernel
falls back to a dense tensor for that tensor alone. Tiny Qwen2 GGUFs are written with gguf's own
quantizers (Q4_0, Q5_0, Q8_0; Q4_1 has no kernel here). Run with -s for the agreement figures."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from gguf.quants import quantize

from asyncpage import AsyncEngine, SamplingParams
from asyncpage.model import gguf_kernels
from asyncpage.model.attention import paged_attention
from asyncpage.model.batch import FlatBatch
from asyncpage.model.gguf_linear import KERNEL_ROWS, GGUFEmbedding, GGUFFused, GGUFLinear, block_bytes, unpadded_rows
from asyncpage.model.weights import load
from tests.gguf_writer import write_gguf
from tests.test_quantization import _prefill_logits

pytestmark = pytest.mark.skipif(not gguf_kernels.available(), reason="the GGUF block kernels did not build")

Q = gguf.GGMLQuantizationType
# GGUF tensor name part -> the format written: mixed within attention (V unlike Q/K: no merged QKV),
# one format for gate/up (merged), and a format without a kernel (down: Q4_1, the dense fallback).
TYPES = {"attn_q": Q.Q5_0, "attn_k": Q.Q5_0, "attn_v": Q.Q8_0, "attn_output": Q.Q4_0, "ffn_gate": Q.Q5_0,
         "ffn_up": Q.Q5_0, "ffn_down": Q.Q4_1, "token_embd": Q.Q8_0}


@pytest.fixture(scope="module")
def tiny_quantized_gguf(tiny_models: dict[str, tuple[Path, Any]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 (tied embeddings, QKV bias) as a GGUF whose matrices are quantized per TYPES."""

    def part(name: str) -> str:
        return name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]

    return write_gguf(tiny_models["qwen2"][0], tmp_path_factory.mktemp("gguf") / "tiny-q.gguf",
                      formats=lambda name: TYPES.get(part(name)))


def test_auto_keeps_each_quantized_tensor_in_its_blocks_and_no_dense_copy_of_a_projection(
        tiny_quantized_gguf: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="asyncpage"):
        model = load(tiny_quantized_gguf, torch.float32, torch.device("cpu"), quantization="auto").model
    said = [r.getMessage() for r in caplog.records if "no block kernel" in r.getMessage()]
    assert len(said) == 1 and "Q4_1" in said[0], said  # one line per format without a kernel
    assert all(r.levelno == logging.WARNING for r in caplog.records if "no block kernel" in r.getMessage())  # seen
    lm: Any = model
    assert isinstance(lm.model.embed_tokens, GGUFEmbedding)
    assert isinstance(lm.lm_head, GGUFLinear) and lm.lm_head.qweight is lm.model.embed_tokens.qweight  # one copy
    # Its rows repacked by eight where a SIMD form reads them so (the head and the lookups alike).
    head_type = Q.Q8_0 if gguf_kernels.default_form() == "portable" else gguf_kernels.GGMLType.Q8_0_R8
    assert lm.lm_head.ggml_type == lm.model.embed_tokens.ggml_type == head_type
    for layer in lm.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(attn.qkv, GGUFFused) and attn.qkv.merged is None  # Q5_0, Q5_0, Q8_0: each its own
        assert [type(p) for p in attn.qkv.parts] == [GGUFLinear] * 3
        assert isinstance(mlp.gate_up, GGUFFused) and mlp.gate_up.merged is not None  # both Q5_0: one call
        assert mlp.gate_proj is None and mlp.up_proj is None
        assert isinstance(attn.o_proj, GGUFLinear)
        # A 32-element format's rows repacked by eight where a SIMD form reads them so (Q4_0 here).
        assert attn.o_proj.ggml_type == (Q.Q4_0 if gguf_kernels.default_form() == "portable"
                                         else gguf_kernels.GGMLType.Q4_0_R8)
        assert isinstance(mlp.down_proj, torch.nn.Linear)  # Q4_1: no kernel, dense for that tensor alone
    # No floating-point tensor anywhere of a quantized projection's size: only norms, biases, and the
    # Q4_1 down projections.
    hidden, inter = lm.config.hidden_size, lm.config.intermediate_size
    for name, p in model.named_parameters():
        assert p.numel() <= hidden * inter, name
        assert p.dim() == 1 or name.endswith("down_proj.weight"), name
    for m in model.modules():
        if isinstance(m, (GGUFLinear, GGUFEmbedding)):
            assert m.qweight.dtype == torch.uint8
    sizes = block_bytes(model)
    assert sizes["dense"] == sum(p.numel() * p.element_size() for p in model.parameters())
    assert sizes["blocks"] > 0


# The block kernels; past KERNEL_ROWS dequantize + dense GEMM, or the interleaved kernels (VNNI, 32-element
# formats: GGUFLinear.kernel_rows).
@pytest.mark.parametrize("tokens", [KERNEL_ROWS, 12])
def test_auto_gives_the_dequantized_models_logits(tiny_quantized_gguf: Path, tokens: int) -> None:
    ids = [0, 5, 9, 13, 40, 41, 42, 7, 100, 101, 3, 17][:tokens]
    ref = _prefill_logits(load(tiny_quantized_gguf, torch.float32, torch.device("cpu")).model, ids)
    got = _prefill_logits(load(tiny_quantized_gguf, torch.float32, torch.device("cpu"), "auto").model, ids)
    rel = ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    print(f"{tokens} rows: max relative logit error {rel:.2e}")
    linears = [m for m in load(tiny_quantized_gguf, torch.float32, torch.device("cpu"), "auto").model.modules()
               if isinstance(m, GGUFLinear)]
    if all(tokens > m.kernel_rows for m in linears):
        # The same dequantized weights in a float32 GEMM: only summation order differs.
        assert rel < 1e-4, rel
    else:
        # The kernels round activations to int8 blocks of 32 (as llama.cpp does): about 1% a layer here.
        assert rel < 0.05, rel


@pytest.mark.parametrize("rows", [1, 3, KERNEL_ROWS, KERNEL_ROWS + 1, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gguf_linear_computes_its_dequantized_weight_at_any_row_count(rows: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 128, generator=g)
    layer = GGUFLinear((int(Q.Q8_0), torch.from_numpy(quantize(w.numpy(), Q.Q8_0)), 128), dtype,
                       bias=torch.randn(96, generator=g))
    x = torch.randn(rows, 128, generator=g).to(dtype)
    ref = torch.nn.functional.linear(x.float(), layer.dequantized().to(dtype).float(), layer.bias.float())
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 96)
    rel = ((got.float() - ref).norm() / ref.norm()).item()
    assert rel < (0.02 if dtype == torch.bfloat16 or rows <= layer.kernel_rows else 1e-5), rel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gguf_linear_past_its_kernel_rows_gives_the_dequantized_gemm_with_its_bias(dtype: torch.dtype) -> None:
    # Where the interleaved kernels take every row count (VNNI), the dense path is reached only past
    # kernel_rows (the K-quants past 48): the same layer with the bound lowered, a 3-d input.
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 128, generator=g)
    layer = GGUFLinear((int(Q.Q8_0), torch.from_numpy(quantize(w.numpy(), Q.Q8_0)), 128), dtype,
                       bias=torch.randn(96, generator=g))
    layer.kernel_rows = 4
    x = torch.randn(2, 5, 128, generator=g).to(dtype)
    got = layer(x)
    ref = torch.nn.functional.linear(x, layer.dequantized().to(dtype), layer.bias)
    assert got.dtype == dtype and got.shape == (2, 5, 96)
    exact = dtype == torch.float32
    assert torch.allclose(got, ref, atol=1e-5 if exact else 0.05, rtol=1e-4 if exact else 0.02)


@pytest.mark.parametrize("amx", [False, True])
def test_where_bfloat16_gemm_runs_on_amx_the_kernels_take_at_most_amx_rows(
        amx: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncpage.model.gguf_linear as gl

    monkeypatch.setattr(gl, "_amx", lambda: amx)
    w = torch.from_numpy(quantize(torch.randn(64, 256).numpy(), Q.Q5_0))
    for dtype in (torch.bfloat16, torch.float32):
        layer = GGUFLinear((int(Q.Q5_0), w, 256), dtype)
        free = layer.bound.max_rows or 1 << 62
        assert layer.kernel_rows == (min(free, gl.AMX_ROWS) if amx and dtype == torch.bfloat16 else free)
    # An LM head (float32 logits from a bfloat16 model) keeps the kernels at any row count: no bf16 rounding.
    head = GGUFLinear((int(Q.Q5_0), w, 256), torch.bfloat16, out_dtype=torch.float32)
    assert head.kernel_rows == (head.bound.max_rows or 1 << 62)


def test_the_head_splits_its_dense_path_into_tiles_with_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncpage.model.gguf_linear as gl

    w = torch.randn(1000, 64)
    layer = GGUFLinear((int(Q.Q8_0), torch.from_numpy(quantize(w.numpy(), Q.Q8_0)), 64), torch.float32)
    x = torch.randn(KERNEL_ROWS + 4, 64)
    whole = layer.dense_matmul(x)
    monkeypatch.setattr(gl, "TILE_BYTES", 64 * 4 * 96)  # tiles of 96 rows: 11 of them, the last short
    assert torch.allclose(layer.dense_matmul(x), whole, atol=1e-5)


def _step_length(exact_rows: int, tokens: int) -> int:
    flat = FlatBatch(16, 0, torch.device("cpu"), paged_attention, exact_rows)
    for i in range(tokens):  # one decode row per sequence
        flat.add([7], 3, [i])
    return len(flat.build()[0])


def test_a_step_is_padded_to_a_bucket_only_past_the_rows_every_projection_runs_its_block_kernel(
        tiny_quantized_gguf: Path) -> None:
    # The tiny GGUF keeps its Q4_1 down projections dense: its steps keep the buckets (13 rows -> 16).
    model: Any = load(tiny_quantized_gguf, torch.float32, torch.device("cpu"), "auto").model
    assert unpadded_rows(model.model) == 0
    assert _step_length(unpadded_rows(model.model), 13) == 16
    assert _step_length(unpadded_rows(model.model), KERNEL_ROWS) == KERNEL_ROWS
    # Every projection a block kernel: no padding up to the fewest rows any of them takes.
    g = torch.Generator().manual_seed(0)
    blocks = [(int(t), torch.from_numpy(quantize(torch.randn(64, 128, generator=g).numpy(), t)), 128)
              for t in (Q.Q8_0, Q.Q5_0, Q.Q4_0)]
    layers = torch.nn.ModuleList([GGUFLinear(b, torch.float32) for b in blocks])
    rows = unpadded_rows(layers)
    assert rows == min(m.kernel_rows for m in layers) >= KERNEL_ROWS
    assert _step_length(rows, 13) == (13 if rows >= 13 else 16)
    assert _step_length(rows, min(rows, 70)) == min(rows, 70)
    layers.append(torch.nn.Linear(128, 64))  # one dense projection beside them: buckets again
    assert unpadded_rows(layers) == 0


async def test_auto_engine_generates_as_the_dequantized_one_on_a_tiny_gguf(tiny_quantized_gguf: Path) -> None:
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = []
    for q in (None, "auto"):
        async with AsyncEngine.from_pretrained(tiny_quantized_gguf, dtype="float32", quantization=q) as engine:
            outs.append([(await engine.generate(p, params)).token_ids for p in ("The quick brown", "fox jumps")])
    agree = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
             for a, b in zip(*outs, strict=True)]
    print("greedy tokens agreeing before the first difference:", agree, "of 16")
    # A random tiny model's logits are nearly flat, so an int8 activation rounding can flip a near-tie
    # later on; the first tokens (a prefill's dense path, then the kernels) must agree.
    assert all(a >= 2 for a in agree), agree


def test_auto_on_float_weights_keeps_them_float(tiny_llama: Path) -> None:
    model = load(tiny_llama, torch.float32, torch.device("cpu"), quantization="auto").model
    assert not any(isinstance(m, (GGUFLinear, GGUFEmbedding)) for m in model.modules())
    ref = load(tiny_llama, torch.float32, torch.device("cpu")).model
    ids = [0, 5, 9, 13]
    assert torch.equal(_prefill_logits(model, ids), _prefill_logits(ref, ids))


def test_a_gguf_whose_tensor_shapes_disagree_with_its_metadata_is_refused_at_load(tiny_quantized_gguf: Path) -> None:
    from asyncpage.model import weights
    from asyncpage.model.gguf import _read_gguf

    for name, cut in (("model.layers.0.self_attn.q_proj.weight", "rows"), ("model.embed_tokens.weight", "rows"),
                      ("mlp", "k")):
        blocks: dict[str, Any] = {}
        config, state, _, _ = _read_gguf(tiny_quantized_gguf, blocks)
        name = name if name in blocks else next(n for n in sorted(blocks) if name in n)  # one in its blocks
        ggml_type, data, k = blocks[name]
        blocks[name] = (ggml_type, data[: data.shape[0] // 2], k) if cut == "rows" else (ggml_type, data, k // 2)
        with pytest.raises(ValueError, match="checkpoint shape"):  # load() gives it as ModelLoadError
            weights._build(config, state, torch.float32, torch.device("cpu"), None, {}, blocks, None)
