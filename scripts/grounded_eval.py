"""Scores `asyncpage extract` output on the grounded-extraction evaluation set (examples/grounded).

    python scripts/grounded_eval.py OUTPUT.jsonl [--labels L.jsonl] [--input T.jsonl]
    python scripts/grounded_eval.py --compare A.jsonl B.jsonl [--names "without copy" "with copy"]
    python scripts/grounded_eval.py OUTPUT.jsonl --rename name=customer   # a schema spelled its own way

Per-field accuracy is exact match after stripping surrounding whitespace (strings case-sensitive;
null matches only null, booleans only booleans); a record with an error or no output line counts
wrong in every field. "Invented values" are string values, in any field, that are not a substring
of their ticket's text (after stripping surrounding whitespace). `score()` is importable. Run on
the labels file itself, it is a self-check of the set: 100% and no invented values.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent / "examples" / "grounded"
FIELDS = ("customer", "product", "order_id", "refund")
SHOWN = 5  # invented values listed per run


def read_jsonl(path: str | Path) -> dict[str, dict[str, Any]]:
    """Rows keyed by their "id" (a later row for the same id replaces an earlier one, as after --resume)."""
    rows: dict[str, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                rows[str(row.get("id"))] = row
    return rows


class RenameClash(ValueError):
    """An output value holds both a renamed field and the name it is renamed to."""


def renamed(row: dict[str, Any], renames: dict[str, str]) -> dict[str, Any]:
    """An output row with its value's fields under the labels' names. A value that holds both a renamed
    field and the name it is renamed to is refused (RenameClash): one of the two would be dropped unscored."""
    value = row.get("value")
    if not renames or not isinstance(value, dict):
        return row
    out = {renames.get(k, k): v for k, v in value.items()}
    if len(out) != len(value):
        raise RenameClash(f"{row.get('id')}: --rename {sorted(renames.items())} clashes with its fields "
                          f"{sorted(value)}")
    return {**row, "value": out}


def _same(got: Any, want: Any) -> bool:
    if want is None:
        return got is None
    if isinstance(want, bool):
        return isinstance(got, bool) and got == want
    if isinstance(want, str):
        return isinstance(got, str) and got.strip() == want.strip()
    return bool(got == want)


def score(outputs: dict[str, dict[str, Any]], labels: dict[str, dict[str, Any]],
          texts: dict[str, str]) -> dict[str, Any]:
    """outputs: id -> output row ({"value": {...}} or {"error": {...}}); labels: id -> gold value;
    texts: id -> ticket text. Scores every labeled id; returns accuracies in [0, 1] and counts."""
    correct = dict.fromkeys(FIELDS, 0)
    errors = missing = strings = 0
    invented: list[tuple[str, str, str]] = []
    for rid, gold in labels.items():
        row = outputs.get(rid)
        if row is None:
            missing += 1
            continue
        value = row.get("value")
        if "error" in row or not isinstance(value, dict):
            errors += 1
            continue
        for f in FIELDS:
            correct[f] += _same(value.get(f), gold.get(f))
        for f, v in value.items():
            if isinstance(v, str):
                strings += 1
                if v.strip() not in texts.get(rid, ""):
                    invented.append((rid, f, v))
    n = len(labels)
    return {
        "records": n,
        "fields": {f: correct[f] / n if n else 0.0 for f in FIELDS},
        "correct": correct,
        "overall": sum(correct.values()) / (n * len(FIELDS)) if n else 0.0,
        "errors": errors,
        "missing": missing,
        "unlabeled": len(set(outputs) - set(labels)),
        "strings": strings,
        "invented": len(invented),
        "invented_examples": invented,
    }


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _report(s: dict[str, Any]) -> None:
    n = s["records"]
    print(f"per-field accuracy ({n} labeled records)")
    for f in FIELDS:
        print(f"  {f:<10} {_pct(s['fields'][f]):>7}  ({s['correct'][f]}/{n})")
    print(f"  {'overall':<10} {_pct(s['overall']):>7}  ({sum(s['correct'].values())}/{n * len(FIELDS)})")
    print(f"records with errors: {s['errors']}" + (f"; without an output line: {s['missing']}" if s["missing"] else "")
          + (f"; outputs with no label: {s['unlabeled']}" if s["unlabeled"] else ""))
    print(f"invented values: {s['invented']} of {s['strings']} string values")
    for rid, f, v in s["invented_examples"][:SHOWN]:
        print(f"  {rid} {f}: {v!r}")


def _compare(a: dict[str, Any], b: dict[str, Any], names: list[str]) -> None:
    w = max(14, *(len(x) + 2 for x in names))
    print(f"{'':<12}{names[0]:>{w}}{names[1]:>{w}}")
    for f in FIELDS:
        print(f"{f:<12}{_pct(a['fields'][f]):>{w}}{_pct(b['fields'][f]):>{w}}")
    print(f"{'overall':<12}{_pct(a['overall']):>{w}}{_pct(b['overall']):>{w}}")
    for key, label in (("errors", "errors"), ("missing", "missing"), ("invented", "invented")):
        print(f"{label:<12}{a[key]:>{w}}{b[key]:>{w}}")
    for name, s in zip(names, (a, b), strict=True):
        for rid, f, v in s["invented_examples"][:SHOWN]:
            print(f"  invented ({name}) {rid} {f}: {v!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("output", nargs="?", help="output of `asyncpage extract` (JSONL)")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="score two outputs side by side")
    p.add_argument("--names", nargs=2, metavar=("NAME_A", "NAME_B"), help="column titles for --compare")
    p.add_argument("--labels", default=str(HERE / "labels.jsonl"))
    p.add_argument("--input", default=str(HERE / "tickets.jsonl"))
    p.add_argument("--rename", action="append", default=[], metavar="OUT=LABEL",
                   help="an output field that holds a label field under another name (a schema of its own "
                        "spelling, e.g. name=customer); repeatable")
    args = p.parse_args(argv)
    pairs = [r.split("=", 1) for r in args.rename]
    if any(len(x) != 2 or not all(x) for x in pairs):
        p.error("--rename takes OUT=LABEL, both named")
    renames = dict((out, label) for out, label in pairs)
    if len(renames) != len(pairs) or len(set(renames.values())) != len(pairs):
        p.error("--rename: each output field and each label field at most once")
    if set(renames.values()) - set(FIELDS):
        p.error(f"--rename OUT=LABEL: LABEL is one of the labels' fields {FIELDS}")

    def outputs(path: str) -> dict[str, dict[str, Any]]:
        return {rid: renamed(row, renames) for rid, row in read_jsonl(path).items()}

    if (args.output is None) == (args.compare is None):
        p.error("give either OUTPUT.jsonl or --compare A.jsonl B.jsonl")
    labels = {rid: row["value"] for rid, row in read_jsonl(args.labels).items()}
    texts = {rid: row["text"] for rid, row in read_jsonl(args.input).items()}
    try:
        return _run(args, labels, texts, outputs)
    except RenameClash as exc:
        p.error(str(exc))


def _run(args: argparse.Namespace, labels: dict[str, Any], texts: dict[str, str],
         outputs: Callable[[str], dict[str, dict[str, Any]]]) -> int:
    if args.compare:
        a, b = (score(outputs(path), labels, texts) for path in args.compare)
        _compare(a, b, args.names or [Path(x).name for x in args.compare])
    else:
        _report(score(outputs(args.output), labels, texts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
