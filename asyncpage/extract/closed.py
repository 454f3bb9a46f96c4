"""Which top-level fields of a schema are closed choices, and how each option is spelled.

A closed choice is a field whose values the schema lists: an `enum`, a `const` among `anyOf`/`oneOf`
alternatives (pydantic's and msgspec's `Literal`, `Optional[Literal]`), a nullable boolean; and the
null-or-present choice of a nullable field whose other branch is an open scalar (a string, copied or
not, a number): there the options are null and "a value", the best one the grammar allows. Plain
booleans are booleans.py's (their statement read after the record). What is decided here and how:
asyncpage.extract.decisions.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from asyncpage.extract.grounding import COPY, resolve, with_outer

MAX_OPTIONS = 16  # more options than this are left to the grammar: one scoring request each per record
# An option the record names in its own words ("This is critical") is copied with this weight: the decision is
# the mix (1 - NAMED_WEIGHT) * the model's share + NAMED_WEIGHT * an even share among the named options, so a
# lone named option wins and the model chooses among several (docs/extraction.md, "Decisions by scoring").
NAMED_WEIGHT = 0.5
_MIN_NAMED = 3  # shorter options ("a", "no") name nothing: they occur in most texts as other words
_SCALARS = ("string", "number", "integer")


class Closed(NamedTuple):
    """A closed field: `options`, the JSON values the grammar allows there (null as None), in the schema's
    order; `present`, for a null-or-present choice, the schema of its non-null branch (a copied one keeps
    `x-copy`), else None."""

    options: tuple[Any, ...]
    present: dict[str, Any] | None = None


def spelling(value: Any) -> str:
    """An option as the grammar writes it: its JSON text (json.dumps' spelling, non-ASCII kept)."""
    return json.dumps(value, ensure_ascii=False)


def named(options: Sequence[Any], text: str) -> list[bool]:
    """Which options `text` names in its own words: a string option of at least three characters, holding a
    letter, found as whole words, case and spacing aside ("High priority" for "high_priority" or "high-priority").
    Numbers, booleans and null name nothing."""
    found = []
    for o in options:
        words = re.findall(r"[^\W_]+", o) if isinstance(o, str) and len(o.strip()) >= _MIN_NAMED else []
        hit = bool(words) and any(ch.isalpha() for ch in o) and re.search(
            r"(?<![^\W_])" + r"[\s_-]+".join(map(re.escape, words)) + r"(?![^\W_])", text, re.IGNORECASE) is not None
        found.append(hit)
    return found


def closed_fields(schema: dict[str, Any]) -> dict[str, Closed]:
    """The top-level properties of `schema` that are closed choices (at most MAX_OPTIONS options, at
    least two), in the schema's order."""
    obj = resolve(schema, schema) if isinstance(schema, dict) else None
    props = obj.get("properties") if isinstance(obj, dict) else None
    out: dict[str, Closed] = {}
    for name, prop in (props.items() if isinstance(props, dict) else ()):
        p = resolve(schema, prop)
        if not isinstance(p, dict):
            continue
        opts = _options(schema, p, 0)
        if opts is not None:
            if 2 <= len(opts) <= MAX_OPTIONS and opts != [True, False]:  # plain booleans: booleans.py
                out[name] = Closed(tuple(opts))
            continue
        branch = _present_branch(schema, p)
        if branch is not None:
            out[name] = Closed((None,), branch)
    return out


def _options(root: dict[str, Any], s: Any, depth: int) -> list[Any] | None:
    """Every value `s` allows when it allows only listed ones, else None."""
    s = resolve(root, s)
    if not isinstance(s, dict) or depth > 8:
        return None
    if "const" in s:
        return [s["const"]]
    if isinstance(s.get("enum"), list):
        return _unique(s["enum"])
    alts = s.get("anyOf") or s.get("oneOf")
    if isinstance(alts, list) and alts:
        found: list[Any] = []
        for a in alts:
            more = _options(root, a, depth + 1)
            if more is None:
                return None
            found += more
        return _unique(found)
    t = s.get("type")
    names = [t] if isinstance(t, str) else list(t) if isinstance(t, list) else []
    if names and set(names) <= {"boolean", "null"}:
        return ([True, False] if "boolean" in names else []) + ([None] if "null" in names else [])
    return None


def _unique(values: list[Any]) -> list[Any]:
    seen: dict[str, Any] = {}
    for v in values:
        seen.setdefault(json.dumps(v, sort_keys=True), v)
    return list(seen.values())


def _present_branch(root: dict[str, Any], s: dict[str, Any]) -> dict[str, Any] | None:
    """A nullable field's non-null branch when it is one open scalar (string, number, integer), else None."""
    t = s.get("type")
    if isinstance(t, list) and "null" in t:
        rest = [x for x in t if x != "null"]
        if len(rest) == 1 and rest[0] in _SCALARS and not any(k in s for k in ("enum", "const", "anyOf", "oneOf")):
            return {**{k: v for k, v in s.items() if k not in ("title", "description")}, "type": rest[0]}
        return None
    alts = s.get("anyOf") or s.get("oneOf")
    if not isinstance(alts, list) or len(alts) != 2:
        return None
    resolved = [resolve(root, a) for a in alts]
    if not all(isinstance(a, dict) for a in resolved):
        return None
    others = [a for a in resolved if a.get("type") != "null"]
    if len(others) != 1 or others[0].get("type") not in _SCALARS or _options(root, others[0], 0) is not None:
        return None
    # Written beside the anyOf, the string keywords hold as well: both bounds and both patterns (with_outer).
    branch = with_outer(s, others[0]) if others[0].get("type") == "string" else dict(others[0])
    if COPY in s:
        branch[COPY] = s[COPY]
    return branch
