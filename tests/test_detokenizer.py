"""Streaming text: never a split character, never re-emitted text, stop strings never leak."""

from __future__ import annotations

from typing import Any

import pytest

from asyncpage import AsyncEngine, SamplingParams
from asyncpage.decoding.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def gemma_tok(default_engine_unstarted: AsyncEngine) -> Any:
    return default_engine_unstarted.tokenizer


def _stream(tok: Any, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, [tok.bos_token_id], stop)
    pieces = [d.add(t) for t in ids]
    pieces.append(d.finish())
    return [p for p in pieces if p], d


@pytest.mark.parametrize("text", [
    "日本語のテキストです。", "emoji 🎉🚀 and 👩‍👩‍👧 family", "ünïcödé ß ∑ ≠", "中文，混合 English 文本"])
def test_multibyte_text_streams_without_replacement_chars(gemma_tok: Any, text: str) -> None:
    ids = gemma_tok(text, add_special_tokens=False).input_ids
    pieces, _ = _stream(gemma_tok, ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_byte_fallback_tokens_are_held_until_the_character_is_whole(gemma_tok: Any) -> None:
    # Force the byte-fallback path: one <0xNN> token per UTF-8 byte of each character.
    text = "🎉漢"
    ids = [gemma_tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in text.encode()]
    assert len(ids) == 7
    d = IncrementalDetokenizer(gemma_tok, [gemma_tok.bos_token_id], ())
    pieces = [d.add(t) for t in ids]
    assert pieces == ["", "", "", "🎉", "", "", "漢"]


def test_stop_string_across_token_boundaries_never_leaks(gemma_tok: Any) -> None:
    text = "The quick brown fox jumps over the lazy dog"
    ids = gemma_tok(text, add_special_tokens=False).input_ids
    pieces, d = _stream(gemma_tok, ids, stop=("n fox ju",))
    assert d.stopped
    assert "".join(pieces) == "The quick brow"
    assert not any("n" in p and "fox" in p for p in pieces)


async def test_engine_stop_string_ends_the_request_with_stop(default_engine: AsyncEngine,
                                                             reference: dict[str, Any]) -> None:
    case = reference["cases"][0]
    full = default_engine.tokenizer.decode(case["greedy_token_ids"])
    stop = "al of th"  # spans " capital", " of", " the"
    assert stop in full
    chunks = [c async for c in default_engine.stream(case["prompt"], SamplingParams(
        max_tokens=48, temperature=0, stop=[stop]))]
    text = "".join(c.text for c in chunks)
    assert text == full[: full.index(stop)]
    assert chunks[-1].finish_reason == "stop"
    assert default_engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize("stop", [(), ("🎉x",)])
def test_a_character_cut_by_the_last_token_ends_the_text_as_decode_spells_it(gemma_tok: Any,
                                                                            stop: tuple[str, ...]) -> None:
    # max_tokens met two bytes into "漢": its bytes end the text as decode() spells them (U+FFFD), not lost.
    ids = [gemma_tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "🎉漢".encode()][:6]
    pieces, d = _stream(gemma_tok, ids, stop=stop)
    expected = "🎉" + gemma_tok.decode(ids[4:])
    assert expected[1:] and set(expected[1:]) == {"\ufffd"}
    assert "".join(pieces) == d.text == expected and not d.stopped
    pieces, d = _stream(gemma_tok, ids, stop=(expected[1:],))  # a stop string the flushed tail completes
    assert "".join(pieces) == d.text == "🎉" and d.stopped


def test_a_character_cut_by_the_last_token_streams_as_decode_spells_it_byte_level(tiny_llama: Any) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)  # ByteLevel: one token per byte of an unseen character
    ids = tok("ok 漢字", add_special_tokens=False).input_ids
    cuts = [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd")]
    assert cuts
    for k in cuts:
        pieces, d = _stream(tok, ids[:k])
        assert "".join(pieces) == d.text == tok.decode(ids[:k])
