"""llguidance's tokenizer for a Hugging Face one, holding no second copy of it.

`llguidance.hf.from_tokenizer` serialises the HF tokenizer to JSON and parses it again in Rust, so
llguidance holds a whole second tokenizer (vocabulary, merges) beside its token trie and slices. For the
default model's 262,144 tokens that cost 4.3 s at load and ~220 MiB kept (~120 of them the copy), with
~100 MiB more of transient JSON and a copied backend that left the heap fragmented.

Here each token's bytes are read off the vocabulary by llguidance's own rules (toktrie_hf_tokenizers:
a `ByteLevel` decoder maps GPT-2's byte-to-character table back; a `ByteFallback` one reads `<0xNN>`
tokens as their byte and the `Replace` decoder's space character as a space; added tokens that are
special or spelled `<...>` are special, never spelled by a grammar's text), and the LLTokenizer is built
from those bytes over the tokenizer the engine already holds (`TokenizerWrapper`, the form llguidance
takes from guidance): 1.4 s, ~78 MiB (its slices: _SLICES). llguidance tokenizes only to spell forced and
closing text, never to build a mask; the Rust copy it no longer makes had its `Prepend` normalizers dropped
and Metaspace set never to prepend, so a tokenizer with either still takes the JSON path (as does a decoder of
another kind, which llguidance refuses as before). tests/test_guided_tokenizer.py checks every token's
bytes, specials and a set of tokenizations against the JSON-built form.
"""

from __future__ import annotations

import json
from typing import Any

# llguidance's slices (sub-tries of the vocabulary that speed a mask where a lexeme allows one of these regexes
# whole) less its first, free whitespace ("[\\x20\\x0A\\x0D\\x09]+"): each slice kept ~16 MiB for the default
# model's 262,144 tokens (all four 94 MiB, these three 78), and the whitespace one sped no mask measured (a JSON
# schema's masks with the engine's bounded separators and with free whitespace: 51-55 us a token either way;
# the string slices do: a 25-character maxLength string without "{1,10}" took 376 against 174 us a token).
_SLICES = [r'[^"\\\x00-\x1F\x7F]{1,10}', r'[^"\\\x00-\x1F\x7F]{1,30}', r'[^"\\\x00-\x1F\x7F]+']
_SELF_MAPPED = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]


def _byte_level_map() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: a byte-level token's character -> its byte."""
    table: dict[str, int] = {}
    k = 0x100
    for b in range(256):
        if b in _SELF_MAPPED:
            table[chr(b)] = b
        else:
            table[chr(k)] = b
            k += 1
    return table


def _state(part: Any) -> dict[str, Any] | None:
    return None if part is None else json.loads(part.__getstate__())


def _parts(state: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    """A component and, for a Sequence, its members (recursively)."""
    if state is None:
        return []
    if state.get("type") == "Sequence":
        return [p for s in state.get(key, []) for p in _parts(s, key)]
    return [state]


def decoder_kind(backend: Any) -> tuple[str, str] | None:
    """("byte_fallback" | "byte_level", the space character) as llguidance reads the decoder, or None
    where it cannot (llguidance itself refuses such a tokenizer)."""
    state = _state(backend.decoder)
    if state is None:
        return None
    if state.get("type") == "ByteLevel":
        return "byte_level", " "
    if state.get("type") != "Sequence":
        return None
    kinds = {d.get("type") for d in state.get("decoders", [])}
    space = " "
    for d in _parts(state, "decoders"):  # llguidance finds the Replace in nested sequences too
        pattern = d.get("pattern") or {}
        if d.get("type") == "Replace" and d.get("content") == " " and len(pattern.get("String") or "") == 1:
            space = pattern["String"]
    if "ByteFallback" in kinds:
        return "byte_fallback", space
    return ("byte_level", space) if "ByteLevel" in kinds else None


def encodes_as_llguidance(backend: Any) -> bool:
    """Whether the tokenizer encodes text as llguidance's own copy would: no `Prepend` normalizer, no
    Metaspace pre-tokenizer that prepends (the two it turns off in its copy), no truncation or padding
    (off in its copy too; a tokenizer.json may carry them), special tokens recognised in text."""
    if backend.truncation is not None or backend.padding is not None or backend.encode_special_tokens:
        return False
    if any(p.get("type") == "Prepend" for p in _parts(_state(backend.normalizer), "normalizers")):
        return False
    return not any(p.get("type") == "Metaspace" and str(p.get("prepend_scheme", "always")).lower() != "never"
                   for p in _parts(_state(backend.pre_tokenizer), "pretokenizers"))


def token_bytes(backend: Any, n_vocab: int, kind: str, space: str) -> tuple[list[bytes], list[int]]:
    """Each id's bytes (n_vocab of them) and the special ids, as llguidance converts them."""
    special: list[int] = []
    added: dict[int, bytes] = {}
    for i, tok in backend.get_added_tokens_decoder().items():
        if tok.special or (tok.content.startswith("<") and tok.content.endswith(">")):
            special.append(i)
        else:
            added[i] = tok.content.encode()  # kept only where the conversion below fails
    table = _byte_level_map() if kind == "byte_level" else {}
    size = backend.get_vocab_size(with_added_tokens=True)
    special += range(size, n_vocab)  # ids past the vocabulary: special placeholders, as llguidance pads
    specials = set(special)
    tokens: list[bytes] = []
    for i in range(n_vocab):
        name = backend.id_to_token(i) if i < size else f"<[{i}]>"
        if name is None:
            b = added.get(i, b"")  # a hole in the vocabulary: llguidance leaves it empty
        elif i in specials:
            b = name.encode()
        elif kind == "byte_fallback":
            if len(name) == 6 and name.startswith("<0x") and name.endswith(">"):
                b = bytes([int(name[3:5], 16)])
            else:
                b = name.replace(space, " ").encode()
        else:
            try:
                b = bytes(table[c] for c in name)
            except KeyError:
                b = added.get(i, b"")  # llguidance keeps an added token's text, else leaves it empty
        tokens.append(b)
    return tokens, sorted(set(special))


class _Encode:
    """The HF tokenizer as llguidance's TokenizerWrapper calls it: text (or UTF-8 bytes) to ids,
    encoded as llguidance's Rust copy did (`add_special_tokens=False`)."""

    def __init__(self, backend: Any, tokens: list[bytes], special: list[int], eos: int, bos: int | None) -> None:
        self._backend = backend
        self.tokens = tokens
        self.special_token_ids = special
        self.eos_token_id = eos
        self.bos_token_id = bos

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8")  # llguidance passes a valid UTF-8 prefix only
        return list(self._backend.encode(text, add_special_tokens=False).ids)


def lean_tokenizer(hf_tokenizer: Any, n_vocab: int, eos_token: list[int]) -> Any:
    """An llguidance LLTokenizer for `hf_tokenizer` (module doc); llguidance.hf's where this one
    cannot be built the same way; ValueError for a tokenizer that is not a fast one."""
    import llguidance
    import llguidance.hf
    from llguidance._tokenizer import TokenizerWrapper

    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("only fast (Rust-backed) Hugging Face tokenizers are supported")
    kind = decoder_kind(backend)
    if (kind is None or not encodes_as_llguidance(backend) or not eos_token
            or backend.get_vocab_size(with_added_tokens=True) > n_vocab):
        return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab, eos_token=eos_token, slices=_SLICES)
    tokens, special = token_bytes(backend, n_vocab, *kind)
    encode = _Encode(backend, tokens, special, eos_token[0], hf_tokenizer.bos_token_id)
    lltok = llguidance.LLTokenizer(TokenizerWrapper(encode), n_vocab=n_vocab, eos_token=eos_token, slices=_SLICES)
    # Read into llguidance's own trie as it was built (its decode reads that); the wrapper, which it
    # keeps for tokenizing, would otherwise keep the 262,144 bytes objects too (~12 MiB).
    tokens.clear()
    return lltok
