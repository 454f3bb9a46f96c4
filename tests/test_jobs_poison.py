"""Poison input in extraction jobs (security review f3ae331, M6 and L6): a line nested past what
json can parse, a record that cannot be written into its prompt, or output lines like those, are
that one line's row; the job and its --resume go on. A schema module's folder leaves sys.path."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from asyncpage import AsyncEngine, InvalidRequestError
from asyncpage.cli import main as cli
from asyncpage.extract.jobs import done_lines, load_examples, load_schema

SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 6}}, "required": ["word"],
          "additionalProperties": False}
DEEP = 100_000


def _rows(out: Path) -> dict[int, dict[str, Any]]:
    rows = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    by_line = {r["line"]: r for r in rows}
    assert len(by_line) == len(rows)  # every line answered once
    return by_line


def _job_args(tiny_llama: Path, tmp_path: Path, inp: Path, out: Path) -> list[str]:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    return ["extract", "--schema", str(schema), "--input", str(inp), "--output", str(out), "--model", str(tiny_llama),
            "--dtype", "float32", "--prompt", "{text}\\nAs JSON: ", "--max-tokens", "8", "--concurrency", "2",
            "--no-progress"]


def test_a_line_nested_100k_deep_is_its_own_error_row_and_resume_finishes(
        tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [json.dumps({"id": "a", "text": "alpha"}),
             "[" * DEEP + "]" * DEEP,  # RecursionError in json.loads
             json.dumps({"id": "b", "text": "beta"}),
             '{"id": "deep", "text": "x", "more": ' + "[" * DEEP + "]" * DEEP + "}",
             json.dumps({"id": "c", "text": "gamma"})]
    inp.write_text("\n".join(lines) + "\n")
    args = _job_args(tiny_llama, tmp_path, inp, out)
    assert cli(args) == 0, capsys.readouterr().err
    print(capsys.readouterr().err)
    rows = _rows(out)
    assert sorted(rows) == [1, 2, 3, 4, 5]
    for n in (2, 4):
        assert rows[n]["error"]["reason"] == "invalid_input"
        assert "deep" in rows[n]["error"]["message"]
    for n in (1, 3, 5):  # the others got the model's answer (a tiny random model: a value or truncated)
        assert rows[n].get("error", {}).get("reason") != "invalid_input"
        assert rows[n]["id"] == {1: "a", 3: "b", 5: "c"}[n]

    # A run cut short: only the deep line's row was written, and a foreign line nested 100k deep
    # (and a torn tail) sit in the output. --resume redoes the rest and leaves the deep line answered.
    out.write_text(json.dumps(rows[2]) + "\n" + "[" * DEEP + "]" * DEEP + "\n" + '{"id": "a", "val')
    assert cli([*args, "--resume"]) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    print(err)
    assert "1 skipped" in err
    again = [json.loads(x) for x in out.read_text().splitlines()[2:]]  # what the resumed run added
    assert sorted(r["line"] for r in again) == [1, 3, 4, 5]
    assert cli([*args, "--resume"]) == 0
    assert "5 skipped" in capsys.readouterr().err


def test_done_lines_passes_over_output_lines_it_cannot_parse(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text("[" * DEEP + "]" * DEEP + "\n" + json.dumps({"id": 1, "value": {}, "line": 3}) + "\n"
                   + '{"id": "x", "value": {"a": ' + "[" * DEEP + "]" * DEEP + "}, \"line\": 4}\n")
    done = done_lines(out)
    assert 3 in done and len(done) == 1


async def test_a_record_that_cannot_be_written_into_its_prompt_is_its_own_error(tiny_llama: Path) -> None:
    engine = AsyncEngine.from_pretrained(str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=128)
    deep: Any = []
    for _ in range(DEEP):
        deep = [deep]
    records = [{"id": "ok", "text": "alpha"}, {"id": "deep", "text": deep}, {"id": "set", "text": {1, 2}},
               {"id": "ok2", "text": "beta"}]
    async with engine:
        seen = {r.id: r async for r in engine.extract_many(records, SCHEMA, prompt="{text}\nAs JSON: ",
                                                            params=None, concurrency=2)}
    assert set(seen) == {"ok", "deep", "set", "ok2"}
    for rid in ("deep", "set"):
        err = seen[rid].error
        assert err is not None and err.reason == "invalid_input", err
    for rid in ("ok", "ok2"):
        assert seen[rid].error is None or seen[rid].error.reason != "invalid_input"


def test_an_examples_file_with_a_deep_line_is_a_typed_error(tmp_path: Path) -> None:
    path = tmp_path / "examples.jsonl"
    path.write_text(json.dumps({"text": "a", "value": {"word": "a"}}) + "\n" + "[" * DEEP + "]" * DEEP + "\n")
    with pytest.raises(InvalidRequestError) as err:
        load_examples(path)
    assert err.value.field == "examples" and "line 2" in err.value.message


def test_a_schema_module_does_not_leave_its_folder_on_sys_path(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "poison_schema_mod.py").write_text("import msgspec\n\nclass Word(msgspec.Struct):\n    word: str\n")
    monkeypatch.chdir(tmp_path)
    before = list(sys.path)
    target = load_schema("poison_schema_mod:Word")
    assert target.__name__ == "Word"
    assert sys.path == before and os.getcwd() not in sys.path
    with pytest.raises(InvalidRequestError):
        load_schema("poison_schema_mod:Nope")
    assert sys.path == before


async def test_a_job_on_a_full_engine_waits_for_room_instead_of_ending(tiny_llama: Path) -> None:
    """Another caller holds the batch and the job fills the queue (max_queued_requests=2): the job's
    records wait for room (the job used to end with QueueFullError), each gets its own result, and the
    other caller's requests finish too."""
    from asyncpage import QueueFullError, SamplingParams

    engine = AsyncEngine.from_pretrained(str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=256,
                                         max_num_seqs=2, max_queued_requests=2)
    records = [{"id": f"r{i}", "text": f"item {i}"} for i in range(6)]
    async with engine:
        other = [engine.stream("busy " * 8, SamplingParams(max_tokens=8, temperature=0)) for _ in range(2)]
        firsts = [await s.__anext__() for s in other]  # running: the queue is the job's to fill
        with pytest.raises(QueueFullError):  # the engine really is full for a plain submit
            await asyncio_gather_submits(engine, 8)
        seen = {r.id: r async for r in engine.extract_many(records, SCHEMA, prompt="{text}\nAs JSON: ",
                                                            concurrency=4)}
        rest = [[c async for c in s] for s in other]
    assert set(seen) == {r["id"] for r in records}
    assert all(r.error is None or r.error.reason != "engine_error" for r in seen.values()), seen
    assert all(f.token_ids for f in firsts) and all(r for r in rest)


async def asyncio_gather_submits(engine: AsyncEngine, n: int) -> None:
    """Submit n requests at once without reading them (they are aborted after)."""
    from asyncpage import SamplingParams

    reqs = []
    try:
        for _ in range(n):
            reqs.append(await engine.submit("x " * 4, SamplingParams(max_tokens=2)))
    finally:
        for r in reqs:
            engine.abort(r)
