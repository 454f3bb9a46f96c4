"""How a scored decision reads after a record, and how decided values enter the generated JSON.

A reading (`Said`) is a text scored after the record and a lead: an option on its field's label line
(" critical" after "\n\nSeverity:"), a copied value on its description's line (" Marlow Duo\n" after "\n\nThe
product brand the ticket is about:"). `value_grammar` and grounding.line_grammar are the grammars of a value found
by search; `applied` puts the decided values into the model's JSON. What is decided, and why each reading:
asyncpage.extract.decisions.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import msgspec

from asyncpage.errors import InvalidRequestError
from asyncpage.extract import grounding
from asyncpage.extract.closed import spelling

MAX_DESCRIBED = 100  # a longer description is not read as a line: its label (title or name) is
LINE_END = "\n"  # what ends a copied value read on its label line (so a span's end is scored too)


class Context(NamedTuple):
    """A generated value in its prompt: the prompt's ids, the value's text and token ids."""

    prompt_ids: list[int]
    text: str
    token_ids: list[int]


class Said(NamedTuple):
    """A reading: `text` scored after the record and `lead` ("<record><lead><text>"); `key` names its offset."""

    lead: str
    text: str

    @property
    def key(self) -> str:
        return self.lead + self.text


def reading(name: str, prop: dict[str, Any], option: Any) -> Said:
    """How an option reads after the record: its field's label line ("\n\nSeverity:") then the option
    (" critical"). The label is the field's title, else its name; null reads "not given"."""
    label = " ".join(str(prop.get("title") or name.replace("_", " ")).split()).rstrip(":")
    word = "not given" if option is None else option if isinstance(option, str) else spelling(option)
    return Said(f"\n\n{label[:1].upper()}{label[1:]}:", f" {' '.join(str(word).split())}")


def described(name: str, prop: dict[str, Any]) -> str:
    """The line a copied value's end is read on: "\n\n<its description>:" when it has a short one ("The product
    brand the ticket is about:"), else its label line's ("\n\nProduct:")."""
    desc = " ".join(str(prop.get("description") or "").split()).rstrip(".:")
    if not desc or len(desc) > MAX_DESCRIBED:
        return reading(name, prop, None).lead
    return f"\n\n{desc[:1].upper()}{desc[1:]}:"


# Words of a field's name that say what kind of value it is, not what it is of ("order_id": "order").
def name_words(field: str) -> list[str]:
    """A field's name as lowercase words: camelCase, snake_case and kebab-case split ("wantsMoneyBack", "order_id")."""
    return re.sub(r"([a-z])([A-Z])", r"\1 \2", field).replace("_", " ").replace("-", " ").lower().split()


def definitions(root: dict[str, Any]) -> dict[str, Any]:
    """The root's `$defs` / `definitions`: what a field's own `$ref`s point into, carried beside it."""
    return {k: root[k] for k in ("$defs", "definitions") if k in root}


def value_grammar(root: dict[str, Any], branch: dict[str, Any], sources: Sequence[str], bridge: str) -> str | None:
    """The Lark grammar of `bridge` then one value of a present branch: a span of `sources` when it is copied,
    else the branch's JSON Schema."""
    lead = json.dumps(bridge) + " " if bridge else ""
    if branch.get(grounding.COPY) is True:
        try:
            text = grounding.grammar({**branch, **definitions(root)},
                                     sources)
        except InvalidRequestError:  # nothing to copy from (no letter or digit): present is not possible
            return None
        return text.replace("\nstart: ", f"\nstart: {lead}", 1)
    body: dict[str, Any] = {**branch, **definitions(root),
                            "x-guidance": {"whitespace_flexible": False, "item_separator": grounding.ITEM_SEP,
                                           "key_separator": grounding.KEY_SEP}}
    return f"%llguidance {{}}\nstart: {lead}v\nv: %json {json.dumps(body)}\n"


def checker(root: dict[str, Any], prop: Any) -> Callable[[Any], bool]:
    """Whether a decided value holds to its field's schema (`prop`, `root`'s definitions beside it). Never
    raises: a schema the bounded checker cannot run (a reference it cannot follow, a pattern RE2 refuses)
    holds no decided value, and the model's own stands there."""
    from asyncpage.guided.untrusted import bounded_validator

    if not isinstance(prop, dict):
        return lambda value: prop is True
    body = {**definitions(root), **{k: v for k, v in prop.items() if k != grounding.COPY}}
    if "$schema" in root:
        body.setdefault("$schema", root["$schema"])
    try:
        validator = bounded_validator(body)
    except Exception:  # any failure to build it (the schema is the caller's): nothing decided is applied
        return lambda value: False

    def holds(value: Any) -> bool:
        try:
            return bool(validator.is_valid(value))
        except Exception:  # raised lazily (an unresolvable $ref, a pattern RE2 refuses): not applied
            return False

    return holds


def applied(text: str, decided: dict[str, Any]) -> str:
    """The generated JSON with each decided field's value in place of the model's own (set also where the model
    left an optional one out). On the text, before the caller's type judges the value."""
    if not decided:
        return text
    try:
        value = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text  # decoding it fails the record as it would have
    if not isinstance(value, dict):
        return text
    return msgspec.json.encode({**value, **decided}).decode()


def mean(xs: Sequence[float | None]) -> float:
    return sum(x for x in xs if x is not None) / len(xs)


def logistic(x: float) -> float:
    return 0.5 * (1 + math.tanh(x / 2))  # 1 / (1 + e^-x), not overflowing at large -x
