"""How an engine is made from a model and options: resolving dtype, device and threads, loading the
weights (and a speculative draft model), compiling decode, sizing the KV pool and preparing guided
decoding. AsyncEngine.from_pretrained and AsyncEngine.clone delegate here (engine.py).

Everything after the checks runs on the engine's compute thread (compute.py), where the weights and
the KV pool are allocated. This module never imports engine.py at runtime: the class to build is
passed in, so subclasses (asyncpage.disagg's workers) are built as themselves.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
import torch

from asyncpage.core.config import (
    EngineConfig,
    EngineOptions,
    check_load_options,
    check_quantization,
    resolve_backend,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
    size_pool,
)
from asyncpage.core.draft import load_draft
from asyncpage.core.runner import kv_bytes_per_block
from asyncpage.decoding.speculative import SpeculativeConfig
from asyncpage.errors import InvalidRequestError
from asyncpage.guided import GrammarManager
from asyncpage.model.compiled import enable as compile_decode
from asyncpage.model.gguf_linear import unpadded_rows
from asyncpage.model.weights import LoadedModel, load
from asyncpage.runtime.compute import ComputeThread
from asyncpage.runtime.heap import trim_heap

log = logging.getLogger(__name__)

# The class built: AsyncEngine or a subclass (asyncpage.disagg's workers), never named here.
E = TypeVar("E")


def env_flag(name: str) -> bool:
    """An on/off environment switch: unset, "", "0", "false", "no" and "off" are off."""
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def compiled_steps_can_run(options: EngineOptions, dev: str, dt: str) -> bool:
    """Where compiled decode steps can run (compiled.CompiledDecode.applies): the CPU, torch attention,
    a pool of the model's dtype. Elsewhere compiling would cost its time and never be used."""
    return (dev == "cpu" and resolve_backend(options.attention_backend, dev, options.block_size) == "torch"
            and resolve_kv_cache_dtype(options.kv_cache_dtype, dt) == dt)


def from_pretrained(cls: Callable[..., E], model: str | os.PathLike[str] | None, *, dtype: str, device: str,
                    num_threads: int | None, quantization: str | None, debug_checks: bool | None,
                    speculative_config: dict[str, Any] | None, compile: bool | None,
                    chat_template: str | None = None, **pool_options: Any) -> E:
    """AsyncEngine.from_pretrained (its docstring says what each option does). `pool_options`: the
    pool and scheduling options, the ones a clone may change (from_pretrained's other keywords)."""
    check_load_options(num_threads, compile)
    dev = resolve_device(device)
    check_quantization(quantization)
    dt = resolve_dtype(dtype, dev)
    if debug_checks is None:
        debug_checks = env_flag("ASYNCPAGE_DEBUG_CHECKS")
    options = EngineOptions(**pool_options, debug_checks=debug_checks,
                            speculative_config=SpeculativeConfig.parse(speculative_config))
    options.check()
    resolve_backend(options.attention_backend, dev, options.block_size)  # refuse before minutes of loading
    threads = num_threads or len(os.sched_getaffinity(0))
    # All torch work on one thread with one deliberately sized pool (see compute.py); with the
    # default thread count it follows the cores other processes leave free (cpu_share.py).
    compute = ComputeThread(threads, adaptive=num_threads is None)
    if chat_template is not None and (not isinstance(chat_template, str) or not chat_template.strip()):
        raise InvalidRequestError("chat_template", "must be a non-empty Jinja template string")
    loaded = compute.run(load, model, getattr(torch, dt), torch.device(dev), quantization)
    if chat_template is not None:
        loaded.tokenizer.chat_template = chat_template  # what chat() and apply_chat_template render with
    if compile is None:
        compile = env_flag("ASYNCPAGE_COMPILE")
    if compile and compiled_steps_can_run(options, dev, dt):
        # Every thread count the compute thread may pick (it follows free cores; cpu_share.py),
        # up to 4: on bigger machines only its full count is compiled, the others run eager.
        counts = range(1, threads + 1) if num_threads is None and threads <= 4 else [threads]
        compute.run(compile_decode, loaded.model, getattr(torch, dt), counts)
    spec = SpeculativeConfig.parse(speculative_config)
    draft = None
    if spec is not None and spec.method == "draft":
        draft = compute.run(load_draft, spec, loaded, getattr(torch, dt), torch.device(dev))
    engine = compute.run(build, cls, loaded, dt, dev, compute, options, None, draft)
    trim_heap()  # what building the engine freed (its warm-up, the KV pool's setup), back to the system
    return engine


def clone(cls: Callable[..., E], loaded: LoadedModel, config: EngineConfig, compute: ComputeThread,
          guided: GrammarManager, options: EngineOptions, draft: LoadedModel | None,
          overrides: dict[str, Any]) -> E:
    """AsyncEngine.clone: a `cls` on the same weights, tokenizer, compute thread and prepared grammar
    tokenizer as the engine whose parts these are, with `overrides` of its `options`."""
    bad = set(overrides) - EngineOptions.names()
    if bad:
        raise InvalidRequestError(sorted(bad)[0], "cannot differ between engines sharing weights")
    mine = options.speculative_config  # the draft model `draft` was loaded for, if any
    options = msgspec.structs.replace(options, **overrides)
    options = msgspec.structs.replace(options, speculative_config=SpeculativeConfig.parse(options.speculative_config))
    options.check()
    spec = options.speculative_config
    if spec is None or spec.method != "draft":
        draft = None
    elif draft is None or mine is None or (mine.model, mine.quantization) != (spec.model, spec.quantization):
        draft = compute.run(load_draft, spec, loaded, getattr(torch, config.dtype), torch.device(config.device))
    return compute.run(build, cls, loaded, config.dtype, config.device, compute, options, guided, draft)


def build(cls: Callable[..., E], loaded: LoadedModel, dt: str, dev: str, compute: ComputeThread,
          options: EngineOptions, parent_guided: GrammarManager | None = None,
          draft: LoadedModel | None = None) -> E:
    """The engine itself, on loaded weights (run on the compute thread: the KV pool is allocated)."""
    mc = loaded.config
    ctx = int(getattr(mc, "max_position_embeddings", 8192))
    max_len = min(ctx, options.max_model_len) if options.max_model_len else ctx
    kv_dt = resolve_kv_cache_dtype(options.kv_cache_dtype, dt)
    per_block = kv_bytes_per_block(loaded.model, options.block_size, getattr(torch, kv_dt))
    whole: Any = loaded.model  # the head included (its rows bound a verify too)
    spec = verified_in_kernels(options.speculative_config, unpadded_rows(whole))
    config = EngineConfig(
        dtype=dt, device=dev, block_size=options.block_size,
        num_kv_blocks=size_pool(options, per_block, max_len, dev),
        max_num_batched_tokens=options.max_num_batched_tokens, max_num_seqs=options.max_num_seqs,
        max_model_len=max_len, enable_prefix_caching=options.enable_prefix_caching,
        attention_backend=resolve_backend(options.attention_backend, dev, options.block_size),
        num_threads=compute.num_threads, debug_checks=options.debug_checks,
        eviction_policy=options.eviction_policy, kv_cache_dtype=kv_dt,
        max_queued_requests=options.max_queued_requests,
        quantization=loaded.quantization, speculative=spec,
        compiled=getattr(loaded.model, "compiled", None) is not None and compiled_steps_can_run(options, dev, dt))
    # Masks cover every id either side knows: some checkpoints' tokenizers have more entries than
    # the logits (Gemma 3 on the hub: 262,145 vs 262,144); masks are sliced to the logits at use.
    mask_vocab = max(int(mc.vocab_size), len(loaded.tokenizer))
    guided = GrammarManager(loaded.tokenizer, mask_vocab, sorted(loaded.eos_token_ids),
                            options.guided_backend, options.grammar_compile_timeout)
    # Adapting a tokenizer for the grammar engine holds the GIL for seconds at a time (2.1 s of a
    # 3.8 s build for the 262k vocabulary, measured): done lazily under a running loop it stalled the
    # host's event loop (a 4.4 s lag in the soak). So it is done here, at load, and shared by clones.
    guided.prepare(parent_guided)
    trim_heap()  # what adapting the tokenizer freed, back to the system
    return cls(loaded, config, compute, guided, draft, options)


def verified_in_kernels(spec: SpeculativeConfig | None, rows: int) -> SpeculativeConfig | None:
    """`spec` with at most `rows` - 1 drafts where the GGUF block kernels run steps of up to `rows` rows (the portable
    form's 8): a verify of more rows would run the dequantized GEMM above them, whose numbers are not the one-row
    kernels', and greedy output would change with speculation (the review's k=8 in the portable form)."""
    if spec is None or rows <= 1 or spec.num_speculative_tokens < rows:
        return spec
    log.warning("speculative_config: num_speculative_tokens %d capped to %d, the rows this CPU's block kernels take "
                "in one step (a verify past them would change greedy output)", spec.num_speculative_tokens, rows - 1)
    return msgspec.structs.replace(spec, num_speculative_tokens=rows - 1)

