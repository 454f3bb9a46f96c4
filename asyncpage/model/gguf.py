"""GGUF files: their config, tokenizer and tensors read with the `gguf` package (names mapped to the
model families' own, Llama's Q/K permutation undone), the Q4_K blocks kept exact for int4, and the
per-file index cache (tensor offsets and the converted tokenizer, under the per-user cache root,
keyed by the file's path, size, mtime_ns and a hash of its first and last MiB; written whole under a
fresh name and renamed in, read back only if it is the shape this version writes)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from asyncpage.errors import ModelLoadError
from asyncpage.model import gguf_tokenizer
from asyncpage.model.gguf_linear import has_kernel
from asyncpage.model.quant import Int4, int4_from_q4_k
from asyncpage.runtime import cache_dir

log = logging.getLogger("asyncpage")


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


def _read_gguf(path: Path, blocks: dict[str, tuple[int, torch.Tensor, int]] | None = None,
               ) -> tuple[Any, dict[str, torch.Tensor], Any, set[int]]:
    """Config, dequantized weights and tokenizer of a GGUF file. With `blocks` (quantization="auto"),
    each 2-D tensor in a format the block kernels read goes there as it is stored, (ggml type, uint8
    [rows, bytes per row], values per row), instead of being dequantized; formats without a kernel
    are dequantized into the state as before, said once per format in the log.

    gguf's GGUFReader parses every metadata array in Python (10+ s for a 262k vocabulary), so the
    first load writes a small index (config, tensor offsets and types) and the converted tokenizer
    to the cache; later loads memory-map the tensors straight from the index."""
    from transformers import AutoConfig

    cached, index = _gguf_index(path)
    model_type = index["model_type"]
    config = AutoConfig.for_model(model_type, **index["config"])
    state: dict[str, torch.Tensor] = {}
    no_kernel: dict[str, int] = {}
    for t in index["tensors"]:
        if t["name"] == "rope_freqs.weight":
            config.rope_freq_factors = _rope_freq_factors(path, t, config, model_type)
            continue
        name = _gguf_tensor_name(t["name"], model_type)
        if name is None:
            continue
        if blocks is not None and t["type"] not in _FLOAT_TYPES:
            if has_kernel(t["type"], t["shape"]):
                raw = torch.from_numpy(np.fromfile(path, dtype=np.uint8, count=t["n_bytes"], offset=t["offset"]))
                data = raw.reshape(t["shape"][1], -1)
                if model_type == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                    heads = index["config"]["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
                    data = _unpermute(data, heads).contiguous()  # whole rows: the blocks move as they are
                blocks[name] = (t["type"], data, t["shape"][0])
                continue
            fmt = _type_name(t["type"])
            no_kernel[fmt] = no_kernel.get(fmt, 0) + 1
        state[name] = _dequantize(path, t)
    for fmt, count in sorted(no_kernel.items()):
        log.warning("no block kernel for %s (%d tensors of %s): those tensors are dequantized (dense weights under "
                    "quantization='auto', written as blocks again under 'int8' / 'int4')", fmt, count, path.name)
    for name, w in state.items():
        if model_type == "gemma3_text" and name.endswith("norm.weight"):
            w -= 1.0  # llama.cpp stores Gemma's (1 + w) norm weights as 1 + w
        if model_type == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            # llama.cpp permutes Llama's Q/K rows to its interleaved RoPE layout; undo it.
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            state[name] = _unpermute(w, heads)
    tokenizer, eos = gguf_tokenizer.cached(cached / "tokenizer", index["eos_token_ids"])
    return config, state, tokenizer, eos


_MAX_ROPE_FACTOR = 1e4  # Llama 3's are 1 to its `factor` (8 or 32); a wavelength 10,000 times longer reads as none


def _rope_freq_factors(path: Path, t: dict[str, Any], config: Any, model_type: str) -> list[float]:
    """The `rope_freqs` tensor: one factor per rotary frequency, which llama.cpp divides it by (ggml_rope_ext's
    freq_factors). Its converter writes Llama 3's RoPE scaling (rope_type "llama3") so, and nothing in the
    metadata says it; layers.rope_inv_freq applies them. Only Llama's graph reads it: another family's file
    holding one is refused, as llama.cpp refuses a tensor its graph does not take."""
    if model_type != "llama":
        raise ModelLoadError(f"{path.name}: a {model_type} file with a rope_freqs tensor (llama.cpp reads one for "
                             "Llama only)")
    factors = _dequantize(path, t).flatten()
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    problem = (f"it holds {factors.numel()}" if factors.numel() != dim // 2 else
               "one is not finite" if not bool(torch.isfinite(factors).all()) else
               f"one is outside [1/{_MAX_ROPE_FACTOR:g}, {_MAX_ROPE_FACTOR:g}]"
               if bool(((factors < 1 / _MAX_ROPE_FACTOR) | (factors > _MAX_ROPE_FACTOR)).any()) else None)
    if problem is not None:
        raise ModelLoadError(f"{path.name}: rope_freqs must hold {dim // 2} factors (one per rotary frequency), "
                             f"each positive and finite; {problem}")
    return [float(x) for x in factors]


# What an index.json this version writes holds; another is rebuilt, not read (the key changed with
# version 2, so older entries are simply never looked up again; version 3's tokenizer folder is saved
# from the model's own tokenizer class, version 4's config lists the added tokens, version 5's tokenizer
# has no token the file lacks and llama.cpp's digit split: gguf_tokenizer.save).
_INDEX_VERSION = 5
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


_FLOAT_TYPES = (0, 1, 30)  # F32, F16, BF16: float weights, kept float under "auto"


def _type_name(ggml_type: int) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"ggml type {ggml_type}"


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
    tokenizer = gguf_tokenizer.load(path)
    eos: set[int] = set()
    eos_id = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
    if eos_id is not None:
        eos.add(int(eos_id))
    eos |= gguf_tokenizer.end_of_turn_ids(tokenizer)
    config_kwargs = _gguf_config_kwargs(reader, arch, model_type)
    n_vocab = int(config_kwargs["vocab_size"])
    pre = _gguf_field(reader, "tokenizer.ggml.pre")
    index = {"version": _INDEX_VERSION, "source": str(path), "model_type": model_type, "config": config_kwargs,
             "tensors": tensors, "eos_token_ids": sorted(i for i in eos if i < n_vocab)}
    del reader  # its parsed metadata (hundreds of MiB for a 262k vocabulary) is not needed past here
    # Written into a fresh private folder and renamed in whole; a concurrent first load that renamed
    # its own in first is kept (fresh_dir), and both read that one.
    with cache_dir.fresh_dir(dest) as tmp:
        gguf_tokenizer.save(tokenizer, tmp / "tokenizer", n_vocab, pre if isinstance(pre, str) else None)
        del tokenizer
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
        return None  # rope_freqs: read by _read_gguf into the config
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
