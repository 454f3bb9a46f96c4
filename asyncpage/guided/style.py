"""How a request's JSON Schema is written out for the grammar: its spelling (the separators, carried to
the backends in the schema's root `x-guidance` key, llguidance's own place for its JSON options) and
closed objects (no property the schema does not declare, unless it says so). Pure functions over
schema dicts: guided/backend.py's GuidedSpec applies them to a request's schema, guided/schema.py
re-exports closed_objects. The separators' rule lives with SamplingParams (asyncpage.params)."""

from __future__ import annotations

from typing import Any

from asyncpage.params import separators_problem

STYLE_KEY = "x-guidance"


def spelled(schema: dict[str, Any], separators: tuple[str, str]) -> dict[str, Any]:
    """`schema` with its root `x-guidance` set to these separators (and nothing else of a caller's own
    x-guidance kept: free whitespace or lenient keywords would undo what the grammar guarantees)."""
    item, key = separators
    return {**{k: v for k, v in schema.items() if k != STYLE_KEY}, STYLE_KEY: {"item_separator": item,
                                                                             "key_separator": key}}


def style_of(schema: Any) -> tuple[dict[str, Any], tuple[str, str] | None]:
    """(the schema without its root x-guidance, the separators it named; None if it named none)."""
    if not isinstance(schema, dict) or not isinstance(schema.get(STYLE_KEY), dict):
        return schema, None
    opts = schema[STYLE_KEY]
    rest = {k: v for k, v in schema.items() if k != STYLE_KEY}
    item, key = opts.get("item_separator", ","), opts.get("key_separator", ":")
    if separators_problem((item, key)) is not None:
        return rest, None
    return rest, (item, key)


# Subschemas under these keys are alternatives or children of the object: closing them only narrows
# what the whole schema accepts, and nothing beside them declares their properties.
_CHILD_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_CHILD_ONE = ("additionalProperties", "items", "additionalItems", "unevaluatedItems", "contains")
_CHILD_LISTS = ("anyOf", "oneOf", "prefixItems")
# Beside these, another subschema may declare more properties of the same object (allOf branches, a
# $ref's target, then/else, dependent schemas): an object with one of them stays as written.
_EXTENDERS = ("allOf", "$ref", "$dynamicRef", "if", "then", "else", "dependentSchemas", "dependencies",
              "unevaluatedProperties")


def _def_name(ref: str) -> str | None:
    for prefix in ("#/$defs/", "#/definitions/"):
        if ref.startswith(prefix) and "/" not in ref[len(prefix):]:
            return ref[len(prefix):]
    return None


def closed_objects(schema: Any) -> Any:
    """A copy of `schema` where every object schema that declares `properties` and says nothing of
    `additionalProperties` gets `additionalProperties: false`, and every tuple (`prefixItems`) that
    says nothing of `items` gets `items: false`: xgrammar's strict mode, vLLM's default. A small model
    otherwise invents keys (`"refund_date"`, ...) until max_tokens ends it.

    It only ever narrows what the schema accepts, and never where another subschema may add to the
    same object: objects beside allOf, $ref, if/then/else or dependent schemas, branches of an allOf
    of more than one part, definitions such an extension refers to, and everything under `not` and
    `if` (narrowing there would widen the whole) stay as written. Values (const, enum, default,
    examples) are data and never touched."""
    if not isinstance(schema, dict):
        return schema
    extended: set[str] = set()
    root_extended = [False]
    _find_extended(schema, False, extended, root_extended)
    return _close(schema, root_extended[0], extended, top=True)


def _find_extended(node: Any, extending: bool, found: set[str], root: list[bool]) -> None:
    """Collect the definitions that something extends (a $ref beside properties, or in a branch of a
    multi-part allOf): closing them would refuse the properties declared beside the reference."""
    if not isinstance(node, dict):
        return
    ref = node.get("$ref")
    if isinstance(ref, str) and (extending or "properties" in node or "allOf" in node):
        name = _def_name(ref)
        if name is not None:
            found.add(name)
        elif ref == "#":
            root[0] = True
    for k in _CHILD_MAPS:
        if isinstance(node.get(k), dict):
            for sub in node[k].values():
                _find_extended(sub, False, found, root)
    for k in (*_CHILD_ONE, "not", "if", "then", "else"):
        _find_extended(node.get(k), k in ("then", "else"), found, root)
    for k in _CHILD_LISTS:
        if isinstance(node.get(k), list):
            for sub in node[k]:
                _find_extended(sub, False, found, root)
    parts = node.get("allOf")
    if isinstance(parts, list):
        for sub in parts:
            _find_extended(sub, len(parts) > 1 or "properties" in node, found, root)
    if isinstance(node.get("dependentSchemas"), dict):
        for sub in node["dependentSchemas"].values():
            _find_extended(sub, True, found, root)


def _close(node: Any, extended: bool, defs_extended: set[str], top: bool = False) -> Any:
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for k in _CHILD_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: _close(sub, k in ("$defs", "definitions") and top and name in defs_extended,
                                   defs_extended) for name, sub in out[k].items()}
    for k in _CHILD_ONE:
        if isinstance(out.get(k), dict):
            out[k] = _close(out[k], False, defs_extended)
    for k in _CHILD_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [_close(sub, False, defs_extended) for sub in out[k]]
    parts = out.get("allOf")
    if isinstance(parts, list) and len(parts) == 1 and "properties" not in out:
        out["allOf"] = [_close(parts[0], False, defs_extended)]  # pydantic v1's `allOf: [{$ref}]`
    if extended or any(k in out for k in _EXTENDERS):
        return out
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    if isinstance(out.get("prefixItems"), list) and "items" not in out and "additionalItems" not in out:
        out["items"] = False
    return out
