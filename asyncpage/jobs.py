"""`asyncpage extract`: a JSONL file of records in, a JSONL file of typed results out.

Every input line gets exactly one output line, `{"id": ..., "value": ...}` or
`{"id": ..., "error": {"reason": ..., "message": ...}}`. Lines are written whole and flushed one by
one, so an interrupted job (Ctrl-C, a kill) leaves a valid file that `--resume` continues: ids
already in the output are skipped, and a torn last line from a hard kill is cut off first.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import msgspec

from asyncpage.engine import AsyncEngine
from asyncpage.errors import InvalidRequestError
from asyncpage.extract import DEFAULT_PROMPT, ExtractError, ExtractResult
from asyncpage.params import SamplingParams


def load_schema(spec: str) -> Any:
    """A JSON Schema file, or `module:Name` naming a msgspec Struct (or any msgspec-describable type)."""
    path = Path(spec)
    if path.suffix == ".json" or path.exists():
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise InvalidRequestError("schema", f"cannot read JSON Schema {spec}: {exc}") from exc
    if ":" in spec:
        module, _, name = spec.partition(":")
        sys.path.insert(0, os.getcwd())
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise InvalidRequestError("schema", f"cannot import {spec}: {exc}") from exc
    raise InvalidRequestError("schema", f"{spec!r} is neither a JSON Schema file nor module:Name")


def done_ids(output: Path) -> set[str]:
    """Ids already in `output`; cuts a torn last line (a write interrupted by a hard kill)."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with output.open("r+b") as f:
            f.truncate(end)
    ids = set()
    for line in data[:end].splitlines():
        try:
            ids.add(_key(json.loads(line)["id"]))
        except (ValueError, KeyError, TypeError):
            continue
    return ids


def _key(rid: Any) -> str:
    return json.dumps(rid, sort_keys=True)


@dataclass
class JobSummary:
    done: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    skipped: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    interrupted: bool = False

    def lines(self) -> list[str]:
        rate = self.done + sum(self.failed.values())
        out = [f"records: {self.done} done, {sum(self.failed.values())} failed"
               + (f" ({', '.join(f'{k}: {v}' for k, v in sorted(self.failed.items()))})" if self.failed else "")
               + (f", {self.skipped} skipped (already in the output)" if self.skipped else ""),
               f"tokens: {self.prompt_tokens} prompt, {self.output_tokens} output",
               f"wall time {self.wall_s:.1f} s: {rate / max(self.wall_s, 1e-9):.2f} records/s, "
               f"{self.output_tokens / max(self.wall_s, 1e-9):.1f} output tokens/s"]
        if self.interrupted:
            out.append("interrupted: the output is valid; run again with --resume to finish")
        return out


class _Writer:
    def __init__(self, f: TextIO, summary: JobSummary) -> None:
        self.f = f
        self.summary = summary

    def write(self, r: ExtractResult) -> None:
        line = {"id": r.id, "error": msgspec.to_builtins(r.error)} if r.error else {"id": r.id, "value": r.value}
        self.f.write(json.dumps(msgspec.to_builtins(line), ensure_ascii=False) + "\n")
        self.f.flush()
        if r.error:
            self.summary.failed[r.error.reason] += 1
        else:
            self.summary.done += 1
        self.summary.prompt_tokens += r.prompt_tokens
        self.summary.output_tokens += r.output_tokens


async def run_job(engine: AsyncEngine, schema: Any, input_path: Path, output_path: Path, *,
                  prompt: str = DEFAULT_PROMPT, concurrency: int = 16, max_tokens: int = 512, resume: bool = False,
                  id_field: str = "id", max_prompt_tokens: int | None = None, progress: bool = True) -> JobSummary:
    if output_path.exists() and not resume and output_path.stat().st_size:
        raise InvalidRequestError("output", f"{output_path} exists; pass --resume to continue it")
    skip = done_ids(output_path) if resume else set()
    summary = JobSummary()
    total = sum(1 for line in input_path.open(encoding="utf-8") if line.strip())
    bar: Any = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="rec", desc="extract", dynamic_ncols=True)
    t0 = time.perf_counter()
    with output_path.open("a", encoding="utf-8") as f:
        writer = _Writer(f, summary)

        def records() -> Iterator[dict[str, Any]]:
            with input_path.open(encoding="utf-8") as inp:
                for n, line in enumerate(inp, 1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                        if not isinstance(rec, dict):
                            raise ValueError(f"a record must be a JSON object, got {type(rec).__name__}")
                    except ValueError as exc:
                        rid: Any = f"line-{n}"
                        if _key(rid) in skip:
                            summary.skipped += 1
                        else:
                            writer.write(ExtractResult(rid, error=ExtractError("invalid_input", str(exc))))
                        _tick()
                        continue
                    rec.setdefault(id_field, f"line-{n}")
                    if _key(rec[id_field]) in skip:
                        summary.skipped += 1
                        _tick()
                        continue
                    yield rec

        def _tick() -> None:
            if bar is not None:
                bar.update(1)
                dt = time.perf_counter() - t0
                bar.set_postfix_str(f"{summary.output_tokens / max(dt, 1e-9):.0f} tok/s, "
                                    f"{sum(summary.failed.values())} failed", refresh=False)

        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        try:
            async for result in engine.extract_many(records(), schema, prompt=prompt, concurrency=concurrency,
                                                    params=params, id_field=id_field,
                                                    max_prompt_tokens=max_prompt_tokens):
                writer.write(result)
                _tick()
        except BaseException:
            summary.interrupted = True
            raise
        finally:
            summary.wall_s = time.perf_counter() - t0
            if bar is not None:
                bar.close()
    return summary
