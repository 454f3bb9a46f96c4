"""A worker process of a disaggregated pair: one AsyncEngine (prefill or decode role) on its own
asyncio loop, driven by control messages from the front end's pipe (messages.py), with one
transfer thread moving KV blocks over the pair's authenticated socket (transport.py, wire.py).

Threads in a worker: the event loop (the engine loop, message handling, per-request tasks), the
engine's compute thread, a pipe reader, and the transfer thread (sender on prefill, receiver on
decode). The transfer threads touch engine state only through `call_soon_threadsafe`; they read and
write the KV tensors of blocks no step uses (pinned on prefill, allocated but not yet running on
decode). A worker whose engine loop dies exits, so the front end sees it as a dead worker; so does
a decode worker whose receive breaks (the pair can no longer hand KV over).

Start-up: the prefill worker binds its KV listener first (loopback or a private AF_UNIX path, see
transport.py) and says where (Listening); both load the model; the decode worker is told the address
(Connect), joins, and both prove they hold the secret the front end gave them in Init before any KV
frame is read. Then each says Ready.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn, cast

import msgspec

from asyncpage.core.request import Request
from asyncpage.core.validation import check_request
from asyncpage.engine import AsyncEngine
from asyncpage.errors import AsyncPageError, EngineDeadError, RequestFailedError
from asyncpage.kv.cache import BlockTable
from asyncpage.outputs import TokenLogprob
from asyncpage.params import SamplingParams

from . import messages as m
from . import wire
from .cores import DecodeCore, DecodeEngine, PrefillCore, PrefillEngine
from .messages import Channel, encode_error
from .transport import FrameError, KVListener, KVTransport, connect

log = logging.getLogger("asyncpage.disagg")


def main(chan: Channel, init: m.Init, stopped: Callable[[], object] | None = None) -> None:
    """A worker's life: load, join the KV pair, serve until told to stop (or orphaned). Then the
    process exits, or `stopped()` is called (a Ray actor ends itself through Ray: actors.py)."""
    listener: KVListener | None = None
    try:
        if init.cpus:
            os.sched_setaffinity(0, init.cpus)
        if init.role == "prefill":
            # Bound before the (slow) load, so the decode side can join as soon as it has loaded too.
            listener = KVListener(init.kv_host)
            chan.send(m.Listening(listener.address))
        engine = (PrefillEngine if init.role == "prefill" else DecodeEngine).from_pretrained(
            init.model, **init.options)
        if listener is not None:
            transport = listener.accept(init.secret, timeout=init.start_timeout, cancel=chan.sock)
        else:
            msg = chan.recv()
            if not isinstance(msg, m.Connect):
                os._exit(0)  # told to stop (or the front end is gone) before the pair was joined
            transport = connect(msg.address, init.secret, timeout=init.start_timeout)
    except BaseException as exc:
        if listener is not None:
            listener.close()
        with contextlib.suppress(OSError):  # the front end may be gone: nobody to tell
            chan.send(m.Failed(encode_error(exc)))
        os._exit(1)
    worker: Worker = (PrefillWorker if init.role == "prefill" else DecodeWorker)(engine, chan, transport)
    chan.send(m.Ready(wire.describe(engine._core.runner.caches), engine.stats(), engine.config.max_model_len))
    try:
        asyncio.run(worker.serve())
    finally:
        if stopped is not None:
            stopped()
        os._exit(0)  # the transfer thread may sit in a blocking receive: do not wait for it


class Worker(abc.ABC):
    def __init__(self, engine: AsyncEngine, chan: Channel, transport: KVTransport) -> None:
        self.engine = engine
        self.chan = chan
        self.caches = engine._core.runner.caches
        self.transport: wire.Transport = transport
        self.xfer: dict[str, int | float] = {"bytes": 0, "seconds": 0.0, "blocks": 0, "skipped_blocks": 0,
                                             "transfers": 0}
        self._send_lock = threading.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Event | None = None

    def send(self, msg: msgspec.Struct) -> None:
        try:
            with self._send_lock:
                self.chan.send(msg)
        except OSError:
            os._exit(0)  # the front end is gone: nobody is left to serve

    def die(self, exc: BaseException) -> NoReturn:
        """Tell the front end this worker is dead (it fails what is in flight, typed) and exit."""
        try:
            # Held to the exit: no other thread's message is cut off half-sent after "failed".
            with self._send_lock:
                self.chan.send(m.Failed(encode_error(exc)))
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
    def handle(self, msg: Any) -> None:
        """One message from the front end, on the worker's loop."""

    def _read(self) -> None:
        assert self.loop is not None
        while True:
            try:
                msg = self.chan.recv()
            except (EOFError, OSError):  # the front end is gone, or sent what is not a message
                msg = m.Shutdown()
            self.loop.call_soon_threadsafe(self._dispatch, msg)
            if isinstance(msg, m.Shutdown):
                return

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, m.Shutdown):
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
            st = m.Stats(self.engine.stats(), dict(self.xfer))
            if st != last:
                self.send(st)
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

    def handle(self, msg: Any) -> None:
        if isinstance(msg, m.Submit):
            job = self.jobs[msg.rid] = Job(msg.rid, msg.params)
            self.spawn(self._run(job, msg.prompt))
        elif isinstance(msg, m.Abort):
            self.spawn(self._abort(msg.rid))
        elif isinstance(msg, m.Limits):
            self.peer_limits = {"pool_tokens": msg.pool_tokens, "max_model_len": msg.max_model_len}

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
                self.send(m.Error(job.rid, encode_error(exc)))
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
                self.send(m.Error(job.rid, encode_error(EngineDeadError(f"KV transfer failed: {exc!r}"))))
            self.loop.call_soon_threadsafe(self._sent, job, pin)

    def _sent(self, job: Job, pin: BlockTable) -> None:
        self.core.release_pin(pin)
        self._finished(job)

    def _finished(self, job: Job) -> None:
        self.jobs.pop(job.rid, None)
        job.done.set()
        self.send(m.Stats(self.engine.stats(), dict(self.xfer)))  # the front end's stats() sees it now
        self.send(m.Released(job.rid, "prefill", self.engine.stats()))  # its blocks (and pin) are back

    async def _abort(self, rid: int) -> None:
        job = self.jobs.get(rid)
        if job is not None:
            job.aborted = True
            if job.req is not None and not job.exporting:
                self.engine.abort(job.req)
            await job.done.wait()
        self.send(m.Released(rid, "prefill", self.engine.stats()))


# ---- decode --------------------------------------------------------------------------------------
class DecodeWorker(Worker):
    MAX_REMEMBERED_ABORTS = 10_000

    def start(self) -> None:
        self.core = cast(DecodeCore, self.engine._core)
        self.live: dict[int, Request] = {}
        # Aborted before their KV arrived: dropped when it does (bounded; see messages.py).
        self.aborted: OrderedDict[int, None] = OrderedDict()
        threading.Thread(target=self._receiver, name="asyncpage-disagg-recv", daemon=True).start()

    def handle(self, msg: Any) -> None:
        if isinstance(msg, m.Abort):
            self.spawn(self._abort(msg.rid))

    def _receiver(self) -> None:
        assert self.loop is not None
        while True:
            try:
                header = wire.recv_header(self.transport)
            except (wire.HeaderError, FrameError) as exc:
                # The stream can no longer be followed (a frame refused unread, or not a header):
                # the pair is dead, as after a broken receive.
                log.error("the prefill worker sent what is not a KV header", exc_info=exc)
                self.die(EngineDeadError(f"KV transfer failed: {exc}"))
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
            except OSError as exc:
                if isinstance(exc, FrameError):
                    log.error("the prefill worker sent a payload of the wrong length", exc_info=exc)
                    self.die(EngineDeadError(f"KV transfer failed: {exc!r}"))
                # The connection broke mid-transfer (the prefill worker died): this request is lost,
                # the ones already decoding here are not. Closed, so a prefill side still alive
                # fails its next transfer instead of waiting on a reply.
                log.error("the KV connection broke during a transfer; no more requests arrive", exc_info=exc)
                with contextlib.suppress(OSError):
                    self.transport.close()
                if req is not None:
                    self.loop.call_soon_threadsafe(self._lost, header.rid, req, exc)
                return
            except Exception as exc:
                # The two sides no longer agree where the stream is: the prefill side would block in
                # its next transfer (the socket has no timeout), its blocks pinned. The pair is dead.
                log.error("KV transfer from the prefill worker failed", exc_info=exc)
                self.die(EngineDeadError(f"KV transfer failed: {exc!r}"))
            if plan is not None and req is not None:
                self.loop.call_soon_threadsafe(self.core.imported, req)

    def _lost(self, rid: int, req: Request, exc: BaseException) -> None:
        """A request whose KV stopped arriving mid-transfer: failed, typed, and its blocks freed."""
        self.send(m.Error(rid, encode_error(EngineDeadError(f"KV transfer failed: {exc!r}"))))
        self.engine.abort(req)
        self.core.imported(req)  # admitted as aborted: dropped, its blocks back in the pool

    def _on_header(self, header: wire.Header, reply: concurrent.futures.Future[Any],
                   box: concurrent.futures.Future[Request | None]) -> None:
        invalid = self._invalid(header)
        if invalid is not None or header.rid in self.aborted:
            if invalid is not None and header.rid not in self.aborted:
                self.send(m.Error(header.rid, encode_error(RequestFailedError(f"KV hand-over refused: {invalid}"))))
            self.aborted.pop(header.rid, None)
            reply.set_result(None)
            box.set_result(None)
            return
        req = self.core.import_request(header, self.engine.eos_token_ids, reply)
        self.live[header.rid] = req
        box.set_result(req)
        self.spawn(self._forward(header.rid, req))

    def _invalid(self, header: wire.Header) -> str | None:
        """Why this side cannot take `header` (its layout, its vocabulary), or None."""
        if header.block_bytes != wire.block_bytes(self.caches):
            return f"{header.block_bytes} bytes per block sent, this pool's are {wire.block_bytes(self.caches)}"
        vocab, ids = self.engine.vocab_size, header.prompt_token_ids
        if not ids or not all(0 <= t < vocab for t in ids) or not 0 <= header.first_token < vocab:
            return "token ids outside the vocabulary"
        if header.num_blocks != -(-len(ids) // self.engine.config.block_size):
            return f"{header.num_blocks} blocks for a prompt of {len(ids)} tokens"
        return None

    async def _forward(self, rid: int, req: Request) -> None:
        try:
            while True:
                chunks = await req.mailbox.get()
                for c in chunks:
                    final = None
                    if c.finish_reason is not None:
                        final = m.Final(list(req.prompt_token_ids), req.num_cached_prompt_tokens,
                                        self.engine.stats())  # blocks already freed: exact
                    self.send(m.Chunk(rid, c, final))
                if any(c.finish_reason is not None for c in chunks):
                    break
        except AsyncPageError as exc:
            self.send(m.Error(rid, encode_error(exc)))
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
        self.send(m.Released(rid, "decode", self.engine.stats()))


def run(fd: int) -> None:
    """The process entry: `fd` is this worker's end of the front end's control socketpair."""
    chan = Channel(socket.socket(fileno=fd), m.ToWorker)
    try:
        init = chan.recv()
    except (EOFError, OSError):
        os._exit(1)
    if not isinstance(init, m.Init):
        os._exit(1)
    main(chan, init)


if __name__ == "__main__":  # python -m asyncpage.disagg.worker FD (started by DisaggEngine.from_pretrained)
    import sys

    run(int(sys.argv[1]))
