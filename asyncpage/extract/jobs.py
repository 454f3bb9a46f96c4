"""`asyncpage extract`: a JSONL file of records in, a JSONL file of typed results out.

Every non-blank input line gets exactly one output line, `{"id": ..., "value": ..., "line": n}` or
`{"id": ..., "error": {"reason": ..., "message": ...}, "line": n}` (n: the input line it answers).
Lines are written whole and flushed one by one, so an interrupted job (Ctrl-C, a kill, a dead
engine) leaves a valid file that `--resume` continues: input lines
already in the output are skipped, and a torn last line from a hard kill is cut off first.
A line that cannot be read as a record (bad bytes, not JSON, nested past what the parser takes) is
that line's `invalid_input` row, and an output line that cannot be parsed is passed over: no single
line ends a job, or every resume of it.
"""

from __future__ import annotations

import codecs
import importlib
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TextIO

import msgspec

from asyncpage.core.client import EngineClient
from asyncpage.errors import EngineDeadError, InvalidRequestError
from asyncpage.extract.many import extract_many
from asyncpage.extract.run import ExtractError, ExtractResult
from asyncpage.extract.types import enc_hook
from asyncpage.params import SamplingParams


def load_schema(spec: str) -> Any:
    """A JSON Schema file, or `module:Name` naming a msgspec Struct (or any msgspec-describable type), or a
    pydantic v2 model (asyncpage.extract.types)."""
    path = Path(spec)
    if path.suffix == ".json" or path.exists():
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise InvalidRequestError("schema", f"cannot read JSON Schema {spec}: {exc}") from exc
    if ":" in spec:
        module, _, name = spec.partition(":")
        # The working directory only for this import: left on sys.path, a file there named like a
        # module imported later (tqdm, jsonschema, llguidance) would be imported instead.
        cwd = os.getcwd()
        sys.path.insert(0, cwd)
        try:
            return getattr(importlib.import_module(module), name)
        except Exception as exc:  # ImportError, AttributeError, or whatever the module's own code raised
            raise InvalidRequestError("schema", f"cannot import {spec}: {exc!r}") from exc
        finally:
            if cwd in sys.path:
                sys.path.remove(cwd)  # the first one: ours, unless the module moved it
    raise InvalidRequestError("schema", f"{spec!r} is neither a JSON Schema file nor module:Name")


def load_examples(path: Path) -> list[dict[str, Any]]:
    """Solved records for the default prompt: JSONL lines {"text": ..., "value": {...}}."""
    try:
        # utf-8-sig: files saved by Windows tools often start with a byte-order mark.
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except (OSError, ValueError) as exc:
        raise InvalidRequestError("examples", f"cannot read {path}: {exc}") from exc
    rows = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except (ValueError, RecursionError) as exc:
                raise InvalidRequestError("examples", f"{path}: line {n}: {_why_not_json(exc)}") from None
    if not all(isinstance(r, dict) and isinstance(r.get("text"), str) and "value" in r for r in rows):
        raise InvalidRequestError("examples", f"{path}: every line must be {{\"text\": ..., \"value\": ...}}")
    return rows


MAX_LINE = 1 << 36  # a line number past this is not one of ours
_BITMAP_LINES = 1 << 27  # a 16 MB bitmap at most: line numbers past it (a corrupt or foreign line) go in a set


class DoneLines:
    """Which input lines an output file already answers: a bitmap over line numbers (a million
    records cost 125 KB, whatever their ids), read by streaming the file, never loading it whole."""

    def __init__(self) -> None:
        self._bits = bytearray()
        self._far: set[int] = set()  # one stray huge line number must not cost a bitmap up to it
        self.legacy_ids: set[str] = set()  # outputs written before lines were recorded carry ids only

    def add(self, line: int) -> None:
        if line >= _BITMAP_LINES:
            self._far.add(line)
            return
        byte = line >> 3
        if byte >= len(self._bits):
            self._bits.extend(bytes(byte + 1 - len(self._bits)))
        self._bits[byte] |= 1 << (line & 7)

    def __contains__(self, line: int) -> bool:
        if line >= _BITMAP_LINES:
            return line in self._far
        byte = line >> 3
        return byte < len(self._bits) and bool(self._bits[byte] & (1 << (line & 7)))

    def __len__(self) -> int:
        return sum(b.bit_count() for b in self._bits) + len(self._far) + len(self.legacy_ids)

    def skips(self, line: int, raw: bytes, id_field: str) -> bool:
        """Whether input line `line` (its bytes `raw`) is answered already; the bytes are parsed only
        when the output holds legacy id-only lines."""
        if line in self:
            return True
        if not self.legacy_ids:
            return False
        key = _key(parse_line(line, raw, id_field)[0])
        return key is not None and key in self.legacy_ids


def cut_torn_tail(output: Path) -> None:
    """A hard kill can leave a last line without its newline: cut it (that record is redone)."""
    with output.open("r+b") as f:
        end = f.seek(0, os.SEEK_END)
        pos = end
        while pos > 0:
            step = min(65536, pos)
            f.seek(pos - step)
            chunk = f.read(step)
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                pos = pos - step + nl + 1
                break
            pos -= step
        if pos < end:
            f.truncate(pos)


def done_lines(output: Path) -> DoneLines:
    """The input lines `output` already holds a final line for (after cutting a torn tail)."""
    done = DoneLines()
    if not output.exists():
        return done
    cut_torn_tail(output)
    with output.open("rb") as f:
        for raw in f:
            try:
                row = json.loads(raw)
            except (ValueError, RecursionError):  # not one of ours (a foreign or corrupt line): passed over
                continue
            if not isinstance(row, dict):
                continue
            error = row.get("error")
            if isinstance(error, dict) and error.get("reason") == "engine_error":
                continue  # written by older versions; never final: redo it
            line = row.get("line")
            if type(line) is int and 1 <= line <= MAX_LINE:
                done.add(line)
            elif "line" not in row and "id" in row:
                key = _key(row["id"])
                if key is not None:
                    done.legacy_ids.add(key)
    return done


def _key(rid: Any) -> str | None:
    """A legacy id's key; None for an id too deep to write again (no input line can match it then)."""
    try:
        return json.dumps(rid, sort_keys=True)
    except (ValueError, TypeError, RecursionError):
        return None


_TOO_DEEP = "nested too deeply to parse (past the JSON parser's depth limit)"


def _why_not_json(exc: BaseException) -> str:
    return _TOO_DEEP if isinstance(exc, RecursionError) else str(exc)


def input_lines(f: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) for each non-blank line of a binary stream. Lines are split on b"\\n" only
    and numbered with the blank ones counted: the numbers are what outputs and resumes key on."""
    for n, raw in enumerate(f, 1):
        if n == 1:
            raw = raw.removeprefix(codecs.BOM_UTF8)  # a byte-order mark (Windows tools) is not the record's
        if raw.strip():
            yield n, raw


def parse_line(n: int, raw: bytes, id_field: str) -> tuple[Any, dict[str, Any] | None, str]:
    """Input line `n` as (id, record, "") or (id, None, why it is not a record). Read from bytes: one
    bad byte is that line's error, never the job's. A record without `id_field` gets "line-n",
    written into it so that its prompt and its result agree."""
    rid = f"line-{n}"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return rid, None, f"line {n} is not valid UTF-8: {exc}"
    try:
        rec = json.loads(text)
    except ValueError as exc:
        return rid, None, str(exc)
    except RecursionError:  # json.loads' depth limit: "[" * 100_000 is one bad line, not a dead job
        return rid, None, f"line {n} is {_TOO_DEEP}"
    if not isinstance(rec, dict):
        return rid, None, f"a record must be a JSON object, got {type(rec).__name__}"
    rec.setdefault(id_field, rid)
    return rec[id_field], rec, ""


def job_params(max_tokens: int) -> SamplingParams:
    """What `asyncpage extract` samples with, in-process or on Ray: greedy, so that reruns agree."""
    return SamplingParams(max_tokens=max_tokens, temperature=0)


def check_paths(input_path: Path, output_path: Path) -> None:
    """A job's files, checked before any model loads: the input a readable regular file (it is read
    twice: counted, then extracted, so a pipe will not do), the output's folder there, the output
    not a folder and not the input."""
    if not input_path.is_file():
        why = ("does not exist" if not input_path.exists() else "is a directory" if input_path.is_dir()
               else "is not a regular file (the job reads its input twice: to count it, then to extract)")
        raise InvalidRequestError("input", f"{input_path} {why}")
    if not os.access(input_path, os.R_OK):
        raise InvalidRequestError("input", f"{input_path} is not readable")
    if output_path.is_dir():
        raise InvalidRequestError("output", f"{output_path} is a directory")
    if output_path.exists() and os.path.samefile(input_path, output_path):
        raise InvalidRequestError("output", f"{output_path} is the input file")
    folder = output_path.parent
    if not folder.is_dir():
        raise InvalidRequestError("output", f"the folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (output_path.exists() and not os.access(output_path, os.W_OK)):
        raise InvalidRequestError("output", f"{output_path} is not writable")


def open_output(output_path: Path, resume: bool) -> DoneLines:
    """The lines a job must not redo: none for a fresh output (refusing to append to a full one
    unless resuming), else those `output_path` answers."""
    if output_path.exists() and not resume and output_path.stat().st_size:
        raise InvalidRequestError("output", f"{output_path} exists; pass --resume to continue it")
    return done_lines(output_path) if resume else DoneLines()


@dataclass
class JobSummary:
    done: int = 0
    closed_early: int = 0  # done, with a value budget closing ended at max_tokens
    failed: Counter[str] = field(default_factory=Counter)
    skipped: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    interrupted: bool = False

    def lines(self) -> list[str]:
        rate = self.done + sum(self.failed.values())
        out = [f"records: {self.done} done"
               + (f" ({self.closed_early} closed early by max_tokens)" if self.closed_early else "")
               + f", {sum(self.failed.values())} failed"
               + (f" ({', '.join(f'{k}: {v}' for k, v in sorted(self.failed.items()))})" if self.failed else "")
               + (f", {self.skipped} skipped (already in the output)" if self.skipped else ""),
               f"tokens: {self.prompt_tokens} prompt, {self.output_tokens} output",
               f"wall time {self.wall_s:.1f} s: {rate / max(self.wall_s, 1e-9):.2f} records/s, "
               f"{self.output_tokens / max(self.wall_s, 1e-9):.1f} output tokens/s"]
        if self.interrupted:
            out.append("interrupted: the output is valid; run again with --resume to finish")
        return out


def unfinished(engine_error: ExtractResult) -> EngineDeadError:
    """What a job raises at its end when an engine died or closed under some records: they have no
    line, so that a resumed run does them."""
    assert engine_error.error is not None
    return EngineDeadError(f"some records could not be processed ({engine_error.error.message}); "
                           "they are not in the output: run again with --resume")


def result_line(r: ExtractResult, line_no: int) -> dict[str, Any]:
    """The output line (JSON builtins) that answers input line `line_no`."""
    line = {"id": r.id, "error": msgspec.to_builtins(r.error)} if r.error else {"id": r.id, "value": r.value}
    if r.closed_early:
        line["closed_early"] = True  # valid, but ended by --max-tokens: maybe shorter than the model's own
    if r.attempts > 1:
        line["attempts"] = r.attempts  # --max-retries decoded a refused value again
    if r.confidence is not None:
        line["confidence"] = r.confidence  # --confidence
    line["line"] = line_no  # the input line it answers: what --resume keys on (ids may repeat or be null)
    return msgspec.to_builtins(line, enc_hook=enc_hook)  # a pydantic value as its JSON dump


def _line_text(line: dict[str, Any]) -> str:
    text = json.dumps(line, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate (json.loads accepts "\\ud800" in an id): written as its escape, valid
        # JSON that reads back the same; unescaped it would kill the job on every resume.
        text = json.dumps(line)
    return text


class ResultWriter:
    """Appends output lines, each whole and flushed (what makes an interrupted output resumable),
    and counts them into a JobSummary."""

    def __init__(self, f: TextIO, summary: JobSummary) -> None:
        self.f = f
        self.summary = summary

    def write(self, r: ExtractResult, line_no: int) -> None:
        try:
            text = _line_text(result_line(r, line_no))
        except (ValueError, TypeError, RecursionError) as exc:
            # An id nested just short of json.loads' limit can be past what writing it takes (a few
            # frames deeper), an API caller's id may not be JSON at all, a recursive schema's value may
            # nest past it too: that line's row says so, instead of ending the job (and every resume).
            why = _why_not_json(exc) if isinstance(exc, RecursionError) else str(exc)
            try:
                _line_text({"id": msgspec.to_builtins(r.id)})
                rid, reason = r.id, "invalid_output"  # the id writes: the value was the culprit
            except (ValueError, TypeError, RecursionError):
                rid, reason = f"line-{line_no}", "invalid_input"
            r = ExtractResult(rid, error=ExtractError(reason, f"the result cannot be written as JSON: {why}"),
                              prompt_tokens=r.prompt_tokens, output_tokens=r.output_tokens)
            text = _line_text(result_line(r, line_no))
        self.f.write(text + "\n")
        self.f.flush()
        self.summary.closed_early += r.closed_early
        if r.error:
            self.summary.failed[r.error.reason] += 1
        else:
            self.summary.done += 1
        self.summary.prompt_tokens += r.prompt_tokens
        self.summary.output_tokens += r.output_tokens


async def run_job(engine: EngineClient, schema: Any, input_path: Path, output_path: Path, *,
                  prompt: str | None = None, concurrency: int = 16, max_tokens: int = 512, resume: bool = False,
                  id_field: str = "id", max_prompt_tokens: int | None = None, progress: bool = True,
                  copy_fields: Sequence[str] | str | None = None,
                  examples: Sequence[Mapping[str, Any]] = (), beam_width: int | None = None,
                  score_booleans: bool | None = None, max_retries: int = 0, confidence: bool = False,
                  score_choices: bool | None = None) -> JobSummary:
    """Every non-blank input line gets exactly one output line across any number of interrupted
    runs: a record is written once it has its final outcome; one whose engine died or closed under
    it is not written (the job stops with the error), so `resume=True` does it again."""
    check_paths(input_path, output_path)
    done = open_output(output_path, resume)
    summary = JobSummary()
    with input_path.open("rb") as src:
        total = sum(1 for _ in input_lines(src))
    bar: Any = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="rec", desc="extract", dynamic_ncols=True)
    t0 = time.perf_counter()
    line_of: dict[int, int] = {}  # position in the record stream -> input line, for records in flight
    with output_path.open("a", encoding="utf-8") as f:
        writer = ResultWriter(f, summary)

        def _tick() -> None:
            if bar is not None:
                bar.update(1)
                dt = time.perf_counter() - t0
                bar.set_postfix_str(f"{summary.output_tokens / max(dt, 1e-9):.0f} tok/s, "
                                    f"{sum(summary.failed.values())} failed", refresh=False)

        def records() -> Iterator[dict[str, Any]]:
            position = 0
            with input_path.open("rb") as src:
                for n, raw in input_lines(src):
                    if done.skips(n, raw, id_field):
                        summary.skipped += 1
                        _tick()
                        continue
                    rid, rec, error = parse_line(n, raw, id_field)
                    if rec is None:
                        writer.write(ExtractResult(rid, error=ExtractError("invalid_input", error)), n)
                        _tick()
                        continue
                    position += 1
                    line_of[position] = n
                    yield rec

        params = job_params(max_tokens)
        engine_error: ExtractResult | None = None
        try:
            async for result in extract_many(engine, records(), schema, prompt=prompt, concurrency=concurrency,
                                             params=params, id_field=id_field,
                                             max_prompt_tokens=max_prompt_tokens, copy_fields=copy_fields,
                                             examples=examples, beam_width=beam_width,
                                             score_booleans=score_booleans, max_retries=max_retries,
                                             confidence=confidence, score_choices=score_choices):
                n = line_of.pop(result.position)
                if result.error is not None and result.error.reason == "engine_error":
                    engine_error = engine_error or result  # not final: left for the resumed run
                    continue
                writer.write(result, n)
                _tick()
            if engine_error is not None:
                raise unfinished(engine_error)
        except BaseException:
            summary.interrupted = True
            raise
        finally:
            summary.wall_s = time.perf_counter() - t0
            if bar is not None:
                bar.close()
    return summary
