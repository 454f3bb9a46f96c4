"""The Triton kernels against the torch backend: compiled on a CUDA GPU when there is one
(scripts/gpu_check.sh), else under Triton's interpreter on the CPU (TRITON_INTERPRET=1). Small
cases: the interpreter runs each program in Python."""

from __future__ import annotations

import os

import pytest
import torch

from asyncpage.guided.backend import apply_bitmask as torch_apply_bitmask
from asyncpage.model.attention import AttentionMetadata, PrefillChunk, paged_attention

# asyncpage.kernels is imported inside the tests, after this: @triton.jit reads the flag then.
CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = "cuda" if CUDA else "cpu"


def _batch(seqs: list[tuple[int, int]], bs: int, kvh: int, h: int, d: int, num_blocks: int, seed: int):  # type: ignore[no-untyped-def]
    """seqs: (num_computed, q_len) per sequence. Returns q, k, v, caches and metadata with cached
    history already in the pool (scattered over random blocks)."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, bs, kvh, d, generator=g)
    v_cache = torch.randn(num_blocks, bs, kvh, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    slots, prefills, dec_rows, dec_tables, dec_lens = [], [], [], [], []
    row = 0
    for nc, ql in seqs:
        n_blocks = -(-(nc + ql) // bs)
        table = [perm.pop() for _ in range(n_blocks)]
        slots += [table[p // bs] * bs + p % bs for p in range(nc, nc + ql)]
        if ql == 1:
            dec_rows.append(row)
            dec_tables.append(table)
            dec_lens.append(nc + 1)
        else:
            prefills.append(PrefillChunk(row, row + ql, nc, torch.tensor(table)))
        row += ql
    meta = AttentionMetadata(block_size=bs, slot_mapping=torch.tensor(slots), prefills=prefills)
    if dec_rows:
        width = max(len(t) for t in dec_tables)
        meta.decode_rows = torch.tensor(dec_rows)
        meta.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in dec_tables])
        meta.decode_context_lens = torch.tensor(dec_lens)
    q = torch.randn(row, h, d, generator=g)
    k = torch.randn(row, kvh, d, generator=g)
    v = torch.randn(row, kvh, d, generator=g)
    if CUDA:
        meta.slot_mapping = meta.slot_mapping.to(DEVICE)
        for p in meta.prefills:
            p.block_table = p.block_table.to(DEVICE)
        if meta.decode_rows is not None:
            meta.decode_rows = meta.decode_rows.to(DEVICE)
            meta.decode_block_tables = meta.decode_block_tables.to(DEVICE)  # type: ignore[union-attr]
            meta.decode_context_lens = meta.decode_context_lens.to(DEVICE)  # type: ignore[union-attr]
    return (q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), meta)


CASES = [
    # block size, head dim, (query heads, kv heads), window, sequences (num_computed, q_len)
    (16, 64, (4, 4), None, [(0, 1), (5, 1), (31, 1), (40, 20), (0, 23)]),  # GQA 1, chunk starts mid-block
    (32, 128, (4, 1), 8, [(3, 1), (70, 1), (0, 17), (33, 19)]),  # MQA (GQA 4), window inside a block
    (16, 256, (8, 1), 20, [(47, 1), (16, 1), (21, 18), (0, 40)]),  # GQA 8, window across block edges
    (16, 128, (8, 2), 16, [(15, 1), (16, 1), (17, 1), (5, 11)]),  # window == block size
]


@pytest.mark.parametrize(("bs", "d", "heads", "window", "seqs"), CASES)
def test_triton_paged_attention_matches_torch(bs: int, d: int, heads: tuple[int, int], window: int | None,
                                              seqs: list[tuple[int, int]]) -> None:
    from asyncpage.model.attention_triton import paged_attention as triton_attention

    h, kvh = heads
    q, k, v, kc, vc, meta = _batch(seqs, bs, kvh, h, d, num_blocks=24, seed=bs + d + h)
    scale = d**-0.5
    kc2, vc2 = kc.clone(), vc.clone()
    ref = paged_attention(q, k, v, kc, vc, meta, scale, window)
    meta.scratch.clear()
    got = triton_attention(q, k, v, kc2, vc2, meta, scale, window)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # the KV write by slot mapping
    # TF32 dot products on a GPU: a looser bound there.
    tol = 2e-2 if CUDA else 2e-4
    assert torch.allclose(got, ref, atol=tol, rtol=1e-3), (got - ref).abs().max()


def test_triton_block_copy_copies_every_layer() -> None:
    from asyncpage.kernels.cache_ops import copy_blocks

    caches = [(torch.randn(6, 16, 2, 64, device=DEVICE), torch.randn(6, 16, 2, 64, device=DEVICE)) for _ in range(2)]
    expected = [(k.clone(), v.clone()) for k, v in caches]
    for k, v in expected:
        k[4], v[4], k[1], v[1] = k[0], v[0], k[3], v[3]
    copy_blocks(caches, [(0, 4), (3, 1)])
    for (k, v), (ek, ev) in zip(caches, expected, strict=True):
        assert torch.equal(k, ek) and torch.equal(v, ev)


def test_triton_bitmask_matches_torch_on_a_ragged_vocabulary() -> None:
    from asyncpage.kernels.bitmask import apply_bitmask

    vocab = 1000 + 17  # not a multiple of 32: the mask is sized to the logits width
    logits = torch.randn(3, vocab, device=DEVICE)
    mask = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32, device=DEVICE)
    ref = logits.cpu()
    torch_apply_bitmask(ref, mask.cpu())
    apply_bitmask(logits, mask)
    assert torch.equal(logits.cpu(), ref)


@pytest.mark.heavy  # ~100 s interpreted: `make test-heavy`
async def test_engine_with_triton_attention_matches_transformers_on_the_default_model(
        default_engine_unstarted, reference) -> None:  # type: ignore[no-untyped-def]
    """The default model through every Triton kernel (interpreted): transformers' first greedy tokens
    for two short prompts and the 709-token one (chunked at 256, past the sliding window)."""
    import asyncio

    from asyncpage import SamplingParams

    if CUDA:
        pytest.skip("on a GPU scripts/gpu_check.sh runs the engine with both backends")
    engine = default_engine_unstarted.clone(max_num_batched_tokens=256, num_kv_blocks=128, attention_backend="triton")
    assert engine.config.attention_backend == "triton"
    cases = [reference["cases"][0], reference["cases"][3], reference["cases"][8]]
    assert len(cases[2]["prompt_token_ids"]) == 709
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    async with engine:
        outs = await asyncio.gather(*(engine.generate(c["prompt_token_ids"], params) for c in cases))
    assert [o.token_ids for o in outs] == [c["greedy_token_ids"][:4] for c in cases]


_COMPILE_FOR_CUDA = r'''
import importlib.util, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton._C.libtriton import ir
spec = importlib.util.spec_from_file_location("ak", sys.argv[1])
ak = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ak)
target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
opts = backend.parse_options({})
def ttir(fn, sig, consts):
    ctx = ir.context(); ir.load_dialects(ctx); backend.load_dialects(ctx)
    ASTSource(fn=fn, signature=sig, constexprs=consts).make_ir(
        target, opts, backend.get_codegen_implementation(opts), backend.get_module_map(), ctx)
P, I, L = "*fp32", "i32", "*" + sys.argv[2]
strides = lambda names: {k: I for k in names.split()}
decode = dict(q_ptr=P, k_ptr=P, v_ptr=P, out_ptr=P, bt_ptr="*i32", ctx_ptr=L, ks_ptr=P, vs_ptr=P,
              **strides("stride_qb stride_qh stride_kb stride_kt stride_kh stride_ob stride_oh stride_bt stride_sb "
                        "stride_st"), scale="fp32", window=I, G="constexpr", G_PAD="constexpr", D="constexpr",
              BS="constexpr", QUANT="constexpr")
prefill = dict(q_ptr=P, k_ptr=P, v_ptr=P, out_ptr=P, bt_ptr="*i32", qstart_ptr=L, qlen_ptr=L, ncomp_ptr=L, ks_ptr=P,
               vs_ptr=P, **strides("stride_qt stride_qh stride_kb stride_kt stride_kh stride_ot stride_oh stride_bt "
                                   "stride_sb stride_st"), scale="fp32", window=I, G="constexpr", D="constexpr",
               BS="constexpr", BM="constexpr", QUANT="constexpr")
for quant in (False, True):
    ttir(ak._decode_kernel, decode, {"G": 4, "G_PAD": 16, "D": 64, "BS": 16, "QUANT": quant})
    ttir(ak._prefill_kernel, prefill, {"G": 4, "D": 64, "BS": 16, "BM": 64, "QUANT": quant})
print("ok")
'''


@pytest.mark.parametrize("lengths", ["i64", "i32"])
def test_the_attention_kernels_compile_for_a_cuda_gpu(lengths: str) -> None:
    # The interpreter the CPU tests run takes what compiled Triton refuses (a variable whose type a branch
    # changes: both kernels died on the first GPU run): their front end, for an sm90 target, with no GPU.
    import subprocess
    import sys
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "kernels" / "attention_kernels.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE_FOR_CUDA, str(src), lengths], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
