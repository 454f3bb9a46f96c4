"""The Lark grammar (llguidance's dialect) of one chat turn: tool calls, answer schema, reasoning.

Tool calls are made valid by construction: every call is the format's literal text around a
`%json` rule built from that tool's own `parameters` schema, so its arguments always validate.
`tool_choice="auto"` is a lazy grammar: free text until the model writes the format's trigger, or
one of a call's other spellings (spellings.py: a bare call object naming a declared tool, or a list
of them), then the grammar holds it to a complete call. A reasoning section, where the turn may have
one, is free text up to its closing marker (reasoning.py), and the grammar applies from there on.
JSON is written with fixed separators (the params'
json_separators, json.dumps' by default) and no free whitespace (runaway whitespace is the most
reported failure of JSON modes); objects take no undeclared key unless the params' json_closed_objects
is False or the schema says otherwise (guided/style.py).
"""

from __future__ import annotations

import copy
import json
import re
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from asyncpage.chat import spellings
from asyncpage.chat.formats import ToolFormat
from asyncpage.chat.reasoning import THINK, ReasoningMarkers
from asyncpage.chat.types import Tool
from asyncpage.guided.backend import NO_DEADLINE, Deadline
from asyncpage.guided.schema import drop_custom_formats, exclusive_one_of
from asyncpage.guided.style import STYLE_KEY, closed_objects, spelled, style_of
from asyncpage.params import DEFAULT_SEPARATORS

# json.dumps' separators: what chat templates render with `tojson`, so calls stay in distribution.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class TurnSpec:
    """What the turn may contain. `mode`: "none" | "auto" | "required" | a tool's name."""

    fmt: ToolFormat
    tools: list[Tool]
    mode: str
    parallel: bool
    answer_schema: dict[str, Any] | None
    reasoning: bool  # a reasoning section (<think>...</think>, `markers`) may open the turn
    in_reasoning: bool  # the prompt already opened it (the turn starts inside the section)
    json_separators: tuple[str, str] = DEFAULT_SEPARATORS  # SamplingParams.json_separators
    closed_objects: bool = True  # SamplingParams.json_closed_objects
    markers: ReasoningMarkers = THINK
    bare_calls: bool = True  # under "auto" without an answer schema, calls also open in their bare spellings

    @property
    def spelled(self) -> bool:
        """Whether calls also open on their other spellings (spellings.py) in this turn."""
        return self.bare_calls and self.calls_allowed and self.mode == "auto" and self.answer_schema is None

    @property
    def calls_allowed(self) -> bool:
        return self.mode != "none" and bool(self.tools)

    @property
    def callable_tools(self) -> list[Tool]:
        if self.mode in ("none", "auto", "required"):
            return self.tools
        return [t for t in self.tools if t.name == self.mode]

    def closed(self, schema: Any) -> Any:
        """`schema` with its objects closed, unless this turn asked not to (guided/style.py)."""
        return closed_objects(schema) if self.closed_objects and isinstance(schema, dict) else schema

    def styled(self, schema: Any) -> Any:
        """`schema` closed, and with this turn's separators named in its root's x-guidance (json_rule
        reads them)."""
        schema = self.closed(schema)
        return spelled(schema, self.json_separators) if isinstance(schema, dict) else schema


def json_rule(schema: dict[str, Any] | bool, deadline: Deadline = NO_DEADLINE) -> str:
    """`%json {...}` for a schema, with asyncpage's exact rewrites and the fixed JSON style: the
    separators its root's x-guidance names (TurnSpec.styled), else json.dumps'. The rewrites check
    `deadline` as they go (the oneOf one is quadratic in a oneOf's branches): past it they raise
    guided.backend.CompileTimeout."""
    deadline.check()
    s: Any = exclusive_one_of(drop_custom_formats(copy.deepcopy(schema), deadline), deadline)
    if s is True or s == {}:
        s = {}
    if not isinstance(s, dict):
        s = {"not": {}}  # `false`: nothing validates
    s, named = style_of(s)
    item, key = named or DEFAULT_SEPARATORS
    s = {**s, STYLE_KEY: {**JSON_STYLE, "item_separator": item, "key_separator": key}}
    return "%json " + json.dumps(s)


class _Lit:
    """Grammar literals; a marker that is a special token of the tokenizer becomes `<[id]>`
    (special tokens cannot be spelled by ordinary text in llguidance, nor by a model).
    llguidance also takes every added token spelled `<...>` as special, whatever its flag: Qwen's
    `<tool_call>` and `<think>` are added as non-special tokens, and spelled as text the grammar
    would refuse the very token the model writes them with."""

    def __init__(self, tokenizer: Any) -> None:
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.special = {t.content: i for i, t in decoder.items() if getattr(t, "special", False)
                        or (len(t.content) >= 2 and t.content.startswith("<") and t.content.endswith(">"))}

    def __call__(self, text: str) -> str:
        """`text` as string literals with each special token in it as its `<[id]>`: Hermes' end
        marker is a newline, then the one token a model closes its call with."""
        if not text:
            return ""
        found = sorted((s for s in self.special if s in text), key=len, reverse=True)
        if not found:
            return json.dumps(text)
        parts, pos = [], 0
        for m in re.finditer("|".join(map(re.escape, found)), text):
            if m.start() > pos:
                parts.append(json.dumps(text[pos:m.start()]))
            parts.append(f"<[{self.special[m.group()]}]>")
            pos = m.end()
        if pos < len(text):
            parts.append(json.dumps(text[pos:]))
        return " ".join(parts)

    def seq(self, text: str, marker: str) -> str:
        """`text`, with `marker` (a prefix of it) spelled on its own so it may be a special token."""
        if marker and text.startswith(marker):
            return f"{self(marker)} {self(text[len(marker):])}".strip()
        return self(text)


# Reading added_tokens_decoder builds a dict of every added token (thousands for Gemma 3): once per
# tokenizer, stamped with its length (a token added later is seen).
_LITS: weakref.WeakKeyDictionary[Any, tuple[int, _Lit]] = weakref.WeakKeyDictionary()
_LITS_LOCK = threading.Lock()


def lit_of(tokenizer: Any) -> _Lit:
    stamp = len(tokenizer) if hasattr(tokenizer, "__len__") else -1
    try:
        with _LITS_LOCK:
            known = _LITS.get(tokenizer)
        if known is not None and known[0] == stamp:
            return known[1]
        lit = _Lit(tokenizer)
        with _LITS_LOCK:
            _LITS[tokenizer] = (stamp, lit)
        return lit
    except TypeError:  # not weakly referable
        return _Lit(tokenizer)


def build(spec: TurnSpec, tokenizer: Any, deadline: Deadline = NO_DEADLINE) -> str | None:
    """Lark text for the turn, or None when the turn is free text (no grammar at all). Past
    `deadline` it raises guided.backend.CompileTimeout (api.py turns it into a GrammarTimeoutError).
    cache.cached_build keeps what it builds per tool set."""
    lit = lit_of(tokenizer)
    fmt = spec.fmt
    rules: list[str] = []
    if spec.calls_allowed:
        tools = spec.callable_tools
        names = [f"call_{i}" for i in range(len(tools))]
        rules.append("call: " + " | ".join(names))
        for rule, tool in zip(names, tools, strict=True):
            rules.append(f"{rule}: {lit(fmt.call_head(tool.name))} {rule}_args {lit('}')}")
            rules.append(f"{rule}_args: {json_rule(spec.styled(arguments(tool.parameters)), deadline)}")
        more = f" ({lit(fmt.sep)} call)*" if spec.parallel else ""
        rest_of_begin = fmt.begin[len(fmt.trigger):]
        rules.append(f"calls_after_trigger: {lit(rest_of_begin)} call{more} {lit(fmt.end)}".replace("  ", " "))
        trigger = lit(fmt.trigger)
        rules.append(f"calls: {trigger} calls_after_trigger" if trigger else "calls: calls_after_trigger")
    if spec.answer_schema is not None:
        rules.append(f"answer: {json_rule(spec.styled(spec.answer_schema), deadline)}")
    if spec.calls_allowed and spec.mode == "auto":
        if spec.answer_schema is not None and fmt.at_start:
            # Both open with "{": one JSON Schema (anyOf) lets the JSON parser decide, where two
            # alternatives would make the lexer commit at the first "{".
            rules.append(f"answer_or_calls: {_answer_or_calls(spec, deadline)}")
            body = "answer_or_calls"
        elif spec.answer_schema is not None:
            body = "answer | calls"
        elif spec.spelled:
            rules.append(r"TEXT: /(?s:.*)/")
            alts = ["TEXT"]
            if fmt.at_start and fmt.begin:
                # The family's own JSON turn, at the start only (Llama 3's is a bare call: read below).
                rules.append(f"own_begin[lazy]: {lit(fmt.begin)}")
                rules.append(f"own_calls: call{more} {lit(fmt.end)}".replace("  ", " "))
                alts.append("own_begin own_calls")
            elif not fmt.at_start and fmt.trigger in lit.special:
                alts.append(f"TEXT {lit(fmt.trigger)} calls_after_trigger")
            elif not fmt.at_start:
                rules.append(f"pre[lazy]: TEXT {lit(fmt.trigger)}")
                alts.append("pre calls_after_trigger")
            extra, bodies = spellings.rules([t.name for t in tools], [f"{n}_args" for n in names], spec.parallel)
            rules += extra
            body = " | ".join(alts + bodies)
        elif fmt.at_start:
            # Free text that does not open with "{" (that would be a call).
            rules.append(r"PLAIN: /([^{](.|\n)*)?/")
            body = "PLAIN | calls"
        elif fmt.trigger in lit.special:
            rules.append(r"TEXT: /(.|\n)*/")
            body = f"TEXT | TEXT {lit(fmt.trigger)} calls_after_trigger"
        else:
            # Lazy: the first occurrence of the trigger ends the free text and starts the call.
            rules.append(r"TEXT: /(.|\n)*/")
            rules.append(f"pre[lazy]: TEXT {lit(fmt.trigger)}")
            body = "TEXT | pre calls_after_trigger"
    elif spec.calls_allowed:
        body = "calls"
    elif spec.answer_schema is not None:
        body = "answer"
    else:
        return None
    rules.insert(0, f"body: {body}")
    if spec.in_reasoning:
        rules.insert(0, "start: think_rest body")
    elif spec.reasoning:
        rules.insert(0, f"start: body | {lit(spec.markers.open)} think_rest body")
    else:
        rules.insert(0, "start: body")
    if spec.reasoning or spec.in_reasoning:
        end = lit(spec.markers.close)
        rules.append(r"THINK: /(?s:.*)/")
        if end.startswith("<["):
            rules.append(f"think_rest: THINK {end} GAP?")
        else:
            # Lazy: the reasoning ends at the first closing marker, then the turn proper begins.
            rules.append(r"think_rest: think_text GAP?")
            rules.append(f"think_text[lazy]: THINK {end}")
        rules.append(r"GAP: /\n{1,2}/")
    return "%llguidance {}\n" + "\n".join(rules) + "\n"


# A turn whose grammar is the answer alone from its first token: compiling it sees all the answer forces.
ANSWER_ALONE = "%llguidance {}\nstart: body\nbody: answer\n"
_SCHEMA_RULE = re.compile(r"(call_\d+_args|answer): %json ")
# Only a reference makes a schema's grammar recursive, and only recursion can force a run without end.
_REFS = ('"$ref"', '"$dynamicRef"', '"$recursiveRef"')


def parts_alone(lark: str | None) -> tuple[tuple[str, str], ...]:
    """(rule, a grammar that starts with it) for each schema rule of `lark` (build's: a tool's
    arguments, the answer) that may recurse. A schema without a finite instance ({"properties":
    {"next": {"$ref": "#"}}, "required": ["next"]}) compiles; the engine refuses a grammar that forces
    such a run from its start, but one alternative of a turn (the answer beside the calls, a call beside
    free text, one tool among others, after a reasoning section) is only met mid-decoding, where the
    matcher refuses the very tokens it forced. Compiled alone (run.py), each one's run is seen. None
    where the turn is the answer alone: its own compile sees it."""
    if lark is None or lark.startswith(ANSWER_ALONE) or not any(r in lark for r in _REFS):
        return ()
    out = []
    for line in lark.split("\n"):
        m = _SCHEMA_RULE.match(line)
        if m is not None and any(r in line for r in _REFS):
            out.append((m.group(1), f"%llguidance {{}}\nstart: {m.group(1)}\n{line}\n"))
    return tuple(out)


def arguments(parameters: Any) -> Any:
    """A tool's `parameters` as the schema of its calls' arguments, which are a JSON object whatever
    it says (OpenAI's contract): messages.parse_tools takes a schema that leaves its type out (`{}`,
    any JSON value, a string among them) or lists "object" among others, and the grammar holds the
    arguments to "object" besides. Where the schema refers to its own root ("#", "#/properties/...") the
    type would narrow those references too (a `next` that may be a string would have to be an object):
    the root then moves into its `$defs` (scoped) and the type is added to the new root alone."""
    kind = parameters.get("type") if isinstance(parameters, dict) else "object"
    if kind == "object" or not (kind is None or (isinstance(kind, list) and "object" in kind)):
        return parameters  # an object's already, or a type parse_tools refuses
    defs: dict[str, Any] = {}
    body = scoped(parameters, "args", defs)
    if "args" not in defs:  # nothing refers to the root: the type narrows it alone
        return {**parameters, "type": "object"}
    return {**body, "type": "object", "$defs": defs}


def _answer_or_calls(spec: TurnSpec, deadline: Deadline) -> str:
    """`%json` of anyOf [the answer, the format's calls as JSON], for JSON formats (generic, Llama 3).
    Properties are listed in the format's order, so the text is exactly what formats.py renders."""
    defs: dict[str, Any] = {}
    fmt = spec.fmt
    one = [{"type": "object",
            "properties": {"name": {"const": t.name},
                           fmt.key: scoped(spec.closed(arguments(t.parameters)), f"t{i}", defs)},
            "required": ["name", fmt.key], "additionalProperties": False}
           for i, t in enumerate(spec.callable_tools)]
    call = {"anyOf": one}
    if fmt.name == "generic":
        calls: dict[str, Any] = {"type": "object", "properties": {"tool_calls": {
            "type": "array", "items": call, "minItems": 1, **({} if spec.parallel else {"maxItems": 1})}},
            "required": ["tool_calls"], "additionalProperties": False}
    else:
        calls = call  # Llama 3: one call object
    answer = scoped(spec.closed(spec.answer_schema), "answer", defs)
    # A loose answer (json_object, or a schema without this key) would also take a call-shaped
    # object, unchecked against the tools, and the parser would read it back as a call.
    marker = "tool_calls" if fmt.name == "generic" else fmt.key
    if answer is True:
        answer = {}
    if isinstance(answer, dict) and marker not in (answer.get("properties") or {}):
        answer = {**answer, "properties": {**(answer.get("properties") or {}), marker: False}}
    root: dict[str, Any] = {"anyOf": [answer, calls]}
    if defs:
        root["$defs"] = defs
    return json_rule(spelled(root, spec.json_separators), deadline)  # closed above, where the marker is not


# Keywords whose values are data, not schemas: a "$ref" inside them is a value to keep as written.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example"})
_NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def scoped(schema: Any, tag: str, defs: dict[str, Any]) -> Any:
    """`schema` made embeddable beside others under one root: its definitions move into the shared
    `defs` under names prefixed by `tag`, and its local `$ref`s are rewritten to match. Merging
    definitions by their own names would let two schemas that both define, say, `Item` resolve
    each other's, and arguments could pass the grammar yet fail their tool's schema."""
    if not isinstance(schema, dict):
        return schema
    own = {**(schema.get("definitions") or {}), **(schema.get("$defs") or {})}
    body = {k: v for k, v in schema.items() if k not in ("$defs", "definitions", "$schema", "$id")}
    refers_to_root = False

    def target(ref: str) -> str:
        nonlocal refers_to_root
        for key in ("$defs", "definitions"):
            prefix = f"#/{key}/"
            if ref.startswith(prefix):
                name, slash, rest = ref[len(prefix):].partition("/")
                return f"#/$defs/{tag}__{name}{slash}{rest}"
        if ref.startswith("#") and not ref.startswith("#/") and len(ref) > 1:
            return f"#{tag}__{ref[1:]}"  # a plain-name ($anchor) reference
        if ref == "#" or ref.startswith("#/"):
            # The schema's own root (recursion) or a place inside it: a copy of it lives in defs.
            refers_to_root = True
            return f"#/$defs/{tag}{ref[1:]}"
        return ref

    def rewrite(node: Any, names: bool = False) -> Any:
        # `names`: node maps property (or definition) names to schemas, so its keys are not keywords.
        if isinstance(node, dict):
            if names:
                return {k: rewrite(v) for k, v in node.items()}
            return {k: (target(v) if k == "$ref" and isinstance(v, str)
                        else f"{tag}__{v}" if k in ("$anchor", "$dynamicAnchor") and isinstance(v, str)
                        else v if k in _DATA_KEYWORDS else rewrite(v, k in _NAME_MAPS)) for k, v in node.items()}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    out = rewrite(body)
    for name, d in own.items():
        defs[f"{tag}__{name}"] = rewrite(d)
    if refers_to_root:
        defs[tag] = out
    return out
