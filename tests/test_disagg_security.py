"""What a stranger can do to a disaggregated pair (asyncpage.disagg; issue 31 item 5, review H7): nothing
in the package unpickles; a running pair listens on nothing beyond loopback (start-up included); a peer
without the pair's secret is refused before any frame of it is read, on either side; a header or control
frame too long is refused before anything is allocated for it, and a malformed one is a typed error that
runs nothing. The transport checks need no model; the others start workers of a tiny model."""

from __future__ import annotations

import ast
import asyncio
import gc
import ipaddress
import os
import pickle
import secrets
import socket
import struct
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

import asyncpage
from asyncpage import SamplingParams
from asyncpage.disagg import DisaggEngine, wire
from asyncpage.disagg import messages as m
from asyncpage.disagg import transport as kvt
from asyncpage.disagg.engine import launch_worker
from asyncpage.errors import InvalidRequestError

OPTS: dict[str, Any] = dict(dtype="float32", block_size=4, num_kv_blocks=128)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


# ---- nothing unpickles -----------------------------------------------------------------------------
# Modules whose loading runs code chosen by whoever wrote the bytes (or that pickle on receive).
_UNSAFE_MODULES = ("pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "joblib",
                   "multiprocessing", "torch.multiprocessing", "copyreg")
_UNSAFE_CALLS = {"torch.load", "torch.serialization.load", "pandas.read_pickle", "pd.read_pickle",
                 "ProcessPoolExecutor"}


def _unsafe_uses(source: str, filename: str) -> list[str]:
    """Every import of an unpickling module, call of a pickle-backed loader, and numpy load that
    allows pickles, in one Python source."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if any(name == mod or name.startswith(mod + ".") for mod in _UNSAFE_MODULES):
                found.append(f"{filename}:{node.lineno}: import {name}")
        if isinstance(node, ast.Call):
            called = ast.unparse(node.func)
            if called in _UNSAFE_CALLS or called.rsplit(".", 1)[-1] in ("read_pickle", "ProcessPoolExecutor"):
                found.append(f"{filename}:{node.lineno}: {called}()")
            if called.rsplit(".", 1)[-1] == "load" and any(
                    k.arg == "allow_pickle" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
                    for k in node.keywords):
                found.append(f"{filename}:{node.lineno}: {called}(allow_pickle=...)")
    return found


def test_nothing_in_the_package_unpickles() -> None:
    root = Path(asyncpage.__file__).parent
    files = sorted(root.rglob("*.py"))
    assert len(files) > 50  # the whole package, not an empty glob
    found = [hit for f in files for hit in _unsafe_uses(f.read_text(), str(f.relative_to(root.parent)))]
    assert found == []


def test_the_unpickling_scan_finds_what_it_looks_for() -> None:
    planted = ("import pickle\nfrom multiprocessing.connection import Connection\nimport torch\n"
               "x = torch.load('w.pt')\nimport numpy as np\ny = np.load('a.npy', allow_pickle=True)\n"
               "z = np.load('a.npy')\n")
    assert [h.split(": ", 1)[1] for h in _unsafe_uses(planted, "planted.py")] == [
        "import pickle", "import multiprocessing.connection", "import multiprocessing.connection.Connection",
        "torch.load()", "np.load(allow_pickle=...)"]


# ---- sockets of a process, from /proc ----------------------------------------------------------
def _inet_sockets(pid: int) -> list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address, int, str]]:
    """(protocol, local address, local port, TCP state in hex: 0A listen, 01 established) of every
    IPv4/IPv6 socket `pid` holds open."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    out = []
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        for line in Path(f"/proc/{pid}/net/{proto}").read_text().splitlines()[1:]:
            f = line.split()
            if f[9] not in inodes:
                continue
            hexaddr, hexport = f[1].split(":")
            raw = bytes.fromhex(hexaddr)
            # /proc writes each 32-bit word of the address in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            out.append((proto, ipaddress.ip_address(raw), int(hexport, 16), f[3]))
    return out


def _is_loopback(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)


def test_the_proc_reader_sees_a_listening_socket_and_its_address() -> None:
    with socket.socket() as s4, socket.socket(socket.AF_INET6) as s6:
        s4.bind(("127.0.0.1", 0))
        s4.listen()
        s6.bind(("::", 0))
        s6.listen()
        seen = {(p, str(a), port, st) for p, a, port, st in _inet_sockets(os.getpid())}
        assert ("tcp", "127.0.0.1", s4.getsockname()[1], "0A") in seen
        assert ("tcp6", "::", s6.getsockname()[1], "0A") in seen
        assert not _is_loopback(ipaddress.ip_address("::")) and _is_loopback(ipaddress.ip_address("::ffff:127.0.0.1"))


@pytest.mark.asyncio
@pytest.mark.parametrize("kv_host", [None, "127.0.0.1"])
async def test_a_running_pair_listens_on_nothing_beyond_loopback(tiny_models: Any, kv_host: str | None) -> None:
    """Default: the KV goes over AF_UNIX, so no process of the pair holds any IP socket. With
    kv_host="127.0.0.1": the one KV connection, both ends on loopback, and nothing listens once joined."""
    before = set(_inet_sockets(os.getpid()))  # the front end is this (shared) test process
    engine = DisaggEngine.from_pretrained(tiny_models["llama"][0], kv_host=kv_host, **OPTS)
    try:
        async with engine:
            out = await engine.generate([0, *range(3, 20)], GREEDY)
            assert len(out.token_ids) == 8 and engine.transfer_stats()["bytes"] > 0
            held = {r: _inet_sockets(p.pid) for r, p in engine._procs.items()}
            held["front end"] = sorted(set(_inet_sockets(os.getpid())) - before)
    finally:
        engine.close()
    for who, socks in held.items():
        assert all(_is_loopback(addr) for _, addr, _, _ in socks), (who, socks)
    for role in ("prefill", "decode"):
        if kv_host is None:
            assert held[role] == [], role
        else:
            assert [st for *_, st in held[role]] == ["01"], (role, held[role])  # established, no listener


@pytest.mark.asyncio
async def test_while_starting_the_prefill_worker_listens_on_loopback_only(tiny_models: Any) -> None:
    """The window the review's attack used (the store waiting for the slower load): the prefill
    worker's listener is bound on 127.0.0.1 at the port it reported, and goes when it is told to stop."""
    proc, chan = launch_worker("prefill", tiny_models["llama"][0], OPTS, secret=kvt.new_secret(),
                               kv_host="127.0.0.1")
    try:
        listening = await asyncio.get_running_loop().run_in_executor(None, chan.recv)
        assert isinstance(listening, m.Listening) and listening.address.family == "tcp"
        socks = _inet_sockets(proc.pid)
        assert [(str(a), port, st) for _, a, port, st in socks] == [("127.0.0.1", listening.address.port, "0A")]
    finally:
        chan.send(m.Shutdown())
        assert proc.wait(timeout=60) is not None
        chan.close()


def test_a_unix_listener_lives_in_a_directory_only_its_user_can_enter() -> None:
    listener = kvt.KVListener()
    try:
        directory = Path(listener.address.path).parent
        assert directory.stat().st_mode & 0o777 == 0o700 and directory.stat().st_uid == os.getuid()
    finally:
        listener.close()
    assert not directory.exists()


def test_a_tcp_listener_binds_loopback_on_a_port_the_kernel_picked() -> None:
    listener = kvt.KVListener("127.0.0.1")
    try:
        assert listener.address.host == "127.0.0.1" and listener.address.port > 0
        assert ("127.0.0.1", listener.address.port, "0A") in {(str(a), p, st) for _, a, p, st in
                                                              _inet_sockets(os.getpid())}
    finally:
        listener.close()


# ---- the secret ----------------------------------------------------------------------------------
class _Evil:
    """A pickle that creates a file when loaded: present afterwards means someone unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def _header(rid: int = 1) -> wire.Header:
    return wire.Header(rid, [0, 5, 6], 7, None, SamplingParams(max_tokens=2), 1, 1024)


def _frame(data: bytes) -> bytes:
    return struct.pack("!I", len(data)) + data


@pytest.fixture
def decoded(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bytes]]:
    """Every header frame anyone decodes during the test."""
    calls: list[bytes] = []
    real = wire.decode_header

    def spy(data: bytes) -> wire.Header:
        calls.append(data)
        return real(data)

    monkeypatch.setattr(wire, "decode_header", spy)
    yield calls


def _pair(host: str | None = None) -> tuple[kvt.KVTransport, kvt.KVTransport]:
    """(listener's end, connector's end) of a joined pair."""
    secret, listener = kvt.new_secret(), kvt.KVListener(host)
    joined: dict[str, kvt.KVTransport] = {}
    t = threading.Thread(target=lambda: joined.update(c=kvt.connect(listener.address, secret, 10)))
    t.start()
    server = listener.accept(secret, timeout=10)
    t.join()
    return server, joined["c"]


@pytest.mark.parametrize("host", [None, "127.0.0.1"])
def test_a_stranger_without_the_secret_is_refused_and_the_real_peer_joins(host: str | None, tmp_path: Path,
                                                                          decoded: list[bytes]) -> None:
    """A stranger connects first, sends a made-up proof and then a pickle and a header: closed unread;
    the peer with the secret joins after it, and the first frame the listener reads is the peer's."""
    secret, listener = kvt.new_secret(), kvt.KVListener(host)
    marker = tmp_path / "unpickled"
    accepted: dict[str, Any] = {}
    t = threading.Thread(target=lambda: accepted.update(tr=listener.accept(secret, timeout=20)))
    t.start()
    with _raw_connect(listener.address) as stranger:
        stranger.sendall(b"apkv\x00\x01\x00\x00" + secrets.token_bytes(32))
        _recv_exact(stranger, 8 + 32 + 32)  # the listener's nonce and proof: no use without the secret
        stranger.sendall(secrets.token_bytes(32) + _frame(pickle.dumps(_Evil(marker)))
                         + _frame(msgspec.msgpack.encode(_header(666))))
        assert _recv_all(stranger) == b""  # closed, no OK
    with pytest.raises(kvt.AuthenticationError):
        kvt.connect(listener.address, kvt.new_secret(), 10)  # a peer with the wrong secret gives up itself
    peer = kvt.connect(listener.address, secret, 10)
    t.join()
    try:
        wire.send_header(peer, _header(1))
        assert wire.recv_header(accepted["tr"]).rid == 1
    finally:
        peer.close()
        accepted["tr"].close()
    assert len(decoded) == 1 and not marker.exists()


def _accept_in_thread(listener: kvt.KVListener, secret: bytes, timeout: float,
                      cancel: socket.socket | None = None) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["tr"] = listener.accept(secret, timeout=timeout, cancel=cancel)
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    return t, out


def _handshake_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "asyncpage-kv-handshake"]


@pytest.mark.parametrize("host", [None, "127.0.0.1"])
def test_a_silent_stranger_connected_first_does_not_hold_up_the_real_peer(host: str | None) -> None:
    """Anyone who can reach a node's address can connect and say nothing: the real peer, connecting
    after it, still joins at once (not after the stranger's HANDSHAKE_TIMEOUT_S), and the stranger is
    closed once the pair is joined."""
    secret, listener = kvt.new_secret(), kvt.KVListener(host)
    t, out = _accept_in_thread(listener, secret, timeout=3 * kvt.HANDSHAKE_TIMEOUT_S)
    with _raw_connect(listener.address) as stranger:
        stranger.sendall(b"apkv")  # a first byte, then silence
        time.sleep(0.3)  # it has been accepted and its handshake is under way
        started = time.monotonic()
        peer = kvt.connect(listener.address, secret, 3 * kvt.HANDSHAKE_TIMEOUT_S)
        t.join(kvt.HANDSHAKE_TIMEOUT_S)
        took = time.monotonic() - started
        try:
            assert "tr" in out, out
            assert took < kvt.HANDSHAKE_TIMEOUT_S / 4, took
            assert _recv_all(stranger) == b""  # closed, no proof and no OK
        finally:
            peer.close()
            out["tr"].close()


def test_a_flood_of_silent_strangers_does_not_lock_the_real_peer_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """As many silent strangers as handshakes may run at once, then the real peer (which does not
    retry): the oldest stranger makes room for it, and it joins."""
    monkeypatch.setattr(kvt, "MAX_PENDING", 4)
    secret, listener = kvt.new_secret(), kvt.KVListener("127.0.0.1")
    t, out = _accept_in_thread(listener, secret, timeout=3 * kvt.HANDSHAKE_TIMEOUT_S)
    strangers = []
    for _ in range(kvt.MAX_PENDING):
        strangers.append(_raw_connect(listener.address))
        time.sleep(0.1)
    try:
        deadline = time.monotonic() + 5
        while len(_handshake_threads()) < kvt.MAX_PENDING and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_handshake_threads()) == kvt.MAX_PENDING  # all of them are being waited on
        peer = kvt.connect(listener.address, secret, 3 * kvt.HANDSHAKE_TIMEOUT_S)
        t.join(kvt.HANDSHAKE_TIMEOUT_S)
        assert "tr" in out, out
        peer.close()
        out["tr"].close()
        assert all(_recv_all(s) == b"" for s in strangers)
    finally:
        for s in strangers:
            s.close()


@pytest.mark.parametrize("ending", ["timeout", "cancel"])
def test_an_accept_that_gives_up_leaves_no_handshake_thread_or_socket_behind(ending: str) -> None:
    """Silent strangers mid-handshake when the accept times out or is called off: they are closed,
    their threads end, and this process holds no more descriptors than before (fewer may be: an earlier
    test's sockets can be collected meanwhile)."""
    gc.collect()
    fds = len(os.listdir("/proc/self/fd"))
    secret, listener = kvt.new_secret(), kvt.KVListener("127.0.0.1")
    stop_r, stop_w = socket.socketpair()
    t, out = _accept_in_thread(listener, secret, timeout=1.0 if ending == "timeout" else 30.0, cancel=stop_r)
    strangers = [_raw_connect(listener.address) for _ in range(3)]
    time.sleep(0.3)
    if ending == "cancel":
        stop_w.send(b"\0")
    t.join(10)
    expected = TimeoutError if ending == "timeout" else kvt.CancelledError
    assert isinstance(out.get("error"), expected), out
    assert all(_recv_all(s) == b"" for s in strangers)
    deadline = time.monotonic() + 5
    while _handshake_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _handshake_threads() == []
    for s in (*strangers, stop_r, stop_w):
        s.close()
    assert len(os.listdir("/proc/self/fd")) <= fds


def test_the_decode_side_refuses_a_listener_without_the_secret(tmp_path: Path, decoded: list[bytes]) -> None:
    """An impostor in the listener's place (the squatter of the review's attack): the connector finds its
    proof wrong and leaves before reading the header and the pickle it sends, and never proves itself."""
    marker = tmp_path / "unpickled"
    impostor = socket.socket()
    impostor.bind(("127.0.0.1", 0))
    impostor.listen()
    heard: dict[str, bytes] = {}

    def serve() -> None:
        conn, _ = impostor.accept()
        with conn:
            heard["hello"] = _recv_exact(conn, 40)
            conn.sendall(b"apkv\x00\x01\x00\x00" + secrets.token_bytes(64)
                         + _frame(msgspec.msgpack.encode(_header())) + _frame(pickle.dumps(_Evil(marker))))
            heard["after"] = _recv_all(conn)

    t = threading.Thread(target=serve)
    t.start()
    address = kvt.KVAddress("tcp", host="127.0.0.1", port=impostor.getsockname()[1])
    with pytest.raises(kvt.AuthenticationError, match="does not hold"):
        kvt.connect(address, kvt.new_secret(), 10)
    t.join()
    impostor.close()
    assert heard["hello"].startswith(b"apkv") and heard["after"] == b""  # no proof was given away
    assert decoded == [] and not marker.exists()


@pytest.mark.asyncio
async def test_a_decode_worker_sent_to_an_impostor_fails_typed_without_reading_it(tiny_models: Any,
                                                                                  tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    impostor = socket.socket()  # listens where the worker is sent, but cannot prove the secret
    impostor.bind(("127.0.0.1", 0))
    impostor.listen()
    proc, chan = launch_worker("decode", tiny_models["llama"][0], OPTS, secret=kvt.new_secret())
    loop = asyncio.get_running_loop()
    try:
        chan.send(m.Connect(kvt.KVAddress("tcp", host="127.0.0.1", port=impostor.getsockname()[1])))

        def serve() -> None:
            conn, _ = impostor.accept()
            with conn:
                _recv_exact(conn, 40)
                conn.sendall(b"apkv\x00\x01\x00\x00" + secrets.token_bytes(64) + _frame(pickle.dumps(_Evil(marker))))
                _recv_all(conn)

        await loop.run_in_executor(None, serve)
        failed = await loop.run_in_executor(None, chan.recv)
        assert isinstance(failed, m.Failed) and failed.error.name == "AuthenticationError"
        assert await loop.run_in_executor(None, proc.wait, 30) == 1
    finally:
        impostor.close()
        if proc.poll() is None:
            chan.send(m.Shutdown())
            proc.wait(timeout=30)
        chan.close()
    assert not marker.exists()


# ---- frames: refused before allocation, typed, running nothing -----------------------------------
@pytest.mark.parametrize("announced", [wire.MAX_HEADER_BYTES + 1, 0xFFFF_FFFF])
def test_an_oversized_header_is_refused_before_anything_is_allocated(announced: int, decoded: list[bytes]) -> None:
    server, client = _pair()
    try:
        client.sock.sendall(struct.pack("!I", announced))  # and nothing more: reading on would block
        server.sock.settimeout(5)
        tracemalloc.start()
        try:
            with pytest.raises(kvt.FrameError, match="past the limit"):
                wire.recv_header(server)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 256 << 10 and decoded == []
    finally:
        server.close()
        client.close()


def test_a_malformed_header_is_a_typed_error_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    good = msgspec.msgpack.decode(msgspec.msgpack.encode(_header()))
    bad_frames = [
        pickle.dumps(_Evil(marker)),  # what the old wire would have loaded
        b"\xc1",  # a byte msgpack never uses
        secrets.token_bytes(200),
        msgspec.msgpack.encode({**good, "rid": "one"}),
        msgspec.msgpack.encode({**good, "smuggled": 1}),
        msgspec.msgpack.encode({**good, "params": {**good["params"], "temperature": -1.0}}),
        msgspec.msgpack.encode([1, 2, 3]),
    ]
    server, client = _pair("127.0.0.1")
    try:
        for data in bad_frames:
            client.send_frame(data)
            with pytest.raises(wire.HeaderError):
                wire.recv_header(server)
        wire.send_header(client, _header(9))  # the stream is still in step after each refusal
        assert wire.recv_header(server) == _header(9)
    finally:
        server.close()
        client.close()
    assert not marker.exists()


def test_a_payload_of_another_length_is_refused_unread() -> None:
    server, client = _pair()
    try:
        client.send_buffer(torch.ones(64, dtype=torch.uint8))
        into = torch.zeros(32, dtype=torch.uint8)
        with pytest.raises(kvt.FrameError, match="64 bytes where 32"):
            server.recv_buffer(into)
        assert not into.any()
    finally:
        server.close()
        client.close()


def test_a_control_frame_too_long_or_of_the_wrong_kind_breaks_the_channel_unread(tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    a, b = socket.socketpair()
    front = m.Channel(a, m.ToFront)  # what the front end reads
    try:
        for data in (pickle.dumps(_Evil(marker)),
                     msgspec.msgpack.encode(m.Submit(1, [1], SamplingParams())),  # a front end -> worker kind
                     msgspec.msgpack.encode(m.Shutdown())):
            b.sendall(_frame(data))
            with pytest.raises(kvt.FrameError, match="not a control message"):
                front.recv()
        b.sendall(struct.pack("!I", m.MAX_FRAME_BYTES + 1))
        front.sock.settimeout(5)
        tracemalloc.start()
        try:
            with pytest.raises(kvt.FrameError, match="past"):
                front.recv()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 256 << 10
    finally:
        front.close()
        b.close()
    assert not marker.exists()


def test_what_the_worker_would_refuse_is_the_callers_invalid_request() -> None:
    """The encoder checks no types; a frame the worker could not decode would end its channel. So a
    Submit is checked against the worker's own decoder first, and the caller gets the error."""
    for prompt, params, field in (([3, "x"], SamplingParams(), "prompt"), ([3, True], SamplingParams(), "prompt"),
                                  ([3], SamplingParams(seed=2**70), "params")):
        with pytest.raises(InvalidRequestError) as info:
            m.encode_submit(m.Submit(1, prompt, params))
        assert info.value.field == field
    sent = msgspec.msgpack.decode(m.encode_submit(m.Submit(1, [np.int64(3), 4], SamplingParams())), type=m.Submit)
    assert sent.prompt == [3, 4]


def _raw_connect(address: kvt.KVAddress) -> socket.socket:
    if address.family == "unix":
        s = socket.socket(socket.AF_UNIX)
        s.connect(address.path)
    else:
        s = socket.create_connection((address.host, address.port))
    s.settimeout(10)
    return s


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, "closed early"
        buf += chunk
    return buf


def _recv_all(s: socket.socket) -> bytes:
    """What the other end still sends before it closes (b"": it sent nothing more)."""
    s.settimeout(10)
    out = b""
    try:
        while chunk := s.recv(4096):
            out += chunk
    except ConnectionResetError:
        pass
    return out
