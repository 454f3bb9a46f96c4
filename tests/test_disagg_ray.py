"""DisaggEngine's two workers as Ray actors on a local Ray cluster of two 1-CPU nodes
(ray.cluster_utils.Cluster: real raylets and worker processes), placed by custom resources: the
prefill worker on the node with {"node_a": 1}, the decode worker on the one with {"node_b": 1}, the
KV crossing between them over TCP. The same guarantees as the two-process form (tests/test_disagg.py):
one engine's greedy tokens, prefix hits on the decode side not sent again, both pools empty after
cancelled streams, a killed worker failing its requests typed instead of hanging."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from asyncpage import AsyncEngine, SamplingParams  # noqa: E402
from asyncpage.disagg import DisaggEngine  # noqa: E402
from asyncpage.errors import EngineDeadError, InvalidRequestError  # noqa: E402

pytestmark = pytest.mark.heavy

OPTS: dict[str, Any] = dict(dtype="float32", block_size=4, num_kv_blocks=256, debug_checks=True)
# start_timeout bounds a placement that cannot happen (both nodes' one CPU taken) to a failure, not a hang.
PLACED: dict[str, Any] = dict(prefill_resources={"node_a": 1}, decode_resources={"node_b": 1}, start_timeout=120)
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _prompts() -> list[Any]:
    """Nine prompts of mixed lengths; later ones extend earlier ones (prefix-cache hits on the decode side)."""
    shared = [0, *range(3, 43)]
    return [[0, 5], shared[:6], shared[:18], shared, shared + list(range(50, 130)),
            shared + list(range(50, 90)) + list(range(200, 260)), "Paged attention keeps the KV cache",
            "def add(a, b):", "The quick brown fox jumps over the lazy dog. " * 4]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Two 1-CPU nodes labelled node_a (the head) and node_b; Ray initialised here, as a caller would."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 1},
                                                      "include_dashboard": False})
    try:
        c.add_node(num_cpus=1, resources={"node_b": 1})
        c.wait_for_nodes()
        ray.init(address=c.address, log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def _node_ids(cluster: Cluster) -> dict[str, str]:
    head = cluster.head_node
    other = next(n for n in cluster.list_all_nodes() if n is not head)
    return {"node_a": head.node_id, "node_b": other.node_id}


@pytest.fixture(scope="module")
def pair(cluster: Cluster, tiny_models: dict[str, tuple[Path, Any]]) -> Iterator[DisaggEngine]:
    engine = DisaggEngine.from_pretrained(tiny_models["gemma3"][0], **OPTS, **PLACED)
    yield engine
    engine.close()


@pytest.fixture
def free_nodes(pair: DisaggEngine) -> None:
    """Each node has one CPU, which the shared pair's actors hold: a test starting its own pair closes it."""
    pair.close()


async def _idle(engine: DisaggEngine) -> dict[str, Any]:
    for _ in range(100):
        st = engine.stats()
        if all(s.kv_blocks_used == 0 and s.num_running == 0 for s in st.values()):
            break
        await asyncio.sleep(0.02)
    return engine.stats()


def test_each_worker_runs_on_the_node_its_resources_name(pair: DisaggEngine, cluster: Cluster) -> None:
    nodes = _node_ids(cluster)
    assert pair.nodes() == {"prefill": nodes["node_a"], "decode": nodes["node_b"]}
    pids = {role: pair._procs[role].pid for role in ("prefill", "decode")}
    assert len({os.getpid(), *pids.values()}) == 3, pids  # two actor processes, neither this one


async def test_greedy_tokens_across_nodes_match_a_single_engine(pair: DisaggEngine, tiny_models: Any) -> None:
    single = AsyncEngine.from_pretrained(tiny_models["gemma3"][0], **OPTS)
    prompts = _prompts()
    async with single, pair:
        ref = [await single.generate(p, GREEDY) for p in prompts]
        got = await asyncio.gather(*(pair.generate(p, GREEDY) for p in prompts))
        for r, g in zip(ref, got, strict=True):
            assert (g.token_ids, g.text, g.finish_reason) == (r.token_ids, r.text, r.finish_reason)
            assert g.prompt_token_ids == r.prompt_token_ids
        seeded = SamplingParams(max_tokens=12, temperature=0.9, seed=3, ignore_eos=True)
        r, g = await single.generate(prompts[3], seeded), await pair.generate(prompts[3], seeded)
        assert g.token_ids == r.token_ids
        # A prompt the decode side holds the start of: only the blocks it lacks cross the network.
        before = pair.transfer_stats()
        again = await pair.generate(prompts[4], GREEDY)
        after = pair.transfer_stats()
        assert again.token_ids == ref[4].token_ids
        assert after["skipped_blocks"] - before["skipped_blocks"] >= len(prompts[4]) // 4
        assert after["bytes"] > 0
        st = await _idle(pair)
        assert st["prefill"].kv_blocks_used == 0 and st["decode"].kv_blocks_used == 0, st


async def test_cancelled_streams_leave_both_pools_at_zero_blocks(pair: DisaggEngine) -> None:
    async def consume(i: int) -> int:
        prompt = [0] + [(7 * i + k) % 300 + 3 for k in range(20 + 9 * i)]
        n = 0
        params = SamplingParams(max_tokens=200 if i % 2 else 40, temperature=0, ignore_eos=True)
        async with pair.stream(prompt, params) as s:
            async for chunk in s:
                n += len(chunk.token_ids)
                if i % 2 and n >= 3:
                    break  # half of them leave mid-way
        return n

    async with pair:
        counts = await asyncio.gather(*(consume(i) for i in range(12)))
        tasks = [asyncio.create_task(consume(2 * i)) for i in range(6)]  # cancelled queued or mid-transfer
        await asyncio.sleep(0.05)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        st = pair.stats()  # aclose() waited for both workers' acknowledgements
        assert st["prefill"].kv_blocks_used == 0 and st["decode"].kv_blocks_used == 0, st
        assert st["prefill"].num_running == 0 and st["decode"].num_running == 0, st
    assert all(c == 40 for c in counts[0::2]) and all(3 <= c < 200 for c in counts[1::2])


def test_a_resource_no_node_has_is_refused_at_once(cluster: Cluster, tiny_models: Any) -> None:
    with pytest.raises(InvalidRequestError, match=r"^decode_resources: no node of the Ray cluster has node_c"):
        DisaggEngine.from_pretrained(tiny_models["gemma3"][0], prefill_resources={"node_a": 1},
                                     decode_resources={"node_c": 1}, start_timeout=120, **OPTS)
    with pytest.raises(InvalidRequestError, match=r"^kv_host:"):
        DisaggEngine.from_pretrained(tiny_models["gemma3"][0], kv_host="127.0.0.1", **PLACED, **OPTS)


@pytest.mark.parametrize("role, how", [("decode", "sigkill"), ("prefill", "ray.kill")])
async def test_a_killed_worker_actor_fails_its_requests_instead_of_hanging(
        cluster: Cluster, tiny_models: Any, free_nodes: None, role: str, how: str) -> None:
    engine = DisaggEngine.from_pretrained(tiny_models["llama"][0], **OPTS, **PLACED)

    async def drain(s: Any) -> None:
        async for _ in s:
            pass

    try:
        async with engine:
            long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
            streams = [engine.stream([0, 3 + i, 4], long) for i in range(3)]
            for s in streams:
                await s.__anext__()  # decoding on the decode actor
            worker = engine._procs[role]
            if how == "sigkill":
                os.kill(worker.pid, signal.SIGKILL)
            else:
                ray.kill(worker.handle, no_restart=True)
            if role == "decode":
                for s in streams:  # the wait_for only bounds a hang; the error is the check
                    with pytest.raises(EngineDeadError, match="decode"):
                        await asyncio.wait_for(drain(s), 60)
            else:  # requests already decoding finish; the dead prefill side refuses new ones
                for s in streams:
                    await asyncio.wait_for(drain(s), 120)
            for _ in range(200):
                if not engine.healthy:
                    break
                await asyncio.sleep(0.05)
            with pytest.raises(EngineDeadError, match=role):
                await asyncio.wait_for(engine.generate("hello", GREEDY), 60)
    finally:
        engine.close()


async def test_default_model_across_nodes_gives_the_nine_reference_prompts_transformers_tokens(
        cluster: Cluster, free_nodes: None, reference: dict[str, Any]) -> None:
    """The acceptance check on the real default model (float32): tests/data/gemma3_270m_reference.json's
    9 prompts, one of 709 tokens (past the 512 sliding window, prefilled in chunks of 256)."""
    cases = reference["cases"]
    assert len(cases) == 9
    prompts = [c["prompt"] if c["prompt"] is not None else c["prompt_token_ids"] for c in cases]
    params = SamplingParams(max_tokens=reference["new_tokens"], temperature=0, ignore_eos=True)
    # quantization=None: the float32 weights the reference was made with (the default keeps the GGUF's blocks).
    engine = DisaggEngine.from_pretrained(dtype="float32", max_num_batched_tokens=256, quantization=None, **PLACED)
    try:
        async with engine:
            got = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
            st = await _idle(engine)
    finally:
        engine.close()
    assert [g.prompt_token_ids for g in got] == [c["prompt_token_ids"] for c in cases]
    assert [g.token_ids for g in got] == [c["greedy_token_ids"] for c in cases]
    assert st["prefill"].kv_blocks_used == 0 and st["decode"].kv_blocks_used == 0, st


async def test_connects_to_ray_address_when_the_caller_has_not_initialised_ray(
        cluster: Cluster, tiny_models: Any, free_nodes: None) -> None:
    ray.shutdown()
    engine = DisaggEngine.from_pretrained(tiny_models["llama"][0], ray_address=cluster.address, **OPTS, **PLACED)
    try:
        assert ray.is_initialized()
        nodes = _node_ids(cluster)
        assert engine.nodes() == {"prefill": nodes["node_a"], "decode": nodes["node_b"]}
        single = AsyncEngine.from_pretrained(tiny_models["llama"][0], **OPTS)
        async with single, engine:
            prompt = [0, *range(3, 30)]
            got, ref = await engine.generate(prompt, GREEDY), await single.generate(prompt, GREEDY)
            assert got.token_ids == ref.token_ids
    finally:
        engine.close()
