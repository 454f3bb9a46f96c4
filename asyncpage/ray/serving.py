"""Serving on Ray Serve: replicas of one AsyncEngine each behind the OpenAI-compatible routes.

    from ray import serve
    import asyncpage.ray
    serve.run(asyncpage.ray.serve_app(num_replicas=2, engine_options={"model": "/models/gemma"}))
    # http://127.0.0.1:8000/v1/chat/completions, .../v1/completions, .../v1/responses, .../v1/models

Owns the two deployments and how a request crosses them (`asyncpage serve --ray` runs the same):
- `Ingress` (the HTTP route, one replica, no CPU by default) reads the body, takes its affinity key
  (asyncpage.ray.routing.affinity_key) and calls an engine replica through a DeploymentHandle, streaming.
  The handle's request router is `CacheAffinityRouter`: a conversation's turns land where its KV blocks
  are. A replica lost before it answered (killed, its node gone) is a 503 with Retry-After, which
  OpenAI's clients retry, by then on a live replica; a stream it was sending ends with an error event.
- `EngineReplica` (num_replicas of them, `ray_actor_options` each: one CPU by default, so two 1-CPU
  nodes hold two) loads the engine, starts it on the replica's event loop, and runs the request through
  `asyncpage.openai.app` in-process (ASGI): every route, the door (API key, origins, hosts) and the
  error shapes are the app's own. `system_fingerprint` names the replica. Serve's health check asks the
  engine; a dead engine's replica is replaced. The engine stops when Serve stops the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping, MutableMapping, Sequence
from typing import Any

import anyio
import msgspec
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from asyncpage.core.config import EngineOptions
from asyncpage.decoding.speculative import SpeculativeConfig
from asyncpage.engine import AsyncEngine
from asyncpage.errors import InvalidRequestError
from asyncpage.openai.convert import BODY_TIMEOUT_S, MAX_REQUEST_BYTES, error_body
from asyncpage.openai.door import check_door_options
from asyncpage.openai.routes import app
from asyncpage.ray.routing import IMBALANCED_THRESHOLD, CacheAffinityRouter, affinity_key

# Scope fields a route reads; the rest of Serve's scope (its app, router, state) stays behind.
_SCOPE_FIELDS = ("type", "http_version", "method", "scheme", "path", "raw_path", "query_string", "headers", "client",
                 "server")
RETRY_AFTER_S = 1
# Responses kept by id -> the affinity they were answered under, so that previous_response_id
# (and GET/DELETE of a response) reaches the replica whose store holds it.
RESPONSE_AFFINITIES = 4096


class EngineReplica:
    """One engine and the OpenAI app over it; `handle` runs one HTTP request through the app."""

    # Serve awaits an async constructor (Ray actors allow one; type checkers do not).
    async def __init__(self, engine_options: Mapping[str, Any], app_options: Mapping[str, Any]) -> None:  # type: ignore[misc]
        options = dict(engine_options)
        template = options.pop("chat_template", None)
        if template is not None and "chat_template" in inspect.signature(AsyncEngine.from_pretrained).parameters:
            options["chat_template"] = template
            template = None
        self.engine = await asyncio.to_thread(AsyncEngine.from_pretrained, **options)
        if template is not None:
            self.engine.tokenizer.chat_template = template
        await self.engine.__aenter__()  # on this replica's event loop, which runs every request
        self.fingerprint = "asyncpage-" + serve.get_replica_context().replica_id.unique_id
        self.app = app(self.engine, fingerprint=self.fingerprint, **app_options)

    async def handle(self, scope: dict[str, Any], body: bytes, affinity: str | None = None
                     ) -> AsyncIterator[dict[str, Any] | bytes]:
        """The app's answer to one request: {"status", "headers"} first, then the body's chunks. When the
        caller stops reading (its client left), the app sees a disconnect and aborts the generation."""
        sent: asyncio.Queue[MutableMapping[str, Any] | None] = asyncio.Queue()
        gone = asyncio.Event()
        body_read = False

        async def receive() -> dict[str, Any]:
            nonlocal body_read
            if not body_read:
                body_read = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            await sent.put(message)

        async def run() -> None:
            try:
                await self.app({**scope, "asgi": {"version": "3.0"}, "root_path": ""}, receive, send)
            finally:
                await sent.put(None)

        task = asyncio.ensure_future(run())
        try:
            while (message := await sent.get()) is not None:
                if message["type"] == "http.response.start":
                    yield {"status": message["status"], "headers": [list(h) for h in message.get("headers", [])]}
                elif message["type"] == "http.response.body" and message.get("body"):
                    yield bytes(message["body"])
            await task  # the app's own failure, if any, is this call's
        finally:
            gone.set()
            if not task.done():
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(asyncio.shield(task), 5)
                task.cancel()

    async def check_health(self) -> None:  # async: on the engine's loop (a sync one runs in a thread)
        """Serve's health check: raises once the engine is dead, and Serve replaces this replica."""
        self.engine.check_usable()

    async def __del__(self) -> None:
        await self.engine.__aexit__(None, None, None)


def _unavailable(message: str) -> Response:
    body = msgspec.json.encode(error_body(message, None, "service_unavailable", "replica_unavailable"))
    return Response(body, 503, {"retry-after": str(RETRY_AFTER_S)}, media_type="application/json")


class Ingress:
    """The HTTP route: one request in, the engine replica its affinity names (CacheAffinityRouter) answers."""

    def __init__(self, engines: DeploymentHandle, max_request_bytes: int = MAX_REQUEST_BYTES,
                 body_timeout: float = BODY_TIMEOUT_S) -> None:
        self.engines = engines.options(method_name="handle", stream=True)
        self.max_request_bytes = max_request_bytes
        self.body_timeout = body_timeout
        self.responses: OrderedDict[str, str] = OrderedDict()

    async def __call__(self, request: Request) -> Response:
        body = bytearray()
        try:
            # The whole body within body_timeout, as the app's own door: a client trickling it (or
            # sending none) would otherwise hold one of the ingress' requests forever.
            with anyio.fail_after(self.body_timeout):
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > self.max_request_bytes:
                        return Response(msgspec.json.encode(error_body(
                            f"the request body is over {self.max_request_bytes} bytes", None,
                            code="request_too_large")), 413, media_type="application/json")
        except TimeoutError:
            return Response(msgspec.json.encode(error_body(
                f"the request body did not arrive within {self.body_timeout:g} s", "body", code="request_timeout")),
                408, media_type="application/json")
        key = self._affinity(request, bytes(body))
        scope = {k: request.scope[k] for k in _SCOPE_FIELDS if k in request.scope}
        answer: Any = self.engines.remote(scope, bytes(body), affinity=key)  # a DeploymentResponseGenerator
        try:
            start = await answer.__anext__()
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start["headers"]}
            if "text/event-stream" in headers.get("content-type", ""):
                return StreamingResponse(self._rest(answer), start["status"], headers)
            content = b"".join([chunk async for chunk in answer])
        except (RayActorError, ActorUnavailableError, BackPressureError) as exc:
            # The replica died or is unreachable before it answered: nothing was sent yet, so the
            # client may retry (OpenAI's clients retry a 503), and Serve routes the retry elsewhere.
            return _unavailable(f"the engine replica was lost ({type(exc).__name__}); retry")
        if key is not None and request.url.path == "/v1/responses" and start["status"] == 200:
            self._remember(content, key)
        return Response(content, start["status"], headers)

    def _affinity(self, request: Request, body: bytes) -> str | None:
        path = request.url.path
        if path.startswith("/v1/responses/"):  # GET / DELETE a stored response
            return self.responses.get(path.removeprefix("/v1/responses/"))
        key = affinity_key(body) if request.method == "POST" else None
        if key is None and path == "/v1/responses":
            with contextlib.suppress(msgspec.DecodeError, RecursionError):
                prev = msgspec.json.decode(body)
                if isinstance(prev, dict) and isinstance(prev.get("previous_response_id"), str):
                    key = self.responses.get(prev["previous_response_id"])
        return key

    def _remember(self, content: bytes, key: str) -> None:
        with contextlib.suppress(msgspec.DecodeError):
            answer = msgspec.json.decode(content)
            if isinstance(answer, dict) and isinstance(answer.get("id"), str):
                self.responses[answer["id"]] = key
                while len(self.responses) > RESPONSE_AFFINITIES:
                    self.responses.popitem(last=False)

    async def _rest(self, answer: Any) -> AsyncIterator[bytes]:
        try:
            async for chunk in answer:
                yield chunk
        except (RayActorError, ActorUnavailableError) as exc:
            # Mid-stream there is no status left to change: an error event ends the stream.
            event = error_body(f"the engine replica was lost ({type(exc).__name__})", None, "service_unavailable",
                               "replica_unavailable")
            yield b"data: " + msgspec.json.encode(event) + b"\n\n"


def _check_engine_options(options: Mapping[str, Any]) -> None:
    """The pool and scheduling options among `options` checked as from_pretrained checks them (the
    rest are checked by the load itself), so that a bad value fails here, naming it, not in every replica."""
    defaults = {k: p.default for k, p in inspect.signature(AsyncEngine.from_pretrained).parameters.items()
                if k in EngineOptions.names()}
    merged = {**defaults, **{k: v for k, v in options.items() if k in EngineOptions.names()}}
    merged["speculative_config"] = SpeculativeConfig.parse(merged.get("speculative_config"))
    if merged.get("debug_checks") is None:
        merged["debug_checks"] = False  # None: the replica reads ASYNCPAGE_DEBUG_CHECKS (from_pretrained)
    EngineOptions(**merged).check()


def serve_app(num_replicas: int = 1, engine_options: Mapping[str, Any] | None = None, *,
              ray_actor_options: Mapping[str, Any] | None = None,
              ingress_actor_options: Mapping[str, Any] | None = None, max_ongoing_requests: int = 64,
              cache_routing: bool = True, imbalanced_threshold: int = IMBALANCED_THRESHOLD,
              api_key: str | None = None, allowed_origins: Sequence[str] = (),
              allowed_hosts: Sequence[str] | None = None, max_request_bytes: int = MAX_REQUEST_BYTES,
              body_timeout: float = BODY_TIMEOUT_S, name: str = "asyncpage") -> serve.Application:
    """A Ray Serve application (run it with `serve.run(...)`): `num_replicas` engine replicas, each
    `AsyncEngine.from_pretrained(**engine_options)` (`model` among them; `num_threads` defaults to the
    replica's CPUs), behind one ingress serving the OpenAI routes (asyncpage.openai.app's; `api_key`,
    `allowed_origins`, `allowed_hosts`, `max_request_bytes`, `body_timeout` as there).

    `ray_actor_options`: each engine replica's resources (default {"num_cpus": 1}); the ingress's
    `ingress_actor_options` (default {"num_cpus": 0}). `max_ongoing_requests`: requests one replica
    holds at once (past it the router waits for a free one). `cache_routing`: keyed requests to the
    replica holding their prefix (CacheAffinityRouter, `imbalanced_threshold` as there); False: Serve's
    default router (by load only)."""
    for field, value, least in (("num_replicas", num_replicas, 1), ("max_ongoing_requests", max_ongoing_requests, 1),
                                ("imbalanced_threshold", imbalanced_threshold, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise InvalidRequestError(field, f"must be an int >= {least}, got {value!r}")
    if engine_options is not None and not isinstance(engine_options, Mapping):
        raise InvalidRequestError("engine_options", f"must be a dict, got {type(engine_options).__name__}")
    # A misspelt option fails here, naming it, not in every replica's constructor (Serve then reports
    # only that the deployment failed to update).
    known = inspect.signature(AsyncEngine.from_pretrained).parameters
    unknown = sorted(str(k) for k in (engine_options or {}) if k not in known)
    if unknown:
        raise InvalidRequestError("engine_options", f"not options of AsyncEngine.from_pretrained: {', '.join(unknown)}")
    _check_engine_options(engine_options or {})
    check_door_options(api_key, allowed_origins, allowed_hosts, max_request_bytes, body_timeout)
    actor = dict(ray_actor_options if ray_actor_options is not None else {"num_cpus": 1})
    options = dict(engine_options or {})
    if options.get("num_threads") is None:
        options["num_threads"] = max(1, int(actor.get("num_cpus", 1) or 1))
    app_options = {"api_key": api_key, "allowed_origins": tuple(allowed_origins), "allowed_hosts": allowed_hosts,
                   "max_request_bytes": max_request_bytes, "body_timeout": body_timeout}
    router: dict[str, Any] = {}
    if cache_routing:
        router["request_router_config"] = {
            "request_router_class": f"{CacheAffinityRouter.__module__}.{CacheAffinityRouter.__name__}",
            "request_router_kwargs": {"imbalanced_threshold": imbalanced_threshold}}
    engines = serve.deployment(name=f"{name}-engine", num_replicas=num_replicas, ray_actor_options=actor,
                               max_ongoing_requests=max_ongoing_requests, **router)(EngineReplica)
    ingress = serve.deployment(name=f"{name}-ingress", num_replicas=1,
                               ray_actor_options=dict(ingress_actor_options or {"num_cpus": 0}),
                               max_ongoing_requests=max(1024, 4 * num_replicas * max_ongoing_requests))(Ingress)
    return ingress.bind(engines.bind(options, app_options), max_request_bytes, body_timeout)
