"""A DisaggEngine's two workers as Ray actors on the nodes their resources name:

    ray.init(address="auto")                                   # or ray_address="ray-head:6379"
    engine = DisaggEngine.from_pretrained("/models/gemma", dtype="float32",
                                          prefill_resources={"node_a": 1}, decode_resources={"node_b": 1})

Each actor runs worker.py's `main` unchanged, in a thread of its own process: the same engine loops
(cores.py), the same control messages (messages.py) and the same KV hand-over (wire.py). Only the
wiring differs from the two-process form, where the front end forks both workers and shares a
socketpair with each:
- control: a socketpair cannot reach another node, so each actor listens on TCP at its node's
  address (transport.KVListener), the front end joins it proving a secret made for it (transport's
  HMAC handshake, both ways), and the two then speak messages.py's frames over that socket as over
  the pipe.
- KV: the prefill actor's KV listener binds its node's address (Init.kv_host), and the decode actor
  joins it from its own node with the pair's secret (sent in Init over the control socket, as today).

Why a TCP socket between the actors rather than Ray's object store for the KV:
- The hand-over is a turn-by-turn exchange: a header, the decode side's answer (how many leading
  blocks its prefix cache already holds), then only the blocks it lacks. The skip is decided before
  any byte moves; through the object store the prefill side would put the whole payload first (or
  each request would add a round of actor calls).
- Nothing read off the socket is unpickled: msgspec frames decoded as their one type, and raw bytes
  received straight into a buffer the receiver sized from its own layout. Ray's object store and actor
  calls serialize with pickle (cloudpickle around numpy's out-of-band buffers too), so a reader
  unpickles whatever the writer put.
- One copy less each way (no put into plasma, no pull, no get), and one protocol with one set of
  failure paths, already tested by the two-process form.

What crosses Ray itself is the placement plumbing only: `listen` (the control secret in; the node's
address, its id and the actor's pid out) and `watch`. The secret crosses Ray's RPC: a Ray cluster is one
trust domain (any of its clients can run code on every node), so it is as private there as the actors.
The front end must reach the nodes' addresses (a driver on a cluster node, or on its network).

Death: a worker whose process ends (killed, crashed, its engine dead) closes its sockets, and the
front end reads EOF as it does from a process. A node lost without closing its sockets is seen
through Ray: `watch` never returns while the actor lives, and fails with RayActorError once Ray has
declared it dead; the front end takes that as the worker's death too.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import os
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import ray
from ray.exceptions import GetTimeoutError

from asyncpage.errors import EngineDeadError, InvalidRequestError

from . import messages as m
from . import worker
from .messages import Channel
from .transport import KVAddress, KVListener, connect, new_secret

# An actor's own threads: the accept/serve thread is not a Ray call; `listen` and `watch` are.
_ACTOR_CONCURRENCY = 4
STOP_GRACE_S = 10.0  # a stopped worker's process is ended by Ray within this, else it exits itself
_RAY_OPTIONS = {"CPU": "num_cpus", "GPU": "num_gpus", "memory": "memory"}


class WorkerActor:
    """One worker of a pair (its role comes in Init over the control socket, as for a process)."""

    def __init__(self) -> None:
        self._stopped = threading.Event()

    def listen(self, secret: bytes, start_timeout: float) -> dict[str, Any]:
        """Bind the control listener at this node's address and serve the worker behind it once the
        front end has joined (proving `secret`); returns where, and which node and process this is."""
        host = ray.util.get_node_ip_address()
        listener = KVListener(host)
        threading.Thread(target=self._serve, args=(listener, secret, start_timeout), name="asyncpage-disagg-actor",
                         daemon=True).start()
        return {"port": listener.address.port, "host": host, "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid()}

    def _serve(self, listener: KVListener, secret: bytes, start_timeout: float) -> None:
        try:
            chan = Channel(listener.accept(secret, timeout=start_timeout).sock, m.ToWorker)
            init = chan.recv()
        except (EOFError, OSError):
            os._exit(1)  # the front end never joined, or left: this actor has no one to serve
        if not isinstance(init, m.Init):
            os._exit(1)
        worker.main(chan, init, self._stop)  # never returns: the actor's process ends with the worker

    def _stop(self) -> None:
        """The worker was told to stop: `watch` ends the actor through Ray (an exit Ray expects; a bare
        process exit reads as a crash in every Ray log), and the process goes unless that stalls."""
        self._stopped.set()
        time.sleep(STOP_GRACE_S)

    def watch(self) -> None:
        """Returns only by ending this actor (RayActorError to the caller): when the worker was told to
        stop, or when the actor dies. The front end's handle on the worker's death."""
        self._stopped.wait()
        ray.actor.exit_actor()


_RemoteWorker: Any = ray.remote(WorkerActor)


class ActorWorker:
    """A worker actor as the front end's shutdown sees a process (`wait`, `kill`, `pid`), with the node
    it runs on and a hook for its death."""

    def __init__(self, role: str, handle: Any, info: Mapping[str, Any]) -> None:
        self.role = role
        self.handle = handle
        self.node_id: str = info["node_id"]
        self.host: str = info["host"]
        self.pid: int = info["pid"]
        self._ended: concurrent.futures.Future[Any] = handle.watch.remote().future()

    def on_exit(self, callback: Callable[[BaseException], None]) -> None:
        """`callback(error)` once Ray has declared this actor dead (from a thread of Ray's)."""
        def done(fut: concurrent.futures.Future[Any]) -> None:
            exc = fut.exception() if not fut.cancelled() else None
            why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200] if exc else "it ended"
            callback(EngineDeadError(f"the {self.role} worker's actor died: {why}"))
        self._ended.add_done_callback(done)

    def wait(self, timeout: float) -> None:
        """Until the actor has ended (told to shut down, it ends itself), its resources free;
        TimeoutExpired past `timeout` (then kill() it)."""
        if not ray.is_initialized():
            return  # Ray was shut down first (at exit): the cluster took its actors with it
        try:
            self._ended.result(timeout)
        except concurrent.futures.TimeoutError:
            raise subprocess.TimeoutExpired(f"ray actor {self.role}", timeout) from None
        except Exception:
            return  # RayActorError: it is gone, which is what was waited for

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            ray.kill(self.handle, no_restart=True)


def actor_options(role: str, resources: Mapping[str, float] | None) -> dict[str, Any]:
    """Ray's actor options for `resources`: "CPU" / "GPU" / "memory" as Ray's own (one CPU unless
    given), every other key a custom resource (a node's label, e.g. {"node_a": 1})."""
    field = f"{role}_resources"
    if resources is not None and not isinstance(resources, Mapping):
        raise InvalidRequestError(field, f"must be a dict of Ray resources, got {type(resources).__name__}")
    opts: dict[str, Any] = {"num_cpus": 1, "resources": {}}
    for name, amount in (resources or {}).items():
        if not isinstance(name, str) or isinstance(amount, bool) or not isinstance(amount, int | float) \
                or not 0 <= amount < math.inf:  # NaN and infinity too
            raise InvalidRequestError(field, f"{name!r}: {amount!r} is not a resource amount")
        if name in _RAY_OPTIONS:
            opts[_RAY_OPTIONS[name]] = amount
        else:
            opts["resources"][name] = amount
    return opts


def _check_cluster(options: Mapping[str, Mapping[str, Any]]) -> None:
    """A custom resource no node of the cluster has fails now, not after the start timeout."""
    have = ray.cluster_resources()
    for role, opts in options.items():
        missing = sorted(name for name in opts["resources"] if name not in have)
        if missing:
            raise InvalidRequestError(f"{role}_resources", f"no node of the Ray cluster has {', '.join(missing)} "
                                                           f"(its resources: {', '.join(sorted(have))})")


def launch_actors(model: str | os.PathLike[str] | None, options: Mapping[str, dict[str, Any]],
                  resources: Mapping[str, Mapping[str, float] | None], *, secret: bytes,
                  ray_address: str | None, start_timeout: float,
                  procs: dict[str, Any], conns: dict[str, Channel]) -> None:
    """Place both worker actors, join each one's control socket and send it Init (as launch_worker
    does for a process); fills `procs` (ActorWorker) and `conns` as it goes, so that a failure part
    way leaves the caller what to shut down."""
    if ray_address is not None and not isinstance(ray_address, str):
        raise InvalidRequestError("ray_address", f"must be a Ray address, got {type(ray_address).__name__}")
    if not ray.is_initialized():
        # The caller's own ray.init(...) comes first when there is one; else this connects.
        ray.init(address=ray_address, log_to_driver=False)
    placed = {role: actor_options(role, resources.get(role)) for role in options}
    _check_cluster(placed)
    handles = {role: _RemoteWorker.options(max_concurrency=_ACTOR_CONCURRENCY, **placed[role]).remote()
               for role in options}
    control = {role: new_secret() for role in options}
    refs = {role: handles[role].listen.remote(control[role], start_timeout) for role in options}
    try:
        infos = dict(zip(refs, ray.get(list(refs.values()), timeout=start_timeout), strict=True))
    except GetTimeoutError:
        for h in handles.values():
            with contextlib.suppress(Exception):
                ray.kill(h, no_restart=True)
        raise EngineDeadError(f"the worker actors were not placed within {start_timeout} s "
                              f"(resources {dict(resources)})") from None
    except BaseException:
        for h in handles.values():
            with contextlib.suppress(Exception):
                ray.kill(h, no_restart=True)
        raise
    for role, info in infos.items():
        procs[role] = ActorWorker(role, handles[role], info)
    for role, info in infos.items():
        address = KVAddress("tcp", host=info["host"], port=info["port"])
        conns[role] = Channel(connect(address, control[role], timeout=start_timeout).sock, m.ToFront)
        opts = dict(options[role])
        if opts.get("num_threads") is None:  # torch's pool: the actor's CPUs, not the node's
            opts["num_threads"] = max(1, int(placed[role]["num_cpus"] or 1))
        kv_host = info["host"] if role == "prefill" else None  # the decode side joins it from its node
        conns[role].send(m.Init(role, None if model is None else os.fspath(model), opts, None,  # type: ignore[arg-type]
                                secret, kv_host, start_timeout))
