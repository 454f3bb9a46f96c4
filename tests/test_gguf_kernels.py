"""The GGUF block kernels (asyncpage/model/gguf_kernels.py, kernels/gguf_quants.c): each format and each
form this CPU runs (VNNI, AVX2, portable, forced) against a reference built from the `gguf` package's own
(de)quantizers: the weights dequantized by gguf, the activations rounded to int8 blocks as the kernels
do (scale max|x| / 127 per block of 32, or of 256 for the K-quants), their product in float64.

Tolerance: the kernels' integer sums are exact, so what is left is float32 rounding of the block scales'
products and of the sum over blocks: |out - ref| <= 1e-6 * (|x_q| @ |w|^T) elementwise (the sum of the
magnitudes; the largest seen here was 6.6e-8 of it). The activation rounding itself (against float x) is
what the model sees: 0.6-0.9% of the outputs' norm here, bounded at 3%."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from asyncpage.model import gguf_kernels as gk

pytestmark = pytest.mark.skipif(not gk.available(), reason="no C compiler for the native kernels")

T = gguf.GGMLQuantizationType
TYPES = [T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
N = 37  # output rows: not a multiple of any chunk


def _k(t: T) -> int:
    return 512 if gk.BLOCKS[gk.GGMLType(t)][0] == 256 else 640


def _weights(t: T, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw blocks [n, row bytes]: gguf's quantizer where it has one (Q4_0, Q5_0, Q8_0); otherwise random
    bytes (every bit pattern is a valid K-quant block) with sane fp16 scales."""
    rng = np.random.default_rng(seed)
    if t in (T.Q4_0, T.Q5_0, T.Q8_0):
        return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), t)
    block, size = gk.BLOCKS[gk.GGMLType(t)]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)

    def half(lo: float, hi: float) -> np.ndarray:
        return rng.uniform(lo, hi, (n, k // block)).astype(np.float16).view(np.uint8).reshape(n, k // block, 2)

    if t == T.Q6_K:
        raw[:, :, 208:210] = half(1e-3, 1e-2)
    else:
        raw[:, :, 0:2] = half(1e-3, 1e-2)
        raw[:, :, 2:4] = half(1e-3, 1e-2)
    return raw.reshape(n, -1)


def _round(x: np.ndarray, block: int) -> np.ndarray:
    """x rounded to int8 blocks as the kernels round it, returned dequantized (float64)."""
    b = x.reshape(x.shape[0], -1, block)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(b * inv)
    return (q * (amax / np.float32(127)).astype(np.float32)).reshape(x.shape).astype(np.float64)


def _check(t: T, rows: int, form: str, n: int = N) -> None:
    k = _k(t)
    raw = _weights(t, n, k)
    w = gguf.quants.dequantize(raw, t).astype(np.float64)
    x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
    out = gk.matmul(torch.from_numpy(x), torch.from_numpy(raw), t, form=form).numpy()
    xq = _round(x, gk.BLOCKS[gk.GGMLType(t)][0])
    ref, bound = xq @ w.T, np.abs(xq) @ np.abs(w).T
    assert out.shape == (rows, n) and out.dtype == np.float32
    assert np.all(np.abs(out - ref) <= 1e-6 * bound), float((np.abs(out - ref) / bound).max())
    exact = x.astype(np.float64) @ w.T  # what rounding the activations costs, against float x
    assert np.linalg.norm(out - exact) <= 0.03 * np.linalg.norm(exact)


@pytest.mark.parametrize("form", gk.forms())
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_matmul_matches_the_dequantized_weights_in_every_form(t: T, form: str) -> None:
    for rows in (1, 3, 8, 64):
        _check(t, rows, form)


@pytest.mark.parametrize("form", gk.forms())
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_a_decode_steps_rows_each_get_the_bits_of_a_one_row_call(t: T, form: str) -> None:
    # Up to 8 activation rows (a decode step, a speculative verify of up to 7 drafts) every output has the
    # bits a one-row call gives it: greedy speculation must reproduce one-token steps exactly.
    raw = torch.from_numpy(_weights(t, N, _k(t), seed=3))
    x = torch.from_numpy(np.random.default_rng(8).standard_normal((8, _k(t))).astype(np.float32))
    one = torch.cat([gk.matmul(x[r : r + 1], raw, t, form=form) for r in range(8)])
    for rows in range(2, 9):
        assert torch.equal(gk.matmul(x[:rows], raw, t, form=form), one[:rows]), rows


@pytest.mark.skipif("avx2" not in gk.forms(), reason="the AVX2 form's tiles")
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_in_the_avx2_form_every_row_count_it_takes_gives_each_row_its_one_row_bits(t: T) -> None:
    # The AVX2 form takes up to Bound.max_rows rows (48 for the K-quants): its four-row tiles give each row the
    # bits of a one-row call there too, so wide decode steps and verifies compute what single steps do.
    raw = torch.from_numpy(_weights(t, 40, _k(t), seed=5))  # rows in whole groups of eight: repacked
    kind = gk.repack8(raw, t)  # the 32-element formats as the engine holds them in the SIMD forms; K-quants as stored
    rows = gk.Bound(raw, kind, form="avx2").max_rows or 64
    assert rows >= 48
    x = torch.from_numpy(np.random.default_rng(9).standard_normal((rows, _k(t))).astype(np.float32))
    one = torch.cat([gk.matmul(x[r : r + 1], raw, kind, form="avx2") for r in range(rows)])
    for n in (9, 16, 33, rows):
        assert torch.equal(gk.matmul(x[:n], raw, kind, form="avx2"), one[:n]), n


@pytest.mark.skipif("vnni" not in gk.forms(), reason="the interleaved path is the VNNI form's")
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_the_interleaved_path_past_eight_rows_matches_the_reference_at_ragged_shapes(t: T) -> None:
    # Past 8 rows every format unpacks 8 weight rows at a time and takes activation rows 8 (4 for the
    # K-quants) at a time: weight rows 1, 8, 9 and 37 (a short last group), activation rows 9, 15 and 40,
    # and a long k (the scratch tile of 8 rows: 128 blocks of 32, 16 of 256).
    for n in (1, 8, 9, N):
        for rows in (9, 15, 40):
            _check(t, rows, "vnni", n=n)
    k = 4096
    raw = _weights(t, 12, k)
    w = gguf.quants.dequantize(raw, t).astype(np.float64)
    x = np.random.default_rng(0).standard_normal((11, k)).astype(np.float32)
    out = gk.matmul(torch.from_numpy(x), torch.from_numpy(raw), t, form="vnni").numpy()
    xq = _round(x, gk.BLOCKS[gk.GGMLType(t)][0])
    assert np.all(np.abs(out - xq @ w.T) <= 1e-6 * (np.abs(xq) @ np.abs(w).T))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_a_long_matrix_at_decode_rows_gives_every_output_row_in_its_longer_chunks(t: T) -> None:
    # At up to 4 activation rows a long matrix (an LM head) is handed out in longer chunks of rows; 9,001
    # rows: several sizes of chunk, the last one ragged; at 1 and 2 rows read one weight row at a time, at 4 in
    # tiles of weight rows.
    for rows in (1, 2, 4):
        _check(t, rows, gk.default_form(), n=9001)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_get_rows_dequantizes_only_the_rows_asked_for(t: T) -> None:
    k = _k(t)
    raw = _weights(t, N, k, seed=3)
    w = gguf.quants.dequantize(raw, t)
    ids = torch.tensor([[5, 0], [36, 5]])
    got = gk.get_rows(ids, torch.from_numpy(raw), t)
    assert got.shape == (2, 2, k)
    np.testing.assert_allclose(got.numpy(), w[ids.numpy()], rtol=1e-6, atol=1e-7)
    with pytest.raises(IndexError):
        gk.get_rows(torch.tensor([N]), torch.from_numpy(raw), t)


def test_k_not_a_multiple_of_the_block_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        gk.row_bytes(T.Q4_K, 640)
    # 640 values of Q4_K would be 2.5 blocks a row: a weight of such rows is refused, not read past.
    w = torch.zeros(4, 360, dtype=torch.uint8)
    with pytest.raises(ValueError, match="whole blocks of 144 bytes"):
        gk.matmul(torch.zeros(1, 640), w, T.Q4_K)
    with pytest.raises(ValueError, match=r"\[rows, 512\]"):
        gk.matmul(torch.zeros(1, 640), torch.zeros(4, 288, dtype=torch.uint8), T.Q4_K)
    with pytest.raises(ValueError, match="no GGUF kernel"):
        gk.matmul(torch.zeros(1, 256), torch.zeros(4, 256, dtype=torch.uint8), T.Q2_K)


R8 = {T.Q4_0: gk.GGMLType.Q4_0_R8, T.Q5_0: gk.GGMLType.Q5_0_R8, T.Q8_0: gk.GGMLType.Q8_0_R8}


@pytest.mark.skipif("avx2" not in gk.forms(), reason="the SIMD forms read rows repacked by eight")
@pytest.mark.parametrize("t", list(R8), ids=lambda t: t.name)
def test_rows_repacked_by_eight_give_each_row_the_bits_of_a_one_row_call_at_any_row_count(
        t: T, monkeypatch: pytest.MonkeyPatch) -> None:
    # A 32-element format's weight repacked at load (gk.repack8): every row count, a verify's 8 and a batch's 40
    # included, gives each output row what a one-row call gives it, within the reference's bound, in each SIMD
    # form and the same bits in both; lookups and the dequantized weight are the file's values exactly. 72 rows:
    # 9 groups of 8.
    monkeypatch.setenv("ASYNCPAGE_GGUF_FORM", "avx2")  # repacked where only AVX2 runs too
    raw = _weights(t, 72, 640, seed=5)
    packed = torch.from_numpy(raw.copy())
    rt = gk.repack8(packed, t)
    assert rt == R8[t]
    assert not torch.equal(packed, torch.from_numpy(raw))  # the same bytes, rearranged in place
    if t == T.Q8_0:
        assert sorted(packed.reshape(-1).tolist()) == sorted(raw.reshape(-1).tolist())
    w = gguf.quants.dequantize(raw, t).astype(np.float64)
    x = np.random.default_rng(4).standard_normal((40, 640)).astype(np.float32)
    xt = torch.from_numpy(x)
    xq = _round(x, 32)
    forms = [f for f in ("avx2", "vnni") if f in gk.forms()]
    ones = {f: torch.cat([gk.matmul(xt[r : r + 1], packed, rt, form=f) for r in range(40)]) for f in forms}
    for f, one in ones.items():
        assert np.all(np.abs(one.numpy() - xq @ w.T) <= 1e-6 * (np.abs(xq) @ np.abs(w).T)), f
        assert torch.equal(one, ones[forms[0]])  # the same integers, the same float order: the same bits
        for rows in (2, 5, 8, 9, 16, 40):
            assert torch.equal(gk.matmul(xt[:rows], packed, rt, form=f), one[:rows]), (f, rows)
    ids = torch.tensor([0, 7, 8, 71, 33])
    assert torch.equal(gk.get_rows(ids, packed, rt), gk.get_rows(ids, torch.from_numpy(raw), t))
    assert torch.equal(gk.dequantize(packed, rt), gk.dequantize(torch.from_numpy(raw), t))
    assert torch.equal(torch.ops.asyncpage.gguf_matmul(xt[:3], packed, int(rt)), ones["avx2"][:3])
    with pytest.raises(ValueError, match="AVX2 forms only"):  # the portable form refuses it, never misreads
        gk.matmul(xt[:1], packed, rt, form="portable")
    with pytest.raises(ValueError, match="AVX2 forms only"):
        gk.Bound(packed, rt, form="portable")


@pytest.mark.skipif("avx2" not in gk.forms(), reason="the SIMD forms read rows repacked by eight")
@pytest.mark.parametrize("t", list(R8), ids=lambda t: t.name)
def test_repacked_rows_at_their_extreme_values_sum_without_saturating(t: T) -> None:
    # The largest products each form's integer dot meets (AVX2's vpmaddubsw sums pairs into int16): every Q8_0 value
    # -128 or 127, every Q4_0 / Q5_0 nibble and fifth bit set or clear, activations all +-127 after rounding: the
    # same bits in both forms and at every row count, exactly the float64 products of the rounded values.
    block, size = gk.BLOCKS[gk.GGMLType(t)]
    raw = np.zeros((16, 640 // block, size), dtype=np.uint8)
    raw[:, :, 0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)  # d = 1
    raw[:8, :, 2:] = 0x80 if t == T.Q8_0 else 0x00  # -128, or the format's most negative value
    raw[8:, :, 2:] = 0x7F if t == T.Q8_0 else 0xFF  # 127, or its largest
    raw = raw.reshape(16, -1)
    w = gguf.quants.dequantize(raw, t).astype(np.float64)
    packed = torch.from_numpy(raw.copy())
    rt = gk.repack8(packed, t)
    x = torch.full((9, 640), 1.0)
    x[1::2] *= -1
    ref = torch.from_numpy(np.sign(x.numpy()).astype(np.float64) * 127 @ w.T / 127)
    for f in [f for f in ("avx2", "vnni") if f in gk.forms()]:
        one = torch.cat([gk.matmul(x[r : r + 1], packed, rt, form=f) for r in range(9)])
        assert torch.equal(gk.matmul(x, packed, rt, form=f), one)
        assert torch.equal(one.double(), ref), f


def test_repack8_leaves_what_it_does_not_repack_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    # Another format, rows not a multiple of 8, or the portable form in use: the bytes and the type unchanged.
    cases = [(T.Q4_K, 64), (T.Q6_K, 64), (T.Q8_0, 37), (T.Q5_0, 12)]
    monkeypatch.setenv("ASYNCPAGE_GGUF_FORM", "portable")
    cases.append((T.Q8_0, 64))
    for t, n in cases:
        raw = _weights(t, n, 640)
        w = torch.from_numpy(raw.copy())
        assert gk.repack8(w, t) == t and torch.equal(w, torch.from_numpy(raw)), (t, n)


def test_the_form_can_be_forced_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCPAGE_GGUF_FORM", "portable")
    assert gk.default_form() == "portable"
    monkeypatch.setenv("ASYNCPAGE_GGUF_FORM", "sse9")
    with pytest.raises(ValueError, match="unknown kernel form"):
        gk.default_form()
    monkeypatch.delenv("ASYNCPAGE_GGUF_FORM")
    assert gk.default_form() == gk.forms()[-1]


def test_a_row_with_a_nan_gives_nan_only_in_its_own_outputs() -> None:
    raw = torch.from_numpy(_weights(T.Q8_0, N, 640))
    x = torch.randn(3, 640)
    x[1, 7] = float("nan")
    out = gk.matmul(x, raw, T.Q8_0)
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any()


def test_the_torch_operator_matches_the_function() -> None:
    raw = torch.from_numpy(_weights(T.Q5_0, N, 640))
    x = torch.randn(2, 640)
    torch.testing.assert_close(torch.ops.asyncpage.gguf_matmul(x, raw, int(T.Q5_0)), gk.matmul(x, raw, T.Q5_0))
    assert torch.ops.asyncpage.gguf_get_rows(torch.tensor([1]), raw, int(T.Q5_0)).shape == (1, 640)


@pytest.mark.parametrize("form", gk.forms())
@pytest.mark.parametrize(("t", "repacked"), [*((t, False) for t in TYPES), *((t, True) for t in R8)],
                         ids=lambda v: v.name if isinstance(v, T) else ("repacked" if v else "as stored"))
def test_the_lm_heads_greedy_search_is_what_max_finds_in_the_outputs(t: T, repacked: bool, form: str) -> None:
    # Bound.with_max: each output row's maximum and first index, found by the threads as they write the outputs,
    # equal to torch's max(dim=-1) over what is returned: 9,001 outputs (many chunks, the last ragged) at 1 to 8
    # rows, one row all zeros (every output ties: index 0), one holding NaN (NaN counts as the maximum), and the
    # best weight row copied to row 0 and to the last (a tie: the first index).
    k, n = _k(t), 9001 - 9001 % 8
    raw = torch.from_numpy(_weights(t, n, k, seed=9))
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((8, k)).astype(np.float32))
    best = int(gk.matmul(x[:1], raw, t).argmax())
    raw[0], raw[-1] = raw[best].clone(), raw[best].clone()
    x[3], x[5, 7] = 0.0, float("nan")
    kind: int = t
    if repacked:
        if form == "portable":
            pytest.skip("rows repacked by eight are read by the SIMD forms only")
        kind = gk.repack8(raw, t)
        assert kind == R8[t]
    bound = gk.Bound(raw, kind, form=form)
    for rows in range(1, 9):
        out, found = bound.with_max(x[:rows])
        assert found is not None
        torch.testing.assert_close(out, bound(x[:rows]), rtol=0, atol=0, equal_nan=True)
        vals, idx = out.max(dim=-1)
        assert torch.equal(found[1], idx) and torch.allclose(found[0], vals, equal_nan=True), rows
    assert int(bound.with_max(x[:1])[1][1][0]) == 0  # type: ignore[index]
    assert bound.with_max(x.repeat(2, 1))[1] is None  # 16 rows: past SEARCH_ROWS, the sampler searches
