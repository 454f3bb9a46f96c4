"""End-to-end guided JSON on real schemas with the default model: one greedy request per schema
(max_tokens=384), then every output is parsed and validated (Draft 2020-12, format checks), those that
ended by max_tokens included (budget closing, on by default, closes them validly: "closed").
Prints refused / failed / valid / invalid / cut counts and the share of compiled schemas without a valid
value. `--no-budget-close` gives the figures without budget closing, `--backend xgrammar` those of the
other grammar backend. Needs jsonschema (the test extra).

    .venv/bin/python scripts/guided_e2e.py ../shared/data/jsonschemabench-dev --limit 40
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import jsonschema

from asyncpage import AsyncEngine, GrammarError, SamplingParams

PROMPT = "Write one JSON value that conforms to this JSON Schema.\nSchema: {schema}\nJSON: "


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--stride", type=int, default=1, help="take every k-th schema (a spread over the subsets)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--no-budget-close", action="store_true")
    ap.add_argument("--backend", default="llguidance", choices=["llguidance", "xgrammar"])
    args = ap.parse_args()
    files = sorted(Path(args.folder).glob("*.json"))[:: args.stride][: args.limit]
    engine = AsyncEngine.from_pretrained(dtype=args.dtype, guided_backend=args.backend)
    counts = {"refused": 0, "failed": 0, "valid": 0, "invalid": 0, "cut": 0, "closed": 0}
    slowest_refusal = 0.0

    async def one(f: Path) -> None:
        nonlocal slowest_refusal
        d = json.loads(f.read_text())
        schema = d.get("schema", d)
        prompt = PROMPT.format(schema=json.dumps(schema)[:4000])
        t = time.perf_counter()
        try:
            out = await engine.generate(prompt, SamplingParams(json_schema=schema, max_tokens=args.max_tokens,
                                                               temperature=0, budget_close=not args.no_budget_close))
        except GrammarError:
            counts["refused"] += 1
            slowest_refusal = max(slowest_refusal, time.perf_counter() - t)
            return
        except Exception as exc:  # anything else is a failure of the engine
            counts["failed"] += 1
            print(f"FAILED {f.name}: {exc!r}")
            return
        try:
            value = json.loads(out.text)
        except ValueError as exc:
            counts["cut" if out.finish_reason == "length" else "invalid"] += 1
            print(f"{'CUT' if out.finish_reason == 'length' else 'INVALID'} {f.name}: {str(exc)[:200]}")
            return
        try:
            cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
            cls(schema, format_checker=cls.FORMAT_CHECKER).validate(value)
            counts["valid"] += 1
            counts["closed"] += out.finish_reason == "length"
        except jsonschema.ValidationError as exc:
            counts["invalid"] += 1
            print(f"INVALID {f.name} ({out.finish_reason}): {str(exc)[:200]}")

    async with engine:
        await asyncio.gather(*(one(f) for f in files))
    n = len(files)
    print(f"{n} schemas: {counts['refused']} refused ({100 * counts['refused'] / n:.0f}%, slowest refusal "
          f"{slowest_refusal:.2f} s), {counts['failed']} failed, {counts['valid']} valid, {counts['invalid']} invalid, "
          f"{counts['cut']} cut at max_tokens ({100 * counts['cut'] / n:.0f}%); {counts['closed']} of the valid were "
          f"closed by the budget")
    compiled = n - counts["refused"]
    without = compiled - counts["valid"]
    print(f"without a valid value: {without} of {compiled} compiled schemas ({100 * without / max(1, compiled):.1f}%)")


if __name__ == "__main__":
    asyncio.run(main())
