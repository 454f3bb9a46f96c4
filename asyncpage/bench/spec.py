"""`asyncpage bench --speculative ngram[:K]`: tokens/s with and without n-gram speculation, side by
side in one run on the same weights, per workload: one stream extracting JSON whose values are
copied from the record, one stream of free text, one of code, and the 32-request mixed workload.
Greedy, so each stream's outputs must be identical; the table says whether they are.
"""

from __future__ import annotations

import time
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


async def _stream(engine: AsyncEngine, prompt: str, params: SamplingParams) -> tuple[list[int], float]:
    t0 = time.perf_counter()
    out = await engine.generate(prompt, params)
    return out.token_ids, time.perf_counter() - t0


async def speculative_figures(base: AsyncEngine, config: dict[str, Any], num_requests: int = 32,
                              seed: int = 0) -> list[dict[str, Any]]:
    """One row per workload: tok/s without and with speculation, the ratio, the share of drafts
    kept, the mean kept run per verification, and whether the outputs were identical."""
    spec = base.clone(speculative_config=config)
    rows = []
    for name, (prompt, params) in STREAMS.items():
        got = {}
        for label, engine in (("off", base), ("on", spec)):
            async with engine:
                # Warm-up, untimed, on each engine alike: a prompt of the stream's own length (other text,
                # so nothing of it is cached) under the same parameters: the first prefill of a shape and a
                # grammar's first masks cost ~0.2 s more than later ones, which whichever engine ran
                # first would otherwise pay alone.
                await engine.generate("Warm-up. " + prompt[9:], msgspec.structs.replace(params, max_tokens=2))
                before = engine.stats()
                got[label] = (*await _stream(engine, prompt, params), before, engine.stats())
        (ids_off, s_off, _, _), (ids_on, s_on, b, a) = got["off"], got["on"]
        proposed = a.spec_proposed_tokens - b.spec_proposed_tokens
        kept = a.spec_accepted_tokens - b.spec_accepted_tokens
        rows.append({"workload": f"{name} (1 stream)", "tok_s_off": len(ids_off) / s_off,
                     "tok_s_on": len(ids_on) / s_on, "speedup": (len(ids_on) / s_on) / (len(ids_off) / s_off),
                     "acceptance": kept / proposed if proposed else None,
                     "tokens_per_step": len(ids_on) / max(1, len(ids_on) - kept), "identical": ids_on == ids_off})
    items = make_workload("mixed", num_requests, base.vocab_size, base.tokenizer.bos_token_id, seed)
    res = {}
    for label, engine in (("off", base), ("on", spec)):
        async with engine:
            await engine.generate("Hello", SamplingParams(max_tokens=4, temperature=0))
            before = engine.stats()
            res[label] = (await run_engine(engine, items, f"mixed speculative {label}", progress=False), before,
                          engine.stats())
    off, on = res["off"][0], res["on"][0]
    b, a = res["on"][1], res["on"][2]
    proposed = a.spec_proposed_tokens - b.spec_proposed_tokens
    kept = a.spec_accepted_tokens - b.spec_accepted_tokens
    rows.append({"workload": f"mixed ({num_requests} requests)", "tok_s_off": off.throughput_tok_s,
                 "tok_s_on": on.throughput_tok_s, "speedup": on.throughput_tok_s / off.throughput_tok_s,
                 "acceptance": kept / proposed if proposed else None, "tokens_per_step": None, "identical": None})
    return rows


def format_rows(rows: list[dict[str, Any]], config: dict[str, Any]) -> str:
    head = (f"speculative decoding {config}: greedy, same engine weights, without vs with\n"
            f"{'workload':<24}{'tok/s off':>10}{'tok/s on':>10}{'speedup':>9}{'kept':>7}{'tok/step':>9}  same output")
    lines = [head]
    for r in rows:
        kept = f"{r['acceptance']:.0%}" if r["acceptance"] is not None else "-"
        per = f"{r['tokens_per_step']:.2f}" if r["tokens_per_step"] is not None else "-"
        lines.append(f"{r['workload']:<24}{r['tok_s_off']:>10.1f}{r['tok_s_on']:>10.1f}{r['speedup']:>8.2f}x"
                     f"{kept:>7}{per:>9}  {_same(r['identical'])}")
    return "\n".join(lines)


def _same(identical: bool | None) -> str:
    return "-" if identical is None else "yes" if identical else "NO"
