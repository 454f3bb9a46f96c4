"""Extraction on a local Ray cluster (real worker processes, 2 CPUs, one engine per actor):
asyncpage.ray.extract_dataset and `asyncpage extract --ray` give what the in-process job gives."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import ray
import ray.data

from asyncpage import AsyncEngine, SamplingParams
from asyncpage.cli import main as cli
from asyncpage.errors import InvalidRequestError
from asyncpage.extract.jobs import run_job
from asyncpage.ray import extract_dataset

from .conftest import CORPUS

# minLength: the tiny random model must write something, and what it writes differs from record to record.
SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "minLength": 3, "maxLength": 8}},
          "required": ["word"], "additionalProperties": False}
# Small pools and float32: the same engine settings in-process and in every actor.
ENGINE = {"dtype": "float32", "block_size": 4, "num_kv_blocks": 256}
PROMPT = "{text}\nAs JSON: "


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


def _texts(n: int) -> list[str]:
    words = " ".join(CORPUS).split()
    return [" ".join(words[(7 * i) % len(words):][:3 + i % 5]) for i in range(n)]


def _builtins(r: Any) -> Any:
    return msgspec.to_builtins(r.error) if r.error else r.value


async def test_dataset_results_equal_in_process_extract_many_and_bad_records_are_rows(tiny_llama: Path,
                                                                                      cluster: None) -> None:
    records: list[dict[str, Any]] = [{"id": f"r{i}", "text": t} for i, t in enumerate(_texts(22))]
    records.append({"id": "no-text", "text": None})  # renders "null": still a record, not a failure
    records.append({"id": "long", "text": "word " * 400})  # over max_prompt_tokens: prompt_too_long
    params = SamplingParams(max_tokens=40, temperature=0)
    opts: dict[str, Any] = dict(prompt=PROMPT, concurrency=4, params=params, max_prompt_tokens=200)

    out = extract_dataset(ray.data.from_items(records), SCHEMA, num_actors=2, batch_size=5, model=str(tiny_llama),
                          **opts, **ENGINE)
    rows = out.take_all()

    engine = AsyncEngine.from_pretrained(str(tiny_llama), **ENGINE)
    async with engine:
        local = {r.id: _builtins(r) async for r in engine.extract_many(records, SCHEMA, **opts)}
    assert sorted(r["id"] for r in rows) == sorted(local)  # one row per record
    on_ray = {r["id"]: r["error"] or json.loads(r["value"]) for r in rows}
    assert on_ray == local
    assert on_ray["long"]["reason"] == "prompt_too_long"
    assert len({json.dumps(v) for v in on_ray.values()}) > 3  # the records really differ


def _write_input(path: Path, n: int) -> None:
    lines = [json.dumps({"id": i, "text": t}) for i, t in enumerate(_texts(n))]
    lines[5] = "{not json"  # invalid_input, written by the job like any other row
    lines.insert(9, "")  # blank: not a record, but counted in line numbers
    path.write_text("\n".join(lines) + "\n")


def _sorted_lines(path: Path) -> list[dict[str, Any]]:
    return sorted((json.loads(x) for x in path.read_text().splitlines()), key=lambda r: r["line"])


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(d))
    found, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            found.add(c)
            todo.append(c)
    return found


def _kill_one_actor_when(output: Path, lines: int, killed: list[tuple[int, int]]) -> None:
    """SIGKILL one extraction actor of this test's cluster once `output` holds `lines` lines (0: as
    soon as an actor exists, before the driver has written anything)."""
    deadline = time.time() + 120
    while time.time() < deadline:
        if lines == 0 or (output.exists() and output.read_text().count("\n") >= lines):
            for pid in sorted(_descendants(os.getpid())):
                try:
                    title = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                if b"MapBatches(_Extractor)" in title:
                    os.kill(pid, signal.SIGKILL)
                    killed.append((pid, output.read_text().count("\n") if output.exists() else 0))
                    return
        time.sleep(0.02)


def test_a_beam_width_every_record_would_be_refused_for_is_refused_on_the_driver(
        tiny_llama: Path, cluster: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Not a Ray task error from inside every actor after the model loaded: the typed error, here."""
    ds = ray.data.from_items([{"id": "a", "text": "Anna Berg"}])
    model = str(tiny_llama)
    cases: list[tuple[int, dict[str, Any], str]] = [
        (4, {"max_num_seqs": 2}, "beam_width"), (2, {"max_num_batched_tokens": 1}, "beam_width"),
        (2, {"params": SamplingParams(n=2, max_tokens=8)}, "n")]
    for width, extra, field in cases:
        with pytest.raises(InvalidRequestError) as e:
            extract_dataset(ds, SCHEMA, copy_fields="auto", beam_width=width, model=model, **ENGINE, **extra)
        assert e.value.field == field, (width, extra)
    # Greedy (width 1), or the default's beams, which fall back to greedy where they do not fit: not refused.
    for width in (1, None):
        extract_dataset(ds, SCHEMA, copy_fields="auto", beam_width=width, model=model, max_num_seqs=1,
                        params=SamplingParams(n=2, max_tokens=8), **ENGINE)
    inp, schema, out = tmp_path / "in.jsonl", tmp_path / "schema.json", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"id": 1, "text": "Anna Berg"}) + "\n")
    schema.write_text(json.dumps(SCHEMA))
    assert cli(["extract", "--ray", "--schema", str(schema), "--input", str(inp), "--output", str(out),
                "--model", model, "--copy-fields", "auto", "--beam-width", "600", "--no-progress"]) == 2
    assert "600 beams exceed max_num_batched_tokens=512" in capsys.readouterr().err


def test_bad_job_options_and_files_are_refused_before_a_cluster_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncpage.ray import run_job as run_ray_job

    monkeypatch.setattr(ray, "is_initialized", lambda: pytest.fail("the job reached the cluster"))

    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": 1, "text": "Anna Berg"}) + "\n")
    cases: list[tuple[Path, dict[str, Any], str]] = [
        (inp, {"concurrency": 0}, "concurrency"), (inp, {"num_actors": 0}, "num_actors"),
        (inp, {"prompt": PROMPT, "examples": [{"text": "Anna", "value": {"word": "Anna"}}]}, "examples"),
        (inp, {"examples": [{"text": "Anna", "value": {"word": 5}}]}, "examples"),  # the schema refuses 5
        (tmp_path / "nope.jsonl", {}, "input")]
    for src, options, field in cases:
        with pytest.raises(InvalidRequestError) as e:
            run_ray_job(src, tmp_path / "out.jsonl", SCHEMA, **options)
        assert e.value.field == field


@pytest.mark.heavy  # ~110 s: a Ray cluster, two CLI runs and a killed actor; `make test-heavy`
async def test_cli_on_ray_writes_the_in_process_lines_after_an_actor_is_killed_and_resumes(
        tiny_llama: Path, cluster: None, tmp_path: Path) -> None:
    inp, schema = tmp_path / "in.jsonl", tmp_path / "schema.json"
    n = 120
    _write_input(inp, n)
    schema.write_text(json.dumps(SCHEMA))
    engine = AsyncEngine.from_pretrained(str(tiny_llama), **ENGINE)
    async with engine:
        await run_job(engine, SCHEMA, inp, tmp_path / "local.jsonl", prompt=PROMPT, concurrency=4, max_tokens=40,
                      progress=False)
    local = _sorted_lines(tmp_path / "local.jsonl")
    assert len(local) == n

    out = tmp_path / "ray.jsonl"
    args = ["extract", "--ray", "--num-actors", "2", "--schema", str(schema), "--input", str(inp), "--prompt",
            "{text}\\nAs JSON: ", "--concurrency", "4", "--max-tokens", "40", "--model", str(tiny_llama),
            "--dtype", "float32", "--no-progress"]
    killed: list[tuple[int, int]] = []
    # Killed as soon as it exists: the driver writes lines in large batches, so "after k lines" could
    # come only once the job is over on a fast machine.
    killer = threading.Thread(target=_kill_one_actor_when, args=(out, 0, killed))
    killer.start()
    assert cli([*args, "--output", str(out)]) == 0
    killer.join()
    assert killed and killed[0][1] < n  # killed mid-job, and Ray's retry still gave every line once
    assert _sorted_lines(out) == local

    # Resume: a job stopped after 40 lines, its last one torn, finishes with only the rest.
    partial = out.read_text().splitlines(keepends=True)[:41]
    out.write_text("".join(partial[:40]) + partial[40][:15])
    assert cli([*args, "--output", str(out), "--resume"]) == 0
    assert _sorted_lines(out) == local
