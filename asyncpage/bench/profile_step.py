"""`python -m asyncpage.bench.profile_step`: where one stream's decode step goes, part by part.

    python -m asyncpage.bench.profile_step                      # from_pretrained()'s defaults ("gguf")
    python -m asyncpage.bench.profile_step --settings gguf,float32,int4 --tokens 128

One greedy stream on the default model (a 32-token random prompt, as `asyncpage bench --workload
single`), after a warm-up request; prints the mean milliseconds per decode step of each part of the
engine loop (schedule, prepare, forward, LM head, sampling, commit, stats, and what is left: the
hand-offs between the event loop and the compute thread, once per burst of steps, and posting each
step's output), what "outside the forward" sums to, and what the event loop does beside the next step
(detokenizer, mailbox) with the latency until the caller's read of the request's mailbox (what `async
for` over a stream awaits) returns the token.

The timers are wrappers set as instance attributes on one engine's own objects (its scheduler, runner,
model, compute thread, and the profiled request's detokenizer and mailbox) for the profiled request,
and removed afterwards: the engine has no timing code, so profiling off costs nothing. A second,
uninstrumented request gives the tok/s without the wrappers (their cost shows as the difference).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import gc
import inspect
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import msgspec

from asyncpage.bench.quant import parse_setting
from asyncpage.bench.throughput import make_workload
from asyncpage.engine import AsyncEngine
from asyncpage.params import SamplingParams


class StepTimer:
    """Durations (ns) of each wrapped call, per part, in call order; `mark` keeps timestamps."""

    def __init__(self) -> None:
        self.calls: dict[str, list[int]] = defaultdict(list)
        self.marks: dict[str, list[int]] = defaultdict(list)
        self._undo: list[Callable[[], None]] = []

    def wrap(self, obj: Any, name: str, part: str, mark_start: bool = False, mark_end: bool = False) -> None:
        """Time every call of `obj.name` under `part` until `remove()`."""
        fn = getattr(obj, name)
        calls, starts, ends = self.calls[part], self.marks[part + ":start"], self.marks[part + ":end"]
        clock = time.perf_counter_ns
        timed: Callable[..., Any]
        if inspect.iscoroutinefunction(fn):
            async def timed(*args: Any, **kwargs: Any) -> Any:
                t0 = clock()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    calls.append(clock() - t0)
        else:
            def timed(*args: Any, **kwargs: Any) -> Any:
                t0 = clock()
                if mark_start:
                    starts.append(t0)
                try:
                    return fn(*args, **kwargs)
                finally:
                    t1 = clock()
                    calls.append(t1 - t0)
                    if mark_end:
                        ends.append(t1)
        own = name in getattr(obj, "__dict__", {})
        setattr(obj, name, timed)
        self._undo.append((lambda: setattr(obj, name, fn)) if own else (lambda: delattr(obj, name)))

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()


def attach(engine: AsyncEngine, timer: StepTimer) -> None:
    """Wrap the engine-wide parts (the per-request ones are wrapped in `profile_request`)."""
    core = engine._core
    timer.wrap(core.scheduler, "schedule", "schedule", mark_start=True)
    timer.wrap(core.runner, "prepare", "prepare")
    timer.wrap(core.compute, "arun", "arun")
    timer.wrap(core.runner, "execute", "execute")
    timer.wrap(core.runner.model, "forward", "forward")
    timer.wrap(core.runner.model, "compute_logits_max", "lm_head")
    timer.wrap(core, "_advance", "advance")
    timer.wrap(core.output, "process", "process")
    timer.wrap(core, "_publish_stats", "stats")


async def profile_request(engine: AsyncEngine, prompt: list[int], params: SamplingParams,
                          timer: StepTimer | None) -> tuple[int, float, list[int]]:
    """Run one stream; returns (tokens, decode tok/s seen by the caller, each chunk's arrival ns)."""
    req = await engine.submit(prompt, params)
    if timer is not None:
        detok = req.seqs[0].detokenizer
        timer.wrap(detok, "add", "detokenizer")
        timer.wrap(req.mailbox, "put", "mailbox", mark_end=True)
    n, arrivals = 0, []
    try:
        while True:
            chunks = await req.mailbox.get()
            arrivals.append(time.perf_counter_ns())
            n += sum(len(c.token_ids) for c in chunks)
            if any(c.finish_reason is not None for c in chunks):
                break
    finally:
        await engine.wait_released(req)
    decode_s = (arrivals[-1] - arrivals[0]) / 1e9
    return n, (n - 1) / decode_s if decode_s > 0 else float("nan"), arrivals


def step_table(timer: StepTimer, arrivals: list[int]) -> list[tuple[str, float]]:
    """Mean ms per decode step of each part: the first step (prefill) and the last are left out."""
    c = timer.calls
    steps = len(c["schedule"])
    # One call per step at batch 1 (stats once more: the idle loop publishes a last snapshot, and once
    # before each burst). The hand-offs to the compute thread are fewer: one per burst of steps.
    for name in ("prepare", "execute", "forward", "lm_head", "advance", "process"):
        assert len(c[name]) == steps, f"{name}: {len(c[name])} calls for {steps} steps"
    keep = range(1, steps - 1)

    def mean(xs: list[float]) -> float:
        return statistics.fmean(xs) / 1e6

    def part(name: str) -> list[float]:
        return [float(c[name][i]) for i in keep]

    starts = timer.marks["schedule:start"]
    total = mean([float(starts[i + 1] - starts[i]) for i in keep])
    detok = [float(x) for x in c["detokenizer"][1 : steps - 1]]
    mailbox = [float(x) for x in c["mailbox"][1 : steps - 1]]
    # Each read of the mailbox against the last put before it (a reader behind a burst reads several at once).
    puts = timer.marks["mailbox:end"]
    delivery = [float(a - puts[i - 1]) for a in arrivals[1:-1] if (i := bisect.bisect_right(puts, a)) > 0]
    sched, prep, exe, fwd, head, adv, proc = (mean(part(x)) for x in ("schedule", "prepare", "execute", "forward",
                                                                        "lm_head", "advance", "process"))
    stats = sum(c["stats"]) / 1e6 / steps
    on_path = sched + prep + exe + adv + stats
    rows = [
        ("schedule", sched),
        ("prepare (tensors)", prep),
        ("forward: embed + layers + norm", fwd),
        ("forward: LM head", head),
        ("sampling + execute glue", exe - fwd - head),
        ("commit: scheduler side", adv),
        ("publish stats", stats),
        ("hand-offs, posting, the loop", total - on_path),
        ("total (step to step)", total),
        ("outside the forward", total - fwd - head),
        ("steps per hand-off", steps / max(1, len(c["arun"]))),
        ("on the event loop, beside the next step:", 0.0),
        ("  detokenizer", mean(detok)),
        ("  mailbox put", mean(mailbox)),
        ("  rest of output processing", proc - mean(detok) - mean(mailbox)),
        ("  caller gets the token, after put", mean(delivery) if delivery else float("nan")),
    ]
    return rows


async def profile_setting(setting: str, args: argparse.Namespace) -> tuple[list[tuple[str, float]], float, float]:
    t0 = time.perf_counter()
    engine = AsyncEngine.from_pretrained(args.model, num_kv_blocks=64, num_threads=args.threads,
                                         **parse_setting(setting))
    print(f"{setting}: loaded in {time.perf_counter() - t0:.1f} s ({engine.config.dtype}, "
          f"quantization={engine.config.quantization})", file=sys.stderr, flush=True)
    prompt = make_workload("single", 1, engine.vocab_size, engine.tokenizer.bos_token_id)[0].prompt
    params = SamplingParams(max_tokens=args.tokens, temperature=args.temperature, seed=0, ignore_eos=True)
    async with engine:
        await profile_request(engine, prompt, msgspec.structs.replace(params, max_tokens=16), None)  # warm-up
        timer = StepTimer()
        attach(engine, timer)
        try:
            _, tok_s, arrivals = await profile_request(engine, prompt, params, timer)
        finally:
            timer.remove()
        _, plain_tok_s, _ = await profile_request(engine, prompt, params, None)
    rows = step_table(timer, arrivals)
    del engine
    gc.collect()
    return rows, tok_s, plain_tok_s


async def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncpage.bench.profile_step", description=__doc__.split("\n")[0])
    ap.add_argument("--settings", default="gguf", help="comma-separated, as `asyncpage bench --settings` "
                    "(gguf: from_pretrained()'s defaults, the GGUF's own blocks; float32, bfloat16, auto: "
                    "float weights; int8, int4, ...+kv=int8)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated by the profiled stream")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (as the bench)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    results = [await profile_setting(s, args) for s in settings]
    print(f"\nms per decode step, one stream, {args.tokens} tokens, temperature {args.temperature}")
    w = max(12, *(len(s) + 2 for s in settings))  # a column as wide as its setting's name
    print(f"{'part':<36}" + "".join(f"{s:>{w}}" for s in settings))
    for i, (name, _) in enumerate(results[0][0]):
        if name.endswith(":"):  # a heading
            print(name)
            continue
        print(f"{name:<36}" + "".join(f"{rows[i][1]:{w}.3f}" for rows, _, _ in results))
    print(f"{'tok/s, profiled':<36}" + "".join(f"{t:{w}.1f}" for _, t, _ in results))
    print(f"{'tok/s, no wrappers':<36}" + "".join(f"{t:{w}.1f}" for _, _, t in results))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
