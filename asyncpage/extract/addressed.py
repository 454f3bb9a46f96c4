"""The brand a record's greeting addresses: "Dear Stitchwell team,", "Hello Climatek dispatch,", "Hi Vaultic support,".

A business writes to the maker's team by its name, and the model, asked for "the product brand", still copied a word
of the subject line or a quoted package name ("Chef" of "Chef jackets", "P1" of "P1 - Technician no-show", "Premium
AV") in five of 44 spent business tickets (v117-v118), where the greeting named the brand and the body named it
again ("Dear Brisa team, ... The Brisa KX-300 ..."). The name counts where the body uses it as a brand (before a
model's word: "Brisa KX-300", "Skyvale Airways"); not where the greeting alone names it (a retailer, a courier or a
department as often: "Dear Currys team", "Dear DHL Customer Service"), nor a team's or a department's name ("Dear
Customer Service", "Dear Product Support"), a seller's the record bought from ("ordered on Amazon", "at MediaMarkt
Berlin"), one the body writes only otherwise ("my Zalando order", "Climatek job 5521") or the writer's own company
(the two reviews found each). On the labeled tickets through v122, 211 so greeted, the name's first word the
product's brand in each.

`addressed_brands` gives each brand field whose value (as decided, else as the model wrote it) holds no word of that
name the name instead: its longest opening words the body writes again ("Boreal Air" of "Dear Boreal Air Group
Sales"). A value that holds it is kept ("Vaultic Backup 360" under "Hi Vaultic support,").
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from asyncpage.extract.employer import companies
from asyncpage.extract.staff import QUOTED

# A greeting at a line's start, then one to three capitalized words, then the team's word ("Dear Kaleido Events Team",
# "Hello Skyvale Group Desk": the name is the words before the first team word).
_TEAM = (r"(?:[Tt]eam|[Ss]upport|[Ss]ervice|[Cc]ustomer|[Ss]ales|[Dd]ispatch|[Ee]vents|[Gg]roup|[Oo]rders?|[Hh]elp"
         r"|[Cc]are|[Bb]illing|[Aa]ccounts?|[Rr]eturns|[Ww]arranty|[Tt]echnical|[Tt]ech|[Cc]laims|[Bb]ookings?"
         r"|[Rr]eservations?|[Dd]esk)")
_WORD = r"[A-ZÀ-ÖØ-Þ][\w'’&-]*"
_GREETING = re.compile(r"^[ \t]*(?:Dear|Hello|Hi|Hey|Good[ \t]+(?:morning|afternoon|evening)|Attn:?|Attention:?)"
                       rf"[ \t,]+(?:the[ \t]+)?(?P<name>{_WORD}(?:[ \t]+{_WORD}){{0,2}}?)[ \t]+{_TEAM}\b", re.MULTILINE)
# Words that name a team or a department, not a company ("Dear Customer Service", "Dear Product Support", "Hello Nordic
# Sales team"; the review's list).
_GENERIC = frozenset(
    "customer customers account accounts support sales service services billing order orders returns warranty help "
    "technical tech claims care team booking bookings reservations events group desk dispatch sir madam all finance "
    "repair repairs after helpdesk it hr product products delivery deliveries shipping installation installations "
    "management store stores head office facilities marketing procurement purchasing hotel front parts logistics "
    "quality premium enterprise trade wholesale corporate business dealer dealers online web webshop shop uk us eu "
    "emea apac nordic complaints concierge admin administration operations reception partner partners key global "
    "regional "
    "local national international main central spare spares accessories technician technicians field onsite".split())
# The name used as a brand: before a model's word (capitalized, or holding a digit) or a possessive ("Stitchwell
# ProChef", "Brisa KX-300", "Skyvale's"); not "ordered on Amazon", "my Zalando order", "Climatek job 5521".
_AS_BRAND = re.compile(r"[ \t]+(?:[A-ZÀ-ÖØ-Þ0-9]|[\w-]*\d)|['’]s\b")


# A seller's name, not a maker's: the record says it bought the product from it ("I bought a Lumisse lamp from
# TechHaus", "at MediaMarkt Berlin"; the name stands as "\0"). None of the labeled tickets the greeting reads says so.
_SELLER = re.compile(r"\b(?:bought|purchased|ordered|got)[ \t]+(?:[\w-]+[ \t]+){0,5}?(?:from|at|on)[ \t]+"
                     r"(?:the[ \t]+)?\0(?![\w-])", re.IGNORECASE)


def addressed(text: str) -> str:
    """The name the first greeting addresses (one before any quoted message first: a forwarded mail may be the
    writer's own, a quoted reply is the seller's, and its greeting to the writer's company `addressed_brands` leaves
    alone), where the rest of `text` uses it as a brand (before a model's word: _AS_BRAND): its longest opening words
    the rest writes; "" where no greeting does, the rest never uses it so, its first word is a team's or a
    department's, or the record bought from it (a seller: _SELLER). On the labeled tickets through v122, 211 tickets
    so greeted (none the writer's company), the name their brand in each; four more whose body writes the name only
    otherwise ("through Staylight") or never are left to the model."""
    quoted = QUOTED.search(text)
    m = (_GREETING.search(text, 0, quoted.start()) if quoted else None) or _GREETING.search(text)
    if m is None or m.group("name").split()[0].casefold() in _GENERIC:
        return ""
    rest = text[:m.start()] + "\n" + text[m.end():]
    words = m.group("name").split()
    for n in range(len(words), 0, -1):
        name = " ".join(words[:n])
        places = list(re.finditer(r"(?<![\w-])" + re.escape(name) + r"(?![\w-])", rest))
        if places:
            if _SELLER.search(rest.replace(name, "\0")) or not any(_AS_BRAND.match(rest, p.end()) for p in places):
                return ""
            return name
    return ""  # the greeting alone: a retailer's or a department's as often ("Dear Currys team, ... your Leeds store")


def addressed_brands(text: str, brands: Iterable[str], decided: dict[str, Any], written: dict[str, Any],
                     holds: Callable[[str, Any], bool]) -> dict[str, str]:
    """The brand fields whose value holds no word of the name `text`'s greeting addresses, with that name, where the
    field's schema holds it, it is no word of another field's value (the customer's) and no company the record names
    as the writer's or a seller (employer.companies)."""
    name = addressed(text)
    if not name or any(name in text[a:b] for a, b in companies(text)):
        return {}  # the writer's own company, or a seller: the employer rules keep it from the brand
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
