"""DisaggEngine: the front end of a prefill process and a decode process, used like AsyncEngine.

    engine = DisaggEngine.from_pretrained(dtype="float32")     # starts both workers, loads twice
    async with engine:
        async for chunk in engine.stream("Hello", SamplingParams(max_tokens=32)):
            print(chunk.text, end="")
    engine.close()                                              # stops the workers

A request goes to the prefill worker, which computes the prompt and samples the first token; the
prompt's KV blocks and that token go to the decode worker over one authenticated socket between the two
(transport.py, wire.py: AF_UNIX in a private directory, or TCP on `kv_host`), and the decode worker
streams every token (the first included) back here. The front end holds no model:
tokenization and validation happen on the prefill worker, so errors arrive typed at the first
`async for` step rather than at the call. Not offered: n > 1, guided decoding, beam search, extract
and chat (InvalidRequestError names the field).
This file owns the front end's state (requests in flight, the latest stats of each worker); it
runs on the caller's event loop and talks to the workers only through their pipes (messages.py:
socketpairs it made, typed msgspec frames; for Ray actors on other nodes, an authenticated TCP socket
to each, actors.py). It makes the pair's KV secret and hands it to the two workers over those pipes;
it never touches the KV itself.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any, Self

import anyio

from asyncpage.core.stream import RequestStream
from asyncpage.errors import EngineDeadError, EngineLoopError, EngineNotRunningError, InvalidRequestError
from asyncpage.outputs import Choice, EngineStats, FinishReason, GenerateOutput, TokenLogprob
from asyncpage.params import SamplingParams
from asyncpage.runtime.eventloop import LoopHandle

from . import messages as m
from .front import RELEASE_TIMEOUT_S, FrontRequest
from .messages import Channel, decode_error
from .transport import new_secret

ROLES = ("prefill", "decode")
_UNSUPPORTED = ("json_schema", "regex", "choice", "grammar")


class DisaggEngine:
    """Prefill and decode in two processes behind one AsyncEngine-like object."""

    def __init__(self, procs: dict[str, Any], conns: dict[str, Channel], infos: dict[str, m.Ready]) -> None:
        """Use `from_pretrained`."""
        self._procs = procs
        self._conns = conns
        self.max_model_len = min(i.max_model_len for i in infos.values())
        self._stats: dict[str, EngineStats] = {r: infos[r].stats for r in ROLES}
        self._xfer: dict[str, dict[str, Any]] = {r: {} for r in ROLES}
        self._dead: dict[str, BaseException] = {}
        self._closed = False  # close() was called: the workers' exits are not deaths
        self._requests: dict[int, FrontRequest] = {}
        self._next_rid = 0
        self._loop: LoopHandle | None = None
        self._send_lock = threading.Lock()
        # A request is checked once, by the prefill worker, against the smaller of the two pools:
        # one the prefill side admits must also fit where it decodes.
        decode = infos["decode"].stats
        self._send("prefill", m.Limits(decode.kv_blocks_total * decode.block_size, infos["decode"].max_model_len))
        for role in ROLES:
            threading.Thread(target=self._read, args=(role,), name=f"asyncpage-disagg-{role}",
                             daemon=True).start()
            if hasattr(procs[role], "on_exit"):  # a Ray actor: its node may go without closing the sockets
                procs[role].on_exit(lambda exc, role=role: self._post(lambda: self._worker_died(role, exc)))
        self._finalizer = weakref.finalize(self, _shutdown, procs, conns)

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike[str] | None = None, *,
                        prefill_cpus: list[int] | None = None, decode_cpus: list[int] | None = None,
                        start_timeout: float = 900.0, kv_host: str | None = None, ray_address: str | None = None,
                        prefill_resources: dict[str, float] | None = None,
                        decode_resources: dict[str, float] | None = None, **options: Any) -> DisaggEngine:
        """Start the two workers and load the model in each (AsyncEngine.from_pretrained's options;
        `speculative_config` applies to the decode worker only). `prefill_cpus` / `decode_cpus`
        pin each worker to those cores (os.sched_setaffinity), as two machines would be.
        The KV goes from one worker to the other over an AF_UNIX socket in a private directory
        (`kv_host=None`), or over TCP on `kv_host` (e.g. "127.0.0.1"; a port the kernel picks); either
        way the two prove they hold a secret made here before any KV frame is read.

        On Ray (`ray_address`, `prefill_resources` or `decode_resources` given): the workers are Ray
        actors placed by those resources (e.g. {"node_a": 1}; "CPU" / "GPU" as Ray's, one CPU each by
        default, and `num_threads` defaults to it), on the caller's Ray if it called ray.init, else
        connecting to `ray_address` ("auto", "host:6379"; None: RAY_ADDRESS or a local cluster). The KV
        crosses nodes over TCP between the actors (actors.py says why not the object store); `model`
        must be readable on both nodes. Needs the extra: pip install 'asyncpage[ray]'."""
        if kv_host is not None and not isinstance(kv_host, str):
            raise InvalidRequestError("kv_host", f"must be a host name or address, got {type(kv_host).__name__}")
        on_ray = ray_address is not None or prefill_resources is not None or decode_resources is not None
        if on_ray and (prefill_cpus is not None or decode_cpus is not None or kv_host is not None):
            name = "kv_host" if kv_host is not None else "prefill_cpus" if prefill_cpus is not None else "decode_cpus"
            raise InvalidRequestError(name, "not for Ray actors (their resources place them; the KV listens on "
                                            "the prefill node's address)")
        secret = new_secret()
        prefill_options = {k: v for k, v in options.items() if k != "speculative_config"}
        procs: dict[str, Any] = {}
        conns: dict[str, Channel] = {}
        infos: dict[str, m.Ready] = {}
        try:
            if on_ray:
                _actors().launch_actors(model, {"prefill": prefill_options, "decode": options},
                                        {"prefill": prefill_resources, "decode": decode_resources}, secret=secret,
                                        ray_address=ray_address, start_timeout=start_timeout, procs=procs,
                                        conns=conns)
            else:
                for role, opts, cpus in (("prefill", prefill_options, prefill_cpus),
                                         ("decode", options, decode_cpus)):
                    procs[role], conns[role] = launch_worker(role, model, opts, secret=secret, kv_host=kv_host,
                                                             cpus=cpus, start_timeout=start_timeout)
            deadline = time.monotonic() + start_timeout
            listening = _expect(conns, {"prefill": m.Listening}, deadline, start_timeout)["prefill"]
            assert isinstance(listening, m.Listening)
            conns["decode"].send(m.Connect(listening.address))
            # Both at once: one that fails while the other waits for its peer is reported at once.
            for role, ready in _expect(conns, dict.fromkeys(ROLES, m.Ready), deadline, start_timeout).items():
                assert isinstance(ready, m.Ready)
                infos[role] = ready
            if infos["prefill"].layout != infos["decode"].layout:
                raise EngineDeadError("the two workers' KV layouts differ")
        except BaseException as exc:
            _shutdown(procs, conns)
            if isinstance(exc, EOFError | OSError):
                raise EngineDeadError(f"a worker exited while starting: {exc}") from exc
            raise
        return cls(procs, conns, infos)

    # ---- lifecycle ---------------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        if self._loop is not None:
            raise RuntimeError("this engine is already running")
        self._loop = LoopHandle.current()
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: TracebackType | None) -> None:
        """Requests still in flight are aborted on both workers and fail with EngineNotRunningError."""
        for rid, fr in list(self._requests.items()):
            fr.mailbox.fail(EngineNotRunningError("the engine was closed"))
            self._abort(rid)
        self._loop = None

    def close(self) -> None:
        """Stop both workers (also done when the engine is garbage-collected or at exit)."""
        self._closed = True
        self._finalizer()

    # ---- public API --------------------------------------------------------------------------
    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> RequestStream[FrontRequest]:
        """As AsyncEngine.stream: `async for chunk in engine.stream(prompt, params)` (the same stream type)."""
        return RequestStream(self, prompt, params or SamplingParams())

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None) -> GenerateOutput:
        """As AsyncEngine.generate (n=1)."""
        params = params or SamplingParams()
        text: list[str] = []
        ids: list[int] = []
        lps: list[TokenLogprob] = []
        reason: FinishReason | None = None
        async with self.stream(prompt, params) as s:
            async for c in s:
                text.append(c.text)
                ids += c.token_ids
                lps += c.logprobs or []
                reason = c.finish_reason or reason
            fr = s.request
        assert fr is not None and reason is not None
        prompt_ids = list(fr.final.prompt_token_ids) if fr.final else []
        choice = Choice(0, "".join(text), ids, reason, lps if params.logprobs is not None else None)
        return GenerateOutput(prompt_ids, [choice], fr.metrics())

    def stats(self) -> dict[str, EngineStats]:
        """{"prefill": EngineStats, "decode": EngineStats}: what each worker last published (it
        publishes within ~20 ms of a change, and before acknowledging an abort)."""
        return dict(self._stats)

    def transfer_stats(self) -> dict[str, Any]:
        """KV hand-over figures, as the prefill worker measured them: bytes, seconds (packing and
        sending the payloads), blocks sent, blocks skipped (already held by the decode side)."""
        return dict(self._xfer["prefill"])

    def nodes(self) -> dict[str, str | None]:
        """The Ray node id each worker runs on ({"prefill": id, "decode": id}); None: a local process."""
        return {role: getattr(self._procs[role], "node_id", None) for role in ROLES}

    @property
    def healthy(self) -> bool:
        """False once a worker has died (new requests then fail with EngineDeadError)."""
        return not self._dead

    # ---- submission (core.client.Submitter: what RequestStream calls) ---------------------------
    async def submit(self, prompt: str | list[int], params: SamplingParams, *, priority: int = 0,
                     cache_key: str | None = None) -> FrontRequest:
        self.check_usable()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params", f"must be SamplingParams, got {type(params).__name__}")
        if priority != 0:
            raise InvalidRequestError("priority", "not offered by the disaggregated engine (its workers run FCFS)")
        if cache_key is not None:
            raise InvalidRequestError("cache_key", "not offered by the disaggregated engine")
        if params.n != 1:
            raise InvalidRequestError("n", "a disaggregated engine runs one sample per request (n=1)")
        if params.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs", "not offered by the disaggregated engine")
        for name in _UNSUPPORTED:
            if getattr(params, name) is not None:
                raise InvalidRequestError(name, "guided decoding is not offered by the disaggregated engine")
        if not isinstance(prompt, str | list | tuple):
            raise InvalidRequestError("prompt", f"must be a str or a list of token ids, got {type(prompt).__name__}")
        self._next_rid += 1
        fr = FrontRequest(self._next_rid, params)
        self._requests[fr.rid] = fr
        try:
            frame = m.encode_submit(m.Submit(fr.rid, prompt if isinstance(prompt, str) else list(prompt), params))
        except InvalidRequestError:
            del self._requests[fr.rid]
            raise
        self._send("prefill", frame)
        return fr

    def abort(self, request: FrontRequest) -> None:
        """Release a request on both workers, unless it has ended (each acknowledges; see
        FrontRequest.released). Only sends."""
        if not request.done:
            self._abort(request.rid)

    async def wait_released(self, request: FrontRequest) -> None:
        """Wait (at most RELEASE_TIMEOUT_S) until both workers have let go of the request's blocks."""
        if request.released.issuperset(ROLES):
            return
        if request.released_event is None:
            request.released_event = anyio.Event()
        with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_TIMEOUT_S):
            await request.released_event.wait()

    def _abort(self, rid: int) -> None:
        """Release `rid` on both workers (each acknowledges; see FrontRequest.released). Only sends."""
        fr = self._requests.get(rid)
        if fr is None or fr.aborting:
            return
        fr.aborting = True
        for role in ROLES:
            if role in self._dead:
                fr.released.add(role)
            else:
                self._send(role, m.Abort(rid))
        self._maybe_forget(fr)

    def check_usable(self) -> None:
        """Raises the typed error a call would get now (dead, not running, another loop); returns
        when the engine can serve."""
        if self._closed:
            raise EngineNotRunningError("the engine was closed (close() stops its workers for good)")
        if self._dead:
            role, exc = next(iter(self._dead.items()))
            raise EngineDeadError(f"the {role} worker died: {exc}") from exc
        if self._loop is None:
            raise EngineNotRunningError("use the engine inside `async with engine:`")
        if not self._loop.is_current():
            raise EngineLoopError("this engine runs on another thread or event loop")

    def _send(self, role: str, msg: m.ToWorker | bytes) -> None:
        try:
            with self._send_lock:
                if isinstance(msg, bytes):
                    self._conns[role].send_frame(msg)
                else:
                    self._conns[role].send(msg)
        except OSError as exc:
            self._worker_died(role, exc)

    # ---- from the workers ---------------------------------------------------------------------
    def _read(self, role: str) -> None:
        """Pipe reader thread: stats are stored at once; everything else runs on the caller's loop."""
        conn = self._conns[role]
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # gone, or sent what is not a message: a dead worker either way
                self._post(lambda: self._worker_died(role, EngineDeadError(f"the {role} worker exited")))
                return
            # Stats are stored here, in the order they were sent (a later "stats" must not be
            # overwritten by an earlier "released" applied on the loop afterwards).
            if isinstance(msg, m.Stats):
                self._stats[role] = msg.stats
                self._xfer[role] = dict(msg.xfer)
                continue
            if isinstance(msg, m.Released):
                self._stats[role] = msg.stats
            if isinstance(msg, m.Chunk) and msg.final is not None:
                self._stats[role] = msg.final.stats
            if isinstance(msg, m.Failed):
                error = decode_error(msg.error)
                self._post(lambda e=error: self._worker_died(role, e))  # type: ignore[misc]
            else:
                self._post(lambda msg=msg: self._on_message(role, msg))  # type: ignore[misc]

    def _post(self, fn: Callable[[], None]) -> None:
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(fn)
        else:
            fn()  # not running: nobody waits on a mailbox, only bookkeeping is left

    def _on_message(self, role: str, msg: m.ToFront) -> None:
        if not isinstance(msg, m.Chunk | m.Error | m.Released):
            return  # Listening, Ready: start-up only
        rid = msg.rid
        fr = self._requests.get(rid)
        if fr is None:
            return
        if isinstance(msg, m.Chunk):
            final = msg.final
            fr.on_chunk(msg.chunk, final)
            if final is not None:
                # The decode side released it; the prefill side says so itself once its pinned
                # blocks are given back (its send may finish after the decode side is done).
                fr.released.add("decode")
                self._maybe_forget(fr)
        elif isinstance(msg, m.Error):
            fr.mailbox.fail(decode_error(msg.error))
            if not fr.aborting:
                self._abort(rid)  # whatever the other side holds of it goes too
        else:
            fr.released.add(role)
            self._maybe_forget(fr)

    def _maybe_forget(self, fr: FrontRequest) -> None:
        if fr.released.issuperset(ROLES):
            self._requests.pop(fr.rid, None)
            if fr.released_event is not None:
                fr.released_event.set()

    def _worker_died(self, role: str, exc: BaseException) -> None:
        if role in self._dead:
            return
        self._dead[role] = exc
        # Every request in flight passes through the decode worker, and a request without output yet
        # may still be on the prefill worker: both kinds fail; a decoding one survives the prefill's death.
        for fr in list(self._requests.values()):
            if role == "decode" or not fr.started:
                fr.mailbox.fail(EngineNotRunningError("the engine was closed") if self._closed
                                else EngineDeadError(f"the {role} worker died: {exc}"))
                fr.released.add(role)
                self._abort(fr.rid)
                self._maybe_forget(fr)  # already aborting (the other worker died first): _abort did not
            else:
                fr.released.add(role)
                self._maybe_forget(fr)


def launch_worker(role: str, model: str | os.PathLike[str] | None, options: dict[str, Any], *, secret: bytes,
                  kv_host: str | None = None, cpus: list[int] | None = None,
                  start_timeout: float = 900.0) -> tuple[subprocess.Popen[bytes], Channel]:
    """Start one worker process; returns it and its control channel. A prefill worker first says
    where it listens (Listening); a decode worker waits to be told (Connect). Each answers Ready or
    Failed once loaded and joined to its peer."""
    # A plain subprocess on a socketpair rather than multiprocessing's spawn: spawn re-imports the
    # caller's __main__ (which breaks any script without an `if __name__ == "__main__"` guard), and
    # its connections pickle. The secret goes over this pipe, never argv or the environment, which
    # other processes of the user can read.
    here, there = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-m", "asyncpage.disagg.worker", str(there.fileno())],
                            pass_fds=[there.fileno()])
    there.close()  # our copy: the worker's death must read as EOF here
    chan = Channel(here, m.ToFront)
    chan.send(m.Init(role, None if model is None else os.fspath(model), options, cpus,  # type: ignore[arg-type]
                     secret, kv_host, start_timeout))
    return proc, chan


def _actors() -> Any:
    try:
        from . import actors
    except ImportError as exc:  # the core install stays lean: Ray is an extra
        raise ImportError("DisaggEngine on Ray needs Ray: pip install 'asyncpage[ray]'") from exc
    return actors


def _expect(conns: dict[str, Channel], kinds: dict[str, type[Any]], deadline: float,
            start_timeout: float) -> dict[str, m.ToFront]:
    """The next start-up message of each role in `kinds`, which must be of that kind; the first
    worker's typed failure is raised as soon as it arrives."""
    got: dict[str, m.ToFront] = {}
    while len(got) < len(kinds):
        waiting = {conns[r].sock: r for r in kinds if r not in got}
        ready, _, _ = select.select(list(waiting), [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise EngineDeadError(f"the {' and '.join(waiting.values())} worker did not start within "
                                  f"{start_timeout} s")
        for sock in ready:
            role = waiting[sock]
            msg = conns[role].recv()
            if isinstance(msg, m.Failed):
                raise decode_error(msg.error)
            if not isinstance(msg, kinds[role]):
                raise EngineDeadError(f"the {role} worker sent {type(msg).__name__} while starting")
            got[role] = msg
    return got


def _shutdown(procs: dict[str, Any], conns: dict[str, Any]) -> None:
    for conn in conns.values():
        try:
            conn.send(m.Shutdown())
        except (OSError, ValueError):
            pass
    for p in procs.values():
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)
    for conn in conns.values():
        conn.close()
