"""The fused decode step (asyncpage.model.native_step, kernels/cpu_forward.c): a decode step of 1..8 rows (up to 32
in the VNNI and AVX2 forms)
through the whole stack in one native call gives what the model's eager forward gives on the same
GGUF blocks: the same hidden states (after the final norm) and the same K/V written into the pool.

Models: the tiny random configs of every family (conftest.py) with their projections and embedding
as GGUF blocks made by the `gguf` package's own quantizers (Q4_0, Q5_0, Q8_0), and wider ones
(hidden 256) for the K-quants (random blocks with sane scales: gguf has no K-quant quantizer), each in
every kernel form this CPU runs (ASYNCPAGE_GGUF_FORM). Steps: rows of different lengths on scattered
block tables, one sharing a block with another, contexts past Gemma's and Mistral's sliding window,
blocks of 16 and of 4 slots, and a pool already full of other values (attention reads only what its
table and window say)."""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
import pytest
import torch

from asyncpage.model import gguf_kernels, native_step
from asyncpage.model.attention import paged_attention
from asyncpage.model.batch import FlatBatch
from asyncpage.model.weights import _build
from tests.conftest import ARCHS, tiny_config

pytestmark = pytest.mark.skipif(not native_step.available(), reason="the fused step's kernels did not build")

Q = gguf.GGMLQuantizationType
# Per projection: V unlike Q/K (no merged QKV), gate and up alike (one merged call), the rest mixed.
SMALL = {"q_proj": Q.Q5_0, "k_proj": Q.Q5_0, "v_proj": Q.Q8_0, "o_proj": Q.Q4_0, "gate_proj": Q.Q5_0,
         "up_proj": Q.Q5_0, "down_proj": Q.Q8_0, "embed_tokens": Q.Q8_0, "lm_head": Q.Q8_0}
# What Q4_K_M files hold (Q4_K attention output, Q6_K down, Q4_K / Q5_K elsewhere), at hidden 256.
KQUANTS = {"q_proj": Q.Q4_K, "k_proj": Q.Q4_K, "v_proj": Q.Q6_K, "o_proj": Q.Q4_K, "gate_proj": Q.Q5_K,
           "up_proj": Q.Q5_K, "down_proj": Q.Q6_K, "embed_tokens": Q.Q8_0, "lm_head": Q.Q6_K}


def blocks_of(w: torch.Tensor, t: Q, seed: int) -> torch.Tensor:
    """w as GGUF blocks uint8 [rows, row bytes]: gguf's quantizer where it has one, else random K-quant
    blocks (every bit pattern is valid) with small fp16 scales."""
    if t in (Q.Q4_0, Q.Q5_0, Q.Q8_0):
        return torch.from_numpy(gguf.quants.quantize(w.float().numpy(), t))
    rng = np.random.default_rng(seed)
    block, size = gguf_kernels.BLOCKS[gguf_kernels.GGMLType(t)]
    n, k = w.shape
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    scale = rng.uniform(2e-4, 1e-3, (n, k // block, 2)).astype(np.float16).view(np.uint8)
    if t == Q.Q6_K:
        raw[:, :, 208:210] = scale[:, :, 0:2]
    else:
        raw[:, :, 0:4] = scale.reshape(n, k // block, 4)
    return torch.from_numpy(raw.reshape(n, -1))


def hf_model(arch: str, wide: bool = False, seed: int = 0) -> Any:
    """A random transformers model of `arch` (conftest's tiny config; `wide`: hidden 256, for K-quants)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch)
    if wide:
        config.hidden_size, config.intermediate_size = 256, 512
        config.head_dim = 64
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif "bias" in name:
                p.normal_(0, 0.1)
    return model


def gguf_model(hf: Any, types: dict[str, Q], dtype: torch.dtype = torch.float32) -> Any:
    """hf's weights loaded as `quantization="auto"` loads a GGUF: the projections and the embedding as
    blocks of `types` (the layers over them: gguf_linear.install), the rest dense; fused step on."""
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    blocks = {}
    tied = bool(getattr(hf.config, "tie_word_embeddings", False) or hf.config.model_type == "gemma3_text")
    for i, (name, w) in enumerate(list(state.items())):
        part = name.split(".")[-2] if "." in name else name
        if w.dim() == 2 and part in types and not (tied and part == "lm_head"):
            blocks[name] = (int(types[part]), blocks_of(w, types[part], i), int(w.shape[1]))
            del state[name]
    model: Any = _build(hf.config, state, dtype, torch.device("cpu"), None, {}, blocks)
    assert native_step.enable(model) and model.native is not None
    return model


# Rows as (context length, block table): lengths 1, one block exactly, several blocks past the
# window (8), a row sharing its first block with the previous one (a common prefix), scattered blocks.
ROWS = [(1, [5]), (16, [9]), (50, [2, 40, 41, 7]), (37, [2, 30, 3]), (23, [11, 12]), (3, [13]),
        (64, [20, 21, 22, 23]), (9, [24])]


def decode_step(model: Any, rows: list[tuple[int, list[int]]], caches: list[tuple[torch.Tensor, ...]],
                block: int, native: bool, seed: int = 0) -> torch.Tensor:
    """One decode step of `rows` (each its newest token at position length - 1) through the fused step
    or the eager forward; returns the hidden states."""
    flat = FlatBatch(block, 0, torch.device("cpu"), paged_attention)
    vocab = model.config.vocab_size
    for i, (n, table) in enumerate(rows):
        flat.add([(seed * 31 + i * 7 + 3) % vocab], n - 1, table)
    ids, pos, meta = flat.build()
    keep = model.native
    model.native = keep if native else None
    try:
        with torch.inference_mode():
            if native:
                assert model.native.applies(meta, len(rows), caches)
            return model(ids, pos, meta, caches).float()
    finally:
        model.native = keep


def pools(model: Any, blocks: int, block: int, dtype: torch.dtype, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(blocks, block, a.num_kv_heads, a.head_dim, generator=g).to(dtype) for _ in range(2))
            for a in (layer.self_attn for layer in model.model.layers)]


def compare(model: Any, rows: list[tuple[int, list[int]]], block: int = 16, dtype: torch.dtype = torch.float32,
            tol: float = 2e-4, blocks: int = 70, flips: int = 1) -> float:
    """The fused step against the eager forward, each on its own copy of one pool: hidden states and
    the K/V each row wrote (every other pool value untouched, bit for bit); returns the hidden states'
    largest relative error over the rows within `tol`.

    Each matrix input is rounded to int8, and the two paths compute its float value by different code
    (torch's vectorized tanh / exp vs libm, sums in another order): a value within a float rounding of
    a rounding tie (about 1 in 10^5) lands one int8 step apart, and that row then differs by about a
    percent. So `flips` rows of a step (one; one in eight of a wide step) may differ by up to FLIP (a rounding flip),
    the others by `tol`."""
    if block != 16:  # the same positions in blocks of `block` slots: each table entry becomes 16 / block
        rows = [(n, [b * (16 // block) + j for b in t for j in range(16 // block)]) for n, t in rows]
    eager_kv = pools(model, blocks * 16 // block, block, dtype)
    fused_kv = [tuple(t.clone() for t in kv) for kv in eager_kv]
    before = [tuple(t.clone() for t in kv) for kv in eager_kv]
    ref = decode_step(model, rows, eager_kv, block, native=False)
    got = decode_step(model, rows, fused_kv, block, native=True)
    err = ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).tolist()
    slots = [(table[(n - 1) // block], (n - 1) % block) for n, table in rows]
    for a, b, c in zip(eager_kv, fused_kv, before, strict=True):
        for x, y, z in zip(a, b, c, strict=True):
            for r, (blk, off) in enumerate(slots):
                xs, ys = x[blk, off].float(), y[blk, off].float()
                err[r] = max(err[r], ((xs - ys).norm() / xs.norm()).item())
                y[blk, off], z[blk, off] = x[blk, off], x[blk, off]  # the written slot, checked: as eager's
            assert torch.equal(x, y) and torch.equal(y, z)  # nothing else written, by either path
    flipped = [e for e in err if e >= tol]
    assert len(flipped) <= flips and all(e < FLIP for e in flipped), err
    return max((e for e in err if e < tol), default=0.0)


FLIP = 3e-2  # the most a row differs by after one activation lands one int8 step apart (see compare)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_fused_step_gives_the_eager_forwards_hidden_states_and_kv(arch: str) -> None:
    model = gguf_model(hf_model(arch), SMALL)
    for n in (1, 2, 5, 8):
        compare(model, ROWS[:n])
    compare(model, ROWS[2:3], block=4)  # one row over 13 blocks of 4
    compare(model, ROWS, block=4)


@pytest.mark.parametrize("form", ["portable", "avx2", "vnni"])
@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_the_fused_step_matches_in_every_kernel_form_with_k_quants(arch: str, form: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    if form not in gguf_kernels.forms():
        pytest.skip(f"this CPU does not run the {form} form")
    monkeypatch.setenv("ASYNCPAGE_GGUF_FORM", form)  # read by each GGUFLinear when it is built
    hf = hf_model(arch, wide=True)
    for types in (KQUANTS, SMALL):
        model = gguf_model(hf, types)
        assert {lin.bound.form for lin in model.modules() if hasattr(lin, "bound")} == \
            {gguf_kernels.FORMS.index(form)}
        for n in (1, 4, 8):
            compare(model, ROWS[:n])


WIDE = [(3 + (7 * i) % 29, [2 * i + 1, 2 * i + 2]) for i in range(native_step.WIDE_ROWS)]  # 32 rows, 64 blocks


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
@pytest.mark.parametrize("form", ["vnni", "avx2"])
def test_in_the_simd_forms_a_step_of_up_to_32_rows_is_fused_and_matches(arch: str, form: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    if form not in gguf_kernels.forms():
        pytest.skip(f"this CPU does not run the {form} form")
    monkeypatch.setenv("ASYNCPAGE_GGUF_FORM", form)
    hf = hf_model(arch, wide=True)
    for types in (KQUANTS, SMALL):
        model = gguf_model(hf, types)
        assert model.native.max_rows == native_step.WIDE_ROWS  # past 8 rows: the interleaved products
        for n in (16, native_step.WIDE_ROWS):  # multiples of 8: no padding rows in the test's batches
            compare(model, WIDE[:n], flips=n // 8)


def test_a_bfloat16_model_writes_a_bfloat16_pool_and_stays_near_its_eager_forward() -> None:
    """The fused step computes in float32 where the eager bfloat16 forward rounds every op's result to
    bfloat16: the two differ by bfloat16's rounding, not more."""
    model = gguf_model(hf_model("gemma3"), SMALL, torch.bfloat16)
    rel = compare(model, ROWS[:4], dtype=torch.bfloat16, tol=0.05)
    print(f"bfloat16: relative difference {rel:.2e}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_values_written_to_a_16_bit_pool_round_as_torch_rounds_them(dtype: torch.dtype) -> None:
    lib = native_step._lib()
    assert lib is not None
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4096, generator=g) * s for s in (1e-8, 1e-5, 1e-3, 1.0, 1e3, 6e4, 1e6)])
    x = torch.cat([x, torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 65504.0, 65519.0, 65520.0, 5.96e-8,
                                    2.98e-8, 2.99e-8, 6.1e-5, 6.09e-5])])
    out = torch.empty(x.numel(), dtype=torch.int16)
    lib.round16(x.data_ptr(), x.numel(), 1 if dtype == torch.bfloat16 else 2, out.data_ptr())
    assert torch.equal(out, x.to(dtype).view(torch.int16))
    nan = torch.tensor([float("nan")])
    lib.round16(nan.data_ptr(), 1, 1 if dtype == torch.bfloat16 else 2, out.data_ptr())
    assert torch.isnan(out[:1].view(dtype)).all()


def test_a_step_with_an_index_outside_the_pool_is_refused_and_writes_nothing() -> None:
    model = gguf_model(hf_model("qwen2"), SMALL)
    caches = pools(model, 8, 16, torch.float32)
    before = [tuple(t.clone() for t in kv) for kv in caches]
    with pytest.raises(IndexError):
        decode_step(model, [(20, [3, 8])], caches, 16, native=True)  # block 8 of a pool of 8
    assert all(torch.equal(x, y) for a, b in zip(caches, before, strict=True) for x, y in zip(a, b, strict=True))


def test_steps_the_fused_step_does_not_take_run_the_eager_forward() -> None:
    model = gguf_model(hf_model("llama"), SMALL)
    caches = pools(model, 70, 16, torch.float32)
    flat = FlatBatch(16, 0, torch.device("cpu"), paged_attention)
    flat.add([5, 6, 7], 0, [1])  # a prefill chunk
    flat.add([8], 9, [2])
    meta = flat.build()[2]
    assert not model.native.applies(meta, 4, caches)
    over = model.native.max_rows + 1  # past what it takes: 9 rows, or 33 in the VNNI and AVX2 forms
    rows = [(n, [i + 1]) for i, n in enumerate([3] * over)]
    flat = FlatBatch(16, 0, torch.device("cpu"), paged_attention)
    for n, t in rows:
        flat.add([1], n - 1, t)
    meta = flat.build()[2]
    assert not model.native.applies(meta, over, caches)
    quantized = [tuple(t.to(torch.int8) for t in kv) + (torch.ones(70, 16, 2),) * 2 for kv in caches]
    flat = FlatBatch(16, 0, torch.device("cpu"), paged_attention)
    flat.add([1], 3, [1])
    meta = flat.build()[2]
    assert not model.native.applies(meta, 1, quantized)  # an int8 pool (kv_cache_dtype="int8")
    assert model.native.applies(meta, 1, caches)
