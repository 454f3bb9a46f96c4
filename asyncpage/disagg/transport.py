"""The byte transport of the KV hand-over: one authenticated stream socket between the prefill worker
(which listens) and the decode worker (which connects). This file owns the sockets, the handshake and
the framing; what the frames mean is wire.py's.

    listener = KVListener(host=None)          # AF_UNIX in a private 0700 directory (host="127.0.0.1": TCP)
    ... tell the peer listener.address ...
    tr = listener.accept(secret, timeout=60)  # prefill side
    tr = connect(address, secret, timeout=60) # decode side

Why not torch.distributed: its TCPStore rendezvous binds every interface whatever host it is given,
and the port had to be picked by bind-then-close (squattable). Here the listener binds where it is told
(loopback unless a host says otherwise) on a port the kernel picks and holds, accepts one peer, and
closes: once the pair is joined nothing listens. Both ends prove they hold the pair's secret
(HMAC-SHA256 over both sides' nonces) before any frame is read, so nothing a stranger sends is ever
parsed, and the decode side never takes KV from a listener that cannot prove it either.

Frames after the handshake (nothing is ever unpickled; a length is checked before anything is allocated):
    frame   u32 length + that many bytes (a msgspec header): refused past the caller's limit
    int     i64
    buffer  u64 length + raw bytes received straight into a tensor the receiver sized itself:
            refused unless the length is exactly that tensor's
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import select
import shutil
import socket
import struct
import tempfile
import threading
import time
from typing import Literal

import msgspec
import torch

SECRET_BYTES = 32
_MAGIC = b"apkv\x00\x01\x00\x00"  # protocol name and version: a stray client fails at once
_NONCE = 32
_MAC = hashlib.sha256().digest_size
_OK = b"\x01"
HANDSHAKE_TIMEOUT_S = 10.0  # per connection: a silent stranger cannot hold the accept for long
MAX_PENDING = 64  # handshakes under way at once (each its own thread)
_U32, _I64, _U64 = struct.Struct("!I"), struct.Struct("!q"), struct.Struct("!Q")


class TransportError(ConnectionError):
    """The peer went away or broke the protocol: the pair can no longer hand KV over."""


class AuthenticationError(TransportError):
    """The other end does not hold the pair's secret (or speaks another protocol)."""


class FrameError(TransportError):
    """A frame longer than allowed, or not the length the receiver expects: refused before reading it."""


class CancelledError(TransportError):
    """The wait for the peer was called off."""


class KVAddress(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a KVListener listens: an AF_UNIX path or a TCP host and port."""

    family: Literal["unix", "tcp"]
    path: str = ""
    host: str = ""
    port: int = 0


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


class KVTransport:
    """A joined, authenticated pair. One thread sends and one receives at a time (wire.py's protocol
    is strictly turn by turn); blocking, no timeout: a dead peer reads as EOF."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send_frame(self, data: bytes) -> None:
        self.sock.sendall(_U32.pack(len(data)) + data)

    def recv_frame(self, limit: int) -> bytes:
        (n,) = _U32.unpack(self._recv_exact(_U32.size))
        if n > limit:
            raise FrameError(f"a frame of {n} bytes, past the limit of {limit}")
        return self._recv_exact(n)

    def send_int(self, value: int) -> None:
        self.sock.sendall(_I64.pack(value))

    def recv_int(self) -> int:
        return int(_I64.unpack(self._recv_exact(_I64.size))[0])

    def send_buffer(self, tensor: torch.Tensor) -> None:
        """A contiguous uint8 CPU tensor, as raw bytes."""
        view = _bytes_of(tensor)
        self.sock.sendall(_U64.pack(len(view)))
        self.sock.sendall(view)

    def recv_buffer(self, into: torch.Tensor) -> None:
        """Receive a buffer straight into `into` (a contiguous uint8 CPU tensor the receiver sized
        from its own layout); a length that is not exactly its size is refused unread."""
        view = _bytes_of(into)
        (n,) = _U64.unpack(self._recv_exact(_U64.size))
        if n != len(view):
            raise FrameError(f"a buffer of {n} bytes where {len(view)} were expected")
        recv_into_exact(self.sock, view, TransportError("the peer closed the KV connection"))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        recv_into_exact(self.sock, memoryview(buf), TransportError("the peer closed the KV connection"))
        return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview, eof: Exception) -> None:
    """Fill `view` from `sock` (the KV connection and the control channel both frame this way);
    `eof` is raised when the peer closes before it is full."""
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise eof
        got += k


def _bytes_of(t: torch.Tensor) -> memoryview:
    if t.dtype != torch.uint8 or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("a KV buffer is a contiguous uint8 CPU tensor")
    return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]  # an ndarray is a buffer


class KVListener:
    """Listens for the one peer. `host=None`: an AF_UNIX socket in a fresh mkdtemp directory (mode
    0700: no other user can even connect); else TCP on `host` (127.0.0.1 unless told otherwise), on a
    port the kernel picks at bind and this socket holds until it closes."""

    def __init__(self, host: str | None = None) -> None:
        self._dir: str | None = None
        if host is None:
            self._dir = tempfile.mkdtemp(prefix="asyncpage-kv-")  # created 0700
            path = os.path.join(self._dir, "kv.sock")
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self._sock.bind(path)
            except OSError:
                self.close()
                raise
            self.address = KVAddress("unix", path=path)
        else:
            info = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
            self._sock = socket.socket(info[0], socket.SOCK_STREAM)
            try:
                self._sock.bind(info[4][:2])
            except OSError:
                self.close()
                raise
            bound = self._sock.getsockname()
            self.address = KVAddress("tcp", host=str(bound[0]), port=int(bound[1]))
        self._sock.listen(4)

    def accept(self, secret: bytes, timeout: float, cancel: socket.socket | None = None) -> KVTransport:
        """The first connection that proves it holds `secret`; others are closed unread. Closes the
        listener either way. TimeoutError when none does within `timeout` s; CancelledError as soon
        as `cancel` (e.g. the control pipe: told to stop, or the front end is gone) is readable.

        Each connection's handshake runs in a thread of its own, so a stranger that connects and stays
        silent cannot hold the real peer's handshake (on a node's address, anyone who can reach it can
        connect). At most MAX_PENDING run at once: past that the oldest is dropped, not the newest (the
        peer does not retry: refusing newcomers would let MAX_PENDING silent strangers lock it out)."""
        deadline = time.monotonic() + timeout
        joined: list[socket.socket] = []
        pending: dict[socket.socket, None] = {}  # in the order they connected
        lock = threading.Lock()
        wake_r, wake_w = socket.socketpair()
        watch = [self._sock, wake_r] if cancel is None else [self._sock, wake_r, cancel]

        def handshake(conn: socket.socket) -> None:
            try:
                _serve_handshake(conn, secret, HANDSHAKE_TIMEOUT_S)
                ok = True
            except (OSError, AuthenticationError):
                ok = False  # a stranger, or a peer that gave up: wait for the real one
            with lock:
                pending.pop(conn, None)
                if ok and not joined and not done:
                    joined.append(conn)
                    with contextlib.suppress(OSError):
                        wake_w.send(b"\0")
                    return
            conn.close()

        done = False
        try:
            while True:
                with lock:
                    if joined:
                        done = True
                        return _joined(joined[0])
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no KV peer joined within {timeout} s")
                readable, _, _ = select.select(watch, [], [], left)
                if cancel is not None and cancel in readable:
                    raise CancelledError("stopped while waiting for the KV peer")
                if wake_r in readable:
                    wake_r.recv(64)
                if self._sock not in readable:
                    continue
                conn, _ = self._sock.accept()
                with lock:
                    while len(pending) >= MAX_PENDING:
                        oldest = next(iter(pending))
                        del pending[oldest]
                        with contextlib.suppress(OSError):  # its thread fails at once and closes it
                            oldest.shutdown(socket.SHUT_RDWR)
                    pending[conn] = None
                try:
                    threading.Thread(target=handshake, args=(conn,), name="asyncpage-kv-handshake", daemon=True).start()
                except BaseException:
                    with lock:
                        pending.pop(conn, None)
                    conn.close()
                    raise
        finally:
            with lock:
                if not done:  # raised: a peer that joined meanwhile is not taken (nor left open)
                    for conn in joined:
                        conn.close()
                done = True
                for conn in pending:  # their threads fail at once and close them
                    with contextlib.suppress(OSError):
                        conn.shutdown(socket.SHUT_RDWR)
            self.close()
            wake_r.close()
            wake_w.close()

    def close(self) -> None:
        self._sock.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def connect(address: KVAddress, secret: bytes, timeout: float) -> KVTransport:
    """Join the listener at `address`; AuthenticationError unless it proves it holds `secret`."""
    if address.family == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target: str | tuple[str, int] = address.path
    else:
        sock = socket.socket(socket.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM)[0][0],
                             socket.SOCK_STREAM)
        target = (address.host, address.port)
    try:
        sock.settimeout(timeout)
        sock.connect(target)
        sock.settimeout(min(HANDSHAKE_TIMEOUT_S, timeout))
        nonce_c = secrets.token_bytes(_NONCE)
        sock.sendall(_MAGIC + nonce_c)
        reply = _read_exact(sock, len(_MAGIC) + _NONCE + _MAC)
        magic, nonce_s, mac_s = reply[:len(_MAGIC)], reply[len(_MAGIC):-_MAC], reply[-_MAC:]
        if magic != _MAGIC or not hmac.compare_digest(mac_s, _mac(secret, b"listener", nonce_c, nonce_s)):
            raise AuthenticationError("the KV listener does not hold the pair's secret")
        sock.sendall(_mac(secret, b"connector", nonce_c, nonce_s))
        if _read_exact(sock, len(_OK)) != _OK:
            raise AuthenticationError("the KV listener refused this peer")
    except BaseException:
        sock.close()
        raise
    return _joined(sock)


def _serve_handshake(conn: socket.socket, secret: bytes, timeout: float) -> None:
    conn.settimeout(timeout)
    hello = _read_exact(conn, len(_MAGIC) + _NONCE)
    if hello[:len(_MAGIC)] != _MAGIC:
        raise AuthenticationError("not an asyncpage KV peer")
    nonce_c, nonce_s = hello[len(_MAGIC):], secrets.token_bytes(_NONCE)
    conn.sendall(_MAGIC + nonce_s + _mac(secret, b"listener", nonce_c, nonce_s))
    if not hmac.compare_digest(_read_exact(conn, _MAC), _mac(secret, b"connector", nonce_c, nonce_s)):
        raise AuthenticationError("the KV peer does not hold the pair's secret")
    conn.sendall(_OK)


def _mac(secret: bytes, role: bytes, nonce_c: bytes, nonce_s: bytes) -> bytes:
    # The role label keeps one side's proof from being replayed as the other's.
    return hmac.new(secret, role + b"\x00" + nonce_c + nonce_s, hashlib.sha256).digest()


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise AuthenticationError("the KV peer closed the connection during the handshake")
        buf += chunk
    return buf


def _joined(sock: socket.socket) -> KVTransport:
    sock.settimeout(None)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        # The header and the reply are small writes answered in turn: Nagle would hold each one back
        # for the peer's delayed ACK.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return KVTransport(sock)
