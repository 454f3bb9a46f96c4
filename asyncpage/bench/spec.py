"""`asyncpage bench --speculative ngram[:K]`: tokens/s with and without n-gram speculation, side by
side in one run on the same weights, per workload: one stream extracting JSON whose values are
copied from the record, one stream of free text, one of code (each `--repeat` times per engine, the
engines taking turns, medians), and the 32-request mixed workload. Greedy, so each stream's outputs
must be identical; the table says whether they are. The speedup is of tokens from submission to the
last one (the prompt's prefill included); "decode" is after the first token, as llama-bench's tg.
"""

from __future__ import annotations

import time
from statistics import median
from typing import Any

import msgspec

from asyncpage.bench.throughput import make_workload, run_engine
from asyncpage.engine import AsyncEngine
from asyncpage.params import SamplingParams

RECORD = (
    "Order confirmation\nCustomer: Margaret Okonkwo-Hall\nShipping address: 1742 Evergreen Terrace, Springfield, "
    "OR 97477\nEmail: margaret.okonkwo@northwind-mail.com\nPhone: +1 541 555 0198\nItems: 2 x Ergonomic Office "
    "Chair (Graphite), 1 x Standing Desk Converter 36in, 3 x USB-C Docking Station Pro\nPayment: Visa ending "
    "4821\nNotes: Leave the parcel with the concierge at the front desk.")
SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "properties": {"customer": {"type": "string"}, "address": {"type": "string"}, "email": {"type": "string"},
                   "phone": {"type": "string"}, "items": {"type": "array", "items": {"type": "string"}},
                   "payment": {"type": "string"}, "notes": {"type": "string"}},
    "required": ["customer", "address", "email", "phone", "items", "payment", "notes"]}
CODE = '''def moving_average(values, window):
    """Average of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = sum(values[:window])
    out.append(total / window)
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out
'''
STREAMS: dict[str, tuple[str, SamplingParams]] = {
    "extraction": (RECORD + "\n\nThe order above as JSON with the fields customer, address, email, phone, items, "
                   "payment, notes:\n", SamplingParams(max_tokens=256, temperature=0, json_schema=SCHEMA)),
    "free text": ("The history of the printing press begins in the fifteenth century, when",
                  SamplingParams(max_tokens=256, temperature=0)),
    "code": ("# The same function with type hints:\n" + CODE.replace("def moving_average(values, window):", "") +
             "\n# Original:\n" + CODE + "\n# With type hints:\ndef moving_average(",
             SamplingParams(max_tokens=256, temperature=0)),
}


async def _stream(engine: AsyncEngine, prompt: str, params: SamplingParams) -> tuple[list[int], float, float]:
    """(tokens, seconds from submission to the last token, seconds from the first token to the last: the
    engine's own decode_time, what llama-bench's tg figure times)."""
    t0 = time.perf_counter()
    out = await engine.generate(prompt, params)
    return out.token_ids, time.perf_counter() - t0, out.metrics.decode_time


async def speculative_figures(base: AsyncEngine, config: dict[str, Any], num_requests: int = 32,
                              seed: int = 0, repeat: int = 3,
                              streams: dict[str, tuple[str, SamplingParams]] | None = None) -> list[dict[str, Any]]:
    """One row per workload: tok/s without and with speculation, the ratio, the share of drafts
    kept, the mean kept run per verification, and whether the outputs were identical. Each stream runs
    `repeat` times on each engine, the two taking turns (which one goes first alternates), each run with its
    own prefix-cache salt (its prompt prefilled every time): the medians are reported, so a machine's
    slower spell (this kind of VM varies ~15% within a minute) lands on both. `streams`: STREAMS by default."""
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    spec = base.clone(speculative_config=config)
    rows = []
    async with base, spec:
        for name, (prompt, params) in (STREAMS if streams is None else streams).items():
            runs: dict[str, list[tuple[list[int], float, float]]] = {"off": [], "on": []}
            for engine in (base, spec):
                # Warm-up, untimed, on each engine alike: a prompt of the stream's own length (other text,
                # so nothing of it is cached) under the same parameters: the first prefill of a shape and a
                # grammar's first masks cost ~0.2 s more than later ones, which whichever engine ran
                # first would otherwise pay alone.
                await engine.generate("Warm-up. " + prompt[9:], msgspec.structs.replace(params, max_tokens=2))
            b = spec.stats()
            for r in range(repeat):
                order = (("off", base), ("on", spec)) if r % 2 == 0 else (("on", spec), ("off", base))
                for label, engine in order:
                    salted = msgspec.structs.replace(params, cache_salt=f"bench-{name}-{r}")
                    runs[label].append(await _stream(engine, prompt, salted))
            a = spec.stats()
            proposed = a.spec_proposed_tokens - b.spec_proposed_tokens
            kept = a.spec_accepted_tokens - b.spec_accepted_tokens
            off, on = runs["off"], runs["on"]
            n_on = sum(len(ids) for ids, _, _ in on)
            rows.append({"workload": f"{name} (1 stream)",
                         "tok_s_off": median(len(ids) / t for ids, t, _ in off),
                         "tok_s_on": median(len(ids) / t for ids, t, _ in on),
                         "speedup": median((len(i1) / t1) / (len(i0) / t0)
                                           for (i0, t0, _), (i1, t1, _) in zip(off, on, strict=True)),
                         # after the first token (the prompt's prefill, the same work either way, left out)
                         "decode_speedup": median(((len(i1) - 1) / d1) / ((len(i0) - 1) / d0)
                                                  for (i0, _, d0), (i1, _, d1) in zip(off, on, strict=True))
                         if all(d > 0 and len(ids) > 1 for ids, _, d in off + on) else None,
                         "acceptance": kept / proposed if proposed else None,
                         "tokens_per_step": n_on / max(1, n_on - kept),
                         "identical": all(ids == off[0][0] for ids, _, _ in off + on)})
    if num_requests <= 0:
        return rows  # the streams alone
    items = make_workload("mixed", num_requests, base.vocab_size, base.tokenizer.bos_token_id, seed)
    res = {}
    for label, engine in (("off", base), ("on", spec)):
        async with engine:
            await engine.generate("Hello", SamplingParams(max_tokens=4, temperature=0))
            before = engine.stats()
            res[label] = (await run_engine(engine, items, f"mixed speculative {label}", progress=False), before,
                          engine.stats())
    mixed_off, mixed_on = res["off"][0], res["on"][0]
    b, a = res["on"][1], res["on"][2]
    proposed = a.spec_proposed_tokens - b.spec_proposed_tokens
    kept = a.spec_accepted_tokens - b.spec_accepted_tokens
    rows.append({"workload": f"mixed ({num_requests} requests)", "tok_s_off": mixed_off.throughput_tok_s,
                 "tok_s_on": mixed_on.throughput_tok_s,
                 "speedup": mixed_on.throughput_tok_s / mixed_off.throughput_tok_s,
                 "decode_speedup": None,
                 "acceptance": kept / proposed if proposed else None, "tokens_per_step": None, "identical": None})
    return rows


def format_rows(rows: list[dict[str, Any]], config: dict[str, Any]) -> str:
    head = (f"speculative decoding {config}: greedy, same engine weights, without vs with\n"
            f"{'workload':<24}{'tok/s off':>10}{'tok/s on':>10}{'speedup':>9}{'decode':>8}{'kept':>7}{'tok/step':>9}"
            "  same output\n(speedup: submission to last token, the prompt's prefill included; decode: after the first "
            "token, as llama-bench's tg)")
    lines = [head]
    for r in rows:
        kept = f"{r['acceptance']:.0%}" if r["acceptance"] is not None else "-"
        per = f"{r['tokens_per_step']:.2f}" if r["tokens_per_step"] is not None else "-"
        dec = f"{r['decode_speedup']:.2f}x" if r.get("decode_speedup") is not None else "-"
        lines.append(f"{r['workload']:<24}{r['tok_s_off']:>10.1f}{r['tok_s_on']:>10.1f}{r['speedup']:>8.2f}x"
                     f"{dec:>8}{kept:>7}{per:>9}  {_same(r['identical'])}")
    return "\n".join(lines)


def _same(identical: bool | None) -> str:
    return "-" if identical is None else "yes" if identical else "NO"
