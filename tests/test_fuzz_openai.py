"""Fuzzing the served surface (asyncpage.openai's app) on a tiny random Llama: hypothesis over the
request bodies of POST /v1/chat/completions and /v1/completions and over GET /v1/models (and routes
and methods that do not exist): wrong types, huge and non-finite numbers, lone surrogates (escaped,
and raw as bytes that are not UTF-8), cut JSON, deep and nested junk, random fields, random bytes.

Every answer is a 2xx or a 4xx, never a 5xx (a stream carries no server error event either); the
engine stays healthy after each, and a normal request works at the end. ASYNCPAGE_FUZZ_SCALE
multiplies the example counts (default 1: 610 requests, about 15 s here); ASYNCPAGE_FUZZ_RANDOM=1 draws
new ones instead of the fixed derandomized set.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from anyio.abc import TaskStatus
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from asyncpage import AsyncEngine
from asyncpage.openai import app
from asyncpage.openai.transport import make_transport_class

SCALE = float(os.environ.get("ASYNCPAGE_FUZZ_SCALE", "1"))


def fuzz(n: int) -> settings:
    return settings(max_examples=max(1, int(n * SCALE)), deadline=None, print_blob=True,
                    derandomize=not os.environ.get("ASYNCPAGE_FUZZ_RANDOM"),
                    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large, HealthCheck.filter_too_much])


TIMEOUT = 30.0


# ---- the app every example talks to (the engine on a background loop) ---------------------------------
@dataclass
class Served:
    engine: AsyncEngine
    portal: BlockingPortal
    client: httpx.AsyncClient

    def __repr__(self) -> str:
        return "Served(tiny llama)"

    def send(self, method: str, path: str, content: bytes | None, headers: dict[str, str]) -> httpx.Response:
        async def go() -> httpx.Response:
            with anyio.fail_after(TIMEOUT):
                return await self.client.request(method, path, content=content, headers=headers)

        return self.portal.call(go)


@pytest.fixture(scope="module")
def served(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from tests import chat_templates

    path = tmp_path_factory.mktemp("fuzz_openai") / "llama"
    shutil.copytree(tiny_llama, path)
    (path / "chat_template.jinja").write_text(chat_templates.LLAMA3)
    engine = AsyncEngine.from_pretrained(path, dtype="float32", num_kv_blocks=96, max_num_seqs=8,
                                         grammar_compile_timeout=3.0)
    stop = anyio.Event()

    async def host(*, task_status: TaskStatus[None]) -> None:
        nonlocal stop
        stop = anyio.Event()
        async with engine:
            task_status.started()
            await stop.wait()

    async def make_client() -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=make_transport_class(httpx)(app(engine)), base_url="http://asyncpage.local",
                                 timeout=None)

    with start_blocking_portal() as portal:
        host_future, _ = portal.start_task(host)
        client = portal.call(make_client)
        yield Served(engine, portal, client)
        portal.call(client.aclose)
        portal.call(stop.set)
        host_future.result(TIMEOUT)


# ---- strategies -------------------------------------------------------------------------------------
ODD_STRINGS = ["", " ", "\x00", "\ud800", "a\udfffb", "\ufeff", "\u202e", "null", "true", "1e309", "NaN",
               "-Infinity", "auto", "none", "required", "function", "json_schema", "json_object", "text",
               "user", "assistant", "system", "tool", "developer", "stop", "\n\n", "<|eot_id|>", "🦜" * 50]
INTS = (st.integers(-3, 8) | st.integers(min_value=10**5) | st.integers(max_value=-(10**5))
        | st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, -(2**63), 10**400]))
# Any character, lone surrogates (which hypothesis leaves out unless asked) and controls included.
TEXT = (st.text(alphabet=st.characters(exclude_categories=()) | st.characters(categories=["Cs"]), max_size=24)
        | st.sampled_from(ODD_STRINGS))
SCALARS = (st.none() | st.booleans() | INTS | st.floats(allow_nan=True, allow_infinity=True) | TEXT)
KEYS = TEXT | st.sampled_from(["type", "name", "content", "role", "function", "arguments", "parameters",
                               "properties", "schema", "json_schema", "text", "tool_calls", "id"])
JUNK = st.recursive(SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(KEYS, c, max_size=4), max_leaves=12)

SCHEMA_TYPES = st.sampled_from(["string", "integer", "number", "boolean", "null", "object", "array", "wizard"])
SCHEMA = st.one_of(
    st.fixed_dictionaries({"type": st.just("object"),
                           "properties": st.dictionaries(TEXT, st.fixed_dictionaries({"type": SCHEMA_TYPES}),
                                                         max_size=3)},
                          optional={"required": st.lists(TEXT, max_size=3), "additionalProperties": st.booleans()}),
    st.fixed_dictionaries({"enum": st.lists(SCALARS, max_size=4)}),
    st.fixed_dictionaries({"type": SCHEMA_TYPES}, optional={"pattern": TEXT, "maxLength": INTS, "minimum": INTS}),
    st.booleans(), JUNK)
ARGUMENTS = TEXT | JUNK.map(lambda v: json.dumps(v)) | st.integers(1, 3000).map(lambda n: "[" * n + "]" * n)
TOOL_CALL = st.fixed_dictionaries({"id": TEXT, "type": st.just("function") | TEXT,
                                   "function": st.fixed_dictionaries({"name": TEXT, "arguments": ARGUMENTS}) | JUNK})
PART = (st.fixed_dictionaries({"type": st.just("text"), "text": TEXT | JUNK})
        | st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "refusal", "file"]),
                                 "image_url": JUNK}) | JUNK)
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "wizard"]),
                           "content": TEXT | st.lists(PART, max_size=3) | JUNK},
                          optional={"tool_calls": st.lists(TOOL_CALL, max_size=2) | JUNK, "tool_call_id": TEXT | JUNK,
                                    "name": TEXT | JUNK, "reasoning_content": TEXT | JUNK}),
    JUNK)
TOOL = st.one_of(
    st.fixed_dictionaries({"type": st.just("function"),
                           "function": st.fixed_dictionaries({"name": TEXT | st.sampled_from(["get_weather", "f"])},
                                                             optional={"parameters": SCHEMA, "description": TEXT,
                                                                       "strict": st.booleans()})}),
    JUNK)
RESPONSE_FORMAT = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["json_object", "text", "json_schema", "grammar", "regex"])}),
    st.fixed_dictionaries({"type": st.just("json_schema"),
                           "json_schema": st.fixed_dictionaries({"name": TEXT}, optional={"schema": SCHEMA,
                                                                                         "strict": SCALARS}) | JUNK}),
    JUNK)
TOOL_CHOICE = (st.sampled_from(["auto", "none", "required"])
               | st.fixed_dictionaries({"type": st.just("function"),
                                        "function": st.fixed_dictionaries({"name": TEXT | st.just("get_weather")})})
               | JUNK)
PROMPT = st.one_of(TEXT, st.lists(INTS, max_size=6), st.lists(TEXT | st.lists(INTS, max_size=4), max_size=5),
                   st.integers(250, 300).map(lambda n: ["a"] * n), JUNK)

COMMON: dict[str, st.SearchStrategy[Any]] = {
    "model": TEXT | JUNK, "max_tokens": INTS | JUNK, "temperature": SCALARS, "top_p": SCALARS, "top_k": SCALARS,
    "min_p": SCALARS, "seed": INTS | JUNK, "stop": TEXT | st.lists(TEXT, max_size=6) | JUNK,
    "stream": st.booleans() | JUNK, "stream_options": st.fixed_dictionaries({"include_usage": SCALARS}) | JUNK,
    "n": INTS | JUNK, "presence_penalty": SCALARS, "frequency_penalty": SCALARS, "repetition_penalty": SCALARS,
    "stop_token_ids": st.lists(INTS, max_size=4) | JUNK, "ignore_eos": SCALARS, "logprobs": SCALARS,
    "top_logprobs": SCALARS, "logit_bias": JUNK, "user": TEXT | JUNK, "cache_salt": TEXT | JUNK,
    "best_of": SCALARS, "priority": SCALARS, "service_tier": TEXT | JUNK, "prompt_cache_key": TEXT | JUNK,
}
CHAT_FIELDS = {**COMMON, "messages": st.lists(MESSAGE, max_size=4) | JUNK, "max_completion_tokens": INTS | JUNK,
               "tools": st.lists(TOOL, max_size=3) | JUNK, "tool_choice": TOOL_CHOICE,
               "parallel_tool_calls": SCALARS, "response_format": RESPONSE_FORMAT, "functions": JUNK,
               "function_call": JUNK, "reasoning_effort": TEXT | JUNK, "max_reasoning_tokens": INTS | JUNK,
               "chat_template": TEXT | JUNK}
COMPLETION_FIELDS = {**COMMON, "prompt": PROMPT, "echo": SCALARS, "suffix": TEXT | JUNK}


def bodies(base: dict[str, Any], fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """A valid body with a few fields replaced by fuzz, some dropped, and some unknown fields added;
    or a whole value of junk (a list, a number, a string where the object belongs)."""
    @st.composite
    def mutated(draw: st.DrawFn) -> dict[str, Any]:
        body = dict(base)
        for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)):
            body[name] = draw(fields[name])
        for name in draw(st.lists(st.sampled_from(sorted(base)), max_size=1)):
            body.pop(name, None)
        body.update(draw(st.dictionaries(TEXT, JUNK, max_size=2)))
        return body

    return st.one_of(mutated(), mutated(), mutated(), JUNK)


def encodings(body: Any) -> st.SearchStrategy[bytes]:
    """The body as JSON (surrogates escaped), as raw bytes that are not UTF-8 (surrogates passed
    through), cut short, with one byte changed, or replaced by random bytes."""
    escaped = json.dumps(body, allow_nan=True).encode()
    raw = json.dumps(body, ensure_ascii=False, allow_nan=True).encode("utf-8", "surrogatepass")

    def flip(args: tuple[int, int]) -> bytes:
        at, byte = args
        return escaped[:at] + bytes([byte]) + escaped[at + 1:]

    return st.one_of(
        st.just(escaped), st.just(escaped), st.just(escaped), st.just(escaped), st.just(raw),
        st.integers(0, max(0, len(escaped) - 1)).map(lambda k: escaped[:k]),
        st.tuples(st.integers(0, max(0, len(escaped) - 1)), st.integers(0, 255)).map(flip),
        st.binary(max_size=64), st.sampled_from([b"[" * 100_000, b'{"a":' * 50_000, b"\xff\xfe\x00{}", b"{}" * 3]))


CONTENT_TYPES = st.sampled_from(["application/json"] * 6 + ["application/json; charset=utf-8",
                                                            "application/json; charset=latin-1"])


def check(served: Served, r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:2000])
    if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
        for line in r.text.splitlines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert event.get("error", {}).get("type") not in ("server_error", "service_unavailable"), line
    assert served.engine.healthy


def _ask(data: st.DataObject, base: dict[str, Any], fields: dict[str, Any]) -> tuple[bytes, str]:
    body = data.draw(bodies(base, fields), label="body")
    return data.draw(encodings(body), label="encoded"), data.draw(CONTENT_TYPES, label="content-type")


# ---- the fuzz ---------------------------------------------------------------------------------------
@fuzz(300)
@given(data=st.data())
def test_chat_completions_answer_every_body_with_a_2xx_or_4xx(served: Served, data: st.DataObject) -> None:
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    raw, ctype = _ask(data, base, CHAT_FIELDS)
    check(served, served.send("POST", "/v1/chat/completions", raw, {"content-type": ctype}))


@fuzz(250)
@given(data=st.data())
def test_completions_answer_every_body_with_a_2xx_or_4xx(served: Served, data: st.DataObject) -> None:
    base = {"prompt": "hi", "max_tokens": 2}
    raw, ctype = _ask(data, base, COMPLETION_FIELDS)
    check(served, served.send("POST", "/v1/completions", raw, {"content-type": ctype}))


@fuzz(60)
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
       path=st.sampled_from(["/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/models/x", "/", "/v1",
                             "/v1/responses", "/v1/completions/../models", "/%ff", "/v1/models?x=%00"]),
       body=st.binary(max_size=32) | st.none(),
       headers=st.dictionaries(st.sampled_from(["content-type", "authorization", "accept", "x-junk"]),
                               st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=20),
                               max_size=3))
def test_any_route_and_method_is_answered_with_a_2xx_or_4xx(served: Served, method: str, path: str,
                                                            body: bytes | None, headers: dict[str, str]) -> None:
    check(served, served.send(method, path, body, headers))


def test_an_integer_past_floats_range_is_a_400_naming_its_field(served: Served) -> None:
    """Found by the fuzz: 10**400 as frequency_penalty was an OverflowError, a 500."""
    for path, base in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        for name in ("frequency_penalty", "temperature", "top_p", "min_p", "presence_penalty"):
            raw = json.dumps({**base, "max_tokens": 2, name: 10**400}).encode()
            r = served.send("POST", path, raw, {"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == name, (path, name, r.text)


def test_after_the_fuzz_the_engine_is_healthy_and_a_normal_request_works(served: Served) -> None:
    r = served.send("POST", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                                                "max_tokens": 3}).encode(),
                    {"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant", r.text
    r = served.send("POST", "/v1/completions", b'{"prompt": ["a", "b"], "max_tokens": 2}',
                    {"content-type": "application/json"})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    assert served.send("GET", "/v1/models", None, {}).status_code == 200
    assert served.engine.healthy

    async def idle() -> bool:
        for _ in range(200):
            st_ = served.engine.stats()
            if st_.num_running == 0 and st_.num_waiting == 0 and st_.kv_blocks_used == 0:
                return True
            await anyio.sleep(0.01)
        return False

    assert served.portal.call(idle), served.engine.stats()
