"""The fused decode step: a decode step of 1..8 rows (up to WIDE_ROWS where every projection runs the VNNI or AVX2
block kernels) through the whole decoder stack in one native call
(kernels/cpu_forward.c, which says what it computes and how it threads), for models whose
projections are GGUF blocks (`quantization="auto"` on a GGUF file, gguf_linear.py), Gemma 3 and the
Llama family. Set up once at load (`enable`): every weight's pointer, format and shape go into a C-side
model; a step passes only what changes (token ids, positions, slots, block tables, context lengths,
the pool's pointers). The LM head stays the model's own `compute_logits` (one block-kernel call).

Used (`NativeStep.applies`) for steps that are all decode rows (no prefill chunk, no padding rows), at
most `max_rows` of them (MAX_ROWS, or WIDE_ROWS), on the CPU, with the torch attention backend and an
unquantized K/V pool of float32, bfloat16 or float16: where the ~40 torch ops a layer cost more than the
layer's bytes.
Everything else runs the model's own forward. Activations are float32 in C whatever the model's dtype;
each matrix input is rounded to int8 blocks exactly as GGUFLinear's kernels round it, so on a float32
model the step computes what the eager forward computes up to float rounding.

`ASYNCPAGE_FUSED_STEP=0` keeps the eager forward (for comparisons); `ASYNCPAGE_NATIVE=0` or no C
compiler turns every native kernel off, this one included.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import weakref
from typing import Any

import torch
from torch import nn

from asyncpage.model import gguf_kernels as gk
from asyncpage.model import native
from asyncpage.model.attention import AttentionMetadata, paged_attention
from asyncpage.model.batch import EXACT_ROWS
from asyncpage.model.gguf_linear import GGUFEmbedding, GGUFFused, GGUFLinear
from asyncpage.model.layers import FusedLinear, GemmaRMSNorm, RMSNorm

log = logging.getLogger("asyncpage")

MAX_ROWS = EXACT_ROWS  # the runner's exact buckets (batch.py): decode steps of up to 8 rows have no padding
# Where every projection is GGUF blocks in the VNNI or AVX2 form taking up to this many rows (gguf_linear), a step of
# up to WIDE_ROWS decode rows goes through too: its products past 8 rows take the paths the eager forward's take
# (cpu_forward.c mat_part: the VNNI form's interleaved one, rows repacked by eight, the K-quants' row tiles), and its
# ~40 torch ops a layer (norms, RoPE, the paged attention) are a quarter of a 32-row step (2-core AMD EPYC VM: 99 ms
# a step, 50 ms of it the layers, 42 the LM head).
WIDE_ROWS = 32
_MAT_F32, _MAT_BF16 = -1, -2  # dense rows (a tensor without a block kernel)
_DENSE = {torch.float32: _MAT_F32, torch.bfloat16: _MAT_BF16}
_KV = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_Q, _K, _V, _O, _GATE, _UP, _DOWN = range(7)
_ATTN_IN, _ATTN_OUT, _FFN_IN, _FFN_OUT, _QNORM, _KNORM = range(6)
_ACTS = {"silu": 0, "gelu_tanh": 1}
_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
# One projection as the C side takes it: (kind: ggml type or _MAT_*, kernel form, the tensor, its
# first row, rows, values per row, bias).
Part = tuple[int, int, torch.Tensor, int, int, int, torch.Tensor | None]
_ERRORS = {-1: "out of memory", -2: "a shape it does not take", -3: "a weight type it does not read",
           -4: "a kernel form this CPU lacks", -5: "an index out of range", -6: "an incomplete set-up"}


class Unsupported(Exception):
    """A model part the fused step cannot express (the model keeps its eager forward)."""


class _Lib:
    def __init__(self, lib: ctypes.CDLL) -> None:
        def fn(name: str, restype: Any, *args: Any) -> Any:
            f = getattr(lib, name)
            f.argtypes, f.restype = list(args), restype
            return f

        self.create = fn("fwd_create", _P, _I, _I, _I, _I, _I, _I, _F, _I, _F, _I)
        self.set_embed = fn("fwd_set_embed", _I, _P, _I, _P, _L)
        self.set_mat = fn("fwd_set_mat", _I, _P, _I, _I, _I, _I, _P, _L, _L, _P)
        self.set_norm = fn("fwd_set_norm", _I, _P, _I, _I, _P)
        self.set_attention = fn("fwd_set_attention", _I, _P, _I, _P, _F, _L, _F)
        self.ready = fn("fwd_ready", _I, _P)
        self.free = fn("fwd_free", None, _P)
        self.step = fn("fwd_step", _I, _P, _I, _P, _P, _P, _P, _P, _L, _P, _P, _I, _L, _I, _I, _P)
        self.round16 = fn("fwd_round16", None, _P, _L, _I, _P)


@functools.cache
def _lib() -> _Lib | None:
    lib = native.library("cpu_forward.c", ("fwd_create", "fwd_step", "fwd_free", "fwd_round16"))
    return None if lib is None else _Lib(lib)


def available() -> bool:
    """Whether the fused step's kernels built and loaded here (a C compiler, ASYNCPAGE_NATIVE not 0)."""
    return _lib() is not None


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise Unsupported(f"{what}: {_ERRORS.get(rc, f'code {rc}')}")


class _Pool:
    """One engine's K/V pools as the step passes them: 2 * layers pointers, the dtype code, blocks."""

    def __init__(self, caches: list[tuple[torch.Tensor, ...]], block_size: int, kv_heads: int, head_dim: int) -> None:
        self.caches = caches  # kept: the pointers are only valid while these tensors live
        flat = [t for kv in caches for t in kv]
        dtypes = {t.dtype for t in flat}
        self.ok = (all(len(kv) == 2 for kv in caches) and len(dtypes) == 1 and next(iter(dtypes)) in _KV
                   and all(t.device.type == "cpu" and t.is_contiguous() and t.dim() == 4
                           and tuple(t.shape[1:]) == (block_size, kv_heads, head_dim)
                           and t.shape[0] == flat[0].shape[0] for t in flat))
        self.ptrs = (ctypes.c_void_p * len(flat))(*(t.data_ptr() for t in flat))
        self.dtype = _KV.get(flat[0].dtype, -1)
        self.blocks = int(flat[0].shape[0])
        self.key = (block_size, *(t.data_ptr() for t in flat[:2]))


class NativeStep:
    """A model's decode steps through kernels/cpu_forward.c; `applies(meta, rows, kv_caches)` says when."""

    def __init__(self, lib: _Lib, model: Any) -> None:
        self.lib = lib
        inner = model.model
        layers = list(inner.layers)
        first = layers[0]
        attn, mlp = first.self_attn, first.mlp
        self.hidden = int(model.config.hidden_size)
        self.heads, self.kv_heads, self.head_dim = int(attn.num_heads), int(attn.num_kv_heads), int(attn.head_dim)
        self.inter = int(model.config.intermediate_size)
        if mlp.act not in _ACTS:
            raise Unsupported(f"activation {mlp.act}")
        self.eps = float(inner.norm.eps)
        self._keep: list[torch.Tensor] = []  # every tensor the C side points into, alive with this object
        head = getattr(model, "lm_head", None)
        dtype = next((p.dtype for p in model.parameters()), torch.float32)
        # The GGUF head takes float32 as it is; a dense head wants the model's dtype.
        self.out_dtype = torch.float32 if isinstance(head, GGUFLinear) else dtype
        scale = float(getattr(inner, "embed_scale", 0.0) or 0.0)
        self.max_rows = WIDE_ROWS if _wide(layers) else MAX_ROWS
        handle = lib.create(len(layers), self.hidden, self.heads, self.kv_heads, self.head_dim, self.inter, self.eps,
                            _ACTS[mlp.act], scale, self.max_rows)
        if not handle:
            raise Unsupported("these shapes (or out of memory)")
        self.handle = handle
        self._finalizer = weakref.finalize(self, lib.free, handle)
        self._embed(inner.embed_tokens)
        _check(lib.set_norm(handle, -1, 0, self._norm(inner.norm)), "final norm")
        for i, layer in enumerate(layers):
            self._layer(i, layer)
        _check(lib.ready(handle), "set-up")
        self._pool: _Pool | None = None
        self.steps = 0  # decode steps run here (tests)

    def _embed(self, emb: Any) -> None:
        if isinstance(emb, GGUFEmbedding):
            w, kind, vocab = emb.qweight, emb.ggml_type, emb.num_embeddings
        elif isinstance(emb, nn.Embedding) and emb.weight.dtype in _DENSE:
            w, kind, vocab = emb.weight.detach().contiguous(), _DENSE[emb.weight.dtype], emb.num_embeddings
        else:
            raise Unsupported(f"embedding {type(emb).__name__}")
        self._keep.append(w)
        _check(self.lib.set_embed(self.handle, kind, w.data_ptr(), vocab), "embedding")

    def _norm(self, norm: Any) -> int | None:
        """The pointer to a norm's float32 scales (Gemma's 1 + w), None for no norm."""
        if norm is None:
            return None
        if isinstance(norm, GemmaRMSNorm):
            w = norm.scale if norm.scale is not None else 1.0 + norm.weight.detach().float()
        elif isinstance(norm, RMSNorm):
            w = norm.weight.detach().float()
        else:
            raise Unsupported(f"norm {type(norm).__name__}")
        if float(norm.eps) != self.eps:
            raise Unsupported("norms with different eps")
        w = w.contiguous()
        self._keep.append(w)
        return int(w.data_ptr())

    def _layer(self, i: int, layer: Any) -> None:
        attn, mlp, lib, h = layer.self_attn, layer.mlp, self.lib, self.handle
        gemma = hasattr(layer, "pre_feedforward_layernorm")
        norms = {_ATTN_IN: layer.input_layernorm,
                 _ATTN_OUT: layer.post_attention_layernorm if gemma else None,
                 _FFN_IN: layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm,
                 _FFN_OUT: layer.post_feedforward_layernorm if gemma else None,
                 _QNORM: attn.q_norm if attn.has_qk_norm else None,
                 _KNORM: attn.k_norm if attn.has_qk_norm else None}
        for which, norm in norms.items():
            _check(lib.set_norm(h, i, which, self._norm(norm)), f"layer {i} norm")
        qkv = _parts(attn.qkv, [attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up = _parts(mlp.gate_up, [mlp.gate_proj, mlp.up_proj])
        for which, part in zip((_Q, _K, _V, _GATE, _UP, _O, _DOWN),
                               [*qkv, *gate_up, _part(attn.o_proj), _part(mlp.down_proj)], strict=True):
            self._mat(i, which, part)
        inv = attn.rotary.inv_freq
        if inv.dtype != torch.float32 or inv.device.type != "cpu" or inv.numel() != self.head_dim // 2:
            raise Unsupported("rotary frequencies")
        inv = inv.contiguous()
        attn.rotary.inv_freq = inv  # the one the C side points to (Rotary moves it only across devices)
        self._keep.append(inv)
        _check(lib.set_attention(h, i, inv.data_ptr(), float(attn.rotary.scaling), int(attn.window or 0),
                                 float(attn.scale)), f"layer {i} attention")

    def _mat(self, i: int, which: int, part: Part) -> None:
        kind, form, w, row0, n, k, bias = part
        stride = w.shape[1] * w.element_size()  # bytes per row: blocks, or dense values
        self._keep.append(w)
        b = None
        if bias is not None:
            bias = bias.detach().float().contiguous()
            self._keep.append(bias)
            b = bias.data_ptr()
        _check(self.lib.set_mat(self.handle, i, which, kind, form, w.data_ptr() + row0 * stride, n, k, b),
               f"layer {i} matrix {which}")

    def applies(self, meta: AttentionMetadata, rows: int, kv_caches: list[tuple[torch.Tensor, ...]]) -> bool:
        if not (0 < rows <= self.max_rows and meta.decode_rows is not None and not meta.prefills
                and int(meta.decode_rows.shape[0]) == rows and meta.attention in (None, paged_attention)):
            return False
        pool = self._pool
        if pool is None or pool.caches is not kv_caches or pool.key != (meta.block_size, kv_caches[0][0].data_ptr(),
                                                                          kv_caches[0][1].data_ptr()):
            pool = self._pool = _Pool(kv_caches, meta.block_size, self.kv_heads, self.head_dim)
        return pool.ok

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
        """The step's hidden states after the final norm, [rows, hidden] (applies() was true)."""
        pool = self._pool
        tables, lens, slots = meta.decode_block_tables, meta.decode_context_lens, meta.slot_mapping
        assert pool is not None and tables is not None and lens is not None
        index = (input_ids, positions, slots, tables, lens)
        if not all(t.dtype == torch.long and t.is_cpu and t.is_contiguous() for t in index):
            raise ValueError("the fused decode step takes contiguous int64 CPU ids, positions, slots and tables")
        rows = int(input_ids.shape[0])
        out = torch.empty(rows, self.hidden, dtype=torch.float32)
        rc = self.lib.step(self.handle, rows, input_ids.data_ptr(), None, positions.data_ptr(), slots.data_ptr(),
                           tables.data_ptr(), int(tables.shape[1]), lens.data_ptr(), pool.ptrs, pool.dtype,
                           pool.blocks, meta.block_size, torch.get_num_threads(), out.data_ptr())
        if rc != 0:
            raise (MemoryError if rc == -1 else IndexError if rc == -5 else ValueError)(
                f"the fused decode step refused this step: {_ERRORS.get(rc, f'code {rc}')}")
        self.steps += 1
        return out if self.out_dtype == torch.float32 else out.to(self.out_dtype)


def _wide(layers: list[Any]) -> bool:
    """Whether every projection of `layers` is GGUF blocks whose SIMD kernels (VNNI or AVX2) take WIDE_ROWS rows (no
    dense one)."""
    simd = {gk.FORMS.index("vnni"), gk.FORMS.index("avx2")}
    mods = [m for layer in layers for m in layer.modules()]
    blocks = [m for m in mods if isinstance(m, GGUFLinear)]
    return bool(blocks) and not any(isinstance(m, (nn.Linear, FusedLinear)) for m in mods) and \
        all(m.bound.form in simd and m.kernel_rows >= WIDE_ROWS for m in blocks)


def _part(mod: nn.Module | None) -> Part:
    """(kind, form, tensor, first row, rows, k, bias) of one projection: GGUF blocks or dense rows."""
    if isinstance(mod, GGUFLinear):
        return mod.ggml_type, mod.bound.form, mod.qweight, 0, mod.out_features, mod.in_features, mod.bias
    if isinstance(mod, nn.Linear) and mod.weight.dtype in _DENSE and mod.weight.is_contiguous():
        w = mod.weight.detach()
        return _DENSE[w.dtype], 0, w, 0, int(w.shape[0]), int(w.shape[1]), mod.bias
    raise Unsupported(f"projection {type(mod).__name__}")


def _parts(fused: Any, mods: list[nn.Module | None]) -> list[Part]:
    """Each projection of a fused call (GGUFFused, FusedLinear) or of the separate modules."""
    if fused is None:
        return [_part(m) for m in mods]
    if isinstance(fused, GGUFFused) and fused.merged is None:
        return [_part(m) for m in fused.parts]
    if isinstance(fused, GGUFFused):
        whole = _part(fused.merged)
    elif isinstance(fused, FusedLinear) and fused.weight.dtype in _DENSE and fused.weight.is_contiguous():
        w = fused.weight.detach()
        whole = (_DENSE[w.dtype], 0, w, 0, int(w.shape[0]), int(w.shape[1]), fused.bias)
    else:
        raise Unsupported(f"fused projection {type(fused).__name__}")
    kind, form, w, _, _, k, bias = whole
    out, row = [], 0
    for n in fused.sizes:
        out.append((kind, form, w, row, n, k, None if bias is None else bias[row : row + n]))
        row += n
    return out


def enable(model: Any) -> bool:
    """Give `model` (a family with a `native` attribute, holding GGUF-block layers) the fused decode
    step; False (and the eager forward) where it does not apply, is turned off, or cannot build."""
    if os.environ.get("ASYNCPAGE_FUSED_STEP", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if not hasattr(model, "native") or not any(isinstance(m, (GGUFLinear, GGUFEmbedding)) for m in model.modules()):
        return False
    lib = _lib()
    if lib is None:
        return False
    try:
        model.native = NativeStep(lib, model)
    except (Unsupported, AttributeError) as exc:
        log.info("no fused decode step for this model (%s): decode runs the eager forward", exc)
        return False
    return True
