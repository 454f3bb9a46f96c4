"""Reasoning through the OpenAI surface, with the official client in-process on a tiny reasoning model
(tests/reasoning_models.py: its template opens the answer with `<think>`, it never closes it alone):
chat's `message.reasoning_content` / `delta.reasoning_content`, the body's max_reasoning_tokens and
reasoning_effort, /v1/responses' `reasoning` output item and its reasoning_text events, a request's
own chat_template (taken in-process, refused by a server that does not trust them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from asyncpage import AsyncEngine
from asyncpage.openai import app
from asyncpage.openai.transport import make_transport_class
from tests import reasoning_models

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"],
          "additionalProperties": False}
CHAT_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
TEXT_FORMAT = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}}
MSGS: list[Any] = [{"role": "user", "content": "Think, then answer."}]


@pytest.fixture(scope="module")
async def engine(tiny_models: dict[str, tuple[Path, Any]],
                 tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = reasoning_models.build(tiny_models["qwen3"][0], tmp_path_factory.mktemp("r") / "never",
                                  template=reasoning_models.THINKING_OPENED, close_probability=0.0)
    async with AsyncEngine.from_pretrained(path, dtype="float32", num_kv_blocks=96) as e:
        yield e


@pytest.fixture(scope="module")
def client(engine: AsyncEngine) -> openai.AsyncOpenAI:
    return engine.openai_client()


async def test_chat_returns_the_reasoning_apart_and_the_answer_valid(client: openai.AsyncOpenAI) -> None:
    r = await client.chat.completions.create(model="m", messages=MSGS, response_format=CHAT_FORMAT,  # type: ignore[arg-type]
                                             max_tokens=80, seed=1, extra_body={"max_reasoning_tokens": 16})
    msg = r.choices[0].message
    assert getattr(msg, "reasoning_content", None) and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(msg.content or ""), SCHEMA)
    assert r.usage is not None and r.usage.completion_tokens_details is not None
    assert r.usage.completion_tokens_details.reasoning_tokens == 16
    none = await client.chat.completions.create(model="m", messages=MSGS, response_format=CHAT_FORMAT,  # type: ignore[arg-type]
                                                max_tokens=40, seed=1, reasoning_effort="none")
    assert getattr(none.choices[0].message, "reasoning_content", None) is None
    jsonschema.validate(json.loads(none.choices[0].message.content or ""), SCHEMA)


async def test_a_streamed_chat_sends_reasoning_deltas_then_content(client: openai.AsyncOpenAI) -> None:
    kinds: list[str] = []
    thought, said = [], []
    stream = await client.chat.completions.create(model="m", messages=MSGS, response_format=CHAT_FORMAT,  # type: ignore[arg-type]
                                                  max_tokens=80, seed=2, stream=True,
                                                  extra_body={"max_reasoning_tokens": 12})
    async for chunk in stream:
        for c in chunk.choices:
            r = getattr(c.delta, "reasoning_content", None)
            if r:
                thought.append(r)
                kinds.append("reasoning")
            if c.delta.content:
                said.append(c.delta.content)
                kinds.append("content")
    assert thought and said and kinds.index("content") > kinds.index("reasoning")
    assert "reasoning" not in kinds[kinds.index("content"):]
    jsonschema.validate(json.loads("".join(said)), SCHEMA)


async def test_a_response_has_a_reasoning_item_before_its_message(client: openai.AsyncOpenAI) -> None:
    r = await client.responses.create(model="m", input="Think, then answer.", text=TEXT_FORMAT,  # type: ignore[arg-type]
                                      max_output_tokens=80, temperature=0, extra_body={"max_reasoning_tokens": 10})
    kinds = [o.type for o in r.output]
    assert kinds == ["reasoning", "message"], kinds
    item = r.output[0]
    assert item.type == "reasoning" and item.content and item.content[0].type == "reasoning_text"
    assert item.content[0].text and item.summary == []
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.usage is not None and r.usage.output_tokens_details.reasoning_tokens == 10
    effort = await client.responses.create(model="m", input="Answer.", text=TEXT_FORMAT,  # type: ignore[arg-type]
                                           max_output_tokens=40, temperature=0, reasoning={"effort": "none"})
    assert [o.type for o in effort.output] == ["message"] and effort.reasoning is not None
    assert effort.reasoning.effort == "none"


async def test_a_streamed_response_sends_reasoning_text_events(client: openai.AsyncOpenAI) -> None:
    kinds: list[str] = []
    deltas: list[str] = []
    async with client.responses.stream(model="m", input="Think, then answer.", text=TEXT_FORMAT,  # type: ignore[arg-type]
                                       max_output_tokens=80, temperature=0,
                                       extra_body={"max_reasoning_tokens": 10}) as stream:
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.reasoning_text.delta":
                deltas.append(event.delta)
        final = await stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    first_text = kinds.index("response.output_text.delta")
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.reasoning_text.done") < first_text
    reasoning = final.output[0]
    assert reasoning.type == "reasoning" and reasoning.content and reasoning.content[0].text == "".join(deltas)
    jsonschema.validate(json.loads(final.output_text), SCHEMA)


async def test_a_request_template_is_taken_in_process_and_refused_by_an_untrusting_app(
        engine: AsyncEngine, client: openai.AsyncOpenAI) -> None:
    template = reasoning_models.PLAIN.replace("<think>\n", "<think>\nLet me think.")
    r = await client.chat.completions.create(model="m", messages=MSGS, max_tokens=24, seed=0,
                                             extra_body={"chat_template": template, "max_reasoning_tokens": 4})
    assert getattr(r.choices[0].message, "reasoning_content", None)
    # A server's app takes no template from its callers unless told to.
    transport = make_transport_class(httpx)(app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://asyncpage.local/v1") as http:
        res = await http.post("/chat/completions", json={"model": "m", "messages": MSGS, "chat_template": template})
        assert res.status_code == 400 and res.json()["error"]["param"] == "chat_template"
        res = await http.post("/chat/completions", json={"model": "m", "messages": MSGS, "reasoning_effort": "huge"})
        assert res.status_code == 400 and res.json()["error"]["param"] == "reasoning_effort"
        res = await http.post("/responses", json={"model": "m", "input": "x", "reasoning": {"effort": "huge"}})
        assert res.status_code == 400 and res.json()["error"]["param"] == "reasoning.effort"
