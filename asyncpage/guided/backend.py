"""The backend protocol and the request-side description of a constraint."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal, Protocol

import torch

from asyncpage.errors import GrammarError
from asyncpage.params import SamplingParams

Kind = Literal["json_schema", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class GuidedSpec:
    kind: Kind
    value: str  # canonical text: JSON for schemas and choice lists, the regex, or the grammar text

    @staticmethod
    def from_params(p: SamplingParams) -> GuidedSpec | None:
        if p.json_schema is not None:
            # Key order is kept: properties are generated in the order the schema lists them.
            return GuidedSpec("json_schema", json.dumps(p.json_schema))
        if p.regex is not None:
            return GuidedSpec("regex", p.regex)
        if p.choice is not None:
            return GuidedSpec("choice", json.dumps(list(p.choice)))
        if p.grammar is not None:
            return GuidedSpec("grammar", shipped_grammar(p.grammar) or p.grammar)
        return None


def shipped_grammar(name: str) -> str | None:
    """The text of a grammar shipped in asyncpage.grammars (`json`, `arithmetic`, `sql_select`), or
    None when `name` is not one (then it is grammar text itself)."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        return None
    res = resources.files("asyncpage.grammars").joinpath(f"{name}.lark")
    return res.read_text() if res.is_file() else None


def shipped_grammar_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("asyncpage.grammars").iterdir() if p.name.endswith(".lark"))


class Matcher(Protocol):
    """Per-sequence grammar state. Touched only by the worker thread during a step."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...

    def accept(self, token: int) -> bool: ...

    def rollback(self, num_tokens: int) -> None: ...

    def is_accepting(self) -> bool: ...

    def is_terminated(self) -> bool: ...

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar allows and no alternative to, from here (not consumed). [] if unknown."""
        ...

    def fork(self) -> Matcher: ...


class CompiledGrammar(Protocol):
    def new_matcher(self) -> Matcher: ...


class GrammarBackend(Protocol):
    name: str

    def compile(self, spec: GuidedSpec) -> CompiledGrammar:
        """Compile or raise GrammarError naming the field (and the unsupported keyword if any)."""
        ...


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


_BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [N, V] float; bitmask [N, ceil(V/32)] int32 (bit j of word i allows token 32*i + j).
    Sized to the logits width, never to len(tokenizer): the two differ for some checkpoints."""
    n, v = logits.shape
    allowed = ((bitmask[:, :, None] >> _BITS) & 1).reshape(n, -1)[:, :v].bool()
    logits.masked_fill_(~allowed, float("-inf"))


def choice_regex(choices: list[str]) -> str:
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def grammar_error(spec: GuidedSpec, message: str) -> GrammarError:
    m = re.search(r"Unimplemented keys: \[(.*?)\]", message)
    if m:
        keys = m.group(1).replace('"', "")
        return GrammarError(spec.kind, f"unsupported JSON Schema keyword(s) {keys}: {message}")
    return GrammarError(spec.kind, message)


def ordered_instance(value: Any, schema: Any, root: Any | None = None) -> Any:
    """`value` with object keys in the order the schema lists its properties: the order the
    constrained decoder produces them in (unknown keys keep their place after the known ones)."""
    root = schema if root is None else root
    if isinstance(schema, dict) and "$ref" in schema and isinstance(schema["$ref"], str):
        ref = schema["$ref"]
        if ref.startswith("#"):
            target: Any = root
            for part in ref.lstrip("#/").split("/") if ref not in ("#", "#/") else []:
                part = part.replace("~1", "/").replace("~0", "~")
                if isinstance(target, dict) and part in target:
                    target = target[part]
                else:
                    target = None
                    break
            if target is not None and target is not schema:
                return ordered_instance(value, target, root)
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


def closed_objects(schema: Any) -> Any:
    """A copy of `schema` where every object with `properties` and no `additionalProperties` gets
    `additionalProperties: false`. Used for schemas derived from a typed target (a msgspec Struct):
    extra keys would be dropped by the decoder anyway, and forbidding them only narrows what the
    grammar accepts, so a small model cannot wander off into invented fields."""
    if isinstance(schema, dict):
        out = {k: closed_objects(v) for k, v in schema.items()}
        if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [closed_objects(x) for x in schema]
    return schema


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
               "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")

# The formats JSON Schema 2020-12 defines. Any other `format` is an annotation for every validator.
STANDARD_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname", "ipv4", "ipv6",
    "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template", "json-pointer",
    "relative-json-pointer", "regex"})


def map_subschemas(schema: Any, fn: Any) -> Any:
    """Apply `fn(dict) -> dict` to every (sub)schema, bottom-up, only at schema positions (a property
    called "format" inside `properties` is a name, not a keyword)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _SCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: map_subschemas(sub, fn) for name, sub in out[k].items()}
    for k in _SCHEMA_ONE:
        if k in out:
            out[k] = map_subschemas(out[k], fn)
    for k in _SCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [map_subschemas(sub, fn) for sub in out[k]]
    if "items" in out:
        items = out["items"]
        out["items"] = [map_subschemas(x, fn) for x in items] if isinstance(items, list) else map_subschemas(items, fn)
    if isinstance(out.get("dependencies"), dict):
        out["dependencies"] = {k: map_subschemas(v, fn) for k, v in out["dependencies"].items()}
    return fn(out)


def drop_custom_formats(schema: Any) -> Any:
    """Remove `format` values that are not JSON Schema formats ("path", "topic", ...): annotations
    only, which no validator asserts; a grammar engine would otherwise refuse the whole schema."""
    def fn(s: dict[str, Any]) -> dict[str, Any]:
        if isinstance(s.get("format"), str) and s["format"] not in STANDARD_FORMATS:
            s = {k: v for k, v in s.items() if k != "format"}
        return s

    return map_subschemas(schema, fn)


def schema_keywords(schema: Any) -> set[str]:
    found: set[str] = set()

    def fn(s: dict[str, Any]) -> dict[str, Any]:
        found.update(s)
        return s

    map_subschemas(schema, fn)
    return found
