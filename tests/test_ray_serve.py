"""Serving on a local Ray cluster of two 1-CPU nodes (ray.cluster_utils.Cluster, real raylets and worker
processes): asyncpage.ray.serve_app's two engine replicas behind Ray Serve's HTTP proxy, reached with the
official openai client. Each replica names itself in system_fingerprint."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from ray.cluster_utils import Cluster  # noqa: E402

import asyncpage.ray  # noqa: E402

from .conftest import build_tiny  # noqa: E402

pytestmark = pytest.mark.heavy

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
ENGINE = {"dtype": "float32", "block_size": 4, "num_kv_blocks": 1024, "max_num_seqs": 32,
          "chat_template": TEMPLATE}
APP = "asyncpage"
SYSTEM = ("You answer questions about the quick brown fox and the lazy dog, in the words of the corpus, "
          "briefly and plainly. ") * 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Two 1-CPU nodes, the app on them (one engine replica each), and its base URL."""
    model = tmp_path_factory.mktemp("tiny") / "llama"
    build_tiny("llama", model)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False)
        port = _free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(asyncpage.ray.serve_app(num_replicas=2, engine_options={"model": str(model), **ENGINE}),
                  name=APP, route_prefix="/")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()


def _client(base_url: str, **kwargs: Any) -> Any:
    return openai.AsyncOpenAI(base_url=base_url, api_key="none", timeout=120, **kwargs)


def _running_replicas() -> int:
    status = serve.status().applications[APP].deployments[f"{APP}-engine"]
    return int(status.replica_states.get("RUNNING", 0))


async def test_32_concurrent_chats_all_answer_and_both_replicas_serve(served: str) -> None:
    client = _client(served)
    replies = await asyncio.gather(*[
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"fox number {i}"}],
                                       max_tokens=8, temperature=0) for i in range(32)])
    assert all(r.choices[0].message.content is not None and r.usage.completion_tokens > 0 for r in replies)
    served_by = {r.system_fingerprint for r in replies}
    assert len(served_by) == 2, served_by
    assert all(f.startswith("asyncpage-") for f in served_by)


async def test_six_turns_of_one_prompt_cache_key_stay_on_one_replica_and_hit_its_cache(served: str) -> None:
    client = _client(served)
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    turns: list[tuple[str, int, int]] = []
    for turn in range(6):
        messages.append({"role": "user", "content": f"and {turn}?"})
        r = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                                 prompt_cache_key="conversation-1")
        assert r.usage.prompt_tokens_details is not None
        turns.append((r.system_fingerprint or "", r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
        messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
    print("turn, replica, prompt tokens, cached:", [(i + 1, *t) for i, t in enumerate(turns)])
    assert len({f for f, _, _ in turns}) == 1, turns
    assert all(cached >= 0.8 * prompt for _, prompt, cached in turns[1:]), turns


def _replica_pids() -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                title = Path(f"/proc/{d}/cmdline").read_bytes()
            except OSError:
                continue
            if b"ServeReplica:" + APP.encode() + b":" + APP.encode() + b"-engine" in title:
                pids.append(int(d))
    return sorted(pids)


async def test_a_killed_replica_fails_its_requests_retryably_and_serve_replaces_it(served: str) -> None:
    sent: list[str] = []
    statuses: list[int] = []

    async def on_request(request: Any) -> None:
        sent.append(str(request.url))

    async def on_response(response: Any) -> None:
        statuses.append(response.status_code)

    # The client's default retries (2), on 502/503/504 and lost connections; the hooks only record.
    client = _client(served, http_client=openai.DefaultAsyncHttpxClient(
        event_hooks={"request": [on_request], "response": [on_response]}))
    pids = _replica_pids()
    assert len(pids) == 2, pids
    calls = [asyncio.ensure_future(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": f"a long story about fox {i}"}], max_tokens=400,
        temperature=0, extra_body={"ignore_eos": True})) for i in range(16)]
    while len(sent) < 16:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # the 16 reach the replicas and generate (400 tokens each)
    os.kill(pids[0], signal.SIGKILL)
    replies = await asyncio.gather(*calls)
    assert all(r.usage.completion_tokens == 400 for r in replies), [r.usage for r in replies]
    # The killed replica's requests came back as 503s and were retried; nothing else failed.
    print("statuses:", sorted(statuses), "replicas:", sorted({r.system_fingerprint for r in replies}))
    assert 503 in statuses and set(statuses) <= {200, 503}, statuses
    # Serve's status still counts the killed replica RUNNING until its health check notices (~10 s),
    # and the killed pid is gone at once: wait for a new replica process, then two RUNNING.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (_running_replicas() == 2 and len(now := _replica_pids()) == 2
                                               and pids[0] not in now):
        await asyncio.sleep(0.5)
    now = _replica_pids()
    assert _running_replicas() == 2 and len(now) == 2 and pids[0] not in now and pids[1] in now, (pids, now)
    again = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "fox"}],
                                                 max_tokens=4)
    assert again.choices[0].message.content is not None
