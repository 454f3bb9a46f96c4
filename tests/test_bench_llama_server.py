"""`--baseline llama-server` against a stand-in script (no llama.cpp needed): the command line, the
requests sent, token counting and that the server is always stopped."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
import time
from pathlib import Path

import pytest

from asyncpage.bench.llama_server import LlamaServerError, find_llama_server, run_llama_server, server_command
from asyncpage.bench.throughput import Item

FAKE = r'''
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
out = os.environ["FAKE_OUT"]
mode = os.environ.get("FAKE_MODE", "ok")
with open(out + ".pid", "w") as f:
    f.write(str(os.getpid()))
with open(out + ".argv", "w") as f:
    json.dump(args, f)
if mode == "crash":
    print("error: failed to load model", flush=True)
    sys.exit(3)
t_start = time.monotonic()


class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _send(self, code, body, ctype="application/json"):
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        ready = time.monotonic() - t_start > 0.3  # "loading model" at first
        self._send(200 if ready else 503, b'{"status":"ok"}' if ready else b'{"status":"loading"}')

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open(out + ".reqs", "a") as f:
            f.write(json.dumps(req) + "\n")
        if mode == "fail":
            return self._send(500, b'{"error":"boom"}')
        n = req["n_predict"] - (1 if mode == "short" else 0)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        for i in range(n):
            self.wfile.write(b"data: " + json.dumps({"content": "x", "tokens": [7], "stop": False}).encode() + b"\n\n")
        self.wfile.write(b"data: " + json.dumps({"content": "", "stop": True, "tokens_predicted": n}).encode()
                         + b"\n\n")
        self.wfile.flush()
        self.close_connection = True


ThreadingHTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), H).serve_forever()
'''


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    script = tmp_path / "llama-server"
    script.write_text(f"#!{sys.executable}\n" + FAKE)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    out = tmp_path / "fake"
    monkeypatch.setenv("FAKE_OUT", str(out))
    return str(script), out


def _gone(pid: int) -> bool:
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


ITEMS = [Item([2, 1000 + i, 1001, 1002], 3 + i) for i in range(5)]


def test_command_line() -> None:
    cmd = server_command("/x/llama-server", "/m.gguf", ITEMS, 2, 8080)
    assert cmd[:3] == ["/x/llama-server", "-m", "/m.gguf"]
    opt = {cmd[i]: cmd[i + 1] for i in range(3, len(cmd) - 1) if cmd[i].startswith("-")}
    assert opt["-np"] == "5" and opt["-t"] == "2" and opt["-tb"] == "2" and opt["--port"] == "8080"
    assert int(opt["-c"]) >= 5 * max(len(it.prompt) + it.max_tokens for it in ITEMS)
    assert "-cb" in cmd


def test_counts_and_stops(fake: tuple[str, Path]) -> None:
    binary, out = fake
    res = asyncio.run(run_llama_server(binary, "/m.gguf", ITEMS, threads=2, startup_timeout=20))
    assert res.output_tokens == sum(it.max_tokens for it in ITEMS)
    assert res.num_requests == 5 and res.throughput_tok_s > 0 and res.ttft_p50_ms is not None
    reqs = [json.loads(line) for line in (out.parent / "fake.reqs").read_text().splitlines()]
    assert len(reqs) == 1 + len(ITEMS)  # the warm-up first
    measured = sorted((r["prompt"], r["n_predict"]) for r in reqs[1:])
    assert measured == sorted((it.prompt, it.max_tokens) for it in ITEMS)
    assert all(r["temperature"] == 0 and r["ignore_eos"] and r["stream"] for r in reqs)
    assert _gone(int((out.parent / "fake.pid").read_text()))


def test_counts_what_the_server_reports(fake: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    binary, _ = fake
    monkeypatch.setenv("FAKE_MODE", "short")
    res = asyncio.run(run_llama_server(binary, "/m.gguf", ITEMS, threads=2, startup_timeout=20))
    assert res.output_tokens == sum(it.max_tokens - 1 for it in ITEMS)


@pytest.mark.parametrize("mode", ["crash", "fail"])
def test_errors_stop_the_server(fake: tuple[str, Path], monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    binary, out = fake
    monkeypatch.setenv("FAKE_MODE", mode)
    with pytest.raises(LlamaServerError) as e:
        asyncio.run(run_llama_server(binary, "/m.gguf", ITEMS, threads=2, startup_timeout=20))
    assert ("exited with 3" in str(e.value) and "failed to load model" in str(e.value)) if mode == "crash" \
        else "500" in str(e.value)
    assert _gone(int((out.parent / "fake.pid").read_text()))


def test_missing_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    with pytest.raises(LlamaServerError, match="--llama-server"):
        find_llama_server(str(tmp_path / "nope"))
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "nope"))
    with pytest.raises(LlamaServerError, match="LLAMA_SERVER"):
        find_llama_server(None)
