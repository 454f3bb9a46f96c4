"""Compiled decode layers (`compile=True`): the decoder layers' small ops fused by torch.compile.

At a few rows a layer's matmuls are small, and the ~40 other ops around them (norms, rotary, QK-norm,
residual adds, gating, reshapes, the casts of the quantized kernels) each pay torch's dispatch, which
dominated a one-stream decode step. Inductor fuses them into a few C++ loops around the matmuls (the
packed kernels stay opaque calls: `asyncpage::linear_q8` / `linear_q4`, or torch's own). Attention stays
an opaque operator (`asyncpage::decode_attention`, a shape-only fake for tracing): the layer's pool,
slots, block tables and masks reach it through `_current` (by layer index), set per step, so they are
not graph inputs.

Used only for steps that are all decode rows (no prefill chunk, no padding rows), with at most
`MAX_ROWS` of them, on the CPU, with the torch attention backend and an unquantized KV pool: one
stream and small batches, where the dispatch cost matters. Everything else runs the eager forward,
which computes the same ops (the compiled graph's float results can differ in the last bits).

The whole stack of layers is one graph (the weights are graph inputs, not constants), compiled for
1 row and for 2.. rows (a dynamic size) up to each quantized projection's packed / dense threshold,
all at load (`warm_up`); afterwards a step that would need a new graph runs eager instead of
compiling mid-request.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from asyncpage.model import native
from asyncpage.model.attention import AttentionMetadata, attend_span, contiguous_span, decode_only_attention
from asyncpage.model.batch import EXACT_ROWS, FlatBatch
from asyncpage.runtime import cache_dir

log = logging.getLogger("asyncpage")

MAX_ROWS = EXACT_ROWS  # the runner's exact buckets: decode steps of up to 8 sequences have no padding rows

# The step's K/V pools (one per layer), slots, block tables and each layer's mask for its window.
# Set by CompiledDecode.forward before the compiled call and read by the operator (by layer index),
# so the pools and the per-step shapes (blocks per sequence) never enter the graph: nothing
# recompiles as sequences grow. How this step's rows attend (CompiledDecode.forward picks it):
# `kernels` (native), else `span` (one row's slice of the pool), else `masks` (gather and mask);
# `windows`: each layer's.
class _Current(threading.local):
    kv: Sequence[tuple[torch.Tensor, ...]] = ()
    meta: AttentionMetadata | None = None
    masks: Sequence[torch.Tensor] = ()
    span: tuple[int, int] | None = None
    windows: Sequence[int | None] = ()
    kernels: native.NativeKernels | None = None


_current = _Current()


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, layer: int) -> torch.Tensor:
    c = _current
    kv, meta, window = c.kv[layer], c.meta, c.windows[layer]
    assert meta is not None and meta.decode_block_tables is not None and meta.decode_context_lens is not None
    if c.kernels is not None:  # any block tables, in one native call
        return c.kernels.attend_rows(q, k, v, kv[0], kv[1], meta.decode_block_tables, meta.decode_context_lens,
                                     meta.slot_mapping, window, scale)
    if c.span is not None:
        return attend_span(q, k, v, kv[0], kv[1], c.span, window, scale)
    return decode_only_attention(q, k, v, kv[0], kv[1], meta.slot_mapping, meta.decode_block_tables,
                                 c.masks[layer], scale)


_lib = torch.library.Library("asyncpage", "FRAGMENT")  # native.py defines the linears
# A Library op, not torch.library.custom_op: that one's Python wrapper cost ~16 us a call here,
# this ~2 us; there are 18 calls a step.
_lib.define("decode_attention(Tensor q, Tensor k, Tensor v, float scale, int layer) -> Tensor")
_lib.impl("decode_attention", _decode_attention, "CompositeExplicitAutograd")


@torch.library.register_fake("asyncpage::decode_attention")
def _fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, layer: int) -> torch.Tensor:
    return torch.empty_like(q)


def _layers(layers: Any, x: torch.Tensor, rotary: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Every decoder layer (the model's own `decode_layer`), attention through the opaque operator.
    One graph for the whole stack: per-layer graphs paid dynamo's guards and call wrappers 18 times a
    step (~2.8 ms of a 23 ms int4 forward here), and a layer's tail could not fuse with the next
    layer's norm."""
    for i, layer in enumerate(layers):
        cos, sin = rotary[i]
        x = layer.decode_layer(x, cos, sin, functools.partial(torch.ops.asyncpage.decode_attention, layer=i))
    return x


class CompiledDecode:
    """The decode forward of one model with its layers compiled; `applies(meta, rows)` says when."""

    def __init__(self, model: Any) -> None:
        import torch._dynamo

        self.model = model
        # Each row interval (and thread count) is a cache entry of the one compiled function (default 8).
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # A code object of its own: dynamo keeps graphs per code object, and these skip the guards on
        # the modules (below), so another model's call must never find them.
        own = types.FunctionType(_layers.__code__.replace(), _layers.__globals__, "_layers")
        # Guards on the modules re-checked ~18 layers' attributes every step (~0.7 ms of a ~22 ms
        # one-stream step here, A/B in one process). They cannot fail: this model's modules are fixed
        # once loaded (their tensors are still read from them at every call). The input shapes and
        # the thread count stay guarded. (An older torch without the filter keeps every guard.)
        skip = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
        options = {"guard_filter_fn": skip} if skip is not None else {}
        self.layers: Callable[..., torch.Tensor] = torch.compile(own, dynamic=None, fullgraph=True, options=options)
        self.windows = [layer.self_attn.window for layer in model.model.layers]  # fixed once loaded
        self.compile_s = 0.0
        self.steps = 0  # decode steps routed here (tests; a thread count not compiled runs them eager)
        self.graphs = 0  # graphs the warm-up compiled

    @staticmethod
    def applies(meta: AttentionMetadata, rows: int, kv_caches: list[tuple[torch.Tensor, ...]]) -> bool:
        return (meta.decode_rows is not None and not meta.prefills and rows <= MAX_ROWS
                and int(meta.decode_rows.shape[0]) == rows and len(kv_caches[0]) == 2
                and meta.attention in (None, _torch_attention()) and meta.slot_mapping.device.type == "cpu")

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        """x: the embedded input [T, hidden]; returns the last layer's output (before the final norm)."""
        assert meta.decode_block_tables is not None
        c = _current
        layers = self.model.model.layers
        c.meta, c.kv, c.windows = meta, kv_caches, self.windows
        assert meta.decode_context_lens is not None
        kernels = native.load()
        # The native kernel where it takes this step; else torch's ops: one row on consecutive
        # blocks reads its slice of the pool, other steps gather their blocks and mask them.
        c.kernels = kernels if kernels is not None and native.takes(
            x, kv_caches[0], meta.decode_block_tables, meta.decode_context_lens, meta.slot_mapping) else None
        c.span = contiguous_span(meta) if c.kernels is None else None
        c.masks = [] if c.kernels is not None or c.span is not None else [meta.decode_mask(w) for w in c.windows]
        rotary = [layer.self_attn.rotary.cos_sin(positions, x.dtype, meta.scratch) for layer in layers]
        self.steps += 1
        try:
            return self.layers(layers, x, rotary)
        finally:
            c.kv = c.masks = ()  # the pools are not kept alive by this thread
            c.meta = None

    def warm_up(self, dtype: torch.dtype, block_size: int, threads: Sequence[int] = ()) -> float:
        """Compile every variant now (1 row, 2..MAX_ROWS rows), on a scratch pool, for
        each thread count in `threads` (default: the current one). Dynamo's guards include torch's
        thread count (inductor's loops are built for one), and the compute thread lowers it while
        other processes hold cores (cpu_share.py): a count not compiled here would run eager."""
        # Imported here: torch._dynamo imports triton, which must first see TRITON_INTERPRET (kernels/).
        from torch._dynamo.utils import counters

        t0 = time.perf_counter()
        graphs = counters["stats"]["unique_graphs"]
        current = torch.get_num_threads()
        try:
            for n in threads or (current,):
                torch.set_num_threads(n)
                self._run_variants(dtype, block_size)
        finally:
            torch.set_num_threads(current)
        self.compile_s = time.perf_counter() - t0
        self.graphs = counters["stats"]["unique_graphs"] - graphs  # what this warm-up compiled
        # Everything was compiled above: from now on a step whose guards fail (a thread count not
        # compiled) runs eager, never compiles (seconds) in the middle of a request. dynamo.run
        # runs cached graphs only; set_stance would do the same but is process-wide (every
        # thread's torch.compile, the host's own included).
        self.layers = torch._dynamo.run(self.layers)
        self.steps = 0
        log.info("compiled the decode layers in %.1f s", self.compile_s)
        return self.compile_s

    def _run_variants(self, dtype: torch.dtype, block_size: int) -> None:
        blocks = MAX_ROWS + 1
        caches = [tuple(torch.zeros(blocks, block_size, layer.self_attn.num_kv_heads, layer.self_attn.head_dim,
                                    dtype=dtype) for _ in range(2)) for layer in self.model.model.layers]
        with torch.inference_mode():
            # A projection's kernel (packed or dense) depends on the rows against a threshold measured
            # at load (quant_kernels.crossover: 1, 2, 4, 8, ...): one graph per interval, each compiled here.
            for rows in (1, 2, 3, 5, MAX_ROWS):
                flat = FlatBatch(block_size, (blocks - 1) * block_size, torch.device("cpu"), _torch_attention())
                for r in range(rows):
                    flat.add([0], r % block_size, [r])
                self.model(*flat.build(), caches)


def enable(model: Any, dtype: torch.dtype, threads: Sequence[int] = (), block_size: int = 16) -> float:
    """Give `model` (a family with `decode_layer`) a compiled decode path and compile it now for each
    thread count in `threads` (default: the current one); returns the seconds that took (0 if the
    model family has no compiled path)."""
    if not hasattr(model, "compiled"):  # a model family without a compiled path
        return 0.0
    if model.compiled is not None:  # already (another engine on the same weights)
        return 0.0
    if not _private_inductor_cache():
        return 0.0
    model.compiled = CompiledDecode(model)  # warm-up compiles by running the model's forward through it
    try:
        return model.compiled.warm_up(dtype, block_size, threads)
    except Exception as exc:  # no C++ compiler, dynamo's recompile limit, an op inductor refuses
        # The model runs as without compile=True: slower, never wrong; the log says why.
        model.compiled = None
        log.warning("compile=True: compiling the decode layers failed (%s: %s); running eager",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return 0.0


def _torch_attention() -> Callable[..., torch.Tensor]:
    from asyncpage.model.attention import paged_attention

    return paged_attention


def _private_inductor_cache() -> bool:
    """Point inductor's cache at the per-user root unless the user chose one; False (and a warning)
    where that root is unsafe. Inductor writes the C++ it compiles, and loads it back, under
    /tmp/torchinductor_<user> by default: a name another local user can create first. Process-wide:
    the host's own torch.compile follows (triton's cache defaults to under it too)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    # Inductor writes its default into the variable the first time anything asks (transformers'
    # imports can, before this runs): that value is torch's, not a choice of the user's.
    if current is not None and os.path.abspath(current) != os.path.abspath(default_cache_dir()):
        return True
    try:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir.subdir("inductor"))
    except cache_dir.UnsafeCacheError as exc:
        log.warning("compile=True: %s; running eager", exc)
        return False
    return True
