"""A GGUF file's tokenizer: converted by transformers' GGUF reader when the file is indexed (gguf.py's
`_index_gguf`: `load`), saved beside the index as a tokenizer.json folder (`save`), then loaded from there at every
load (`cached_tokenizer`). The conversion is mended where it differs from what llama.cpp reads in the file: a
token its byte-level classes add that the file lacks, and a pre-tokenizer split transformers does not know."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from asyncpage.runtime.heap import trim_heap

log = logging.getLogger("asyncpage")

# llama.cpp ends generation on these tokens, known by their text (its EOG list, llama-vocab.cpp); a
# GGUF has no generation config to say so. Those of the supported families: Gemma's end of turn,
# Qwen's (<|endoftext|> ends Qwen2/3 turns too: in their generation configs, not their GGUF's eos id),
# Llama 3's.
END_OF_TURN = ("<end_of_turn>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")

# `tokenizer.ggml.pre` names llama.cpp splits with "\p{N}" (each digit alone) before GPT-2's expression
# (llama-vocab.cpp: STARCODER, REFACT, COMMAND_R, SMOLLM, CODESHELL, EXAONE, MINERVA, MELLUM2), and which
# transformers' GGUF conversion leaves at GPT-2's alone: SmolLM's "2024" was one token, not four. The same
# two expressions in tokenizers' terms: each digit alone (Digits), then GPT-2's byte-level split (ByteLevel's regex).
_DIGITS_FIRST = ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2")
_DIGITS_THEN_GPT2 = {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}


def end_of_turn_ids(tokenizer: Any) -> set[int]:
    """The ids of END_OF_TURN's tokens the tokenizer has."""
    ids: set[int] = set()
    for tok in END_OF_TURN:
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return ids


def cached(folder: Path, eos_token_ids: list[int]) -> tuple[Any, set[int]]:
    """The tokenizer `save` wrote into `folder`, and the ids that end generation: the index's `eos_token_ids`
    and END_OF_TURN's, read again here (an index cached before a token joined that list gets it)."""
    tokenizer = cached_tokenizer(folder)
    return tokenizer, set(eos_token_ids) | end_of_turn_ids(tokenizer)


def cached_tokenizer(folder: Path) -> Any:
    """The tokenizer `save` wrote, loaded as its tokenizer.json stands: transformers' generic fast
    tokenizer, its special tokens and chat template from the saved config. The model's own class
    (GemmaTokenizer and the like) would rebuild the same Rust tokenizer from Python copies of the vocabulary
    and merges: for a 262k vocabulary 3.6 s against 1.2 here, and 14 MiB more kept at the end of an engine's
    load (the same ids, text, specials and padding side: tests/test_gguf_tokenizer.py; the folder was saved
    from that class, with what its construction adds, such as Qwen2's NFC normalizer). Then the heap freed by
    parsing the JSON is handed back (trim_heap). Built from the folder's files directly, not `from_pretrained`: that
    passes the config's `added_tokens_decoder` on, whose tokens the constructor adds to the Rust tokenizer again
    though its tokenizer.json holds them (8-11 MiB more kept for Gemma's 6,384; the same ids, text, specials and
    template either way: tests/test_gguf_tokenizer.py)."""
    from transformers import PreTrainedTokenizerFast

    config = json.loads((folder / "tokenizer_config.json").read_text())
    kwargs = {k: v for k, v in config.items() if k not in _NOT_INIT}
    template = folder / "chat_template.jinja"
    if template.is_file():  # before the config's, as transformers reads it
        kwargs["chat_template"] = template.read_text()
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), name_or_path=str(folder),
                                        **kwargs)
    trim_heap()
    return tokenizer


# A saved config's entries that are no constructor's argument: the added tokens (tokenizer.json holds them), what
# names the class and where it was read from.
# "add_bos_token" / "add_eos_token": from_pretrained drops them for this class (the tokenizer.json's post-processor
# decides), so they are dropped here too.
_NOT_INIT = frozenset(("added_tokens_decoder", "tokenizer_class", "backend", "is_local", "local_files_only",
                       "auto_map", "name_or_path", "add_bos_token", "add_eos_token"))


def load(path: Path) -> Any:
    """The file's tokenizer as transformers' GGUF reader converts it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def save(tokenizer: Any, folder: Path, n_vocab: int, pre: str | None) -> None:
    """`tokenizer` (from `load`) saved into `folder` for `cached_tokenizer`, mended (module doc); `n_vocab`: the
    file's token count, `pre`: its `tokenizer.ggml.pre`. The model's own class (not the generic one) rebuilds its
    backend at construction, adding what the converted one lacks (Qwen2Tokenizer's NFC normalizer): the folder is
    saved again from that class reading it back, so the generic class that loads it reads it as saved; with the
    class's padding side, which it does not save."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    rebuild, padding_side = type(tokenizer) is not PreTrainedTokenizerFast, tokenizer.padding_side
    tokenizer.save_pretrained(folder)
    if rebuild:
        AutoTokenizer.from_pretrained(folder).save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["padding_side"] = padding_side
    data = json.loads((folder / "tokenizer.json").read_text())
    changed = _without_phantoms(data, config, n_vocab)
    if pre in _DIGITS_FIRST and data.get("pre_tokenizer") != _DIGITS_THEN_GPT2:
        data["pre_tokenizer"] = _DIGITS_THEN_GPT2
        changed = True
    if changed:
        (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    # The added tokens as the config's own list: without one, transformers' from_pretrained parses the whole
    # tokenizer.json in Python at every load to read them from it (1.1-1.5 s of a 33 MB file for Gemma's 6,384).
    added = data.get("added_tokens", [])
    config["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _without_phantoms(data: dict[str, Any], config: dict[str, Any], n_vocab: int) -> bool:
    """Drop from a tokenizer.json's `data` the added tokens past the file's `n_vocab` tokens, and from
    `config`'s special tokens; whether there were any. transformers' GGUF conversion builds a byte-level
    vocabulary with GPT2Tokenizer or Qwen2Tokenizer, whose constructors add their default "<|endoftext|>"
    where the file has none (Llama 3's has <|end_of_text|>): text spelling it would become an id the model
    has no embedding row for, where llama.cpp reads it as text."""
    added: list[dict[str, Any]] = data.get("added_tokens", [])
    phantoms = {t["content"] for t in added if t["id"] >= n_vocab}
    if not phantoms:
        return False
    data["added_tokens"] = [t for t in added if t["id"] < n_vocab]
    for key, value in list(config.items()):
        if isinstance(value, str) and key.endswith("_token") and value in phantoms:
            config[key] = None
        elif isinstance(value, list) and key.endswith("special_tokens"):
            config[key] = [v for v in value if v not in phantoms]
    log.info("the tokenizer converted from the GGUF added %s, which the file lacks: left out", sorted(phantoms))
    return True
