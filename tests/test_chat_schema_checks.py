"""What a tool's parameters and the answer's schema may hold, as the turn's grammar enforces it: a
schema without a finite instance is a 400 naming it whatever it stands beside (tools, the answer,
free text), never a failure mid-decoding; a call's arguments are a JSON object whatever the tool's
schema leaves out."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from asyncpage import AsyncEngine, SamplingParams
from asyncpage.chat import HERMES, chat, chat_stream, prepare
from asyncpage.errors import InvalidRequestError
from asyncpage.guided.backend import GuidedSpec
from tests import chat_templates

ASK = [{"role": "user", "content": "Weather?"}]
# Every instance needs a `next`, itself such an object: none ends. Alone it was refused (its grammar
# forces the endless run from the start); beside tools the matcher met it mid-decoding, a 500.
ENDLESS = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
FINE = {"type": "object", "properties": {"a": {"type": "string"}}}
NO_END = "has no finite instance"


def tool(name: str, params: Any = None) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name}
    if params is not None:
        fn["parameters"] = params
    return {"type": "function", "function": fn}


def flat(name: str, params: Any = None) -> dict[str, Any]:
    return {"type": "function", "name": name, **({} if params is None else {"parameters": params})}


def json_schema(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def text_format(schema: Any) -> dict[str, Any]:
    return {"text": {"format": {"type": "json_schema", "name": "a", "schema": schema}}}


@pytest.fixture(scope="module")
def engine(tiny_models: dict[str, tuple[Path, Any]], tmp_path_factory: pytest.TempPathFactory) -> AsyncEngine:
    d = tmp_path_factory.mktemp("chat_schema_checks") / "qwen2"
    shutil.copytree(tiny_models["qwen2"][0], d)
    (d / "chat_template.jinja").write_text(chat_templates.HERMES)
    return AsyncEngine.from_pretrained(d, dtype="float32", num_kv_blocks=64)


def _client(engine: AsyncEngine) -> httpx.AsyncClient:
    from asyncpage.openai import app

    application = app(engine, trust_request_chat_template=True)
    return httpx.AsyncClient(transport=httpx.ASGITransport(application), base_url="http://t", timeout=120)


async def test_a_schema_without_a_finite_instance_is_a_400_naming_it_beside_tools_too(engine: AsyncEngine) -> None:
    """Hermes' format (the engine's template: the answer or the calls) and Llama 3's (the answer and the
    calls are one JSON Schema under tool_choice "auto"), chat and responses, streamed or not: the part
    without an end is named as the body wrote it, and a turn running meanwhile, and the next, go on."""
    chat_cases: list[tuple[dict[str, Any], str]] = [
        ({"response_format": json_schema(ENDLESS)}, "response_format.json_schema.schema"),
        ({"tools": [tool("g"), tool("f", FINE)], "response_format": json_schema(ENDLESS)},
         "response_format.json_schema.schema"),
        ({"tools": [tool("g"), tool("f", ENDLESS)], "response_format": json_schema(FINE)},
         "tools[1].function.parameters"),
        ({"tools": [tool("g"), tool("f", ENDLESS)]}, "tools[1].function.parameters"),
        ({"tools": [tool("g"), tool("f", ENDLESS)], "tool_choice": "required"}, "tools[1].function.parameters"),
        ({"tools": [tool("f", ENDLESS)], "tool_choice": "required"}, "tools[0].function.parameters")]
    cases = [("/v1/chat/completions", {"messages": ASK, **body}, param) for body, param in chat_cases]
    cases += [("/v1/responses", {"input": "hi", "tools": [flat("g"), flat("f", FINE)], **text_format(ENDLESS)},
               "text.format.schema"),
              ("/v1/responses", {"input": "hi", "tools": [flat("g"), flat("f", ENDLESS)], **text_format(FINE)},
               "tools[1].parameters"),
              ("/v1/responses", {"input": "hi", "tools": [flat("g"), flat("f", ENDLESS)]}, "tools[1].parameters")]
    finished: list[str | None] = []

    async def meanwhile(c: httpx.AsyncClient) -> None:
        body = {"messages": ASK, "tools": [tool("f", FINE)], "max_tokens": 48, "seed": 1,
                "response_format": json_schema(FINE), "stream": True}
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    finished.extend(ch["finish_reason"] for ch in json.loads(line[6:])["choices"])

    async with engine, _client(engine) as c:
        async with anyio.create_task_group() as tg:
            tg.start_soon(meanwhile, c)
            for path, body, param in cases:
                for template in (None, chat_templates.LLAMA3):
                    for stream in (False, True):
                        extra = {"chat_template": template} if template else {}
                        r = await c.post(path, json={**body, **extra, "max_tokens": 32, "stream": stream})
                        err = r.json()["error"]
                        assert (r.status_code, err["param"]) == (400, param), (path, template is None, stream, r.text)
                        assert NO_END in err["message"] and "%json" not in err["message"], err["message"]
        assert finished[-1] in ("stop", "length", "tool_calls"), finished
        r = await c.post("/v1/chat/completions", json={"messages": ASK, "tools": [tool("f", FINE)], "max_tokens": 8,
                                                       "response_format": json_schema(FINE)})
        assert r.status_code == 200, r.text


async def test_in_process_the_endless_part_is_named_in_the_generic_format_and_after_reasoning(
        engine: AsyncEngine) -> None:
    """The generic format (the default model's) writes the calls as JSON too, and a reasoning section
    may open the turn before the answer alone: chat() and chat_stream() raise the error naming the
    part, before any token."""
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tools": [tool("f", FINE)], "response_format": json_schema(ENDLESS)},
         "response_format.json_schema.schema"),
        ({"tools": [tool("g"), tool("f", ENDLESS)], "response_format": json_schema(FINE)},
         "tools[1].function.parameters"),
        ({"response_format": json_schema(ENDLESS), "reasoning_markers": ("<think>", "</think>")},
         "response_format.json_schema.schema")]
    params = SamplingParams(max_tokens=16)
    async with engine:
        for kw, field in cases:
            with pytest.raises(InvalidRequestError) as err:
                await chat(engine, ASK, tool_format="generic", params=params, **kw)
            assert err.value.field == field and NO_END in err.value.message, err.value
            with pytest.raises(InvalidRequestError) as err:
                async for _ in chat_stream(engine, ASK, tool_format="generic", params=params, **kw):
                    raise AssertionError("a delta before the refusal")
            assert err.value.field == field, err.value
        res = await chat(engine, ASK, tool_format="generic", params=params, tools=[tool("f", FINE)],
                         response_format=json_schema(FINE))
        assert res.finish_reason in ("stop", "length", "tool_calls"), res


# `{}` and a type list leave the type open: any JSON value (a tiny model wrote a string as the arguments).
# The last refers to its root: `next` may be any value, so it ends; held to "object" it would not.
# Each with arguments it takes: no parameters are no arguments (`{}`).
OPEN: list[tuple[Any, str]] = [
    ({}, '{"a": 1}'), ({"description": "anything"}, '{"a": 1}'), ({"type": ["object", "null"]}, '{"a": 1}'),
    (None, "{}"), ({"properties": {"next": {"$ref": "#"}}, "required": ["next"]}, '{"next": "x"}')]


@pytest.mark.parametrize(("params", "taken"), OPEN, ids=["empty", "untyped", "type-list", "absent", "root-ref"])
async def test_the_arguments_of_a_tool_whose_schema_leaves_the_type_open_are_an_object(
        engine: AsyncEngine, params: Any, taken: str) -> None:
    async with engine, _client(engine) as c:
        for path, body in (("/v1/chat/completions", {"messages": ASK, "tools": [tool("f", params)]}),
                           ("/v1/responses", {"input": "hi", "tools": [flat("f", params)]})):
            for seed in range(4):
                r = await c.post(path, json={**body, "tool_choice": "required", "max_tokens": 48, "seed": seed,
                                             "temperature": 1.5})
                assert r.status_code == 200, (path, r.text)
                out = r.json()
                calls = (out["choices"][0]["message"]["tool_calls"] if "choices" in out
                         else [o for o in out["output"] if o["type"] == "function_call"])
                for call in calls:
                    args = call["function"]["arguments"] if "function" in call else call["arguments"]
                    assert isinstance(json.loads(args), dict), (path, seed, args)
    # What a call may be, whatever the sampling: the grammar takes an object and nothing else.
    turn = await prepare(engine, ASK, tools=[tool("f", params)], tool_choice="required")
    assert turn.params.grammar is not None
    compiled = engine.guided.compile_sync(GuidedSpec("grammar", turn.params.grammar))
    for args in (taken, '"x"', "1", "null", "[]"):
        ids = engine.tokenizer(HERMES.render([("f", args)]), add_special_tokens=False)["input_ids"]
        m = compiled.new_matcher()
        assert (all(m.accept(t) for t in ids) and m.is_accepting()) == (args == taken), (params, args)
