"""The `asyncpage` command: `asyncpage bench` (figures, optionally against transformers; also
`bench-guided`, `bench-sharing`, `bench-eviction`), `asyncpage generate` (one streamed completion),
`asyncpage extract` (a JSONL job), `asyncpage soak` (a long random run with a verdict) and
`asyncpage serve` (the OpenAI-compatible server; its flags live in asyncpage/serve.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from asyncpage.bench import commands as cli_bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncpage", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="stream one completion to the terminal")
    g.add_argument("prompt")
    _model_args(g)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)

    b = sub.add_parser("bench", help="throughput and latency figures (printed, never asserted)")
    _model_args(b)
    b.add_argument("--workload", default="mixed",
                   choices=["mixed", "shared-prefix", "long-prompt", "single", "extract"],
                   help="extract: an extraction job (extract_many over generated ticket records, one JSON schema), "
                   "records/s beside llama-server with --llama-server PATH (asyncpage/bench/extract_job.py)")
    b.add_argument("-n", "--num-requests", type=int, default=None, help="default 32; 60 records for extract")
    b.add_argument("--max-num-seqs", type=int, default=None,
                   help="default 64; for extract, the parallel requests of both sides (default 16): extract_many's "
                   "concurrency and llama-server's slots")
    b.add_argument("--copy-fields", default=None, metavar="NAMES|auto",
                   help="extract: also run extract_many with these copied fields (as `asyncpage extract`)")
    b.add_argument("--max-num-batched-tokens", type=int, default=512)
    b.add_argument("--num-kv-blocks", type=int, default=None)
    b.add_argument("--no-prefix-caching", action="store_true")
    b.add_argument("--baseline", choices=["transformers", "llama.cpp", "llama-server"], default=None,
                   help="also run transformers' generate() with static batches of 8 on the same weights, "
                   "llama-cpp-python on the same GGUF (with --settings; an optional extra), or llama.cpp's "
                   "llama-server binary with one slot per request on the same GGUF")
    b.add_argument("--llama-server", default=None, metavar="PATH",
                   help="the llama-server binary for --baseline llama-server (default: $LLAMA_SERVER, else PATH)")
    b.add_argument("--llama-bench", default=None, metavar="PATH",
                   help="asyncpage beside llama.cpp on the same GGUF: one stream, prefill of 512 tokens, mixed-32 "
                   "(with --llama-server PATH), resident memory after load and load time, each asyncpage "
                   "--settings (default: defaults) in fresh processes (asyncpage/bench/cpu_path.py)")
    b.add_argument("--settings", default=None, metavar="S1,S2,...",
                   help="compare weight / KV settings side by side, the first as the base, e.g. "
                   "float32,bfloat16,int8,int4,int4+kv=int8 (see asyncpage/bench_quant.py)")
    b.add_argument("--speculative", default=None, metavar="ngram[:K]|draft:PATH[:K]",
                   help="tokens/s without and with speculation (n-gram, or a draft model with the target's tokenizer; "
                   "at most K drafts a step), side by side: "
                   "one stream each of extraction, free text and code, and the mixed workload")
    b.add_argument("--repeat", type=_at_least_one, default=3, metavar="N",
                   help="with --speculative: runs of each one-stream workload per engine, taking turns (medians)")
    b.add_argument("--json", action="store_true", help="print machine-readable results")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--sweep", default=None, help="comma-separated concurrency levels, e.g. 1,4,16,64: one "
                   "run of the workload per level, N = level")
    b.add_argument("--competing-load", type=int, default=0, metavar="N",
                   help="run N busy-looping processes during the measured run (sharing the CPU with other work)")
    b.add_argument("--plot", default=None, help="with --sweep: write a PNG of throughput and latency (matplotlib)")

    gb = sub.add_parser("bench-guided", help="guided decoding: compile / mask time, coverage, throughput")
    _model_args(gb)
    gb.add_argument("--data", default="../shared/data", help="folder with json-schema-test-suite and "
                    "jsonschemabench-dev")
    gb.add_argument("--backend", default="llguidance", choices=["llguidance", "xgrammar"])
    gb.add_argument("-n", "--num-requests", type=int, default=16)
    gb.add_argument("--no-throughput", action="store_true", help="only the model-free figures")

    sh = sub.add_parser("bench-sharing", help="prefix caching (cold vs warm TTFT) and copy-on-write (blocks)")
    _model_args(sh)

    ev = sub.add_parser("bench-eviction", help="prefix-cache eviction: LRU vs the default policy on a tight pool")
    _model_args(ev)
    ev.add_argument("--num-kv-blocks", type=int, default=96, help="the pool (blocks of 16 tokens); one round "
                    "of the default workload needs ~133")
    ev.add_argument("--rounds", type=int, default=8)
    ev.add_argument("--every", type=int, default=4, help="one request in EVERY uses the system prompt")
    ev.add_argument("--system-tokens", type=int, default=512)
    ev.add_argument("--prompt-tokens", type=int, default=512, help="length of each one-off prompt")
    ev.add_argument("--max-tokens", type=int, default=8)
    # float32: in bfloat16 a hit that ends mid-chunk changes how the rest of the prompt is chunked,
    # and rounding alone can flip a greedy token, which would hide a wrong block among false alarms.
    ev.set_defaults(dtype="float32")

    x = sub.add_parser("extract", help="typed JSON from every record of a JSONL file")
    x.add_argument("--schema", required=True, help="a JSON Schema file, or module:Name naming a msgspec Struct or a "
                   "pydantic v2 model")
    x.add_argument("--input", required=True, help="JSONL: one JSON object per line")
    x.add_argument("--output", required=True, help="JSONL: one result line per input line")
    x.add_argument("--prompt", default=None, help="template over the record's fields, e.g. "
                   "'Contract:\n{text}\nParties as JSON: ' (default: one written from the schema: each field, "
                   "its description and allowed values, over the record's text)")
    x.add_argument("--copy-fields", default=None, metavar="auto|F1,F2",
                   help="string fields copied from the record, never invented: names, or auto (every string "
                   "without enum, const or format); also \"x-copy\": true in a JSON Schema")
    x.add_argument("--examples", default=None, metavar="FILE",
                   help="JSONL of solved records ({\"text\": ..., \"value\": {...}}) shown in the default prompt")
    x.add_argument("--beam-width", type=int, default=None, metavar="W",
                   help="each value the best of W beams under the grammar, about W times the compute (default: 4 "
                        "when a field is copied, --copy-fields or x-copy, where beams copy the right span more "
                        "often; else 1, greedy)")
    x.add_argument("--score-booleans", default=None, action=argparse.BooleanOptionalAction,
                   help="decide each top-level boolean field by how likely its description is after the record's "
                        "text, against reference records, not by generating it (default: on when a field "
                        "is copied)")
    x.add_argument("--score-choices", default=None, action=argparse.BooleanOptionalAction,
                   help="decide each closed choice (an enum, const alternatives, null or a value for a nullable "
                        "field) by the model's likelihood of each option, calibrated on reference records, not by "
                        "the first token the grammar allows (default: on when a field is copied)")
    x.add_argument("--max-retries", type=int, default=0, metavar="N",
                   help="a value the type's own validation refuses (a pydantic validator, a msgspec constraint or "
                        "__post_init__) is decoded again up to N times, from its first refused field, the refused "
                        "value excluded (the row's attempts says how many decodes)")
    x.add_argument("--confidence", action="store_true",
                   help="add to each row a probability per top-level field (confidence)")
    _model_args(x)
    x.add_argument("--max-tokens", type=int, default=512)
    x.add_argument("--max-prompt-tokens", type=int, default=None, help="refuse longer records (prompt_too_long)")
    x.add_argument("--concurrency", type=int, default=16)
    x.add_argument("--id-field", default="id")
    x.add_argument("--resume", action="store_true",
                   help="skip the input lines already answered in the output, and append")
    x.add_argument("--no-progress", action="store_true")
    x.add_argument("--speculative", default=None, metavar="ngram[:K]|draft:PATH[:K]",
                   help="speculative decoding, n-gram or a draft model with the same tokenizer (same output; "
                        "values copied from the record come faster)")
    x.add_argument("--ray", action="store_true",
                   help="run on Ray (pip install 'asyncpage[ray]'): the cluster at RAY_ADDRESS, else a local one "
                   "started for the job; the input is read through Ray Data, one engine per actor")
    x.add_argument("--num-actors", type=int, default=1, help="with --ray: actors, each with its own engine")

    so = sub.add_parser("soak", help="thousands of random requests, cancellations and dropped streams; a verdict")
    _model_args(so)
    so.add_argument("--requests", type=int, default=2000)
    so.add_argument("--concurrency", type=int, default=32)
    so.add_argument("--max-tokens", type=int, default=24)
    so.add_argument("--num-kv-blocks", type=int, default=96, help="a small pool, so preemption happens")
    so.add_argument("--max-num-seqs", type=int, default=16)
    so.add_argument("--max-rss-growth", type=float, default=0.05)
    so.add_argument("--seed", type=int, default=0)
    so.add_argument("--debug-checks", action="store_true", help="check the pool's invariants every step")

    from asyncpage.serve import add_parser as _serve_parser

    _serve_parser(sub)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.cmd == "serve":
        from asyncpage.serve import serve

        return serve(args)
    if args.cmd == "generate":
        return asyncio.run(_generate(args))
    if args.cmd == "bench-guided":
        return asyncio.run(cli_bench.bench_guided(args))
    if args.cmd == "extract":
        return _extract(args)
    if args.cmd == "soak":
        return asyncio.run(_soak(args))
    if args.cmd == "bench-sharing":
        return asyncio.run(cli_bench.bench_sharing(args))
    if args.cmd == "bench-eviction":
        return asyncio.run(cli_bench.bench_eviction(args))
    return asyncio.run(cli_bench.bench(args))


def _at_least_one(value: str) -> int:
    n = int(value) if value.strip().lstrip("-").isdigit() else 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"a whole number of at least 1, got {value!r}")
    return n


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF directory, cached hub id or .gguf (default: gemma-3-270m)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None)


async def _soak(args: argparse.Namespace) -> int:
    from asyncpage import AsyncEngine
    from asyncpage.bench.soak import soak

    engine = AsyncEngine.from_pretrained(args.model, dtype=args.dtype, device=args.device, num_threads=args.threads,
                                         num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
                                         debug_checks=args.debug_checks)
    print(f"soak: {args.requests} requests, concurrency {args.concurrency}, pool {engine.config.num_kv_blocks} "
          f"blocks x {engine.config.block_size} [{engine.config.dtype}]", flush=True)
    async with engine:
        report = await soak(engine, args.requests, args.concurrency, args.max_tokens, args.seed)
    print("\n".join(report.lines()))
    ok = report.ok(args.max_rss_growth)
    print("verdict:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


async def _generate(args: argparse.Namespace) -> int:
    from asyncpage import AsyncEngine, SamplingParams

    engine = AsyncEngine.from_pretrained(args.model, dtype=args.dtype, device=args.device, num_threads=args.threads)
    async with engine:
        async for chunk in engine.stream(args.prompt, SamplingParams(max_tokens=args.max_tokens,
                                                                    temperature=args.temperature)):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _extract(args: argparse.Namespace) -> int:
    from pathlib import Path

    from asyncpage import AsyncEngine, AsyncPageError
    from asyncpage.decoding.speculative import cli_config
    from asyncpage.extract.jobs import JobSummary, check_paths, load_examples, load_schema, run_job
    from asyncpage.extract.run import beams_per_record

    summary: JobSummary | None = None

    def on_ray() -> JobSummary:
        try:
            from asyncpage.ray import run_job as run_ray_job
        except ImportError as exc:
            raise SystemExit(f"asyncpage extract: {exc}") from None
        return run_ray_job(
            Path(args.input), Path(args.output), schema, num_actors=args.num_actors, resume=args.resume,
            progress=not args.no_progress, prompt=prompt, concurrency=args.concurrency, max_tokens=args.max_tokens,
            id_field=args.id_field, max_prompt_tokens=args.max_prompt_tokens, copy_fields=args.copy_fields,
            examples=examples, beam_width=args.beam_width, score_booleans=args.score_booleans,
            max_retries=args.max_retries, confidence=args.confidence, model=args.model,
            dtype=args.dtype, device=args.device,
            num_threads=args.threads, speculative_config=speculative)

    async def main() -> None:
        nonlocal summary
        engine = AsyncEngine.from_pretrained(args.model, dtype=args.dtype, device=args.device,
                                             num_threads=args.threads,
                                             max_num_seqs=max(args.concurrency * width, 1),
                                             speculative_config=speculative)
        async with engine:
            summary = await run_job(
                engine, schema, Path(args.input), Path(args.output), prompt=prompt,
                concurrency=args.concurrency, max_tokens=args.max_tokens, resume=args.resume, id_field=args.id_field,
                max_prompt_tokens=args.max_prompt_tokens, progress=not args.no_progress,
                copy_fields=args.copy_fields, examples=examples, beam_width=args.beam_width,
                score_booleans=args.score_booleans, max_retries=args.max_retries, confidence=args.confidence,
                score_choices=args.score_choices)

    # Shell quoting makes real newlines awkward: "\n" and "\t" in --prompt are newline and tab.
    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t") if args.prompt else None
    try:
        speculative = cli_config(args.speculative) if args.speculative else None  # refused before loading
        schema = load_schema(args.schema)
        width = beams_per_record(schema, args.copy_fields, args.beam_width)  # refused before loading if bad
        examples = load_examples(Path(args.examples)) if args.examples else []
        check_paths(Path(args.input), Path(args.output))
        if args.ray:
            summary = on_ray()
        else:
            asyncio.run(main())
    except AsyncPageError as exc:
        print(f"asyncpage extract: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted: the output is valid; run again with --resume to finish", file=sys.stderr)
        return 130
    assert summary is not None
    for line in summary.lines():
        print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
