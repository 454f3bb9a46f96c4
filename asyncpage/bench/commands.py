"""`asyncpage bench`, `bench-guided`, `bench-sharing` and `bench-eviction`: the figures commands
(parsed in cli.py)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import msgspec


async def bench(args: argparse.Namespace) -> int:
    extract = args.workload == "extract"
    if args.num_requests is None:
        args.num_requests = 60 if extract else 32
    if args.max_num_seqs is None:
        args.max_num_seqs = 16 if extract else 64
    if extract:
        from asyncpage.bench.extract_job import bench_extract

        return await bench_extract(args)
    if args.speculative:
        return await _bench_speculative(args)
    if getattr(args, "llama_bench", None):
        from asyncpage.bench.cpu_path import compare

        return await compare(args)
    if args.settings or args.baseline in ("llama.cpp", "llama-server"):
        from asyncpage.bench.quant import compare_settings

        return await compare_settings(args)
    from asyncpage import AsyncEngine
    from asyncpage.bench.throughput import (
        format_result,
        make_workload,
        run_engine,
        run_transformers_continuous,
        run_transformers_static,
        transformers_model,
    )

    engine = AsyncEngine.from_pretrained(
        args.model, dtype=args.dtype, device=args.device, num_threads=args.threads, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=not args.no_prefix_caching)
    print(f"# model {engine.model_source} [{engine.config.dtype}, {engine.config.num_threads} threads], "
          f"loaded in {engine.load_seconds:.1f} s; KV pool {engine.config.num_kv_blocks} blocks of "
          f"{engine.config.block_size}", file=sys.stderr)
    bos = engine.tokenizer.bos_token_id
    items = make_workload(args.workload, args.num_requests, engine.vocab_size, bos, args.seed)
    async with engine:
        # Warm-up: first-call allocations and kernel selection stay out of the figures.
        await run_engine(engine, make_workload("single", 1, engine.vocab_size, bos, 99)[:1], "warmup", False)
        if args.sweep:
            levels = [int(x) for x in args.sweep.split(",")]
            sweep = []
            for level in levels:
                r = await run_engine(engine, make_workload(args.workload, level, engine.vocab_size, bos,
                                                           args.seed + level), f"{args.workload} x{level}")
                print(format_result(r))
                sweep.append(r)
            if args.json:
                print(json.dumps([msgspec.to_builtins(r) for r in sweep], indent=1))
            if args.plot:
                from asyncpage.bench.throughput import plot_sweep

                plot_sweep(levels, sweep, args.plot)
                print(f"wrote {args.plot}", file=sys.stderr)
            return 0
        with _competing_load(args.competing_load):
            res = await run_engine(engine, items, args.workload + (f" +{args.competing_load} busy procs"
                                                                   if args.competing_load else ""))
    results = [res]
    if args.baseline == "transformers":
        hf = transformers_model(engine)
        base = run_transformers_static(hf, items, engine.config.dtype)
        base.workload = args.workload
        results.append(base)
        try:
            cb = run_transformers_continuous(hf, items, engine.config.dtype)
            cb.workload = args.workload
            results.append(cb)
        except Exception as exc:  # an optional, still-moving transformers API: report, do not fail the bench
            print(f"# transformers continuous batching failed: {exc!r}", file=sys.stderr)
    if args.json:
        print(json.dumps([msgspec.to_builtins(r) for r in results], indent=1))
    else:
        for r in results:
            print(format_result(r))
        for other in results[1:]:
            print(f"ratio asyncpage / {other.engine}: {res.throughput_tok_s / other.throughput_tok_s:.2f}x")
    return 0


@contextlib.contextmanager
def _competing_load(n: int) -> Iterator[None]:
    """n processes that each keep a core busy (another tenant of the machine) while the body runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


async def _bench_speculative(args: argparse.Namespace) -> int:
    from asyncpage import AsyncEngine
    from asyncpage.bench.spec import format_rows, speculative_figures
    from asyncpage.decoding.speculative import cli_config

    config = cli_config(args.speculative)
    engine = AsyncEngine.from_pretrained(
        args.model, dtype=args.dtype, device=args.device, num_threads=args.threads, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=not args.no_prefix_caching)
    rows = await speculative_figures(engine, config, args.num_requests, args.seed, args.repeat)
    print(json.dumps(rows) if args.json else format_rows(rows, config))
    return 0


async def bench_sharing(args: argparse.Namespace) -> int:
    from asyncpage import AsyncEngine
    from asyncpage.bench.throughput import sharing_figures

    engine = AsyncEngine.from_pretrained(args.model, dtype=args.dtype, device=args.device, num_threads=args.threads)
    async with engine:
        f = await sharing_figures(engine)
    print(f"prefix caching [{engine.config.dtype}], 512-token shared prefix: TTFT cold {f['ttft_cold_ms']:.0f} ms, "
          f"warm p50 {f['ttft_warm_p50_ms']:.0f} ms ({f['ttft_cold_ms'] / f['ttft_warm_p50_ms']:.1f}x faster)")
    for n in (4, 8):
        print(f"n={n} samples of a 709-token prompt, 32 tokens each: peak KV blocks {f[f'blocks_n{n}_shared']:.0f} "
              f"shared (copy-on-write) vs {f[f'blocks_n{n}_separate']:.0f} as {n} separate requests")
    return 0


async def bench_eviction(args: argparse.Namespace) -> int:
    from asyncpage import AsyncEngine
    from asyncpage.bench.throughput import eviction_figures

    # A fixed thread count: following other processes' load would change reduction orders between the
    # runs whose outputs are compared.
    threads = args.threads or len(os.sched_getaffinity(0))
    engine = AsyncEngine.from_pretrained(args.model, dtype=args.dtype, device=args.device, num_threads=threads)
    runs = await eviction_figures(engine, args.num_kv_blocks, args.rounds, args.every, args.system_tokens,
                                  args.prompt_tokens, args.max_tokens)
    n = args.rounds * args.every
    print(f"prefix-cache eviction [{engine.config.dtype}], pool {args.num_kv_blocks} blocks of "
          f"{engine.config.block_size}: {args.rounds} rounds of a {args.system_tokens}-token system prompt "
          f"(+ a 32-token question) then {args.every - 1} one-off {args.prompt_tokens}-token prompts; {n} requests "
          f"one at a time, {args.max_tokens} greedy tokens each")
    print(f"{'policy':<8} {'prefix hit rate':>15} {'system prompt found':>20} {'evictions':>10} "
          f"{'TTFT p50 all':>13} {'TTFT p50 system-prompt requests':>32}")
    ref = runs[0]
    for r in runs[1:]:
        found = f"{r.shared_prompt_hits}/{r.shared_prompt_requests}"
        print(f"{r.policy:<8} {100 * r.prefix_cache_hit_rate:>14.1f}% {found:>20} {r.prefix_cache_evictions:>10} "
              f"{r.ttft_p50_ms:>10.0f} ms {r.ttft_shared_p50_ms:>29.0f} ms")
    print(f"{'off':<8} {'-':>15} {'-':>20} {'-':>10} {ref.ttft_p50_ms:>10.0f} ms {ref.ttft_shared_p50_ms:>29.0f} ms")
    same = {r.policy: r.outputs == ref.outputs for r in runs[1:]}
    print("outputs equal to prefix caching off (greedy): "
          + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in same.items()))
    return 0 if all(same.values()) else 1


async def bench_guided(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tqdm import tqdm

    from asyncpage.bench.guided_conformance import load_cases, run_all, summarize
    from asyncpage.guided import GrammarManager
    from asyncpage.model.weights import load_tokenizer

    tok, config, eos = load_tokenizer(args.model)
    manager = GrammarManager(tok, config.vocab_size, sorted(eos), args.backend)
    manager.backend()
    cases = load_cases(Path(args.data))
    results = list(tqdm(run_all(manager, tok, cases, config.vocab_size), total=len(cases), desc="schemas",
                        leave=False))
    for name, prefix in (("JSONSchemaBench dev", "bench/"), ("JSON Schema Test Suite 2020-12", "suite/")):
        s = summarize([r for r in results if r.case_id.startswith(prefix)])
        print(f"{args.backend} on {name}: {s['compiled']}/{s['schemas']} compiled ({100 * s['coverage']:.1f}%), "
              f"valid accepted {100 * s['valid_accepted']:.2f}% of {s['valid_instances']}, invalid accepted "
              f"{s['invalid_accepted']} of {s['invalid_instances']}; compile p50/p99 {s['compile_p50_ms']:.1f}/"
              f"{s['compile_p99_ms']:.1f} ms; mask p50/p99 {s['mask_p50_us']:.1f}/{s['mask_p99_us']:.1f} us")
    if args.no_throughput:
        return 0
    from asyncpage import AsyncEngine
    from asyncpage.bench.throughput import guided_throughput

    engine = AsyncEngine.from_pretrained(args.model, dtype=args.dtype, device=args.device, num_threads=args.threads,
                                         guided_backend=args.backend)
    async with engine:
        t = await guided_throughput(engine, args.num_requests)
    print(f"{args.num_requests} concurrent requests [{engine.config.dtype}]: constrained {t['constrained_tok_s']:.1f} "
          f"tok/s vs unconstrained {t['unconstrained_tok_s']:.1f} tok/s "
          f"({100 * t['constrained_tok_s'] / t['unconstrained_tok_s']:.0f}%)")
    return 0
