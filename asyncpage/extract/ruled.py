"""Values a rule gives over the scored decisions (decisions.Plan.outcome): the brand a greeting addresses
(addressed.py), the writer's whole name where the model copied part of it, and a code without the sentence's period
it was copied with.

The writer's name: "Echeverría" of a record signed "Tomás Echeverría", "McAllister" of "Connor McAllister" (v102,
v128: the start decision kept the surname the model wrote, and a span inside the model's value is no start). A
writer field's value (as decided, else as the model wrote it) that opens or closes a name written alone on a line
of the record's signature (its last SIGNATURE characters before a quoted reply: not a quoted agent's) becomes that
name. Such values report no scored share (the share their decision left was the part's).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from typing import Any

from asyncpage.extract.addressed import addressed_brands
from asyncpage.extract.employer import DASH, PERSON, SIGNATURE, companies
from asyncpage.extract.grounding import WRITER
from asyncpage.extract.staff import QUOTED
from asyncpage.extract.starts import coded, names_a_code

# A field asking for part of a name ("customer_last_name", "the writer's first name"): its value is not completed.
_PART = re.compile(r"first|last|given|family|sur_?name|fore_?name|middle|initial", re.IGNORECASE)
_TITLE = re.compile(r"^(?:Mrs|Mr|Ms|Miss|Mx|Dr|Prof)\.?[ \t]+")
# A name alone on its line, a dash before it at most ("Tomás Echeverría", "- Dev Patel", "— Matteo Rossi"; a hyphen
# too, which employer's signature lines leave to a list's items).
_NAME_LINE = re.compile(rf"^[ \t]*(?:-[ \t]*)?{DASH}(?P<name>{PERSON})[ \t]*\r?$", re.MULTILINE)


def signed_name(text: str, value: str) -> str | None:
    """The name alone on a line of `text`'s signature that `value`, one word, opens or closes ("Connor" or
    "McAllister" of "Connor McAllister"), its title left off ("Dr. Amara Okafor": "Amara Okafor"), or None. Not
    where the rest is an initial ("A. Nowicka"), the line names a company (employer.companies, or right under another
    name line: "Gwynedd Joinery" under "Rhys ap Gwynedd"), the record signs with the value alone ("Maria" above
    "Maria Lopez Consulting"), or two names hold it."""
    value = value.strip()
    end = q.start() if (q := QUOTED.search(text)) else len(text)  # the signature stands before a quoted reply
    if value.isalpha() and value.islower():
        return _signed_lowercase(text, value, end)
    if not value or not value[:1].isupper() or len(value.split()) != 1:
        return None
    signature = text[max(0, end - SIGNATURE) : end]
    if re.search(rf"^[ \t]*(?:-[ \t]*)?{DASH}{re.escape(value)}[ \t]*\r?$", signature, re.MULTILINE):
        return None  # the record signs with the value itself ("Best,\nMaria\nMaria Lopez Consulting")
    found = set()
    orgs = companies(text)
    lines = list(_NAME_LINE.finditer(text, max(0, end - SIGNATURE), end))
    under = {b.start() for a, b in itertools.pairwise(lines)
             if not text[a.end() : b.start()].strip() and text.count("\n", a.end(), b.start()) <= 1}
    for m in lines:
        if m.start() in under:
            continue  # the line right under a name is its company's or its title's ("Gwynedd Joinery")
        name = _TITLE.sub("", m.group("name"))  # a span of the record as written ("Connor  McAllister" too)
        words = name.split()
        rest = words[1:] if words[:1] == [value] else words[:-1] if words[-1:] == [value] else []
        if rest and all(len(w.rstrip(".")) > 1 and not w.endswith(".") for w in rest) and \
                not any(a <= m.start("name") < b for a, b in orgs):
            found.add(name)
    return found.pop() if len(found) == 1 else None  # two names the value is part of: neither


# A name typed all in lowercase alone on a signature's line ("noor haddad" under "sent from my iphone"), and the
# words a closing line holds that no name does ("thanks noor", "love from mum").
_LOWER_LINE = re.compile(r"^[ \t]*(?:-[ \t]*)?(?P<name>[a-z][a-z'’-]+(?:[ \t]+[a-z][a-z'’-]+){1,2})[ \t]*\r?$",
                         re.MULTILINE)
_CLOSING_WORDS = frozenset("thanks thank thx ty cheers regards best love from sent my the and you kind warm many hi "
                           "hello hey dear please sincerely yours bye ta again so much all".split())


def _signed_lowercase(text: str, value: str, end: int) -> str | None:
    """`signed_name` for a record typed in lowercase: the one line of two or three lowercase words in its last lines
    (before `end`) that `value` opens or closes, no closing's word among them ("noor haddad" of "noor"; v135)."""
    names = [m.group("name") for m in _LOWER_LINE.finditer(text, max(0, end - SIGNATURE), end)]
    found = {n for n in names if value in ((w := n.split())[0], w[-1]) and not _CLOSING_WORDS.intersection(w)}
    return found.pop() if len(found) == 1 else None


def ruled(text: str, brands: set[str], branches: dict[str, dict[str, Any]], decided: dict[str, Any],
          written: dict[str, Any], holds: Callable[[str, Any], bool]) -> dict[str, Any]:
    """The fields a rule decides: each brand field a greeting addresses (addressed_brands), each writer field
    (`branches` marked grounding.WRITER) whose value is part of a signed name (`signed_name`), with their values; not
    a field whose name or description asks for part of a name (_PART: "customer_last_name"); each code field whose
    value ends with its sentence's period (v138), without it."""
    out: dict[str, Any] = addressed_brands(text, brands, decided, written, holds)
    for name, branch in branches.items():
        value = decided.get(name, written.get(name))
        if branch.get(WRITER) is True and not _PART.search(f"{name} {branch.get('description', '')}") and \
                isinstance(value, str) and (full := signed_name(text, value)) and holds(name, full):
            out[name] = full
    for name in {*written, *decided} - set(out):  # a code copied with its sentence's period ("Order number: 4417-SC.")
        value = decided.get(name, written.get(name))
        if isinstance(value, str) and value.endswith(".") and names_a_code(name) and coded(value[:-1]) and \
                holds(name, value[:-1]):
            out[name] = value[:-1]
    return out
