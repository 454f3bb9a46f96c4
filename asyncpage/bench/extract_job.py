"""`asyncpage bench --workload extract`: the extraction job's records per second, beside llama-server.

60 ticket-like records (`tickets`: generated here, deterministic in the seed; customers, products,
order ids `ORD-nnnnn` or none, refund asks, severities stated in words; 60-120 words each) and one
JSON schema (TICKET_SCHEMA, tests/data/ticket_severity.schema.json). asyncpage's side is
`engine.extract_many(records, TICKET_SCHEMA, concurrency=N)` on the engine's defaults (copy_fields
off: no copied spans, no beams, no scored decisions; `--copy-fields auto` adds a second run with them),
timed from the first submit to the last result. llama-server's side (`--llama-server PATH`, one slot per
parallel request: `-np N`, the same GGUF and threads) gets N `/completion` requests in flight at a
time, each with the same prompt text extract_many writes for the record (`prompts`: its default prompt,
asyncpage.extract.prompt.schema_prompt), `json_schema` = the schema, greedy, the same max_tokens.
Printed: records/s of each side, the ratio, how many outputs are JSON valid against the schema
(jsonschema), and how many fields equal the generated record's own values.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from asyncpage.bench.llama_server import (
    LlamaServerError,
    _stop,
    _tail,
    _wait_healthy,
    find_llama_server,
    free_port,
    gather_or_cancel,
    server_command,
)
from asyncpage.bench.throughput import Item

TICKET_SCHEMA: dict[str, Any] = {
    "title": "Ticket",
    "type": "object",
    "properties": {
        "customer": {"type": "string", "description": "full name of the person who wrote the ticket"},
        "product": {"type": "string", "description": "the product brand the ticket is about"},
        "order_id": {"type": ["string", "null"], "description": "the order id, null when the ticket gives none"},
        "refund": {"type": "boolean", "description": "true when the customer asks for money back"},
        "severity": {"enum": ["low", "medium", "high", "critical"], "description": "how severe the issue is"},
    },
    "required": ["customer", "product", "order_id", "refund", "severity"],
    "additionalProperties": False,
}
MAX_TOKENS = 1024  # extract_many's default budget (extract.run.json_params), given to llama-server too

_FIRST = ["Maria", "James", "Aiko", "Oluwaseun", "Pieter", "Sofia", "Rahul", "Chloe", "Mateo", "Ingrid",
          "Wei", "Fatima", "Lukas", "Amara", "Diego", "Hannah", "Kenji", "Nadia", "Tomasz", "Grace"]
_LAST = ["Okafor", "Lindqvist", "Tanaka", "Fernandes", "de Vries", "Kowalski", "Haddad", "Brennan",
         "Castillo", "Novak", "Chen", "Adeyemi", "Moreau", "Schmidt", "Patel", "O'Neill", "Rossi", "Yilmaz"]
_PRODUCTS = [("Northwind", "router"), ("Brightline", "electric kettle"), ("Kestrel", "laptop"),
             ("Orbita", "smart watch"), ("Vellum", "note-taking app"), ("Cobalt", "wireless earbuds"),
             ("Tidewater", "coffee grinder"), ("Helix", "fitness tracker"), ("Quarry", "backup drive"),
             ("Lumen", "desk lamp"), ("Ferro", "espresso machine"), ("Solace", "sleep headphones")]
_PROBLEMS = ["stops working after a few minutes", "will not turn on at all", "keeps dropping the connection",
             "shows an error code on start-up", "arrived with a cracked casing", "loses all its settings every night",
             "makes a loud grinding noise", "charges to only half of its battery", "crashes when I open it",
             "was delivered without the power cable"]
# (the words the ticket states it in, the enum value)
_SEVERITY = [("It is a minor annoyance, nothing urgent.", "low"), ("This is low priority for me.", "low"),
             ("It is a moderate problem but I can work around it.", "medium"),
             ("Medium severity, I would say.", "medium"),
             ("This is a serious problem, I cannot do my work.", "high"),
             ("High priority please, it blocks my whole team.", "high"),
             ("URGENT: this is critical, our whole office is down.", "critical"),
             ("This is critical, we are losing customers every hour.", "critical")]
_REFUND_YES = ["I want a full refund.", "Please give me my money back.", "I am asking for a refund of the price.",
               "Refund me, please; I do not want a replacement."]
_REFUND_NO = ["I do not want a refund, I just want it fixed.", "No refund needed, please send a replacement.",
              "I would rather keep it if you can repair it."]
_FILLER = ["I bought it a few weeks ago from your online shop.", "I have already restarted it several times.",
           "The manual did not say anything about this.", "My neighbour has the same model and it works fine.",
           "I followed every step in your troubleshooting guide.", "I have been a customer for many years.",
           "Nobody answered when I called your hotline yesterday.", "It worked perfectly for the first two days.",
           "I tried it in another room and with another cable too.", "Please let me know what you need from me."]


def tickets(n: int = 60, seed: int = 0) -> list[dict[str, Any]]:
    """n records {"id", "text", "expected"}: a ticket as an email, a chat log or a plain message, and
    the values its text states (what a right extraction gives)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        name = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
        brand, thing = rng.choice(_PRODUCTS)
        order = f"ORD-{rng.randint(10000, 99999)}" if rng.random() < 0.6 else None
        ask = rng.random()
        refund = ask < 0.45
        words, severity = rng.choice(_SEVERITY)
        body = [f"My {brand} {thing} {rng.choice(_PROBLEMS)}."]
        if order:
            body.append(rng.choice([f"The order number is {order}.", f"It came with order {order}.",
                                    f"Order {order} was delivered last week."]))
        body += rng.sample(_FILLER, rng.randint(3, 6))
        body.append(words)
        if refund:
            body.append(rng.choice(_REFUND_YES))
        elif ask < 0.75:
            body.append(rng.choice(_REFUND_NO))
        while len(" ".join(body).split()) < 60:
            body.insert(-1, rng.choice([f for f in _FILLER if f not in body]))
        text = " ".join(body)
        style = i % 3
        if style == 0:
            text = f"Subject: Problem with my {brand} {thing}\n\nHello,\n{text}\n\nRegards,\n{name}"
        elif style == 1:
            text = (f"[10:{i % 60:02d}] Agent (Sam): Hi, how can I help?\n"
                    f"[10:{(i + 1) % 60:02d}] Customer ({name}): {text}")
        else:
            text = f"From: {name}\n{text}"
        out.append({"id": f"T{i + 1:03d}", "text": text,
                    "expected": {"customer": name, "product": brand, "order_id": order, "refund": refund,
                                 "severity": severity}})
    return out


def prompts(records: Sequence[Mapping[str, Any]], schema: dict[str, Any], max_model_len: int) -> list[str]:
    """The prompt text extract_many(records, schema) writes for each record by default (copy_fields off,
    no examples): extract.many's own construction."""
    from asyncpage.extract import grounding
    from asyncpage.extract.prompt import render_prompt, schema_prompt
    from asyncpage.extract.run import DEMOS_MIN_CONTEXT

    marked = grounding.mark(schema, None)
    fn = schema_prompt(marked, copied=grounding.copied_names(marked), demos=max_model_len >= DEMOS_MIN_CONTEXT)
    return [render_prompt(fn, r) for r in records]


class Side(msgspec.Struct):
    name: str
    records: int
    wall_s: float
    records_per_s: float
    valid: int  # outputs that parse as JSON and validate against the schema
    fields_right: int
    fields: int
    options: str = ""
    at_budget: int = 0  # outputs ended by max_tokens (asyncpage: closed early, valid; llama-server: cut)
    errors: int = 0  # asyncpage: records that came back with an error
    right_by_field: dict[str, int] = {}


def score(name: str, values: Sequence[Any], records: Sequence[Mapping[str, Any]], schema: dict[str, Any],
          wall: float, options: str = "", at_budget: int = 0, errors: int = 0) -> Side:
    """values: each record's parsed value (None where it failed or did not parse)."""
    import jsonschema

    check = jsonschema.Draft202012Validator(schema)
    valid = sum(1 for v in values if v is not None and check.is_valid(v))
    right = total = 0
    by_field: dict[str, int] = {}
    for v, r in zip(values, records, strict=True):
        for k, want in r["expected"].items():
            total += 1
            ok = isinstance(v, dict) and k in v and v[k] == want
            right += ok
            by_field[k] = by_field.get(k, 0) + ok
    return Side(name, len(values), wall, len(values) / wall if wall > 0 else float("nan"), valid, right, total,
                options, at_budget, errors, by_field)


async def run_asyncpage(engine: Any, records: Sequence[Mapping[str, Any]], schema: dict[str, Any],
                        concurrency: int, copy_fields: str | None = None) -> Side:
    """One extract_many job over the records, from its call to its last result."""
    by_id: dict[Any, Any] = {}
    job = [{"id": r["id"], "text": r["text"]} for r in records]
    early = errors = 0
    t0 = time.perf_counter()
    async for res in engine.extract_many(job, schema, concurrency=concurrency, copy_fields=copy_fields):
        by_id[res.id] = res.value if res.ok else None
        early += res.closed_early
        errors += not res.ok
    wall = time.perf_counter() - t0
    opts = f"copy_fields={copy_fields!r}" + ("" if copy_fields else ", no beams, no scored decisions")
    return score(f"asyncpage extract_many ({opts})", [by_id.get(r["id"]) for r in records], records, schema,
                 wall, opts, early, errors)


async def _post(client: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = await client.post(url + "/completion", json=body, timeout=None)
    if r.status_code != 200:
        raise LlamaServerError(f"/completion answered {r.status_code}: {r.text[:200]}")
    out: dict[str, Any] = r.json()
    return out


def _parse(content: Any) -> Any:
    try:
        return json.loads(content) if isinstance(content, str) else None
    except ValueError:
        return None


async def run_llama_server_extract(binary: str, model: str, texts: Sequence[str], schema: dict[str, Any],
                                   concurrency: int, threads: int, prompt_tokens: Sequence[int],
                                   max_tokens: int = MAX_TOKENS,
                                   startup_timeout: float = 300.0) -> tuple[float, list[Any], int]:
    """llama-server with `concurrency` slots on `model`; after a short warm-up, every prompt as a greedy
    /completion with `json_schema`, `concurrency` in flight at a time. (wall seconds, each output's
    parsed JSON or None, how many ended at max_tokens); the server is stopped before returning (or raising)."""
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # Each slot's context holds the longest prompt and the whole budget (the cache is split between slots).
    sizing = [Item([0] * n, max_tokens) for n in prompt_tokens]
    cmd = server_command(binary, model, sizing, threads, port, slots=concurrency)
    outs: list[Any] = [None] * len(texts)
    limited = [False] * len(texts)
    gate = asyncio.Semaphore(concurrency)

    async def one(client: Any, i: int) -> None:
        body = {"prompt": texts[i], "n_predict": max_tokens, "temperature": 0.0, "top_k": 1,
                "json_schema": schema, "cache_prompt": True, "stream": False}
        async with gate:
            answer = await _post(client, url, body)
        outs[i] = _parse(answer.get("content"))
        limited[i] = answer.get("stop_type") == "limit" or int(answer.get("tokens_predicted") or 0) >= max_tokens

    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        try:
            async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 4)) as client:
                await _wait_healthy(client, proc, url, startup_timeout)
                await _post(client, url, {"prompt": texts[0][:64], "n_predict": 4, "temperature": 0.0,
                                          "stream": False})  # warm-up, not counted
                t0 = time.perf_counter()
                await gather_or_cancel([one(client, i) for i in range(len(texts))])
                wall = time.perf_counter() - t0
        except LlamaServerError as exc:
            raise LlamaServerError(f"{exc}; its log ends:\n{_tail(log)}") from None
        finally:
            _stop(proc)
    return wall, outs, sum(limited)


def format_side(s: Side) -> str:
    return (f"{s.name}: {s.records} records in {s.wall_s:.1f} s = {s.records_per_s:.2f} records/s; "
            f"valid JSON for the schema {s.valid}/{s.records}; fields right {s.fields_right}/{s.fields} ("
            + ", ".join(f"{k} {v}" for k, v in s.right_by_field.items()) + ")"
            + (f"; {s.at_budget} ended at max_tokens ({MAX_TOKENS})" if s.at_budget else "")
            + (f"; {s.errors} records failed" if s.errors else ""))


async def bench_extract(args: argparse.Namespace) -> int:
    """The `--workload extract` figures (see the module's docstring)."""
    from asyncpage import AsyncEngine
    from asyncpage.extract.run import beams_per_record

    n, par = args.num_requests, args.max_num_seqs
    copy_fields = getattr(args, "copy_fields", None)
    server_bin = None
    try:
        width = max(1, beams_per_record(TICKET_SCHEMA, copy_fields, None)) if copy_fields else 1
        server_bin = find_llama_server(args.llama_server) if args.llama_server or _env_server() else None
    except Exception as exc:  # a bad --copy-fields, a missing binary: refused before anything loads
        print(f"asyncpage bench: {exc}", file=sys.stderr)
        return 2
    records = tickets(n, args.seed)
    # Sized as `asyncpage extract` sizes its engine: room for every record's beams at once.
    engine = AsyncEngine.from_pretrained(args.model, dtype=args.dtype, device=args.device, num_threads=args.threads,
                                         max_num_seqs=par * width)
    c = engine.config
    threads = c.num_threads
    print(f"# model {engine.model_source} [{c.dtype}, quantization {c.quantization}, {threads} threads], "
          f"loaded in {engine.load_seconds:.1f} s", file=sys.stderr)
    texts = prompts(records, TICKET_SCHEMA, c.max_model_len)
    sides: list[Side] = []
    async with engine:
        lengths = [len(await engine.tokenize(t)) for t in texts]
        await engine.generate(texts[0][:200])  # warm-up (first-call allocations), not the schema's grammar
        sides.append(await run_asyncpage(engine, records, TICKET_SCHEMA, par))
        print(format_side(sides[-1]), flush=True)
        if copy_fields:
            sides.append(await run_asyncpage(engine, records, TICKET_SCHEMA, par, copy_fields))
            print(format_side(sides[-1]), flush=True)
    source = engine.model_source
    del engine
    base: Side | None = None
    if server_bin is None:
        print("# no llama-server (--llama-server PATH or $LLAMA_SERVER): asyncpage only", file=sys.stderr)
    elif not str(source).endswith(".gguf"):
        print(f"# llama-server needs a GGUF; the model is {source}", file=sys.stderr)
    else:
        try:
            wall, outs, at_limit = await run_llama_server_extract(server_bin, str(source), texts, TICKET_SCHEMA,
                                                                  par, threads, lengths)
        except LlamaServerError as exc:
            print(f"# llama-server: {exc}", file=sys.stderr)
            return 1
        base = score(f"llama-server ({par} slots, {threads} threads, json_schema, greedy)", outs, records,
                     TICKET_SCHEMA, wall, "json_schema", at_limit)
        print(format_side(base), flush=True)
    print(f"\nextract workload: {n} ticket records, {par} at a time, schema {TICKET_SCHEMA['title']}, prompts "
          f"{min(lengths)}-{max(lengths)} tokens (asyncpage's default prompt, the same text to both sides)")
    if base is not None:
        for s in sides:
            print(f"ratio {s.name} / llama-server: {s.records_per_s / base.records_per_s:.2f}x")
    if args.json:
        print(json.dumps([msgspec.to_builtins(s) for s in sides + ([base] if base else [])], indent=1))
    return 0


def _env_server() -> bool:
    return bool(os.environ.get("LLAMA_SERVER"))
