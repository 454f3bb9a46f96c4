"""The door of the served surface (asyncpage.openai's app and `asyncpage serve`), on a tiny Llama: the
API key (401), foreign Origins and Hosts (403), non-JSON bodies (415), a body that trickles (408), a
full queue (429 + Retry-After), the prompts-per-request limit, one request's prompts admitted in a
window, generic 500s, engine options as serve flags, and a real `asyncpage serve` over a socket."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from asyncpage import AsyncEngine
from asyncpage.errors import QueueFullError
from asyncpage.openai import MAX_PROMPTS_PER_REQUEST, app
from asyncpage.openai.transport import make_transport_class

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def tiny_dir(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests import chat_templates

    path = tmp_path_factory.mktemp("door") / "llama"
    shutil.copytree(tiny_llama, path)
    (path / "chat_template.jinja").write_text(chat_templates.LLAMA3)
    return path


@pytest.fixture(scope="module")
async def tiny(tiny_dir: Path) -> AsyncIterator[AsyncEngine]:
    engine = AsyncEngine.from_pretrained(tiny_dir, dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    async with engine:
        yield engine


def _client(application: Any, base_url: str = "http://asyncpage.local/v1", **kw: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=make_transport_class(httpx)(application), base_url=base_url,
                             timeout=None, **kw)


# ---- the API key ----------------------------------------------------------------------------------

async def test_a_keyed_app_answers_401_without_the_bearer_key_and_200_with_it(tiny: AsyncEngine) -> None:
    async with _client(app(tiny, api_key="s3cret")) as hc:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"},
                        {"authorization": "Basic czNjcmV0"}, {"authorization": "Bearer s3cret2"}):
            for r in (await hc.post("/chat/completions", json=CHAT, headers=headers),
                      await hc.post("/completions", json=COMPLETION, headers=headers),
                      await hc.get("/models", headers=headers)):
                assert r.status_code == 401, (headers, r.text)
                err = r.json()["error"]
                assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
                assert "s3cret" not in r.text
                assert r.headers["www-authenticate"].lower().startswith("bearer")
        good = {"authorization": "Bearer s3cret"}
        assert (await hc.post("/chat/completions", json=CHAT, headers=good)).status_code == 200
        assert (await hc.post("/completions", json=COMPLETION, headers=good)).status_code == 200
        assert (await hc.get("/models", headers=good)).status_code == 200


def test_an_empty_api_key_is_refused_not_served_open(tiny: AsyncEngine, capsys: pytest.CaptureFixture[str]) -> None:
    """`--api-key "$UNSET_VAR"` (empty or blank): `asyncpage serve` exits 2 before loading anything, and
    app() refuses it; it served everyone, with no warning."""
    from asyncpage import InvalidRequestError
    from asyncpage.serve import serve

    for key in ("", "   "):
        with pytest.raises(InvalidRequestError) as info:
            app(tiny, api_key=key)
        assert info.value.field == "api_key"
        assert serve(_serve_args("--api-key", key, "--host", "0.0.0.0")) == 2
        assert "is empty" in capsys.readouterr().err


def test_an_api_key_variable_set_to_nothing_is_refused_too(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """ASYNCPAGE_API_KEY="" (a secret that expanded to nothing) is refused as an empty --api-key is; it
    used to serve with no key, silently."""
    from asyncpage.serve import serve

    monkeypatch.setenv("ASYNCPAGE_API_KEY", "")
    assert serve(_serve_args("--host", "0.0.0.0")) == 2
    assert "ASYNCPAGE_API_KEY" in capsys.readouterr().err
    monkeypatch.setenv("ASYNCPAGE_API_KEY", "s3cret")
    assert _serve_args().api_key == "s3cret"


def test_serve_takes_speculative_as_a_short_flag() -> None:
    assert _serve_args("--speculative", '{"method": "ngram"}').speculative_config == {"method": "ngram"}


async def test_the_in_process_client_needs_no_key_unless_the_app_sets_one(tiny: AsyncEngine) -> None:
    import openai

    r = await tiny.openai_client().completions.create(model="m", prompt="hi", max_tokens=2)
    assert r.choices[0].finish_reason in ("length", "stop")
    from asyncpage.openai import client

    keyed = client(tiny, api_key="k", http_client=_client(app(tiny, api_key="k")))
    assert (await keyed.completions.create(model="m", prompt="hi", max_tokens=2)).choices
    wrong = client(tiny, api_key="nope", http_client=_client(app(tiny, api_key="k")))
    with pytest.raises(openai.AuthenticationError):
        await wrong.completions.create(model="m", prompt="hi", max_tokens=2)


# ---- Origin, Host, Content-Type -------------------------------------------------------------------

async def test_a_request_carrying_a_foreign_origin_is_refused(tiny: AsyncEngine) -> None:
    async with _client(app(tiny)) as hc:  # default: no Origin allowed (a non-browser client sends none)
        for origin in ("https://evil.example", "null", "http://localhost:3000"):
            r = await hc.post("/completions", json=COMPLETION, headers={"origin": origin})
            assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed", r.text
            assert "access-control-allow-origin" not in r.headers
        assert (await hc.post("/completions", json=COMPLETION)).status_code == 200
    async with _client(app(tiny, allowed_origins=["http://localhost:3000"])) as hc:
        r = await hc.post("/completions", json=COMPLETION, headers={"origin": "http://localhost:3000"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        r = await hc.post("/completions", json=COMPLETION, headers={"origin": "https://evil.example"})
        assert r.status_code == 403
        # The browser's preflight for a JSON POST with a key: answered for the listed origin only.
        pre = {"access-control-request-method": "POST",
               "access-control-request-headers": "authorization, content-type"}
        r = await hc.options("/completions", headers={**pre, "origin": "http://localhost:3000"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        r = await hc.options("/completions", headers={**pre, "origin": "https://evil.example"})
        assert r.status_code >= 400 and "access-control-allow-origin" not in r.headers


async def test_a_post_that_is_not_json_is_refused_415_before_it_is_read(tiny: AsyncEngine) -> None:
    finished: list[Any] = []
    tiny.on_request_finished(finished.append)
    body = json.dumps(COMPLETION)
    async with _client(app(tiny)) as hc:
        # text/plain, a form, or no type at all: what a web page can send without a CORS preflight.
        for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
            headers = {"content-type": ctype} if ctype else {}
            r = await hc.post("/completions", content=body, headers=headers)
            assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", (ctype, r.text)
        assert finished == []  # nothing reached the engine
        for ctype in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
            r = await hc.post("/completions", content=body, headers={"content-type": ctype})
            assert r.status_code == 200, (ctype, r.text)


async def test_on_a_loopback_address_a_foreign_host_header_is_refused(tiny: AsyncEngine) -> None:
    """DNS rebinding: evil.example resolves to 127.0.0.1, so the browser's Host header names it."""
    async with _client(app(tiny), base_url="http://127.0.0.1:8000/v1") as hc:
        for host in ("127.0.0.1:8000", "localhost:8000", "localhost", "[::1]:8000", "api.localhost:8000"):
            r = await hc.post("/completions", json=COMPLETION, headers={"host": host})
            assert r.status_code == 200, (host, r.text)
        for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example"):
            r = await hc.post("/completions", json=COMPLETION, headers={"host": host})
            assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", (host, r.text)
    async with _client(app(tiny, allowed_hosts=["api.example.com"]), base_url="http://127.0.0.1:8000/v1") as hc:
        assert (await hc.post("/completions", json=COMPLETION, headers={"host": "api.example.com"})).status_code == 200
        assert (await hc.post("/completions", json=COMPLETION, headers={"host": "evil.example"})).status_code == 403
    async with _client(app(tiny)) as hc:  # in-process (http://asyncpage.local): no socket, nothing to rebind
        assert (await hc.post("/completions", json=COMPLETION)).status_code == 200


async def test_a_body_that_trickles_past_the_body_timeout_gets_a_408(tiny: AsyncEngine) -> None:
    sent: list[dict[str, Any]] = []
    first = True

    async def receive() -> dict[str, Any]:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": b'{"prompt": "h', "more_body": True}
        await asyncio.sleep(3600)  # the rest never comes
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "headers": [(b"content-type", b"application/json")], "scheme": "http", "path": "/v1/completions",
             "raw_path": b"/v1/completions", "query_string": b"", "server": ("x", 80), "client": ("127.0.0.1", 1),
             "root_path": ""}
    await asyncio.wait_for(app(tiny, body_timeout=0.2)(scope, receive, send), 30)
    assert sent[0]["status"] == 408
    assert json.loads(sent[1]["body"])["error"]["code"] == "request_timeout"


# ---- admission ------------------------------------------------------------------------------------

async def test_a_full_queue_is_a_429_with_retry_after(tiny: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    async def full(*args: Any, **kwargs: Any) -> Any:
        raise QueueFullError("the waiting queue is full (max_queued_requests=1)", retry_after=2.5)

    monkeypatch.setattr(tiny, "submit", full)
    async with _client(app(tiny)) as hc:
        for path, body in (("/chat/completions", CHAT), ("/chat/completions", {**CHAT, "stream": True}),
                           ("/completions", COMPLETION), ("/completions", {**COMPLETION, "stream": True}),
                           ("/completions", {**COMPLETION, "prompt": ["a", "b", "c"]})):
            r = await hc.post(path, json=body)
            assert r.status_code == 429, (path, body, r.text)
            assert r.headers["retry-after"] == "3"
            assert r.json()["error"]["code"] == "rate_limit_exceeded"


async def test_past_max_queued_requests_the_app_answers_429_and_serves_again_after(tiny_dir: Path) -> None:
    engine = AsyncEngine.from_pretrained(tiny_dir, dtype="float32", num_kv_blocks=32, max_num_seqs=1,
                                         max_queued_requests=1)
    long = {"prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True}
    async with engine, _client(app(engine)) as hc:
        async def wait_for(cond: Any) -> None:
            while not cond(engine.stats()):
                await asyncio.sleep(0.005)

        running = asyncio.create_task(hc.post("/completions", json=long))
        await asyncio.wait_for(wait_for(lambda s: s.num_running == 1), 30)
        waiting = asyncio.create_task(hc.post("/completions", json=long))
        await asyncio.wait_for(wait_for(lambda s: s.num_waiting == 1), 30)
        for path, body in (("/completions", COMPLETION), ("/chat/completions", {**CHAT, "stream": True})):
            r = await hc.post(path, json=body)
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, r.text
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
        running.cancel()
        waiting.cancel()
        await asyncio.gather(running, waiting, return_exceptions=True)
        await asyncio.wait_for(wait_for(lambda s: s.num_running == 0 and s.num_waiting == 0), 30)
        assert (await hc.post("/completions", json=COMPLETION)).status_code == 200
        assert engine.healthy


async def test_the_openai_client_reads_a_full_queue_as_a_rate_limit(tiny: AsyncEngine,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import openai

    async def full(*args: Any, **kwargs: Any) -> Any:
        raise QueueFullError("full", retry_after=1.0)

    monkeypatch.setattr(tiny, "submit", full)
    with pytest.raises(openai.RateLimitError):
        await tiny.openai_client().completions.create(model="m", prompt="hi", max_tokens=2)


async def test_more_prompts_than_the_limit_in_one_request_is_a_400_naming_prompt(tiny: AsyncEngine) -> None:
    finished: list[Any] = []
    tiny.on_request_finished(finished.append)
    async with _client(app(tiny)) as hc:
        r = await hc.post("/completions", json={"prompt": ["a"] * (MAX_PROMPTS_PER_REQUEST + 1), "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        r = await hc.post("/completions", json={"prompt": [[5, 6]] * 20_000, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert finished == []
        r = await hc.post("/completions", json={"prompt": ["a"] * MAX_PROMPTS_PER_REQUEST, "max_tokens": 1})
        assert r.status_code == 200 and len(r.json()["choices"]) == MAX_PROMPTS_PER_REQUEST


async def test_another_clients_request_is_not_queued_behind_one_requests_200_prompts(tiny: AsyncEngine) -> None:
    """The big request's prompts are admitted a window at a time, so the small request sent while it
    runs waits behind a few of them, not all 200 (before: FIFO behind every one)."""
    big_prompt, small_prompt = [7, 8, 9, 10, 11], [20, 21]
    done: list[tuple[str, int]] = []  # (which, how many of the big request's prompts had finished)
    big_finished = 0

    def on_finished(f: Any) -> None:
        nonlocal big_finished
        if f.num_prompt_tokens == len(big_prompt):
            big_finished += 1

    tiny.on_request_finished(on_finished)
    async with _client(app(tiny)) as hc:
        async def big() -> None:
            r = await hc.post("/completions", json={"prompt": [big_prompt] * 200, "max_tokens": 8,
                                                    "ignore_eos": True})
            assert r.status_code == 200 and len(r.json()["choices"]) == 200
            done.append(("big", big_finished))

        async def small() -> None:
            while big_finished < 3:  # the big one is under way
                await asyncio.sleep(0.005)
            r = await hc.post("/completions", json={"prompt": small_prompt, "max_tokens": 2, "ignore_eos": True})
            assert r.status_code == 200
            done.append(("small", big_finished))

        await asyncio.gather(big(), small())
    assert [d[0] for d in done] == ["small", "big"], done
    # FIFO behind all of them would have let ~200 finish first; the window lets a handful.
    assert done[0][1] <= 20, done


# ---- errors ---------------------------------------------------------------------------------------

async def test_an_unexpected_error_is_a_generic_500_with_a_request_id_and_the_detail_is_logged(
        tiny: AsyncEngine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise KeyError("secret-internal-detail")

    monkeypatch.setattr(tiny, "submit", broken)
    async with _client(app(tiny)) as hc:
        for path, body in (("/completions", COMPLETION), ("/chat/completions", CHAT)):
            r = await hc.post(path, json=body)
            assert r.status_code == 500
            err = r.json()["error"]
            assert "secret-internal-detail" not in r.text and "KeyError" not in r.text
            assert err["message"].startswith("internal error") and r.headers["x-request-id"] in err["message"]
    assert "secret-internal-detail" in caplog.text


async def test_a_dead_engine_answers_503_without_the_causes_repr(tiny_dir: Path) -> None:
    from tests.conftest import fail_at_step

    engine = AsyncEngine.from_pretrained(tiny_dir, dtype="float32", num_kv_blocks=32)
    async with engine:
        fail_at_step(engine, 1, "secret-device-detail")
        async with _client(app(engine)) as hc:
            r1 = await hc.post("/completions", json=COMPLETION)
            r2 = await hc.post("/completions", json=COMPLETION)
            r3 = await hc.get("/models")
    for r in (r1, r2, r3):
        assert r.status_code == 503, r.text
        assert "secret-device-detail" not in r.text and "RuntimeError" not in r.text, r.text


async def test_cache_salt_from_the_body_reaches_the_sampling_params(tiny: AsyncEngine,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    real = tiny.submit

    async def spy(prompt: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(params.cache_salt)
        return await real(prompt, params, *args, **kwargs)

    monkeypatch.setattr(tiny, "submit", spy)
    async with _client(app(tiny)) as hc:
        assert (await hc.post("/completions", json={**COMPLETION, "cache_salt": "tenant-a"})).status_code == 200
        assert (await hc.post("/chat/completions", json={**CHAT, "cache_salt": "tenant-b"})).status_code == 200
        r = await hc.post("/completions", json={**COMPLETION, "cache_salt": 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    assert seen == ["tenant-a", "tenant-b"]


async def test_a_prompt_cache_key_past_the_limit_is_a_400_naming_it_on_every_route(tiny: AsyncEngine) -> None:
    from asyncpage import InvalidRequestError
    from asyncpage.core.validation import MAX_CACHE_KEY_CHARS

    key = "k" * (MAX_CACHE_KEY_CHARS + 1)
    async with _client(app(tiny)) as hc:
        for path, body in (("/completions", COMPLETION), ("/chat/completions", CHAT),
                           ("/responses", {"input": "hi", "max_output_tokens": 2})):
            r = await hc.post(path, json={**body, "prompt_cache_key": key})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_key", (path, r.text)
            r = await hc.post(path, json={**body, "prompt_cache_key": key[:-1]})
            assert r.status_code == 200, (path, r.text)
    with pytest.raises(InvalidRequestError) as err:  # in process, the engine's own name for it
        await tiny.generate("hi", cache_key=key)
    assert err.value.field == "cache_key"


async def test_a_bad_reasoning_effort_is_a_400_naming_it_as_each_route_spells_it(tiny: AsyncEngine) -> None:
    """Chat's `reasoning_effort` is the Responses body's `reasoning.effort`: each route names its own."""
    async with _client(app(tiny)) as hc:
        for path, body, param in (
                ("/chat/completions", {**CHAT, "reasoning_effort": "extreme"}, "reasoning_effort"),
                ("/responses", {"input": "hi", "max_output_tokens": 2, "reasoning": {"effort": "extreme"}},
                 "reasoning.effort")):
            for stream in (False, True):
                r = await hc.post(path, json={**body, "stream": stream})
                err = r.json()["error"]
                assert r.status_code == 400 and err["param"] == param, (path, stream, r.text)
                assert "'extreme'" in err["message"] and "low" in err["message"], err["message"]


# ---- `asyncpage serve` ----------------------------------------------------------------------------

def _serve_args(*argv: str) -> Any:
    import argparse

    from asyncpage.serve import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd"))
    return parser.parse_args(["serve", *argv])


def test_every_from_pretrained_option_is_a_serve_flag() -> None:
    from asyncpage.serve import ENGINE_FLAGS, engine_options

    params = {p.name: p.default for p in inspect.signature(AsyncEngine.from_pretrained).parameters.values()
              if p.name not in ("cls", "model")}
    # Every option is a flag, and --help shows the engine's real default (--chat-template is separate).
    assert {name: default for name, (_, default) in ENGINE_FLAGS.items()} == {
        k: v for k, v in params.items() if k != "chat_template"}
    args = _serve_args("--quantization", "int8", "--kv-cache-memory", "2GiB", "--max-num-seqs", "8",
                       "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                       "--no-enable-prefix-caching", "--compile", "--block-size", "32")
    assert engine_options(args) == {"quantization": "int8", "kv_cache_memory": 2 << 30, "max_num_seqs": 8,
                                    "speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
                                    "enable_prefix_caching": False, "compile": True, "block_size": 32}
    assert engine_options(_serve_args()) == {}  # nothing given: every default is the engine's own
    # The default keeps a GGUF's own blocks; `none` asks for from_pretrained's None (dequantized weights).
    assert engine_options(_serve_args("--quantization", "none")) == {"quantization": None}


def test_serve_flags_set_uvicorns_limits_and_the_door() -> None:
    from asyncpage.serve import uvicorn_options

    args = _serve_args("--limit-concurrency", "10", "--timeout-keep-alive", "3", "--h11-max-incomplete-event-size",
                       "8192", "--api-key", "k", "--allowed-origins", "http://a.example,http://b.example")
    opts = uvicorn_options(args)
    assert opts["limit_concurrency"] == 10 and opts["timeout_keep_alive"] == 3
    assert opts["h11_max_incomplete_event_size"] == 8192 and opts["http"] == "h11"
    assert args.api_key == "k" and args.allowed_origins == ["http://a.example", "http://b.example"]
    defaults = uvicorn_options(_serve_args())
    for name in ("limit_concurrency", "timeout_keep_alive", "h11_max_incomplete_event_size"):
        assert defaults[name] > 0, name


@pytest.fixture
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def served(tiny_dir: Path, free_port: int, tmp_path: Path) -> Iterator[str]:
    """`asyncpage serve` in a subprocess with its key from ASYNCPAGE_API_KEY and a custom chat template."""
    template = tmp_path / "t.jinja"
    template.write_text("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}")
    env = {**os.environ, "ASYNCPAGE_API_KEY": "K", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "asyncpage.cli", "serve", "--model", str(tiny_dir),
                             "--port", str(free_port), "--dtype", "float32", "--num-kv-blocks", "32",
                             "--max-num-seqs", "2", "--body-timeout", "1", "--chat-template", str(template)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{free_port}"
    try:
        for _ in range(600):
            try:
                with socket.create_connection(("127.0.0.1", free_port), timeout=0.5):
                    break
            except OSError:
                assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def test_asyncpage_serve_over_a_socket_has_a_door(served: str) -> None:
    with httpx.Client(base_url=served + "/v1", timeout=60) as hc:
        assert hc.post("/completions", json=COMPLETION).status_code == 401
        assert hc.post("/completions", json=COMPLETION, headers={"authorization": "Bearer nope"}).status_code == 401
        key = {"authorization": "Bearer K"}
        r = hc.post("/completions", json=COMPLETION, headers=key)
        assert r.status_code == 200, r.text
        r = hc.post("/chat/completions", json=CHAT, headers=key)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 0, r.text
        r = hc.post("/completions", json=COMPLETION, headers={**key, "origin": "https://evil.example"})
        assert r.status_code == 403
        r = hc.post("/completions", content=json.dumps(COMPLETION), headers={**key, "content-type": "text/plain"})
        assert r.status_code == 415
        r = hc.post("/completions", json=COMPLETION, headers={**key, "host": "evil.example"})
        assert r.status_code == 403
    # A client that sends half its body and stops is answered 408 after --body-timeout (1 s).
    port = int(served.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer K\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        assert s.recv(4096).startswith(b"HTTP/1.1 408")


async def test_serve_renders_chats_with_the_chat_template_file(tiny_dir: Path, tmp_path: Path) -> None:
    from asyncpage import SamplingParams
    from asyncpage.serve import load_engine

    template = tmp_path / "t.jinja"
    template.write_text("{{ bos_token }}{% for m in messages %}<<{{ m.content }}>>{% endfor %}")
    engine = load_engine(_serve_args("--model", str(tiny_dir), "--dtype", "float32", "--num-kv-blocks", "16",
                                     "--chat-template", str(template)))
    async with engine:
        res = await engine.chat([{"role": "user", "content": "hi there"}], params=SamplingParams(max_tokens=1))
    expected = engine.tokenizer("<bos><<hi there>>", add_special_tokens=False)["input_ids"]
    assert res.usage.prompt_tokens == len(expected)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"body_timeout": 0}, "body_timeout"), ({"body_timeout": float("inf")}, "body_timeout"),
    ({"max_request_bytes": 0}, "max_request_bytes"), ({"allowed_hosts": "localhost"}, "allowed_hosts"),
    ({"allowed_origins": ["http://a", 3]}, "allowed_origins"), ({"api_key": b"k"}, "api_key")])
def test_the_app_refuses_a_bad_door_option_when_built(kwargs: dict[str, Any], field: str) -> None:
    from asyncpage.errors import InvalidRequestError
    from asyncpage.openai import app

    with pytest.raises(InvalidRequestError, match=rf"^{field}:"):
        app(object(), **kwargs)  # type: ignore[arg-type]  # refused before the engine is looked at


@pytest.mark.parametrize("argv", [("--body-timeout", "-3"), ("--ray", "--body-timeout", "-3")])
def test_serve_refuses_a_bad_door_flag_before_loading_anything(argv: tuple[str, ...],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from asyncpage.serve import serve

    assert serve(_serve_args(*argv)) == 2
    assert "body_timeout: must be a finite number of seconds > 0" in capsys.readouterr().err
