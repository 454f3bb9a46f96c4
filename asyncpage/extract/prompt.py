"""The default extraction prompt: the fields and what they mean, read from the schema.

A small model given only "The information above as JSON:" guesses what each key wants. Each
record is followed by its field list (name, description, allowed values, when it may be null,
whether it is copied as written) and "JSON:". Four solved records of an unrelated schema come first
(DEMOS): measured on the default model, they teach the pattern (copy a span, null when absent)
better than instructions; the caller's own labeled examples follow them in the same shape. The last
two (a chat log with an id and a version number, a title and a refusal of a refund) raised fields
right on examples/grounded with 4 beams from 66% to 71%.

Also how any prompt meets a record: `render_prompt` fills a template's {field}s (or calls a
function of the record), and `copy_sources` says which of the record's fields copied values come from.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from asyncpage.errors import GrammarError, InvalidRequestError
from asyncpage.extract.grounding import resolve as _resolve
from asyncpage.guided.untrusted import bounded_validator, refuse_outside_refs

TEXT_FIELD = "text"
_DEMO_FIELDS = [
    "- sender: who wrote it; text, copied exactly as written in the record",
    "- city: where the sender lives; text, copied exactly as written in the record; null when the record "
    "does not give it",
    "- order: the order number; text, copied exactly as written in the record; null when the record does "
    "not give it",
    "- wants_money_back: true or false",
]
DEMOS = [
    ("Hello, this is Ana Beatriz Silva from Porto. My order 7781-B never arrived, please send my money back. "
     "Call me at 555 0192.",
     {"sender": "Ana Beatriz Silva", "city": "Porto", "order": "7781-B", "wants_money_back": True}),
    ("From: Tom Reyes\nThe export button in the Lumen Desk app is greyed out since Monday. No need to refund "
     "anything, just fix it.",
     {"sender": "Tom Reyes", "city": None, "order": None, "wants_money_back": False}),
    ("[09:12] Support (Kim): Hello, how can I help?\n[09:13] Customer (Lena Marquardt): My Aurora Desk Lamp from "
     "order LX-55210 flickers since the 2.4 firmware. Please refund it, I paid 89.90 EUR.",
     {"sender": "Lena Marquardt", "city": None, "order": "LX-55210", "wants_money_back": True}),
    ("Subject: Sync stopped\n\nSince version 7.1 the Fernleaf Calendar app on my phone stops syncing at 50%. I "
     "restarted it 3 times. I don't want my money back, I want it to work.\n\nDr. Kofi Boateng, Accra",
     {"sender": "Kofi Boateng", "city": "Accra", "order": None, "wants_money_back": False}),
]
# The reference records scored decisions are calibrated on (booleans.py, decisions.py): the solved records above
# and two plain messages that ask for nothing (no refund, no order, no severity), so that most references, as
# most messages, do not ask for money back.
REFERENCES = [text for text, _ in DEMOS] + [
    "Hi, I moved house last month. Please update the delivery address on my account to 14 Elm Road, Leeds.\n\n"
    "Thanks, Sara Quinn",
    "[15:10] Customer (Jon Vik): hello, do you ship to Norway?\n[15:11] Agent (Eve): Yes, we do, within 5 days.",
]


def _kind(root: dict[str, Any], s: dict[str, Any]) -> tuple[str, bool]:
    """A short reading of a property's type, and whether it may be null."""
    alts = [_resolve(root, a) for a in (s.get("anyOf") or s.get("oneOf") or [])]
    types = s.get("type")
    names = [types] if isinstance(types, str) else list(types or [])
    names += [a.get("type") for a in alts if isinstance(a.get("type"), str)]
    nullable = "null" in names
    enum = s.get("enum") or next((a.get("enum") for a in alts if a.get("enum")), None)
    if enum:
        return "one of " + ", ".join(json.dumps(v) for v in enum if v is not None), nullable
    if "const" in s:
        return "always " + json.dumps(s["const"]), nullable
    kinds = [n for n in names if n != "null"]
    text = {"boolean": "true or false", "integer": "a whole number", "number": "a number",
            "array": "a list", "object": "an object"}
    return (text.get(kinds[0], "text") if kinds else "a value"), nullable


def field_lines(schema: dict[str, Any], copied: Collection[str] = ()) -> list[str]:
    """One line per top-level property: name, meaning, values allowed."""
    obj = _resolve(schema, schema)
    required = set(obj.get("required") or [])
    lines = []
    for name, prop in (obj.get("properties") or {}).items():
        p = _resolve(schema, prop)
        kind, nullable = _kind(schema, p)
        meaning = str(p.get("description") or p.get("title") or "").strip().rstrip(".")
        meaning = "" if meaning.lower() == name.lower() else meaning
        parts = [meaning] if meaning else []
        parts.append(kind + (", copied exactly as written in the record" if name in copied else ""))
        if nullable:
            parts.append("null when the record does not give it")
        elif name not in required:
            parts.append("may be left out")
        lines.append(f"- {name}: " + "; ".join(parts))
    return lines


def _check_example(schema: dict[str, Any], value: Any, number: int) -> None:
    """A solved case whose values the schema refuses would teach the model a wrong value: refused, by
    its number. Fields left out are allowed, at any depth (a partial label still shows the rest right)."""
    import jsonschema
    from referencing.exceptions import Unresolvable

    lenient = _without_required(schema)
    try:
        # Bounded as a grammar's check is: nothing fetched for a $ref, patterns on RE2 (linear time).
        refuse_outside_refs(lenient)
        validator = bounded_validator(lenient)
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    except GrammarError as exc:
        raise InvalidRequestError("schema", f"cannot check the examples against it: {exc.message}") from exc
    except (jsonschema.exceptions.SchemaError, jsonschema.exceptions.UnknownType, Unresolvable, re.error) as exc:
        raise InvalidRequestError("schema", f"cannot check the examples against it: {exc}") from exc
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "the value"
        raise InvalidRequestError("examples", f"example {number}: {where}: {error.message}")


_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema maps


def _without_required(node: Any, names: bool = False) -> Any:
    """`node` (a schema, or a map of names to schemas) with every `required` list dropped."""
    if isinstance(node, list):
        return [_without_required(x) for x in node]
    if not isinstance(node, dict):
        return node
    if names:
        return {k: _without_required(v) for k, v in node.items()}
    return {k: _without_required(v, k in _NAMED) for k, v in node.items()
            if not (k == "required" and isinstance(v, list))}


def schema_prompt(schema: dict[str, Any], *, examples: Sequence[Mapping[str, Any]] = (),
                  copied: Collection[str] = (), demos: bool = True,
                  text_field: str = TEXT_FIELD) -> Callable[[Mapping[str, Any]], str]:
    """The prompt (a function of the record) for extracting `schema` from `record[text_field]`.
    `examples`: records with their labeled `value`, shown as solved cases after the built-in DEMOS
    (`demos=False` leaves those out: about 700 tokens a short-context model cannot spare)."""
    fields = "\n".join(field_lines(schema, copied))
    shots = [_case(text, "\n".join(_DEMO_FIELDS), value) for text, value in DEMOS] if demos else []
    for i, ex in enumerate(examples):
        if not isinstance(ex, Mapping) or not isinstance(ex.get(text_field), str) or "value" not in ex:
            raise InvalidRequestError("examples", f"example {i + 1} needs a {text_field!r} string and a 'value'")
        _check_example(schema, ex["value"], i + 1)
        shots.append(_case(ex[text_field], fields, ex["value"]))
    preamble = "".join(shots)

    def prompt(record: Mapping[str, Any]) -> str:
        text = record.get(text_field)
        if not isinstance(text, str):
            raise InvalidRequestError("prompt", f"the record has no {text_field!r} string for the default prompt "
                                                "(pass prompt= a template over its fields)")
        return preamble + _case(text, fields, None)

    return prompt


def _case(text: str, fields: str, value: Any) -> str:
    """One record in the prompt; with its value, a solved one (spaced JSON, as the grammar writes it)."""
    head = f"Record:\n{text.strip()}\n\nFields:\n{fields}\nJSON: "
    return head if value is None else head + json.dumps(value, ensure_ascii=False) + "\n\n"


# A template with {field} placeholders, or a function of the record.
PromptTemplate = str | Callable[[Mapping[str, Any]], str]
_FIELD = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def render_prompt(template: PromptTemplate, record: Mapping[str, Any]) -> str:
    """Fill `{field}` placeholders from the record. Only `{identifier}` is a placeholder, so JSON
    examples in a prompt ({"name": ...}) need no escaping."""
    if callable(template):
        try:
            text = template(record)
        except InvalidRequestError:
            raise  # already says what is wrong with the record (the default prompt's own refusals)
        except Exception as exc:  # a user's function: its failure is this record's, never the job's
            raise InvalidRequestError("prompt", f"the prompt function raised {exc!r}") from exc
        if not isinstance(text, str):
            raise InvalidRequestError("prompt", f"the prompt function returned {type(text).__name__}, not str")
        return text

    def field(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in record:
            raise InvalidRequestError("prompt", f"the record has no field {name!r} used by the prompt template")
        value = record[name]
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)

    return _FIELD.sub(field, template)


def copy_sources(prompt: PromptTemplate | None, record: Mapping[str, Any], id_field: str) -> list[str]:
    """What a record's copied fields may copy from: the fields its prompt template shows, else its
    text field, else every string field but its id."""
    if isinstance(prompt, str):
        names = [n for n in dict.fromkeys(_FIELD.findall(prompt)) if n != id_field]
    elif isinstance(record.get("text"), str):
        names = ["text"]
    else:
        names = [n for n in record if n != id_field]
    return [v for n in names if isinstance(v := record.get(n), str) and v]
