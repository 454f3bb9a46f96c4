"""`--baseline llama-server` and `--workload extract` against a stand-in script (no llama.cpp needed):
the command line, the requests sent, token counting, the extract job's figures, and that the server is
always stopped."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from asyncpage.bench import extract_job
from asyncpage.bench.llama_server import LlamaServerError, find_llama_server, run_llama_server, server_command
from asyncpage.bench.throughput import Item

FAKE = r'''
import json, os, sys, threading, time
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
lock = threading.Lock()
in_flight = [0, 0]  # now, most at once; then one entry per answer


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
        if not req.get("stream"):  # the extract workload's: one JSON answer
            with lock:
                in_flight[0] += 1
                in_flight[1] = max(in_flight[:2])
                with open(out + ".peak", "w") as f:
                    f.write(str(in_flight[1]))
            time.sleep(0.1 if "json_schema" in req else 0)
            with lock:
                in_flight[0] -= 1
            value = {"customer": "Ann Lee", "product": "Lumen", "order_id": None, "refund": False, "severity": "low"}
            with lock:
                in_flight.append(0)  # one more answered
                bad = mode == "badjson" and "json_schema" in req and len(in_flight) % 2 == 1
            content = '{"customer": "Ann' if bad else json.dumps(value)
            answer = {"content": content, "tokens_predicted": req["n_predict"] if bad else 9, "stop": True,
                      "stop_type": "limit" if bad else "eos"}
            return self._send(200, json.dumps(answer).encode())
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


def test_extract_sends_each_prompt_with_the_schema_n_at_a_time(fake: tuple[str, Path]) -> None:
    binary, out = fake
    records = extract_job.tickets(7, seed=3)
    texts = extract_job.prompts(records, extract_job.TICKET_SCHEMA, 4096)
    wall, values, at_limit = asyncio.run(extract_job.run_llama_server_extract(
        binary, "/m.gguf", texts, extract_job.TICKET_SCHEMA, 3, 2, [900] * len(texts), startup_timeout=20))
    assert at_limit == 0 and wall > 0 and all(v is not None and v["customer"] == "Ann Lee" for v in values)
    argv = json.loads((out.parent / "fake.argv").read_text())
    assert argv[argv.index("-np") + 1] == "3" and argv[argv.index("-t") + 1] == "2"
    assert int(argv[argv.index("-c") + 1]) >= 3 * (900 + extract_job.MAX_TOKENS)
    reqs = [json.loads(line) for line in (out.parent / "fake.reqs").read_text().splitlines()]
    assert "json_schema" not in reqs[0]  # the warm-up
    measured = reqs[1:]
    assert sorted(r["prompt"] for r in measured) == sorted(texts)
    assert all(r["json_schema"] == extract_job.TICKET_SCHEMA and r["n_predict"] == extract_job.MAX_TOKENS
               and r["temperature"] == 0 and r["top_k"] == 1 and not r["stream"] for r in measured)
    assert int((out.parent / "fake.peak").read_text()) == 3  # 3 in flight, never more
    assert _gone(int((out.parent / "fake.pid").read_text()))


def test_extract_schema_is_the_ticket_schema_and_records_state_their_values() -> None:
    data = Path(__file__).parent / "data" / "ticket_severity.schema.json"
    assert extract_job.TICKET_SCHEMA == json.loads(data.read_text())
    records = extract_job.tickets(60)
    assert records == extract_job.tickets(60) and len({r["text"] for r in records}) == 60
    for r in records:
        want = r["expected"]
        assert 60 <= len(r["text"].split()) <= 120
        assert want["customer"] in r["text"] and want["product"] in r["text"]
        assert want["order_id"] is None or want["order_id"] in r["text"]
    assert {r["expected"]["severity"] for r in records} == {"low", "medium", "high", "critical"}
    assert 10 < sum(r["expected"]["refund"] for r in records) < 50
    assert 10 < sum(r["expected"]["order_id"] is None for r in records) < 50


def test_extract_scores_valid_outputs_and_fields() -> None:
    records = extract_job.tickets(3)
    good = dict(records[0]["expected"])
    wrong = dict(records[1]["expected"], severity="low" if records[1]["expected"]["severity"] != "low" else "high")
    side = extract_job.score("x", [good, wrong, None], records, extract_job.TICKET_SCHEMA, 2.0)
    assert side.valid == 2 and side.fields_right == 9 and side.fields == 15 and side.records_per_s == 1.5
    assert side.right_by_field == {"customer": 2, "product": 2, "order_id": 2, "refund": 2, "severity": 1}
    assert extract_job.score("x", [{"customer": "a"}], records[:1], extract_job.TICKET_SCHEMA, 1.0).valid == 0


async def test_extract_prompts_are_the_ones_extract_many_writes(tiny_llama: Path) -> None:
    from asyncpage import AsyncEngine

    engine = AsyncEngine.from_pretrained(str(tiny_llama), dtype="float32", num_kv_blocks=256)
    records = extract_job.tickets(3, seed=1)
    seen: list[str] = []
    tokenize = engine.tokenize

    async def spy(prompt: Any) -> list[int]:
        seen.append(prompt)
        return await tokenize(prompt)

    engine.tokenize = spy  # type: ignore[method-assign]
    async with engine:
        results = [r async for r in engine.extract_many([{"id": r["id"], "text": r["text"]} for r in records],
                                                        extract_job.TICKET_SCHEMA, concurrency=3)]
    assert len(results) == 3
    assert seen == extract_job.prompts(records, extract_job.TICKET_SCHEMA, engine.config.max_model_len)


def test_extract_bench_prints_both_sides(fake: tuple[str, Path], tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from asyncpage import AsyncEngine
    from asyncpage.cli import main

    real = AsyncEngine.from_pretrained
    asked: dict[str, Any] = {}

    def tiny(cls: Any, model: Any = None, **kw: Any) -> Any:
        asked.update(kw)
        engine = real(str(tiny_llama), dtype="float32", num_kv_blocks=256, max_num_seqs=kw["max_num_seqs"],
                      max_model_len=512)
        engine.model_source = "/m.gguf"  # what llama-server is given
        return engine

    monkeypatch.setattr(AsyncEngine, "from_pretrained", classmethod(tiny))
    binary, out = fake
    assert main(["bench", "--workload", "extract", "-n", "4", "--max-num-seqs", "2", "--llama-server", binary,
                 "--threads", "2"]) == 0
    printed = capsys.readouterr().out
    assert asked["max_num_seqs"] == 2
    lines = {line.split(":")[0]: line for line in printed.splitlines()}
    ours = next(v for k, v in lines.items() if k.startswith("asyncpage extract_many"))
    theirs = next(v for k, v in lines.items() if k.startswith("llama-server (2 slots, 2 threads"))
    assert "4 records in" in ours and "records/s" in ours and "/4; fields right" in ours and "(customer " in ours
    assert "valid JSON for the schema 4/4; fields right" in theirs
    assert any(line.startswith("ratio asyncpage extract_many") and line.endswith("x") for line in printed.splitlines())
    reqs = [json.loads(line) for line in (out.parent / "fake.reqs").read_text().splitlines()]
    assert len(reqs) == 5 and int((out.parent / "fake.peak").read_text()) == 2


def test_extract_counts_unparsable_outputs(fake: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    binary, _ = fake
    monkeypatch.setenv("FAKE_MODE", "badjson")
    records = extract_job.tickets(4)
    texts = extract_job.prompts(records, extract_job.TICKET_SCHEMA, 4096)
    wall, values, at_limit = asyncio.run(extract_job.run_llama_server_extract(
        binary, "/m.gguf", texts, extract_job.TICKET_SCHEMA, 2, 2, [900] * 4, startup_timeout=20))
    assert sum(v is None for v in values) == 2 and at_limit == 2  # every other answer is cut at the budget
    assert extract_job.score("llama-server", values, records, extract_job.TICKET_SCHEMA, wall).valid == 2
