"""JSON under a schema is spelled as models write it, and objects take no key the schema does not
declare: `SamplingParams.json_separators` (json.dumps' `", "` / `": "` by default, compact on request,
never free whitespace) and `json_closed_objects` (on by default, as xgrammar's strict mode), on both
backends, in chat's response_format and tool arguments, and the README's first extraction example on
the default model."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from asyncpage import AsyncEngine, InvalidRequestError, SamplingParams
from asyncpage.chat.formats import FORMATS
from asyncpage.chat.grammar import TurnSpec, build
from asyncpage.chat.types import Tool
from asyncpage.guided import GrammarManager, GuidedSpec
from asyncpage.guided.style import closed_objects
from asyncpage.model.weights import load_tokenizer

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def gemma() -> tuple[Any, Any, list[int]]:
    tok, config, eos = load_tokenizer(None)
    return tok, config.vocab_size, sorted(eos)


def _takes(manager: GrammarManager, tok: Any, params: SamplingParams, text: str) -> bool:
    spec = GuidedSpec.from_params(params)
    assert spec is not None
    m = manager.compile_sync(spec).new_matcher()
    return all(m.accept(t) for t in tok(text, add_special_tokens=False)["input_ids"]) and m.is_accepting()


def test_separators_default_to_json_dumps_and_a_bad_pair_is_refused_by_name() -> None:
    assert SamplingParams().json_separators == (", ", ": ") and SamplingParams().json_closed_objects is True
    assert SamplingParams(json_separators=[",", ":"]).json_separators == (",", ":")  # a JSON body's list
    assert SamplingParams(json_separators=(",\n", ": ")).json_separators == (",\n", ": ")
    for bad in [(";", ":"), (", ", "="), (",", ":", ","), ", ", (" , x", ":"), (",", ":" + " " * 40), None]:
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(json_separators=bad)  # type: ignore[arg-type]
        assert e.value.field == "json_separators"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(json_closed_objects="no")  # type: ignore[arg-type]
    assert e.value.field == "json_closed_objects"


def test_closed_objects_narrows_only_where_nothing_else_adds_properties() -> None:
    assert closed_objects(PERSON)["additionalProperties"] is False
    for kept in [True, {"type": "integer"}]:
        assert closed_objects({**PERSON, "additionalProperties": kept})["additionalProperties"] == kept
    nested = closed_objects({"type": "object", "properties": {"a": PERSON, "b": {"type": "array", "items": PERSON}},
                             "$defs": {"P": PERSON}, "anyOf": [PERSON]})
    assert nested["properties"]["a"]["additionalProperties"] is False
    assert nested["properties"]["b"]["items"]["additionalProperties"] is False
    assert nested["$defs"]["P"]["additionalProperties"] is False and nested["anyOf"][0]["additionalProperties"] is False
    # Values are data: a const object is kept as written.
    const = {"const": {"properties": {"x": 1}}}
    assert closed_objects(const) == const
    # Properties split over allOf branches, a $ref extended beside properties, `not` and `if`: as written.
    split = {"allOf": [PERSON, {"properties": {"city": {"type": "string"}}}]}
    assert closed_objects(split) == split
    ext = {"$defs": {"Base": PERSON}, "$ref": "#/$defs/Base", "properties": {"city": {"type": "string"}}}
    assert closed_objects(ext) == ext
    negated = {"not": PERSON, "if": PERSON, "then": PERSON}
    assert closed_objects(negated) == negated
    # A pydantic v1 style field (`allOf: [{$ref}]`) and a plain $ref: the definition is closed.
    ref = {"$defs": {"P": PERSON}, "properties": {"p": {"allOf": [{"$ref": "#/$defs/P"}]}, "q": {"$ref": "#/$defs/P"}}}
    assert closed_objects(ref)["$defs"]["P"]["additionalProperties"] is False
    assert closed_objects({"prefixItems": [{"type": "integer"}]})["items"] is False
    assert closed_objects({"prefixItems": [{"type": "integer"}], "items": {"type": "string"}})["items"] == {
        "type": "string"}


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_json_is_spelled_with_the_requested_separators_and_nothing_undeclared(
        gemma: tuple[Any, Any, list[int]], backend: str) -> None:
    tok, vocab, eos = gemma
    manager = GrammarManager(tok, vocab, eos, backend)
    spaced, compact, extra = '{"name": "A", "age": 3}', '{"name":"A","age":3}', '{"name": "A", "age": 3, "x": 1}'
    default = SamplingParams(json_schema=PERSON)
    assert _takes(manager, tok, default, spaced)
    assert not _takes(manager, tok, default, compact)
    assert not _takes(manager, tok, default, '{"name":  "A", "age": 3}')  # still no free whitespace
    assert not _takes(manager, tok, default, extra)
    terse = SamplingParams(json_schema=PERSON, json_separators=(",", ":"))
    assert _takes(manager, tok, terse, compact) and not _takes(manager, tok, terse, spaced)
    assert _takes(manager, tok, SamplingParams(json_schema=PERSON, json_closed_objects=False), extra)
    assert _takes(manager, tok, SamplingParams(json_schema={**PERSON, "additionalProperties": True}), extra)
    # A caller's own x-guidance cannot turn free whitespace back on.
    loose = {**PERSON, "x-guidance": {"whitespace_flexible": True}}
    assert not _takes(manager, tok, SamplingParams(json_schema=loose), '{ "name": "A", "age": 3}')
    # Budget closing follows the spelling: the start completion is written with it.
    spec = GuidedSpec.from_params(default)
    assert spec is not None
    assert manager.compile_sync(spec).start_completion() == b'{"name": "", "age": 0}'  # type: ignore[attr-defined]


def test_an_enum_of_objects_is_spelled_as_the_rest(gemma: tuple[Any, Any, list[int]]) -> None:
    tok, vocab, eos = gemma
    manager = GrammarManager(tok, vocab, eos, "llguidance")
    # `not` makes llguidance refuse the schema; it compiles as the enum's valid values.
    schema = {"enum": [{"a": 1, "b": 2}, {"a": 3, "b": 4}], "not": {"const": {"a": 3, "b": 4}}}
    assert _takes(manager, tok, SamplingParams(json_schema=schema), '{"a": 1, "b": 2}')
    assert not _takes(manager, tok, SamplingParams(json_schema=schema), '{"a": 3, "b": 4}')


def test_chat_response_format_and_tool_arguments_follow_the_params(gemma: tuple[Any, Any, list[int]]) -> None:
    tok = gemma[0]
    tools = [Tool("lookup", "", {"type": "object", "properties": {"q": {"type": "string"}}})]

    def rules(**kw: Any) -> list[dict[str, Any]]:
        text = build(TurnSpec(FORMATS["hermes"], tools, "required", False, None, False, False, **kw), tok)
        answer = build(TurnSpec(FORMATS["hermes"], [], "none", False, PERSON, False, False, **kw), tok)
        assert text is not None and answer is not None
        return [json.loads(line.split("%json ", 1)[1]) for line in (text + answer).splitlines() if "%json " in line]

    for schema in rules():
        assert schema["additionalProperties"] is False
        assert schema["x-guidance"]["item_separator"] == ", " and schema["x-guidance"]["key_separator"] == ": "
    for schema in rules(json_separators=(",", ":"), closed_objects=False):
        assert "additionalProperties" not in schema
        assert schema["x-guidance"]["item_separator"] == "," and schema["x-guidance"]["key_separator"] == ":"


class Person(msgspec.Struct):
    name: str
    age: int


async def test_the_readme_extraction_example_gives_what_the_readme_says(default_engine: AsyncEngine) -> None:
    """Compact JSON (`{"name":"Alice","age":`) led the default model to age 100000000000000."""
    assert await default_engine.extract("Alice is 31. As JSON: ", Person) == Person(name="Alice", age=31)
    assert await default_engine.extract("Bob is 40. As JSON: ", Person) == Person(name="Bob", age=40)
    out = await default_engine.generate("Alice is 31. As JSON: ", SamplingParams(
        json_schema=msgspec.json.schema(Person), temperature=0, max_tokens=32))
    assert out.text == '{"name": "Alice", "age": 31}'  # a plain msgspec schema: no invented keys either
