"""Control messages between the front end and its workers, the channel they cross (a socketpair the
front end made, length-prefixed msgspec msgpack frames: typed data, never pickles), and how a typed
error crosses a process boundary.

front end -> worker   Init (first; carries the pair's KV secret)   Submit (prefill)   Abort
                      Limits (prefill: the decode side's pool)   Connect (decode: where the KV
                      listener is)   Shutdown
worker -> front end   Listening (prefill: its KV address)   Ready   Failed   Stats
                      Released (this side holds nothing of rid any more)   Error (rid failed on this side)
decode -> front end   Chunk (`final`, on the last chunk: prompt_token_ids, num_cached_prompt_tokens)

Pipes, not the KV socket, for control: they are ordered per worker, survive a peer's death as an EOF
the front end can act on, and need no rendezvous. Only the KV (wire.py) goes over the KV transport.
Each direction has its own decoder: a message that is not one of its kinds, or a frame past
MAX_FRAME_BYTES (checked before it is read), breaks the channel like an EOF.
"""

from __future__ import annotations

import operator
import os
import select
import socket
import struct
import threading
from typing import Any, Literal

import msgspec

from asyncpage import errors
from asyncpage.outputs import EngineStats, StreamChunk
from asyncpage.params import SamplingParams

from .transport import FrameError, KVAddress, recv_into_exact
from .wire import Layout

# A Submit carries the caller's prompt text: 64 MiB is far past any context (DisaggEngine.submit
# refuses a bigger one as InvalidRequestError before it is sent).
MAX_FRAME_BYTES = 64 << 20
_U32 = struct.Struct("!I")
Role = Literal["prefill", "decode"]


class FrameTooLargeError(FrameError):
    """A message to send encodes past MAX_FRAME_BYTES: nothing was sent."""


class ErrorInfo(msgspec.Struct, frozen=True):
    name: str  # a class of asyncpage.errors
    args: tuple[str, ...]


# ---- front end -> worker -------------------------------------------------------------------------
class Init(msgspec.Struct, frozen=True, tag="init"):
    role: Role
    model: str | None
    options: dict[str, Any]  # AsyncEngine.from_pretrained's (plain data: str, numbers, dicts, lists)
    cpus: list[int] | None
    secret: bytes  # the pair's KV secret (transport.py): only this private pipe ever carries it
    kv_host: str | None  # where the prefill side listens: None = AF_UNIX, else TCP on this host
    start_timeout: float


class Connect(msgspec.Struct, frozen=True, tag="connect"):
    address: KVAddress


class Submit(msgspec.Struct, frozen=True, tag="submit"):
    rid: int
    prompt: str | list[int]
    params: SamplingParams


class Abort(msgspec.Struct, frozen=True, tag="abort"):
    rid: int


class Limits(msgspec.Struct, frozen=True, tag="limits"):
    pool_tokens: int
    max_model_len: int


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown"):
    pass


ToWorker = Init | Connect | Submit | Abort | Limits | Shutdown


# ---- worker -> front end -------------------------------------------------------------------------
class Listening(msgspec.Struct, frozen=True, tag="listening"):
    address: KVAddress


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    layout: Layout
    stats: EngineStats
    max_model_len: int


class Failed(msgspec.Struct, frozen=True, tag="failed"):
    error: ErrorInfo


class Stats(msgspec.Struct, frozen=True, tag="stats"):
    stats: EngineStats
    xfer: dict[str, int | float]


class Released(msgspec.Struct, frozen=True, tag="released"):
    rid: int
    role: Role
    stats: EngineStats


class Error(msgspec.Struct, frozen=True, tag="error"):
    rid: int
    error: ErrorInfo


class Final(msgspec.Struct, frozen=True):
    prompt_token_ids: list[int]
    num_cached_prompt_tokens: int
    stats: EngineStats  # the decode side's, its blocks already freed: exact


class Chunk(msgspec.Struct, frozen=True, tag="chunk"):
    rid: int
    chunk: StreamChunk
    final: Final | None


ToFront = Listening | Ready | Failed | Stats | Released | Error | Chunk


class Channel:
    """One end of a control socket. send() is thread-safe; one thread receives. EOFError when the
    other end is gone; FrameError (an OSError) for a frame too long or not one of `kinds`."""

    def __init__(self, sock: socket.socket, kinds: Any) -> None:
        self.sock = sock
        self._decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(kinds)
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_plain)
        self._lock = threading.Lock()

    def send(self, msg: msgspec.Struct) -> None:
        self.send_frame(self._encoder.encode(msg))

    def send_frame(self, data: bytes) -> None:
        """An encoded message (see encode_submit)."""
        if len(data) > MAX_FRAME_BYTES:
            raise FrameTooLargeError(f"a control message of {len(data)} bytes, past {MAX_FRAME_BYTES}")
        with self._lock:
            self.sock.sendall(_U32.pack(len(data)) + data)

    def recv(self) -> Any:
        (n,) = _U32.unpack(self._recv_exact(_U32.size))
        if n > MAX_FRAME_BYTES:
            raise FrameError(f"a control frame of {n} bytes, past {MAX_FRAME_BYTES}")
        try:
            return self._decoder.decode(self._recv_exact(n))
        except (msgspec.DecodeError, ValueError, TypeError) as exc:
            raise FrameError(f"not a control message: {exc}") from None

    def poll(self, timeout: float) -> bool:
        """True when a message (or the EOF) can be read now or within `timeout` s."""
        return bool(select.select([self.sock], [], [], max(0.0, timeout))[0])

    def close(self) -> None:
        self.sock.close()

    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        recv_into_exact(self.sock, memoryview(buf), EOFError("the other end of the control channel is gone"))
        return bytes(buf)


_worker_decoder = msgspec.msgpack.Decoder(ToWorker)


def encode_submit(msg: Submit) -> bytes:
    """`msg` as its frame, checked against the worker's own decoder first: the encoder does not check
    types (a float max_tokens, a str among token ids encode fine), and a frame the worker refuses
    breaks its channel. So what it would refuse is the caller's InvalidRequestError instead."""
    try:
        data = msgspec.msgpack.encode(msg, enc_hook=_plain)
        if len(data) > MAX_FRAME_BYTES:
            raise errors.InvalidRequestError("prompt", f"too large to send to the prefill worker "
                                                       f"(over {MAX_FRAME_BYTES} bytes)")
        _worker_decoder.decode(data)
    except (TypeError, OverflowError, msgspec.ValidationError) as exc:
        # msgspec names the place: "... - at `$.params.max_tokens`" or "... - at `$.prompt[3]`".
        path = str(exc).rpartition("`$.")[2]
        name = path.split(".")[1] if path.startswith("params.") else "prompt" if path.startswith("prompt") else "params"
        raise errors.InvalidRequestError(name.split("[")[0].rstrip("`"),
                                         f"cannot be sent to the prefill worker: {exc}") from None
    return data


def _plain(obj: Any) -> Any:
    # Options may name a model or a draft by Path; the worker takes the same path as a string.
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if hasattr(obj, "__index__"):  # numpy's integers among token ids, as AsyncEngine takes them
        return operator.index(obj)
    raise TypeError(f"cannot send a {type(obj).__name__} to a worker")


def encode_error(exc: BaseException) -> ErrorInfo:
    """(class name, constructor args): the typed error, rebuilt on the other side by decode_error."""
    if isinstance(exc, errors.InvalidRequestError):
        return ErrorInfo(type(exc).__name__, (exc.field, exc.message))
    if isinstance(exc, errors.ExtractionError):
        return ErrorInfo("EngineDeadError", (str(exc),))  # not raised on these paths; never rebuilt half-typed
    return ErrorInfo(type(exc).__name__, (str(exc),))


def decode_error(info: ErrorInfo) -> BaseException:
    """The typed error back (an unknown class becomes EngineDeadError with its text)."""
    cls = getattr(errors, info.name, None)
    if isinstance(cls, type) and issubclass(cls, errors.AsyncPageError):
        try:
            return cls(*info.args)
        except TypeError:
            pass
    return errors.EngineDeadError(f"{info.name}: {info.args[0] if info.args else ''}")
