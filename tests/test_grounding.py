"""Grounded extraction: fields marked x-copy (or named by copy_fields) can only be spans of the
record's text, intersected with the schema's own constraints; nullable ones may be null. Grammar
checks run on a tiny tokenizer with llguidance directly; the engine checks on a tiny random model,
whose every copied value must still come from its record."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import msgspec
import pytest

from asyncpage import AsyncEngine, ExtractionError, InvalidRequestError, SamplingParams
from asyncpage.extract import ends, grounding
from asyncpage.extract.prompt import schema_prompt
from asyncpage.guided.schema import closed_objects

SOURCE = 'From: Fatima Khan\nI bought "CloudDesk Pro" (order ORD-48213) and want a refund.'
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"customer": {"type": "string", "maxLength": 40, "description": "who wrote it"},
                   "product": {"type": "string"},
                   "order_id": {"type": ["string", "null"], "pattern": "^[A-Z]+-[0-9]+$"},
                   "refund": {"type": "boolean"},
                   "channel": {"enum": ["email", "chat"]},
                   "note": {"type": "string"}},
    "required": ["customer", "product", "order_id", "refund"]}


@pytest.fixture(scope="module")
def accepts(tiny_llama: Path) -> Any:
    import llguidance.hf
    from llguidance import LLMatcher
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    lt = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))

    def check(lark: str, text: str) -> bool:
        m = LLMatcher(lt, LLMatcher.grammar_from_lark(lark), log_level=0)
        assert not m.is_error(), m.get_error()
        return all(m.consume_token(t) for t in tok(text, add_special_tokens=False)["input_ids"]) and m.is_accepting()

    return check


def _obj(**kw: Any) -> str:
    return json.dumps(kw)  # json.dumps' spacing is the grammar's


def test_auto_marks_every_free_string_and_nullable_string_but_not_enums() -> None:
    marked = grounding.mark(SCHEMA, "auto")
    assert grounding.copied_names(marked) == {"customer", "product", "order_id", "note"}
    assert grounding.copied_names(grounding.mark(SCHEMA, "customer, order_id")) == {"customer", "order_id"}
    assert SCHEMA["properties"]["customer"].get("x-copy") is None  # the caller's schema is not touched


def test_copy_fields_naming_a_missing_or_non_string_field_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="no property 'nope'") as e:
        grounding.mark(SCHEMA, ["nope"])
    assert e.value.field == "copy_fields"
    with pytest.raises(InvalidRequestError, match="not a string"):
        grounding.mark(SCHEMA, ["refund"])


def test_copied_values_must_be_spans_of_the_record(accepts: Any) -> None:
    g = grounding.grammar(grounding.mark(SCHEMA, ["customer", "product", "order_id"]), [SOURCE])
    assert accepts(g, _obj(customer="Fatima Khan", product="CloudDesk Pro", order_id="ORD-48213", refund=True))
    assert accepts(g, _obj(customer="Fatima", product='"CloudDesk Pro"', order_id=None, refund=False,
                           channel="chat", note="anything"))  # quotes copied as JSON escapes; note is free
    assert not accepts(g, _obj(customer="Fahima Khan", product="CloudDesk Pro", order_id=None, refund=True))
    assert not accepts(g, _obj(customer="Fatima Khan", product="CloudDesk", order_id="ORD-10000", refund=True))
    assert not accepts(g, _obj(customer="", product="CloudDesk Pro", order_id=None, refund=True))  # empty span
    assert not accepts(g, _obj(customer="Fatima Khan", product="CloudDesk Pro", refund=True))  # required


def test_the_schema_constraints_still_hold_on_copied_values(accepts: Any) -> None:
    g = grounding.grammar(grounding.mark(SCHEMA, "auto"), [SOURCE])
    # order_id's pattern: "order" is in the text but is not an id.
    assert not accepts(g, _obj(customer="Fatima Khan", product="Pro", order_id="order", refund=True))
    long = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 4, "x-copy": True}},
            "required": ["a"]}
    g = grounding.grammar(long, [SOURCE])
    assert accepts(g, _obj(a="Khan")) and not accepts(g, _obj(a="Fatima"))


def test_copied_values_start_and_end_on_whole_words(accepts: Any) -> None:
    g = grounding.grammar(grounding.mark(SCHEMA, ["customer"]), [SOURCE])
    fine = dict(product="x", order_id=None, refund=True)
    assert accepts(g, _obj(customer="Fatima Khan", **fine)) and accepts(g, _obj(customer="ORD-48213", **fine))
    for part in ("atima", "Fatima Kh", "4821"):
        assert not accepts(g, _obj(customer=part, **fine)), part


def test_a_msgspec_struct_schema_with_optional_and_list_fields_is_grounded(accepts: Any) -> None:
    class Ticket(msgspec.Struct):
        customer: Annotated[str, msgspec.Meta(min_length=1, max_length=60)]
        order_id: str | None
        urgent: bool
        tags: list[str] = []

    marked = grounding.mark(closed_objects(msgspec.json.schema(Ticket)), "auto")
    g = grounding.grammar(marked, [SOURCE])
    assert accepts(g, _obj(customer="Fatima", order_id=None, urgent=False))
    assert accepts(g, _obj(customer="Khan", order_id="ORD-48213", urgent=True, tags=["refund", "Pro"]))
    assert not accepts(g, _obj(customer="Bob", order_id=None, urgent=False))
    assert accepts(g, _obj(customer="Khan", order_id=None, urgent=True, tags=["urgent"]))  # lists stay free
    marked["properties"]["tags"] = {"type": "array", "items": {"type": "string", "x-copy": True}}
    g = grounding.grammar(marked, [SOURCE])  # unless their items are marked
    assert accepts(g, _obj(customer="Khan", order_id=None, urgent=True, tags=["refund", "Pro"]))
    assert not accepts(g, _obj(customer="Khan", order_id=None, urgent=True, tags=["urgent"]))


def test_any_of_several_sources_may_be_copied(accepts: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "x-copy": True}}, "required": ["a"]}
    g = grounding.grammar(schema, ["alpha beta", "gamma"])
    assert accepts(g, _obj(a="beta")) and accepts(g, _obj(a="gamma")) and not accepts(g, _obj(a="delta"))


def test_grammars_for_long_records_compile_in_milliseconds(accepts: Any) -> None:
    # Timed for the report, not asserted: compile cost is printed (see README, grounded extraction).
    text = ("Order ORD-48213 from Fatima Khan about CloudDesk Pro, delivered late. " * 800)[:50_000]
    for n in (1_000, 10_000, 50_000):
        t0 = time.perf_counter()
        g = grounding.grammar(grounding.mark(SCHEMA, "auto"), [text[:n]])
        assert accepts(g, _obj(customer="Fatima Khan", product="CloudDesk Pro", order_id="ORD-48213", refund=False))
        print(f"grounded grammar, {n} source chars: {1000 * (time.perf_counter() - t0):.1f} ms (build+compile+check)")


def test_the_default_prompt_names_each_field_its_meaning_and_values() -> None:
    marked = grounding.mark(SCHEMA, ["customer"])
    prompt = schema_prompt(marked, copied=grounding.copied_names(marked),
                           examples=[{"text": "From: Al Bo", "value": {"customer": "Al Bo"}}])({"text": "Hi {x}"})
    assert "- customer: who wrote it; text, copied exactly as written" in prompt
    assert '- channel: one of "email", "chat"; may be left out' in prompt
    assert "- order_id: text; null when the record does not give it" in prompt
    assert 'Record:\nFrom: Al Bo\n\nFields:\n- customer: who wrote it' in prompt
    assert 'JSON: {"customer": "Al Bo"}\n\nRecord:\nHi {x}\n\nFields:\n' in prompt
    assert prompt.endswith("JSON: ")  # and the braces in a record are text, not placeholders
    for value, where in (({"customer": 7}, "customer"), ({"customer": "Al", "channel": "fax"}, "channel"), ([], "")):
        with pytest.raises(InvalidRequestError, match=f"example 1: {where}") as err:  # a label the schema refuses
            schema_prompt(marked, examples=[{"text": "From: Al Bo", "value": value}])
        assert err.value.field == "examples"
    # Left out at any depth is fine: a partial label (here inside an optional nested object).
    nested = {"type": "object", "properties": {"addr": {"anyOf": [
        {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
         "required": ["city", "zip"]}, {"type": "null"}]}}, "required": ["addr"]}
    schema_prompt(nested, examples=[{"text": "Oslo", "value": {"addr": {"city": "Oslo"}}}])
    for broken in ({"type": "strng"}, {"type": "string", "pattern": "("}):
        with pytest.raises(InvalidRequestError) as err:
            schema_prompt({"type": "object", "properties": {"a": broken}},
                          examples=[{"text": "t", "value": {"a": "x"}}])
        assert err.value.field == "schema"


async def test_extract_many_copies_every_value_from_its_own_record(tiny_llama: Path) -> None:
    records = [{"id": i, "text": t} for i, t in enumerate(
        ["Invoice from Anna Berg for the Lumen lamp.", "Bob Stone wrote about order 77-A.", "Cara Diaz"])]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "order": {"type": ["string", "null"], "maxLength": 8}},
              "required": ["name", "order"], "additionalProperties": False}
    engine = AsyncEngine.from_pretrained(str(tiny_llama), dtype="float32", num_kv_blocks=64)
    async with engine:
        cached = len(engine.guided._cache)
        results = [r async for r in engine.extract_many(
            records, schema, copy_fields="auto", params=SamplingParams(max_tokens=40, temperature=1.0, seed=3))]
        assert len(engine.guided._cache) <= cached + 1  # per-record grammars leave with their records
        for r in results:
            assert r.ok, r.error
            text = records[r.id]["text"]
            for value in r.value.values():
                assert value is None or (value and value in text), (value, text)
        one = await engine.extract("Anna Berg, order 77-A. JSON: ", schema, SamplingParams(max_tokens=40, seed=1),
                                   copy_from="Anna Berg, order 77-A")
        assert all(v is None or v in "Anna Berg, order 77-A" for v in one.values())


async def test_a_record_too_long_for_the_context_is_refused_before_its_spans_are_built(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    built: list[int] = []
    real = grounding.grammar
    monkeypatch.setattr(grounding, "grammar", lambda s, sources: built.append(len(sources[0])) or real(s, sources))
    engine = AsyncEngine.from_pretrained(str(tiny_llama), dtype="float32", num_kv_blocks=64, max_model_len=200)
    async with engine:
        results = [r async for r in engine.extract_many(
            [{"id": 1, "text": "Anna Berg wrote. " * 200}, {"id": 2, "text": "Bob"}], schema, copy_fields="auto",
            params=SamplingParams(max_tokens=8))]
    by_id = {r.id: r for r in results}
    assert by_id[1].error is not None and by_id[1].error.reason == "prompt_too_long"
    assert by_id[2].error is None or by_id[2].error.reason != "prompt_too_long"
    assert 3 in built and max(built) < 100  # the short record's grammar was built, the long one's never


class Addr(msgspec.Struct):
    city: str


class WithOptionals(msgspec.Struct):
    name: str
    addr: Addr | None = None
    note: str | None = None


def test_auto_skips_optional_structs_instead_of_failing(accepts: Any) -> None:
    marked = grounding.mark(closed_objects(msgspec.json.schema(WithOptionals)), "auto")
    assert grounding.copied_names(marked) == {"name", "note"}
    g = grounding.grammar(marked, [SOURCE])
    assert accepts(g, _obj(name="Fatima", addr={"city": "anywhere"}, note=None))


def test_copied_values_never_start_or_end_with_whitespace(accepts: Any) -> None:
    g = grounding.grammar(grounding.mark(SCHEMA, ["customer"]), [SOURCE])
    fine = dict(product="x", order_id=None, refund=True)
    for bad in (" Fatima", "Khan\n", "Khan\nI ", " "):
        assert not accepts(g, _obj(customer=bad, **fine)), bad
    assert accepts(g, _obj(customer="Khan\nI", **fine))


def test_patterns_hold_on_the_decoded_value_and_may_contain_slashes(accepts: Any) -> None:
    schema = {"type": "object", "properties": {
        "line": {"type": "string", "pattern": "^[^\\n]*$", "x-copy": True},
        "url": {"type": ["string", "null"], "pattern": "^https?:\\/\\/", "x-copy": True}}, "required": ["line", "url"]}
    g = grounding.grammar(schema, ["Fatima Khan\nsee https://example.com/x now"])
    assert accepts(g, _obj(line="Fatima Khan", url="https://example.com/x"))
    assert not accepts(g, _obj(line="Khan\nsee", url=None))  # the pattern forbids a newline in the value


def test_a_pattern_with_alternatives_or_a_final_backslash_keeps_its_json_schema_meaning(accepts: Any) -> None:
    """JSON Schema patterns search: "^A|B$" is "starts with A, or ends with B", each alternative
    anchored on its own; "x\\\\$" ends with a backslash."""
    schema = {"type": "object", "properties": {"f": {"type": "string", "pattern": "^A|B$", "x-copy": True}},
              "required": ["f"]}
    g = grounding.grammar(schema, ["Axyz and qqB and A"])
    for value in ("Axyz", "qqB", "A", "Axyz and qqB"):
        assert accepts(g, _obj(f=value)), value
    assert not accepts(g, _obj(f="xyz and"))
    schema["properties"]["f"]["pattern"] = "[|]x|^y"  # a | inside a class does not split
    g = grounding.grammar(schema, ["a|x y and"])
    assert accepts(g, _obj(f="y and")) and not accepts(g, _obj(f="and"))
    schema["properties"]["f"]["pattern"] = "n\\\\$"
    g = grounding.grammar(schema, ["C:\\win dir\\ and"])  # compiles; escapes are out of patterned spans
    assert not accepts(g, _obj(f="and"))


def test_length_and_pattern_beside_a_string_or_null_any_of_hold_on_the_copied_value(accepts: Any) -> None:
    nullable = [{"type": "string"}, {"type": "null"}]
    for extra, good, bad in (({"maxLength": 3}, "123", "Paris"), ({"pattern": "^[0-9]+$"}, "123", "Paris"),
                             ({"minLength": 4}, "Paris", "123")):
        schema = {"type": "object", "properties": {"f": {"anyOf": nullable, **extra, "x-copy": True}},
                  "required": ["f"]}
        g = grounding.grammar(schema, ["Paris 123"])
        assert accepts(g, _obj(f=good)) and not accepts(g, _obj(f=bad)), extra
    with pytest.raises(InvalidRequestError):  # a format beside it: not a free string, refused as x-copy
        grounding.grammar({"type": "object", "properties": {"f": {"anyOf": nullable, "format": "email",
                                                                  "x-copy": True}}}, ["a@b.c"])
    marked = grounding.mark({"type": "object", "properties": {"f": {"anyOf": nullable, "format": "email"}}}, "auto")
    assert not grounding.copied(marked)
    for bad in ({"minLength": "x"}, {"maxLength": None}, {"maxLength": [1]}, {"minLength": -1}):
        with pytest.raises(InvalidRequestError) as err:  # a typed refusal, not a ValueError from int()
            grounding.mark({"type": "object", "properties": {"f": {"anyOf": nullable, **bad}}}, "auto")
        assert err.value.field == "schema"


def test_a_record_with_no_text_gives_null_for_nullable_copied_fields(accepts: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"type": ["string", "null"], "x-copy": True}}, "required": ["a"]}
    g = grounding.grammar(schema, [""])
    assert accepts(g, _obj(a=None)) and not accepts(g, _obj(a="x"))
    with pytest.raises(InvalidRequestError):
        grounding.grammar(grounding.mark(SCHEMA, ["customer"]), [""])


def test_what_a_copied_object_cannot_honour_is_refused_clearly() -> None:
    for extra in ({"minProperties": 5}, {"anyOf": [{"required": ["a"]}]}, {"required": ["a", "ghost"]}):
        schema = {"type": "object", "properties": {"a": {"type": "string", "x-copy": True}}, "required": ["a"],
                  **extra}
        with pytest.raises(InvalidRequestError, match="x-copy"):
            grounding.grammar(schema, [SOURCE])
    with pytest.raises(InvalidRequestError, match="format"):
        grounding.grammar({"type": "object", "properties": {"a": {"type": "string", "format": "email",
                                                                  "x-copy": True}}}, [SOURCE])


def test_a_copied_value_is_never_only_punctuation(accepts: Any) -> None:
    g = grounding.grammar(grounding.mark(SCHEMA, ["customer"]), [SOURCE])
    fine = dict(product="x", order_id=None, refund=True)
    for bad in (":", '\\"', "(", "."):
        assert not accepts(g, _obj(customer=bad, **fine)), bad
    assert accepts(g, _obj(customer="(order ORD-48213)", **fine))
    with pytest.raises(InvalidRequestError, match="no letter or digit"):
        grounding.grammar(grounding.mark(SCHEMA, ["customer"]), ["!!! ?"])


async def test_copied_values_are_the_best_of_four_beams_by_default(tiny_llama: Path) -> None:
    text = "Invoice from Anna Berg for the Lumen lamp, order 77-A."
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "order": {"type": ["string", "null"], "maxLength": 8}},
              "required": ["name", "order"], "additionalProperties": False}
    prompt = f"{text}\nJSON: "
    engine = AsyncEngine.from_pretrained(str(tiny_llama), dtype="float32", num_kv_blocks=128)
    async with engine:
        params = SamplingParams(max_tokens=40, temperature=0)
        grammar = grounding.grammar(grounding.mark(schema, "auto"), [text])
        beams = await engine.beam_search(prompt, 4, 40, params=msgspec.structs.replace(params, grammar=grammar))
        greedy = await engine.generate(prompt, msgspec.structs.replace(params, grammar=grammar))
        # (score_choices off: the order's null-or-present is otherwise decided by scoring, extract_scoring's tests)
        assert await engine.extract(prompt, schema, params, copy_from=text, score_choices=False) == json.loads(
            beams.beams[0].text)
        assert await engine.extract(prompt, schema, params, copy_from=text, beam_width=1,
                                    score_choices=False) == json.loads(greedy.text)
        [many] = [r async for r in engine.extract_many([{"id": 1, "text": text}], schema, copy_fields="auto",
                                                      prompt="{text}\nJSON: ", params=params, score_choices=False)]
        assert many.value == json.loads(beams.beams[0].text)
        [plain] = [r async for r in engine.extract_many([{"id": 1, "text": text}], schema, prompt=prompt,
                                                       params=params)]  # nothing copied: greedy
        plain_greedy = await engine.generate(prompt, msgspec.structs.replace(params, json_schema=schema))
        assert plain.value == json.loads(plain_greedy.text)
        with pytest.raises(InvalidRequestError) as e:
            await engine.extract(prompt, schema, params, copy_from=text, beam_width=0)
        assert e.value.field == "beam_width"
        with pytest.raises(InvalidRequestError):
            [r async for r in engine.extract_many([text], schema, beam_width=0)]


async def test_without_room_for_four_beams_copied_values_are_greedy_not_refused(tiny_llama: Path) -> None:
    text = "Invoice from Anna Berg for the Lumen lamp, order 77-A."
    schema = {"type": "object", "properties": {"name": {"type": ["string", "null"], "maxLength": 12}},
              "required": ["name"]}
    engine = AsyncEngine.from_pretrained(str(tiny_llama), dtype="float32", num_kv_blocks=64, max_num_seqs=2)
    async with engine:
        params = SamplingParams(max_tokens=20, temperature=0)
        grammar = grounding.grammar(grounding.mark(schema, "auto"), [text])
        greedy = await engine.generate(text, msgspec.structs.replace(params, grammar=grammar))
        assert await engine.extract(text, schema, params, copy_from=text) == json.loads(greedy.text)
        with pytest.raises(InvalidRequestError) as e:  # asked for by name: refused, naming it
            await engine.extract(text, schema, params, copy_from=text, beam_width=4)
        assert e.value.field == "beam_width"
        # A job: refused once, before its first record, not an invalid_input for every record.
        records = [{"text": text}] * 3
        for width, own, field in ((4, params, "beam_width"), (2, msgspec.structs.replace(params, n=2), "n"),
                                  (2, msgspec.structs.replace(params, logprobs=1), "logprobs")):
            with pytest.raises(InvalidRequestError) as e:
                [r async for r in engine.extract_many(records, schema, copy_fields="auto", params=own,
                                                      beam_width=width)]
            assert e.value.field == field, (width, field)
        assert engine.stats().kv_blocks_used == 0


def test_a_control_character_alone_is_not_a_value(accepts: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"type": ["string", "null"], "x-copy": True}}, "required": ["a"]}
    g = grounding.grammar(schema, ["\x1b[31m red \x07 \b"])
    for bad in ("\x1b", "\x07", "\b"):
        assert not accepts(g, _obj(a=bad)), repr(bad)
    assert accepts(g, _obj(a="\x1b[31m red")) and accepts(g, _obj(a=None))


async def test_default_beams_never_return_half_a_value_and_fall_back_where_beams_cannot_help(
        tiny_llama: Path) -> None:
    nullable = {"type": "object", "properties": {"name": {"type": ["string", "null"]},
                                                 "order": {"type": ["string", "null"], "pattern": "^ORD-[0-9]+$"}},
                "required": ["name", "order"]}
    engine = AsyncEngine.from_pretrained(str(tiny_llama), dtype="float32", num_kv_blocks=128)
    async with engine:
        params = SamplingParams(max_tokens=60, temperature=0)
        # No letter or digit to copy: null, not an opening quote with nothing after it.
        [r] = [r async for r in engine.extract_many(["!!! ?? -- ..."], nullable, copy_fields="auto", params=params)]
        assert r.ok and r.value == {"name": None, "order": None}, r
        # A pattern nothing in the text matches: every beam returned is a whole value.
        text = "Anna Berg wrote about the Lumen lamp."
        grammar = grounding.grammar(grounding.mark(nullable, "auto"), [text])
        out = await engine.beam_search(text, 4, 60, params=msgspec.structs.replace(params, grammar=grammar))
        assert out.beams and all(json.loads(b.text)["order"] is None for b in out.beams)
        # Cut by max_tokens: beams have no budget closing, so the record is decoded greedy, as before beams.
        short = msgspec.structs.replace(params, max_tokens=12)
        outcomes = []
        for width in (None, 1):
            try:
                outcomes.append(await engine.extract(text, nullable, short, copy_from=text, beam_width=width))
            except ExtractionError as exc:
                outcomes.append((exc.reason, exc.value))
        assert outcomes[0] == outcomes[1]
        # Sampling params: the default samples (beams would ignore temperature and seed).
        hot = SamplingParams(max_tokens=60, temperature=1.0, seed=7)
        sampled = await engine.generate(text, msgspec.structs.replace(hot, grammar=grammar))
        try:
            value = await engine.extract(text, nullable, hot, copy_from=text)
        except ExtractionError as exc:  # a random model may run to max_tokens: closed by the budget
            value = exc.value
        assert value == json.loads(sampled.text)
        for bad in (True, 1.0, 0):
            with pytest.raises(InvalidRequestError) as e:
                await engine.extract(text, nullable, params, copy_from="!!!", beam_width=bad)  # type: ignore[arg-type]
            assert e.value.field == "beam_width"
        assert engine.stats().kv_blocks_used == 0


async def test_when_no_beam_can_copy_a_required_value_extract_raises_invalid_not_index_error(
        tiny_llama: Path) -> None:
    text = "Anna Berg wrote about the Lumen lamp."
    # Required, and no span of the text fits the pattern: every beam stops at the opening quote.
    schema = {"type": "object", "properties": {"order": {"type": "string", "pattern": "^ORD-[0-9]+$"}},
              "required": ["order"]}
    engine = AsyncEngine.from_pretrained(str(tiny_llama), dtype="float32", num_kv_blocks=128)
    async with engine:
        params = SamplingParams(max_tokens=30, temperature=0)
        with pytest.raises(ExtractionError) as e:
            await engine.extract(text, schema, params, copy_from=text, beam_width=4)
        assert e.value.reason == "invalid" and "none of the 4 beams" in str(e.value)
        with pytest.raises(ExtractionError) as e:  # the default's beams: decoded greedy instead, as with beam_width=1
            await engine.extract(text, schema, params, copy_from=text)
        assert e.value.reason == "invalid"
        [r] = [r async for r in engine.extract_many([text], schema, copy_fields="auto", params=params, beam_width=4)]
        assert r.error is not None and r.error.reason == "invalid_output" and "none of the 4 beams" in r.error.message
        assert engine.stats().kv_blocks_used == 0


async def test_listing_eos_among_stop_token_ids_does_not_make_a_half_value_a_beam(tiny_llama: Path) -> None:
    # EOS at an unfinished value is a dead end whether or not the caller also lists it as a stop id:
    # no beam comes back as the half value '{"order": "' (it would be ranked against whole values).
    text = "Anna Berg wrote about the Lumen lamp."
    schema = {"type": "object", "properties": {"order": {"type": "string", "pattern": "^ORD-[0-9]+$"}},
              "required": ["order"]}
    engine = AsyncEngine.from_pretrained(str(tiny_llama), dtype="float32", num_kv_blocks=128)
    async with engine:
        grammar = grounding.grammar(grounding.mark(schema, "auto"), [text])
        for stop_ids in ((), tuple(sorted(engine.eos_token_ids))):
            params = SamplingParams(max_tokens=30, temperature=0, grammar=grammar, stop_token_ids=stop_ids)
            out = await engine.beam_search(text, 4, 30, params=params)
            assert out.beams == [], (stop_ids, [b.text for b in out.beams])
            plain = SamplingParams(max_tokens=30, temperature=0, stop_token_ids=stop_ids)
            with pytest.raises(ExtractionError) as e:
                await engine.extract(text, schema, plain, copy_from=text, beam_width=4)
            assert e.value.reason == "invalid" and "none of the 4 beams" in str(e.value), stop_ids
        assert engine.stats().kv_blocks_used == 0


async def test_extract_with_copy_from_but_no_field_copied_is_greedy_not_four_beams(tiny_llama: Path) -> None:
    text = "Invoice 77 from Anna Berg."
    numbers = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    engine = AsyncEngine.from_pretrained(str(tiny_llama), dtype="float32", num_kv_blocks=128)
    searches = []
    real = engine.beam_search

    async def counted(*args: Any, **kwargs: Any) -> Any:
        searches.append(args)
        return await real(*args, **kwargs)

    engine.beam_search = counted  # type: ignore[method-assign]
    async with engine:
        params = SamplingParams(max_tokens=60, temperature=0)
        for schema, fields in ((numbers, None), (SCHEMA, [])):  # no string field; nothing named
            try:
                await engine.extract(text, schema, params, copy_from=text, copy_fields=fields)
            except ExtractionError:
                pass  # a random model's value: only how it was decoded matters here
        assert searches == []


def test_a_job_runs_four_beams_a_record_only_when_a_field_is_copied_and_sizes_its_batch_by_that() -> None:
    from asyncpage.extract import beams_per_record

    schema = {"type": "object", "properties": {"customer": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["customer", "n"]}
    assert beams_per_record(schema, None, None) == 1  # nothing copied: greedy, no 4x max_num_seqs
    assert beams_per_record(schema, "auto", None) == 4
    assert beams_per_record(schema, "customer", 2) == 2
    assert beams_per_record(schema, None, 3) == 3  # a width asked for is used as asked

    class Ticket(msgspec.Struct):
        customer: Annotated[str, msgspec.Meta(extra_json_schema={"x-copy": True})]

    assert beams_per_record(Ticket, None, None) == 4
    with pytest.raises(InvalidRequestError):
        beams_per_record(schema, "nobody", None)  # refused before a model loads
    with pytest.raises(InvalidRequestError):
        beams_per_record(schema, "auto", 0)


def test_a_copied_name_is_widened_by_the_capitalized_words_that_open_it_in_the_record() -> None:
    from asyncpage.extract.ends import widened, word_prefixes

    text = "Hi. My Tovisk Sona 12 hums. There's gas from the Juniperra Flame 6 hob.\nSubject: Flame 6\nHi Sona 12"
    assert widened(text, "Sona 12") == ["Tovisk Sona 12"] and widened(text, "Flame 6") == ["Juniperra Flame 6"]
    assert widened("Dear Corrowen Aura 7 team", "Aura 7") == [] and widened(text, "gas from") == []
    assert word_prefixes("Juniperra Flame 6") == ["Juniperra", "Juniperra Flame", "Juniperra Flame 6"]
    assert word_prefixes("Rain Jacket, women's M") == ["Rain", "Rain Jacket", "Rain Jacket, women's",
                                                        "Rain Jacket, women's M"]  # a prefix read without its comma


def test_a_brand_copied_from_inside_its_name_opens_with_the_name() -> None:
    from asyncpage.extract.ends import opened, opened_brands

    text = "Hi, my Glacierpoint Q7 heat pump runs nonstop. The Zanthe K5 Split unit too."
    assert opened(text, "Q7", [text]) == "Glacierpoint Q7" and opened(text, "K5 Split", [text]) == "Zanthe K5 Split"
    # Written nowhere after a name's opening (at its line's or sentence's start, after a determiner): as it is.
    for other in ("Glacierpoint Q7 broke", "Hi,\nQ7 broke", "It broke. Q7 again", "the Q7 broke"):
        assert opened(other, "Q7", [other]) == "Q7", other
    # Once so is enough, wherever else it stands alone; a quantity of at most three digits opens a name too.
    for other in ("Q7 works again. my Glacierpoint Q7", "my Glacierpoint Q7 broke, the Q7 is new",
                  "We ordered 12 Glacierpoint Q7 units. The Q7 ones fail"):
        assert opened(other, "Q7", [other]) == "Glacierpoint Q7", other
    # Not where it stands alone before a model's word somewhere (it is itself a brand), nor after an id's number or a
    # date's month.
    for other, value in (("My Velora X5 broke. I took it to the Manchester Velora store.", "Velora"),
                         ("The Dyson V8 stopped. Our John Lewis Dyson display model worked.", "Dyson"),
                         ("Order 4471 Amazon Velora X5 never came", "X5"), ("On 5 Jan Velora X5 arrived broken", "X5")):
        assert opened(other, value, [other]) == value, other
    assert opened(text, "Q7", ["Q7 heat pump"]) == "Q7"  # the wider span is no span the field allows
    # Only after a determiner or a lowercase word that is no preposition; no shout, possessive, day, month or title;
    # at most three words, whole words of the sources.
    for other in ("Ordered Halvern Echo S headphones", "bought at Harrow Echo S", "from Amazon Echo S",
                  "in Lisbon Echo S", "my BRAND NEW Echo S", "at Harrow's Echo S", "since last Monday Echo S",
                  "my Dr Echo S", "Re: Fwd Echo S", "I bought it on Amazon. Echo S broke", "the X B C D Echo S"):
        assert opened(other, "Echo S", [other]) == "Echo S", other
    assert opened("the B C D E thing", "E", ["the B C D E thing"]) == "B C D E"
    # "Zeta Q7" (one space) is no whole span of the record:
    assert opened("my Zeta  Q7 ok; Zeta Q7s are bad", "Q7", ["my Zeta  Q7 ok; Zeta Q7s are bad"]) == "Q7"
    written = {"product": "Q7", "customer": "Rick"}
    assert opened_brands(text, [text], {"product"}, {}, written, lambda n, v: True) == {"product": "Glacierpoint Q7"}
    assert opened_brands(text, [text], {"product"}, {"product": "Glacierpoint"}, written, lambda n, v: True) == {}
    # The wider value the field's schema refuses, or one holding another field's value: the value as it was.
    assert opened_brands(text, [text], {"product"}, {}, written, lambda n, v: len(v) < 10) == {}
    son = "Hi, my son Tom Kestrel bike broke"
    assert opened_brands(son, [son], {"product"}, {}, {"product": "Kestrel", "customer": "Tom Kestrel"},
                         lambda n, v: True) == {}


def test_a_brand_is_never_copied_as_a_code_but_may_hold_a_model_number(accepts: Any) -> None:
    # ends.named_copies: a field asking for a brand takes no span with a code-shaped word (three digits in one
    # word: an order id, a serial number); a short model number and a hyphenated name stay copyable.
    schema = {"type": "object", "required": ["product", "order_id"], "properties": {
        "product": {"type": "string", "description": "the product brand the ticket is about"},
        "order_id": {"type": ["string", "null"], "description": "the order id"}}}
    text = "Order OPX-993-1148-A: my Optivex Z-50 camera from 7-Eleven broke."
    marked = ends.named_copies(grounding.mark(schema, "auto"))
    assert marked["properties"]["product"].get(grounding.NAMED) is True
    assert grounding.NAMED not in marked["properties"]["order_id"]
    assert grounding.NAMED not in schema["properties"]["product"]  # the caller's schema is not touched
    g = grounding.grammar(marked, [text])
    for brand in ("Optivex Z-50", "Optivex", "7-Eleven"):
        assert accepts(g, _obj(product=brand, order_id="OPX-993-1148-A")), brand
    for code in ("OPX-993-1148-A", "Order OPX-993-1148-A", "OPX-993-1148-A: my Optivex"):
        assert not accepts(g, _obj(product=code, order_id=None)), code
    line = grounding.line_grammar(marked["properties"]["product"], [text], " ", "\n")
    assert line is not None and accepts(line, " Optivex Z-50\n") and not accepts(line, " OPX-993-1148-A\n")
    # a name, not a sentence: at most six words
    g = grounding.grammar(marked, ["Booked a hotel in Lisbon through Tripwhistle last May, order 55120"])
    assert accepts(g, _obj(product="Tripwhistle", order_id="55120"))
    assert accepts(g, _obj(product="a hotel in Lisbon through Tripwhistle", order_id=None))
    assert not accepts(g, _obj(product="Booked a hotel in Lisbon through Tripwhistle", order_id=None))
    # a word with a lowercase run is a name's, digits or not; a record of codes alone leaves the brand free
    g = grounding.grammar(marked, ["Flowers by 1-800-Flowers, order 55120"])
    assert accepts(g, _obj(product="1-800-Flowers", order_id="55120"))
    assert accepts(grounding.grammar(marked, ["12345 67890"]), _obj(product="12345", order_id=None))
    # a code's field, or one asking for the model too, is no brand's, whatever its description says
    other = {"type": "object", "required": ["order_id", "car"], "properties": {
        "order_id": {"type": "string", "description": "the order number the vendor assigned"},
        "car": {"type": "string", "description": "make and model of the car"}}}
    flagged = ends.named_copies(grounding.mark(other, "auto"))["properties"]
    assert grounding.NAMED not in flagged["order_id"] and grounding.NAMED not in flagged["car"]
    # an Optional[str] brand (anyOf with null) keeps the flag on the present branch its line is read with
    from asyncpage.extract.closed import _present_branch

    optional = {"anyOf": [{"type": "string"}, {"type": "null"}], grounding.COPY: True, grounding.NAMED: True}
    assert (_present_branch(optional, optional) or {}).get(grounding.NAMED) is True


def test_a_brand_is_never_copied_from_the_company_a_signature_names_as_the_writer_s_employer(accepts: Any) -> None:
    from asyncpage.extract.employer import employers

    def named(text: str) -> list[str]:
        return [text[a:b] for a, b in employers(text)]

    assert named("Many thanks,\nIfeoma Chukwu\nPractice Manager, Westgate Family Clinic") == ["Westgate Family Clinic"]
    assert named("Ángel Cabrera-Ruiz\nHead Chef, La Marea, 22 Quay Street") == ["La Marea"]
    assert named("Yuki Tanabe-Morris\nHead of Sales Operations, Larchfield Logistics") == ["Larchfield Logistics"]
    assert named("Ana Silva, Customer Service Manager at Bakery Co") == ["Bakery Co"]
    assert named("Thanks\r\nJohn Smith\r\nCEO, Acme Ltd\r\n") == ["Acme Ltd"]
    assert named("Fix it.\n\n— Matteo Rossi\nCTO, Bottega Rossi Online") == ["Bottega Rossi Online"]  # a dash signs
    assert named("– Ana Silva, Head of Sales at Foo Bar") == ["Foo Bar"]
    assert named("Items I bought:\n- Standing Desk\nDesk Chair, Herman Miller") == []  # a list's item is no signature
    # the company on the line after the title alone on its own
    assert named("Best regards,\nPriyanka Venkataraman\nFinance Controller\nOakridge Dental Group\n+353 1 555 2290") \
        == ["Oakridge Dental Group"]
    assert named("Call me.\n\nOlusegun Bakare\nIT Director\r\nMeridian Freight Co.") == ["Meridian Freight Co."]
    # and, for what a brand's spans come from, the writer's job title too ("Finance": once the brand)
    sig = "Adaeze Nwosu\nFinance Director, Ikenga Logistics Ltd"
    assert sorted(sig[a:b] for a, b in employers(sig, titles=True)) == ["Finance Director", "Ikenga Logistics Ltd"]
    # a surname's particle ("Sanne de Vries"), and a form's own company field
    assert named("Thanks,\nSanne de Vries\nOffice Manager, De Vries & Bakker Tandartsen\n+31 20 555 0184") == \
        ["De Vries & Bakker Tandartsen"]
    from asyncpage.extract.employer import company_fields

    form = "--- Booking Enquiry Form ---\nCompany: Sahel Consulting Group\r\nContact: Moussa Diallo\nHotel: Linden"
    assert [form[a:b] for a, b in company_fields(form)] == ["Sahel Consulting Group"]
    assert company_fields("Company policy: refunds in 30 days") == [] and company_fields("Company:\nName: X") == []
    for other in ("Customer: My desk wobbles.\nCompany: Which Nimbra model do you have?",  # a chat's speaker
                  "Company: Acme Bakery (we use your Ledgerly Payroll app)", "Business: Ledgerly Payroll subscription"):
        assert company_fields(other) == [], other  # no company's name alone on the line
    # a title is cut only where its words are a department's or a rank's: a product's line or role keeps its brand
    for sig in ("Thanks,\nMaria Lopez\nLedgerly Administrator\nAcme Corp",
                "Thanks,\nAnna Berg\nZentro Pro Controller, X"):
        assert not any("Ledgerly" in sig[a:b] or "Zentro" in sig[a:b] for a, b in employers(sig, titles=True)), sig
    for listed in ("two items damaged:\nStanding Desk Frame\nErgonomic Office Chair\nMonitor Arm Pro\n",
                   "Subject: Broken\nVelvet Buds Pro\nHead Band Snapped\nVelvet Buds Pro",
                   "Tom Reed\nOwner\nSorrelgate Breeze 16",
                   "Thanks,\nMaria Lopez\nLead time was three weeks\nVelosta City E5"):
        assert named(listed) == [], listed  # a list of products, a model's digits, a line that is no title
    for text in ("Kind regards, Maria", "Order 55120, Foo Ltd", "My manager, John, said the Rostera app is broken",
                 "The head, Velox 3, snapped", "Manager " * 20_000, "Gaming Chair, Secretlab Titan Evo",
                 "Order details\nOffice Chair, Herman Miller Aeron", "Dear Store Manager, Zipvolt Urban X, bought",
                 "Product: Pro Controller, Nintendo Switch",
                 "Ifeoma Chukwu\nPractice Manager, Westgate Family Clinic\n" + "More text. " * 40):
        assert named(text) == [], text[:40]  # a product's line, or no signature at the record's end
    schema = {"type": "object", "required": ["customer", "product"], "properties": {
        "customer": {"type": "string", "description": "full name of the person who wrote the ticket"},
        "product": {"type": "string", "description": "the product brand the ticket is about"}}}
    marked = ends.named_copies(grounding.mark(schema, "auto"))
    text = "Our Rostera Teams rota app logs everyone out.\n\nIfeoma Chukwu\nPractice Manager, Westgate Family Clinic"
    g = grounding.grammar(marked, [text])
    assert accepts(g, _obj(customer="Ifeoma Chukwu", product="Rostera Teams"))
    assert not accepts(g, _obj(customer="Ifeoma Chukwu", product="Westgate Family Clinic"))
    assert accepts(g, _obj(customer="Ifeoma Chukwu", product="Rostera"))
    # nor is the writer: a person, never the company signed (employer.without_company)
    assert not accepts(g, _obj(customer="Westgate Family Clinic", product="Rostera"))
    line = grounding.line_grammar(marked["properties"]["product"], [text], " ", "\n")
    assert line is not None and accepts(line, " Rostera Teams\n") and not accepts(line, " Westgate\n")
    plain = grounding.grammar(marked, ["Our Rostera Teams app logs everyone out."])
    assert "BRAND_SPAN" not in plain  # no employer named: the brand copies from the record as it is


def test_a_brand_is_never_copied_from_a_company_named_with_its_legal_form(accepts: Any) -> None:
    from asyncpage.extract.employer import legal_names

    def named(text: str) -> list[str]:
        return [text[a:b] for a, b in legal_names(text)]

    assert named("Regards,\nKeiko Matsumura\nProcurement, Hoshino Packaging GmbH\nTel. +49 40 555") == \
        ["Hoshino Packaging GmbH"]
    assert named("a payment of GHS 2,350.00 to VENDORA HOME LTD on 28 May") == ["VENDORA HOME LTD"]
    assert named("shipped by Tengri Logistics LLP, then Foo Co., Ltd. and Novo Nordisk A/S.") == \
        ["Tengri Logistics LLP", "Foo Co., Ltd.", "Novo Nordisk A/S"]
    for text in ("Maribel & Co. Sienna", "Forgeline Angle Grinder AG-115", "Apple Watch SE", "a 5 KG bag", "ltd",
                 "Ordwell LP-340", "A " * 50_000, "Aa & " * 40_000, "My Nintendo Switch OLED Limited Edition",
                 "a 2021 Jeep Grand Cherokee Limited", "The Orbea Orca M20 LTD frame", "Our Siemens SIMATIC PLC",
                 "Our Cisco ASA 5506", "the Seagate Exos X18 SAS drive", "Perfect Fitness AB Carver Pro",
                 "my Samsung 9 KG washer"):
        assert named(text) == [], text[:40]  # a brand's "& Co.", a model's name, trim or number, a weight
    assert named("a Breville Barista Express. Breville Pty Ltd won't") == ["Breville Pty Ltd"]  # not past a sentence
    from asyncpage.extract.employer import without_employer

    # an employer holding a company's legal form is cut whole (the union of the two), with the title before it
    assert without_employer(["Jane Doe\nOperations Manager, Acme Ltd Warehouse Services"]) == ["Jane Doe\n", ", "]
    schema = {"type": "object", "required": ["customer", "product"], "properties": {
        "customer": {"type": "string", "description": "full name of the person who wrote the ticket"},
        "product": {"type": "string", "description": "the product brand the ticket is about"}}}
    marked = ends.named_copies(grounding.mark(schema, "auto"))
    text = ("Three of the Ordwell LP-340 label printers feed crooked.\nRegards,\nKeiko Matsumura\n"
            "Procurement, Hoshino Packaging GmbH")
    g = grounding.grammar(marked, [text])
    assert accepts(g, _obj(customer="Keiko Matsumura", product="Ordwell"))  # "LP-340": a code, never a brand
    for company in ("Hoshino Packaging GmbH", "Hoshino Packaging", "Packaging"):
        assert not accepts(g, _obj(customer="Keiko Matsumura", product=company)), company
    line = grounding.line_grammar(marked["properties"]["product"], [text], " ", "\n")
    assert line is not None and accepts(line, " Ordwell\n") and not accepts(line, " Hoshino Packaging\n")
    # a record that names nothing else keeps its company: a required brand has a span to copy
    assert accepts(grounding.grammar(marked, ["Tesla Inc."]), _obj(customer="Tesla", product="Tesla Inc."))


def test_the_writer_is_never_copied_from_a_support_agents_name(accepts: Any) -> None:
    # ends.named_copies + staff.py: a field asking for who wrote the record leaves the names the record marks as
    # support staff out of its spans (speaker labels, a quoted reply's header, a signature with a team).
    from asyncpage.extract.staff import staff_names

    schema = {"type": "object", "required": ["customer", "product"], "properties": {
        "customer": {"type": "string", "description": "full name of the person who wrote the ticket"},
        "product": {"type": "string"}}}
    chat = ("Hannah Brooks (Support): Welcome! Who am I chatting with?\nVisitor: Hi Hannah, this is Devika Raman.\n"
            "Agent Priya: I'll loop in billing.\n> On 2 May, Emily Carter (Vantiq Support) wrote:\n"
            "Tom, Acme Support")
    assert set(staff_names(chat)) == {"Hannah Brooks", "Priya", "Emily Carter", "Tom"}
    assert staff_names("Kind regards, Maria (IT admin at Foo Ltd)\nHi Hannah, this is Devika.") == []
    for own in ("Hi, this is Jane Doe, support told me to write.", "Submitted by Maria Lopez (via support portal)",
                "Maria Lopez from Foo Ltd IT support here", "Jane Doe - Support request",
                "Fleet operator Jan Novak here",
                "Ana Silva, Customer Service Manager at Bakery Co", "Ravi Kumar (Support Engineer at Globex)",
                "Maria Lopez (customer since 2019, premium support plan)", "REPORT Lisa Wong", "Maria (IT Support)"):
        assert staff_names(own) == [], own  # the customer's own words and roles are not staff
    assert staff_names("A" * 20_000 + " (Support)") == []  # a long run of capitals: no backtracking into it
    from asyncpage.extract.staff import without_staff
    left = without_staff(["Agent Tom: how can I help?\nTom Brown: my kettle leaks."])
    assert "Tom Brown: my kettle leaks." in "".join(left)  # the label's name cut there, not in a longer name
    # and wherever else it stands alone: a greeting to the agent, the agent's own words
    assert "Marco" not in "".join(without_staff(["[10:02] Marco (Brevo Support): You're chatting with Marco.\n"
                                                 "[10:02] Francesca Bianchi: Hi Marco, my Duo 2 broke."]))
    # but not inside a longer name, as a speaker's label or alone on its line (a customer's own name)
    assert without_staff(["Agent Brown: hi\nTom Brown: my kettle leaks.\nThanks,\nTom Brown"]) == \
        ["Agent ", ": hi\nTom Brown: my kettle leaks.\nThanks,\nTom Brown"]
    assert "\nMaria: my kettle leaks\nThanks,\nMaria" in "".join(without_staff(
        ["Maria (Acme Support): Hi!\nMaria: my kettle leaks\nThanks,\nMaria"]))
    assert without_staff(["Marco (Support): hi\r\nok\r\nMarco\r\n"])[-1].endswith("\r\nMarco\r\n")  # CRLF lines
    assert without_staff(["Marco (Support): hi\nCustomer: Marco said no"])[-1] == " said no"  # after a speaker
    many = "".join(f"Agent{chr(65 + i % 26)}{i} (Support): hi Agent{chr(65 + i % 26)}{i}\n" for i in range(9_000))
    # one pass over the text for the MAX_STAFF longest names, not one per name (9,000 passes took 33 s)
    assert without_staff([many])[0] == " (Support): hi AgentA0\n"
    assert len(without_staff(["Marco (Support): hi " + "x" * 20_000 + " and Marco" * 2_000])) == 2_000  # each read on
    # at most _LINE characters of its line (the whole line each time took minutes)
    marked = ends.named_copies(grounding.mark(schema, "auto"))
    assert marked["properties"]["customer"].get(grounding.WRITER) is True
    assert grounding.WRITER not in marked["properties"]["product"]
    g = grounding.grammar(marked, [chat])
    assert accepts(g, _obj(customer="Devika Raman", product="Hannah Brooks"))  # only the writer field is cut
    for staff in ("Hannah Brooks", "Emily Carter", "Priya", "Tom", "Brooks (Support"):
        assert not accepts(g, _obj(customer=staff, product="Vantiq")), staff
    line = grounding.line_grammar(marked["properties"]["customer"], [chat], " ", "\n")
    assert line is not None and accepts(line, " Devika Raman\n") and not accepts(line, " Emily Carter\n")
    # the one the first line greets is written to, never the writer: cut wherever that name stands, with a surname
    from asyncpage.extract.staff import addressed

    reply = ("Hi Sophie,\nNo refund, just a filter.\nAhmad Karimi\n\n> On Tue, 4 Jun, Sophie Laurent (Zephyrine Care) "
             "wrote:\n> Kind regards, Sophie")
    assert [reply[a:b] for a, b in addressed(reply)] == ["Sophie", "Sophie Laurent", "Sophie"]
    for text in ("Dear Mr Karimi,\nthanks", "Hello Maria here, my kettle", "Hi, Maria here", "Hi there,\nI",
                 "Thanks.\nHi Sophie,", "Hi " + "A" * 50_000, "Hello Team,\nI'm Team Lead Jordan Smith",
                 "Hi Maria, thanks for contacting us! How can I help?\nMaria: my kettle leaks\nMaria Gonzalez",
                 "Hi Ana,\nthanks for your patience.\n> On Mon, Ana Lucia Reyes wrote:\n> Ana Lucia Reyes",
                 "Hi Ana,\nthe blender broke.\nBest, Ana María López"):
        # a title, a self-introduction, no one's name, not the first line; an agent's greeting on top, or a record
        # signed with the name it greets: the one greeted is its writer
        assert addressed(text) == [], text[:30]
    assert [t[a:b] for t in ["Subject: Fwd: your return\n\nHi Ke Wang,\nKe Wang's note"] for a, b in addressed(t)] \
        == ["Ke Wang"]  # after a subject line; not a possessive's word
    inline = ("Ciao Ben,\n\n> From: Ben, Ventura Mobility Support\n> We have received your photos.\n\nNo, never in "
              "rain.\n\nIsabella Rossi")  # the agent's words quoted, the writer's own below them
    assert [inline[a:b] for a, b in addressed(inline)] == ["Ben", "Ben"]
    unmarked = ("Hi Sophie,\n\nStill broken.\n\nAna\n\nOn Mon, 5 Dec, Sophie Laurent (Zephyrine Care) wrote:\nHi Ana,\n"
                "Please retry.\nSophie")  # a quote without its ">" marks runs to the end: not the writer's own lines
    assert [unmarked[a:b] for a, b in addressed(unmarked)] == ["Sophie", "Sophie Laurent", "Sophie"]
    assert addressed("Hi Ben,\n" + " " * 50_000 + "x") == [(3, 6)]  # no backtracking on a long indent
    g = grounding.grammar(marked, [reply])
    assert accepts(g, _obj(customer="Ahmad Karimi", product="Zephyrine"))
    for agent in ("Sophie Laurent", "Sophie", "Laurent"):
        assert not accepts(g, _obj(customer=agent, product="Zephyrine")), agent
    from asyncpage.extract.staff import writer_sources

    assert writer_sources(["x" * 200_000 + " Ana Lima"])[-1].endswith("Ana Lima")  # linear on a word with no digit
    # the article "A" opening a sentence is no one's name (a customer "A" was copied so); an initial is kept, with
    # its dot or before a name
    assert writer_sources(["A replacement is fine.\nReginald A. Achterberg"]) == [" replacement is fine.\nReginald A. "
                                                                                  "Achterberg"]
    assert writer_sources(["From: A Khan\nJohn A Smith"]) == ["From: A Khan\nJohn A Smith"]
    # someone the writer names by their relation to them is not the writer: that name there is no span
    assert writer_sources(["As my colleague Thomas Berger said, refund us.\nKatharina Vogl"]) == \
        ["As my colleague ", " said, refund us.\nKatharina Vogl"]
    assert writer_sources(["Our director, Mr. Adebayo Ogunleye, asked me.\nNgozi Eze"]) == \
        ["Our director, Mr. ", ", asked me.\nNgozi Eze"]
    assert writer_sources(["for my downstairs neighbour, Herr Eberhard Stimmel.\nRoswitha"]) == \
        ["for my downstairs neighbour, Herr ", ".\nRoswitha"]
    assert writer_sources(["my son\nPriority: low"]) == ["my son\nPriority: low"]  # no name after it on its line
    # ... nor anywhere else the record names them, with their surname ("To: Gareth Hutchins", "Dear Gareth,")
    assert writer_sources(["My husband Gareth booked it.\nClaire Hutchins\n> To: Gareth Hutchins\n> Dear Gareth,"]) \
        == ["My husband ", " booked it.\nClaire Hutchins\n> To: ", "\n> ", ","]
    # the seller's people and departments, a shouted word and "I'm" are no one's name either
    assert writer_sources(["delivered by your driver, Kevin Moss, today.\nBeatrix Lowe"]) == \
        ["delivered by your driver, ", ", today.\nBeatrix Lowe"]
    assert writer_sources(["My sous-chef Paolo Ricci will be there.\nIsabella Conti"]) == \
        ["My sous-chef ", " will be there.\nIsabella Conti"]
    assert writer_sources(["From: Ergonova Shipping <s@e.example>\nThis is CRITICAL, I'm stuck.\nGraham Whitlock"]) == \
        ["From: ", " <s@e.example>\nThis is ", ", ", " stuck.\nGraham Whitlock"]
    assert writer_sources(["Jane Doe Sales Director, Acme"]) == ["Jane Doe Sales Director, Acme"]  # a title's word
    assert writer_sources(["Lanterra Bot: Welcome!\nCustomer: Ramón Echeverría"]) == \
        [": Welcome!\nCustomer: Ramón Echeverría"]  # a chat's bot
    # not inside a longer name (a shared surname), nor alone on its line (a signature)
    assert writer_sources(["My husband, Mr. Smith, booked it.\nRegards,\nJane Smith"])[-1] == ",\nJane Smith"
    assert writer_sources(["My friend Will recommended you.\nWill Turner"])[-1].endswith("Will Turner")
    # a brand before its model's code is no one's name ("Vantor" of "the Vantor M27Q" was copied as the customer)
    assert writer_sources(["I shipped the Vantor M27Q back.\nConnor McAllister"]) == \
        [" shipped the ", " back.\nConnor McAllister"]
    for signed in ("From: Jane Smith jsmith84@gmail.com", "Name: Priya Nair Unit 4B", "Maria Lopez B2B"):
        assert signed.split(": ")[-1].split(" ")[0] in writer_sources([signed])[0], signed  # a name before a code
    assert writer_sources(["Thanks,\nConnor McAllister\nPhone 0412 555 908"]) == [",\nConnor McAllister\nPhone "]
    # the writer saying who they are is not someone else
    assert writer_sources(["Hello, I am her husband, Tom Smith, writing"])[-1].endswith("Tom Smith, writing")
    assert writer_sources(["I'm their manager, Jane Doe, and"]) == [" their manager, Jane Doe, and"]
    # a letter's closing is no one's name, in any language customers close in, however its words are spaced
    assert writer_sources(["Help!\n\nYstävällisin terveisin\nSanna Virtanen", "Merci beaucoup,\nJean Dupont",
                           "Thanks.\nTak Wing Lee", "Kind\xa0regards,\nAna Silva", "Ystävällisin\nterveisin\nMatti"]) \
        == ["Help!\n\n", "\nSanna Virtanen", ",\nJean Dupont", ".\nTak Wing Lee", ",\nAna Silva", "\nMatti"]
    # a team is no one's name: "Boreal Support" (its agent's bracket cut, the team is left) is never the writer
    quoted = "Hi Carla,\n> On 12 Feb, Carla (Boreal Support) wrote:\n> We can ship it.\nCheers,\nLiam O'Sullivan"
    g = grounding.grammar(marked, [quoted])
    assert accepts(g, _obj(customer="Liam O'Sullivan", product="Boreal"))
    for team in ("Boreal Support", "Boreal", "Support"):
        assert not accepts(g, _obj(customer=team, product="Boreal")), team
    # a name, not a message: at most eight words
    note = "Kia ora, Ngaio Te Rangi here. After the sync last night half my folders vanished."
    g = grounding.grammar(marked, [note])
    assert accepts(g, _obj(customer="Ngaio Te Rangi", product="sync"))
    assert not accepts(g, _obj(customer="Kia", product="sync"))  # a greeting is no name, nor "I"
    pronoun = grounding.grammar(marked, ["Kia ora! I bought a Zed 2. Tane Ngata"])
    assert not accepts(pronoun, _obj(customer="I", product="Zed"))
    initial = grounding.grammar(marked, ["Kia ora! I bought a Zed 2. J. I. Tane"])
    assert accepts(initial, _obj(customer="J. I. Tane", product="Zed"))  # an initial keeps its dot
    assert not accepts(g, _obj(customer="Kia ora, Ngaio Te Rangi", product="sync"))
    assert not accepts(g, _obj(customer="Kia ora, Ngaio Te Rangi here. After the sync", product="sync"))
    # a line break or a tab, written as a JSON escape in the value, breaks words as it does in the record
    lines = "Hi,\nmy blender arrived broken\nplease refund me\nMaria Lopez\tmaria@example.com"
    g = grounding.grammar(marked, [lines])
    assert not accepts(g, _obj(customer=lines, product="blender"))
    assert accepts(g, _obj(customer="Maria Lopez", product="blender"))
    assert accepts(g, _obj(customer="my blender arrived broken\nplease refund me\nMaria", product="blender"))  # 8
    # a name holds no digit and no title before it: a phone number is no customer, "Mrs." not part of her name
    signed = "The Zestara air fryer died.\nMrs. Adaeze Okonkwo-Bell\n+61 412 555 983\nI miss Miss Lee's help, Dr Who"
    g = grounding.grammar(marked, [signed])
    assert accepts(g, _obj(customer="Adaeze Okonkwo-Bell", product="Zestara"))
    for wrong in ("Mrs. Adaeze Okonkwo-Bell", "+61 412 555 983", "412 555 983", "Okonkwo-Bell\n+61", "Miss Lee"):
        assert not accepts(g, _obj(customer=wrong, product="Zestara")), wrong
    assert accepts(g, _obj(customer="miss", product="+61 412"))  # "miss" is no title; other fields keep digits
    line = grounding.line_grammar(marked["properties"]["customer"], [signed], " ", "\n")
    assert line is not None and accepts(line, " Adaeze Okonkwo-Bell\n") and not accepts(line, " Mrs. Adaeze\n")
    assert not accepts(g, _obj(customer="my blender arrived broken\nplease refund me\nMaria Lopez", product="blender"))
