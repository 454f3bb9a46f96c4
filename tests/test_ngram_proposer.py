"""The n-gram proposer (decoding/ngram.py): what it drafts from a sequence's own tokens, read through a
tokenizer's vocabulary (a fake one here, SentencePiece-style: "▁" marks a leading space)."""

from __future__ import annotations

from asyncpage.decoding.ngram import NgramIndex, TokenForms
from asyncpage.decoding.speculative import SpecState, SpeculativeConfig


class Vocab:
    """convert_ids_to_tokens / convert_tokens_to_ids over a list of pieces; ids are list positions."""

    unk_token_id = 0

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = ["<unk>", *pieces]
        self.ids = {p: i for i, p in enumerate(self.pieces)}

    def convert_ids_to_tokens(self, i: int) -> str:
        return self.pieces[i]

    def convert_tokens_to_ids(self, piece: str) -> int:
        return self.ids.get(piece, 0)

    def __call__(self, *pieces: str) -> list[int]:
        return [self.ids[p] for p in pieces]


V = Vocab(["Customer", ":", "▁Margaret", "Margaret", "▁Ok", "onk", "wo", "\n", "Email", "▁marg", "marg", "aret",
           "@", "north", "{\"", "customer", "\":", "▁\"", "\",", "email", "▁the", "▁cat", "▁dog", "▁sat", ".",
           "▁42", "▁\"[", "x"])


def index(lookup_min: int = 2, lookup_max: int = 4) -> NgramIndex:
    return NgramIndex(lookup_min, lookup_max, TokenForms(V))


def test_a_copied_word_is_found_whatever_its_leading_space() -> None:
    # The record has " Margaret"; the model writes "Margaret" right after a JSON quote: one word.
    prompt = V("Customer", ":", "▁Margaret", "▁Ok", "onk", "wo", "\n")
    out = V("{\"", "customer", "\":", "▁\"", "Margaret")
    assert index().propose(prompt + out, 4) == V("▁Ok", "onk", "wo", "\n")


def test_a_short_token_alone_proposes_nothing() -> None:
    tokens = V("x", "▁cat", "x", "▁dog", "x")  # "x" recurs with other followers: too short to stand alone
    assert index().propose(tokens, 4) == []


def test_a_field_label_drafts_its_value_after_the_key() -> None:
    prompt = V("Email", ":", "▁marg", "aret", "@", "north", "\n")
    out = V("{\"", "email", "\":", "▁\"")
    # After `"email": "` the value starts without a space: " marg" becomes "marg".
    assert index().propose(prompt + out, 3) == V("marg", "aret", "@")


def test_the_separator_usually_next_is_drafted_before_a_label_value() -> None:
    prompt = V("Customer", ":", "▁Margaret", "\n", "Email", ":", "▁marg", "aret", "\n")
    # Two keys already written, each `":` followed by ` "`: the third key's draft starts with ` "`.
    out = V("{\"", "customer", "\":", "▁\"", "Margaret", "\",", "▁\"", "customer", "\":", "▁\"", "Margaret",
            "\",", "▁\"", "email", "\":")
    assert index().propose(prompt + out, 3) == V("▁\"", "marg", "aret")


def test_an_ngram_whose_last_two_followers_differ_proposes_nothing() -> None:
    # `": "` before every value of a JSON object: each time something else follows.
    a = V("\":", "▁\"", "▁cat", "\":", "▁\"", "▁dog", "\":", "▁\"")
    assert index().propose(a, 4) == []
    # A loop: once the last two turns agree, it predicts again.
    loop = V("▁the", "▁cat", "▁sat", "▁the", "▁dog", "▁sat", "▁the", "▁dog", "▁sat", "▁the")
    assert index().propose(loop, 2) == V("▁dog", "▁sat")


def test_without_a_tokenizer_ids_are_compared_as_before() -> None:
    state = SpecState(SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3))
    assert state.propose([1, 2, 3, 9, 1, 2], 5) == [3, 9, 1]
    assert state.propose([1, 2, 3, 9, 1, 2, 7, 5, 1], 5) == []  # "1" alone: below prompt_lookup_min


def test_an_unknown_token_id_has_a_form_of_its_own() -> None:
    class Broken(Vocab):
        def convert_ids_to_tokens(self, i: int) -> str:
            if i >= len(self.pieces):
                raise IndexError(i)
            return super().convert_ids_to_tokens(i)

    forms = TokenForms(Broken(["a"]))
    assert forms.form(10_000) != forms.form(10_001) and not forms.word(10_000)
