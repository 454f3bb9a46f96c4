"""Extraction jobs across interruptions (issue 11, defect 7): every non-blank input line ends with
exactly one output line, whatever the ids, the bytes, the prompt function or the engine do."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from asyncpage import AsyncEngine, EngineDeadError, InvalidRequestError
from asyncpage.cli import main as cli
from asyncpage.extract.jobs import done_lines, run_job

from .conftest import fail_at_step

SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 6}}, "required": ["word"],
          "additionalProperties": False}



def _input(path: Path) -> int:
    """16 records with duplicate, null and missing ids, one invalid UTF-8 line, one non-object line."""
    rows = [json.dumps({"id": i % 5 if i % 3 else None, "text": f"record {i} says hello"}).encode()
            for i in range(14)]
    rows.insert(4, b'{"id": "bad-bytes", "text": "caf\xe9 \xff"}')
    rows.insert(7, b"[1, 2, 3]")
    rows.insert(9, b"")  # blank lines are not records
    path.write_bytes(b"\n".join(rows) + b"\n")
    return 16


def _lines(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]


async def test_a_job_interrupted_by_a_dead_engine_resumes_to_one_line_per_input(tiny_llama: Path,
                                                                                tmp_path: Path) -> None:
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    n_records = _input(inp)
    engine = AsyncEngine.from_pretrained(str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=256)
    real = fail_at_step(engine, 12, "injected device failure")
    async with engine:
        with pytest.raises(EngineDeadError):
            await run_job(engine, SCHEMA, inp, out, concurrency=3, max_tokens=12, progress=False)
    first = _lines(out)
    assert all(r.get("error", {}).get("reason") != "engine_error" for r in first)  # never final
    assert len(first) < n_records

    engine._core.runner.execute = real  # type: ignore[method-assign]
    async with engine:
        summary = await run_job(engine, SCHEMA, inp, out, concurrency=3, max_tokens=12, resume=True,
                                progress=False)
        assert summary.skipped == len(first)
        again = await run_job(engine, SCHEMA, inp, out, concurrency=3, max_tokens=12, resume=True,
                              progress=False)
    rows = _lines(out)
    assert sorted(r["line"] for r in rows) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 14, 15, 16, 17]
    assert len(rows) == n_records and again.skipped == n_records and again.done == 0
    by_line = {r["line"]: r for r in rows}
    assert by_line[5]["error"]["reason"] == "invalid_input" and "UTF-8" in by_line[5]["error"]["message"]
    assert by_line[8]["error"]["reason"] == "invalid_input"
    assert [by_line[n]["id"] for n in (1, 2, 4)] == [None, 1, None]  # ids as given, duplicates and nulls kept


def test_a_torn_last_line_is_cut_and_its_record_redone(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": 1, "value": {}, "line": 1}\n{"id": 2, "value": {}, "line": 3}\n{"id": 3, "val')
    done = done_lines(out)
    assert 1 in done and 3 in done and 2 not in done and 4 not in done
    assert out.read_text().endswith('"line": 3}\n')


async def test_a_prompt_function_that_raises_fails_only_its_record(tiny_llama: Path) -> None:
    def prompt(record: Any) -> str:
        if record["id"] == 2:
            raise KeyError("boom")
        return f"{record['text']} as JSON: "

    engine = AsyncEngine.from_pretrained(str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=256)
    async with engine:
        results = [r async for r in engine.extract_many(
            [{"id": i, "text": f"item {i}"} for i in range(4)], SCHEMA, prompt=prompt,
            params=None, concurrency=2)]
    by_id = {r.id: r for r in results}
    assert set(by_id) == {0, 1, 2, 3}
    assert by_id[2].error is not None and by_id[2].error.reason == "invalid_input" and "boom" in by_id[2].error.message
    assert sorted(r.position for r in results) == [1, 2, 3, 4]


async def test_a_record_without_text_for_the_default_prompt_is_told_so_plainly(tiny_llama: Path) -> None:
    engine = AsyncEngine.from_pretrained(str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=256)
    async with engine:
        [r] = [r async for r in engine.extract_many([{"id": 1, "body": "hello"}], SCHEMA)]
    assert r.error is not None and r.error.reason == "invalid_input"
    assert r.error.message.startswith("prompt: the record has no 'text' string"), r.error.message


def test_resume_redoes_engine_errors_and_ignores_lines_that_are_not_ours(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    rows = [{"id": "a", "value": {}}, {"id": "b", "error": {"reason": "engine_error", "message": "died"}},
            {"id": "c", "value": {}, "line": -1}, {"id": "d", "value": {}, "line": True},
            {"id": "e", "value": {}, "line": 10**12}, {"id": "f", "value": {}, "line": 4},
            {"id": "g", "error": {"reason": "engine_error", "message": "x"}, "line": 5}]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = done_lines(out)
    assert done.legacy_ids == {'"a"'}  # b was never final
    assert [n for n in range(1, 8) if n in done] == [4]


async def test_an_id_with_a_lone_surrogate_and_a_byte_order_mark_are_answered_like_any_record(
        tiny_llama: Path, tmp_path: Path) -> None:
    """json.loads takes "\\ud800" (scraped data has them), and Windows tools start files with a BOM:
    neither may kill the job (a surrogate written raw did, and again on every resume)."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(b'\xef\xbb\xbf{"id": "first", "text": "a"}\n{"id": "x\\ud800", "text": "b"}\n'
                    + '{"id": "Jos\u00e9", "text": "c"}\n'.encode())
    engine = AsyncEngine.from_pretrained(str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=256)
    async with engine:
        summary = await run_job(engine, SCHEMA, inp, out, max_tokens=8, progress=False)
        assert summary.failed.get("invalid_input", 0) == 0
        lines = _lines(out)
        assert [(r["id"], r["line"]) for r in lines] == [("first", 1), ("x\ud800", 2), ("Jos\u00e9", 3)]
        assert "Jos\u00e9" in out.read_text(encoding="utf-8")  # other text stays readable, unescaped
        again = await run_job(engine, SCHEMA, inp, out, max_tokens=8, progress=False, resume=True)
        assert again.skipped == 3 and len(_lines(out)) == 3


def test_a_stray_huge_line_number_in_the_output_costs_no_bitmap(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps({"id": i, "value": {}, "line": n}) + "\n" for i, n in ((1, 2**36), (2, 3))))
    done = done_lines(out)
    assert 2**36 in done and 3 in done and 2 not in done and len(done) == 2
    assert len(done._bits) < 16


def test_missing_or_wrong_files_are_refused_before_the_model_loads(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    schema, inp = tmp_path / "schema.json", tmp_path / "in.jsonl"
    schema.write_text(json.dumps(SCHEMA))
    inp.write_text(json.dumps({"id": 1, "text": "a"}) + "\n")
    cases = [(tmp_path / "nope.jsonl", tmp_path / "out.jsonl", "does not exist"),
             (tmp_path, tmp_path / "out.jsonl", "is a directory"),
             (inp, tmp_path / "no-folder" / "out.jsonl", "does not exist")]
    for src, dst, why in cases:
        # A model path that does not exist: had the files not been refused first, loading would fail.
        assert cli(["extract", "--schema", str(schema), "--input", str(src), "--output", str(dst),
                    "--model", str(tmp_path / "no-model"), "--no-progress"]) == 2
        assert why in capsys.readouterr().err
    from asyncpage.extract.jobs import check_paths

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for src, dst, field in ((inp, tmp_path, "output"), (inp, inp, "output"), (fifo, tmp_path / "o.jsonl", "input")):
        with pytest.raises(InvalidRequestError) as err:  # a folder, the input itself, a pipe read twice
            check_paths(src, dst)
        assert err.value.field == field
    check_paths(inp, Path(os.devnull))  # a device is a fine output
