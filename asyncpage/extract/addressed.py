"""The brand a record's greeting addresses: "Dear Stitchwell team,", "Hello Climatek dispatch,", "Hi Vaultic support,".

A business writes to the maker's team by its name, and the model, asked for "the product brand", still copied a word
of the subject line or a quoted package name ("Chef" of "Chef jackets", "P1" of "P1 - Technician no-show", "Premium
AV") in five of 44 spent business tickets (v117-v118), where the greeting named the brand and the body named it
again ("Dear Brisa team, ... The Brisa KX-300 ..."). On every labeled ticket (tests/data through v118: 2,400 with a
product) where a greeting so addresses a name and the body writes that name again, the name's first word is the
product's brand: 209 of 209 (a generic team's name left out: "Dear Customer Service", "Dear Accounts Team").

`addressed_brands` gives each brand field whose value (as decided, else as the model wrote it) holds no word of that
name the name instead: its longest opening words the body writes again ("Boreal Air" of "Dear Boreal Air Group
Sales"). A value that holds it is kept ("Vaultic Backup 360" under "Hi Vaultic support,").
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

# A greeting at a line's start, then one to three capitalized words, then the team's word ("Dear Kaleido Events Team",
# "Hello Skyvale Group Desk": the name is the words before the first team word).
_TEAM = (r"(?:[Tt]eam|[Ss]upport|[Ss]ervice|[Cc]ustomer|[Ss]ales|[Dd]ispatch|[Ee]vents|[Gg]roup|[Oo]rders?|[Hh]elp"
         r"|[Cc]are|[Bb]illing|[Aa]ccounts?|[Rr]eturns|[Ww]arranty|[Tt]echnical|[Tt]ech|[Cc]laims|[Bb]ookings?"
         r"|[Rr]eservations?|[Dd]esk)")
_WORD = r"[A-ZÀ-ÖØ-Þ][\w'’&-]*"
_GREETING = re.compile(r"^[ \t]*(?:Dear|Hello|Hi|Hey|Good[ \t]+(?:morning|afternoon|evening)|Attn:?|Attention:?)"
                       rf"[ \t,]+(?:the[ \t]+)?(?P<name>{_WORD}(?:[ \t]+{_WORD}){{0,2}}?)[ \t]+{_TEAM}\b", re.MULTILINE)
# Words that name a team, not a company ("Dear Customer Service", "Hello Support team", "Dear Sir").
_GENERIC = frozenset("customer customers account accounts support sales service services billing order orders returns "
                     "warranty help technical tech claims care team booking bookings reservations events group desk "
                     "dispatch sir madam all finance repair repairs after helpdesk it hr".split())


# A seller's name, not a maker's: the record says it bought the product from it ("I bought a Lumisse lamp from
# TechHaus"; the name stands as "\0"). None of the 202 labeled tickets the greeting reads says so.
_SELLER = re.compile(r"\b(?:bought|purchased|ordered|got)[ \t]+(?:[\w-]+[ \t]+){0,5}?(?:from|at)[ \t]+"
                     r"(?:the[ \t]+)?\0(?![\w-])(?-i:(?![ \t]+[A-Z0-9]))", re.IGNORECASE)


def addressed(text: str) -> str:
    """The name the first such greeting addresses, its opening words the rest of `text` writes again (as whole words);
    "" where no greeting does, its first word is a team's, or the record bought from it (a seller: _SELLER)."""
    m = _GREETING.search(text)
    if m is None or m.group("name").split()[0].casefold() in _GENERIC:
        return ""
    rest = text[:m.start()] + "\n" + text[m.end():]
    words = m.group("name").split()
    for n in range(len(words), 0, -1):
        name = " ".join(words[:n])
        if re.search(r"(?<![\w-])" + re.escape(name) + r"(?![\w-])", rest):
            return "" if _SELLER.search(rest.replace(name, "\0")) else name
    return ""


def addressed_brands(text: str, brands: Iterable[str], decided: dict[str, Any], written: dict[str, Any],
                     holds: Callable[[str, Any], bool]) -> dict[str, str]:
    """The brand fields whose value holds no word of the name `text`'s greeting addresses, with that name, where the
    field's schema holds it and it is no word of another field's value (the customer's)."""
    name = addressed(text)
    if not name:
        return {}
    first = name.split()[0].casefold()
    out: dict[str, str] = {}
    for field in brands:
        value = decided.get(field, written.get(field))
        if not isinstance(value, str) or first in value.casefold().split():
            continue
        others = {w for d in (decided, written) for n, v in d.items() if n != field and isinstance(v, str)
                  for w in v.casefold().split()}
        if first not in others and holds(field, name):
            out[field] = name
    return out
