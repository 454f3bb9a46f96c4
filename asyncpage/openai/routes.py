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

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from asyncpage.chat import ChatDelta, chat, chat_stream
from asyncpage.errors import (
    InvalidRequestError,
)
from asyncpage.openai.convert import (
    BASE_URL,
    BODY_TIMEOUT_S,
    DEFAULT_MAX_TOKENS,
    MAX_REQUEST_BYTES,
    PROMPT_WINDOW,
    JSONResponse,
    _chat_args,
    _error,
    _failure,
    _include_usage,
    _json_body,
    _model,
    _params,
    _prompts,
    _require,
    _sse,
    _usage,
    error_body,
    model_id,
    run_options,
)
from asyncpage.openai.door import _Door, check_door_options
from asyncpage.openai.responses import ResponseStore, body_field, sampling_body
from asyncpage.openai.responses import Turn as ResponseTurn

if TYPE_CHECKING:
    from asyncpage.core.client import EngineClient

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


async def _first(request: Request, stream: Any) -> Any:
    """The first delta (or chunk), so that request errors become an error response, not a broken
    stream. No response has started yet, so nothing else would notice a client that leaves while
    the request waits in the queue or prefills: watch for it, and close the stream (aborting the
    request) if it goes. Returns the 499 Response then."""
    first = await _until_disconnect(request, stream.__anext__)
    if isinstance(first, Response):
        await stream.aclose()
    return first


def prompt_window(engine: EngineClient) -> int:
    """How many of one /v1/completions request's prompts are in the engine at once."""
    return max(1, min(PROMPT_WINDOW, engine.config.max_num_seqs // 4))


def app(engine: EngineClient, *, max_request_bytes: int = MAX_REQUEST_BYTES, api_key: str | None = None,
        allowed_origins: Sequence[str] = (), allowed_hosts: Sequence[str] | None = None,
        body_timeout: float = BODY_TIMEOUT_S, fingerprint: str | None = None,
        trust_request_chat_template: bool = False) -> Starlette:
    """The OpenAI-compatible ASGI app over `engine` (started by the caller, or by the app's lifespan
    when `asyncpage serve` owns the engine). Requests may name any model: one engine serves one.
    Bodies over `max_request_bytes` get a 413 before any work is done on them, bodies not received
    within `body_timeout` s a 408. `api_key`: required as `Authorization: Bearer <key>` (401);
    None: no key. `allowed_origins`: browser origins served (with CORS), e.g. "http://localhost:3000"
    ("*": any); a request with any other Origin is a 403. `allowed_hosts`: Host names served besides
    the loopback ones ("*": any); None checks Host only on loopback connections (DNS rebinding).
    `fingerprint`: the `system_fingerprint` of every chat, completion and response body (and chunk),
    naming the engine that answered (asyncpage.ray.serve_app gives each replica its own); None: left out.
    `trust_request_chat_template`: take a body's `chat_template` (it runs in this process; off, a 400);
    the in-process clients turn it on (their caller wrote the app)."""
    check_door_options(api_key, allowed_origins, allowed_hosts, max_request_bytes, body_timeout)
    served = model_id(engine)
    window = prompt_window(engine)
    mark = {} if fingerprint is None else {"system_fingerprint": fingerprint}

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
            args = _chat_args(body, trust_request_chat_template)
            cid, created, model = "chatcmpl-" + uuid.uuid4().hex[:24], int(time.time()), _model(body, served)
            if body.get("stream"):
                stream = chat_stream(engine, msgs, params=params, **args)
                first = await _first(request, stream)
                if isinstance(first, Response):
                    return first
                usage = _include_usage(body)
                return StreamingResponse(_chat_sse(stream, first, cid, created, model, usage, mark),
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
                             "usage": _usage(res.usage), **mark})

    async def completions(request: Request) -> Response:
        try:
            body = await _json_body(request, max_request_bytes, body_timeout)
            prompts = _prompts(_require(body, "prompt", (str, list)))
            params = _params(body, 16)  # OpenAI's default for /v1/completions
            run = run_options(body)
            cid, created, model = "cmpl-" + uuid.uuid4().hex[:24], int(time.time()), _model(body, served)
            if body.get("stream"):
                if len(prompts) > 1:
                    raise InvalidRequestError("prompt", "a streamed completion takes one prompt")
                stream = engine.stream(prompts[0], params, **run)
                first = await _first(request, stream)
                if isinstance(first, Response):
                    return first
                usage = _include_usage(body)
                return StreamingResponse(_completion_sse(stream, first, cid, created, model, usage, mark),
                                         media_type="text/event-stream")

            async def run_all() -> list[Any]:
                outs: list[Any] = [None] * len(prompts)
                todo = iter(enumerate(prompts))

                async def worker() -> None:  # one request per prompt, batched by the engine, `window` at a time
                    for i, prompt in todo:
                        outs[i] = await engine.generate(prompt, params, **run)

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
        cached = sum(o.metrics.num_cached_prompt_tokens for o in result)
        return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": model,
                             "choices": [{"index": i, "text": o.text, "finish_reason": o.finish_reason,
                                          "logprobs": None} for i, o in enumerate(result)],
                             "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                       "total_tokens": n_prompt + n_out,
                                       "prompt_tokens_details": {"cached_tokens": cached}}, **mark})

    store = ResponseStore()

    async def responses_create(request: Request) -> Response:
        try:
            body = await _json_body(request, max_request_bytes, body_timeout)
            turn = ResponseTurn(body, store, _model(body, served), trust_request_chat_template)
            params = _params(sampling_body(body), DEFAULT_MAX_TOKENS)
            run = run_options(body)
            run["cache_key"] = turn.cache_key
            if body.get("stream"):
                stream = chat_stream(engine, turn.messages, params=params, **turn.args, **run)
                first = await _first(request, stream)
                if isinstance(first, Response):
                    return first

                async def events() -> AsyncIterator[str]:
                    try:
                        async for e in turn.events(stream, first, store):
                            if mark and isinstance(e.get("response"), dict):
                                e = {**e, "response": {**e["response"], **mark}}
                            yield f"event: {e['type']}\n" + _sse(e)
                    except Exception as exc:  # after the first delta: an error event, the stream ends
                        failure = _failure(exc, "input", body_field)[1]["error"]
                        yield "event: error\n" + _sse({"type": "error", **failure})
                    finally:
                        await stream.aclose()  # type: ignore[attr-defined]

                return StreamingResponse(events(), media_type="text/event-stream")
            res = await _until_disconnect(request, lambda: chat(engine, turn.messages, params=params, **turn.args,
                                                                **run))
            if isinstance(res, Response):
                return res
        except Exception as exc:
            return _error(exc, "input", body_field)
        return JSONResponse({**turn.finished(res, store), **mark})

    async def responses_get(request: Request) -> Response:
        kept = store.get(request.path_params["rid"])
        if kept is None:
            return JSONResponse(error_body("no such response", "response_id"), 404)
        return JSONResponse(kept[0])

    async def responses_delete(request: Request) -> Response:
        rid = request.path_params["rid"]
        if not store.delete(rid):
            return JSONResponse(error_body("no such response", "response_id"), 404)
        return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})

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
        Route("/v1/responses", responses_create, methods=["POST"]),
        Route("/v1/responses/{rid}", responses_get, methods=["GET"]),
        Route("/v1/responses/{rid}", responses_delete, methods=["DELETE"]),
    ], exception_handlers={404: not_found, 405: not_found}, middleware=cors + door)


async def _chat_sse(stream: AsyncIterator[ChatDelta], first: ChatDelta, cid: str, created: int, model: str,
                    include_usage: bool, mark: dict[str, str]) -> AsyncIterator[str]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return _sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **mark})

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
                                "choices": [], "usage": _usage(d.usage), **mark})
            d = await anext(stream, None)
    except Exception as exc:  # an engine failure mid-stream: OpenAI's clients read an error event
        yield _sse(_failure(exc, "messages")[1])
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    yield "data: [DONE]\n\n"


async def _completion_sse(stream: Any, first: Any, cid: str, created: int, model: str,
                          include_usage: bool, mark: dict[str, str]) -> AsyncIterator[str]:
    n_tokens = 0
    c = first
    try:
        while c is not None:
            n_tokens += len(c.token_ids)
            yield _sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                        "choices": [{"index": 0, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None}],
                        **mark})
            c = await anext(stream, None)
    except Exception as exc:
        yield _sse(_failure(exc)[1])
    finally:
        await stream.aclose()
    if include_usage and stream.request is not None:
        n_prompt = len(stream.request.prompt_token_ids)
        yield _sse({"id": cid, "object": "text_completion", "created": created, "model": model, "choices": [],
                    "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_tokens,
                              "total_tokens": n_prompt + n_tokens,
                              "prompt_tokens_details": {"cached_tokens": stream.request.num_cached_prompt_tokens}},
                    **mark})
    yield "data: [DONE]\n\n"


def http_client(engine: EngineClient, *, module: str = "httpx2", **kwargs: Any) -> Any:
    """An `httpx2.AsyncClient` (or `httpx.AsyncClient` with module="httpx") that reaches the app
    in-process through the streaming transport: hand it to any client that takes one."""
    import importlib

    from asyncpage.openai.transport import make_transport_class

    mod = importlib.import_module(module)
    transport = make_transport_class(mod)(app(engine, trust_request_chat_template=True))
    kwargs.setdefault("timeout", None)
    return mod.AsyncClient(transport=transport, base_url=BASE_URL, **kwargs)


def client(engine: EngineClient, **kwargs: Any) -> Any:
    """`openai.AsyncOpenAI` wired to `engine` in-process: no socket, no second process."""
    import openai

    kwargs.setdefault("api_key", "asyncpage")
    kwargs.setdefault("base_url", BASE_URL)
    kwargs.setdefault("max_retries", 0)
    kwargs.setdefault("http_client", http_client(engine))
    return openai.AsyncOpenAI(**kwargs)
