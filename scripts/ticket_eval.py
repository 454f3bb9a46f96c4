"""Scores `asyncpage extract` output on labeled support tickets with a severity (tests/data/*_tickets*.jsonl:
one `{"id", "text", "label"}` line each).

    python scripts/ticket_eval.py --strip tests/data/dev_tickets.jsonl > /tmp/dev_in.jsonl   # the job's input
    asyncpage extract --schema tests/data/ticket_severity.schema.json --input /tmp/dev_in.jsonl \
        --output /tmp/dev_out.jsonl --copy-fields auto
    python scripts/ticket_eval.py tests/data/dev_tickets.jsonl /tmp/dev_out.jsonl

A label's string fields match exactly after stripping surrounding whitespace; a list is the answers accepted
(a product brand alone or with its model: ["Skyloft AX6", "Skyloft"]); null matches only null, booleans only
booleans. A field a label leaves out is not scored (severity where the ticket does not state it in words). A
record with an error or no output line is wrong in each of its scored fields. "Invented" counts string values,
in any field, that are not a substring of their ticket's text. Also printed, not in the overall figure: the
product read leniently, right when the value holds one of the accepted answers ("Skyloft AX6 router").
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

FIELDS = ("customer", "product", "order_id", "refund", "severity")


def read(path: str) -> dict[str, dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {str(r.get("id")): r for r in rows}


def same(got: Any, want: Any) -> bool:
    if isinstance(want, list):
        return any(same(got, w) for w in want)
    if want is None or isinstance(want, bool):
        return got is want
    if isinstance(want, str):
        return isinstance(got, str) and got.strip() == want.strip()
    return bool(got == want)


def score(tickets: dict[str, dict[str, Any]], outputs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    right = dict.fromkeys(FIELDS, 0)
    scored = dict.fromkeys(FIELDS, 0)
    wrong: list[tuple[str, str, Any, Any]] = []
    invented: list[tuple[str, str, str]] = []
    errors = 0
    for rid, t in tickets.items():
        label, row = t["label"], outputs.get(rid) or {}
        value = row.get("value") if isinstance(row.get("value"), dict) else None
        errors += value is None
        for f in FIELDS:
            if f not in label:
                continue
            scored[f] += 1
            got = value.get(f) if value is not None else "<error>"
            if value is not None and same(got, label[f]):
                right[f] += 1
            else:
                wrong.append((rid, f, got, label[f]))
        for f, v in (value or {}).items():
            if isinstance(v, str) and f != "severity" and v.strip() not in t["text"]:
                invented.append((rid, f, v))
    lenient = sum(1 for rid, t in tickets.items() if "product" in t["label"]
                  and isinstance(v := ((outputs.get(rid) or {}).get("value") or {}).get("product"), str)
                  and any(a in v for a in (t["label"]["product"] if isinstance(t["label"]["product"], list)
                                           else [t["label"]["product"]])))
    return {"right": right, "scored": scored, "wrong": wrong, "invented": invented, "errors": errors,
            "product_lenient": lenient}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tickets")
    p.add_argument("output", nargs="?")
    p.add_argument("--strip", action="store_true", help="print the tickets without their labels (the job's input)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    tickets = read(a.tickets)
    if a.strip:
        for rid, t in tickets.items():
            sys.stdout.write(json.dumps({"id": rid, "text": t["text"]}, ensure_ascii=False) + "\n")
        return 0
    if a.output is None:
        p.error("an output file to score (or --strip)")
    s = score(tickets, read(a.output))
    if a.json:
        print(json.dumps(s, ensure_ascii=False))
        return 0
    for f in FIELDS:
        print(f"  {f:<10} {s['right'][f]:>3}/{s['scored'][f]:<3}")
    total, n = sum(s["right"].values()), sum(s["scored"].values())
    print(f"  {'overall':<10} {total:>3}/{n:<3} {100 * total / max(n, 1):.1f}%   records with errors: {s['errors']}, "
          f"invented values: {len(s['invented'])}")
    print(f"  product, holding an accepted answer: {s['product_lenient']}/{s['scored']['product']}")
    for rid, f, got, want in s["wrong"]:
        print(f"    {rid} {f}: got {got!r}, want {want!r}")
    for rid, f, v in s["invented"]:
        print(f"    invented {rid} {f}: {v!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
