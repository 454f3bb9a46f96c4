"""JSON Schema as the grammar backends need it: rewrites that make a schema compile to what it means
(closed objects, custom formats dropped or made patterns, exclusive oneOf as anyOf, enums of valid
candidates), references and patterns an untrusted schema may not use, and a validator whose regexes
run in linear time (RE2). Pure functions over schema dicts; no grammar engine here (guided/backend.py
has the protocols, guided/llg.py and guided/xgr.py the engines)."""

from __future__ import annotations

from typing import Any

from asyncpage.errors import GrammarError
from asyncpage.guided.backend import NO_DEADLINE, Deadline
from asyncpage.guided.style import closed_objects as closed_objects  # re-exported: its home is style.py
from asyncpage.guided.untrusted import bounded_validator, refuse_outside_refs, refuse_unbounded_patterns


def ordered_instance(value: Any, schema: Any, root: Any | None = None) -> Any:
    """`value` with object keys in the order the schema lists its properties: the order the
    constrained decoder produces them in (unknown keys keep their place after the known ones)."""
    root = schema if root is None else root
    schema = _resolve(schema, root)
    if isinstance(value, dict) and isinstance(schema, dict):
        props: dict[str, Any] = schema["properties"] if isinstance(schema.get("properties"), dict) else {}
        keys = [k for k in props if k in value] + [k for k in value if k not in props]
        addl = schema.get("additionalProperties")
        return {k: ordered_instance(value[k], props.get(k, addl if isinstance(addl, dict) else {}), root)
                for k in keys}
    if isinstance(value, list) and isinstance(schema, dict):
        prefix: list[Any] = schema["prefixItems"] if isinstance(schema.get("prefixItems"), list) else []
        items: dict[str, Any] = schema["items"] if isinstance(schema.get("items"), dict) else {}
        return [ordered_instance(x, prefix[i] if i < len(prefix) else items, root) for i, x in enumerate(value)]
    return value


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
               "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")

# The formats JSON Schema 2020-12 defines. Any other `format` is an annotation for every validator.
STANDARD_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname", "ipv4", "ipv6",
    "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template", "json-pointer",
    "relative-json-pointer", "regex"})


def map_subschemas(schema: Any, fn: Any, deadline: Deadline = NO_DEADLINE) -> Any:
    """Apply `fn(dict) -> dict` to every (sub)schema, bottom-up, only at schema positions (a property
    called "format" inside `properties` is a name, not a keyword)."""
    if not isinstance(schema, dict):
        return schema
    deadline.check()
    out = dict(schema)
    for k in _SCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: map_subschemas(sub, fn, deadline) for name, sub in out[k].items()}
    for k in _SCHEMA_ONE:
        if k in out:
            out[k] = map_subschemas(out[k], fn, deadline)
    for k in _SCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [map_subschemas(sub, fn, deadline) for sub in out[k]]
    if "items" in out:
        items = out["items"]
        out["items"] = ([map_subschemas(x, fn, deadline) for x in items] if isinstance(items, list)
                        else map_subschemas(items, fn, deadline))
    if isinstance(out.get("dependencies"), dict):
        out["dependencies"] = {k: map_subschemas(v, fn, deadline) for k, v in out["dependencies"].items()}
    return fn(out)


_YEAR = r"(?:[0-9]{3}[1-9]|[0-9]{2}[1-9][0-9]|[0-9][1-9][0-9]{2}|[1-9][0-9]{3})"  # 0001-9999
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
DATE_PATTERN = (rf"^(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
                rf"|02-(?:0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)$")

# Standard formats llguidance has no matcher for, each narrowed to a format it knows or to a pattern
# whose every match is valid in that format: the grammar may refuse some valid strings, never accept
# an invalid one.
FORMAT_NARROWINGS: dict[str, dict[str, str]] = {
    "idn-email": {"format": "email"},
    "idn-hostname": {"format": "hostname"},
    "uri-reference": {"pattern": r"^[A-Za-z0-9._~/-]*$"},
    "iri": {"format": "uri"},
    "iri-reference": {"pattern": r"^[A-Za-z0-9._~/-]*$"},
    "uri-template": {"pattern": r"^[A-Za-z0-9._~/:-]*$"},
    "json-pointer": {"pattern": r"^(/[A-Za-z0-9._-]*)*$"},
    "relative-json-pointer": {"pattern": r"^(0|[1-9][0-9]{0,8})(#|(/[A-Za-z0-9._-]*)*)$"},
    "regex": {"pattern": r"^[A-Za-z0-9 _-]*$"},
    # llguidance's own `date` lets through year 0000 and Feb 30, which validators refuse; budget
    # closing's completions start from `0000-09-09` (zeros come first). Exactly the calendar dates:
    "date": {"pattern": DATE_PATTERN},
}


def drop_custom_formats(schema: Any, deadline: Deadline = NO_DEADLINE) -> Any:
    """Remove `format` values that are not JSON Schema formats ("path", "topic", ...): annotations
    only, which no validator asserts; a grammar engine would otherwise refuse the whole schema.
    Narrow the standard formats the grammar engine lacks (FORMAT_NARROWINGS)."""
    def fn(s: dict[str, Any]) -> dict[str, Any]:
        fmt = s.get("format")
        if not isinstance(fmt, str):
            return s
        if fmt not in STANDARD_FORMATS:
            return {k: v for k, v in s.items() if k != "format"}
        narrow = FORMAT_NARROWINGS.get(fmt)
        if narrow is not None and not ("pattern" in narrow and "pattern" in s):
            s = {k: v for k, v in s.items() if k != "format"}
            s.update(narrow)
        return s

    return map_subschemas(schema, fn, deadline)


def schema_keywords(schema: Any) -> set[str]:
    found: set[str] = set()

    def fn(s: dict[str, Any]) -> dict[str, Any]:
        found.update(s)
        return s

    map_subschemas(schema, fn)
    return found


_JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_UNSET = object()


def _resolve(schema: Any, root: Any, depth: int = 0) -> Any:
    """Follow a local $ref (a few levels); anything else is returned as is."""
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and depth < 8:
        ref = schema["$ref"]
        if not ref.startswith("#"):
            return schema
        target: Any = root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part) if isinstance(target, dict) else None
        if target is None:
            return schema
        schema, depth = target, depth + 1
    return schema


def _value_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "integer" if v.is_integer() else "number"
    names: dict[type, str] = {str: "string", list: "array", dict: "object"}
    return names.get(type(v), "?")


def _types(schema: Any, root: Any) -> frozenset[str] | None:
    """The JSON types a schema can match, when it says so (type, const, enum); None if unknown."""
    s = _resolve(schema, root)
    if not isinstance(s, dict):
        return None
    t = s.get("type")
    if isinstance(t, str):
        return frozenset({t})
    if isinstance(t, list) and all(x in _JSON_TYPES for x in t):
        return frozenset(t)
    if "const" in s:
        return frozenset({_value_type(s["const"])})
    if isinstance(s.get("enum"), list):
        return frozenset(_value_type(v) for v in s["enum"])
    return None


def _listed(s: Any) -> list[Any] | None:
    """The values a schema lists itself (const or enum), else None."""
    if isinstance(s, dict):
        if "const" in s:
            return [s["const"]]
        if isinstance(s.get("enum"), list):
            return list(s["enum"])
    return None


def _values(schema: Any, root: Any) -> list[Any] | None:
    return _listed(_resolve(schema, root))


def _disjoint(a: Any, b: Any, root: Any) -> bool:
    """True only when no JSON value can match both schemas (provably, by simple rules)."""
    ta, tb = _types(a, root), _types(b, root)
    if ta is not None and tb is not None:
        wa = ta | ({"integer"} if "number" in ta else set())
        wb = tb | ({"integer"} if "number" in tb else set())
        if not (wa & wb):
            return True
    va, vb = _values(a, root), _values(b, root)
    if va is not None and vb is not None and not any(x == y for x in va for y in vb):
        return True
    ra, rb = _resolve(a, root), _resolve(b, root)
    if isinstance(ra, dict) and isinstance(rb, dict) and ta == tb == frozenset({"object"}):
        # Objects told apart by a discriminator: a property required by both, with disjoint values.
        # Only when both branches admit objects alone: `required` and `properties` say nothing about
        # a number or a string, which would match both branches (and fail the original oneOf).
        common = set(ra.get("required") or []) & set(rb.get("required") or [])
        pa, pb = ra.get("properties") or {}, rb.get("properties") or {}
        for name in common:
            if name in pa and name in pb:
                xa, xb = _values(pa[name], root), _values(pb[name], root)
                if xa is not None and xb is not None and not any(x == y for x in xa for y in xb):
                    return True
    return False


def _pairwise_disjoint(branches: list[Any], root: Any, deadline: Deadline) -> bool:
    for i in range(len(branches)):
        deadline.check()  # n^2 pairs: a oneOf of thousands of branches must not run unbounded
        for j in range(i + 1, len(branches)):
            if not _disjoint(branches[i], branches[j], root):
                return False
    return True


def exclusive_one_of(schema: Any, deadline: Deadline = NO_DEADLINE) -> Any:
    """oneOf whose branches are pairwise disjoint (different types, different const/enum values,
    different discriminator values) means exactly anyOf: rewrite it so the grammar engine, which
    refuses oneOf, can compile it. Any other oneOf is left for the engine to refuse."""
    root = schema

    def fn(s: dict[str, Any]) -> dict[str, Any]:
        branches = s.get("oneOf")
        if isinstance(branches, list) and "anyOf" not in s and _pairwise_disjoint(branches, root, deadline):
            s = {k: v for k, v in s.items() if k != "oneOf"}
            s["anyOf"] = branches
        return s

    return map_subschemas(schema, fn, deadline)


def finite_candidates(schema: Any) -> list[Any] | None:
    """If the schema itself or one of its top-level allOf branches is an enum/const, the values
    that could ever validate; else None."""
    if not isinstance(schema, dict):
        return None
    for part in [schema, *(schema.get("allOf") or [])]:
        values = _listed(part)
        if values is not None:
            return values
    return None


def enum_of_valid_candidates(schema: Any, deadline: Deadline = NO_DEADLINE) -> dict[str, Any] | None:
    """A schema that can only match a finite set of values (an enum or const at the top, or in a
    top-level allOf) is exactly {"enum": [the candidates jsonschema says are valid]}, whatever else it
    says (not, dependencies, ...). Used when the grammar engine refuses the original.

    The schema is untrusted: jsonschema runs here with a registry that retrieves nothing (its default
    one fetches http(s), ftp and file:// $refs with urllib, no timeout, on the one compile thread) and
    checks regexes with RE2, in linear time (Python's re backtracks while holding the GIL: `^(a+)+$` on
    30 a's and a "!" froze the event loop for minutes, whatever the deadline)."""
    values = finite_candidates(schema)
    if values is None:
        return None
    refuse_outside_refs(schema)
    refuse_unbounded_patterns(schema)
    import jsonschema
    import re2
    from referencing.exceptions import Unresolvable

    validator = bounded_validator(schema)
    valid = []
    try:
        for v in values:
            deadline.check()  # jsonschema takes milliseconds per value: a 20k-value enum took 87 s
            if validator.is_valid(v):
                valid.append(v)
    except Unresolvable as exc:  # a reference refuse_outside_refs let through still fetches nothing
        raise GrammarError("json_schema", f"$ref cannot be resolved within the schema: {exc}") from None
    except jsonschema.exceptions.UnknownType as exc:
        raise GrammarError("json_schema", f"unknown type: {exc.type!r}") from None
    finally:
        re2.purge()  # its module-wide cache of compiled patterns would keep this schema's
    return {"enum": valid}


# Keys whose values are data (a value, not a schema): a "$ref" inside them is not a reference.
