"""The prefix-cache hit rate that asyncpage.ray's CacheAffinityRouter buys over Ray Serve's default router:
the same multi-turn conversations (each turn's messages are the previous turns' plus one, every request
carrying its conversation's `prompt_cache_key`) sent to `serve_app(num_replicas=2)` on a local Ray cluster
of two 1-CPU nodes, once per router; prints prefix-cache hit tokens / prompt tokens for each (from the
usage's `prompt_tokens_details.cached_tokens`), overall and per turn, and how many conversations stayed
on one replica.

    .venv/bin/python scripts/router_hit_rate.py                      # tiny random model, 8 x 6 turns
    .venv/bin/python scripts/router_hit_rate.py --conversations 16 --concurrency 8 --model /path/to/hf-dir

The cluster is started here and shut down at the end (nothing left running). The tiny model is the
tests' (tests/conftest.py build_tiny): the routing, not the model, decides what is cached.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TOPICS = ["the quick brown fox", "paged attention", "continuous batching", "the lazy dog", "block tables",
          "numbers and lists", "adding two values", "a small JSON record"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _system(i: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    return f"Conversation {i}. You answer questions about {topic}, briefly and plainly."


async def _conversation(client: Any, i: int, turns: int, max_tokens: int) -> list[tuple[str, int, int]]:
    """(replica, prompt tokens, cached tokens) of each turn."""
    messages: list[dict[str, str]] = [{"role": "system", "content": _system(i)}]
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"and {turn + 1}?"})
        r = await client.chat.completions.create(
            model="asyncpage", messages=messages, max_tokens=max_tokens, temperature=0,
            prompt_cache_key=f"conversation-{i}", extra_body={"ignore_eos": True})
        details = r.usage.prompt_tokens_details
        out.append((r.system_fingerprint or "", r.usage.prompt_tokens, details.cached_tokens if details else 0))
        messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
    return out


async def _measure(base_url: str, conversations: int, concurrency: int, turns: int,
                   max_tokens: int) -> list[list[tuple[str, int, int]]]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", timeout=600, max_retries=0)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> list[tuple[str, int, int]]:
        async with gate:
            return await _conversation(client, i, turns, max_tokens)

    return list(await asyncio.gather(*(one(i) for i in range(conversations))))


def _report(name: str, runs: list[list[tuple[str, int, int]]], seconds: float) -> dict[str, float]:
    prompt = sum(p for conv in runs for _, p, _ in conv)
    cached = sum(c for conv in runs for _, _, c in conv)
    later_p = sum(p for conv in runs for _, p, _ in conv[1:])
    later_c = sum(c for conv in runs for _, _, c in conv[1:])
    one_replica = sum(1 for conv in runs if len({f for f, _, _ in conv}) == 1)
    per_turn: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for conv in runs:
        for t, (_, p, c) in enumerate(conv):
            per_turn[t + 1][0] += c
            per_turn[t + 1][1] += p
    replicas: dict[str, int] = defaultdict(int)
    for conv in runs:
        for f, _, _ in conv:
            replicas[f] += 1
    print(f"\n{name}: {len(runs)} conversations x {len(runs[0])} turns in {seconds:.1f} s")
    print(f"  hit tokens / prompt tokens, all turns: {cached}/{prompt} = {cached / prompt:.1%}")
    print(f"  turns 2-{len(runs[0])}:                       {later_c}/{later_p} = {later_c / later_p:.1%}")
    print("  per turn: " + ", ".join(f"{t}: {c}/{p} ({c / p:.0%})" for t, (c, p) in sorted(per_turn.items())))
    print(f"  conversations served by one replica: {one_replica}/{len(runs)}; requests per replica: "
          f"{sorted(replicas.values())}")
    return {"all": cached / prompt, "later": later_c / later_p, "one_replica": one_replica}


def _wait_for_free_cpus(ray: Any, n: float, timeout: float = 120.0) -> None:
    """Until the deleted app's replicas have given their CPUs back (the next app's need them)."""
    deadline = time.monotonic() + timeout
    while ray.available_resources().get("CPU", 0) < n and time.monotonic() < deadline:
        time.sleep(0.5)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="an HF directory (default: the tests' tiny random llama)")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8, help="conversations in flight at once")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    a = p.parse_args()

    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    import asyncpage.ray

    tmp = tempfile.TemporaryDirectory(prefix="asyncpage-router-")
    model = a.model
    if model is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.conftest import build_tiny

        model = str(Path(tmp.name) / "llama")
        build_tiny("llama", Path(model))
    engine = {"model": model, "dtype": "float32", "block_size": a.block_size, "max_num_seqs": 32,
              "chat_template": TEMPLATE}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    results: dict[str, dict[str, float]] = {}
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        port = _free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        for name, affinity in (("CacheAffinityRouter", True), ("Serve's default router", False)):
            app = f"router-{int(affinity)}"
            try:
                serve.run(asyncpage.ray.serve_app(num_replicas=2, engine_options=engine, cache_routing=affinity,
                                                  name=app), name=app, route_prefix="/")
            except RuntimeError:
                print(serve.status().applications.get(app), file=sys.stderr)
                raise
            t0 = time.perf_counter()
            runs = asyncio.run(_measure(f"http://127.0.0.1:{port}/v1", a.conversations, a.concurrency, a.turns,
                                        a.max_tokens))
            results[name] = _report(name, runs, time.perf_counter() - t0)
            serve.delete(app)  # the next router starts on fresh replicas: empty caches
            _wait_for_free_cpus(ray, 2)
    finally:
        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()
            tmp.cleanup()
    aff, dflt = results["CacheAffinityRouter"], results["Serve's default router"]
    print(f"\nhit rate, all turns: affinity {aff['all']:.1%} vs default {dflt['all']:.1%}; "
          f"turns 2+: {aff['later']:.1%} vs {dflt['later']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
