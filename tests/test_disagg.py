"""Disaggregated prefill/decode (asyncpage.disagg): the pair gives one engine's output, frees its
blocks on both sides, speaks its wire protocol to a fake peer, and fails typed when a worker dies.
Each DisaggEngine starts two worker processes (~7 s with a tiny model). What a stranger on the wire
can and cannot do: tests/test_disagg_security.py."""

from __future__ import annotations

import asyncio
import os
import signal
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncpage import AsyncEngine, SamplingParams
from asyncpage.disagg import DisaggEngine, wire
from asyncpage.disagg import engine as disagg_engine
from asyncpage.disagg import messages as m
from asyncpage.disagg.engine import launch_worker
from asyncpage.disagg.transport import KVListener, new_secret
from asyncpage.errors import EngineDeadError, EngineNotRunningError, InvalidRequestError, PromptTooLongError

pytestmark = pytest.mark.asyncio

OPTS: dict[str, Any] = dict(dtype="float32", block_size=4, num_kv_blocks=256, debug_checks=True)
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def _prompts() -> list[Any]:
    shared = [0, *range(3, 43)]  # later prompts extend it: prefix-cache hits on the decode side
    return [[0, 5], shared[:6], shared[:18], shared, shared + list(range(50, 130)),
            "Paged attention keeps the KV cache", "def add(a, b):"]


@pytest.fixture(scope="module")
def pair(tiny_models: dict[str, tuple[Path, Any]]) -> Any:
    engine = DisaggEngine.from_pretrained(tiny_models["gemma3"][0], **OPTS)
    yield engine
    engine.close()


async def _idle(engine: DisaggEngine) -> dict[str, Any]:
    for _ in range(100):
        st = engine.stats()
        if all(s.kv_blocks_used == 0 and s.num_running == 0 for s in st.values()):
            break
        await asyncio.sleep(0.02)
    return engine.stats()


async def test_disagg_greedy_matches_single_engine(pair: DisaggEngine, tiny_models: Any) -> None:
    single = AsyncEngine.from_pretrained(tiny_models["gemma3"][0], **OPTS)
    prompts = _prompts()
    async with single, pair:
        ref = await asyncio.gather(*(single.generate(p, GREEDY) for p in prompts))
        got = await asyncio.gather(*(pair.generate(p, GREEDY) for p in prompts))
        for r, g in zip(ref, got, strict=True):
            assert (g.token_ids, g.text, g.finish_reason) == (r.token_ids, r.text, r.finish_reason)
            assert g.prompt_token_ids == r.prompt_token_ids
        # Seeded sampling, a stop string, logprobs: as one engine too.
        for params in (SamplingParams(max_tokens=12, temperature=0.9, seed=3, ignore_eos=True),
                       SamplingParams(max_tokens=30, temperature=0, stop=(r.text[3:6],)),
                       SamplingParams(max_tokens=5, temperature=0, logprobs=2, ignore_eos=True)):
            r, g = await single.generate(prompts[3], params), await pair.generate(prompts[3], params)
            assert (g.token_ids, g.text, g.finish_reason) == (r.token_ids, r.text, r.finish_reason)
            assert [lp.token_id for lp in g.choices[0].logprobs or []] == \
                   [lp.token_id for lp in r.choices[0].logprobs or []]
        xfer = pair.transfer_stats()
        assert xfer["skipped_blocks"] > 0 and xfer["bytes"] > 0  # prefixes held by the decode side not resent
        st = await _idle(pair)
        assert st["prefill"].kv_blocks_used == 0 and st["decode"].kv_blocks_used == 0


@pytest.mark.parametrize("kv", ["int8", "fp8"])
async def test_a_pair_with_a_quantized_kv_pool_matches_a_single_engine(tiny_models: Any, kv: str) -> None:
    """The payload carries one-byte values and their scales; fp8 rows are copied as bytes (the CPU
    has no float8 index_copy_)."""
    opts = {**OPTS, "kv_cache_dtype": kv}
    single = AsyncEngine.from_pretrained(tiny_models["gemma3"][0], **opts)
    pair = DisaggEngine.from_pretrained(tiny_models["gemma3"][0], **opts)
    prompts = _prompts()
    try:
        async with single, pair:
            ref = await asyncio.gather(*(single.generate(p, GREEDY) for p in prompts))
            got = await asyncio.gather(*(pair.generate(p, GREEDY) for p in prompts))
            assert [g.token_ids for g in got] == [r.token_ids for r in ref]
            assert pair.healthy and pair.transfer_stats()["bytes"] > 0
    finally:
        pair.close()


async def test_cancelled_streams_free_blocks_on_both_sides(pair: DisaggEngine) -> None:
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
        counts = await asyncio.gather(*(consume(i) for i in range(20)))
        # Cancelled while queued or mid-transfer: tasks cancelled outright.
        tasks = [asyncio.create_task(consume(2 * i)) for i in range(6)]
        await asyncio.sleep(0.05)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        st = pair.stats()  # aclose() waited for both workers' acknowledgements
        assert st["prefill"].kv_blocks_used == 0 and st["decode"].kv_blocks_used == 0, st
        assert st["decode"].num_running == 0 and st["prefill"].num_running == 0
    assert all(c == 40 for c in counts[0::2]) and all(3 <= c < 200 for c in counts[1::2])


async def test_refuses_what_it_does_not_run(pair: DisaggEngine) -> None:
    async with pair:
        with pytest.raises(InvalidRequestError, match=r"^n:"):
            await pair.generate("x", SamplingParams(n=2))
        with pytest.raises(InvalidRequestError, match=r"^json_schema:"):
            await pair.generate("x", SamplingParams(json_schema={"type": "object"}))
        with pytest.raises(PromptTooLongError):  # refused by the prefill worker, typed across the pipe
            await pair.generate([3 + i % 300 for i in range(600)], GREEDY)
        with pytest.raises(InvalidRequestError, match=r"^prompt:"):
            await pair.generate("", GREEDY)
        with pytest.raises(InvalidRequestError, match=r"^prompt:"):  # a frame the worker could not decode
            await pair.generate([3, "x"], GREEDY)
        assert (await pair.generate("ok", GREEDY)).finish_reason == "length"  # still serving


async def test_wire_protocol_with_a_fake_prefill_peer(tiny_models: Any) -> None:
    """The test process plays the prefill worker: a real decode worker must answer each header with
    the blocks it holds, take a payload into its pool and emit the first token it was given; a header
    frame past the limit ends the pair (typed, at once) rather than being read."""
    secret, listener = new_secret(), KVListener()
    proc, chan = launch_worker("decode", tiny_models["llama"][0], OPTS, secret=secret)
    loop = asyncio.get_running_loop()
    tr = None
    try:
        chan.send(m.Connect(listener.address))
        tr = await loop.run_in_executor(None, listener.accept, secret, 60.0)
        layout = (await loop.run_in_executor(None, _recv_kind, chan, m.Ready)).layout
        rows = [[torch.randn(8, *row.shape).to(getattr(torch, row.dtype.split(".")[1])) for row in layer]
                for layer in layout.rows]  # a fake pool of 8 blocks with the decode side's layout
        caches = [tuple(layer) for layer in rows]
        prompt = [0, *range(3, 13)]  # 11 tokens: 3 blocks of 4
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

        def transfer(rid: int, block_bytes: int) -> int:
            assert tr is not None
            wire.send_header(tr, wire.Header(rid, prompt, 42, None, params, 3, block_bytes))
            skip = wire.recv_reply(tr)
            if skip != wire.DROP:
                wire.send_blocks(tr, caches, [5, 1, 6][skip:])
            return skip

        assert await loop.run_in_executor(None, transfer, 1, layout.block_bytes) == 0
        first = await loop.run_in_executor(None, _recv_kind, chan, m.Chunk)
        assert first.rid == 1 and first.chunk.token_ids[:1] == [42]  # the token it was handed comes first
        # The same prompt again: its two full blocks are held (prefix cache); only the last is sent.
        assert await loop.run_in_executor(None, transfer, 2, layout.block_bytes) == 2
        # A layout mismatch (that request fails, typed), and a request aborted before its KV arrived: dropped.
        assert await loop.run_in_executor(None, transfer, 3, layout.block_bytes + 4) == wire.DROP
        refused = await loop.run_in_executor(None, _recv_kind, chan, m.Error)
        assert refused.rid == 3 and refused.error.name == "RequestFailedError"
        chan.send(m.Abort(4))
        assert (await loop.run_in_executor(None, _recv_kind, chan, m.Released)).rid == 4
        assert await loop.run_in_executor(None, transfer, 4, layout.block_bytes) == wire.DROP
        # A later payload still lands where the block tables say (pack/unpack keep rows in table order).
        mirror = [tuple(torch.zeros_like(t) for t in layer) for layer in caches]
        wire.unpack_blocks(mirror, [2, 0], wire.pack_blocks(caches, [6, 5]))
        assert all(torch.equal(got[2], t[6]) and torch.equal(got[0], t[5])
                   for lm, lt in zip(mirror, caches, strict=True) for got, t in zip(lm, lt, strict=True))
        # A header announcing 4 GiB: refused unread, and the worker says so and exits.
        tr.sock.sendall(struct.pack("!I", 0xFFFF_FFFF))
        failed = await loop.run_in_executor(None, _recv_kind, chan, m.Failed)
        assert failed.error.name == "EngineDeadError" and "past the limit" in failed.error.args[0]
        assert await loop.run_in_executor(None, proc.wait, 20) == 1
    finally:
        try:
            chan.send(m.Shutdown())
        except OSError:
            pass
        proc.wait(timeout=20)
        listener.close()
        if tr is not None:
            tr.close()


def _recv_kind(chan: m.Channel, kind: type[Any]) -> Any:
    while True:
        msg = chan.recv()
        if isinstance(msg, kind):
            return msg


@pytest.mark.parametrize("role", ["decode", "prefill"])
async def test_killed_worker_fails_requests_with_a_typed_error(tiny_models: Any, role: str) -> None:
    engine = DisaggEngine.from_pretrained(tiny_models["llama"][0], **OPTS)
    try:
        async with engine:
            long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
            streams = [engine.stream([0, 3 + i, 4], long) for i in range(3)]
            for s in streams:
                await s.__anext__()  # decoding on the decode worker
            os.kill(engine._procs[role].pid, signal.SIGKILL)
            if role == "decode":
                for s in streams:
                    with pytest.raises(EngineDeadError):
                        async for _ in s:
                            pass
            else:  # requests already decoding finish; the dead prefill side refuses new ones
                for s in streams:
                    async for _ in s:
                        pass
            for _ in range(100):
                if not engine.healthy:
                    break
                await asyncio.sleep(0.05)
            with pytest.raises(EngineDeadError, match=role):
                await engine.generate("hello", GREEDY)
    finally:
        engine.close()


# Run as the decode worker (`python -c`): its 3rd KV receive lands, then cannot be written.
_BREAK_THIRD_RECEIVE = """
import runpy
from asyncpage.disagg import wire
real, calls = wire.recv_blocks, []
def recv_blocks(*args):
    calls.append(1)
    n = real(*args)
    if len(calls) == 3:
        raise RuntimeError("injected: the received KV cannot be written")
    return n
wire.recv_blocks = recv_blocks
runpy.run_module("asyncpage.disagg.worker", run_name="__main__")
"""


def _workers_run(monkeypatch: pytest.MonkeyPatch, script: str) -> None:
    """The pair's worker processes start as `python -c script` (which runs the worker module itself)."""
    real_popen = subprocess.Popen

    def popen(args: list[str], **kwargs: Any) -> Any:
        if args[1:3] == ["-m", "asyncpage.disagg.worker"]:
            args = [args[0], "-c", script, *args[3:]]
        return real_popen(args, **kwargs)

    monkeypatch.setattr(disagg_engine.subprocess, "Popen", popen)


async def test_a_broken_kv_receive_fails_the_pair_promptly_with_engine_dead(
        tiny_models: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A receive that breaks leaves the two sides out of step: requests in flight and new ones fail
    typed at once, rather than the next transfer blocking until gloo's 600 s timeout."""
    _workers_run(monkeypatch, _BREAK_THIRD_RECEIVE)
    engine = DisaggEngine.from_pretrained(tiny_models["llama"][0], **OPTS)

    async def drain(s: Any) -> None:
        async for _ in s:
            pass

    try:
        async with engine:
            long = SamplingParams(max_tokens=450, temperature=0, ignore_eos=True)
            decoding = [engine.stream([0, 3 + i, 4], long) for i in range(2)]
            for s in decoding:
                await s.__anext__()  # received and decoding
            broken = engine.stream([0, 9, 8, 7], GREEDY)
            tasks = [asyncio.create_task(drain(s)) for s in [broken, *decoding]]  # submitted at the first step
            for t in tasks:
                with pytest.raises(EngineDeadError):
                    await asyncio.wait_for(t, 30)
            assert not engine.healthy
            with pytest.raises(EngineDeadError, match="decode"):
                await asyncio.wait_for(engine.generate("hello", GREEDY), 30)
            for _ in range(100):  # the prefill side pins nothing
                if engine.stats()["prefill"].kv_blocks_used == 0:
                    break
                await asyncio.sleep(0.05)
            assert engine.stats()["prefill"].kv_blocks_used == 0
    finally:
        engine.close()


# Run as the decode worker (`python -c`): its 3rd KV receive finds the connection gone (as when the
# prefill worker is killed mid-transfer).
_CONNECTION_LOST_ON_THIRD_RECEIVE = """
import runpy
from asyncpage.disagg import transport, wire
real, calls = wire.recv_blocks, []
def recv_blocks(*args):
    calls.append(1)
    if len(calls) == 3:
        raise transport.TransportError("injected: the peer closed the KV connection")
    return real(*args)
wire.recv_blocks = recv_blocks
runpy.run_module("asyncpage.disagg.worker", run_name="__main__")
"""


async def test_a_kv_connection_lost_mid_transfer_fails_that_request_and_spares_those_decoding(
        tiny_models: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill worker killed while it sends a request's KV: the decode worker used to die with it,
    failing every request already decoding there. Now only the one in transfer fails (typed), the
    decoding ones finish, new ones are refused typed, and neither pool holds a block."""
    _workers_run(monkeypatch, _CONNECTION_LOST_ON_THIRD_RECEIVE)
    engine = DisaggEngine.from_pretrained(tiny_models["llama"][0], **OPTS)

    async def drain(s: Any) -> int:
        n = 0
        async for chunk in s:
            n += len(chunk.token_ids)
        return n

    try:
        async with engine:
            long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
            decoding = [engine.stream([0, 3 + i, 4], long) for i in range(2)]
            first = [len((await s.__anext__()).token_ids) for s in decoding]  # received and decoding
            with pytest.raises(EngineDeadError, match="KV transfer failed"):
                await asyncio.wait_for(drain(engine.stream([0, 9, 8, 7], GREEDY)), 30)
            rest = await asyncio.wait_for(asyncio.gather(*(drain(s) for s in decoding)), 60)
            # Every token of both (a chunk may carry more than one when its reader is behind).
            assert [a + b for a, b in zip(first, rest, strict=True)] == [200, 200]
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(engine.generate([0, 5, 6], GREEDY), 30)
            for _ in range(100):
                st = engine.stats()
                if st["prefill"].kv_blocks_used == 0 and st["decode"].kv_blocks_used == 0:
                    break
                await asyncio.sleep(0.05)
            assert st["prefill"].kv_blocks_used == 0 and st["decode"].kv_blocks_used == 0, st
    finally:
        engine.close()


async def test_requests_fail_at_once_when_both_workers_die_one_after_the_other(tiny_models: Any) -> None:
    """Waiting on the prefill worker when it dies, then the decode worker dies too before it has
    acknowledged their abort: each stream's close used to wait out RELEASE_TIMEOUT_S (both workers
    were gone, yet the request was never let go)."""
    engine = DisaggEngine.from_pretrained(tiny_models["llama"][0], **OPTS)

    async def run(i: int) -> float:
        with pytest.raises(EngineDeadError):
            async with engine.stream([0, *range(3, 20 + i)], GREEDY) as s:
                async for _ in s:
                    pass
        return asyncio.get_running_loop().time()

    try:
        async with engine:
            for role in ("prefill", "decode"):  # neither answers: the requests wait on the prefill side
                os.kill(engine._procs[role].pid, signal.SIGSTOP)
            tasks = [asyncio.create_task(run(i)) for i in range(4)]
            await asyncio.sleep(0.3)  # submitted
            killed = asyncio.get_running_loop().time()
            for role in ("prefill", "decode"):
                os.kill(engine._procs[role].pid, signal.SIGKILL)
                for _ in range(500):
                    if role in engine._dead:
                        break
                    await asyncio.sleep(0.01)
            ended = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            assert max(ended) - killed < 3, [t - killed for t in ended]
    finally:
        engine.close()


@pytest.mark.heavy  # ~60 s: two default-model workers and a single engine; `make test-heavy`
async def test_default_model_pair_matches_single_engine_on_nine_prompts(default_engine: AsyncEngine) -> None:
    """The acceptance check: 9 prompts of mixed lengths, one of 709 tokens (past the 512 sliding window)."""
    text = " ".join(f"Item {i}: the block table maps logical position {i} to a physical block." for i in range(200))
    long = (await default_engine.tokenize(text))[:709]
    prompts: list[Any] = ["Hello", "The capital of France is", "def fib(n):", "1, 2, 3, 4,", long[:40],
                          long[:130], long[:300], long[:517], long]
    assert len(long) == 709
    params = SamplingParams(max_tokens=8, temperature=0)
    ref = [await default_engine.generate(p, params) for p in prompts]
    # The default_engine fixture's weights (dequantized float32), so the two sides run the same arithmetic.
    pair = DisaggEngine.from_pretrained(dtype="float32", max_num_batched_tokens=256, quantization=None)
    try:
        async with pair:
            got = await asyncio.gather(*(pair.generate(p, params) for p in prompts))
    finally:
        pair.close()
    assert [g.token_ids for g in got] == [r.token_ids for r in ref]
    assert [g.text for g in got] == [r.text for r in ref]


async def test_a_stream_cancelled_while_the_prefill_worker_is_busy_is_released_at_once(pair: DisaggEngine) -> None:
    """Cancelled while still queued in the prefill worker's engine: both sides acknowledge it (the
    caller's cancellation used to wait out the 10 s release timeout)."""
    async def victim() -> None:
        async with pair.stream([0, 5, 6], GREEDY) as s:
            async for _ in s:
                pass

    async with pair:
        busy = [asyncio.create_task(pair.generate([0] + [3 + i % 300 for i in range(90)], GREEDY)) for _ in range(4)]
        await asyncio.sleep(0.05)
        loop = asyncio.get_running_loop()
        for _ in range(10):
            task = asyncio.create_task(victim())
            await asyncio.sleep(0)  # it submits
            t0 = loop.time()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert loop.time() - t0 < 2.0
        await asyncio.gather(*busy)
        assert not pair._requests


async def test_both_pools_are_empty_when_generate_returns(pair: DisaggEngine) -> None:
    """generate() returns once both workers have let go: the prefill side's pinned blocks included,
    even when the decode side (max_tokens=1: done at admission) answers first."""
    async with pair:
        for i in range(10):
            await pair.generate([0] + [3 + (i * 13 + k) % 300 for k in range(80)],
                                SamplingParams(max_tokens=1, temperature=0))
            st = pair.stats()
            assert st["prefill"].kv_blocks_used == 0 and st["decode"].kv_blocks_used == 0, st


async def test_leaving_and_closing_fail_what_is_left_with_engine_not_running(tiny_models: Any) -> None:
    long = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    pair = DisaggEngine.from_pretrained(tiny_models["gemma3"][0], **OPTS)
    try:
        async with pair:
            held = pair.stream([0, *range(3, 30)], long)
            await held.__anext__()
        with pytest.raises(EngineNotRunningError):  # a stream held past `async with`, as AsyncEngine's
            async for _ in held:
                pass
        async with pair:
            assert (await pair.generate([0, 5, 6], GREEDY)).finish_reason == "length"
            pair.close()
            with pytest.raises(EngineNotRunningError):  # closed on purpose: not a dead worker
                await pair.generate([0, 5], GREEDY)
    finally:
        pair.close()
