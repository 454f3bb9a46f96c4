"""An OpenAI-compatible surface over one engine: the ASGI app, and clients that reach it in-process.

    client = engine.openai_client()                  # openai.AsyncOpenAI, no socket
    r = await client.chat.completions.create(model="any", messages=[...], tools=[...])
    app = asyncpage.openai.routes.app(engine)               # the same app; `asyncpage serve` runs it

Routes: POST /v1/chat/completions (mapped onto asyncpage.chat), POST /v1/completions, GET
/v1/models. Streaming is SSE in OpenAI's chunk shapes; errors are OpenAI's error object with the
status OpenAI uses. A client that disconnects cancels its generation (its KV blocks are freed).
Needs the `asyncpage[openai]` extra (starlette; openai and httpx2 for the client).

The door (checked before a route runs, in this order; see `app`):
- Host: on a loopback address (the connection arrived on 127.0.0.1 or ::1) the Host header must be a
  loopback name (localhost, *.localhost, a loopback IP) or one of `allowed_hosts`: else 403. This stops
  DNS rebinding (a page on evil.example re-pointed at 127.0.0.1). The in-process clients reach no
  address, so their Host (asyncpage.local) is not checked.
- Origin: a request carrying an Origin header (a browser) is refused 403 unless the origin is in
  `allowed_origins` (default: none; "*" allows any); listed origins get CORS headers and preflights.
  Non-browser clients send no Origin.
- API key: with `api_key` set, every route needs `Authorization: Bearer <key>` (401 otherwise,
  compared in constant time). Without one (the default, and the in-process clients') none is needed.
- Content-Type: a POST must be application/json (parameters such as charset allowed), else 415: a web
  page's blind "simple request" (text/plain, a form) is refused before its body is read.
Then the body: over `max_request_bytes` is a 413, not all arrived within `body_timeout` s a 408.
Admission: a full engine queue (QueueFullError) is a 429 with Retry-After; /v1/completions takes at
most MAX_PROMPTS_PER_REQUEST prompts and admits them a window at a time (see `prompt_window`), so one
request's batch never queues ahead of every other client. An unexpected error is a generic 500 with a
request id (the detail goes to the log, logger "asyncpage.openai.routes"), never the exception's text.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import math
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse as _StarletteJSON
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from asyncpage.chat import ChatDelta, chat, chat_stream
from asyncpage.errors import (
    EngineDeadError,
    EngineNotRunningError,
    InvalidRequestError,
    PromptTooLongError,
    QueueFullError,
    SamplingError,
)
from asyncpage.params import SamplingParams

if TYPE_CHECKING:
    from asyncpage.engine import AsyncEngine

BASE_URL = "http://asyncpage.local/v1"
DEFAULT_MAX_TOKENS = 1024
# A request body past this is refused (413) before it is parsed, rendered or tokenized: a server
# must not let one client spend its memory and CPU on a prompt far beyond any model's context.
MAX_REQUEST_BYTES = 8 << 20
# A body that has not fully arrived this many seconds after the request started is cut with a 408: a
# client trickling its body would otherwise hold a connection (and a slot of limit_concurrency) forever.
BODY_TIMEOUT_S = 60.0
# /v1/completions' prompts per request: past it a 400 naming `prompt`. Each prompt is a request in the
# engine (its tokenizing, its queue slot), so one body must not become thousands of them.
MAX_PROMPTS_PER_REQUEST = 256
# At most this many of one request's prompts are in the engine at once (fewer on a small engine: a
# quarter of max_num_seqs, at least 1); the next is submitted as one finishes. Another client's request
# then waits behind a window of them, not behind the whole batch.
PROMPT_WINDOW = 8
# OpenAI's request names -> SamplingParams fields (same meaning).
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "seed": "seed", "presence_penalty": "presence_penalty",
             "frequency_penalty": "frequency_penalty", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repetition_penalty", "stop_token_ids": "stop_token_ids",
             "ignore_eos": "ignore_eos", "cache_salt": "cache_salt"}
_LOG = logging.getLogger("asyncpage.openai.routes")


def model_id(engine: AsyncEngine) -> str:
    src = str(engine.model_source)
    return Path(src).stem if src.endswith(".gguf") else Path(src).name or src


def error_body(message: str, param: str | None, kind: str = "invalid_request_error",
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class RequestTooLargeError(InvalidRequestError):
    """The request body is over the app's `max_request_bytes`."""


class BodyTimeoutError(InvalidRequestError):
    """The request body did not arrive within the app's `body_timeout`."""


class JSONResponse(_StarletteJSON):
    """JSON as ASCII: a lone surrogate (valid JSON, echoed back in `model` or an error message)
    cannot be encoded as UTF-8, and would turn a finished response into a crash."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def _failure(exc: BaseException, prompt_field: str = "prompt") -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, OpenAI error body, headers) for an exception. `prompt_field`: what the route calls the
    prompt (the chat route's is `messages`). Only our own typed errors' messages reach the client; for
    anything else (and an engine's death, whose message carries its cause) the client gets a generic
    message with a request id, and the detail goes to the log under that id."""
    if isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        return _failure(exc.exceptions[0], prompt_field)  # one failed prompt of a batch: report it as itself
    if isinstance(exc, RequestTooLargeError):
        return 413, error_body(exc.message, exc.field, code="request_too_large"), {}
    if isinstance(exc, BodyTimeoutError):
        return 408, error_body(exc.message, exc.field, code="request_timeout"), {}
    if isinstance(exc, PromptTooLongError):
        field = prompt_field if exc.field == "prompt" else exc.field
        return 400, error_body(exc.message, field, code="context_length_exceeded"), {}
    if isinstance(exc, InvalidRequestError):
        return 400, error_body(exc.message, exc.field), {}
    if isinstance(exc, QueueFullError):
        # Retry-After is whole seconds (RFC 9110); never 0, which reads as "retry at once".
        retry = str(max(1, math.ceil(exc.retry_after)))
        return 429, error_body(str(exc), None, "requests", "rate_limit_exceeded"), {"Retry-After": retry}
    if isinstance(exc, EngineNotRunningError):
        # 503: the server cannot serve now; a balancer sends the client elsewhere (a 500 reads as a bad request).
        return 503, error_body(str(exc), None, "service_unavailable"), {}
    rid = "req_" + uuid.uuid4().hex[:16]
    if isinstance(exc, EngineDeadError):
        _LOG.error("request %s: the engine is dead: %s", rid, exc, exc_info=exc)
        message = f"the engine stopped on an internal error; the server needs a restart (request id {rid})"
        return 503, error_body(message, None, "service_unavailable"), {"x-request-id": rid}
    if isinstance(exc, SamplingError):  # this request's own logits or grammar; its message names no internals
        return 500, error_body(str(exc), None, "server_error"), {}
    _LOG.error("request %s failed", rid, exc_info=exc)
    return 500, error_body(f"internal error (request id {rid})", None, "server_error"), {"x-request-id": rid}


def _error(exc: BaseException, prompt_field: str = "prompt") -> JSONResponse:
    status, body, headers = _failure(exc, prompt_field)
    return JSONResponse(body, status, headers=headers)


def _params(body: dict[str, Any], default_max: int) -> SamplingParams:
    kw: dict[str, Any] = {k: body[o] for o, k in _SAMPLING.items() if body.get(o) is not None}
    max_tokens = next((body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), None)
    kw["max_tokens"] = default_max if max_tokens is None else max_tokens
    stop = body.get("stop")
    if stop is not None:
        if not isinstance(stop, str | list):
            raise InvalidRequestError("stop", "must be a string or a list of strings")
        kw["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
    n = body.get("n")
    if n not in (None, 1):
        raise InvalidRequestError("n", "only n=1 is supported")
    # Refused rather than ignored: a caller relying on them would get silently different output.
    for name in ("logprobs", "top_logprobs", "logit_bias", "suffix", "best_of", "echo", "functions", "function_call"):
        if body.get(name) and not (name == "best_of" and body[name] == 1):
            raise InvalidRequestError(name, f"{name} is not supported by this server")
    try:
        return SamplingParams(**kw)
    except TypeError as exc:  # a wrongly typed value msgspec could not even store
        raise InvalidRequestError(next(iter(kw), "body"), str(exc)) from exc
    except OverflowError:  # JSON has integers of any size; a float field cannot take one past float's range
        big = next((k for k, v in kw.items() if isinstance(v, int) and abs(v) > sys.float_info.max), "body")
        raise InvalidRequestError(big, "is out of range") from None


async def _json_body(request: Request, limit: int, timeout: float = BODY_TIMEOUT_S) -> dict[str, Any]:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise RequestTooLargeError("body", f"is {declared} bytes, over this server's limit of {limit}")
    raw = bytearray()
    try:
        with anyio.fail_after(timeout):  # the whole body, not per chunk: a trickle of tiny chunks is cut too
            async for part in request.stream():
                raw += part
                if len(raw) > limit:  # a chunked body says no length up front: count as it arrives
                    raise RequestTooLargeError("body", f"is over this server's limit of {limit} bytes")
    except TimeoutError:
        raise BodyTimeoutError("body", f"did not arrive within {timeout:g} s") from None
    try:
        body = json.loads(bytes(raw) or b"null")
    except RecursionError:
        raise InvalidRequestError("body", "is nested too deeply") from None
    except ValueError as exc:
        raise InvalidRequestError("body", f"is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidRequestError("body", "must be a JSON object")
    for flag in ("stream", "parallel_tool_calls", "echo"):
        # "false" as a string is truthy: a flag of the wrong type would do the opposite of what was meant.
        if body.get(flag) is not None and not isinstance(body[flag], bool):
            raise InvalidRequestError(flag, f"must be true or false, got {body[flag]!r}")
    return body


def _model(body: dict[str, Any], served: str) -> str:
    """The model name to echo back: the request's (one engine serves any name), else the served one."""
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise InvalidRequestError("model", f"must be a string, got {type(name).__name__}")
    return name or served


def _require(body: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = body.get(name)
    if value is None:
        raise InvalidRequestError(name, "is required")
    if not isinstance(value, kind):
        raise InvalidRequestError(name, f"has the wrong type ({type(value).__name__})")
    return value


async def _until_disconnect(request: Request, fn: Callable[[], Awaitable[Any]]) -> Any:
    """Run fn, cancelling it if the client goes away first (its request is aborted, blocks freed)."""
    result: list[Any] = []
    error: list[BaseException] = []

    async with anyio.create_task_group() as tg:
        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        async def work() -> None:
            try:
                result.append(await fn())
            except Exception as exc:  # raised as itself below, not wrapped in an ExceptionGroup
                error.append(exc)
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        tg.start_soon(work)
    if error:
        raise error[0]
    if not result:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return result[0]


def _sse(obj: Any) -> str:
    return "data: " + json.dumps(obj, separators=(",", ":")) + "\n\n"


def _usage(u: Any) -> dict[str, int]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def _chat_args(body: dict[str, Any]) -> dict[str, Any]:
    return dict(tools=body.get("tools"), tool_choice=body.get("tool_choice", "auto"),
                parallel_tool_calls=body.get("parallel_tool_calls", True) is not False,
                response_format=body.get("response_format"))


async def _first(request: Request, stream: Any) -> Any:
    """The first delta (or chunk), so that request errors become an error response, not a broken
    stream. No response has started yet, so nothing else would notice a client that leaves while
    the request waits in the queue or prefills: watch for it, and close the stream (aborting the
    request) if it goes. Returns the 499 Response then."""
    first = await _until_disconnect(request, stream.__anext__)
    if isinstance(first, Response):
        await stream.aclose()
    return first


def _prompts(value: Any) -> list[str | list[int]]:
    """/v1/completions' `prompt`: a string, token ids, or a list of either (one choice per prompt),
    at most MAX_PROMPTS_PER_REQUEST of them."""
    def ids(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

    if isinstance(value, str) or ids(value):
        return [value]
    if isinstance(value, list) and len(value) > MAX_PROMPTS_PER_REQUEST:
        raise InvalidRequestError("prompt", f"takes at most {MAX_PROMPTS_PER_REQUEST} prompts per request, "
                                  f"got {len(value)}")
    if isinstance(value, list) and value and all(isinstance(p, str) or ids(p) for p in value):
        return list(value)
    raise InvalidRequestError("prompt", "must be a string, a list of token ids, or a non-empty list of either")


def prompt_window(engine: AsyncEngine) -> int:
    """How many of one /v1/completions request's prompts are in the engine at once."""
    return max(1, min(PROMPT_WINDOW, engine.config.max_num_seqs // 4))


_LOOPBACK_NAMES = ("localhost",)


def _host_name(host: str) -> str:
    """The name of a Host header, without its port ("[::1]:8000" -> "::1"), lowercased."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_loopback(name: str) -> bool:
    if name in _LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _origin(value: str) -> str:
    return value.strip().rstrip("/").lower()


class _Door:
    """The checks every request passes before a route sees it (see the module docstring), as plain
    ASGI so that a refusal costs no body read and no routing. Refusals are OpenAI's error object."""

    def __init__(self, app: Any, *, api_key: str | None, allowed_origins: Sequence[str],
                 allowed_hosts: Sequence[str] | None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.any_origin = "*" in allowed_origins
        self.origins = {_origin(o) for o in allowed_origins}
        self.any_host = allowed_hosts is not None and "*" in allowed_hosts
        self.hosts = None if allowed_hosts is None else {_host_name(h) for h in allowed_hosts}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refusal = self.refuse(scope, Headers(scope=scope))
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refuse(self, scope: Any, headers: Headers) -> Response | None:
        host = headers.get("host")
        if host is not None and not self.any_host and not self.host_allowed(scope, _host_name(host)):
            return JSONResponse(error_body("this server does not answer for that Host name", None,
                                           code="host_not_allowed"), 403)
        origin = headers.get("origin")
        if origin is not None and not self.any_origin and _origin(origin) not in self.origins:
            return JSONResponse(error_body("requests from this Origin are not allowed (the server's "
                                           "--allowed-origins)", None, code="origin_not_allowed"), 403)
        if self.key is not None and not self.key_matches(headers.get("authorization", "")):
            return JSONResponse(error_body("a valid API key is required: send 'Authorization: Bearer <key>'",
                                           None, code="invalid_api_key"), 401,
                                headers={"WWW-Authenticate": 'Bearer realm="asyncpage"'})
        if scope["method"] in ("POST", "PUT", "PATCH"):
            media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if media != "application/json":
                return JSONResponse(error_body(f"the body must be application/json, not {media or 'untyped'}",
                                               None, code="unsupported_media_type"), 415)
        return None

    def host_allowed(self, scope: Any, name: str) -> bool:
        if _is_loopback(name) or (self.hosts is not None and name in self.hosts):
            return True
        if self.hosts is not None:
            return False
        # Not configured: checked only where rebinding can reach, a connection on a loopback address.
        server = scope.get("server") or (None, None)
        return not (isinstance(server[0], str) and _is_loopback(server[0]))

    def key_matches(self, authorization: str) -> bool:
        assert self.key is not None
        scheme, _, token = authorization.partition(" ")
        # compare_digest over the bytes: constant time whatever the token; a non-Bearer scheme still compares.
        ok = hmac.compare_digest(token.strip().encode("latin-1", "replace"), self.key)
        return ok and scheme.lower() == "bearer"


def app(engine: AsyncEngine, *, max_request_bytes: int = MAX_REQUEST_BYTES, api_key: str | None = None,
        allowed_origins: Sequence[str] = (), allowed_hosts: Sequence[str] | None = None,
        body_timeout: float = BODY_TIMEOUT_S) -> Starlette:
    """The OpenAI-compatible ASGI app over `engine` (started by the caller, or by the app's lifespan
    when `asyncpage serve` owns the engine). Requests may name any model: one engine serves one.
    Bodies over `max_request_bytes` get a 413 before any work is done on them, bodies not received
    within `body_timeout` s a 408. `api_key`: required as `Authorization: Bearer <key>` (401);
    None: no key. `allowed_origins`: browser origins served (with CORS), e.g. "http://localhost:3000"
    ("*": any); a request with any other Origin is a 403. `allowed_hosts`: Host names served besides
    the loopback ones ("*": any); None checks Host only on loopback connections (DNS rebinding)."""
    served = model_id(engine)
    window = prompt_window(engine)

    async def models(request: Request) -> Response:
        try:
            # Dead, or not running (outside `async with`): no route can serve, so this one says so too.
            engine.check_usable()
        except Exception as exc:
            return _error(exc)
        return JSONResponse({"object": "list", "data": [
            {"id": served, "object": "model", "created": 0, "owned_by": "asyncpage"}]})

    async def chat_completions(request: Request) -> Response:
        try:
            body = await _json_body(request, max_request_bytes, body_timeout)
            msgs = _require(body, "messages", list)
            params = _params(body, DEFAULT_MAX_TOKENS)
            args = _chat_args(body)
            cid, created, model = "chatcmpl-" + uuid.uuid4().hex[:24], int(time.time()), _model(body, served)
            if body.get("stream"):
                stream = chat_stream(engine, msgs, params=params, **args)
                first = await _first(request, stream)
                if isinstance(first, Response):
                    return first
                opts = body.get("stream_options") or {}
                usage = bool(opts.get("include_usage")) if isinstance(opts, dict) else False
                return StreamingResponse(_chat_sse(stream, first, cid, created, model, usage),
                                         media_type="text/event-stream")
            res = await _until_disconnect(request, lambda: chat(engine, msgs, params=params, **args))
            if isinstance(res, Response):
                return res
        except Exception as exc:
            return _error(exc, "messages")
        message: dict[str, Any] = {"role": "assistant", "content": res.content}
        if res.reasoning is not None:
            message["reasoning_content"] = res.reasoning
        if res.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in res.tool_calls]
        return JSONResponse({"id": cid, "object": "chat.completion", "created": created, "model": model,
                             "choices": [{"index": 0, "message": message, "finish_reason": res.finish_reason,
                                          "logprobs": None}],
                             "usage": _usage(res.usage)})

    async def completions(request: Request) -> Response:
        try:
            body = await _json_body(request, max_request_bytes, body_timeout)
            prompts = _prompts(_require(body, "prompt", (str, list)))
            params = _params(body, 16)  # OpenAI's default for /v1/completions
            cid, created, model = "cmpl-" + uuid.uuid4().hex[:24], int(time.time()), _model(body, served)
            if body.get("stream"):
                if len(prompts) > 1:
                    raise InvalidRequestError("prompt", "a streamed completion takes one prompt")
                stream = engine.stream(prompts[0], params)
                first = await _first(request, stream)
                if isinstance(first, Response):
                    return first
                opts = body.get("stream_options") or {}
                usage = bool(opts.get("include_usage")) if isinstance(opts, dict) else False
                return StreamingResponse(_completion_sse(stream, first, cid, created, model, usage),
                                         media_type="text/event-stream")

            async def run_all() -> list[Any]:
                outs: list[Any] = [None] * len(prompts)
                todo = iter(enumerate(prompts))

                async def worker() -> None:  # one request per prompt, batched by the engine, `window` at a time
                    for i, prompt in todo:
                        outs[i] = await engine.generate(prompt, params)

                async with anyio.create_task_group() as tg:
                    for _ in range(min(window, len(prompts))):
                        tg.start_soon(worker)
                return outs

            result = await _until_disconnect(request, run_all)
            if isinstance(result, Response):
                return result
        except Exception as exc:
            return _error(exc)
        n_prompt = sum(len(o.prompt_token_ids) for o in result)
        n_out = sum(len(o.token_ids) for o in result)
        return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": model,
                             "choices": [{"index": i, "text": o.text, "finish_reason": o.finish_reason,
                                          "logprobs": None} for i, o in enumerate(result)],
                             "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                       "total_tokens": n_prompt + n_out}})

    async def not_found(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        return JSONResponse(error_body(f"{request.method} {request.url.path}: no such route", None), status)

    # Outermost first: CORS answers a listed origin's preflight (which carries no key) and adds its
    # headers to every answer, the door's refusals included, so the page can read why.
    door = [Middleware(_Door, api_key=api_key, allowed_origins=tuple(allowed_origins), allowed_hosts=allowed_hosts)]
    cors = [Middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST", "OPTIONS"],
                       allow_headers=["authorization", "content-type"])] if allowed_origins else []
    return Starlette(routes=[
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ], exception_handlers={404: not_found, 405: not_found}, middleware=cors + door)


async def _chat_sse(stream: AsyncIterator[ChatDelta], first: ChatDelta, cid: str, created: int, model: str,
                    include_usage: bool) -> AsyncIterator[str]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return _sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]})

    yield chunk({"role": "assistant", "content": ""})
    d: ChatDelta | None = first
    try:
        while d is not None:
            if d.content:
                yield chunk({"content": d.content})
            if d.reasoning:
                yield chunk({"reasoning_content": d.reasoning})
            if d.tool_call is not None:
                tc = d.tool_call
                frag: dict[str, Any] = {"index": tc.index, "function": {"arguments": tc.arguments}}
                if tc.id is not None:
                    frag.update(id=tc.id, type="function")
                    frag["function"]["name"] = tc.name
                yield chunk({"tool_calls": [frag]})
            if d.finish_reason is not None:
                yield chunk({}, d.finish_reason)
                if include_usage and d.usage is not None:
                    yield _sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                                "choices": [], "usage": _usage(d.usage)})
            d = await anext(stream, None)
    except Exception as exc:  # an engine failure mid-stream: OpenAI's clients read an error event
        yield _sse(_failure(exc, "messages")[1])
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    yield "data: [DONE]\n\n"


async def _completion_sse(stream: Any, first: Any, cid: str, created: int, model: str,
                          include_usage: bool) -> AsyncIterator[str]:
    n_tokens = 0
    c = first
    try:
        while c is not None:
            n_tokens += len(c.token_ids)
            yield _sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                        "choices": [{"index": 0, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None}]})
            c = await anext(stream, None)
    except Exception as exc:
        yield _sse(_failure(exc)[1])
    finally:
        await stream.aclose()
    if include_usage and stream.request is not None:
        n_prompt = len(stream.request.prompt_token_ids)
        yield _sse({"id": cid, "object": "text_completion", "created": created, "model": model, "choices": [],
                    "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_tokens,
                              "total_tokens": n_prompt + n_tokens}})
    yield "data: [DONE]\n\n"


def http_client(engine: AsyncEngine, *, module: str = "httpx2", **kwargs: Any) -> Any:
    """An `httpx2.AsyncClient` (or `httpx.AsyncClient` with module="httpx") that reaches the app
    in-process through the streaming transport: hand it to any client that takes one."""
    import importlib

    from asyncpage.openai.transport import make_transport_class

    mod = importlib.import_module(module)
    transport = make_transport_class(mod)(app(engine))
    kwargs.setdefault("timeout", None)
    return mod.AsyncClient(transport=transport, base_url=BASE_URL, **kwargs)


def client(engine: AsyncEngine, **kwargs: Any) -> Any:
    """`openai.AsyncOpenAI` wired to `engine` in-process: no socket, no second process."""
    import openai

    kwargs.setdefault("api_key", "asyncpage")
    kwargs.setdefault("base_url", BASE_URL)
    kwargs.setdefault("max_retries", 0)
    kwargs.setdefault("http_client", http_client(engine))
    return openai.AsyncOpenAI(**kwargs)
