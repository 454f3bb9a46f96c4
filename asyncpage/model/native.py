"""Native CPU kernels (kernels/cpu_decode.c; why they are hand-written is said there): the compiled
decode steps' attention, and the int8 / int4 linears of quantized layers at decode row counts
(`asyncpage::linear_q8` / `linear_q4`, registered here). Built with the system C compiler at first
use and cached per source, compiler, flags and CPU under the per-user cache root
(cache_dir.subdir("native"): ASYNCPAGE_CACHE, else $XDG_CACHE_HOME/asyncpage or ~/.cache/asyncpage).
The .so is loaded as code, so it is loaded only when it and its folder are this user's alone (a
regular file owned by this uid, not group/other-writable: cache_dir's checks); a cached file that
fails them is rebuilt over (the folder is ours, so the rename replaces it), and a folder that fails
them turns the kernels off with a warning (nowhere safe to build). `load()` is None where they
cannot be built or loaded (no compiler, another OS, an unsafe cache): torch's ops serve then, with
the same results up to float rounding (the linears: up to their activations' rounding to int8).
`ASYNCPAGE_NATIVE=0` turns them off.

`library(source, symbols)` builds and loads any other C file of kernels/ the same way (cached under
its own name and key; OpenMP build first, serial second): gguf_kernels.py's kernels/gguf_quants.c."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import torch

from asyncpage.runtime import cache_dir

log = logging.getLogger("asyncpage")

SOURCE = "cpu_decode.c"
# -march=native: the kernels are built on the machine that runs them (the cache key names its CPU).
# -fopenmp: linear_q8 splits its channels over torch's own OpenMP threads (the libgomp.so.1 torch has
# loaded is the one this library's reference resolves to). A compiler without OpenMP builds the
# second set: the same kernels on the calling thread.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
SERIAL_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC")
_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float


class NativeKernels:
    """The loaded library, with typed entry points that take tensors."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._attend = lib.attend_rows_f32
        self._attend.argtypes = [_P, _P, _P, _P, _P, _P, _L, _P, _P, _L, _I, _I, _I, _I, _I, _F, _P]
        self._attend.restype = _I
        self._q8 = lib.linear_q8
        self._q8.argtypes = [_P, _P, _P, _L, _L, _I, _I, _P]
        self._q8.restype = _I
        # The k linear_q8 takes a multiple of: 64 with AVX-512 VNNI, 32 with AVX2, 0 without either.
        self.q8_granule = int(lib.linear_q8_granule())
        self._q4 = lib.linear_q4
        self._q4.argtypes = [_P, _P, _P, _P, _L, _L, _I, _I, _P]
        self._q4.restype = _I

    def attend_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor,
                    window: int | None, scale: float) -> torch.Tensor:
        """Decode rows' attention over their block tables, in place (see attend_rows_f32). q [R, H, D],
        k / v [R, KVH, D] float32; tables [R, W], lens [R], slots [R] int64 (the caller checks: `takes`)."""
        rows, heads, dim = q.shape
        _, block, kv_heads, _ = k_cache.shape
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = torch.empty(rows, heads, dim, dtype=torch.float32)  # what the C code writes, whatever torch's default
        if self._attend(q.data_ptr(), k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                        tables.data_ptr(), tables.shape[1], lens.data_ptr(), slots.data_ptr(), window or 0,
                        rows, heads, kv_heads, dim, block, scale, out.data_ptr()):
            raise MemoryError("attend_rows_f32: no memory for its scratch")
        return out


    def takes_q8(self, w: torch.Tensor) -> bool:
        """Whether linear_q8 takes this weight: int8 [n, k] on the CPU, contiguous, k a multiple of
        the build's granule."""
        return (self.q8_granule > 0 and w.dim() == 2 and w.dtype == torch.int8 and w.device.type == "cpu"
                and w.is_contiguous() and w.shape[1] % self.q8_granule == 0)

    def linear_q8(self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x [rows, k] times w^T [k, n] (int8, one float32 scale per output channel), x rounded to
        int8 in blocks of 32 (see linear_q8 in cpu_decode.c): [rows, n] float32. Every size is checked
        (ValueError); x is made contiguous float32 here."""
        # Checked here: the C code trusts every size it is given, and a wrong one reads past a buffer.
        if not self.takes_q8(w):
            raise ValueError(f"linear_q8 takes a contiguous int8 [n, k] CPU weight, k a multiple of "
                             f"{self.q8_granule}; got {tuple(w.shape)} {w.dtype} on {w.device}")
        n, k = w.shape
        if scale.numel() != n or scale.device.type != "cpu":
            raise ValueError(f"linear_q8: scale must hold {n} values on the CPU; got {scale.numel()}")
        return self._linear("linear_q8", self._q8, x, n, k, w, scale.to(torch.float32).contiguous())

    def takes_q4(self, k: int) -> bool:
        """Whether linear_q4 takes an int4 weight of k inputs (a multiple of 128, where the build has
        integer dot products)."""
        return self.q8_granule > 0 and k > 0 and k % 128 == 0

    def linear_q4(self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
        """x [rows, k] times the int4 weight w^T (pack_q4's layout [n, k / 2] uint8; bfloat16
        scale and minimum [n, k / 32]: w = q * scale + minimum), x rounded to int8 in blocks of 32
        (see linear_q4 in cpu_decode.c): [rows, n] float32."""
        n, half = w.shape if w.dim() == 2 else (0, 0)
        k = 2 * half
        if not (self.takes_q4(k) and w.dtype == torch.uint8 and w.device.type == "cpu" and w.is_contiguous()):
            raise ValueError(f"linear_q4 takes packed uint8 [n, k / 2] CPU weights, k a multiple of 128; "
                             f"got {tuple(w.shape)} {w.dtype} on {w.device}")
        for t in (scale, minimum):
            if t.shape != (n, k // 32) or t.dtype != torch.bfloat16 or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"linear_q4: scale and minimum must be contiguous bfloat16 [{n}, {k // 32}]; "
                                 f"got {tuple(t.shape)} {t.dtype}")
        return self._linear("linear_q4", self._q4, x, n, k, w, scale, minimum)

    def _linear(self, name: str, fn: Any, x: torch.Tensor, n: int, k: int, *weight: torch.Tensor) -> torch.Tensor:
        """A native linear's call, its weight tensors checked by the caller: x checked against k and
        made contiguous float32, then out [rows, n] float32."""
        if x.dim() != 2 or x.shape[1] != k or x.device.type != "cpu":
            raise ValueError(f"{name}: x must be [rows, {k}] on the CPU; got {tuple(x.shape)} on {x.device}")
        rows = x.shape[0]
        x = x.to(torch.float32).contiguous()
        out = torch.empty(rows, n, dtype=torch.float32)
        if rows == 0:
            return out
        rc = fn(x.data_ptr(), *(t.data_ptr() for t in weight), n, k, rows, torch.get_num_threads(), out.data_ptr())
        if rc == -1:
            raise MemoryError(f"{name}: no memory for its scratch")
        if rc != 0:
            raise ValueError(f"{name} does not take k={k} (this build's granule: {self.q8_granule})")
        return out


def takes(x: torch.Tensor, pool: tuple[torch.Tensor, ...], *index: torch.Tensor) -> bool:
    """Whether attend_rows takes a step of these: float32 activations and a (K, V) pool of float32 on
    the CPU, contiguous; its block tables, lengths and slots contiguous int64."""
    return (len(pool) == 2 and all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
                                   for t in (x, *pool))
            and all(t.dtype == torch.long and t.device.type == "cpu" and t.is_contiguous() for t in index))


# The native linears as operators (shape-only fakes for tracing): compiled decode graphs call them
# as they call torch's packed kernels. A Library op, not custom_op: ~2 us a call, not ~16.
_lib = torch.library.Library("asyncpage", "FRAGMENT")
_lib.define("linear_q8(Tensor x, Tensor w, Tensor scale) -> Tensor")


def _linear_q8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    kernels = load()
    assert kernels is not None, "a layer takes linear_q8 only where the kernels loaded"
    return kernels.linear_q8(x, w, scale)


_lib.impl("linear_q8", _linear_q8, "CompositeExplicitAutograd")


@torch.library.register_fake("asyncpage::linear_q8")
def _linear_q8_fake(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)


_lib.define("linear_q4(Tensor x, Tensor w, Tensor scale, Tensor minimum) -> Tensor")


def _linear_q4(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    kernels = load()
    assert kernels is not None, "a layer takes linear_q4 only where the kernels loaded"
    return kernels.linear_q4(x, w, scale, minimum)


_lib.impl("linear_q4", _linear_q4, "CompositeExplicitAutograd")


@torch.library.register_fake("asyncpage::linear_q4")
def _linear_q4_fake(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """int4 values [N, K] (0..15, K a multiple of 128) in linear_q4's layout: each 128 of a row as
    64 bytes, byte j holding value j (low nibble) and value 64 + j (high nibble)."""
    n, k = q.shape
    pairs = q.to(torch.uint8).reshape(n, k // 128, 2, 64)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_q4(packed: torch.Tensor) -> torch.Tensor:
    n, half = packed.shape
    chunks = packed.reshape(n, half // 64, 1, 64)
    return torch.cat([chunks & 0x0F, chunks >> 4], dim=2).reshape(n, 2 * half)


@functools.cache
def load() -> NativeKernels | None:
    """The kernels, built on first use (about a second) and cached; None where that fails."""
    if os.environ.get("ASYNCPAGE_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        return NativeKernels(_load(FLAGS))
    except cache_dir.UnsafeCacheError as exc:
        log.warning("no native CPU kernels (%s): torch ops serve the compiled decode steps", exc)
        return None
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        # A compiler without OpenMP, or a build that does not load: the serial build still serves.
        log.info("the native kernels with OpenMP did not build or load (%s); building them serial",
                 _why(exc))
    try:
        return NativeKernels(_load(SERIAL_FLAGS))
    except (OSError, subprocess.SubprocessError, AttributeError, cache_dir.UnsafeCacheError) as exc:
        log.warning("no native CPU kernels (%s): torch ops serve the compiled decode steps", _why(exc))
        return None


@functools.cache
def library(source: str, symbols: tuple[str, ...]) -> ctypes.CDLL | None:
    """kernels/`source` built (OpenMP first, else serial) and loaded, checked to export `symbols`;
    None where that fails or ASYNCPAGE_NATIVE=0 (the reason logged)."""
    if os.environ.get("ASYNCPAGE_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    errors: list[str] = []
    for flags in (FLAGS, SERIAL_FLAGS):
        try:
            return _load(flags, source, symbols)
        except (OSError, subprocess.SubprocessError, AttributeError, cache_dir.UnsafeCacheError) as exc:
            errors.append(_why(exc))
    log.warning("no native kernels from %s (%s)", source, "; ".join(errors))
    return None


def _load(flags: tuple[str, ...], source: str = SOURCE,
          symbols: tuple[str, ...] = ("attend_rows_f32", "linear_q8", "linear_q4")) -> ctypes.CDLL:
    """The library built with `flags`; one that does not load (a truncated or foreign file left at
    its cache key) is removed and built once more, not left to disable the kernels for every later
    process."""
    path = _build_with(flags, source)
    try:
        lib = ctypes.CDLL(str(path))
        for name in symbols:
            getattr(lib, name)  # a missing symbol raises AttributeError here
        return lib
    except (OSError, AttributeError) as exc:
        log.warning("rebuilding %s, which does not load: %s", path, exc)
        path.unlink(missing_ok=True)
        return ctypes.CDLL(str(_build_with(flags, source)))


def _why(exc: BaseException) -> str:
    stderr = getattr(exc, "stderr", None)
    lines = stderr.decode(errors="replace").strip().splitlines() if isinstance(stderr, bytes) else []
    return lines[-1] if lines else str(exc)


def _build_with(flags: tuple[str, ...], source_name: str = SOURCE) -> Path:
    """The library built with `flags` at its cache key, built now if missing; checked to be this
    user's alone (cache_dir.check_file) before it is returned for ctypes to load."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc) on PATH")
    source = _kernels_dir() / source_name
    text = _source_text(source)
    key = hashlib.sha256(b"\0".join([text, compiler.encode(), " ".join(flags).encode(), _cpu().encode()]))
    target = cache_dir.subdir("native") / f"{source.stem}-{key.hexdigest()[:16]}.so"  # UnsafeCacheError: off
    try:
        cache_dir.check_file(target)
        return target
    except FileNotFoundError:
        pass
    except cache_dir.UnsafeCacheError as exc:
        # Only this user can write the folder (checked above), so this came from one of its own
        # (an older build left group-writable by a umask of 002, a symlink) or from root: built
        # again, the rename replaces it (a symlink itself, never what it points to).
        log.warning("%s; building it again", exc)
    # Built beside the target and renamed into place: a process loading it never sees half a file.
    with cache_dir.fresh_file(target, suffix=".so", mode=0o700) as tmp:
        subprocess.run([compiler, *flags, str(source), "-o", str(tmp), "-lm"], check=True, capture_output=True,
                       timeout=120)
    cache_dir.check_file(target)
    return target


def _kernels_dir() -> Path:
    """Where the kernels' C sources are: the installed asyncpage.kernels package, else (an editable
    install whose finder lacks that mapping, a bare checkout on sys.path) the checkout's kernels/."""
    try:
        spec = importlib.util.find_spec("asyncpage.kernels")
    except ModuleNotFoundError:
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    checkout = Path(__file__).resolve().parents[2] / "kernels"
    if not checkout.is_dir():
        raise OSError("the kernels' C sources (asyncpage.kernels) are not installed")
    return checkout


def _source_text(source: Path) -> bytes:
    """The source's bytes and those of every kernels/ file it `#include "..."`s (cpu_forward.c includes
    gguf_quants.c): a change to either rebuilds."""
    seen: list[Path] = []
    todo = [source]
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.append(path)
        todo += [path.parent / m.decode() for m in re.findall(rb'^#include "([^"/]+)"', path.read_bytes(), re.M)]
    return b"\0".join(p.read_bytes() for p in seen)


def _cpu() -> str:
    """The CPU's model and feature flags (what -march=native builds for)."""
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(sorted({line for line in f if line.startswith(("model name", "flags"))}))
    except OSError:
        return os.uname().machine
