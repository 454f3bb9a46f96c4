"""Which top-level fields of a schema are closed choices, and how each option is spelled.

A closed choice is a field whose values the schema lists: an `enum`, a `const` among `anyOf`/`oneOf`
alternatives (pydantic's and msgspec's `Literal`, `Optional[Literal]`), a nullable boolean; and the
null-or-present choice of a nullable field whose other branch is an open scalar (a string, copied or
not, a number): there the options are null and "a value", the best one the grammar allows. Plain
booleans are booleans.py's (their statement read after the record). What is decided here and how:
asyncpage.extract.decisions.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from asyncpage.extract.grounding import COPY, NAMED, WRITER, resolve, with_outer

MAX_OPTIONS = 16  # more options than this are left to the grammar: one scoring request each per record
# An option the record names in its own words ("This is critical") is copied with this weight: the decision is
# the mix (1 - NAMED_WEIGHT) * the model's share + NAMED_WEIGHT * an even share among the named options, so a
# lone named option wins and the model chooses among several (docs/extraction.md, "Decisions by scoring").
NAMED_WEIGHT = 0.5
# A nameable option: 1-8 words of letters and digits, one space, "_" or "-" between them, 3+ of those characters,
# a letter among them. Shorter ones ("a", "no", "on") occur in most texts as other words.
_NAMEABLE = re.compile(r"[^\W_]+(?:[ _-][^\W_]+){0,7}")
_MIN_NAMED = 3
_BETWEEN = r"[ \t\u00a0_-]+"  # words of an option as a text may space them (never across a line)
# A naming that is denied: a negation and at most three more words before it, or a verb denying it right after, in
# its own clause ("I don't want a refund", "not asking for a refund", "a repair than a refund", "nothing serious",
# "non-urgent", "A refund isn't the point"; "No, this is critical" and "a refund, not a repair" are not denials of
# it); none in a condition ("if I don't get a refund"), and none after "the refund" ("the refund wasn't paid").
_APOS = "'’ʼ´"
_DENIED_BEFORE = re.compile(rf"(?:\b(?:not|no|non|never|nothing|nobody|no\s+one|none|hardly|without|nor|rather\s+than"
                            rf"|instead\s+of"
                            rf"|far\s+from|dont|didnt|doesnt|isnt|wont|cant|cannot)\b|n[{_APOS}]t)"
                            rf"(?:[\s-]+[\w{_APOS}]+){{0,3}}[\s-]*$|\bthan(?:\s+\w+)?\s+$", re.IGNORECASE)
_DENIED_AFTER = re.compile(rf"^\s+(?:(?:is|was|were|are|has|have|would|will|does|did|do|could|can|should)"
                           rf"(?:n[{_APOS}]t|\s+not\b|\s+never\b)|(?:isn|wasn|won|doesn|don|aren|hasn|haven)[{_APOS}]t\b"
                           rf"|(?:isnt|wasnt|wont|doesnt|dont|arent|hasnt|havent|cannot)\b)", re.IGNORECASE)
_CONDITION = re.compile(r"\b(?:if|unless|until|whether)\b", re.IGNORECASE)
_DEFINITE = re.compile(r"\b(?:the|my|your|our|his|her|their|this|that)\s+$", re.IGNORECASE)
_ANSWERED_NO = re.compile(r"^[^\S\n]*[:?][^\S\n]*(?:no|not|none|n/?a)\b", re.IGNORECASE)  # "Refund: No"
_CLAUSE = re.compile(r"[.,;:!?()\[\]\n–—]|\s-\s|\bbut\b", re.IGNORECASE)
_SOFT_BREAK = re.compile(r"(?<![.!?:;\n])\n(?![\n\[])")  # a hard-wrapped line: one clause goes on
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


def named(options: Sequence[Any], text: str) -> list[bool] | None:
    """Which options `text` names in its own words (`mentions`). Options that are not strings name nothing. None
    when a string option cannot be named (see _NAMEABLE: "no" beside "yes", "C++"): then none is, so that no
    option wins for being the one a text can name."""
    strings = [o.strip() for o in options if isinstance(o, str)]
    if not strings or not all(nameable(o) for o in strings):
        return None
    return [isinstance(o, str) and mentions(o, text) for o in options]


def nameable(phrase: str) -> bool:
    """Whether a text can name `phrase` in its own words (_NAMEABLE, 3+ letters and digits, a letter)."""
    return bool(_NAMEABLE.fullmatch(phrase) and sum(ch.isalnum() for ch in phrase) >= _MIN_NAMED
                and any(ch.isalpha() for ch in phrase))


def mentions(phrase: str, text: str) -> bool:
    """Whether `text` names `phrase` (`namings`) at least once undenied."""
    return namings(phrase, text)[0] > 0


@functools.lru_cache(maxsize=1024)
def phrasing(phrase: str) -> re.Pattern[str] | None:
    """`phrase` as a text may write it: whole words (not inside a word, an address or a "HIGH_TEMP"), any case, its
    " ", "_" and "-" alike, within one line, any apostrophe ("can't", "can’t"). None: it has no word."""
    words = re.findall(rf"[^\W_]+(?:[{_APOS}][^\W_]+)*", phrase)
    if not words:
        return None
    spelled = [f"[{_APOS}]".join(map(re.escape, re.split(f"[{_APOS}]", w))) for w in words]
    return re.compile(r"(?<![\w@])" + _BETWEEN.join(spelled) + r"(?![\w@]|\.\w)", re.IGNORECASE)


def namings(phrase: str, text: str) -> tuple[int, int]:
    """How often `text` names `phrase` and how often it denies it: as whole words (not inside a word, an address or
    a "HIGH_TEMP"), any case, its " ", "_" and "-" alike ("High priority" for "high_priority"), within one line;
    denied in its clause ("not critical", "isn't that high", "I don't want a refund", "a refund isn't the point")
    or answered no ("Refund: No")."""
    found = naming_spans(phrase, text)
    denied = sum(d for _, _, d in found)
    said = len(found) - denied
    return said, denied


def naming_spans(phrase: str, text: str) -> list[tuple[int, int, bool]]:
    """Where `text` names `phrase` (`phrasing`): (start, end, whether it is denied there: `is_denied`) each."""
    pattern = phrasing(phrase)
    return [(m.start(), m.end(), is_denied(text, m.start(), m.end()))
            for m in (pattern.finditer(text) if pattern is not None else ())]


def is_denied(text: str, start: int, end: int) -> bool:
    """Whether the words at text[start:end] are denied in their clause ("not critical", "nobody was injured", "a
    refund isn't the point") or answered no ("Refund: No"); a negation inside a condition is none ("if I don't get
    a refund")."""
    before = _CLAUSE.split(_SOFT_BREAK.sub(" ", text[max(0, start - 80):start]))[-1]
    rest = text[end:end + 40]
    after = _CLAUSE.split(_SOFT_BREAK.sub(" ", rest))[0]
    return bool((_DENIED_BEFORE.search(before) and not _CONDITION.search(before)) or _ANSWERED_NO.match(rest)
                or (_DENIED_AFTER.search(after) and not _DEFINITE.search(before)))


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
    for flag in (COPY, NAMED, WRITER):  # what the copied field's spans may be holds for its present branch too
        if flag in s:
            branch[flag] = s[flag]
    return branch
