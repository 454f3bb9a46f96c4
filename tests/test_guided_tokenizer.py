"""The grammar backend's tokenizer is built over the engine's own HF tokenizer (guided/lltokenizer.py),
not a second copy of it, and reads every token exactly as llguidance's own JSON-built one does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import llguidance.hf
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from asyncpage.guided.lltokenizer import decoder_kind, encodes_as_llguidance, lean_tokenizer
from asyncpage.model.weights import load_tokenizer

TEXTS = ['{"name": "Alice", "age": 31}', "héllo wörld 日本語 <eos> <start_of_turn>", "  \n\n\t x", "a  b",
         "ORD-12345, refund?", " leading space", "emoji 🤖 and \u2581 the metaspace char", "<bos><pad>"]
RAW = [b"\xe6\x97", b"abc\xff", b'"key": 1', b""]


def same_as_llguidance(hf: Any, n_vocab: int, eos: list[int]) -> tuple[Any, Any]:
    lean = lean_tokenizer(hf, n_vocab, eos)
    ref = llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab, eos_token=eos)
    assert (lean.vocab_size, lean.eos_tokens) == (ref.vocab_size, ref.eos_tokens)
    differ = [i for i in range(n_vocab)
              if lean.decode_bytes([i]) != ref.decode_bytes([i]) or lean.is_special_token(i) != ref.is_special_token(i)]
    assert differ == [], f"{len(differ)} tokens read differently, first {differ[:5]}"
    for text in [t.encode() for t in TEXTS] + RAW:
        assert lean.tokenize_bytes(text) == ref.tokenize_bytes(text), text
    return lean, ref


def test_the_default_models_262k_tokens_read_as_llguidance_reads_them() -> None:
    tokenizer, _, eos = load_tokenizer(None)
    assert decoder_kind(tokenizer.backend_tokenizer) == ("byte_fallback", "\u2581")
    _, ref = same_as_llguidance(tokenizer, 262144, sorted(eos))
    assert sum(ref.is_special_token(i) for i in range(262144)) > 6000  # <eos>, <start_of_turn>, <unusedN>, ...


def test_a_byte_level_tokenizer_with_padding_past_its_vocabulary_reads_the_same(tiny_llama: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    assert decoder_kind(tokenizer.backend_tokenizer) == ("byte_level", " ")
    # Logits wider than the tokenizer (as some checkpoints have): the extra ids are special placeholders.
    lean, _ = same_as_llguidance(tokenizer, len(tokenizer) + 5, [tokenizer.eos_token_id])
    assert lean.is_special_token(len(tokenizer) + 4)


def test_added_tokens_and_a_saved_truncation_read_as_llguidance_reads_them(tiny_llama: Path, tmp_path: Path) -> None:
    # Added non-special tokens are converted like the rest ('é' is byte 0xE9, 'ÿ' byte 0xFF, 'Ġfoo' ' foo');
    # truncation saved in tokenizer.json (llguidance's own copy drops it) keeps the JSON-built form.
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    tokenizer.add_tokens(["é", "ÿ", "\u0120foo", "<tag>", "hello world"])
    tokenizer.backend_tokenizer.enable_truncation(max_length=4)
    tokenizer.save_pretrained(tmp_path)
    saved = AutoTokenizer.from_pretrained(tmp_path)
    assert saved.backend_tokenizer.truncation is not None
    same_as_llguidance(saved, len(saved), [saved.eos_token_id])
    saved.backend_tokenizer.no_truncation()
    lean, _ = same_as_llguidance(saved, len(saved), [saved.eos_token_id])
    assert lean.tokenize_bytes(b"x" * 40) != []  # the whole text, not 4 tokens of it


def _metaspace(prepend: str) -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)},
             "\u2581": 259, "a": 260, "\u2581a": 261, "b": 262, "\u2581b": 263}
    tk = Tokenizer(models.BPE(vocab, [("\u2581", "a"), ("\u2581", "b")], unk_token="<unk>", byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Replace(" ", "\u2581")])
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=prepend)
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("prepend", ["first", "never"])
def test_a_metaspace_tokenizer_encodes_as_llguidance_whether_or_not_it_prepends_a_space(prepend: str) -> None:
    # llguidance's own copy never prepends: one that does (Llama 2, Mistral) keeps the JSON-built form.
    tokenizer = _metaspace(prepend)
    assert encodes_as_llguidance(tokenizer.backend_tokenizer) == (prepend == "never")
    lean, ref = same_as_llguidance(tokenizer, len(tokenizer), [2])
    assert lean.tokenize_bytes(b"a b") == ref.tokenize_bytes(b"a b")


def test_a_slow_tokenizer_is_refused_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="fast"):
        lean_tokenizer(object(), 10, [1])
