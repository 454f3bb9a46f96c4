"""A GGUF's tokenizer, loaded from the index's saved tokenizer.json (model/gguf_tokenizer.py `cached_tokenizer`),
is the tokenizer transformers' own class for the model gives: the same ids for any text, the same text
back for any ids, the same special tokens."""

from __future__ import annotations

import random

import pytest

from asyncpage.model.gguf import _gguf_index
from asyncpage.model.weights import load_tokenizer, resolve

TEXTS = [
    "Hello , world . It 's fine", "  two leading spaces", "tab\there\n\nnew lines\r\n", "a  b   c    d",
    '{"name": "Alice", "age": 31}', "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "emoji 😀, 中文, ﬁ ligature, Zürich, Zu\u0308rich, cafe\u0301, \u212b", "<bos>inside<eos>",
    "ORD-12345 #A77812 $1,299.00", " ", "",
]


@pytest.fixture(scope="module")
def both() -> tuple[object, object]:
    """(the engine's tokenizer of the default GGUF, transformers' GemmaTokenizer of the same folder)"""
    from transformers import AutoTokenizer

    ours = load_tokenizer(None)[0]
    cached, _ = _gguf_index(resolve(None))
    return ours, AutoTokenizer.from_pretrained(cached / "tokenizer")


def test_the_default_models_tokenizer_gives_the_ids_of_its_own_class(both: tuple[object, object]) -> None:
    ours, theirs = both
    assert type(theirs).__name__ == "GemmaTokenizer"
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids", "chat_template",
                 "padding_side"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert len(ours) == len(theirs) == 262144  # type: ignore[arg-type]
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == theirs.encode(  # type: ignore[attr-defined]
                text, add_special_tokens=special), text


def test_the_default_models_tokenizer_decodes_any_ids_as_its_own_class(both: tuple[object, object]) -> None:
    ours, theirs = both
    rng = random.Random(0)
    seqs = [ours.encode(t) for t in TEXTS] + [  # type: ignore[attr-defined]
        [rng.randrange(262144) for _ in range(rng.randrange(1, 12))] for _ in range(500)]
    for ids in seqs:
        assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)  # type: ignore[attr-defined]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(  # type: ignore[attr-defined]
                ids, skip_special_tokens=skip), ids


def test_the_cached_config_lists_the_tokenizer_files_added_tokens() -> None:
    """So loading reads them from the small config, not by parsing the whole tokenizer.json in Python."""
    import json

    cached, _ = _gguf_index(resolve(None))
    config = json.loads((cached / "tokenizer" / "tokenizer_config.json").read_text())
    added = json.loads((cached / "tokenizer" / "tokenizer.json").read_text())["added_tokens"]
    assert len(added) == 6384
    assert config["added_tokens_decoder"] == {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}

