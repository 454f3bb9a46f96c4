"""Schema rewrites before compilation must be exact or narrowing: whatever the rewritten schema
accepts, the original accepts too (issue 11, defect 3). Checked on the JSON Schema test suite and
JSONSchemaBench's instances, and on generated values."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncpage.bench.guided_conformance import load_cases
from asyncpage.guided.schema import drop_custom_formats, exclusive_one_of

from .conftest import SHARED


def _rewrite(schema: Any) -> Any:
    return exclusive_one_of(drop_custom_formats(schema))


def _valid(schema: Any, value: Any) -> bool:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return bool(cls(schema, format_checker=cls.FORMAT_CHECKER).is_valid(value))


def _checkable(schema: Any) -> bool:
    """jsonschema asserts a format only when its checker's dependency is installed (`hostname` needs
    fqdn): without it the oracle would call anything valid, so such schemas prove nothing here."""
    checkers = jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers
    formats: set[str] = set()

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            if isinstance(x.get("format"), str):
                formats.add(x["format"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(schema)
    return formats <= set(checkers)


DISCRIMINATED = {"oneOf": [{"properties": {"k": {"const": "a"}}, "required": ["k"]},
                           {"properties": {"k": {"const": "b"}}, "required": ["k"]}]}


def test_a_discriminator_without_type_object_is_not_treated_as_disjoint() -> None:
    # 5 and "x" match both branches, so the oneOf rejects them; an anyOf would accept them.
    assert not _valid(DISCRIMINATED, 5) and not _valid(DISCRIMINATED, "x")
    rewritten = _rewrite(DISCRIMINATED)
    assert not _valid(rewritten, 5) and not _valid(rewritten, "x")
    typed = {"oneOf": [{**b, "type": "object"} for b in DISCRIMINATED["oneOf"]]}
    assert "anyOf" in _rewrite(typed)  # with type: object the branches are disjoint: rewritten


def test_rewrites_never_accept_an_instance_the_original_rejects() -> None:
    if not (SHARED / "jsonschemabench-dev").is_dir():
        pytest.skip(f"shared test data not found at {SHARED}")
    changed = 0
    for case in load_cases(SHARED):
        try:
            rewritten = _rewrite(case.schema)
        except RecursionError:
            continue
        if rewritten == case.schema or not _checkable(rewritten):
            continue
        changed += 1
        for instance, _ in case.tests:
            try:
                if _valid(rewritten, instance):
                    assert _valid(case.schema, instance), (case.case_id, json.dumps(instance)[:200])
            except (jsonschema.exceptions.SchemaError, jsonschema.exceptions.RefResolutionError, RecursionError):
                pass
    assert changed > 10  # the rewrites were exercised


JSON = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.floats(-5, 5, allow_nan=False)
                    | st.sampled_from(["a", "b", "x", ""]),
                    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.sampled_from(["k", "j"]), kids,
                                                                               max_size=2), max_leaves=6)
ONE_OFS = [
    DISCRIMINATED,
    {"oneOf": [{"type": "string"}, {"type": "integer"}]},
    {"oneOf": [{"type": "number"}, {"type": "integer"}]},
    {"oneOf": [{"const": 1}, {"enum": [1, 2]}]},
    {"oneOf": [{"enum": ["a"]}, {"enum": ["b"]}, {"type": "object", "required": ["k"]}]},
    {"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
               {"type": ["object", "string"], "properties": {"k": {"const": "b"}}, "required": ["k"]}]},
]


@settings(max_examples=300, deadline=None)
@given(schema=st.sampled_from(ONE_OFS), value=JSON)
def test_generated_values_never_pass_a_rewrite_the_original_rejects(schema: Any, value: Any) -> None:
    if _valid(_rewrite(schema), value):
        assert _valid(schema, value)
