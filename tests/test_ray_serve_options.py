"""asyncpage.ray.serve_app without a cluster: what it refuses before Ray is touched, and the ingress'
door for a body that never arrives. The cluster tests are tests/test_ray_serve.py (heavy)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest

pytest.importorskip("ray.serve")

from starlette.requests import Request

from asyncpage.errors import InvalidRequestError
from asyncpage.ray import serve_app
from asyncpage.ray.serving import Ingress


def test_a_misspelt_engine_option_is_refused_naming_it_before_any_replica_starts() -> None:
    # Else each replica's constructor fails, and serve.run says only "Failed to update the deployments".
    with pytest.raises(InvalidRequestError, match=r"^engine_options: .*num_kv_block\b"):
        serve_app(1, {"model": "/models/x", "num_kv_block": 64})
    with pytest.raises(InvalidRequestError, match=r"^engine_options:"):
        serve_app(1, ["model"])  # type: ignore[arg-type]
    serve_app(1, {"model": "/models/x", "num_kv_blocks": 64, "chat_template": "{{ x }}"})  # builds


@pytest.mark.parametrize("n", [0, True, "2", 2.5])
def test_num_replicas_must_be_a_positive_int(n: Any) -> None:
    with pytest.raises(InvalidRequestError, match=r"^num_replicas:"):
        serve_app(n)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"engine_options": {"num_kv_blocks": "many"}}, "num_kv_blocks"),
    ({"engine_options": {"enable_prefix_caching": "no"}}, "enable_prefix_caching"),
    ({"engine_options": {"speculative_config": {"method": "nope"}}}, "speculative_config"),
    ({"body_timeout": -1}, "body_timeout"), ({"body_timeout": float("nan")}, "body_timeout"),
    ({"max_request_bytes": -5}, "max_request_bytes"), ({"imbalanced_threshold": -1}, "imbalanced_threshold"),
    ({"max_ongoing_requests": 0}, "max_ongoing_requests"), ({"allowed_origins": "http://a"}, "allowed_origins"),
    ({"api_key": 123}, "api_key"), ({"api_key": " "}, "api_key")])
def test_a_bad_option_value_is_refused_naming_it_before_any_replica_starts(kwargs: dict[str, Any], field: str) -> None:
    # Each of these was accepted, then failed in every replica (or made every request a 408 / 413).
    with pytest.raises(InvalidRequestError, match=rf"^{field}:"):
        serve_app(1, **({"engine_options": {"model": "/models/x"}} | kwargs))


class _NoEngines:
    def options(self, **kwargs: Any) -> _NoEngines:
        return self

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a request whose body never arrived reached an engine replica")


@pytest.mark.asyncio
async def test_a_body_that_never_arrives_is_a_408_after_body_timeout_not_a_held_request() -> None:
    """A client that sends its headers and then nothing (or trickles) held an ingress request forever:
    the ingress now keeps the app's own body_timeout."""
    ingress = Ingress(_NoEngines(), body_timeout=0.5)  # type: ignore[arg-type]
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": b"{", "more_body": True}
        await asyncio.sleep(3600)
        raise AssertionError

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [], "query_string": b""}
    started = time.monotonic()
    response = await asyncio.wait_for(ingress(Request(scope, receive)), 10)
    assert response.status_code == 408 and time.monotonic() - started < 5
    assert msgspec.json.decode(response.body)["error"]["code"] == "request_timeout"


@pytest.mark.asyncio
async def test_a_replica_lost_reads_as_the_servers_fault_not_the_callers() -> None:
    """The 503 before any output and the error event mid-stream are "service_unavailable" (as the app's
    own 503s), not "invalid_request_error", which tells a client its request was wrong."""
    from ray.exceptions import RayActorError

    from asyncpage.ray.serving import _unavailable

    refused = msgspec.json.decode(_unavailable("the engine replica was lost; retry").body)["error"]
    assert refused["type"] == "service_unavailable" and refused["code"] == "replica_unavailable"

    async def answer() -> Any:
        yield b"data: {}\n\n"
        raise RayActorError()

    ingress = Ingress(_NoEngines())  # type: ignore[arg-type]
    chunks = [c async for c in ingress._rest(answer())]
    event = msgspec.json.decode(chunks[-1].removeprefix(b"data: "))["error"]
    assert event["type"] == "service_unavailable" and event["code"] == "replica_unavailable"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_a_body_nested_too_deeply_reaches_the_replica_for_its_400_not_a_500(path: str) -> None:
    """msgspec raises RecursionError (not DecodeError) past its depth limit: the ingress' affinity
    read let it out, a plain-text 500 where the app's own door answers 400 "nested too deeply"."""
    from asyncpage.ray.routing import affinity_key

    deep = b"[" * 100_000 + b"]" * 100_000
    assert affinity_key(deep) is None
    assert affinity_key(b'{"messages": ' + deep + b"}") is None
    scope = {"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""}
    ingress = Ingress(_NoEngines())  # type: ignore[arg-type]
    assert ingress._affinity(Request(scope), deep) is None
