"""`asyncpage extract` in-process against `asyncpage extract --ray` on the same records: every run must
write one line per record with the same values; prints records/s of each run.

    .venv/bin/python scripts/ray_extract_check.py -n 200 --actors 1,2
    .venv/bin/python scripts/ray_extract_check.py -n 200 --actors 2 --model /path/to/tiny-hf-dir --dtype float32

Each --ray run starts its own local Ray cluster (or uses RAY_ADDRESS). Exit status 1 if any run's
lines differ from the in-process run's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130}},
          "required": ["name", "age"], "additionalProperties": False}
NAMES = ["Alice", "Bob", "Carla", "Dmitri", "Eve", "Farid", "Grace", "Hiro", "Ines", "Jamal"]
FORMS = ["{n} is {a}.", "{n} turned {a} last week.", "{n}, aged {a}, lives in Rome.", "{n} is {a} years old.",
         "{n} ({a}) is a pilot."]


def _records(n: int) -> list[str]:
    return [json.dumps({"id": f"p{i}", "text": FORMS[i % len(FORMS)].format(n=NAMES[i % len(NAMES)], a=18 + i % 61)})
            for i in range(n)]


def _run(args: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "asyncpage.cli", "extract", *args], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"asyncpage extract {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return wall, proc.stderr


def _lines(path: Path) -> dict[int, Any]:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return {r["line"]: r for r in rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=200)
    p.add_argument("--actors", default="1,2", help="comma-separated actor counts, one --ray run each")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None, help="engine threads in every run (default: each run's own)")
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--concurrency", type=int, default=16)
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    work = Path(tempfile.mkdtemp(prefix="ray-extract-check-"))
    (work / "in.jsonl").write_text("\n".join(_records(a.n)) + "\n")
    (work / "schema.json").write_text(json.dumps(SCHEMA))
    common = ["--schema", str(work / "schema.json"), "--input", str(work / "in.jsonl"), "--prompt",
              "{text}\\nAs JSON: ", "--max-tokens", str(a.max_tokens), "--concurrency", str(a.concurrency),
              "--dtype", a.dtype, "--no-progress"]
    common += ["--model", a.model] if a.model else []
    common += ["--threads", str(a.threads)] if a.threads else []
    runs = [("in-process", [])] + [(f"ray, {k} actor{'s' if k > 1 else ''}", ["--ray", "--num-actors", str(k)])
                                   for k in map(int, a.actors.split(","))]
    print(f"{a.n} records, model {a.model or 'default'} [{a.dtype}], max_tokens {a.max_tokens}, "
          f"concurrency {a.concurrency}, {len(os.sched_getaffinity(0))} cores")
    print(f"{'run':<16} {'lines':>6} {'same values':>12} {'job records/s':>14} {'end-to-end s':>13}")
    ok = True
    reference: dict[int, Any] | None = None
    for name, extra in runs:
        out = work / f"out-{len(extra)}-{extra[-1] if extra else 0}.jsonl"
        wall, err = _run([*common, *extra, "--output", str(out)])
        rate = re.search(r"([\d.]+) records/s", err)
        lines = _lines(out)
        reference = reference if reference is not None else lines
        same = lines == reference
        ok &= same and len(lines) == a.n
        print(f"{name:<16} {len(lines):>6} {'yes' if same else 'NO':>12} {rate.group(1) if rate else '?':>14} "
              f"{wall:>13.1f}")
    print(f"(outputs in {work})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
