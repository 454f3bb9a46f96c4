"""Retries from the first refused field, and the per-field confidence of a generated value.

A value the type's own validation refuses (types.Refused) is decoded again from its first refused top-level
field: the next request's prompt is the record's prompt ids plus the kept tokens of the generated JSON up to
that field's value, so the engine's prefix cache serves the prompt's (and the kept tokens') KV, with no
prefill of them again. Its grammar (llguidance Lark, `%json` blocks) continues the object from there: what is
left between the kept tokens and the value (`": "`), the field's value under its schema with each refused
value excluded, then the remaining properties in the schema's order and the closing brace. Where that is not
possible (another grammar backend, an object that is not closed) the whole value is decoded again under the
schema with the exclusion, from the prompt alone.

Exclusions are JSON Schema llguidance compiles (it has no `not`): a refused string by a pattern matching every
other string, a number by exclusive bounds on either side, a boolean by the other const, null by the other
types. An array or object value cannot be excluded: such a refusal is not retried (greedy would write it again).
A refusal that names no field (a `__post_init__`, a pydantic model validator) retries the last top-level field.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from asyncpage.extract.grounding import resolve

_TYPES = ("string", "number", "integer", "boolean", "null", "array", "object")
_WS = re.compile(r"[ \t\n\r]*")


class Field(NamedTuple):
    key: str
    start: int  # the value's first character in the text
    end: int  # one past its last


def top_fields(text: str) -> list[Field] | None:
    """The top-level properties of a JSON object text, in the order written; None when it is not one."""
    dec = json.JSONDecoder()
    i = _WS.match(text, 0).end()  # type: ignore[union-attr]
    if not text.startswith("{", i):
        return None
    i += 1
    out: list[Field] = []
    try:
        while True:
            i = _WS.match(text, i).end()  # type: ignore[union-attr]
            if text.startswith("}", i):
                return out
            key, i = dec.raw_decode(text, i)
            i = _WS.match(text, i).end()  # type: ignore[union-attr]
            if not text.startswith(":", i):
                return None
            start = _WS.match(text, i + 1).end()  # type: ignore[union-attr]
            _, end = dec.raw_decode(text, start)
            out.append(Field(str(key), start, end))
            i = _WS.match(text, end).end()  # type: ignore[union-attr]
            if text.startswith(",", i):
                i += 1
            elif not text.startswith("}", i):
                return None
    except (ValueError, RecursionError):
        return None


def _rx(s: str) -> str:
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in s)


def not_literal(word: str) -> str:
    """A regex matching every string but `word` (anchored)."""
    alts = [_rx(word[:i]) for i in range(len(word))]  # its proper prefixes
    alts += [f"{_rx(word[:i])}[^{_rx(word[i])}][\\s\\S]*" for i in range(len(word))]
    alts.append(f"{_rx(word)}[\\s\\S]+")
    return "^(?:" + "|".join(alts) + ")$"


def excluding(values: Sequence[Any]) -> dict[str, Any] | None:
    """A schema every JSON value but `values` meets; None when one of them cannot be excluded (an array or an
    object)."""
    parts: list[dict[str, Any]] = []
    for v in values:
        if isinstance(v, bool):
            parts.append({"anyOf": [{"type": [t for t in _TYPES if t != "boolean"]}, {"const": not v}]})
        elif v is None:
            parts.append({"type": [t for t in _TYPES if t != "null"]})
        elif isinstance(v, int | float):
            if not math.isfinite(v):
                return None
            parts.append({"anyOf": [{"type": [t for t in _TYPES if t not in ("number", "integer")]},
                                    {"type": "number", "exclusiveMaximum": v},
                                    {"type": "number", "exclusiveMinimum": v}]})
        elif isinstance(v, str):
            parts.append({"anyOf": [{"type": [t for t in _TYPES if t != "string"]},
                                    {"type": "string", "pattern": not_literal(v)}]})
        else:
            return None
    return {"allOf": parts} if parts else None


def _top(schema: dict[str, Any]) -> dict[str, Any] | None:
    """The top-level object schema (a `$ref` followed), when it is a plain object with properties."""
    obj = resolve(schema, schema)
    if not isinstance(obj, dict) or not isinstance(obj.get("properties"), dict):
        return None
    if any(k in obj for k in ("anyOf", "oneOf", "allOf", "if", "patternProperties", "dependentSchemas")):
        return None
    return obj


def _with_defs(schema: dict[str, Any], node: Any, options: dict[str, Any] | None) -> dict[str, Any]:
    out = dict(node) if isinstance(node, dict) else ({} if node is True else {"not": {}})
    for defs in ("$defs", "definitions"):
        if defs in schema and defs not in out and "$ref" in json.dumps(node):
            out[defs] = schema[defs]
    if options:
        out["x-guidance"] = options
    return out


def whole_schema(schema: dict[str, Any], field: str, excluded: Sequence[Any]) -> dict[str, Any] | None:
    """`schema` with its top-level `field` refusing `excluded`: the retry that decodes the whole value again."""
    obj, excl = _top(schema), excluding(excluded)
    if obj is None or excl is None or field not in obj["properties"]:
        return None
    props = {k: ({"allOf": [v, excl]} if k == field else v) for k, v in obj["properties"].items()}
    return {**{k: v for k, v in schema.items() if k in ("$defs", "definitions")}, **obj, "properties": props}


def rest_grammar(schema: dict[str, Any], field: str, bridge: str, excluded: Sequence[Any],
                 options: dict[str, Any]) -> str | None:
    """The Lark grammar of the rest of the object from `field`'s value: `bridge` (what separates the kept
    tokens from the value), the value without `excluded`, the properties after it in the schema's order (the
    order llguidance writes them in), `}`. None where the object is not closed or the value not excludable."""
    obj, excl = _top(schema), excluding(excluded)
    if obj is None or excl is None or obj.get("additionalProperties", True) is not False:
        return None
    names = list(obj["properties"])
    if field not in names:
        return None
    required = set(obj.get("required") or ())
    item, key = options.get("item_separator", ","), options.get("key_separator", ":")
    lit = lambda s: json.dumps(s, ensure_ascii=False)  # noqa: E731  # a Lark string literal
    rules = [f"v0: %json {json.dumps(_with_defs(schema, {'allOf': [obj['properties'][field], excl]}, options))}"]
    tail = []
    for n, name in enumerate(names[names.index(field) + 1:], 1):
        rules.append(f"v{n}: %json {json.dumps(_with_defs(schema, obj['properties'][name], options))}")
        part = f"{lit(item)} {lit(lit(name) + key)} v{n}"
        tail.append(part if name in required else f"({part})?")
    start = " ".join(([lit(bridge)] if bridge else []) + ["v0", *tail, lit("}")])
    return "\n".join([f"start: {start}", *rules]) + "\n"


def token_ends(tokenizer: Any, ids: Sequence[int]) -> list[int]:
    """For each token, the length of the text the tokens up to it decode to."""
    return [len(tokenizer.decode(list(ids[:i + 1]), skip_special_tokens=True)) for i in range(len(ids))]


def in_string(text: str) -> list[bool]:
    """For each prefix length 0..len(text) of a JSON text, whether that prefix ends inside a string (an open quote,
    escapes read): one pass."""
    out = [False]
    inside = escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif inside and ch == "\\":
            escaped = True
        elif ch == '"':
            inside = not inside
        out.append(inside)
    return out


def kept_tokens(ends: Sequence[int], upto: int) -> int:
    """How many tokens end at or before character `upto`."""
    k = 0
    while k < len(ends) and ends[k] <= upto:
        k += 1
    return k


def ids_upto(tokenizer: Any, ctx: Any, ends: Sequence[int], upto: int) -> list[int]:
    """A generated value's context up to character `upto` of its text (`ctx`: readings.Context): the prompt,
    the generated tokens that end by then (`ends`: token_ends), and the rest of the text up to it tokenized."""
    k = kept_tokens(ends, upto)
    head = ctx.text[(ends[k - 1] if k else 0):upto]
    return list(ctx.prompt_ids) + list(ctx.token_ids[:k]) + list(
        tokenizer(head, add_special_tokens=False)["input_ids"] if head else [])


def field_confidence(text: str, ends: Sequence[int], logprobs: Sequence[float | None]) -> dict[str, float]:
    """Per top-level field: the product of the probabilities (raw model output) of the tokens that overlap its
    value's text. {} when the text is not an object or a token has no log-probability."""
    fields = top_fields(text)
    if not fields or len(logprobs) < len(ends):
        return {}
    out = {}
    for f in fields:
        lps = [logprobs[i] for i in range(len(ends)) if ends[i] > f.start and (ends[i - 1] if i else 0) < f.end]
        if lps and all(lp is not None for lp in lps):
            out[f.key] = math.exp(sum(lp for lp in lps if lp is not None))
    return out
