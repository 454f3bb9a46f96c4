"""Which engine replica a request goes to, behind Ray Serve: the request's affinity key, and the
Serve request router that keeps a key on one replica.

`affinity_key` reads a request body the way the engine's prefix cache would group it: its
`prompt_cache_key` (a conversation, an agent's session), else the start of a long prompt (requests that
share a long system prompt or document), else nothing. `CacheAffinityRouter` is a Ray Serve
`RequestRouter` (the deployment's `request_router_config`): a keyed request goes to the replica the key
hashes to (rendezvous hashing over the running replicas, so a replica that dies or joins moves only its
own keys), unless that replica's queue is `imbalanced_threshold` requests longer than the shortest
other one, or full; then to the least loaded. A request with no key goes to the less loaded of two
random replicas (Serve's default, power of two choices). The ingress passes the key to the replica call
as its `affinity` keyword, which is where the router reads it.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import msgspec
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

# A prompt counts as "long" past this many characters of its start: requests sharing that much
# (a system prompt, a document) share KV blocks worth keeping on one replica.
PREFIX_CHARS = 1024
IMBALANCED_THRESHOLD = 8


def _prompt_start(body: dict[str, Any]) -> str:
    """The start of what the request's prompt is made of, as text, in a stable form."""
    parts: list[Any] = []
    for field in ("instructions", "messages", "input", "prompt"):
        value = body.get(field)
        if value is not None:
            parts.append(value)
    if not parts:
        return ""
    return msgspec.json.encode(parts).decode()[:PREFIX_CHARS]


def affinity_key(body: bytes) -> str | None:
    """The replica affinity of a request body (JSON): "key:<prompt_cache_key>", "prefix:<digest>" for a
    prompt at least PREFIX_CHARS long, or None (no affinity; also for a body that is not a JSON object,
    which the replica refuses itself)."""
    try:
        parsed = msgspec.json.decode(body) if body else None
    except (msgspec.DecodeError, RecursionError):  # nested too deeply: the replica refuses it (400)
        return None
    if not isinstance(parsed, dict):
        return None
    key = parsed.get("prompt_cache_key")
    if isinstance(key, str) and key:
        return "key:" + key
    start = _prompt_start(parsed)
    if len(start) >= PREFIX_CHARS:
        return "prefix:" + hashlib.sha1(start.encode(), usedforsecurity=False).hexdigest()
    return None


def _weight(key: str, replica: RunningReplica) -> int:
    digest = hashlib.blake2b(f"{key}\0{replica.replica_id.unique_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class CacheAffinityRouter(RequestRouter):
    """Keyed requests to the replica their key hashes to (see the module docstring); the rest by load."""

    def initialize_state(self, imbalanced_threshold: int = IMBALANCED_THRESHOLD, **kwargs: Any) -> None:
        self.imbalanced_threshold = imbalanced_threshold

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            # Every replica is in the ranks returned: when none takes the request, back off before
            # asking again (else the routing task spins).
            pending_request.routing_context.should_backoff = True
        key = pending_request.kwargs.get("affinity") if pending_request is not None else None
        if not isinstance(key, str) or len(candidate_replicas) == 1:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        home, *rest = sorted(candidate_replicas, key=lambda r: _weight(key, r), reverse=True)
        queue = self.replica_queue_len_cache
        home_len = queue.get(home.replica_id)
        rest_lens = [n for r in rest if (n := queue.get(r.replica_id)) is not None]
        if home_len is not None and rest_lens and home_len - min(rest_lens) > self.imbalanced_threshold:
            return [rest, [home]]  # the home replica is swamped: the cache is worth less than the wait
        return [[home], rest]
