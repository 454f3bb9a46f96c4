"""What an untrusted JSON Schema may not do: reference anything outside itself (remote or file `$ref`s),
or carry regexes that backtrack; and a jsonschema validator whose `pattern`s run on RE2 in linear
time, so a hostile pattern cannot hold the GIL past a compile deadline. Pure functions over schema
dicts (guided/schema.py rewrites them, guided/manager.py checks them before compiling)."""

from __future__ import annotations

import functools
from typing import Any
from urllib.parse import urldefrag, urljoin

from asyncpage.errors import GrammarError

_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
_REF_KEYWORDS = ("$ref", "$dynamicRef", "$recursiveRef")


def outside_ref(schema: Any) -> str | None:
    """The first reference in `schema` to anything but itself (a URL, a file, another document), or
    None. Local means a fragment (`#/$defs/a`, `#name`) or the `$id` of a part of the schema, as
    written or resolved against the ids around it. Walks every object except data (enum, const,
    default, examples): a `$ref` can point into any part of the document."""
    ids: set[str] = set()
    refs: list[tuple[str, str]] = []  # (the base URI where it stands, the reference)
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:  # no recursion: a deep schema must not cost a RecursionError here
        node, base = stack.pop()
        if isinstance(node, list):
            stack.extend((x, base) for x in node)
            continue
        if not isinstance(node, dict):
            continue
        for key in ("$id", "id"):  # `id` in draft 4 and before
            own = node.get(key)
            if isinstance(own, str):
                try:
                    base = urljoin(base, own)
                except ValueError:
                    continue
                ids.add(own)
                ids.add(urldefrag(base).url)
        for key in _REF_KEYWORDS:
            ref = node.get(key)
            if isinstance(ref, str):
                refs.append((base, ref))
        stack.extend((v, base) for k, v in node.items() if k not in _DATA_KEYWORDS)
    for base, ref in refs:
        if ref.startswith("#") or ref == "":  # a fragment, or the document itself
            continue
        try:
            target = urldefrag(urljoin(base, ref)).url
        except ValueError:  # a URL that does not parse ("http://[") is not one of the schema's
            return ref
        if target not in ids and urldefrag(ref).url not in ids:
            return ref
    return None


def refuse_outside_refs(schema: Any) -> None:
    """GrammarError naming the first $ref of `schema` that points outside it: nothing is fetched."""
    ref = outside_ref(schema)
    if ref is not None:
        raise GrammarError("json_schema", f"$ref {ref!r} points outside the schema; remote and file references "
                                          "are never fetched: put the definition in $defs and use #/$defs/...")


def refuse_unbounded_patterns(schema: Any) -> None:
    """jsonschema matches the patternProperties of every schema `unevaluatedProperties` looks through
    with Python's re, out of reach of bounded_validator's keywords: refused together."""
    keys = _all_keys(schema)
    if "unevaluatedProperties" in keys and "patternProperties" in keys:
        raise GrammarError("json_schema", "unevaluatedProperties with patternProperties cannot be checked with a "
                                          "linear-time regex engine")


def _all_keys(schema: Any) -> set[str]:
    found: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            found.update(k for k in node if isinstance(k, str))
            stack.extend(v for k, v in node.items() if k not in _DATA_KEYWORDS)
        elif isinstance(node, list):
            stack.extend(node)
    return found


def bounded_validator(schema: Any) -> Any:
    """A jsonschema validator for `schema` (its own `$schema` draft, else 2020-12, with format
    checks) that resolves only references inside `schema` (an empty registry that retrieves nothing),
    and evaluates `pattern`, `patternProperties` and `additionalProperties` next to them with RE2:
    linear in the text, whatever the pattern. A pattern RE2 cannot run (a backreference, a
    lookaround) is a GrammarError naming it."""
    import jsonschema
    import referencing

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    bounded = _bounded_class(cls)
    return bounded(schema, registry=referencing.Registry(), format_checker=cls.FORMAT_CHECKER)


# RE2 keeps each compiled program (and its DFA cache) under this: a huge pattern fails to compile
# (refused) instead of costing the default 8 MiB a pattern.
_RE2_MAX_MEM = 2 << 20


def _re2(pattern: Any) -> Any:
    import re2

    if not isinstance(pattern, str):
        raise GrammarError("json_schema", f"a pattern must be a string, got {type(pattern).__name__}")
    options = re2.Options()
    options.log_errors = False
    options.max_mem = _RE2_MAX_MEM
    options.never_capture = True
    try:
        return re2.compile(pattern, options)
    except re2.error as exc:
        why = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise GrammarError("json_schema", f"pattern {pattern!r} cannot be checked in linear time (RE2: {why}); "
                                          "backreferences and lookarounds are not supported") from None


def _pattern(validator: Any, pattern: Any, instance: Any, schema: Any) -> Any:
    from jsonschema.exceptions import ValidationError

    if validator.is_type(instance, "string") and _re2(pattern).search(instance) is None:
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator: Any, patterns: Any, instance: Any, schema: Any) -> Any:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        rx = _re2(pattern)
        for k, v in instance.items():
            if rx.search(k) is not None:
                yield from validator.descend(v, subschema, path=k, schema_path=pattern)


def _additional_properties(validator: Any, extra_schema: Any, instance: Any, schema: Any) -> Any:
    from jsonschema import _keywords
    from jsonschema.exceptions import ValidationError

    if "patternProperties" not in schema:  # no regex involved: jsonschema's own
        yield from _keywords.additionalProperties(validator, extra_schema, instance, schema)
        return
    if not validator.is_type(instance, "object"):
        return
    props = schema.get("properties", {})
    patterns = [_re2(p) for p in schema["patternProperties"]]
    extras = [k for k in instance if k not in props and not any(rx.search(k) is not None for rx in patterns)]
    if validator.is_type(extra_schema, "object"):
        for k in extras:
            yield from validator.descend(instance[k], extra_schema, path=k)
    elif not extra_schema and extras:
        yield ValidationError(f"{', '.join(map(repr, sorted(extras)))} match none of the patternProperties")


@functools.cache
def _bounded_class(cls: Any) -> Any:
    import jsonschema

    return jsonschema.validators.extend(cls, {"pattern": _pattern, "patternProperties": _pattern_properties,
                                              "additionalProperties": _additional_properties})
