"""Conformance of guided JSON decoding against JSON Schema test data, without a model.

For each (schema, instance): the schema is compiled (or refused with a GrammarError); the instance,
serialized in the engine's policy (compact, object keys in schema order), is tokenized and fed token
by token; each token must be allowed by the mask and accepted by the matcher, and the matcher must
accept at the end. A valid instance must pass, an invalid one must fail somewhere.
Used by the tests (with a ratchet file) and by `asyncpage bench-guided` (figures).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncpage.errors import GrammarError
from asyncpage.guided.backend import GuidedSpec, bitmask_width
from asyncpage.guided.manager import GrammarManager
from asyncpage.guided.schema import ordered_instance


@dataclass
class Case:
    case_id: str
    schema: Any
    tests: list[tuple[Any, bool]]  # (instance, valid)


@dataclass
class CaseResult:
    case_id: str
    refused: str | None  # the GrammarError message, when the schema was refused
    compile_s: float
    outcomes: list[tuple[bool, bool]] = field(default_factory=list)  # (valid, accepted) per instance
    mask_s: list[float] = field(default_factory=list)


def load_cases(root: Path) -> list[Case]:
    """Both data sets: the official test suite (draft 2020-12, top level) and JSONSchemaBench dev."""
    cases: list[Case] = []
    suite = root / "json-schema-test-suite" / "draft2020-12"
    for f in sorted(suite.glob("*.json")):
        for i, c in enumerate(json.loads(f.read_text())):
            cases.append(Case(f"suite/{f.stem}/{i}", c["schema"], [(t["data"], t["valid"]) for t in c["tests"]]))
    for f in sorted((root / "jsonschemabench-dev").glob("*.json")):
        d = json.loads(f.read_text())
        cases.append(Case(f"bench/{f.stem}", d["schema"], [(t["data"], t["valid"]) for t in d["tests"]]))
    return cases


def serialize(instance: Any, schema: Any) -> str:
    return json.dumps(ordered_instance(instance, schema), separators=(",", ":"), ensure_ascii=False)


def run_case(manager: GrammarManager, tokenizer: Any, case: Case, vocab_size: int) -> CaseResult:
    spec = GuidedSpec("json_schema", json.dumps(case.schema))
    t0 = time.perf_counter()
    try:
        compiled = manager.compile_sync(spec)
    except GrammarError as exc:
        return CaseResult(case.case_id, str(exc), time.perf_counter() - t0)
    result = CaseResult(case.case_id, None, time.perf_counter() - t0)
    bitmask = torch.zeros((1, bitmask_width(vocab_size)), dtype=torch.int32)
    for instance, valid in case.tests:
        ids = tokenizer(serialize(instance, case.schema), add_special_tokens=False)["input_ids"]
        matcher = compiled.new_matcher()
        ok = True
        for tok in ids:
            t = time.perf_counter()
            matcher.fill_bitmask(bitmask, 0)
            result.mask_s.append(time.perf_counter() - t)
            if not (int(bitmask[0, tok // 32]) >> (tok % 32)) & 1 or not matcher.accept(tok):
                ok = False
                break
        result.outcomes.append((valid, ok and matcher.is_accepting()))
    return result


def run_all(manager: GrammarManager, tokenizer: Any, cases: list[Case], vocab_size: int) -> Iterator[CaseResult]:
    for case in cases:
        yield run_case(manager, tokenizer, case, vocab_size)


def outcome_map(results: list[CaseResult]) -> dict[str, str]:
    """case/instance -> "refused" | "accepted" | "rejected" (the ratchet's format)."""
    out: dict[str, str] = {}
    for r in results:
        if r.refused is not None:
            out[r.case_id] = "refused"
            continue
        for i, (_, accepted) in enumerate(r.outcomes):
            out[f"{r.case_id}#{i}"] = "accepted" if accepted else "rejected"
    return out


def summarize(results: list[CaseResult]) -> dict[str, float]:
    compiled = [r for r in results if r.refused is None]
    valid = [a for r in compiled for v, a in r.outcomes if v]
    invalid = [a for r in compiled for v, a in r.outcomes if not v]
    comp = sorted(r.compile_s for r in compiled)
    masks = sorted(x for r in compiled for x in r.mask_s)

    def pct(xs: list[float], q: float) -> float:
        return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else float("nan")

    return {
        "schemas": len(results), "compiled": len(compiled), "refused": len(results) - len(compiled),
        "coverage": len(compiled) / max(1, len(results)),
        "valid_instances": len(valid), "valid_accepted": sum(valid) / max(1, len(valid)),
        "invalid_instances": len(invalid), "invalid_accepted": sum(invalid),
        "compile_p50_ms": pct(comp, 50) * 1e3, "compile_p99_ms": pct(comp, 99) * 1e3,
        "mask_p50_us": pct(masks, 50) * 1e6, "mask_p99_us": pct(masks, 99) * 1e6,
    }
