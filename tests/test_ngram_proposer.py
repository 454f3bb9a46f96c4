"""The n-gram proposer (decoding/ngram.py): what it drafts from a sequence's own tokens, read through a
tokenizer's vocabulary (a fake one here, SentencePiece-style: "▁" marks a leading space)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from asyncpage import SamplingParams
from asyncpage.decoding.ngram import NgramIndex, TokenForms
from asyncpage.decoding.sampling import SampleSpec
from asyncpage.decoding.speculative import SpecState, SpeculativeConfig, Verify, draft_masks, verify
from asyncpage.model.batch import EXACT_ROWS
from tests.test_engine_lifecycle import PROMPTS, tiny_engine


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


class Forcing:
    """A matcher that allows everything and, after token 5, forces a run of `run` tokens (100, 101, ...)."""

    def __init__(self, run: int) -> None:
        self.run, self.seen = run, []

    def accept(self, t: int) -> bool:
        self.seen.append(t)
        return True

    def is_terminated(self) -> bool:
        return False

    def forced_tokens(self) -> list[int]:
        return list(range(100, 100 + self.run)) if self.seen and self.seen[-1] == 5 else []

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = -1

    def rollback(self, n: int) -> None:
        del self.seen[len(self.seen) - n :]


@pytest.mark.parametrize("run", [3, 7, 8, 12])
def test_a_kept_draft_whose_forced_run_makes_a_chunk_is_computed_again_with_it(run: int) -> None:
    # Without drafts, token 5 and the run its grammar forces are computed next step together: as decode
    # rows when they fit a decode step (8 rows), else as one chunk. A draft kept here was computed as a
    # row; past 8 the run would be a chunk one token shorter, rounded otherwise: not kept then.
    logits = torch.full((3, 300), -1.0)
    logits[0, 5] = 1.0
    spec = SampleSpec(0, SamplingParams(temperature=0), None, matcher=Forcing(run))  # type: ignore[arg-type]
    out = verify(Verify(spec, [5, 7], [0, 1, 2], frozenset()), logits, draft_masks(
        Verify(spec, [5, 7], [0, 1, 2], frozenset()), 300))
    assert out.tokens == [5] and out.forced == list(range(100, 100 + run))
    assert out.accepted == (1 if 1 + run <= EXACT_ROWS else 0)


def test_a_draft_never_names_a_token_past_the_model_rows() -> None:
    forms = TokenForms(V, vocab_size=V.ids["Margaret"])  # "Margaret" exists in the tokenizer, not in the model
    assert forms.unspaced(V.ids["▁Margaret"]) is None
    assert TokenForms(V).unspaced(V.ids["▁Margaret"]) == V.ids["Margaret"]


async def test_a_proposer_that_raises_costs_its_sequence_the_drafts_not_the_engine(
        tiny_models: dict[str, tuple[Path, Any]], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    path = tiny_models["llama"][0]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    async with tiny_engine(path) as plain:
        want = [(await plain.generate(p, params)).token_ids for p in PROMPTS[:2]]

    def broken(self: NgramIndex, tokens: list[int], k: int, known: int | None = None) -> list[int]:
        raise RuntimeError("proposer bug")

    monkeypatch.setattr(NgramIndex, "propose", broken)
    async with tiny_engine(path, speculative_config={"method": "ngram"}) as spec:
        got = [(await spec.generate(p, params)).token_ids for p in PROMPTS[:2]]
        assert spec.stats().spec_proposed_tokens == 0
    assert got == want
    assert sum("speculative proposal failed" in r.getMessage() for r in caplog.records) == 2  # once a sequence


def test_a_long_prompt_is_indexed_over_several_proposals() -> None:
    from asyncpage.decoding.ngram import INDEX_PER_CALL

    idx = NgramIndex(2, 4, None)
    tokens = [*range(1000, 1000 + 3 * INDEX_PER_CALL), 7, 8, 9, 7, 8]  # "7 8" recurs only at the very end
    # Each proposal indexes INDEX_PER_CALL more tokens: the match is found on the fourth.
    assert [idx.propose(tokens, 2) for _ in range(4)] == [[], [], [], [9, 7]]


def test_a_label_spelled_in_several_tokens_is_one_word() -> None:
    # Byte-level BPE, its own marks: "Email" is "E" + "mail" in the record, "email" one token in the JSON.
    bpe = Vocab(["E", "mail", ":", "Ġmarg", "marg", "aret", "Ċ", "{\"", "email", "\":", "Ġ\"", "ĠE"])
    idx = NgramIndex(2, 4, TokenForms(bpe))
    prompt = bpe("E", "mail", ":", "Ġmarg", "aret", "Ċ")
    assert idx.propose([*prompt, *bpe("{\"", "email", "\":", "Ġ\"")], 2) == bpe("marg", "aret")
    # A key that is only the label's tail ("mail") is another word: no draft from "Email:".
    other = NgramIndex(2, 4, TokenForms(bpe))
    assert other.propose([*prompt, *bpe("{\"", "mail", "\":", "Ġ\"")], 2) == []


def test_a_label_that_drafts_nothing_is_not_where_the_proposal_came_from() -> None:
    # "Email:" labels " marg", which this vocabulary has no form of without its space: the label drafts nothing,
    # and what the lookups propose instead is not a label's
    w = Vocab(["Email", ":", "▁marg", "aret", "\n", "{\"", "email", "\":", "▁\""])
    idx = NgramIndex(2, 4, TokenForms(w))
    idx.propose(w("Email", ":", "▁marg", "aret", "\n", "{\"", "email", "\":", "▁\""), 3)
    assert idx.by_label is False
    idx = NgramIndex(2, 4, TokenForms(V))
    assert idx.propose(V("Email", ":", "▁marg", "aret", "\n", "{\"", "email", "\":", "▁\""), 3) == V("marg", "aret",
                                                                                                        "\n")
    assert idx.by_label is True


def test_a_word_longer_than_any_label_matches_no_shorter_label() -> None:
    letters = [chr(c) for c in range(ord("a"), ord("m"))]
    bpe = Vocab([*letters, ":", "Ġ", "VAL", "Ċ", "{\"", "\":", "Ġ\"", "x", "ĉ", "E", "mail", "email"])
    # A 12-token word in the record, then keys that are its 9- and 2-token tails: neither is that label.
    rec = bpe(*letters, ":", "Ġ", "VAL", "Ċ")
    for tail in (letters[-9:], letters[-2:], ["x", *letters[-9:]]):
        assert NgramIndex(2, 4, TokenForms(bpe)).propose([*rec, *bpe("{\"", *tail, "\":", "Ġ\"")], 2) == []
    # A tab (byte-level "ĉ") is no letter: the label after it is still "email".
    tab = bpe("ĉ", "E", "mail", ":", "Ġ", "VAL", "Ċ", "{\"", "email", "\":", "Ġ\"")
    assert NgramIndex(2, 4, TokenForms(bpe)).propose(tab, 1) == bpe("VAL")


@pytest.mark.parametrize("held", [3, 2])
def test_drafts_that_hold_the_run_the_grammar_forces_are_kept(held: int) -> None:
    # A copied value's end drafted with the run its grammar forces after it (`",` then ` "email":`): those
    # rows were computed in this step, so they are kept, and the row after the run is verified next; where
    # the drafts end inside the run, the rest of it follows.
    draft = [5, 100, 101, 102, 9] if held == 3 else [5, 100, 101][: 1 + held]
    logits = torch.full((len(draft) + 1, 300), -1.0)
    logits[0, 5] = 1.0
    logits[len(draft) - 1, 9] = 1.0
    logits[len(draft), 11] = 1.0
    spec = SampleSpec(0, SamplingParams(temperature=0), None, matcher=Forcing(3))  # type: ignore[arg-type]
    rows = list(range(len(draft) + 1))
    v = Verify(spec, draft, rows, frozenset())
    out = verify(v, logits, draft_masks(v, 300))
    if held == 3:
        assert out.tokens == [5, 100, 101, 102, 9, 11] and out.accepted == 5 and out.forced == []
    else:
        assert out.tokens == [5, 100, 101, 102] and out.accepted == 3 and out.forced == []


class JsonString:
    """A matcher inside a JSON string value: a line break is refused; after `",` the grammar forces
    ` "email":`; forks copy what it has taken."""

    def __init__(self, seen: list[int] | None = None) -> None:
        self.seen = list(seen or [])

    def _ok(self, t: int) -> bool:
        return t != V.ids["\n"]

    def valid_prefix(self, tokens: list[int]) -> int:
        return next((i for i, t in enumerate(tokens) if not self._ok(t)), len(tokens))

    def accept(self, t: int) -> bool:
        self.seen.append(t)
        return self._ok(t)

    def is_terminated(self) -> bool:
        return False

    def forced_tokens(self) -> list[int]:
        return V("▁\"", "email", "\":") if self.seen and self.seen[-1] == V.ids["\","] else []

    def fork(self) -> JsonString:
        return JsonString(self.seen)


def test_a_copied_values_end_drafts_the_ending_learned_and_the_next_fields_start() -> None:
    from types import SimpleNamespace

    from asyncpage.core.speculation import Speculation

    spec = Speculation(SpeculativeConfig(method="ngram"), None, 512, TokenForms(V))  # type: ignore[arg-type]
    record = V("Customer", ":", "▁Margaret", "▁Ok", "onk", "wo", "\n", "Email", ":", "▁marg", "aret", "@", "north",
               "\n")
    request = SimpleNamespace(beam=None, width=1, forked=False, stop_ids=frozenset({1}))
    seq = SimpleNamespace(request=request, params=SamplingParams(max_tokens=100), spec=None, matcher=JsonString(),
                          token_ids=[*record, *V("{\"", "customer", "\":", "▁\"", "Margaret")],
                          num_computed_tokens=0, num_output_tokens=5)
    seq.num_tokens = len(seq.token_ids)

    def propose() -> list[int]:
        seq.num_computed_tokens = len(seq.token_ids) - 1
        return spec.propose(seq, 7)  # type: ignore[arg-type]

    # The record's line break is refused: no ending known yet, the drafts stop at the value's end.
    assert propose() == V("▁Ok", "onk", "wo")
    # The model ends the value with `",` there (the grammar then forces ` "email":`): learned.
    seq.token_ids += V("▁Ok", "onk", "wo", "\",", "▁\"", "email", "\":", "▁\"", "marg", "aret")
    # At the next value's end: its last tokens, the ending, the forced run, then what the lookups draft
    # after it (the separator that followed `":` before), 7 in all.
    assert propose() == V("@", "north", "\",", "▁\"", "email", "\":", "▁\"")
    # Without a grammar nothing is refused: the drafts are the record's text, its line break included.
    spec = Speculation(SpeculativeConfig(method="ngram"), None, 512, TokenForms(V))  # type: ignore[arg-type]
    seq.spec, seq.matcher = None, None
    seq.token_ids = [*record, *V("{\"", "customer", "\":", "▁\"", "Margaret")]
    assert propose()[:4] == V("▁Ok", "onk", "wo", "\n")


def test_a_labels_value_before_any_of_its_kind_opens_with_the_token_the_grammar_takes() -> None:
    from types import SimpleNamespace

    from asyncpage.core.speculation import Speculation

    class AfterColon(JsonString):
        """After `":` a value opens with ` "` (a string), then anything but a line break."""

        def accept(self, t: int) -> bool:
            ok = self._ok(t) and not (self.seen and self.seen[-1] == V.ids["\":"] and t != V.ids["▁\""])
            self.seen.append(t)
            return ok

        def valid_prefix(self, tokens: list[int]) -> int:
            m = AfterColon(self.seen)
            return next((i for i, t in enumerate(tokens) if not m.accept(t)), len(tokens))

        def fork(self) -> AfterColon:
            return AfterColon(self.seen)

    assert TokenForms(V).openers() == V("▁\"", "{\"")  # those the vocabulary has, in its own space mark
    spec = Speculation(SpeculativeConfig(method="ngram"), None, 512, TokenForms(V))  # type: ignore[arg-type]
    record = V("Customer", ":", "▁Margaret", "▁Ok", "onk", "wo", "\n")
    seq = SimpleNamespace(request=SimpleNamespace(beam=None, width=1, forked=False, stop_ids=frozenset({1})),
                          params=SamplingParams(max_tokens=100), spec=None,
                          matcher=AfterColon(V("{\"", "customer", "\":")),
                          token_ids=[*record, *V("{\"", "customer", "\":")], num_output_tokens=3)
    seq.num_tokens = len(seq.token_ids)
    seq.num_computed_tokens = seq.num_tokens - 1
    # The label drafts " Margaret ...": refused right after `":`; opened with ` "`, the name without its space.
    assert spec.propose(seq, 7) == V("▁\"", "Margaret", "▁Ok", "onk", "wo")  # type: ignore[arg-type]
    # Never a stop token among the drafts it opens with; none when the opener or the first token stops.
    for stop in ("▁\"", "Margaret"):
        spec = Speculation(SpeculativeConfig(method="ngram"), None, 512, TokenForms(V))  # type: ignore[arg-type]
        seq.spec, seq.request.stop_ids = None, frozenset({1, V.ids[stop]})
        assert V.ids[stop] not in spec.propose(seq, 7), stop  # type: ignore[arg-type]
    # A separator the label drafted first (learned after other keys) is no value's first token: dropped.
    spec = Speculation(SpeculativeConfig(method="ngram"), None, 512, TokenForms(V))  # type: ignore[arg-type]
    assert spec._opened(seq, V("▁\"", "▁Margaret", "▁Ok"), 7) == []  # type: ignore[arg-type]  # its stop still holds
    seq.request.stop_ids = frozenset({1})
    assert spec._opened(seq, V("▁\"", "▁Margaret", "▁Ok"), 7) == V("▁\"", "Margaret", "▁Ok")  # type: ignore[arg-type]


def test_a_label_right_before_the_object_opens_keeps_the_record_s_value() -> None:
    # The record's "Email: marg..." then an instruction ending in the field's name ("..., email:") right before the
    # output's `{"customer`: the key is no value of "email", so the label still drafts the record's value.
    w = Vocab(["Email", ":", "▁marg", "marg", "aret", "\n", "▁fields", "▁email", "{\"", "customer", "\":", "▁\"",
               "Ann", "\",", "email"])
    tokens = w("Email", ":", "▁marg", "aret", "\n", "▁fields", "▁email", ":", "\n", "{\"", "customer", "\":", "▁\"",
               "Ann", "\",", "▁\"", "email", "\":", "▁\"")
    assert NgramIndex(2, 4, TokenForms(w)).propose(tokens, 2) == w("marg", "aret")
    # and where an object opens after a key in the output, its first key is due: no value drafted from the label
    assert NgramIndex(2, 4, TokenForms(w)).propose(w("Email", ":", "▁marg", "aret", "\n", "{\"", "email", "\":",
                                                      "{\""), 2) == []


def test_a_chat_template_s_marker_is_no_label_s_value() -> None:
    # "..., email:" then the template's markers before the output: the marker is no value of "email", so the
    # label still drafts the record's value. Gemma 3's turn markers are special in its added tokens only.
    from types import SimpleNamespace

    class Chat(Vocab):
        all_special_ids: tuple[object, ...] = (0, None)  # an entry that is no id is skipped, not the others
        marked: tuple[int, ...] = ()

        @property
        def added_tokens_decoder(self) -> dict[int, object]:
            return {i: SimpleNamespace(special=True) for i in self.marked}

    w = Chat(["Email", ":", "▁marg", "marg", "aret", "\n", "▁email", "{\"", "customer", "\":", "▁\"", "Ann", "\",",
              "email", "<end_of_turn>", "model"])
    tokens = w("Email", ":", "▁marg", "aret", "\n", "▁email", ":", "\n", "<end_of_turn>", "\n", "model", "\n", "{\"",
               "customer", "\":", "▁\"", "Ann", "\",", "▁\"", "email", "\":", "▁\"")
    Chat.marked = (w.ids["<end_of_turn>"],)
    assert NgramIndex(2, 4, TokenForms(w)).propose(tokens, 2) == w("marg", "aret")
    Chat.marked = ()  # read as a word, the marker was the label's value: the lookup disagreed
    assert NgramIndex(2, 4, TokenForms(w)).propose(tokens, 2) != w("marg", "aret")

    class Broken(Vocab):
        @property
        def all_special_ids(self) -> list[int]:
            raise RuntimeError("cannot say")

    assert TokenForms(Broken(["a"])).form(1) == "a"  # a tokenizer that cannot say: read by its text
