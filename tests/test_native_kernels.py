"""asyncpage.model.native: the C kernels of the one-stream decode step give what torch's ops give, and
where they cannot be built the torch ops serve."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncpage.model import native
from asyncpage.model.attention import AttentionMetadata, decode_only_attention


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block", "window"), [
    (4, 1, 256, 16, None),  # the default model's shape: 4 query heads on one KV head
    (4, 1, 256, 16, 16),  # a sliding window inside the context
    (8, 2, 64, 4, None),
    (4, 4, 32, 1, 7),  # no grouping, blocks of one slot
])
def test_decode_rows_attend_over_any_block_tables_as_torchs_gather_and_mask(
        heads: int, kv_heads: int, dim: int, block: int, window: int | None) -> None:
    """Rows of several lengths (1, one block exactly, a shared first block, scattered blocks)
    against the torch path that gathers each row's blocks and masks them."""
    kernels = native.load()
    assert kernels is not None
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(64, block, kv_heads, dim, generator=gen) for _ in range(2))
    lens = [1, block, 3 * block + 2, 2 * block + 1]
    need = [-(-n // block) for n in lens]
    free = iter([40, 41, 7, 30, 3, 44, 45, 46, 47, 48, 49, 50, 51])  # not in order: scattered blocks
    tables = [[5], [9]] + [[2] + [next(free) for _ in range(b - 1)] for b in need[2:]]  # rows 3, 4 share block 2
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(block_size=block, slot_mapping=torch.tensor(
        [t[(n - 1) // block] * block + (n - 1) % block for t, n in zip(tables, lens, strict=True)]))
    meta.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    meta.decode_context_lens = torch.tensor(lens)
    rows = len(lens)
    q = torch.randn(rows, heads, dim, generator=gen)
    k, v = (torch.randn(rows, kv_heads, dim, generator=gen) for _ in range(2))
    pools = (k_cache.clone(), v_cache.clone())
    want = decode_only_attention(q, k, v, k_cache, v_cache, meta.slot_mapping, meta.decode_block_tables,
                                 meta.decode_mask(window), dim ** -0.5)
    got = kernels.attend_rows(q, k, v, *pools, meta.decode_block_tables, meta.decode_context_lens,
                              meta.slot_mapping, window, dim ** -0.5)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert torch.equal(pools[0], k_cache) and torch.equal(pools[1], v_cache)  # the new K/V, at the same slots


def test_without_a_c_compiler_the_torch_ops_serve(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built there
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))
    native.load.cache_clear()
    try:
        assert native.load() is None
    finally:
        native.load.cache_clear()


def test_asyncpage_native_0_turns_them_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCPAGE_NATIVE", "0")
    native.load.cache_clear()
    try:
        assert native.load() is None
    finally:
        native.load.cache_clear()


def test_only_float32_cpu_tensors_and_contiguous_pools_are_taken() -> None:
    pool, table = torch.zeros(4, 2, 1, 8), torch.zeros(1, 2, dtype=torch.long)
    assert native.takes(torch.zeros(1, 8), (pool, pool), table)
    assert not native.takes(torch.zeros(1, 8, dtype=torch.bfloat16), (pool, pool), table)
    assert not native.takes(torch.zeros(1, 8), (pool, pool.transpose(0, 1)), table)
    assert not native.takes(torch.zeros(1, 8), (pool, pool, torch.zeros(4)), table)  # a quantized pool's scales
    assert not native.takes(torch.zeros(1, 8), (pool, pool), table.int())


def test_the_kernels_answer_in_float32_whatever_torchs_default_dtype() -> None:
    kernels = native.load()
    assert kernels is not None
    pool = torch.zeros(4, 2, 1, 8, dtype=torch.float32)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = kernels.attend_rows(torch.ones(1, 2, 8, dtype=torch.float32), torch.ones(1, 1, 8, dtype=torch.float32),
                                  torch.full((1, 1, 8), 3.0, dtype=torch.float32), pool, pool.clone(),
                                  torch.tensor([[1]]), torch.tensor([1]), torch.tensor([2]), None, 0.5)
    finally:
        torch.set_default_dtype(previous)
    assert out.dtype == torch.float32 and torch.equal(out, torch.full((1, 2, 8), 3.0))


def test_a_cached_library_that_does_not_load_is_rebuilt(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native.load.cache_clear()
    try:
        built = native._build_with(native.FLAGS)  # built, not loaded: a loaded library must never be rewritten in place
        built.write_bytes(built.read_bytes()[:100])  # a torn file at its cache key, as a killed build leaves
        assert native.load() is not None
        assert built.stat().st_size > 100
    finally:
        native.load.cache_clear()


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """The activations as the native linears take them: each row's blocks of 32 rounded to int8 with
    scale max|x| / 127 (half to even), in float64."""
    rows, k = x.shape
    blocks = x.view(rows, k // 32, 32).double()
    step = blocks.abs().amax(-1, keepdim=True) / 127
    return (torch.round(blocks / torch.where(step > 0, step, 1)) * step).view(rows, k)


def _q8_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What linear_q8 promises: the rounded activations times the int8 weight and its per-channel
    scale, summed in float64."""
    return (_rounded(x) @ w.double().t()) * scale.double()


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within the activations' 8-bit rounding (or torch's bfloat16), relative to the largest output."""
    return bool((got - want).abs().max() / want.abs().max() < 2e-2)


def _q8_builds() -> list[tuple[str, ...]]:
    """This machine's build, and the AVX2 form where the CPU runs AVX2 but -march=native picks AVX-512."""
    flags = [native.FLAGS]
    cpu = native._cpu()
    if " avx2" in cpu and " avx512_vnni" in cpu:
        flags.append(tuple("-march=haswell" if f == "-march=native" else f for f in native.FLAGS))
    return flags


@pytest.mark.parametrize("flags", _q8_builds(), ids=lambda f: next(x for x in f if x.startswith("-march")))
def test_linear_q8_is_the_int8_weights_times_activations_rounded_in_blocks_of_32(
        flags: tuple[str, ...], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    import ctypes

    kernels = native.NativeKernels(ctypes.CDLL(str(native._build_with(flags))))
    assert kernels.q8_granule in (32, 64)
    gen = torch.Generator().manual_seed(0)
    for n, k, rows in [(1, 64, 1), (3, 128, 2), (7, 640, 3), (640, 1024, 1), (1031, 2048, 9), (5, 16384, 2)]:
        w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)  # -128 too (any int8 weight)
        scale = torch.rand(n, generator=gen)
        x = torch.randn(rows, k, generator=gen)
        x[0, :5] *= 100  # an outlier in one block: the other blocks keep their own scale
        x[-1, 32:64] = 0  # an all-zero block
        x[-1, 64:96] = 1e-38  # a block too small for 127 / max|x|: zeros
        got = kernels.linear_q8(x, w, scale)
        want = _q8_reference(x, w, scale)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        assert ((got.double() - want).abs().max() / want.abs().max()) < 1e-5, (n, k, rows)
        # the integer sums are exact whatever k: all-positive rows (no cancellation to hide behind)
        pos = x.abs()
        assert ((kernels.linear_q8(pos, w, scale).double() - _q8_reference(pos, w, scale)).abs().max()
                / _q8_reference(pos, w, scale).abs().max()) < 1e-6, (n, k, rows)
        # the same dot products as the float weights give, up to the activations' rounding
        exact = (x.double() @ w.double().t()) * scale.double()
        assert ((got.double() - exact).abs().max() / exact.abs().max()) < 2e-2


def test_linear_q8_refuses_what_it_cannot_read_safely() -> None:
    kernels = native.load()
    assert kernels is not None and kernels.q8_granule
    w, scale = torch.randint(-127, 128, (64, 128), dtype=torch.int8), torch.rand(64)
    for x, weight, s in [
        (torch.randn(1, 64), w, scale),  # x shorter than k: the C code would read past it
        (torch.randn(128), w, scale),  # 1-D
        (torch.randn(1, 128), w, torch.rand(8)),  # too few scales
        (torch.randn(1, 64), w.t(), scale),  # a transposed (strided) weight
        (torch.randn(1, 128), w.to(torch.uint8), scale),
        (torch.randn(1, 128), w.float(), scale),
    ]:
        with pytest.raises(ValueError):
            kernels.linear_q8(x, weight, s)


@pytest.mark.parametrize("size", [1e36, 1e37])
def test_the_native_linears_stay_finite_where_the_true_result_is(size: float) -> None:
    """Huge finite activations (mixed signs): a block's integer sums times its scale once overflowed
    to inf, and opposite lanes added to NaN."""
    from asyncpage.model.native import pack_q4

    kernels = native.load()
    assert kernels is not None and kernels.q8_granule
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 256, generator=gen) * size
    w = torch.randint(-127, 128, (4, 256), dtype=torch.int8, generator=gen)
    scale = torch.rand(4, generator=gen) * 0.01
    want = (x.double() @ w.double().t()) * scale.double()
    got = kernels.linear_q8(x, w, scale)
    assert got.isfinite().all() and ((got.double() - want).abs().max() / want.abs().max()) < 2e-2
    # a small block beside a huge one keeps its share where the huge one's cancels (zero weights)
    mixed, w0 = torch.ones(1, 256) * 1e-5, w.clone()
    mixed[0, :32] = size
    w0[:, :32] = 0
    exact = (mixed.double() @ w0.double().t()) * scale.double()
    assert ((kernels.linear_q8(mixed, w0, scale).double() - exact).abs().max() / exact.abs().max()) < 2e-2
    q = torch.randint(0, 16, (4, 256), generator=gen)
    s4, m4 = torch.full((4, 8), 0.01).bfloat16(), torch.full((4, 8), -0.08).bfloat16()
    want4 = x.double() @ (q.double() * 0.01 - 0.08).t()
    got4 = kernels.linear_q4(x, pack_q4(q), s4, m4)
    assert got4.isfinite().all() and ((got4.double() - want4).abs().max() / want4.abs().max()) < 2e-2


def test_linear_q8_rows_are_computed_each_alone_and_a_non_finite_row_gives_nan() -> None:
    kernels = native.load()
    assert kernels is not None and kernels.q8_granule
    gen = torch.Generator().manual_seed(1)
    w = torch.randint(-127, 128, (96, 256), dtype=torch.int8, generator=gen)
    scale = torch.rand(96, generator=gen)
    x = torch.randn(4, 256, generator=gen)
    alone = torch.cat([kernels.linear_q8(row, w, scale) for row in x.split(1)])
    assert torch.equal(kernels.linear_q8(x, w, scale), alone)  # a row never depends on the others
    for bad in (float("nan"), float("inf")):
        poisoned = x.clone()
        poisoned[2, 100] = bad
        out = kernels.linear_q8(poisoned, w, scale)
        assert out[2].isnan().all()  # never finite logits made of a NaN
        assert torch.equal(out[[0, 1, 3]], alone[[0, 1, 3]])
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(kernels.linear_q8(x, w, scale), alone)  # each channel is one thread's sum
    finally:
        torch.set_num_threads(previous)


def test_linear_q8_runs_on_torchs_own_openmp_threads() -> None:
    assert native.load() is not None
    with open("/proc/self/maps") as f:
        runtimes = {line.split()[-1] for line in f if "gomp" in line or "libiomp" in line}
    assert len(runtimes) <= 1, runtimes  # a second OpenMP runtime's threads would fight torch's for the cores


def test_a_compiler_without_openmp_builds_the_kernels_serial(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import shutil

    real = shutil.which("cc") or shutil.which("gcc")
    if real is None:
        pytest.skip("no C compiler on this machine")
    fake = tmp_path / "cc-no-openmp"
    fake.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && exit 1; done\nexec {real} "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(fake))
    native.load.cache_clear()
    try:
        kernels = native.load()
        assert kernels is not None
        w, x = torch.randint(-127, 128, (8, 64), dtype=torch.int8), torch.randn(2, 64)
        if kernels.q8_granule:  # float32 sums against float64: within float rounding of the largest output
            want = _q8_reference(x, w, torch.ones(8))
            got = kernels.linear_q8(x, w, torch.ones(8)).double()
            assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    finally:
        native.load.cache_clear()


@pytest.mark.parametrize(("kind", "k", "odd_k"), [("int8", 128, 100), ("int4", 256, 96)])
def test_quantized_layers_take_the_native_kernel_where_it_builds_and_torchs_without_it(
        kind: str, k: int, odd_k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 layers take linear_q8 (k a multiple of the build's granule), int4 layers linear_q4 (k a
    multiple of 128); other shapes, and ASYNCPAGE_NATIVE=0, keep torch's kernels."""
    from asyncpage.model.quant import QuantLinear

    def native_of(layer: QuantLinear) -> object:
        return layer.q8 if kind == "int8" else layer.q4

    w, x = torch.randn(64, k), torch.randn(1, k)
    layer = QuantLinear.from_float(kind, w, torch.float32)
    assert native_of(layer) is not None and layer.dense is not None
    assert _close(layer.kernel(x), x @ layer.dequantized().t())
    assert native_of(QuantLinear.from_float(kind, torch.randn(64, odd_k), torch.float32)) is None
    # any number of outputs (torch's int4 kernel wants a multiple of 16: such a layer was made int8)
    odd_n = QuantLinear.from_float(kind, torch.randn(40, k), torch.float32)
    assert odd_n.kind == kind and native_of(odd_n) is not None
    monkeypatch.setenv("ASYNCPAGE_NATIVE", "0")
    native.load.cache_clear()
    try:
        plain = QuantLinear.from_float(kind, w, torch.float32)
        assert native_of(plain) is None
        assert _close(plain.kernel(x), x @ plain.dequantized().t())
    finally:
        native.load.cache_clear()


@pytest.mark.parametrize("flags", _q8_builds(), ids=lambda f: next(x for x in f if x.startswith("-march")))
def test_linear_q4_is_the_int4_weights_times_activations_rounded_in_blocks_of_32(
        flags: tuple[str, ...], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each group of 32 weights is q * scale + minimum (q in 0..15, bfloat16 scale and minimum)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    import ctypes

    from asyncpage.model.native import pack_q4, unpack_q4
    from asyncpage.model.quant import dequantize_int4

    kernels = native.NativeKernels(ctypes.CDLL(str(native._build_with(flags))))
    gen = torch.Generator().manual_seed(2)
    for n, k, rows in [(1, 128, 1), (5, 256, 2), (7, 640, 3), (640, 1024, 1), (1031, 2048, 9)]:
        q = torch.randint(0, 16, (n, k), generator=gen)
        scale = (torch.rand(n, k // 32, generator=gen) * 0.01).bfloat16()
        minimum = (-torch.rand(n, k // 32, generator=gen) * 0.08).bfloat16()
        packed = pack_q4(q)
        assert packed.shape == (n, k // 2) and torch.equal(unpack_q4(packed), q.to(torch.uint8))
        x = torch.randn(rows, k, generator=gen)
        x[0, :5] *= 100
        w = dequantize_int4(q, scale, minimum).double()
        want = _rounded(x) @ w.t()
        got = kernels.linear_q4(x, packed, scale, minimum)
        assert got.shape == (rows, n)
        assert ((got.double() - want).abs().max() / want.abs().max()) < 1e-5, (n, k, rows)
    bad = torch.randn(2, 128)
    bad[1, 7] = float("nan")
    one = kernels.linear_q4(bad, pack_q4(torch.ones(3, 128)), torch.ones(3, 4).bfloat16(), torch.zeros(3, 4).bfloat16())
    assert one[1].isnan().all() and one[0].isfinite().all()
    with pytest.raises(ValueError):
        kernels.linear_q4(torch.randn(1, 64), packed, scale, minimum)  # x shorter than k
    with pytest.raises(ValueError):
        kernels.linear_q4(torch.randn(1, 2048), packed, scale.float(), minimum)  # float32 scales


@pytest.mark.parametrize("source", ["cpu_decode.c", "cpu_forward.c", "gguf_quants.c"])
def test_every_native_source_builds_without_openmp(source: str, monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    """Where -fopenmp fails, native.library builds with SERIAL_FLAGS: a kernel must not need OpenMP to compile."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert native._build_with(native.SERIAL_FLAGS, source).stat().st_size > 0
