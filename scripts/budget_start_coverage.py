"""Which JSONSchemaBench schemas budget closing cannot close from the start: for every schema that
compiles (llguidance), the start search (asyncpage.guided.search.start_search) is run as the engine's
grammar compile thread runs it, under the same time bound, and each schema without a start
completion is listed with the reason. Prints the count, the search time per schema (p50 / p99 / max)
and the completion lengths in tokens.

    .venv/bin/python scripts/budget_start_coverage.py ../shared/data/jsonschemabench-dev
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from asyncpage.errors import GrammarError
from asyncpage.guided import GrammarManager, GuidedSpec
from asyncpage.guided.budget import START_SECONDS
from asyncpage.guided.search import START_NODES, START_WALK_STEPS, run, walk_steps
from asyncpage.model.weights import load_tokenizer


def reason(grammar: Any) -> str:
    """Why the start search found nothing: where the walk gave up, when it did."""
    reached: list[bytes] = []
    walked = run(walk_steps(grammar.byte_template.deep_copy(), START_WALK_STEPS, None, reached))
    if walked is not None:  # the start search ran this same walk: only its time bound can differ
        return "the walk closes it, but not within the time bound"
    where = reached[0] if reached else b""
    return (f"no accepting state within {START_NODES} search nodes, and the walk is stuck after "
            f"{len(where)} bytes: ...{where[-80:].decode('utf-8', 'replace')!r}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--seconds", type=float, default=START_SECONDS, help="the time bound of one start search")
    args = ap.parse_args()
    tok, config, eos = load_tokenizer(None)
    manager = GrammarManager(tok, config.vocab_size, sorted(eos), "llguidance")
    compiled = 0
    missing: list[tuple[str, str]] = []
    times: list[float] = []
    lengths: list[int] = []
    for f in sorted(Path(args.folder).glob("*.json")):
        d = json.loads(f.read_text())
        try:
            grammar = manager.compile_sync(GuidedSpec("json_schema", json.dumps(d.get("schema", d))))
        except GrammarError:
            continue
        compiled += 1
        plan = grammar.start_plan  # type: ignore[attr-defined]
        t = time.perf_counter()
        run(plan.steps(args.seconds))
        times.append(time.perf_counter() - t)
        timed_out = times[-1] > args.seconds
        if plan.result is not None:
            lengths.append(len(plan.result[1]))
        else:
            why = f"over the {args.seconds:g} s time bound" if timed_out else reason(grammar)
            missing.append((f.stem, why))
            print(f"NO START {f.stem}: {why} ({times[-1]:.2f} s)", flush=True)
    times.sort()
    lengths.sort()
    print(f"{compiled} compiled schemas, {len(missing)} without a start completion "
          f"({100 * len(missing) / max(1, compiled):.1f}%); search time p50 {times[len(times) // 2] * 1e3:.0f} ms, "
          f"p99 {times[int(0.99 * len(times))] * 1e3:.0f} ms, max {times[-1]:.2f} s, total {sum(times):.1f} s; "
          f"completion tokens p50 {lengths[len(lengths) // 2]}, max {lengths[-1]}")


if __name__ == "__main__":
    main()
