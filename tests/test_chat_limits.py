"""Chat preparation is bounded and off the loop: each limit of asyncpage.chat.messages is a typed
error naming its field (a 400 over HTTP), a hostile request is refused before the work that grows
faster than it, preparation runs in a worker thread of its own limiter under one deadline, and the
stream parser's work is linear in the text it reads."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from asyncpage import AsyncEngine, SamplingParams
from asyncpage.chat import api, formats, grammar, prepare
from asyncpage.chat.formats import FORMATS, GENERIC, HERMES, ToolFormat
from asyncpage.chat.messages import MAX_JSON_DEPTH, MAX_ONE_OF, MAX_SCHEMA_BYTES, MAX_TOOLS
from asyncpage.chat.parse import THINK_CLOSE, THINK_OPEN, Parsed, ParsedCall, StreamParser
from asyncpage.errors import GrammarTimeoutError, InvalidRequestError
from asyncpage.guided.backend import CompileTimeout, Deadline
from tests import chat_templates

ASK = [{"role": "user", "content": "Weather?"}]


def tool(name: str, params: Any = None) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name}
    if params is not None:
        fn["parameters"] = params
    return {"type": "function", "function": fn}


def big_params(nbytes: int) -> dict[str, Any]:
    """An object schema of about `nbytes` bytes of JSON (properties with long descriptions)."""
    props = {f"p{i}": {"type": "string", "description": "d" * 900} for i in range(max(1, nbytes // 940))}
    return {"type": "object", "properties": props}


def one_of(n: int) -> dict[str, Any]:
    return {"oneOf": [{"const": i} for i in range(n)]}


def json_schema(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def nested(depth: int) -> Any:
    v: Any = {}
    for _ in range(depth - 1):
        v = {"items": v}
    return v


@pytest.fixture(scope="module")
def hermes_dir(tiny_models: dict[str, tuple[Path, Any]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("chat_limits") / "qwen2"
    shutil.copytree(tiny_models["qwen2"][0], d)
    (d / "chat_template.jinja").write_text(chat_templates.HERMES)
    return d


@pytest.fixture(scope="module")
def engine(hermes_dir: Path) -> AsyncEngine:
    return AsyncEngine.from_pretrained(hermes_dir, dtype="float32", num_kv_blocks=64)


LIMITS = [
    ("tools", dict(tools=[tool(f"t{i}") for i in range(MAX_TOOLS + 1)])),
    ("tools[0].function.name", dict(tools=[tool("x" * 65)])),
    ("tools[0].function.name", dict(tools=[tool("has space")])),
    ("tools[1].function.name", dict(tools=[tool("same"), tool("same")])),
    ("tools[0].function.parameters", dict(tools=[tool("big", big_params(MAX_SCHEMA_BYTES + 2000))])),
    ("tools", dict(tools=[tool(f"t{i}", big_params(MAX_SCHEMA_BYTES - 2000)) for i in range(5)])),
    ("tools[0].function.parameters",
     dict(tools=[tool("f", {"type": "object", "properties": {"a": one_of(MAX_ONE_OF + 1)}})])),
    ("tools[0].function.parameters", dict(tools=[tool("f", nested(MAX_JSON_DEPTH + 1))])),
    ("tools[1].function.parameters", dict(tools=[tool("g"), tool("f", {"type": "string"})])),
    ("tools[1].function.parameters", dict(tools=[tool("g"), tool("f", {"type": "nonsense"})])),
    ("response_format.json_schema.schema", dict(response_format=json_schema(big_params(MAX_SCHEMA_BYTES + 2000)))),
    ("response_format.json_schema.schema", dict(response_format=json_schema(one_of(MAX_ONE_OF + 1)))),
    ("response_format.json_schema.schema", dict(response_format=json_schema(nested(MAX_JSON_DEPTH + 1)))),
    ("response_format.json_schema.schema", dict(response_format=json_schema({"enum": [{1, 2}]}))),
]


@pytest.mark.parametrize(("field", "kw"), LIMITS, ids=[f"{i}-{f}" for i, (f, _) in enumerate(LIMITS)])
async def test_each_chat_limit_is_a_typed_error_naming_its_field(engine: AsyncEngine, field: str,
                                                                 kw: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError) as err:
        await prepare(engine, ASK, **kw)
    assert err.value.field == field, err.value


async def test_the_limits_are_400s_naming_the_field_over_http(engine: AsyncEngine) -> None:
    from asyncpage.openai import app

    body: dict[str, Any] = {"model": "m", "messages": ASK, "tools": [tool(f"t{i}") for i in range(MAX_TOOLS + 1)]}
    async with engine, httpx.AsyncClient(transport=httpx.ASGITransport(app(engine)), base_url="http://t") as c:
        r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
        body = {"model": "m", "messages": ASK, "response_format": json_schema(one_of(466_000))}
        r = await c.post("/v1/chat/completions", content=json.dumps(body, separators=(",", ":")),
                         headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema", r.text


async def test_a_schema_that_does_not_compile_is_a_400_naming_it_as_the_body_wrote_it(engine: AsyncEngine) -> None:
    """The grammar of the whole turn is what fails to compile: the error names the tool or the answer
    schema it failed in, as the route's body spells it, and says why without quoting the grammar."""
    from asyncpage.openai import app

    broken = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/chat/completions", {"messages": ASK, "tools": [tool("g"), tool("f", {"type": "nonsense"})]},
         "tools[1].function.parameters"),
        ("/v1/chat/completions", {"messages": ASK, "tools": [tool("g"), tool("f", broken)]},
         "tools[1].function.parameters"),
        ("/v1/chat/completions", {"messages": ASK, "response_format": json_schema({"type": "nonsense"})},
         "response_format.json_schema.schema"),
        ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": broken}]},
         "tools[0].parameters"),
        ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "a",
                                                              "schema": {"type": "nonsense"}}}},
         "text.format.schema")]
    async with engine, httpx.AsyncClient(transport=httpx.ASGITransport(app(engine)), base_url="http://t") as c:
        for path, body, param in cases:
            for stream in (False, True):
                r = await c.post(path, json={**body, "stream": stream})
                err = r.json()["error"]
                assert r.status_code == 400 and err["param"] == param, (path, stream, r.text)
                assert "nonsense" in err["message"] and "%json" not in err["message"], err["message"]
                assert "_args" not in err["message"] and " | " not in err["message"], err["message"]


async def test_in_a_json_call_format_a_schema_that_does_not_compile_names_the_part_at_fault(
        engine: AsyncEngine) -> None:
    """Llama 3's format (and the generic one) writes calls as JSON, so with tool_choice "auto" the
    answer and the calls are one JSON Schema: a failure in it names the part that fails alone, the
    answer's schema or the tool (it named `tools` either way); parts that compile alone but not as one
    schema are response_format, which brought the answer in, and the message says so."""
    from asyncpage.openai import app

    fine = {"type": "object", "properties": {"a": {"type": "string"}}}
    broken = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
    # Valid, and its parts compile alone, but its $ref goes through its root's $id, which the one schema
    # does not keep (grammar.scoped drops it, a limitation of its own): the pair is what fails.
    by_id = {"$id": "https://example.com/s", "type": "object", "$defs": {"x": {"type": "string"}},
             "properties": {"a": {"$ref": "https://example.com/s#/$defs/x"}}}

    def answer(schema: Any) -> dict[str, Any]:
        return {"text": {"format": {"type": "json_schema", "name": "a", "schema": schema}}}

    def flat(params: Any) -> list[dict[str, Any]]:
        return [{"type": "function", "name": "g"}, {"type": "function", "name": "f", "parameters": params}]

    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/chat/completions", {"tools": [tool("g"), tool("f", fine)], "response_format": json_schema(broken)},
         "response_format.json_schema.schema"),
        ("/v1/chat/completions", {"tools": [tool("g"), tool("f", broken)], "response_format": json_schema(fine)},
         "tools[1].function.parameters"),
        ("/v1/chat/completions", {"tools": [tool("g"), tool("f", fine)], "response_format": json_schema(by_id)},
         "response_format"),
        ("/v1/responses", {"tools": flat(fine), **answer(broken)}, "text.format.schema"),
        ("/v1/responses", {"tools": flat(broken), **answer(fine)}, "tools[1].parameters"),
        ("/v1/responses", {"tools": flat(fine), **answer(by_id)}, "text.format")]
    llama3 = {"chat_template": chat_templates.LLAMA3, "max_tokens": 2}
    application = app(engine, trust_request_chat_template=True)
    async with engine, httpx.AsyncClient(transport=httpx.ASGITransport(application), base_url="http://t") as c:
        for path, body, param in cases:
            prompt = {"messages": ASK} if path == "/v1/chat/completions" else {"input": "hi"}
            together = param in ("response_format", "text.format")
            for stream in (False, True):
                r = await c.post(path, json={**prompt, **body, **llama3, "stream": stream})
                err = r.json()["error"]
                assert r.status_code == 400 and err["param"] == param, (path, stream, r.text)
                assert "%json" not in err["message"] and " | " not in err["message"], err["message"]
                assert ("one JSON Schema" in err["message"]) == together, err["message"]
            # The engine's own template (Hermes' format: calls are not JSON Schema) names the same part,
            # and takes the pair that only fails as one schema.
            r = await c.post(path, json={**prompt, **body, "max_tokens": 2})
            assert (r.status_code, (r.json().get("error") or {}).get("param")) == ((200, None) if together
                                                                               else (400, param)), r.text


async def test_a_tool_whose_parameters_declare_no_properties_is_offered_and_called(engine: AsyncEngine) -> None:
    """An object schema without `properties` ({"type": "object"}: any object) is a tool OpenAI takes:
    the template, which reads `parameters.properties`, is shown an empty one (it refused to render, a
    400 naming `messages`), and the grammar keeps the schema as sent (any object, not only `{}`)."""
    from asyncpage.openai import app

    async with engine, httpx.AsyncClient(transport=httpx.ASGITransport(app(engine)), base_url="http://t") as c:
        for params in ({"type": "object"}, {"type": "object", "additionalProperties": {"type": "integer"}}):
            r = await c.post("/v1/chat/completions", json={"messages": ASK, "tools": [tool("f", params)],
                                                          "tool_choice": "required", "max_tokens": 64})
            assert r.status_code == 200, (params, r.text)
            calls = r.json()["choices"][0]["message"]["tool_calls"]
            assert calls[0]["function"]["name"] == "f" and isinstance(json.loads(calls[0]["function"]["arguments"]),
                                                                      dict), calls
    turn = await prepare(engine, ASK, tools=[tool("f", {"type": "object"})])
    assert "f: {}" in engine.tokenizer.decode(turn.prompt)
    assert turn.params.grammar is not None and '"additionalProperties": false' not in turn.params.grammar
    # A turn whose output is JSON only (an answer schema, or calls forced) gets json_schema's runaway guards (a
    # number's digits, a repeating string); one where prose may come first does not.
    assert not turn.params.json_guards
    person = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    answer = {"type": "json_schema", "json_schema": {"name": "p", "schema": person}}
    assert (await prepare(engine, ASK, response_format=answer)).params.json_guards
    assert (await prepare(engine, ASK, tools=[tool("f", person)], tool_choice="required")).params.json_guards
    # each guard off where the schema asks for long values, as under json_schema (the review's 20-digit bound)
    big = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 1e20}, "s": {"type": "string",
                                                                                         "maxLength": 500}}}
    for kw in ({"response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": big}}},
               {"tools": [tool("f", big)], "tool_choice": "required"}):
        p = (await prepare(engine, ASK, **kw)).params
        assert p.json_guards and p.max_number_digits == 0 and p.max_string_repeats == 0, kw


class _Untouchable(dict[str, Any]):
    def get(self, *a: Any) -> Any:
        raise AssertionError("a tool was read before the count was checked")


async def test_170k_tools_are_refused_before_any_tool_is_read(engine: AsyncEngine) -> None:
    tools = [_Untouchable() for _ in range(170_000)]
    with pytest.raises(InvalidRequestError, match="170000 tools") as err:
        await prepare(engine, ASK, tools=tools)
    assert err.value.field == "tools"


async def test_duplicate_tool_names_are_found_among_the_most_tools_allowed(engine: AsyncEngine) -> None:
    tools = [tool(f"t{i}") for i in range(MAX_TOOLS - 1)] + [tool("t3")]
    with pytest.raises(InvalidRequestError, match="duplicate tool name 't3'") as err:
        await prepare(engine, ASK, tools=tools)
    assert err.value.field == f"tools[{MAX_TOOLS - 1}].function.name"
    turn = await prepare(engine, ASK, tools=tools[:-1], tool_choice="required")  # exactly the limit passes
    assert len(turn.spec.tools) == MAX_TOOLS - 1


async def test_a_466k_branch_one_of_is_refused_and_the_largest_allowed_is_prepared(engine: AsyncEngine) -> None:
    with pytest.raises(InvalidRequestError) as err:
        await prepare(engine, ASK, response_format=json_schema(one_of(466_000)))
    assert err.value.field == "response_format.json_schema.schema"
    turn = await prepare(engine, ASK, response_format=json_schema(one_of(MAX_ONE_OF)))
    assert turn.params.grammar is not None and '"anyOf"' in turn.params.grammar  # rewritten, not refused


@pytest.mark.parametrize("as_text", [True, False], ids=["string", "object"])
async def test_history_call_arguments_nested_100k_deep_are_a_400_not_a_recursion_error(
        engine: AsyncEngine, as_text: bool) -> None:
    deep: Any = "[" * 100_000 + "]" * 100_000
    if not as_text:
        deep = []
        for _ in range(100_000):
            deep = [deep]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    with pytest.raises(InvalidRequestError, match="nested more than") as err:
        await prepare(engine, msgs, tools=[tool("f")])
    assert err.value.field == "messages[1].tool_calls[0].function.arguments"
    fine = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps(nested(60))}}
    ok = [msgs[0], {**msgs[1], "tool_calls": [fine]}, msgs[2]]
    assert (await prepare(engine, ok, tools=[tool("f")])).prompt


def test_the_schema_rewrites_stop_at_the_deadline() -> None:
    expired = Deadline(0.0)
    time.sleep(0.001)
    with pytest.raises(CompileTimeout):
        grammar.json_rule(one_of(MAX_ONE_OF), expired)


async def test_a_preparation_past_its_deadline_is_a_grammar_timeout_naming_the_tools(
        engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    real = grammar.json_rule

    def slow_rule(schema: Any, deadline: Deadline) -> str:
        while True:  # a rewrite that would never end on its own
            deadline.check()
            time.sleep(0.001)
        return real(schema, deadline)

    monkeypatch.setattr(grammar, "json_rule", slow_rule)
    monkeypatch.setattr(engine.guided, "compile_timeout", 0.05)
    # Tool sets and schemas no earlier test built (a built grammar is kept per tool set: chat/cache.py).
    with pytest.raises(GrammarTimeoutError) as err:
        await prepare(engine, ASK, tools=[tool("f_deadline")])
    assert err.value.field == "tools"
    with pytest.raises(GrammarTimeoutError) as err:
        await prepare(engine, ASK, response_format=json_schema({"type": "object", "title": "deadline"}))
    assert err.value.field == "response_format"


async def test_a_cancelled_preparation_stops_its_thread(engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    ended = threading.Event()

    def endless_rule(schema: Any, deadline: Deadline) -> str:
        try:
            while True:
                deadline.check()
                time.sleep(0.001)
        finally:
            ended.set()

    monkeypatch.setattr(grammar, "json_rule", endless_rule)
    monkeypatch.setattr(engine.guided, "compile_timeout", 3600.0)  # only the cancellation can end it
    with anyio.move_on_after(0.2) as scope:
        await prepare(engine, ASK, tools=[tool("f_cancelled")])  # not built before (chat/cache.py)
    assert scope.cancelled_caught and ended.is_set()
    assert api._limiter().borrowed_tokens == 0  # the thread's token came back with the thread


async def test_waiting_for_a_preparation_thread_is_not_a_preparations_time_and_a_long_wait_is_a_429(
        engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Other callers hold both preparation threads: a chat waiting behind them still gets its whole
    time bound once a thread is its own (it used to spend it waiting and time out), and one that
    waits longer than the bound is a QueueFullError (HTTP 429), never a GrammarTimeoutError."""
    from asyncpage.errors import QueueFullError

    left: list[float] = []
    real = api._prepare_sync

    def timed(*a: Any) -> Any:
        left.append(a[-1].at - time.monotonic())  # its deadline, as the thread starts
        return real(*a)

    monkeypatch.setattr(api, "_prepare_sync", timed)
    monkeypatch.setattr(engine.guided, "compile_timeout", 1.0)
    limiter = api._limiter()
    holders = [object() for _ in range(int(limiter.total_tokens))]
    for h in holders:
        await limiter.acquire_on_behalf_of(h)

    async def release_after(delay: float) -> None:
        await anyio.sleep(delay)
        for h in holders:
            limiter.release_on_behalf_of(h)

    async with anyio.create_task_group() as tg:
        tg.start_soon(release_after, 0.6)
        turn = await prepare(engine, ASK, tools=[tool("f")])  # waited 0.6 s of its 1 s
    assert turn.prompt and left and left[0] > 0.9, left
    for h in holders:
        await limiter.acquire_on_behalf_of(h)
    try:
        with pytest.raises(QueueFullError) as info:
            await prepare(engine, ASK, tools=[tool("f")])
        assert info.value.retry_after > 0
    finally:
        for h in holders:
            limiter.release_on_behalf_of(h)
    assert limiter.borrowed_tokens == 0


def test_a_conversation_past_the_message_limit_is_refused_before_it_is_rendered() -> None:
    from asyncpage.chat.messages import MAX_MESSAGES, normalize

    with pytest.raises(InvalidRequestError, match="over the limit") as info:
        normalize([{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1))
    assert info.value.field == "messages"
    assert len(normalize([{"role": "user", "content": "hi"}] * MAX_MESSAGES)) >= 1


def _big_allowed_request() -> dict[str, Any]:
    """Near every limit at once: the most tools, each with a sizeable schema, a oneOf answer of the
    most branches, and a long history."""
    tools = [tool(f"t{i}", {"type": "object", "properties": {f"p{j}": {"enum": list(range(40))} for j in range(8)},
                            "required": ["p0"]}) for i in range(MAX_TOOLS)]
    history = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 20} for i in range(400)]
    return dict(msgs=history, tools=tools, response_format=json_schema(one_of(MAX_ONE_OF)))


async def test_preparing_a_big_allowed_request_runs_in_a_worker_thread_of_its_own_limiter(
        engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[bool, int, int]] = []
    real_build = grammar.build
    limiter = api._limiter()  # this event loop's chat-preparation limiter

    def watched_build(*a: Any) -> Any:
        seen.append((threading.current_thread() is threading.main_thread(), limiter.borrowed_tokens,
                     int(limiter.total_tokens)))
        return real_build(*a)

    monkeypatch.setattr(grammar, "build", watched_build)
    req = _big_allowed_request()
    stall = 0.0
    done = False

    async def tick() -> None:
        nonlocal stall
        last = time.perf_counter()
        while not done:
            await anyio.sleep(0.001)
            now = time.perf_counter()
            stall, last = max(stall, now - last), now

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(tick)
        turn = await prepare(engine, req["msgs"], tools=req["tools"], response_format=req["response_format"],
                             params=SamplingParams(max_tokens=8))
        done = True
    print(f"\nprepared {len(turn.prompt)} prompt tokens, {len(turn.params.grammar or '')} grammar chars in "
          f"{time.perf_counter() - t0:.3f} s; the event loop's longest stall meanwhile: {stall * 1000:.1f} ms")
    assert seen == [(False, 1, api.PREPARE_THREADS)]  # in a worker, holding one token of the chat limiter
    assert api.PREPARE_THREADS < 40  # not anyio's default limiter of 40 threads


def test_the_vocabulary_is_read_once_per_tokenizer(hermes_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hermes_dir)
    calls = 0
    real = tok.get_vocab

    def counted() -> dict[str, int]:
        nonlocal calls
        calls += 1
        return real()

    tok.get_vocab = counted  # type: ignore[method-assign]
    for _ in range(5):
        assert formats.detect("{{ messages }}", tok) is GENERIC  # no markers in the template: the vocabulary says
    assert calls == 1
    tok.add_tokens(["<tool_call>"])
    other = AutoTokenizer.from_pretrained(hermes_dir)
    other.add_tokens(["<tool_call>"])
    assert formats.detect("{{ messages }}", other) is HERMES  # another tokenizer is read afresh


# ---- the stream parser: the same answers as the whole-text parser it replaced, in linear work ----
# The parser as it was before it kept its state (asyncpage/chat/parse.py at f3ae331), kept here as
# the reference the incremental one must agree with after every chunk.

def _ref_held(text: str, marker: str) -> int:
    """Length of the longest proper suffix of `text` that starts `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _ref_json_end(s: str, i: int) -> int | None:
    """Index just past the JSON value starting at s[i], or None if it is not complete yet."""
    if i >= len(s):
        return None
    if s[i] not in "{[\"":
        # A scalar: it ends where the call's closing brace starts (more digits could still come).
        j = i
        while j < len(s) and s[j] not in ",}] \n":
            j += 1
        return j if j < len(s) else None
    depth, in_str, esc = 0, False, False
    for j in range(i, len(s)):
        c = s[j]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
                if depth == 0:
                    return j + 1
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def reference_parse(text: str, fmt: ToolFormat, *, calls_allowed: bool, reasoning: bool, in_reasoning: bool,
          final: bool, forced: bool = False) -> Parsed:
    """`forced`: tool_choice "required" or a named tool, where the grammar writes nothing but calls."""
    out = Parsed()
    body = text
    if in_reasoning or (reasoning and text.lstrip().startswith(THINK_OPEN)):
        start = 0 if in_reasoning else text.index(THINK_OPEN) + len(THINK_OPEN)
        end = text.find(THINK_CLOSE, start)
        if end < 0:
            cut = len(text) if final else len(text) - _ref_held(text, THINK_CLOSE)
            # Trailing newlines wait: if the block closes next, they are not part of the reasoning.
            out.reasoning = text[start:cut].lstrip("\n") if final else text[start:cut].strip("\n")
            return out
        out.reasoning = text[start:end].strip("\n")
        body = text[end + len(THINK_CLOSE):].lstrip("\n")
    elif reasoning and not final and THINK_OPEN.startswith(text.lstrip()):
        return out  # maybe the start of a reasoning block (whitespace included: it may precede one)
    if not calls_allowed:
        out.content = body
        return out
    head = fmt.head
    if forced and not body.startswith(head):
        return out  # every character is forced markup: a call cut before its name (by max_tokens) is no content
    if fmt.at_start:
        if not body.startswith(head):
            if body and head.startswith(body):
                return out  # undecided yet, or at the end a call cut before its name: markup, not content
            out.content = body
            return out
        at = 0
    else:
        at = body.find(head)
        if at < 0:
            if not final:
                out.content = body[: len(body) - _ref_held(body, head)]
                return out
            # Under the grammar the trigger always opens a call: after it, a call cut before its name.
            cut = body.find(fmt.trigger) if fmt.trigger else -1
            out.content = body if cut < 0 else body[:cut]
            return out
        out.content = body[:at]
    _ref_calls(body, at + len(head), fmt, out.calls)
    return out


def _ref_calls(body: str, j: int, fmt: ToolFormat, calls: list[ParsedCall]) -> None:
    next_head = fmt.sep + '{"name": "'
    key = '", "' + fmt.key + '": '
    while True:
        q = body.find('"', j)
        if q < 0:
            return  # the name is not complete yet
        name = body[j:q]
        rest = body[q : q + len(key)]
        if rest != key:
            if key.startswith(rest):
                calls.append(ParsedCall(name, "", False))
            return
        a = q + len(key)
        end = _ref_json_end(body, a)
        if end is None:
            calls.append(ParsedCall(name, body[a:], False))
            return
        calls.append(ParsedCall(name, body[a:end], True))
        if not body.startswith(next_head, end + 1):
            return
        j = end + 1 + len(next_head)


def _texts(fmt: ToolFormat) -> list[str]:
    calls = fmt.render([("get_weather", '{"city": "o\\"s}{lo", "u": [1, {"k": "]"}]}'), ("t", '{"n": 3}')])
    scalar = fmt.begin + fmt.call_head("f") + "12" + "}" + fmt.end
    lead = "" if fmt.at_start else "Sure. "
    out = []
    for head in ("", "\n\n", "  ", "<think>plan\n\nmore\n\n</think>\n\n", "<think>\n\n</think>", " <think>x"):
        for body in (lead + calls, calls, scalar, "plain text, no call", "a <tool_call> b [TOOL_CALLS] c",
                     lead + fmt.begin + '{"name": "f", "oops', "{not json", "   ", ""):
            out.append(head + body)
    return out


FLAGS = [dict(calls_allowed=c, reasoning=r, in_reasoning=i, forced=f)
         for c in (True, False) for r in (True, False) for i in (False, True) for f in (False, True)
         if not (f and not c)]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_stream_parser_reads_every_chunking_as_the_whole_text_parser_does(name: str) -> None:
    import random

    fmt, rng = FORMATS[name], random.Random(name)
    for text in _texts(fmt):
        for flags in FLAGS:
            for cut in sorted({len(text), *(rng.randrange(len(text) + 1) for _ in range(3))}):
                whole = text[:cut]
                sp, pos = StreamParser(fmt, **flags), 0
                while True:
                    step = rng.choice((1, 1, 2, 3, 7, 40))
                    piece, pos = whole[pos:pos + step], pos + step
                    final = pos >= len(whole)
                    sp.feed(piece, final)
                    want = reference_parse(whole[:min(pos, len(whole))], fmt, final=final, **flags)
                    assert sp.parsed() == want, (name, flags, whole[:pos], final)
                    assert sp.has_calls == bool(want.calls)
                    assert [c for c in want.calls if c.complete] == sp.calls
                    if final:
                        break


def test_a_long_streamed_turn_costs_parse_work_linear_in_its_length() -> None:
    # Reasoning, content and one long call's arguments, streamed a few characters at a time: the
    # characters the parser's searches and scanners look at grow with the text, not its square.
    work = {}
    for n in (2_000, 20_000):
        text = ("<think>" + "step. " * n + "</think>\n\nLet me check. " + "word " * n + HERMES.render(
            [("f", '{"a": "' + 'x\\"' * n + '", "b": [' + "1, " * n + "2]}")]))
        sp = StreamParser(HERMES, calls_allowed=True, reasoning=True, in_reasoning=False)
        for i in range(0, len(text), 3):
            sp.feed(text[i:i + 3], i + 3 >= len(text))
        p = sp.parsed()
        assert p.reasoning.startswith("step.") and p.content == "Let me check. " + "word " * n
        assert len(p.calls) == 1 and p.calls[0].complete and json.loads(p.calls[0].arguments)["b"][-1] == 2
        work[n] = sp.scanned / len(text)
        assert sp.scanned < 8 * len(text), (n, sp.scanned, len(text))
    print(f"\ncharacters looked at per character of text: {work}")


def _reference_cut_at_stop(p: Parsed, stops: tuple[str, ...], final: bool) -> bool:
    """api._cut_at_stop as it was (whole strings searched after every chunk)."""
    for name in ("reasoning", "content"):
        text = getattr(p, name)
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            setattr(p, name, text[: min(hits)])
            if name == "reasoning":
                p.content = ""
            p.calls.clear()
            return True
    if not final and not p.calls:
        name = "content" if p.content else "reasoning"
        text = getattr(p, name)
        setattr(p, name, text[: len(text) - max(_ref_held(text, s) for s in stops)])
    return False


@pytest.mark.parametrize("stops", [("STOP",), ("\n\n", "plan"), ("ab", "abab", "x")], ids=["one", "two", "three"])
def test_stop_strings_cut_every_chunking_as_the_whole_text_cut_did(stops: tuple[str, ...]) -> None:
    import random

    rng = random.Random(str(stops))
    for fmt in (HERMES, GENERIC):
        lead = "" if fmt.at_start else "ok "
        for text in ("<think>a plan ST" + "OP more\n\n</think>\n\nabx" + lead, "<think>abab</think>\n\n" + lead
                     + fmt.render([("f", '{"a": "STOP"}')]), "Sure: a b ab aSTOPb\n\nx", "no stop here at all"):
            flags = dict(calls_allowed=True, reasoning=True, in_reasoning=False, forced=False)
            for _ in range(5):
                sp, cut, pos = StreamParser(fmt, **flags), api._StopCut(stops), 0
                while True:
                    step = rng.choice((1, 2, 3, 5))
                    pos += step
                    final = pos >= len(text)
                    r = api._Read.of(sp.feed(text[pos - step:pos], final))
                    met = cut.apply(r, final)
                    want = reference_parse(text[:pos], fmt, final=final, **flags)
                    assert met == _reference_cut_at_stop(want, stops, final)
                    got = (r.field("reasoning"), r.field("content"), sp.calls[:r.n_calls], r.has_calls)
                    assert got == (want.reasoning, want.content, [c for c in want.calls if c.complete],
                                   bool(want.calls)), (text[:pos], final)
                    if met or final:
                        break
