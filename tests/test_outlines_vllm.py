"""vLLM's guided-decoding body fields on the OpenAI app: `structured_outputs` (json, regex, choice,
grammar) and older servers' `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, on the
chat and completions routes, so `outlines.from_vllm(engine.openai_client(), model)` gives outlines'
output types in-process: a pydantic model, an `outlines.types` regex term, a Literal choice and a Lark
CFG. A tiny random model writes garbage, but the grammar makes it valid; one run on the default model."""

from __future__ import annotations

import json
import re
import shutil
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, Field

from asyncpage import AsyncEngine


class Item(BaseModel):
    name: str = Field(max_length=12)
    count: int = Field(ge=0, le=999)
    colour: Literal["red", "green", "blue"]


@pytest.fixture(scope="module")
async def tiny(tiny_llama: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from tests import chat_templates

    path = tmp_path_factory.mktemp("outlines") / "llama"
    shutil.copytree(tiny_llama, path)
    (path / "chat_template.jinja").write_text(chat_templates.LLAMA3)
    engine = AsyncEngine.from_pretrained(path, dtype="float32", num_kv_blocks=128, max_num_seqs=4)
    async with engine:
        yield engine


async def test_outlines_from_vllm_gets_every_output_type_on_a_tiny_model(tiny: AsyncEngine) -> None:
    import outlines
    from outlines import types

    model = outlines.from_vllm(tiny.openai_client(), "tiny")
    kw = {"max_tokens": 96, "temperature": 1.0, "seed": 3}
    for seed in range(3):
        item = Item.model_validate_json(await model("An item as JSON:", Item, **{**kw, "seed": seed}))
        assert isinstance(item, Item)
    date = await model("A date:", types.date, **kw)
    assert re.fullmatch(types.date.pattern, date)
    colour = await model("A colour:", Literal["red", "green", "blue"], **kw)
    assert colour in ("red", "green", "blue")
    answer = await model("Yes or no?", types.cfg('start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]{1,3}/'), **kw)
    assert re.fullmatch(r"yes|no|maybe [0-9]{1,3}", answer)


async def test_each_body_field_constrains_chat_and_completions(tiny: AsyncEngine) -> None:
    client = tiny.openai_client()
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"structured_outputs": {"json": schema}}, lambda t: set(json.loads(t)) <= {"n"}),
        ({"structured_outputs": {"json": json.dumps(schema)}}, lambda t: set(json.loads(t)) <= {"n"}),
        ({"structured_outputs": {"regex": "[a-c]{3}"}}, lambda t: re.fullmatch("[a-c]{3}", t)),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
        ({"structured_outputs": {"grammar": 'start: "x" "y"?'}}, lambda t: t in ("x", "xy")),
        ({"structured_outputs": {"json_object": True}}, lambda t: isinstance(json.loads(t), dict)),
        ({"guided_json": schema}, lambda t: set(json.loads(t)) <= {"n"}),
        ({"guided_regex": "[0-9]{2}"}, lambda t: re.fullmatch("[0-9]{2}", t)),
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"guided_grammar": 'root ::= "a" | "b"'}, lambda t: t in ("a", "b")),
    ]
    for extra, ok in cases:
        chat = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "go"}],
                                                    max_tokens=48, seed=1, extra_body=extra)
        text = chat.choices[0].message.content
        assert text is not None and ok(text), (extra, text)
        done = await client.completions.create(model="tiny", prompt="go", max_tokens=48, seed=1, extra_body=extra)
        assert ok(done.choices[0].text), (extra, done.choices[0].text)


async def test_undeclared_keys_follow_disable_additional_properties(tiny: AsyncEngine) -> None:
    """Closed by default (no key the schema does not list); vLLM's `disable_additional_properties:
    false` keeps JSON Schema's open default (the request's schema as the grammar gets it)."""
    from asyncpage.guided import GuidedSpec
    from asyncpage.openai.convert import _params

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    for extra, closed in [({}, True), ({"disable_additional_properties": True}, True),
                          ({"disable_additional_properties": False}, False)]:
        params = _params({"structured_outputs": {"json": schema, **extra}}, 16)
        spec = GuidedSpec.from_params(params)
        assert spec is not None
        assert ("additionalProperties" in json.loads(spec.value)) is closed


async def test_conflicting_or_unknown_fields_are_a_400_naming_the_field(tiny: AsyncEngine) -> None:
    client = tiny.openai_client()
    msgs = [{"role": "user", "content": "go"}]
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    bad: list[tuple[dict[str, Any], str]] = [
        ({"response_format": rf, "extra_body": {"structured_outputs": {"regex": "a"}}}, "structured_outputs.regex"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_json": {}}}, "guided_json"),
        ({"tools": [tool], "extra_body": {"guided_choice": ["a"]}}, "guided_choice"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs.choice"),
        ({"extra_body": {"structured_outputs": {"regex": "a"}, "guided_regex": "b"}}, "guided_regex"),
        ({"extra_body": {"structured_outputs": {"json": "{not json"}}}, "structured_outputs.json"),
        ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs.choice"),
        ({"extra_body": {"structured_outputs": {"whitespace_pattern": " *"}}}, "structured_outputs.whitespace_pattern"),
        ({"extra_body": {"structured_outputs": "json"}}, "structured_outputs"),
        ({"extra_body": {"json_separators": ";"}}, "json_separators"),
        # a constraint that fails to compile is named by its kind, not as response_format (none was sent)
        ({"extra_body": {"guided_regex": "[^\\s\\S]"}}, "regex"),
        ({"extra_body": {"structured_outputs": {"grammar": "start: x"}}}, "grammar"),
        ({"extra_body": {"guided_choice": ["a", "x" * 20000]}}, "choice"),
    ]
    for kw, field in bad:
        with pytest.raises(openai.BadRequestError) as e:
            await client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, **kw)  # type: ignore[call-overload]
        assert e.value.body["param"] == field, (kw, e.value.body)  # type: ignore[index]


async def test_outlines_from_vllm_on_the_default_model(default_engine: AsyncEngine) -> None:
    import outlines

    class Person(BaseModel):
        name: str
        age: int

    model = outlines.from_vllm(default_engine.openai_client(), "gemma")
    text = await model("Alice is 31 years old. Give her as JSON with name and age.", Person, max_tokens=48,
                       temperature=0)
    person = Person.model_validate_json(text)
    assert person.name == "Alice" and person.age == 31, text
