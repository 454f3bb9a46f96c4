"""A worker process of a disaggregated pair: one AsyncEngine (prefill or decode role) on its own
asyncio loop, driven by control messages from the front end's pipe (messages.py), with one
transfer thread moving KV blocks over torch.distributed (wire.py).

Threads in a worker: the event loop (the engine loop, message handling, per-request tasks), the
engine's compute thread, a pipe reader, and the transfer thread (sender on prefill, receiver on
decode). The transfer threads touch engine state only through `call_soon_threadsafe`; they read and
write the KV tensors of blocks no step uses (pinned on prefill, allocated but not yet running on
decode). A worker whose engine loop dies exits, so the front end sees it as a dead worker; so does
a decode worker whose receive breaks (the pair can no longer hand KV over).
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NoReturn, cast

import msgspec

from asyncpage.engine import AsyncEngine
from asyncpage.errors import AsyncPageError, EngineDeadError
from asyncpage.kv_cache import BlockTable
from asyncpage.outputs import TokenLogprob
from asyncpage.params import SamplingParams
from asyncpage.request import Request
from asyncpage.validation import check_request

from . import wire
from .cores import DecodeCore, DecodeEngine, PrefillCore, PrefillEngine
from .messages import encode_error

log = logging.getLogger("asyncpage.disagg")


def main(role: str, conn: Any, model: Any, options: dict[str, Any], port: int, cpus: list[int] | None) -> None:
    """A worker's life: load, join the transfer group, serve until told to stop (or orphaned)."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        engine = (PrefillEngine if role == "prefill" else DecodeEngine).from_pretrained(model, **options)
        import torch.distributed as dist

        # A group of the two workers only: the KV never passes through the front end, and keeping it
        # out of the group means a crashed worker can never leave the front end blocked in gloo.
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2,
                                rank=wire.PREFILL_RANK if role == "prefill" else wire.DECODE_RANK,
                                timeout=timedelta(seconds=600))
    except BaseException as exc:
        conn.send(("failed", encode_error(exc)))
        os._exit(1)
    worker: Worker = PrefillWorker(engine, conn) if role == "prefill" else DecodeWorker(engine, conn)
    conn.send(("ready", {"layout": wire.describe(engine._core.runner.caches), "stats": engine.stats(),
                         "max_model_len": engine.config.max_model_len}))
    try:
        asyncio.run(worker.serve())
    finally:
        os._exit(0)  # the transfer thread may sit in a gloo recv: do not wait for it


class Worker(abc.ABC):
    def __init__(self, engine: AsyncEngine, conn: Any) -> None:
        self.engine = engine
        self.conn = conn
        self.caches = engine._core.runner.caches
        self.transport: wire.Transport = wire.DistTransport(
            wire.DECODE_RANK if isinstance(self, PrefillWorker) else wire.PREFILL_RANK)
        self.xfer = {"bytes": 0, "seconds": 0.0, "blocks": 0, "skipped_blocks": 0, "transfers": 0}
        self._send_lock = threading.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Event | None = None

    def send(self, msg: tuple[Any, ...]) -> None:
        try:
            with self._send_lock:
                self.conn.send(msg)
        except OSError:
            os._exit(0)  # the front end is gone: nobody is left to serve

    def die(self, exc: BaseException) -> NoReturn:
        """Tell the front end this worker is dead (it fails what is in flight, typed) and exit."""
        try:
            # Held to the exit: no other thread's message is cut off half-sent after "failed".
            with self._send_lock:
                self.conn.send(("failed", encode_error(exc)))
        finally:
            os._exit(1)

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._done = asyncio.Event()
        async with self.engine:
            self.start()
            threading.Thread(target=self._read, name="asyncpage-disagg-pipe", daemon=True).start()
            self.spawn(self._push_stats())
            await self._done.wait()

    @abc.abstractmethod
    def start(self) -> None:
        """Called once the engine is open, before any message is read."""

    @abc.abstractmethod
    def handle(self, msg: tuple[Any, ...]) -> None:
        """One message from the front end (or the peer), on the worker's loop."""

    def _read(self) -> None:
        assert self.loop is not None
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                msg = ("shutdown",)  # the front end is gone
            self.loop.call_soon_threadsafe(self._dispatch, msg)
            if msg[0] == "shutdown":
                return

    def _dispatch(self, msg: tuple[Any, ...]) -> None:
        if msg[0] == "shutdown":
            assert self._done is not None
            self._done.set()
        else:
            self.handle(msg)

    async def _push_stats(self) -> None:
        """Publish the pool figures to the front end whenever they change (its stats() is a read)."""
        last: Any = None
        while True:
            if not self.engine.healthy:
                self.die(EngineDeadError(repr(self.engine._core.dead)))
            st = (self.engine.stats(), dict(self.xfer))
            if st != last:
                self.send(("stats", *st))
                last = st
            await asyncio.sleep(0.02)


# ---- prefill -------------------------------------------------------------------------------------
@dataclass(eq=False)
class Job:
    rid: int
    params: SamplingParams
    done: asyncio.Event = field(default_factory=asyncio.Event)  # this side holds nothing of it any more
    req: Request | None = None
    aborted: bool = False
    exporting: bool = False


class PrefillWorker(Worker):
    def start(self) -> None:
        self.core = cast(PrefillCore, self.engine._core)
        self.core.on_prefilled = self.on_prefilled
        self.jobs: dict[int, Job] = {}
        self.by_request: dict[int, Job] = {}
        self.outbox: queue.Queue[tuple[Job, wire.Header, BlockTable]] = queue.Queue()
        self.peer_dead: BaseException | None = None
        self.peer_limits: dict[str, int] = {"pool_tokens": 1 << 62, "max_model_len": 1 << 62}  # the decode side's
        threading.Thread(target=self._sender, name="asyncpage-disagg-send", daemon=True).start()

    def handle(self, msg: tuple[Any, ...]) -> None:
        if msg[0] == "submit":
            _, rid, prompt, params = msg
            job = self.jobs[rid] = Job(rid, params)
            self.spawn(self._run(job, prompt))
        elif msg[0] == "abort":
            self.spawn(self._abort(msg[1]))
        elif msg[0] == "limits":
            self.peer_limits = msg[1]

    async def _run(self, job: Job, prompt: Any) -> None:
        eng = self.engine
        try:
            ids = await eng.tokenize(prompt)
            # The caller's max_tokens counts against context and pool on both sides (the decode side
            # holds them to the end).
            own_pool = eng.config.num_kv_blocks * eng.config.block_size
            check_request(ids, job.params, vocab_size=eng.vocab_size,
                          max_model_len=min(eng.config.max_model_len, self.peer_limits["max_model_len"]),
                          pool_tokens=min(own_pool, self.peer_limits["pool_tokens"]),
                          max_num_seqs=eng.config.max_num_seqs)
            if job.aborted:
                return
            if self.peer_dead is not None:
                raise EngineDeadError("the decode worker is gone") from self.peer_dead
            req = job.req = await eng.submit(ids, msgspec.structs.replace(job.params, max_tokens=1))
            self.by_request[req.request_id] = job
            if job.aborted:
                eng.abort(req)
            while not any(c.finish_reason is not None for c in await req.mailbox.get()):
                pass
        except AsyncPageError as exc:
            if not job.aborted:
                self.send(("error", job.rid, encode_error(exc)))
        finally:
            if job.req is not None:
                await eng.wait_released(job.req)
                self.by_request.pop(job.req.request_id, None)
            if not job.exporting:
                self._finished(job)

    def on_prefilled(self, req: Request, token: int, logprob: TokenLogprob | None, pin: BlockTable) -> None:
        """PrefillCore: the prompt is computed; its pinned blocks go to the sender thread."""
        job = self.by_request.get(req.request_id)
        if job is None or job.aborted:
            self.core.release_pin(pin)
            return
        job.exporting = True
        header = wire.Header(job.rid, list(req.prompt_token_ids), token, logprob, job.params,
                             len(pin.blocks), wire.block_bytes(self.caches))
        self.outbox.put((job, header, pin))

    def _sender(self) -> None:
        """One transfer at a time, in prefill order (wire.py's protocol is strictly turn by turn)."""
        assert self.loop is not None
        while True:
            job, header, pin = self.outbox.get()
            try:
                if self.peer_dead is None and not job.aborted:
                    wire.send_header(self.transport, header)
                    skip = wire.recv_reply(self.transport)
                    if skip != wire.DROP:
                        t = time.perf_counter()
                        nbytes = wire.send_blocks(self.transport, self.caches, pin.ids[skip:])
                        self.xfer["seconds"] += time.perf_counter() - t
                        self.xfer["bytes"] += nbytes
                        self.xfer["blocks"] += len(pin.ids) - skip
                        self.xfer["skipped_blocks"] += skip
                        self.xfer["transfers"] += 1
                elif not job.aborted:
                    raise EngineDeadError("the decode worker is gone")
            except Exception as exc:
                if self.peer_dead is None:
                    log.error("KV transfer to the decode worker failed", exc_info=exc)
                    self.peer_dead = exc
                self.send(("error", job.rid, encode_error(EngineDeadError(f"KV transfer failed: {exc!r}"))))
            self.loop.call_soon_threadsafe(self._sent, job, pin)

    def _sent(self, job: Job, pin: BlockTable) -> None:
        self.core.release_pin(pin)
        self._finished(job)

    def _finished(self, job: Job) -> None:
        self.jobs.pop(job.rid, None)
        job.done.set()
        self.send(("stats", self.engine.stats(), dict(self.xfer)))  # the front end's stats() sees it now
        self.send(("released", job.rid, "prefill", self.engine.stats()))  # its blocks (and pin) are back

    async def _abort(self, rid: int) -> None:
        job = self.jobs.get(rid)
        if job is not None:
            job.aborted = True
            if job.req is not None and not job.exporting:
                self.engine.abort(job.req)
            await job.done.wait()
        self.send(("released", rid, "prefill", self.engine.stats()))


# ---- decode --------------------------------------------------------------------------------------
class DecodeWorker(Worker):
    MAX_REMEMBERED_ABORTS = 10_000

    def start(self) -> None:
        self.core = cast(DecodeCore, self.engine._core)
        self.live: dict[int, Request] = {}
        # Aborted before their KV arrived: dropped when it does (bounded; see messages.py).
        self.aborted: OrderedDict[int, None] = OrderedDict()
        threading.Thread(target=self._receiver, name="asyncpage-disagg-recv", daemon=True).start()

    def handle(self, msg: tuple[Any, ...]) -> None:
        if msg[0] == "abort":
            self.spawn(self._abort(msg[1]))

    def _receiver(self) -> None:
        assert self.loop is not None
        while True:
            try:
                header = wire.recv_header(self.transport)
            except Exception as exc:
                log.error("the prefill worker is gone; no more requests arrive", exc_info=exc)
                return
            reply: concurrent.futures.Future[tuple[int, list[int]] | None] = concurrent.futures.Future()
            box: concurrent.futures.Future[Request | None] = concurrent.futures.Future()
            self.loop.call_soon_threadsafe(self._on_header, header, reply, box)
            plan = reply.result()
            req = box.result()
            try:
                wire.send_reply(self.transport, wire.DROP if plan is None else plan[0])
                if plan is not None:
                    wire.recv_blocks(self.transport, self.caches, plan[1])
            except Exception as exc:
                # The two sides no longer agree where the stream is: the prefill side would block in
                # its next transfer until gloo's timeout, its blocks pinned. The pair is dead.
                log.error("KV transfer from the prefill worker failed", exc_info=exc)
                self.die(EngineDeadError(f"KV transfer failed: {exc!r}"))
            if plan is not None and req is not None:
                self.loop.call_soon_threadsafe(self.core.imported, req)

    def _on_header(self, header: wire.Header, reply: concurrent.futures.Future[Any],
                   box: concurrent.futures.Future[Request | None]) -> None:
        if header.rid in self.aborted or header.block_bytes != wire.block_bytes(self.caches):
            self.aborted.pop(header.rid, None)
            reply.set_result(None)
            box.set_result(None)
            return
        req = self.core.import_request(header, self.engine.eos_token_ids, reply)
        self.live[header.rid] = req
        box.set_result(req)
        self.spawn(self._forward(header.rid, req))

    async def _forward(self, rid: int, req: Request) -> None:
        try:
            while True:
                chunks = await req.mailbox.get()
                for c in chunks:
                    final = None
                    if c.finish_reason is not None:
                        final = {"prompt_token_ids": req.prompt_token_ids,
                                 "num_cached_prompt_tokens": req.num_cached_prompt_tokens,
                                 "stats": self.engine.stats()}  # blocks already freed: exact
                    self.send(("chunk", rid, c, final))
                if any(c.finish_reason is not None for c in chunks):
                    break
        except AsyncPageError as exc:
            self.send(("error", rid, encode_error(exc)))
        finally:
            await self.engine.wait_released(req)
            self.live.pop(rid, None)

    async def _abort(self, rid: int) -> None:
        req = self.live.get(rid)
        if req is None:
            self.aborted[rid] = None
            while len(self.aborted) > self.MAX_REMEMBERED_ABORTS:
                self.aborted.popitem(last=False)
        else:
            self.engine.abort(req)
            await self.engine.wait_released(req)
        self.send(("released", rid, "decode", self.engine.stats()))


if __name__ == "__main__":  # python -m asyncpage.disagg.worker FD (started by DisaggEngine.from_pretrained)
    import sys
    from multiprocessing.connection import Connection

    _conn = Connection(int(sys.argv[1]))
    _, _role, _model, _options, _port, _cpus = _conn.recv()
    main(_role, _conn, _model, _options, _port, _cpus)
