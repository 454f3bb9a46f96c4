"""Extraction on a Ray cluster: Ray Data feeds records to a pool of actors, one engine each.

Owns the Ray side of extraction: `extract_dataset` (a `ray.data.Dataset` in, a Dataset of results
out) and `run_job` (`asyncpage extract --ray`: a JSONL file in, one JSONL file out). Each actor loads
the model once and runs `extract_many` over every batch Ray hands it, so it batches continuously like
the in-process engine. Record parsing, ids, output lines, resume and error reasons are
asyncpage.extract.jobs' and asyncpage.extract.run's; this module only moves them across Ray and must not grow its
own versions. Needs the optional extra: `pip install 'asyncpage[ray]'`.

    ds = ray.data.read_json("s3://bucket/records/")
    out = extract_dataset(ds, Invoice, num_actors=8, model="/models/gemma")
    out.write_parquet("s3://bucket/invoices/")
"""

from __future__ import annotations

import asyncio
import inspect
import io
import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from asyncpage.engine import AsyncEngine
from asyncpage.errors import InvalidRequestError
from asyncpage.extract.beams import refuse_asked_beams
from asyncpage.extract.jobs import (
    DoneLines,
    JobSummary,
    ResultWriter,
    check_paths,
    input_lines,
    job_params,
    open_output,
    parse_line,
    unfinished,
)
from asyncpage.extract.many import extract_many
from asyncpage.extract.prompt import PromptTemplate
from asyncpage.extract.run import ExtractError, ExtractResult, beams_per_record, check_job
from asyncpage.extract.types import enc_hook
from asyncpage.params import SamplingParams

try:
    import pyarrow as pa
    import ray
    import ray.data
    from ray.data.datasource import FileBasedDatasource
except ImportError as exc:  # the core install stays lean: Ray is an extra
    raise ImportError("asyncpage.ray needs Ray Data: pip install 'asyncpage[ray]' (or 'ray[data]')") from exc

# Fixed column types: every block of the result has the same schema, whatever its rows hold.
# `value` is JSON text because Arrow cannot hold arbitrary JSON losslessly (a struct column would
# add the keys one value lacks as nulls, and mixed types do not fit one column).
ERROR_TYPE = pa.struct([("reason", pa.string()), ("message", pa.string())])


@dataclass(frozen=True)
class _Job:
    """What every actor needs besides the engine; shipped to each actor once."""

    schema: Any
    params: SamplingParams | None
    prompt: PromptTemplate | None
    concurrency: int
    id_field: str
    max_prompt_tokens: int | None
    copy_fields: Sequence[str] | str | None
    examples: Sequence[Mapping[str, Any]]
    beam_width: int | None
    score_booleans: bool | None
    jsonl: bool  # rows are (line, raw) input lines of a JSONL file, not records
    max_retries: int = 0
    confidence: bool = False  # rows are (line, raw) input lines of a JSONL file, not records


class _Extractor:
    """A Ray Data callable class: built once per actor (the model loads here), called per batch."""

    def __init__(self, job: _Job, engine_options: dict[str, Any]) -> None:
        self.job = job
        self.engine: AsyncEngine = AsyncEngine.from_pretrained(**engine_options)
        self._started: asyncio.Future[Any] | None = None

    async def __call__(self, batch: pa.Table) -> pa.Table:
        # Started on the first call, on the loop Ray runs this actor's batches on (an engine binds to
        # the loop that starts it); concurrent batches share the one engine, so they batch together.
        if self._started is None:
            self._started = asyncio.ensure_future(self.engine.__aenter__())
        await asyncio.shield(self._started)
        job = self.job
        rows = batch.to_pylist()
        results: list[ExtractResult | None] = [None] * len(rows)
        records: list[dict[str, Any]] = []
        slots: list[int] = []
        for i, row in enumerate(rows):
            if job.jsonl:
                rid, rec, error = parse_line(row["line"], row["raw"], job.id_field)
                if rec is None:
                    results[i] = ExtractResult(rid, error=ExtractError("invalid_input", error))
                    continue
                row = rec
            elif job.id_field not in row:
                raise InvalidRequestError("id_field", f"the dataset has no column {job.id_field!r} to tag results "
                                                      "with (name one with id_field=)")
            records.append(row)
            slots.append(i)
        async for r in extract_many(self.engine, records, job.schema, prompt=job.prompt,
                                    concurrency=job.concurrency, params=job.params, id_field=job.id_field,
                                    max_prompt_tokens=job.max_prompt_tokens, copy_fields=job.copy_fields,
                                    examples=job.examples, beam_width=job.beam_width,
                                    score_booleans=job.score_booleans, max_retries=job.max_retries,
                                    confidence=job.confidence):
            results[slots[r.position - 1]] = r
        done = [r for r in results if r is not None]
        assert len(done) == len(rows)  # extract_many answers every record it is given
        if job.jsonl:
            # A file's ids may mix types (and "line-n" stands in for missing ones): JSON text fits one column.
            ids = pa.array([json.dumps(r.id) for r in done], pa.string())
            extra = {"line": pa.array([row["line"] for row in rows], pa.int64())}
        else:
            ids, extra = batch.column(job.id_field), {}
        return pa.table({
            "id": ids,
            "value": pa.array([None if r.error else msgspec.json.encode(r.value, enc_hook=enc_hook).decode()
                               for r in done], pa.string()),
            "error": pa.array([msgspec.to_builtins(r.error) if r.error else None for r in done], ERROR_TYPE),
            "closed_early": pa.array([r.closed_early for r in done], pa.bool_()),
            "prompt_tokens": pa.array([r.prompt_tokens for r in done], pa.int64()),
            "output_tokens": pa.array([r.output_tokens for r in done], pa.int64()),
            "attempts": pa.array([r.attempts for r in done], pa.int64()),
            "confidence": pa.array([None if r.confidence is None else json.dumps(r.confidence) for r in done],
                                   pa.string()),
            **extra,
        })


def extract_dataset(ds: ray.data.Dataset, schema: Any, *, num_actors: int = 1, num_cpus_per_actor: float = 1,
                    batch_size: int | None = None, prompt: PromptTemplate | None = None, concurrency: int = 16,
                    params: SamplingParams | None = None, id_field: str = "id", max_prompt_tokens: int | None = None,
                    copy_fields: Sequence[str] | str | None = None, examples: Sequence[Mapping[str, Any]] = (),
                    beam_width: int | None = None, score_booleans: bool | None = None, max_retries: int = 0,
                    confidence: bool = False, model: str | os.PathLike[str] | None = None,
                    **engine_options: Any) -> ray.data.Dataset:
    """Extract `schema` from every row of `ds` on `num_actors` actors, one engine each (the model and
    `engine_options` as AsyncEngine.from_pretrained takes them; `num_threads` defaults to the actor's
    CPUs). The other arguments are extract_many's. Rows are records: their fields fill the prompt and
    their `id_field` column tags the results.

    Returns a Dataset with one row per input row, in no particular order: `id`, then `value` (the
    value as JSON text) or `error` (`{reason, message}`, the reasons of `asyncpage extract`: a
    record's own failure is its row, never the job's), `closed_early`, `prompt_tokens`,
    `output_tokens`, `attempts`, `confidence` (JSON text, or null without `confidence=True`). Lazy, like
    every Dataset: nothing runs until it is consumed or written.
    """
    job = _Job(schema, params, prompt, concurrency, id_field, max_prompt_tokens, copy_fields, tuple(examples),
               beam_width, score_booleans, jsonl=False, max_retries=max_retries, confidence=confidence)
    options = {"model": model, **engine_options}
    _refuse(job, options, num_actors)  # here, not in every actor (a Ray task error, after the model loaded)
    return _map(ds, job, num_actors=num_actors, num_cpus_per_actor=num_cpus_per_actor, batch_size=batch_size,
                engine_options=options)


def _refuse(job: _Job, engine_options: Mapping[str, Any], num_actors: int) -> None:
    """What extract_many refuses up front, inside the actors (its options, extract_beams.refuse_asked_beams),
    is refused on the driver, with the engine limits the actors will have; and no actors."""
    if num_actors < 1:
        raise InvalidRequestError("num_actors", "must be >= 1")
    check_job(job.prompt, job.examples, job.concurrency, job.schema, job.copy_fields)
    defaults = inspect.signature(AsyncEngine.from_pretrained).parameters
    refuse_asked_beams(job.params or SamplingParams(), job.beam_width,
                       max_num_seqs=engine_options.get("max_num_seqs", defaults["max_num_seqs"].default),
                       max_num_batched_tokens=engine_options.get("max_num_batched_tokens",
                                                                 defaults["max_num_batched_tokens"].default))


def _map(ds: ray.data.Dataset, job: _Job, *, num_actors: int, num_cpus_per_actor: float, batch_size: int | None,
         engine_options: dict[str, Any]) -> ray.data.Dataset:
    # Ray gives each actor OMP_NUM_THREADS = its CPUs; the engine's own default (every core of the
    # machine) would oversubscribe it with several actors per machine.
    engine_options.setdefault("num_threads", None)
    if engine_options["num_threads"] is None:
        engine_options["num_threads"] = max(1, int(num_cpus_per_actor))
    # Two calls in flight per actor, on its one engine: while one batch's last records finish, the
    # next batch's fill the freed slots (one call at a time, measured: each batch drained to idle).
    pool = ray.data.ActorPoolStrategy(size=num_actors, max_concurrent_calls_per_actor=2)
    return ds.map_batches(
        _Extractor, fn_constructor_args=(job, engine_options), batch_format="pyarrow",
        # Batches of two engine-fulls: small enough to spread over the actors, large enough that
        # the calls' overheads stay small.
        batch_size=batch_size or 2 * job.concurrency, compute=pool, num_cpus=num_cpus_per_actor)


class _JsonLines(FileBasedDatasource):
    """A JSONL file as rows (line, raw bytes), numbered and split exactly as the in-process job does
    (Ray's read_text splits on every Unicode line break and decodes, which would renumber lines and
    fail on a bad byte). Lines `done` answers are never read into the Dataset."""

    ROWS_PER_BLOCK = 1024

    def __init__(self, path: str, done: DoneLines, id_field: str) -> None:
        super().__init__(path)
        self.done = done
        self.id_field = id_field

    def _read_stream(self, f: pa.NativeFile, path: str) -> Iterator[pa.Table]:
        lines: list[int] = []
        raws: list[bytes] = []
        for n, raw in input_lines(io.BufferedReader(f)):
            if self.done.skips(n, raw, self.id_field):
                continue
            lines.append(n)
            raws.append(raw)
            if len(lines) == self.ROWS_PER_BLOCK:
                yield pa.table({"line": pa.array(lines, pa.int64()), "raw": pa.array(raws, pa.binary())})
                lines, raws = [], []
        if lines:
            yield pa.table({"line": pa.array(lines, pa.int64()), "raw": pa.array(raws, pa.binary())})


def _result(row: dict[str, Any]) -> ExtractResult:
    """A result row of a JSONL job back into the ExtractResult the in-process job would have written."""
    error = row["error"]
    return ExtractResult(json.loads(row["id"]),
                         value=json.loads(row["value"]) if row["value"] is not None else None,
                         error=ExtractError(**error) if error is not None else None,
                         prompt_tokens=row["prompt_tokens"], output_tokens=row["output_tokens"],
                         closed_early=row["closed_early"], attempts=row["attempts"],
                         confidence=json.loads(row["confidence"]) if row["confidence"] is not None else None)


def run_job(input_path: Path, output_path: Path, schema: Any, *, num_actors: int = 1, resume: bool = False,
            progress: bool = True, prompt: PromptTemplate | None = None, concurrency: int = 16, max_tokens: int = 512,
            id_field: str = "id", max_prompt_tokens: int | None = None,
            copy_fields: Sequence[str] | str | None = None, examples: Sequence[Mapping[str, Any]] = (),
            beam_width: int | None = None, score_booleans: bool | None = None, max_retries: int = 0,
            confidence: bool = False, **engine_options: Any) -> JobSummary:
    """`asyncpage extract --ray`: asyncpage.extract.jobs.run_job's contract (one output line per non-blank
    input line across interrupted runs, `resume` skipping the lines already answered) with the records
    read by Ray Data and extracted by `num_actors` actors. The output is written here, by the driver,
    as results arrive: one file, flushed line by line, as resumable as the in-process one. Connects
    to the cluster at RAY_ADDRESS, else starts a local one for the job (and stops it after)."""
    # Refused before a cluster starts: bad options, missing files.
    width = beams_per_record(schema, copy_fields, beam_width)
    check_paths(input_path, output_path)
    job = _Job(schema, job_params(max_tokens), prompt, concurrency, id_field, max_prompt_tokens, copy_fields,
               tuple(examples), beam_width, score_booleans, jsonl=True, max_retries=max_retries,
               confidence=confidence)
    options = {"max_num_seqs": max(concurrency * width, 1), **engine_options}
    _refuse(job, options, num_actors)
    done = open_output(output_path, resume)
    started = not ray.is_initialized()
    if started:
        # A local cluster needs a CPU per actor; the reading task asks for none (it is I/O).
        ray.init(num_cpus=None if os.environ.get("RAY_ADDRESS") else max(num_actors, os.cpu_count() or 1),
                 include_dashboard=False, log_to_driver=False)
    try:
        ray.data.DataContext.get_current().enable_progress_bars = progress
        reader = _JsonLines(str(input_path.resolve()), done, id_field)
        ds = ray.data.read_datasource(reader, num_cpus=0)
        out = _map(ds, job, num_actors=num_actors, num_cpus_per_actor=1, batch_size=None, engine_options=options)
        return _write(out, output_path, JobSummary(skipped=len(done)))
    finally:
        if started:
            ray.shutdown()


def _write(out: ray.data.Dataset, output_path: Path, summary: JobSummary) -> JobSummary:
    written = DoneLines()  # a batch Ray retried after its actor died may come twice: write each line once
    engine_error: ExtractResult | None = None
    t0 = time.perf_counter()
    with output_path.open("a", encoding="utf-8") as f:
        writer = ResultWriter(f, summary)
        try:
            for batch in out.iter_batches(batch_format="pyarrow", batch_size=None):
                assert isinstance(batch, pa.Table)
                for row in batch.to_pylist():
                    r = _result(row)
                    if r.error is not None and r.error.reason == "engine_error":
                        engine_error = engine_error or r  # not final: left for the resumed run
                    elif row["line"] not in written:
                        written.add(row["line"])
                        writer.write(r, row["line"])
            if engine_error is not None:
                raise unfinished(engine_error)
        except BaseException:
            summary.interrupted = True
            raise
        finally:
            summary.wall_s = time.perf_counter() - t0
    return summary
