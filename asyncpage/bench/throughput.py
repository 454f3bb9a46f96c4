"""Benchmarks that print figures (never asserted): throughput, TTFT / ITL percentiles, KV usage,
event-loop lag, and optionally transformers' generate() on the same weights, dtype and workload.

    asyncpage bench --workload mixed -n 32 --dtype bfloat16 --baseline transformers
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from asyncpage.engine import AsyncEngine
from asyncpage.outputs import GenerateOutput
from asyncpage.params import SamplingParams


@dataclass
class Item:
    prompt: list[int]
    max_tokens: int


class BenchResult(msgspec.Struct):
    workload: str
    engine: str
    dtype: str
    num_requests: int
    output_tokens: int
    prompt_tokens: int
    wall_s: float
    throughput_tok_s: float
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    loop_lag_p50_ms: float | None = None
    loop_lag_p99_ms: float | None = None
    peak_kv_blocks_used: int | None = None
    kv_blocks_total: int | None = None
    num_preemptions: int | None = None
    prefix_cache_hit_rate: float | None = None


def make_workload(name: str, n: int, vocab: int, bos: int | None, seed: int = 0) -> list[Item]:
    """Prompts of random ordinary token ids (no special tokens), BOS first; outputs run to max_tokens."""
    rng = random.Random(seed)
    lo, hi = 1000, min(vocab, 200_000) - 1

    def ids(k: int) -> list[int]:
        return ([bos] if bos is not None else []) + [rng.randint(lo, hi) for _ in range(k - 1)]

    if name == "mixed":  # prompts 32-256 tokens, outputs 32-128
        return [Item(ids(rng.randint(32, 256)), rng.randint(32, 128)) for _ in range(n)]
    if name == "shared-prefix":  # one 512-token system prompt, short unique suffixes
        prefix = ids(512)
        return [Item(prefix + [rng.randint(lo, hi) for _ in range(32)], 32) for _ in range(n)]
    if name == "long-prompt":
        return [Item(ids(2048), 32) for _ in range(n)]
    if name == "single":  # one stream: decode speed
        return [Item(ids(32), 128)]
    raise ValueError(f"unknown workload {name!r}")


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))] * 1000


async def run_engine(engine: AsyncEngine, items: list[Item], workload: str, progress: bool = True) -> BenchResult:
    """All requests at once, through the public streaming API, as an embedding app would."""
    ttfts: list[float] = []
    itls: list[float] = []
    lags: list[float] = []
    peak = 0
    done = asyncio.Event()

    async def ticker() -> None:
        # Event-loop lag: how late a 10 ms sleep wakes up while the engine is saturated.
        nonlocal peak
        loop = asyncio.get_running_loop()
        while not done.is_set():
            t = loop.time()
            await asyncio.sleep(0.01)
            lags.append(max(0.0, loop.time() - t - 0.01))
            peak = max(peak, engine.stats().kv_blocks_used)

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(items), desc=f"asyncpage {workload}", unit="req", leave=False)

    async def one(item: Item) -> int:
        params = SamplingParams(max_tokens=item.max_tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        last = None
        n = 0
        async for chunk in engine.stream(item.prompt, params):
            now = time.perf_counter()
            if last is None:
                ttfts.append(now - start)
            else:
                # A merged chunk of k tokens stands for k inter-token gaps.
                itls.extend([(now - last) / len(chunk.token_ids)] * len(chunk.token_ids))
            last = now
            n += len(chunk.token_ids)
        if bar is not None:
            bar.update(1)
        return n

    before = engine.stats()
    tick = asyncio.create_task(ticker())
    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(it) for it in items))
    wall = time.perf_counter() - t0
    done.set()
    await tick
    if bar is not None:
        bar.close()
    after = engine.stats()
    q = after.prefix_cache_query_tokens - before.prefix_cache_query_tokens
    h = after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
    return BenchResult(
        workload=workload, engine="asyncpage", dtype=engine.config.dtype, num_requests=len(items),
        output_tokens=sum(counts), prompt_tokens=sum(len(i.prompt) for i in items), wall_s=wall,
        throughput_tok_s=sum(counts) / wall, ttft_p50_ms=_pct(ttfts, 50), ttft_p99_ms=_pct(ttfts, 99),
        itl_p50_ms=_pct(itls, 50), itl_p99_ms=_pct(itls, 99), loop_lag_p50_ms=_pct(lags, 50),
        loop_lag_p99_ms=_pct(lags, 99), peak_kv_blocks_used=peak, kv_blocks_total=after.kv_blocks_total,
        num_preemptions=after.num_preemptions - before.num_preemptions,
        prefix_cache_hit_rate=h / q if q else None)


def transformers_model(engine: AsyncEngine) -> Any:
    """transformers' own model class holding the very tensors asyncpage runs (same dequantized
    weights, same dtype)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = engine.model_config
    # Built for real (not on the meta device): its non-persistent buffers (rotary frequencies, the
    # embedding scale) are computed at construction and are not in any state dict.
    hf = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, engine.config.dtype))
    state = engine.model.state_dict()
    missing, _ = hf.load_state_dict(state, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]  # tied to the embedding
    if missing:
        raise RuntimeError(f"transformers model lacks {missing[:3]}")
    hf.tie_weights()
    return hf.eval()


def run_transformers_static(hf: Any, items: list[Item], dtype: str, batch_size: int = 8,
                            progress: bool = True) -> BenchResult:
    """transformers generate() on static, left-padded batches of `batch_size`, in arrival order:
    each batch runs until its longest request is done. Useful tokens = what each request asked for."""
    import torch

    pad = 0
    t0 = time.perf_counter()
    batches = [items[i : i + batch_size] for i in range(0, len(items), batch_size)]
    it: Any = batches
    if progress:
        from tqdm import tqdm

        it = tqdm(batches, desc="transformers static batches", unit="batch", leave=False)
    for batch in it:
        width = max(len(x.prompt) for x in batch)
        ids = torch.tensor([[pad] * (width - len(x.prompt)) + x.prompt for x in batch])
        mask = torch.tensor([[0] * (width - len(x.prompt)) + [1] * len(x.prompt) for x in batch])
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(x.max_tokens for x in batch),
                        do_sample=False, eos_token_id=None, pad_token_id=pad)
    wall = time.perf_counter() - t0
    useful = sum(x.max_tokens for x in items)
    return BenchResult(workload="", engine=f"transformers generate() static batches of {batch_size}", dtype=dtype,
                       num_requests=len(items), output_tokens=useful,
                       prompt_tokens=sum(len(i.prompt) for i in items), wall_s=wall, throughput_tok_s=useful / wall)


def run_transformers_continuous(hf: Any, items: list[Item], dtype: str) -> BenchResult:
    """transformers' own continuous batching (the generate_batch() machinery), each request with its
    own max_new_tokens and no EOS, on the same weights."""
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=max(
        x.max_tokens for x in items))
    t0 = time.perf_counter()
    produced = 0
    with hf.continuous_batching_context_manager(generation_config=cfg, block=True, timeout=5) as manager:
        ids = [manager.add_request(x.prompt, max_new_tokens=x.max_tokens, eos_token_id=-1) for x in items]
        pending = set(ids)
        while pending:
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped")
                continue
            if result.is_finished():
                pending.discard(result.request_id)
                produced += len(result.generated_tokens)
    wall = time.perf_counter() - t0
    return BenchResult(workload="", engine="transformers generate_batch() (continuous batching)", dtype=dtype,
                       num_requests=len(items), output_tokens=produced,
                       prompt_tokens=sum(len(i.prompt) for i in items), wall_s=wall, throughput_tok_s=produced / wall)


def format_result(r: BenchResult) -> str:
    def f(x: float | None, unit: str = "") -> str:
        return "-" if x is None else f"{x:.1f}{unit}"

    lines = [f"{r.engine} [{r.dtype}] {r.workload}: {r.num_requests} requests, {r.prompt_tokens} prompt + "
             f"{r.output_tokens} output tokens in {r.wall_s:.1f} s -> {r.throughput_tok_s:.1f} tok/s"]
    if r.ttft_p50_ms is not None:
        lines.append(f"  TTFT p50/p99 {f(r.ttft_p50_ms)}/{f(r.ttft_p99_ms)} ms, ITL p50/p99 {f(r.itl_p50_ms)}/"
                     f"{f(r.itl_p99_ms)} ms, event-loop lag p50/p99 {f(r.loop_lag_p50_ms)}/{f(r.loop_lag_p99_ms)} ms")
    if r.kv_blocks_total is not None:  # asyncpage's own figures (not a baseline's)
        hit = "-" if r.prefix_cache_hit_rate is None else f"{100 * r.prefix_cache_hit_rate:.0f}%"
        lines.append(f"  KV blocks peak {r.peak_kv_blocks_used}/{r.kv_blocks_total}, preemptions "
                     f"{r.num_preemptions}, prefix-cache hit rate {hit}")
    return "\n".join(lines)


GUIDED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}


async def guided_throughput(engine: AsyncEngine, n: int = 16) -> dict[str, float]:
    """Constrained vs unconstrained decode rate (tok/s) at `n` concurrent requests, same prompts."""
    prompts = [f"Record {i}: a fictional person as a JSON object with name, age, city and hobbies: "
               for i in range(n)]

    async def run(params: list[SamplingParams]) -> tuple[list[int], float]:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate(p, q) for p, q in zip(prompts, params, strict=True)))
        return [len(o.token_ids) for o in outs], time.perf_counter() - t0

    await run([SamplingParams(max_tokens=2, json_schema=GUIDED_SCHEMA)] * n)  # compile + warm-up
    lengths, g_wall = await run([SamplingParams(max_tokens=160, temperature=0, json_schema=GUIDED_SCHEMA)] * n)
    # The same prompts, each free to run exactly as many tokens as its constrained twin: the batch
    # shrinks the same way, so the ratio isolates the cost of the masks.
    _, f_wall = await run([SamplingParams(max_tokens=k, temperature=0, ignore_eos=True) for k in lengths])
    g_tokens = f_tokens = sum(lengths)
    return {"constrained_tok_s": g_tokens / g_wall, "unconstrained_tok_s": f_tokens / f_wall,
            "constrained_tokens": g_tokens, "unconstrained_tokens": f_tokens}


def plot_sweep(levels: list[int], results: list[BenchResult], path: str) -> None:
    """Throughput and latency (TTFT, ITL p50) against concurrency, as a PNG (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(levels, [r.throughput_tok_s for r in results], "o-")
    a.set(xscale="log", xlabel="concurrent requests", ylabel="output tokens/s", title="throughput")
    b.plot(levels, [r.ttft_p50_ms or 0 for r in results], "o-", label="TTFT p50")
    b.plot(levels, [r.itl_p50_ms or 0 for r in results], "s-", label="inter-token p50")
    b.set(xscale="log", yscale="log", xlabel="concurrent requests", ylabel="ms", title="latency")
    b.legend()
    for ax in (a, b):
        ax.set_xticks(levels, [str(x) for x in levels])
        ax.grid(alpha=0.3)
    r0 = results[0]
    fig.suptitle(f"asyncpage, {r0.workload.split(' ')[0]} workload, {r0.dtype}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def sharing_figures(engine: AsyncEngine, prefix_len: int = 512, n_warm: int = 15) -> dict[str, float]:
    """Prefix caching: TTFT of a cold request with a `prefix_len`-token shared prefix, then the median
    TTFT of `n_warm` requests reusing it (one at a time, so TTFT is the prefill alone).
    Copy-on-write: peak KV blocks of one n-sample request vs n separate requests, for n = 4 and 8."""
    rng = random.Random(1)
    bos = engine.tokenizer.bos_token_id
    prefix = ([bos] if bos is not None else []) + [rng.randint(1000, 200_000) for _ in range(prefix_len - 1)]
    one = SamplingParams(max_tokens=1, temperature=0)

    async def ttft(prompt: list[int]) -> float:
        return (await engine.generate(prompt, one)).metrics.ttft

    def suffix() -> list[int]:
        return [rng.randint(1000, 200_000) for _ in range(16)]

    cold = await ttft(prefix + suffix())
    warm = sorted([await ttft(prefix + suffix()) for _ in range(n_warm)])
    out = {"ttft_cold_ms": cold * 1e3, "ttft_warm_p50_ms": warm[len(warm) // 2] * 1e3}

    async def peak_blocks(coro: Any) -> int:
        peak = 0
        task = asyncio.ensure_future(coro)
        while not task.done():
            peak = max(peak, engine.stats().kv_blocks_used)
            await asyncio.sleep(0.005)
        await task
        return peak

    long_prompt = ([bos] if bos is not None else []) + [rng.randint(1000, 200_000) for _ in range(708)]
    for n in (4, 8):
        params = SamplingParams(n=n, max_tokens=32, temperature=0.8, seed=7, ignore_eos=True)
        single = SamplingParams(max_tokens=32, temperature=0.8, seed=7, ignore_eos=True)
        salt = f"bench-{n}-{rng.random()}"  # no prefix-cache help for the separate requests
        shared = await peak_blocks(engine.generate(long_prompt, msgspec.structs.replace(params, cache_salt=salt)))
        separate = await peak_blocks(asyncio.gather(*(
            engine.generate(long_prompt, msgspec.structs.replace(single, cache_salt=f"{salt}-{i}"))
            for i in range(n))))
        out[f"blocks_n{n}_shared"] = shared
        out[f"blocks_n{n}_separate"] = separate
    return out


class EvictionRun(msgspec.Struct):
    policy: str
    prefix_cache_hit_rate: float
    shared_prompt_hits: int  # requests with the system prompt that found it cached (most of it)
    shared_prompt_requests: int
    prefix_cache_evictions: int
    ttft_p50_ms: float
    ttft_shared_p50_ms: float
    outputs: list[list[int]]


def eviction_workload(rng: random.Random, bos: int | None, rounds: int, every: int, system_tokens: int,
                      prompt_tokens: int, question_tokens: int = 32,
                      vocab: int = 200_001) -> list[tuple[bool, list[int]]]:
    """`rounds` times: the system prompt with a question of its own, then `every - 1` one-off prompts
    of `prompt_tokens`. Returns (uses the system prompt, token ids) per request, in order. Ids are
    drawn above the low (special) ids and below `vocab`."""
    lo, hi = min(1000, vocab // 4), min(vocab, 200_000) - 1

    def ids(k: int) -> list[int]:
        return [rng.randint(lo, hi) for _ in range(k)]

    head = [bos] if bos is not None else []
    system = head + ids(system_tokens - len(head))
    out: list[tuple[bool, list[int]]] = []
    for _ in range(rounds):
        out.append((True, system + ids(question_tokens)))
        out += [(False, head + ids(prompt_tokens - len(head))) for _ in range(every - 1)]
    return out


async def eviction_figures(engine: AsyncEngine, num_kv_blocks: int, rounds: int = 8, every: int = 4,
                           system_tokens: int = 512, prompt_tokens: int = 512, max_tokens: int = 8,
                           progress: bool = True) -> list[EvictionRun]:
    """The same requests, one at a time (so TTFT is the prefill alone), each through three clones of
    `engine` with a pool of `num_kv_blocks`: prefix caching off (the reference outputs), "lru", and the
    default policy. A pool smaller than one round's blocks makes the one-off prompts evict the
    system prompt between its uses unless the policy keeps it."""
    workload = eviction_workload(random.Random(5), engine.tokenizer.bos_token_id, rounds, every, system_tokens,
                                 prompt_tokens, vocab=engine.vocab_size)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    # "Found": all of the system prompt's full blocks but the last one may be cut by the BOS offset.
    found = (system_tokens // engine.config.block_size - 1) * engine.config.block_size
    configs: dict[str, dict[str, Any]] = {"off": {"enable_prefix_caching": False}, "lru": {"eviction_policy": "lru"},
                                          "default": {"eviction_policy": None}}
    outs: dict[str, list[GenerateOutput]] = {name: [] for name in configs}
    async with contextlib.AsyncExitStack() as stack:
        clones = {name: await stack.enter_async_context(engine.clone(num_kv_blocks=num_kv_blocks, **options))
                  for name, options in configs.items()}
        for clone in clones.values():
            await clone.generate(workload[-1][1][:64], SamplingParams(max_tokens=2))  # warm-up, not counted
        before = {name: clone.stats() for name, clone in clones.items()}
        it: Any = workload
        if progress:
            from tqdm import tqdm

            it = tqdm(workload, desc="eviction", unit="req", leave=False)
        # Request by request through the three pools in turn, not one policy after another: other
        # work on a shared machine then slows every policy alike, and TTFTs stay comparable.
        for _, prompt in it:
            for name, clone in clones.items():
                outs[name].append(await clone.generate(prompt, params))
        after = {name: clone.stats() for name, clone in clones.items()}
    runs = []
    for name in configs:
        st, st0, o = after[name], before[name], outs[name]
        q = st.prefix_cache_query_tokens - st0.prefix_cache_query_tokens
        h = st.prefix_cache_hit_tokens - st0.prefix_cache_hit_tokens
        shared = [x for (s, _), x in zip(workload, o, strict=True) if s]
        runs.append(EvictionRun(
            policy=name, prefix_cache_hit_rate=h / q if q else 0.0,
            shared_prompt_hits=sum(1 for x in shared if x.metrics.num_cached_prompt_tokens >= found),
            shared_prompt_requests=len(shared),
            prefix_cache_evictions=st.prefix_cache_evictions - st0.prefix_cache_evictions,
            ttft_p50_ms=_pct([x.metrics.ttft for x in o], 50) or 0.0,
            ttft_shared_p50_ms=_pct([x.metrics.ttft for x in shared], 50) or 0.0,
            outputs=[x.token_ids for x in o]))
    return runs
