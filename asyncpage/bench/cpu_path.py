"""`asyncpage bench --llama-bench PATH [--llama-server PATH]`: asyncpage beside llama.cpp on the same GGUF,
in one run: one stream (decode tok/s, as llama-bench's tg128), prefill of a 512-token prompt (tok/s, as
pp512), the 32-request mixed workload (tok/s, against llama-server with 32 slots), resident memory after
load with a 64 MiB KV pool, and load time.

Each asyncpage setting runs in fresh processes (`python -m asyncpage.bench.cpu_path child ...`), so the
resident memory is that of one engine and nothing else: one process for load, memory, one stream and
prefill (a 64 MiB pool), one for the mixed workload (the default pool: 32 requests need more than 64 MiB).
The setting `defaults` is `from_pretrained(model)` with no options; others are `--settings` spellings
(asyncpage/bench/quant.py). llama.cpp's memory is llama-server's resident set once it answers /health,
one slot of 4,096 tokens; its load time is the time until then.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from asyncpage.bench.throughput import make_workload, run_engine

KV_64_MIB = 64 << 20
PREFILL_TOKENS = 512
DECODE_TOKENS = 128


def rss_mib(pid: int | str = "self") -> float:
    """The resident set of a process (VmRSS), in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    raise OSError(f"no VmRSS for process {pid}")


def setting_options(setting: str) -> dict[str, Any]:
    if setting == "defaults":
        return {}
    from asyncpage.bench.quant import parse_setting

    return parse_setting(setting)


async def _child(model: str | None, setting: str, part: str, threads: int | None) -> dict[str, Any]:
    from asyncpage import AsyncEngine, SamplingParams

    opts = setting_options(setting)
    if threads:
        opts["num_threads"] = threads
    t0 = time.perf_counter()
    if part == "mixed":
        engine = AsyncEngine.from_pretrained(model, **opts)
    else:
        engine = AsyncEngine.from_pretrained(model, kv_cache_memory=KV_64_MIB, enable_prefix_caching=False, **opts)
    out: dict[str, Any] = {"load_s": time.perf_counter() - t0, "rss_mib": rss_mib(),
                           "dtype": engine.config.dtype, "source": engine.model_source}
    bos = engine.tokenizer.bos_token_id
    async with engine:
        warm = make_workload("single", 1, engine.vocab_size, bos, 99)
        await run_engine(engine, warm, "warmup", False)
        if part == "mixed":
            r = await run_engine(engine, make_workload("mixed", 32, engine.vocab_size, bos, 0), "mixed-32", False)
            out["mixed_tok_s"] = r.throughput_tok_s
            return out
        # One stream: decode rate between the first token and the last (tg128 times generation alone).
        rates = []
        for seed in (1, 2):
            item = make_workload("single", 1, engine.vocab_size, bos, seed)[0]
            stamps: list[float] = []
            params = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0, ignore_eos=True)
            async for chunk in engine.stream(item.prompt, params):
                stamps.extend([time.perf_counter()] * len(chunk.token_ids))
            rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
        out["single_tok_s"] = max(rates)
        # Prefill: a 512-token prompt, caching off, to its first token (pp512 times the prompt alone).
        times = []
        for seed in (3, 4, 5, 6):
            prompt = make_workload("long-prompt", 1, engine.vocab_size, bos, seed)[0].prompt[:PREFILL_TOKENS]
            t = time.perf_counter()
            await engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0))
            times.append(time.perf_counter() - t)
        out["prefill_tok_s"] = PREFILL_TOKENS / statistics.median(times[1:])  # the first warms the shape
    return out


def run_child(model: str | None, setting: str, part: str, threads: int | None) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "asyncpage.bench.cpu_path", "child", json.dumps([model, setting, part, threads])]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"asyncpage {setting} ({part}) failed:\n{proc.stderr[-2000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def run_llama_bench(binary: str, model: str, threads: int) -> dict[str, float]:
    """llama-bench's tg128 and pp512 (mean tok/s over its repetitions) on `model`."""
    cmd = [binary, "-m", model, "-t", str(threads), "-p", str(PREFILL_TOKENS), "-n", str(DECODE_TOKENS), "-o", "json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    out: dict[str, float] = {}
    for row in json.loads(proc.stdout):
        key = "prefill_tok_s" if row.get("n_prompt") and not row.get("n_gen") else "single_tok_s"
        out[key] = float(row["avg_ts"])
    return out


async def llama_server_figures(binary: str, model: str, threads: int, vocab: int, bos: int | None) -> dict[str, float]:
    """llama-server's memory and load time (one slot, 4,096 tokens) and its mixed-32 tok/s (32 slots)."""
    import httpx

    from asyncpage.bench.llama_server import _stop, _wait_healthy, free_port, run_llama_server

    port = free_port()
    cmd = [binary, "-m", model, "-np", "1", "-c", "4096", "-t", str(threads), "--host", "127.0.0.1",
           "--port", str(port), "--no-webui"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        async with httpx.AsyncClient() as client:
            await _wait_healthy(client, proc, f"http://127.0.0.1:{port}", 300.0)
        out = {"load_s": time.perf_counter() - t0, "rss_mib": rss_mib(proc.pid)}
    finally:
        _stop(proc)
    r = await run_llama_server(binary, model, make_workload("mixed", 32, vocab, bos, 0), threads)
    out["mixed_tok_s"] = r.throughput_tok_s
    return out


async def compare(args: Any) -> int:
    """The side-by-side table; figures printed, never asserted."""
    from asyncpage.model.weights import load_tokenizer

    settings = [s.strip() for s in (args.settings or "defaults").split(",") if s.strip()]
    from asyncpage.errors import InvalidRequestError

    try:
        for s in settings:
            setting_options(s)  # a bad setting is refused before anything runs
    except InvalidRequestError as exc:
        print(f"asyncpage bench: {exc}", file=sys.stderr)
        return 2
    threads = args.threads or len(os.sched_getaffinity(0))
    rows: dict[str, dict[str, Any]] = {}
    for s in settings:
        rows[f"asyncpage {s}"] = run_child(args.model, s, "single", args.threads)
        rows[f"asyncpage {s}"]["mixed_tok_s"] = run_child(args.model, s, "mixed", args.threads)["mixed_tok_s"]
        print(f"# asyncpage {s}: {json.dumps(rows[f'asyncpage {s}'])}", file=sys.stderr, flush=True)
    source = str(rows[f"asyncpage {settings[0]}"]["source"])
    if not source.endswith(".gguf"):
        print(f"asyncpage bench --llama-bench: {source} is not a GGUF file", file=sys.stderr)
        return 2
    llama: dict[str, Any] = run_llama_bench(args.llama_bench, source, threads)
    if args.llama_server:
        tok, config, _ = load_tokenizer(source)
        llama.update(await llama_server_figures(args.llama_server, source, threads, config.vocab_size,
                                                tok.bos_token_id))
    rows["llama.cpp"] = llama
    file_mib = os.path.getsize(source) / 2**20
    if args.json:
        print(json.dumps({"file_mib": file_mib, "threads": threads, "rows": rows}))
        return 0
    print(f"{source} ({file_mib:.0f} MiB), {threads} threads; ratios against llama.cpp "
          f"(llama-bench tg{DECODE_TOKENS} / pp{PREFILL_TOKENS}, llama-server 32 slots)")
    cols = [("single_tok_s", "one stream tok/s"), ("prefill_tok_s", f"prefill {PREFILL_TOKENS} tok/s"),
            ("mixed_tok_s", "mixed-32 tok/s"), ("rss_mib", "RSS after load MiB"), ("load_s", "load s")]
    print(f"{'':<28}" + "".join(f"{title:>22}" for _, title in cols))
    for name, row in rows.items():
        cells = []
        for key, _ in cols:
            v, ref = row.get(key), llama.get(key)
            ratio = f" ({v / ref:.2f}x)" if v is not None and ref and name != "llama.cpp" else ""
            cells.append("-" if v is None else f"{v:.1f}{ratio}")
        print(f"{name:<28}" + "".join(f"{c:>22}" for c in cells))
    budget = 1.25 * file_mib + 64 + 450
    print(f"memory budget of issue 33 (1.25 x file + 64 MiB KV + 450 MiB): {budget:.0f} MiB")
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    model_, setting_, part_, threads_ = json.loads(sys.argv[2])
    print(json.dumps(asyncio.run(_child(model_, setting_, part_, threads_))))
