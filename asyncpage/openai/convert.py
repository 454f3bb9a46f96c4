"""The OpenAI wire format on our side: request bodies read and checked (size, time, JSON, types) and
turned into SamplingParams, our typed errors turned into OpenAI's error objects with their HTTP
status, SSE framing and usage. No routes and no engine calls here (routes.py)."""

from __future__ import annotations

import json
import logging
import math
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse as _StarletteJSON

from asyncpage.chat.reasoning import budget as effort_budget
from asyncpage.core.validation import MAX_CACHE_KEY_CHARS
from asyncpage.errors import (
    EngineDeadError,
    EngineNotRunningError,
    InvalidRequestError,
    PromptTooLongError,
    QueueFullError,
    SamplingError,
)
from asyncpage.openai.structured import structured_fields
from asyncpage.params import SamplingParams

if TYPE_CHECKING:
    from asyncpage.core.client import EngineClient

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
             "ignore_eos": "ignore_eos", "cache_salt": "cache_salt",
             # asyncpage's own: JSON's spelling and undeclared keys under a schema (SamplingParams' docs)
             "json_separators": "json_separators", "json_closed_objects": "json_closed_objects"}
_LOG = logging.getLogger("asyncpage.openai")



def model_id(engine: EngineClient) -> str:
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


def _failure(exc: BaseException, prompt_field: str = "prompt",
             body_field: Callable[[str], str] | None = None) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, OpenAI error body, headers) for an exception. `prompt_field`: what the route calls the
    prompt (the chat route's is `messages`); `body_field`: the route's body's name for a field that
    chat() or SamplingParams named (the Responses body is translated into their arguments). Only our
    own typed errors' messages reach the client; for anything else (and an engine's death, whose
    message carries its cause) the client gets a generic message with a request id, and the detail
    goes to the log under that id."""
    if isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        return _failure(exc.exceptions[0], prompt_field, body_field)  # one failed prompt of a batch: as itself
    if isinstance(exc, InvalidRequestError) and body_field is not None:
        exc = type(exc)(body_field(exc.field), exc.message)
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


def _error(exc: BaseException, prompt_field: str = "prompt",
           body_field: Callable[[str], str] | None = None) -> JSONResponse:
    status, body, headers = _failure(exc, prompt_field, body_field)
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
    guided = structured_fields(body)  # vLLM's structured_outputs / guided_* fields (structured.py)
    kw.update({field: value for field, (_src, value) in guided.items()})
    try:
        return SamplingParams(**kw)
    except InvalidRequestError as exc:
        if exc.field in guided:  # named as the body wrote it
            raise InvalidRequestError(guided[exc.field][0], exc.message) from None
        raise
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
        body = _parse(bytes(raw) or b"null")
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


def _parse(raw: bytes) -> Any:
    """JSON on the event loop: msgspec's parser (about 2x json's on large bodies: an 11 MiB body of
    numbers in 0.06 s against 0.14 s), and json's where msgspec refuses what json reads (NaN, lone
    surrogate escapes), so what a request means never depends on which one parsed it."""
    try:
        return msgspec.json.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return json.loads(raw)


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


def _sse(obj: Any) -> str:
    return "data: " + json.dumps(obj, separators=(",", ":")) + "\n\n"


def _include_usage(body: dict[str, Any]) -> bool:
    """A streamed request's `stream_options.include_usage` (a final chunk with usage)."""
    opts = body.get("stream_options") or {}
    return bool(opts.get("include_usage")) if isinstance(opts, dict) else False


def _usage(u: Any) -> dict[str, Any]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": int(getattr(u, "cached_tokens", 0) or 0)},
            "completion_tokens_details": {"reasoning_tokens": int(getattr(u, "reasoning_tokens", 0) or 0)}}


# OpenAI's service tiers onto the engine's priorities (lower runs first): interactive turns ahead of the
# default, background ("flex") work after it.
SERVICE_TIERS = {"priority": -1, "default": 0, "auto": 0, "flex": 1}


def run_options(body: dict[str, Any]) -> dict[str, Any]:
    """How a request runs in the engine: `priority` (vLLM's extension, an int, lower first) or
    `service_tier`; `prompt_cache_key` keeps the conversation's blocks for its next turn."""
    tier = body.get("service_tier")
    if tier is not None and (not isinstance(tier, str) or tier not in SERVICE_TIERS):
        raise InvalidRequestError("service_tier", f"must be one of {sorted(SERVICE_TIERS)}, got {tier!r:.40}")
    priority = body.get("priority", SERVICE_TIERS.get(tier or "auto", 0))
    key = body.get("prompt_cache_key")
    if key is not None and not isinstance(key, str):
        raise InvalidRequestError("prompt_cache_key", "must be a string")
    if key is not None and len(key) > MAX_CACHE_KEY_CHARS:  # the engine refuses it too, naming its `cache_key`
        raise InvalidRequestError("prompt_cache_key", f"has {len(key)} characters, over the limit of "
                                                      f"{MAX_CACHE_KEY_CHARS}")
    return {"priority": priority, "cache_key": key or None}


def reasoning_options(body: dict[str, Any], effort: Any = None, trust_template: bool = True) -> dict[str, Any]:
    """A body's reasoning budget (`max_reasoning_tokens`, vLLM's `thinking_token_budget` spelling too, or
    `reasoning_effort`; `effort` is the Responses API's reasoning.effort) and its `chat_template`. A
    template from a request runs in this process: it is refused unless the app trusts them (Jinja's
    sandbox bounds what a template may touch, not the time or memory it may take)."""
    budget = body.get("max_reasoning_tokens", body.get("thinking_token_budget"))
    if effort is not None and budget is None:
        try:  # checked as chat() checks the reasoning_effort it becomes, to be named as the body names it
            effort_budget(None, effort)
        except InvalidRequestError as exc:
            raise InvalidRequestError("reasoning.effort", exc.message) from None
    effort = body.get("reasoning_effort") if effort is None else effort
    template = body.get("chat_template")
    if template is not None and not trust_template:
        raise InvalidRequestError("chat_template", "this server does not take chat templates from requests "
                                  "(the app's trust_request_chat_template is off)")
    return {"max_reasoning_tokens": budget, "reasoning_effort": effort, "chat_template": template}


def _chat_args(body: dict[str, Any], trust_template: bool = True) -> dict[str, Any]:
    return dict(tools=body.get("tools"), tool_choice=body.get("tool_choice", "auto"),
                parallel_tool_calls=body.get("parallel_tool_calls", True) is not False,
                response_format=body.get("response_format"), **run_options(body),
                **reasoning_options(body, trust_template=trust_template))


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


