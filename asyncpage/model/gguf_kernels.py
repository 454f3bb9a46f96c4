"""GGUF quantized tensors used as they are stored: `matmul` (activations times a Q4_0 / Q5_0 / Q8_0 /
Q4_K / Q5_K / Q6_K weight, read block by block from the file's bytes) and `get_rows` (an embedding
lookup that dequantizes only the rows it reads). The kernels are kernels/gguf_quants.c (built and
loaded by native.py; the formats, the arithmetic and the threading are described there); this module
owns their Python face: the checks the C code trusts, the choice of form, and a torch operator for
compiled graphs.

Each call rounds its activation rows to int8 once (llama.cpp's Q8_0 for the 32-element formats,
Q8_K-style blocks of 256 for the K-quants: scale max|x| / 127, values rint(x / scale)) and takes
integer dot products: AVX-512 VNNI, AVX2, or portable C, the best this CPU has unless the form is
forced (`form=` or ASYNCPAGE_GGUF_FORM = vnni | avx2 | portable; the tests run each).

Why hand-written: nothing torch ships reads these blocks, and what it has needs its own copy of the
weights. Measured here (scripts/gguf_kernel_bench.py --torch-ops; 2 shared cores of a Xeon with AVX-512
VNNI and AMX, torch 2.13, 2 threads, fastest call), x [1, 640] times ffn_up [2048, 640] (Q5_0 in the
file) / the LM head [262144, 640] (Q8_0):
  - `aten._weight_int4pack_mm_for_cpu` (A16W4, groups of 32, its own packed copy; Q5_0 / Q6_K / Q8_0
    only through a lossy requantize to 4 bits): 45 us / 11.8 ms with bfloat16 activations, 1,329 us /
    173 ms with float32 (its scalar path);
  - `aten._weight_int8pack_mm` (one scale per output channel: Q8_0's per-32 scales would have to be
    requantized): 47 us / 31.8 ms bfloat16, 462 us / 63.6 ms float32;
  - dense matmul of the dequantized weight (3.6-7x the blocks' bytes held): 88 us / 37.0 ms bfloat16,
    76 us / 39.8 ms float32;
  - this module, on the file's own blocks (VNNI form): 56 us / 23.0 ms (12.9 ms for 4 rows).
At one to eight rows these kernels are the only exact path on the file's bytes and beat the dense
matmuls; past eight rows the VNNI form's interleaved path (gguf_quants.c matmul_ilv) keeps them ahead of
dequantize + bfloat16 GEMM for the 32-element formats at every row count measured (up to 512) and for
the K-quants up to 48 rows (Bound.max_rows); scripts/gguf_kernel_bench.py prints both.
"""

from __future__ import annotations

import ctypes
import functools
import os
from enum import IntEnum

import torch

from asyncpage.model import native

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


class GGMLType(IntEnum):
    """The ggml type numbers of the formats these kernels read (gguf.GGMLQuantizationType's values)."""

    Q4_0 = 2
    Q5_0 = 6
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    # No file's types: the 32-element formats' rows repacked by eight in place (repack8), for the SIMD forms.
    Q4_0_R8 = 102
    Q5_0_R8 = 106
    Q8_0_R8 = 108


# (elements, bytes) per block.
BLOCKS: dict[GGMLType, tuple[int, int]] = {
    GGMLType.Q4_0: (32, 18), GGMLType.Q5_0: (32, 22), GGMLType.Q8_0: (32, 34),
    GGMLType.Q4_K: (256, 144), GGMLType.Q5_K: (256, 176), GGMLType.Q6_K: (256, 210),
    GGMLType.Q4_0_R8: (32, 18), GGMLType.Q5_0_R8: (32, 22), GGMLType.Q8_0_R8: (32, 34),
}
REPACKED = frozenset({GGMLType.Q4_0_R8, GGMLType.Q5_0_R8, GGMLType.Q8_0_R8})
FORMS = ("portable", "avx2", "vnni")  # index = the C code's form number
_SYMBOLS = ("gguf_matmul", "gguf_matmul_max", "gguf_get_rows", "gguf_dequantize", "gguf_form_best", "gguf_block_elems",
            "gguf_block_bytes", "gguf_repack8")


class _Lib:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.matmul = lib.gguf_matmul
        self.matmul.argtypes = [_I, _I, _P, _P, _L, _L, _I, _I, _P]
        self.matmul.restype = _I
        self.matmul_max = lib.gguf_matmul_max
        self.matmul_max.argtypes = [_I, _I, _P, _P, _L, _L, _I, _I, _P, _P, _P]
        self.matmul_max.restype = _I
        self.get_rows = lib.gguf_get_rows
        self.get_rows.argtypes = [_I, _P, _L, _L, _P, _L, _P]
        self.get_rows.restype = _I
        self.dequantize = lib.gguf_dequantize
        self.dequantize.argtypes = [_I, _P, _L, _L, _I, _I, _P]
        self.dequantize.restype = _I
        self.best = int(lib.gguf_form_best())
        self.repack8 = lib.gguf_repack8
        self.repack8.argtypes = [_I, _P, _L, _L]
        self.repack8.restype = _I


@functools.cache
def _lib() -> _Lib | None:
    lib = native.library("gguf_quants.c", _SYMBOLS)
    return None if lib is None else _Lib(lib)


def available() -> bool:
    """Whether the kernels built and loaded here (a C compiler, ASYNCPAGE_NATIVE not 0)."""
    return _lib() is not None


def supports(ggml_type: int) -> bool:
    """Whether `matmul` / `get_rows` read this file's ggml type (and the kernels are available)."""
    return ggml_type in {int(t) for t in GGMLType} and ggml_type not in REPACKED and available()


def forms() -> tuple[str, ...]:
    """The forms this CPU runs, best last (empty where the kernels are unavailable)."""
    lib = _lib()
    return () if lib is None else FORMS[: lib.best + 1]


def default_form() -> str:
    """ASYNCPAGE_GGUF_FORM if set (checked against what the CPU runs), else the best form."""
    lib = _require()
    name = os.environ.get("ASYNCPAGE_GGUF_FORM", "").strip().lower()
    return _form_name(name) if name else FORMS[lib.best]


def _form_name(name: str) -> str:
    runs = forms()
    if name not in FORMS:
        raise ValueError(f"unknown kernel form {name!r}: one of {', '.join(FORMS)}")
    if name not in runs:
        raise ValueError(f"kernel form {name!r} needs a CPU feature this one lacks (it runs: {', '.join(runs)})")
    return name


def _require() -> _Lib:
    lib = _lib()
    if lib is None:
        raise RuntimeError("the GGUF kernels (kernels/gguf_quants.c) are not available here: no C compiler, "
                           "or ASYNCPAGE_NATIVE=0 (see the log)")
    return lib


def row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of one row of k values in this type; ValueError where k is not a multiple of its block."""
    block, size = _block(ggml_type)
    if k <= 0 or k % block:
        raise ValueError(f"{GGMLType(ggml_type).name} rows hold a multiple of {block} values; got k={k}")
    return k // block * size


def _block(ggml_type: int) -> tuple[int, int]:
    try:
        return BLOCKS[GGMLType(ggml_type)]
    except ValueError:
        raise ValueError(f"no GGUF kernel for ggml type {ggml_type} (these read: "
                         f"{', '.join(t.name for t in GGMLType)})") from None


def _weight(w: torch.Tensor, ggml_type: int) -> tuple[int, int]:
    """(n, k) of a weight given as its rows of raw blocks: uint8 [n, row bytes], contiguous, CPU."""
    block, size = _block(ggml_type)
    if w.dim() != 2 or w.dtype != torch.uint8 or w.device.type != "cpu" or not w.is_contiguous():
        raise ValueError(f"a GGUF weight is a contiguous uint8 [n, bytes per row] CPU tensor; got "
                         f"{tuple(w.shape)} {w.dtype} on {w.device}")
    if w.shape[1] % size:
        raise ValueError(f"{GGMLType(ggml_type).name} rows are whole blocks of {size} bytes; got rows of {w.shape[1]}")
    return int(w.shape[0]), int(w.shape[1]) // size * block


def matmul(x: torch.Tensor, w: torch.Tensor, ggml_type: int, *, form: str | None = None,
           threads: int | None = None) -> torch.Tensor:
    """x [rows, k] times the GGUF weight w^T: w holds its n rows of raw blocks, uint8 [n, k / block *
    bytes] (the tensor's bytes as the file stores them, shape ne1 x row bytes). Returns float32
    [rows, n]. x is rounded to int8 blocks first (see the module docstring). form: "vnni" | "avx2" |
    "portable" (default_form() when None); threads: torch.get_num_threads() when None. ValueError for
    a type without a kernel, a k that is not a multiple of the type's block (256 for the K-quants,
    32 otherwise), or shapes that do not match."""
    lib = _require()
    n, k = _weight(w, ggml_type)
    if x.dim() != 2 or x.shape[1] != k or x.device.type != "cpu":
        raise ValueError(f"x must be [rows, {k}] on the CPU for this weight; got {tuple(x.shape)} on {x.device}")
    row_bytes(ggml_type, k)  # the block check, with its message
    x = x.to(torch.float32).contiguous()
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    f = FORMS.index(_form_name(form) if form is not None else default_form())
    _repacked_form(ggml_type, f)
    rc = lib.matmul(int(ggml_type), f, x.data_ptr(), w.data_ptr(), n, k, x.shape[0],
                    threads or torch.get_num_threads(), out.data_ptr())
    if rc == -1:
        raise MemoryError("gguf_matmul: no memory for its rounded activations or scratch")
    if rc != 0:
        raise ValueError(f"gguf_matmul refused type {ggml_type}, k={k}, form {FORMS[f]} (code {rc})")
    return out


def _repacked_form(ggml_type: int, form: int) -> None:
    if ggml_type in REPACKED and FORMS[form] == "portable":
        raise ValueError(f"rows repacked by eight ({GGMLType(ggml_type).name}) are read by the VNNI and AVX2 forms "
                         "only, not the portable one")


def get_rows(ids: torch.Tensor, w: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """The rows `ids` (int64, any shape) of the GGUF weight w (uint8 [n, row bytes], as for matmul),
    dequantized: float32 [*ids.shape, k]. Only those rows' blocks are read. IndexError for an id
    outside 0..n-1."""
    lib = _require()
    n, k = _weight(w, ggml_type)
    flat = ids.reshape(-1).to(torch.long).contiguous()
    out = torch.empty(flat.numel(), k, dtype=torch.float32)
    rc = lib.get_rows(int(ggml_type), w.data_ptr(), n, k, flat.data_ptr(), flat.numel(), out.data_ptr())
    if rc == -5:
        raise IndexError(f"get_rows: an id outside 0..{n - 1}")
    if rc != 0:
        raise ValueError(f"gguf_get_rows refused type {ggml_type}, k={k} (code {rc})")
    return out.reshape(*ids.shape, k)


def repack8(w: torch.Tensor, ggml_type: int) -> int:
    """A Q4_0 / Q5_0 / Q8_0 weight of a multiple of 8 rows, where a SIMD form (VNNI or AVX2) is the one in use,
    repacked in place by eight rows (the same bytes rearranged: each block's 8 scales, then its values with 4 of
    each row side by side, as one 8-lane integer dot reads them; kernels/gguf_quants.c gguf_repack8) and its
    repacked type returned (Q8_0_R8 ...): `matmul` then reads it without unpacking at every row count, one
    output's arithmetic the same at 1 row as at 8 or 64 (a speculative verify gives the bits of one-token steps;
    the VNNI and AVX2 forms give the same bits). LM head [262144, 640] Q8_0 at 8 rows: 6.5 ms where the tiles
    take 17 (VNNI, 2-core AMD EPYC VM, 2 threads; one row 5.0 either way). `get_rows` and `dequantize` read it
    too. Anything else is left as it is and its type returned. The portable form does not read the repacked
    types: asked for them, a ValueError."""
    lib = _require()
    n, k = _weight(w, ggml_type)
    if ggml_type not in (GGMLType.Q4_0, GGMLType.Q5_0, GGMLType.Q8_0) or n % 8 or default_form() == "portable":
        return ggml_type
    rc = lib.repack8(int(ggml_type), w.data_ptr(), n, k)
    if rc == -1:
        raise MemoryError("gguf_repack8: no memory for a group's buffer")
    if rc < 0:
        raise ValueError(f"gguf_repack8 refused a {GGMLType(ggml_type).name} [{n}, {k}] weight (code {rc})")
    return int(rc)


def dequantize(w: torch.Tensor, ggml_type: int, dtype: torch.dtype = torch.float32, *,
               threads: int | None = None) -> torch.Tensor:
    """Every row of the GGUF weight w (uint8 [n, row bytes], as for matmul) dequantized: [n, k] in
    bfloat16 (rounded to nearest even) or float32; any other dtype from float32. Multithreaded (over
    rows); what a many-row call multiplies with a dense GEMM, made per call and dropped after."""
    lib = _require()
    n, k = _weight(w, ggml_type)
    bf16 = dtype == torch.bfloat16
    out = torch.empty(n, k, dtype=torch.bfloat16 if bf16 else torch.float32)
    rc = lib.dequantize(int(ggml_type), w.data_ptr(), n, k, threads or torch.get_num_threads(), int(bf16),
                        out.data_ptr())
    if rc == -1:
        raise MemoryError("gguf_dequantize: no memory for a row buffer")
    if rc != 0:
        raise ValueError(f"gguf_dequantize refused type {ggml_type}, k={k} (code {rc})")
    return out if bf16 or dtype == torch.float32 else out.to(dtype)


# The most activation rows whose outputs' maxima the kernel finds as it writes them (Bound.with_max): a decode
# step of up to 8 streams.
SEARCH_ROWS = 8


class Bound:
    """One weight's matmul with its checks done once (at load) and its form fixed then: the decode
    path, where matmul()'s Python checks would cost about as much as a small layer's kernel."""

    def __init__(self, w: torch.Tensor, ggml_type: int, form: str | None = None) -> None:
        self.lib = _require()
        self.n, self.k = _weight(w, ggml_type)
        row_bytes(ggml_type, self.k)
        self.w, self.type = w, int(ggml_type)
        self.form = FORMS.index(_form_name(form) if form is not None else default_form())
        _repacked_form(self.type, self.form)
        self.ptr = w.data_ptr()
        # The most rows for which these kernels beat dequantize + torch's bf16 GEMM (None: any count). In
        # the VNNI form every format takes the interleaved path past 8 rows (kernels/gguf_quants.c,
        # matmul_ilv). Without AMX (a 2-core AMD EPYC VM; where a bf16 GEMM runs on AMX, gguf_linear caps
        # this at AMX_ROWS) the 32-element formats are ahead at every count measured (ffn_up Q5_0 [2048, 640]
        # at 32 rows 0.25 ms vs 0.53, at 512 3.1 vs 3.5; the Q8_0 LM head at 32 rows 43 vs 128 ms, at 128
        # 152 vs 166); the K-quants up to about 48 (ffn_down Q6_K [640, 2048] at 32 rows 0.39 vs 0.55 ms, 64
        # even, at 512 5.3 vs 3.9). In the AVX2 form the rows repacked by eight go at any count too and the
        # K-quants' four-row tiles up to 48, against a float32 GEMM (what dtype="auto" picks without native bf16)
        # on the weight already dequantized, which the dense path also does each call (the Xeon VM with torch and
        # MKL held to AVX2, scripts/avx2_compare.py's settings; scripts/gguf_kernel_bench.py --form avx2):
        # ffn_up Q5_0 at 512 rows 5.41 ms vs 6.14 + 0.19 to dequantize; a Q4_K ffn_down at 32 rows 0.49 vs 0.54 +
        # 0.17, at 64 0.84 vs 0.83 + 0.17, at 128 1.71 vs 1.50 + 0.17; the Q8_0 head at 32 rows 51 ms vs 73 (MKL
        # left on AVX-512 there, in the dense path's favour). The portable form and rows not repacked tile four
        # activation rows at a time and fall behind past 8 (gguf_linear.py's docstring).
        vnni, block = self.form == FORMS.index("vnni"), _block(self.type)[0]
        if vnni:
            self.max_rows: int | None = None if block == 32 else 48
        elif FORMS[self.form] == "avx2":
            self.max_rows = None if self.type in REPACKED else 8 if block == 32 else 48
        else:
            self.max_rows = 8

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, k] (any float dtype, CPU) times the weight^T: float32 [rows, n]."""
        x = x.to(torch.float32).contiguous()
        out = torch.empty(x.shape[0], self.n, dtype=torch.float32)
        self._check(self.lib.matmul(self.type, self.form, x.data_ptr(), self.ptr, self.n, self.k, x.shape[0],
                                    torch.get_num_threads(), out.data_ptr()))
        return out

    def with_max(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """As calling it, and each output row's maximum and first index (NaN counted as the maximum, as
        `max(dim=-1)`), found as the outputs are written, at up to SEARCH_ROWS rows (else None: numpy's
        search of many rows after the call is faster than the threads' scalar pass); None too where the
        interleaved path runs (past 8 rows in the VNNI form, rows not repacked by eight), which finds none.
        Under the default floating-point environment: a caller's flush-to-zero (torch.set_flush_denormal)
        holds for its own thread only, not the kernel's other threads, whose comparisons then keep denormals."""
        if x.dtype != torch.float32:
            x = x.to(torch.float32)
        x = x.contiguous()
        rows = x.shape[0]
        if rows > SEARCH_ROWS:
            return self(x), None
        out = torch.empty(rows, self.n, dtype=torch.float32)
        vals, idx = torch.empty(rows, dtype=torch.float32), torch.empty(rows, dtype=torch.long)
        self._check(self.lib.matmul_max(self.type, self.form, x.data_ptr(), self.ptr, self.n, self.k, rows,
                                        torch.get_num_threads(), out.data_ptr(), vals.data_ptr(), idx.data_ptr()))
        return out, (None if rows and min(idx.tolist()) < 0 else (vals, idx))

    def _check(self, rc: int) -> None:
        if rc != 0:
            raise MemoryError("gguf_matmul: no memory for its rounded activations or scratch") if rc == -1 else \
                ValueError(f"gguf_matmul refused type {self.type} (code {rc})")


# As torch operators (shape-only fakes for tracing), as native.py's linears: compiled graphs call them.
_ops = torch.library.Library("asyncpage", "FRAGMENT")
_ops.define("gguf_matmul(Tensor x, Tensor w, int ggml_type) -> Tensor")
_ops.define("gguf_get_rows(Tensor ids, Tensor w, int ggml_type) -> Tensor")


def _matmul_op(x: torch.Tensor, w: torch.Tensor, ggml_type: int) -> torch.Tensor:
    return matmul(x, w, ggml_type)


def _get_rows_op(ids: torch.Tensor, w: torch.Tensor, ggml_type: int) -> torch.Tensor:
    return get_rows(ids, w, ggml_type)


_ops.impl("gguf_matmul", _matmul_op, "CompositeExplicitAutograd")
_ops.impl("gguf_get_rows", _get_rows_op, "CompositeExplicitAutograd")


@torch.library.register_fake("asyncpage::gguf_matmul")
def _matmul_fake(x: torch.Tensor, w: torch.Tensor, ggml_type: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)


@torch.library.register_fake("asyncpage::gguf_get_rows")
def _get_rows_fake(ids: torch.Tensor, w: torch.Tensor, ggml_type: int) -> torch.Tensor:
    block, size = _block(ggml_type)
    return w.new_empty((*ids.shape, w.shape[1] // size * block), dtype=torch.float32)
