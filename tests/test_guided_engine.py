"""Guided decoding through the engine on the default model: typed extraction, regex, choice, shipped
grammars, constrained and free requests in one batch, and typed errors that leave others running."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import jsonschema
import msgspec
import pytest

from asyncpage import AsyncEngine, GrammarError, InvalidRequestError, SamplingParams


class Person(msgspec.Struct):
    name: str
    age: int
    city: str


async def test_extract_returns_a_typed_struct(default_engine: AsyncEngine) -> None:
    p = await default_engine.extract("Alice is a 31 year old engineer living in Paris.\nAs JSON: ", Person)
    assert isinstance(p, Person) and p.city == "Paris" and p.name == "Alice"


async def test_extract_with_a_json_schema_dict_returns_valid_json(default_engine: AsyncEngine) -> None:
    schema = {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                         "minItems": 1, "maxItems": 3}},
              "required": ["colors"], "additionalProperties": False}
    value = await default_engine.extract("Name some primary colors as JSON: ", schema)
    jsonschema.validate(value, schema)


async def test_regex_and_choice_constrain_the_text(default_engine: AsyncEngine) -> None:
    date = await default_engine.generate("Today's date in ISO format: ", SamplingParams(
        regex=r"20\d\d-[01]\d-[0-3]\d", max_tokens=20, temperature=0.7, seed=1))
    assert re.fullmatch(r"20\d\d-[01]\d-[0-3]\d", date.text) and date.finish_reason == "stop"
    ans = await default_engine.generate("Is water wet? Answer: ", SamplingParams(choice=["yes", "no"], temperature=0))
    assert ans.text in ("yes", "no") and ans.finish_reason == "stop"


@pytest.mark.parametrize("name", ["sql_select", "arithmetic", "json"])
async def test_shipped_grammars_are_usable_by_name(default_engine: AsyncEngine, name: str) -> None:
    out = await default_engine.generate("Example:\n", SamplingParams(grammar=name, max_tokens=40, temperature=0))
    if name == "sql_select":
        assert out.text.startswith("SELECT ")
    if name == "json" and out.finish_reason == "stop":
        json.loads(out.text)
    if name == "arithmetic":
        assert re.fullmatch(r"[0-9+\-*/().]+", out.text)


async def test_constrained_and_free_requests_share_a_batch(default_engine: AsyncEngine) -> None:
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = await default_engine.generate("The history of Rome", free)
    outs = await asyncio.gather(
        default_engine.generate("The history of Rome", free),
        default_engine.extract("Bob, 42, lives in Oslo. JSON: ", Person),
        default_engine.generate("Pick one: ", SamplingParams(choice=["alpha", "beta", "gamma"], temperature=0)),
        default_engine.generate("Count: ", SamplingParams(regex=r"[0-9]{3}", max_tokens=8, temperature=0)))
    assert outs[0].token_ids == alone.token_ids  # the masks of the others did not touch the free row
    assert isinstance(outs[1], Person)
    assert outs[2].text in ("alpha", "beta", "gamma")
    assert re.fullmatch(r"[0-9]{3}", outs[3].text)


async def test_unsupported_schema_and_compile_timeout_fail_alone(default_engine: AsyncEngine) -> None:
    free = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    running = asyncio.create_task(default_engine.generate("Once upon a time", free))
    with pytest.raises(GrammarError) as e:
        await default_engine.generate("x", SamplingParams(json_schema={"type": "array", "uniqueItems": True}))
    assert e.value.field == "json_schema" and "uniqueItems" in str(e.value)
    with pytest.raises(InvalidRequestError):
        await default_engine.generate("x", SamplingParams(grammar="start: (((("))
    async with default_engine.clone(grammar_compile_timeout=0.001, num_kv_blocks=64) as strict:
        big = {"type": "object", "properties": {f"field_{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}x$"}
                                                for i in range(400)}}
        with pytest.raises(GrammarError, match="longer than"):
            await strict.generate("x", SamplingParams(json_schema=big))
        ok = await strict.generate("Hello", SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(ok.token_ids) == 3
    out = await running
    assert len(out.token_ids) == 30


async def test_parallel_samples_each_follow_the_grammar(default_engine: AsyncEngine) -> None:
    out = await default_engine.generate("A number: ", SamplingParams(
        n=4, regex=r"[1-9][0-9]{0,3}", max_tokens=6, temperature=1.0, seed=5))
    assert all(re.fullmatch(r"[1-9][0-9]{0,3}", c.text) for c in out.choices)


async def test_grammar_forced_tokens_take_no_steps_of_their_own(default_engine_unstarted: AsyncEngine) -> None:
    """Fast-forward: after '{"' the schema forces 'name' etc.; those tokens join the sequence at once
    and are computed together, so the request takes fewer engine steps than it has output tokens."""
    engine = default_engine_unstarted.clone(num_kv_blocks=64)
    real = engine._core.runner.execute
    steps = 0

    def counting(batch):  # type: ignore[no-untyped-def]
        nonlocal steps
        steps += 1
        return real(batch)

    engine._core.runner.execute = counting  # type: ignore[method-assign]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    async with engine:
        out = await engine.generate("Alice is 31. As JSON: ", SamplingParams(json_schema=schema, temperature=0))
    json.loads(out.text)
    assert out.finish_reason == "stop"
    assert steps < len(out.token_ids), (steps, len(out.token_ids))


async def test_xgrammar_lets_the_model_go_on_where_the_grammar_could_end(tiny_llama: Any) -> None:
    """As with llguidance: "a" of ["a", "ab"] or one digit of `[0-9]{1,6}` may end the value (the
    stop token is offered there) but need not; a grammar complete from the start gives ""."""
    opts: dict[str, Any] = dict(dtype="float32", block_size=4, num_kv_blocks=128, max_num_batched_tokens=32)
    async with AsyncEngine.from_pretrained(str(tiny_llama), guided_backend="xgrammar", **opts) as engine:
        choice = await engine.generate("Count: 12345 ", SamplingParams(choice=["a", "ab"], n=8, seed=3))
        assert {c.text for c in choice.choices} == {"a", "ab"}
        digits = await engine.generate("Count: 12345 ", SamplingParams(regex="[0-9]{1,6}", n=8, seed=1))
        assert all(re.fullmatch("[0-9]{1,6}", c.text) for c in digits.choices)
        assert max(len(c.text) for c in digits.choices) > 1
        empty = await engine.generate("Count: ", SamplingParams(regex="", max_tokens=4))
        assert (empty.text, empty.choices[0].finish_reason) == ("", "stop")
