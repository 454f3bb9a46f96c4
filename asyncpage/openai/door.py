"""The door of the served app: the checks every request passes before a route sees it (Host, Origin,
API key, Content-Type), as plain ASGI, so that a refusal costs no body read and no routing."""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Sequence
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import Response

from asyncpage.errors import InvalidRequestError
from asyncpage.openai.convert import JSONResponse, error_body

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


def check_door_options(api_key: Any, allowed_origins: Any, allowed_hosts: Any, max_request_bytes: Any,
                       body_timeout: Any) -> None:
    """InvalidRequestError naming the first of the app's door options that is of the wrong type or out of
    range, at construction (not at the first request, or in every replica of asyncpage.ray.serve_app)."""
    if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
        raise InvalidRequestError("api_key", "must be a non-empty string (None serves without a key)")
    for name, value in (("allowed_origins", allowed_origins), ("allowed_hosts", allowed_hosts)):
        if value is not None and (isinstance(value, str) or not all(isinstance(v, str) for v in value)):
            raise InvalidRequestError(name, f"must be a list of strings, got {value!r}")
    if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int) or max_request_bytes < 1:
        raise InvalidRequestError("max_request_bytes", f"must be an int >= 1, got {max_request_bytes!r}")
    if (isinstance(body_timeout, bool) or not isinstance(body_timeout, int | float)
            or not 0 < body_timeout < float("inf")):
        raise InvalidRequestError("body_timeout", f"must be a finite number of seconds > 0, got {body_timeout!r}")


def _origin(value: str) -> str:
    return value.strip().rstrip("/").lower()


class _Door:
    """The checks every request passes before a route sees it (see the module docstring), as plain
    ASGI so that a refusal costs no body read and no routing. Refusals are OpenAI's error object."""

    def __init__(self, app: Any, *, api_key: str | None, allowed_origins: Sequence[str],
                 allowed_hosts: Sequence[str] | None) -> None:
        self.app = app
        # Stripped as the client's token is: a key given with a stray space still matches its own value.
        self.key = api_key.strip().encode() if api_key else None
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


