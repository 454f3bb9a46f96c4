"""Engine configuration: option checks, device / dtype / backend resolution, KV pool sizing.

Everything here is decided once, before an engine exists; nothing here touches a running engine.
"""

from __future__ import annotations

import math
import os
from typing import Any

import msgspec
import torch

from asyncpage.decoding.speculative import SpeculativeConfig
from asyncpage.errors import InvalidRequestError
from asyncpage.kv.eviction import EVICTION_POLICIES


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    dtype: str
    device: str
    block_size: int
    num_kv_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_prefix_caching: bool
    attention_backend: str
    num_threads: int
    debug_checks: bool = False  # check the KV pool's invariants after every step (tests, fuzzing)
    eviction_policy: str | None = None  # None: prefix-aware (eviction.py); "lru": plain LRU
    kv_cache_dtype: str | None = None  # the KV pool's torch dtype name; None: `dtype`
    quantization: str | None = None  # weight-only: None, "int8", "int4" (gguf_quantize.py), "auto" (gguf_linear.py)
    speculative: SpeculativeConfig | None = None  # n-gram speculative decoding (speculative.py)
    compiled: bool = False  # small decode steps run torch.compile'd layers (models/compiled.py)
    # Requests handed over but not started past which submission raises QueueFullError (HTTP 429).
    max_queued_requests: int = 2048


class EngineOptions(msgspec.Struct, frozen=True, kw_only=True):
    """The pool and scheduling options an engine was built with: what `AsyncEngine.clone` may change
    (from_pretrained's signature holds their defaults and says what each does). Checked by `check`,
    since a Struct built in code checks no types."""

    block_size: int
    num_kv_blocks: int | None
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_prefix_caching: bool
    attention_backend: str
    max_model_len: int | None
    kv_cache_memory: int | None
    guided_backend: str
    grammar_compile_timeout: float
    debug_checks: bool
    eviction_policy: str | None
    kv_cache_dtype: str
    speculative_config: SpeculativeConfig | None
    max_queued_requests: int

    @staticmethod
    def names() -> frozenset[str]:
        return frozenset(EngineOptions.__struct_fields__)

    def check(self) -> None:
        """Raise InvalidRequestError naming the first option that is out of range or of the wrong type."""
        o = self
        bs = o.block_size
        if not isinstance(bs, int) or isinstance(bs, bool) or bs < 1 or bs & (bs - 1):
            raise InvalidRequestError("block_size", f"must be a power of two, got {bs!r}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_queued_requests"):
            v = getattr(o, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidRequestError(name, f"must be an integer >= 1, got {v!r}")
        for name in ("num_kv_blocks", "max_model_len", "kv_cache_memory"):
            v = getattr(o, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise InvalidRequestError(name, f"must be None or an integer >= 1, got {v!r}")
        for name in ("enable_prefix_caching", "debug_checks"):
            # A truthy string ("no", "false") must not switch a feature on.
            if not isinstance(getattr(o, name), bool):
                raise InvalidRequestError(name, f"must be True or False, got {getattr(o, name)!r}")
        if o.guided_backend not in ("llguidance", "xgrammar"):
            raise InvalidRequestError("guided_backend", f"must be llguidance or xgrammar, got {o.guided_backend!r}")
        t = o.grammar_compile_timeout
        if not isinstance(t, int | float) or isinstance(t, bool) or not 0 < t < math.inf:
            raise InvalidRequestError("grammar_compile_timeout", f"must be > 0 seconds, got {t!r}")
        if o.eviction_policy not in EVICTION_POLICIES:
            raise InvalidRequestError("eviction_policy", f"must be None (the default, prefix-aware) or 'lru', "
                                      f"got {o.eviction_policy!r}")
        if o.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError("kv_cache_dtype", f"must be 'auto' (the model dtype), 'int8' or 'fp8', "
                                      f"got {o.kv_cache_dtype!r}")
        if o.attention_backend not in ("auto", "torch", "triton"):
            raise InvalidRequestError("attention_backend",
                                      f"must be torch, triton or auto, got {o.attention_backend!r}")


KV_CACHE_DTYPES = ("auto", "int8", "fp8")


def check_load_options(num_threads: Any, compile: Any) -> None:
    """The options only a load takes (not in `check_options`: a clone cannot change them)."""
    if num_threads is not None and (not isinstance(num_threads, int) or isinstance(num_threads, bool)
                                    or num_threads < 1):
        raise InvalidRequestError("num_threads", f"must be None or an integer >= 1, got {num_threads!r}")
    if compile is not None and not isinstance(compile, bool):
        raise InvalidRequestError("compile", f"must be None, True or False, got {compile!r}")


def check_quantization(q: Any) -> None:
    """None (dequantize to the dtype), "int8", "int4" (float weights as GGUF blocks, gguf_quantize.py; quant.py
    where the block kernels do not run), or "auto" (a GGUF's quantized tensors
    stay in their own block formats on the CPU, gguf_linear.py; float weights stay float)."""
    if q not in (None, "int8", "int4", "auto"):
        raise InvalidRequestError("quantization", f"must be None, 'auto', 'int8' or 'int4', got {q!r}")


def resolve_kv_cache_dtype(kv: str, dtype: str) -> str:
    """The torch dtype name the KV pool is stored in."""
    return {"auto": dtype, "int8": "int8", "fp8": "float8_e4m3fn"}[kv]


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise InvalidRequestError("device", f"must be 'cpu', 'cuda' or 'auto', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError("device", "CUDA is not available in this torch build / machine")
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype == "auto":
        if device == "cuda":
            return "bfloat16"
        # bf16 on CPUs with native bf16 dot products (AVX512-BF16/AMX): half the weight traffic.
        # Elsewhere bf16 is emulated and ~3x slower than float32 (measured on AVX2-only machines).
        bf16 = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")()
        native = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
        return "bfloat16" if native or "AMX" in str(bf16) else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise InvalidRequestError("dtype", f"must be float32, bfloat16, float16 or auto, got {dtype!r}")
    return dtype


# The Triton kernels multiply [rows, block_size] tiles with tl.dot, which NVIDIA GPUs reject below
# K = 16 for 16-bit types; refuse such a pool at construction rather than at the first step.
TRITON_MIN_BLOCK_SIZE = 16


def resolve_backend(backend: str, device: str, block_size: int) -> str:
    if backend == "auto":
        backend = "triton" if device == "cuda" and block_size >= TRITON_MIN_BLOCK_SIZE else "torch"
    if backend not in ("torch", "triton"):
        raise InvalidRequestError("attention_backend", f"must be torch, triton or auto, got {backend!r}")
    if backend == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise InvalidRequestError("attention_backend", "the Triton kernels run on the CPU only under Triton's "
                                  "interpreter: set TRITON_INTERPRET=1 before importing asyncpage (slow; for tests)")
    if backend == "triton" and block_size < TRITON_MIN_BLOCK_SIZE:
        raise InvalidRequestError("block_size", f"the triton attention backend needs block_size >= "
                                  f"{TRITON_MIN_BLOCK_SIZE} (tl.dot tiles), got {block_size}")
    return backend


def size_pool(options: EngineOptions, per_block_bytes: int, max_len: int, device: str) -> int:
    """Blocks in the KV pool: `num_kv_blocks` if given, else what `kv_cache_memory` bytes hold
    (default: 1 GiB on the CPU, 80% of free GPU memory on CUDA)."""
    if options.num_kv_blocks is not None:
        return int(options.num_kv_blocks)
    budget = options.kv_cache_memory
    if budget is None:
        budget = int(torch.cuda.mem_get_info()[0] * 0.8) if device == "cuda" else 1 << 30
    blocks = max(1, budget // per_block_bytes)
    # A pool larger than max_num_seqs full contexts is memory nobody can use.
    return int(min(blocks, options.max_num_seqs * math.ceil(max_len / options.block_size)))
