"""Extraction jobs: extract_many from Python, and `asyncpage extract` on a JSONL file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import msgspec
import pytest

from asyncpage import AsyncEngine

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130}},
          "required": ["name", "age"], "additionalProperties": False}
PEOPLE = ["Alice is 31.", "Bob turned 42 last week.", "Carla, aged 25, lives in Rome.", "Dmitri is 60 years old.",
          "Eve is a 19 year old student.", "Farid (38) is a pilot."]


class Person(msgspec.Struct):
    name: str
    age: int


async def test_extract_many_yields_each_record_once_with_bounded_concurrency(default_engine: AsyncEngine) -> None:
    records = [{"id": i, "text": t} for i, t in enumerate(PEOPLE)] + [{"id": "bad", "body": "no text field"}]
    peak = 0

    async def watch():  # type: ignore[no-untyped-def]
        for r in records:
            nonlocal peak
            peak = max(peak, default_engine.stats().num_running + default_engine.stats().num_waiting)
            yield r

    seen = {}
    async for r in default_engine.extract_many(watch(), Person, prompt="{text}\nAs JSON: ", concurrency=3):
        seen[r.id] = r
    assert set(seen) == {*range(len(PEOPLE)), "bad"}
    assert seen["bad"].error is not None and seen["bad"].error.reason == "invalid_input"
    assert all(isinstance(seen[i].value, Person) for i in range(len(PEOPLE)) if seen[i].ok)
    assert sum(r.ok for r in seen.values()) >= len(PEOPLE) - 1
    assert peak <= 3
    assert default_engine.stats().kv_blocks_used == 0


def _cli(*args: str, cwd: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen([sys.executable, "-m", "asyncpage.cli", "extract", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _write_input(path: Path, n_people: int) -> list[str]:
    lines = [json.dumps({"id": f"p{i}", "text": PEOPLE[i % len(PEOPLE)]}) for i in range(n_people)]
    lines.insert(2, "{not json")
    lines.append(json.dumps({"id": "long", "text": "word " * 3000}))
    path.write_text("\n".join(lines) + "\n")
    return [f"p{i}" for i in range(n_people)] + ["line-3", "long"]


@pytest.mark.heavy  # ~110 s: the default model in two CLI processes, one killed; `make test-heavy`
def test_cli_writes_one_line_per_record_and_resumes_after_a_kill(tmp_path: Path) -> None:
    schema = tmp_path / "person.schema.json"
    schema.write_text(json.dumps(SCHEMA))
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    ids = _write_input(inp, 24)
    args = ("--schema", str(schema), "--input", str(inp), "--output", str(out), "--prompt", "{text}\\nAs JSON: ",
            "--max-prompt-tokens", "500", "--concurrency", "2", "--max-tokens", "40", "--dtype", "bfloat16")
    first = _cli(*args, cwd=tmp_path)
    deadline = time.time() + 300
    while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 6):
        time.sleep(0.2)
    first.send_signal(signal.SIGKILL)
    first.wait()
    done_before = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert 6 <= len(done_before) < len(ids)

    second = _cli(*args, "--resume", cwd=tmp_path)
    _, err = second.communicate(timeout=600)
    assert second.returncode == 0, err
    assert f"{len(done_before)} skipped" in err
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in results) == sorted(ids)  # every input exactly once
    by_id = {r["id"]: r for r in results}
    assert by_id["line-3"]["error"]["reason"] == "invalid_input"
    assert by_id["long"]["error"]["reason"] == "prompt_too_long"
    for r in results:
        if "value" in r:
            jsonschema.validate(r["value"], SCHEMA)
        else:
            assert r["error"]["reason"] in ("invalid_input", "prompt_too_long", "truncated")
    assert sum("value" in r for r in results) >= 20

    third = _cli(*args, "--resume", cwd=tmp_path)
    _, err = third.communicate(timeout=300)
    assert third.returncode == 0 and "0 done, 0 failed" in err and f"{len(ids)} skipped" in err
    assert out.read_text().count("\n") == len(ids)
