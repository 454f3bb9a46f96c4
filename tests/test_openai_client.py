"""The OpenAI-compatible surface, driven by the official `openai` client in-process (streaming
transport, no socket) on the real default model: tool calls valid by construction in every
tool_choice mode, streamed deltas that assemble the same calls, usage, errors, cancellation."""

from __future__ import annotations

import json
import time
from typing import Any

import jsonschema
import openai
import pytest

from asyncpage import AsyncEngine

pytestmark = pytest.mark.slow

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
                                                   "unit": {"enum": ["c", "f"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": WEATHER_PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                        "maxLength": 20}}, "required": ["city"]}}}
ASK = [{"role": "system", "content": "You are a weather assistant."},
       {"role": "user", "content": "What is the weather in Paris, in celsius?"}]


@pytest.fixture(scope="module")
def client(default_engine: AsyncEngine) -> openai.AsyncOpenAI:
    return default_engine.openai_client()


def _check_calls(calls: Any, allowed: tuple[str, ...] = ("get_weather",)) -> None:
    schemas = {"get_weather": WEATHER_PARAMS, "get_time": TIME["function"]["parameters"]}
    assert calls
    for c in calls:
        assert c.type == "function" and c.id and c.function.name in allowed
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])


async def test_chat_without_tools_answers_in_text(client: openai.AsyncOpenAI, default_engine: AsyncEngine) -> None:
    r = await client.chat.completions.create(model="anything", messages=ASK, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and isinstance(r.choices[0].message.content, str)
    assert r.usage is not None and r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 10
    models = await client.models.list()
    assert [m.id for m in models.data] == [r.model if r.model != "anything" else models.data[0].id]


@pytest.mark.parametrize("choice", ["required", "named"])
async def test_forced_tool_call_returns_valid_arguments(client: openai.AsyncOpenAI, choice: str) -> None:
    tool_choice: Any = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    r = await client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice,
                                             parallel_tool_calls=False, max_tokens=48, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls or []) == 1
    _check_calls(ch.message.tool_calls, ("get_weather", "get_time") if choice == "required" else ("get_weather",))


async def test_a_named_tool_choice_is_one_call_even_with_parallel_calls_allowed(client: openai.AsyncOpenAI) -> None:
    # OpenAI's default parallel_tool_calls=True: a base model would repeat the forced call to max_tokens.
    r = await client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, TIME], max_tokens=96,
                                             tool_choice={"type": "function", "function": {"name": "get_time"}},
                                             temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls or []) == 1
    _check_calls(ch.message.tool_calls, ("get_time",))


async def test_streamed_tool_call_assembles_from_index_stable_deltas(client: openai.AsyncOpenAI) -> None:
    kw: Any = dict(model="m", messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                   max_tokens=48, temperature=0)
    whole = await client.chat.completions.create(**kw)
    t0 = time.monotonic()
    stream = await client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    calls: dict[int, dict[str, str]] = {}
    first_at, finish, usage = None, None, None
    async for chunk in stream:
        first_at = first_at or time.monotonic() - t0
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                if tc.id is not None:
                    assert tc.index not in calls and tc.function and tc.function.name
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                calls[tc.index]["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = c.finish_reason or finish
    total = time.monotonic() - t0
    assert finish == "tool_calls" and usage is not None and usage.completion_tokens > 0
    assert first_at is not None and first_at < total
    assert list(calls) == list(range(len(calls)))
    for c in calls.values():
        assert c["name"] == "get_weather"
        jsonschema.validate(json.loads(c["arguments"]), WEATHER_PARAMS)
    same = whole.choices[0].message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in same] == [(c["name"], c["arguments"])
                                                                       for c in calls.values()]


async def test_stop_strings_never_cut_inside_a_tool_call(client: openai.AsyncOpenAI) -> None:
    # Every call's JSON holds '"', ", " and ": ": as stop strings they would end it mid-arguments.
    for stream in (False, True):
        kw: Any = dict(model="m", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=48,
                       temperature=0, parallel_tool_calls=False, stop=['"', ", ", "}"])
        if not stream:
            r = await client.chat.completions.create(**kw)
            assert r.choices[0].finish_reason == "tool_calls"
            _check_calls(r.choices[0].message.tool_calls)
            continue
        args, finish = "", None
        async for chunk in await client.chat.completions.create(**kw, stream=True):
            for c in chunk.choices:
                for tc in c.delta.tool_calls or []:
                    args += (tc.function.arguments or "") if tc.function else ""
                finish = c.finish_reason or finish
        assert finish == "tool_calls"
        jsonschema.validate(json.loads(args), WEATHER_PARAMS)


async def test_stop_strings_still_end_free_text_when_tools_are_offered(default_engine: AsyncEngine) -> None:
    from asyncpage import SamplingParams

    msgs = [{"role": "user", "content": "Write a short poem about the sea."}]
    free = await default_engine.chat(msgs, tools=[WEATHER], tool_choice="auto",
                                     params=SamplingParams(max_tokens=24, temperature=0))
    assert free.content and not free.tool_calls, free  # this model answers in text here
    word = free.content.split()[1]
    deltas = [d async for d in default_engine.chat_stream(msgs, tools=[WEATHER], tool_choice="auto",
                                                          params=SamplingParams(max_tokens=24, temperature=0,
                                                                                stop=[word]))]
    cut = free.content[: free.content.index(word)]
    assert "".join(d.content or "" for d in deltas) == cut and deltas[-1].finish_reason == "stop"
    res = await default_engine.chat(msgs, tools=[WEATHER], tool_choice="auto",
                                    params=SamplingParams(max_tokens=24, temperature=0, stop=[word]))
    assert res.content == cut and res.finish_reason == "stop" and res.usage.completion_tokens < 24


async def test_auto_and_none_never_return_invalid_calls(client: openai.AsyncOpenAI) -> None:
    r = await client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="auto",
                                             max_tokens=24, temperature=0)
    if r.choices[0].message.tool_calls:
        _check_calls(r.choices[0].message.tool_calls)
    r = await client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="none",
                                             max_tokens=8, temperature=0)
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason in ("stop", "length")


async def test_response_format_json_schema_is_followed(client: openai.AsyncOpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    r = await client.chat.completions.create(
        model="m", messages=ASK, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), schema)


async def test_malformed_request_gets_a_400_naming_the_parameter(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model="m", messages=ASK, temperature=-1)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER],
                                             tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.param == "tool_choice"
    auto_tool = {"type": "function", "function": {"name": "auto", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as e:  # would read as tool_choice="auto": refused, not misread
        await client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, auto_tool],
                                             tool_choice={"type": "function", "function": {"name": "auto"}})
    assert e.value.param == "tool_choice" and "rename" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "x"}])
    assert e.value.param == "messages[0].role"
    with pytest.raises(openai.NotFoundError):
        await client.get("/nowhere", cast_to=object)


async def test_unsupported_or_oversized_requests_are_refused_not_ignored(client: openai.AsyncOpenAI,
                                                                      default_engine: AsyncEngine) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model="m", messages=ASK, logit_bias={"1": 5})
    assert e.value.param == "logit_bias"
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model="m", prompt=["a", "b"], max_tokens=2, stream=True)
    assert e.value.param == "prompt"
    import httpx2

    from asyncpage.openai import app
    from asyncpage.openai.transport import make_transport_class

    transport = make_transport_class(httpx2)(app(default_engine, max_request_bytes=1000))
    async with httpx2.AsyncClient(transport=transport, base_url="http://x/v1") as hc:
        big = {"model": "m", "messages": [{"role": "user", "content": "x" * 2000}]}
        r = await hc.post("/chat/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = await hc.post("/chat/completions", json={"model": "m", "messages": ASK, "max_tokens": 1})
        assert r.status_code == 200
    assert default_engine.stats().kv_blocks_used == 0


async def test_completions_take_a_list_of_prompts_one_choice_each(client: openai.AsyncOpenAI) -> None:
    prompts = ["The capital of France is", "One, two, three,"]
    r = await client.completions.create(model="m", prompt=prompts, max_tokens=4, temperature=0)
    singles = [await client.completions.create(model="m", prompt=p, max_tokens=4, temperature=0) for p in prompts]
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [s.choices[0].text for s in singles]
    assert r.usage is not None
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles if s.usage)


async def test_closing_a_stream_early_frees_its_kv_blocks(client: openai.AsyncOpenAI,
                                                          default_engine: AsyncEngine) -> None:
    stream = await client.chat.completions.create(model="m", messages=ASK, max_tokens=200, temperature=0.8,
                                                  stream=True, extra_body={"ignore_eos": True})
    n = 0
    async for _ in stream:
        n += 1
        if n == 3:
            assert default_engine.stats().kv_blocks_used > 0
            break
    await stream.close()
    for _ in range(100):
        st = default_engine.stats()
        if st.kv_blocks_used == 0 and st.num_running == 0:
            break
        import asyncio

        await asyncio.sleep(0.02)
    assert default_engine.stats().kv_blocks_used == 0 and default_engine.stats().num_running == 0


async def test_completions_endpoint_streams_text(client: openai.AsyncOpenAI) -> None:
    r = await client.completions.create(model="m", prompt="The capital of France is", max_tokens=4, temperature=0)
    assert r.choices[0].text and r.usage is not None and r.usage.completion_tokens <= 4
    parts = [c.choices[0].text async for c in await client.completions.create(
        model="m", prompt="The capital of France is", max_tokens=4, temperature=0, stream=True) if c.choices]
    assert "".join(parts) == r.choices[0].text


# ---- on a tiny model: what the HTTP surface answers at its edges ------------------------------------------

@pytest.fixture(scope="module")
async def tiny(tiny_llama: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    import shutil

    from tests import chat_templates

    path = tmp_path_factory.mktemp("openai") / "llama"
    shutil.copytree(tiny_llama, path)
    (path / "chat_template.jinja").write_text(chat_templates.LLAMA3)
    engine = AsyncEngine.from_pretrained(path, dtype="float32", num_kv_blocks=64, max_num_seqs=1)
    async with engine:
        yield engine


async def _post_and_leave(app: Any, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST `body` straight to the ASGI app from a client that is gone as soon as it has sent it
    (a socket closed by the client: the app's next receive() says so, nothing cancels the app)."""
    sent: list[dict[str, Any]] = []
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "headers": [(b"content-type", b"application/json")], "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "server": ("x", 80),
             "client": ("127.0.0.1", 1), "root_path": ""}
    await app(scope, receive, send)
    return sent


async def test_a_stream_whose_client_left_before_its_first_token_generates_nothing(tiny: AsyncEngine) -> None:
    import asyncio

    from asyncpage.openai import app

    finished: list[Any] = []
    tiny.on_request_finished(finished.append)
    for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})]:
        await _post_and_leave(app(tiny), path, {**body, "stream": True, "max_tokens": 64, "ignore_eos": True})
        for _ in range(100):
            st = tiny.stats()
            if st.num_running == 0 and st.num_waiting == 0 and st.kv_blocks_used == 0:
                break
            await asyncio.sleep(0.02)
    assert all(f.num_generated_tokens == 0 for f in finished), finished
    assert tiny.stats().kv_blocks_used == 0


async def test_models_route_answers_503_while_the_engine_is_not_running(tiny_llama: Any) -> None:
    from asyncpage.openai import http_client

    engine = AsyncEngine.from_pretrained(tiny_llama, dtype="float32", num_kv_blocks=16)
    async with http_client(engine) as hc:  # never started: no `async with engine`
        r = await hc.get("/models")
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"


async def test_a_lone_surrogate_in_a_message_is_a_400_naming_messages(tiny: AsyncEngine) -> None:
    from asyncpage import InvalidRequestError
    from asyncpage.openai import http_client

    raw = '{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2%s}'  # valid JSON
    async with http_client(tiny) as hc:
        for stream in ("", ', "stream": true'):
            r = await hc.post("/chat/completions", content=raw % stream, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    with pytest.raises(InvalidRequestError) as e:
        await tiny.chat([{"role": "user", "content": "hi \ud800"}])
    assert e.value.field == "messages"


async def test_the_model_name_must_be_a_string_and_any_string_is_echoed_back(tiny: AsyncEngine) -> None:
    from asyncpage.openai import http_client

    async with http_client(tiny) as hc:
        for path, body in [("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/completions", {"prompt": "hi"})]:
            raw = json.dumps({**body, "max_tokens": 2})[:-1] + ', "model": "m\\ud800"}'  # valid JSON
            r = await hc.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 200 and r.json()["model"] == "m\ud800", r.text
            r = await hc.post(path, json={**body, "model": {"a": 1}, "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text


async def test_a_conversation_over_the_context_is_refused_naming_messages(tiny: AsyncEngine) -> None:
    from asyncpage.openai import http_client

    async with http_client(tiny) as hc:
        r = await hc.post("/chat/completions", json={"messages": [{"role": "user", "content": "a b " * 600}]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text
    assert err["param"] == "messages" and not err["message"].startswith("prompt:")
