"""Typed extraction asks of pydantic types, retries a refused value from its first refused field (the prompt's
KV reused, the refused value excluded), and reports a confidence per field: on a tiny random model, whose text
is garbage but whose grammar makes it valid JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, ClassVar

import msgspec
import pytest
from pydantic import BaseModel, Field, field_validator

from asyncpage import AsyncEngine
from asyncpage.errors import ExtractionError
from asyncpage.extract import ExtractResult
from asyncpage.extract.jobs import load_schema, result_line
from asyncpage.extract.retry import excluding, in_string, not_literal, rest_grammar, top_fields

PROMPT = "Records of people, one per line, with their name and age, as JSON objects. The first one: "


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=99)


class PickyAge(BaseModel):
    """Refuses the first age it is shown, whatever it is."""

    seen: ClassVar[list[int]] = []
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=99)

    @field_validator("age")
    @classmethod
    def not_the_first(cls, v: int) -> int:
        cls.seen.append(v)
        if len(cls.seen) == 1:
            raise ValueError("the first age is always refused")
        return v


class PickyStruct(msgspec.Struct):
    """Refuses its first value in __post_init__ (no field named: the last field is decoded again)."""

    seen: ClassVar[list[Any]] = []
    name: Annotated[str, msgspec.Meta(max_length=8)]
    age: Annotated[int, msgspec.Meta(ge=0, le=99)]

    def __post_init__(self) -> None:
        PickyStruct.seen.append(self.age)
        if len(PickyStruct.seen) == 1:
            raise ValueError("the first value is always refused")


def tiny(path: Path) -> AsyncEngine:
    return AsyncEngine.from_pretrained(str(path), dtype="float32", block_size=4, num_kv_blocks=256,
                                       max_num_batched_tokens=64)


async def test_a_pydantic_model_comes_back_as_its_instance(tiny_llama: Path) -> None:
    async with tiny(tiny_llama) as engine:
        p = await engine.extract(PROMPT, Person, max_retries=0)
        assert isinstance(p, Person) and len(p.name) <= 8 and 0 <= p.age <= 99
        many = [r async for r in engine.extract_many([PROMPT, PROMPT + " "], list[Person], prompt="{text}")]
        assert all(r.ok and isinstance(r.value, list) and all(isinstance(x, Person) for x in r.value) for r in many)
        assert all(r.attempts == 1 and r.confidence is None for r in many)


async def test_a_refused_field_is_decoded_again_from_there_reusing_the_prompt(tiny_llama: Path) -> None:
    PickyAge.seen.clear()
    async with tiny(tiny_llama) as engine:
        before = engine.stats().prefix_cache_hit_tokens
        [r] = [r async for r in engine.extract_many([PROMPT], PickyAge, prompt="{text}", max_retries=1)]
        n_prompt = len(await engine.tokenize(PROMPT))
        grown = engine.stats().prefix_cache_hit_tokens - before
        assert r.ok, r.error
        assert isinstance(r.value, PickyAge) and r.attempts == 2
        first, second = PickyAge.seen
        assert r.value.age == second != first  # the refused value was excluded by the grammar
        assert grown >= 0.9 * n_prompt, (grown, n_prompt)
        assert engine.stats().kv_blocks_used == 0


async def test_without_retries_the_refusal_is_the_records_error_with_its_field(tiny_llama: Path) -> None:
    PickyAge.seen.clear()
    async with tiny(tiny_llama) as engine:
        [r] = [r async for r in engine.extract_many([PROMPT], PickyAge, prompt="{text}")]
        assert r.error is not None and r.error.reason == "invalid_output" and "age" in r.error.message
        assert r.attempts == 1
        PickyAge.seen.clear()
        with pytest.raises(ExtractionError, match="age"):
            await engine.extract(PROMPT, PickyAge)
        PickyAge.seen.clear()
        value = await engine.extract(PROMPT, PickyAge, max_retries=2)
        assert isinstance(value, PickyAge) and len(PickyAge.seen) == 2


async def test_a_post_init_refusal_is_retried_and_confidence_is_per_field(tiny_llama: Path) -> None:
    PickyStruct.seen.clear()
    async with tiny(tiny_llama) as engine:
        [r] = [r async for r in engine.extract_many([PROMPT], PickyStruct, prompt="{text}", max_retries=1,
                                                    confidence=True)]
        assert r.ok and isinstance(r.value, PickyStruct) and r.attempts == 2
        assert r.confidence is not None and set(r.confidence) == {"name", "age"}
        assert all(0 < c <= 1 for c in r.confidence.values())
        res = await engine.extract(PROMPT, Person, confidence=True)
        assert isinstance(res, ExtractResult) and isinstance(res.value, Person) and res.attempts == 1
        assert res.confidence is not None and set(res.confidence) == {"name", "age"}


def test_old_rows_still_decode_and_new_rows_write_pydantic_values() -> None:
    old = msgspec.json.decode(b'{"id": 1, "value": {"a": 1}}', type=ExtractResult)
    assert old.attempts == 1 and old.confidence is None
    row = result_line(ExtractResult("x", value=Person(name="Al", age=3), attempts=2, confidence={"age": 0.5}), 7)
    assert row == {"id": "x", "value": {"name": "Al", "age": 3}, "attempts": 2, "confidence": {"age": 0.5},
                   "line": 7}
    assert b"attempts" not in msgspec.json.encode(ExtractResult("y"))


def test_schema_module_name_takes_a_pydantic_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mymodels.py").write_text("from pydantic import BaseModel\nclass Ticket(BaseModel):\n"
                                          "    customer: str\n    urgent: bool\n")
    monkeypatch.chdir(tmp_path)
    model = load_schema("mymodels:Ticket")
    from asyncpage.extract import json_params

    params, target = json_params(model, None)
    assert params.json_schema is not None and params.json_schema["additionalProperties"] is False
    assert target.decode('{"customer": "a", "urgent": true}').customer == "a"


def test_exclusions_refuse_exactly_the_refused_values() -> None:
    from llguidance import LLMatcher

    from asyncpage.guided.search import byte_tokenizer

    tok = byte_tokenizer()

    def takes(grammar: Any, text: str) -> bool:
        m = LLMatcher(tok, grammar, log_level=0)
        return all(m.consume_token(b) for b in text.encode()) and m.is_accepting()

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "ok": {"type": "boolean"}},
              "required": ["name", "age"], "additionalProperties": False}
    opts = {"whitespace_flexible": False}
    lark = rest_grammar(schema, "name", "", ["Al ice", "ü.*"], opts)
    assert lark is not None
    g = LLMatcher.grammar_from_lark(lark)
    assert not takes(g, '"Al ice","age":3}') and not takes(g, '"ü.*","age":3}')
    assert takes(g, '"Al ic","age":3,"ok":true}') and takes(g, '"Al icee","age":3}')
    g = LLMatcher.grammar_from_lark(rest_grammar(schema, "age", '":', [31], opts) or "")
    assert not takes(g, '":31}') and takes(g, '":30}') and takes(g, '":32,"ok":false}')
    assert excluding([[1]]) is None and excluding([{"a": 1}]) is None
    assert not_literal("")  # every non-empty string
    assert [f.key for f in top_fields('{"a": "x,}", "b" : [1, {"c": 2}], "d":null}') or []] == ["a", "b", "d"]
    assert top_fields("[1]") is None and json.loads('{"a": 1}') == {"a": 1}



async def test_a_retry_decodes_under_json_schemas_runaway_guards(tiny_llama: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The retry's grammar (a Lark grammar of `%json` blocks) asks for json_schema's guards, as the first decode has
    them (a model that wanted the refused 52 wrote 52 and a thousand zeros to max_tokens; the guard itself:
    tests/test_budget_close.py), each off where the schema asks for long values, as under json_schema."""
    from asyncpage import SamplingParams
    from asyncpage.extract import many, run

    asked: list[SamplingParams] = []
    real = run.retry_params

    def spy(*args: Any, **kwargs: Any) -> SamplingParams | None:
        out = real(*args, **kwargs)
        asked.append(out)  # type: ignore[arg-type]
        return out

    monkeypatch.setattr(many, "retry_params", spy)
    PickyAge.seen.clear()
    params = SamplingParams(max_tokens=200, temperature=0, max_number_digits=4, max_string_repeats=3)
    async with tiny(tiny_llama) as engine:
        [r] = [r async for r in engine.extract_many([PROMPT], PickyAge, prompt="{text}", params=params,
                                                    max_retries=1)]
    assert r.ok and r.attempts == 2, r.error
    [p] = asked
    assert p.grammar is not None and p.json_guards and (p.max_number_digits, p.max_string_repeats) == (4, 3)
    long = run.json_grammar(params, p.grammar, {"type": "integer", "maximum": 10**20})
    assert long.json_guards and long.max_number_digits == 0  # the schema asks for 21 digits: that guard is off


def test_a_copied_fields_grammar_keeps_the_digit_guard_not_the_repetition_guard() -> None:
    """A copied span is never longer than its record: the repetition guard would cut one that repeats itself
    ("Tok tok tok ... Drum"); a generated number keeps the digit guard."""
    from asyncpage import SamplingParams
    from asyncpage.extract import grounding, run

    schema = grounding.mark({"type": "object", "properties": {"product": {"type": "string"}, "n": {"type": "integer"}},
                             "required": ["product", "n"], "additionalProperties": False}, "auto")
    p = run.grounded(SamplingParams(max_tokens=64), schema, ["Tok tok tok tok tok tok tok tok tok tok Drum, 3"])
    assert p.grammar is not None and p.json_guards and (p.max_number_digits, p.max_string_repeats) == (15, 0)


def test_a_retry_keeps_tokens_up_to_a_place_outside_every_string() -> None:
    """The guards' lexer starts outside strings at the retry grammar's start: the kept tokens end outside one
    (a `":` token that closes the key is not kept)."""
    for text in ('{"name": "Al', '{"a": "x\\"', '{"n'):
        assert in_string(text)[-1], text
    for text in ('{"name": "Al", ', '{"a": "x\\\\"', ""):
        assert not in_string(text)[-1], text
    assert in_string('"x", 1') == [False, True, True, False, False, False, False]
