"""Where a record names a nullable copied field: the stretches a search for its span reads (`near`, `near_grammar`).

An order's id is read among the ids the record labels as the order's where it labels any (`_labeled_windows`), else
in the stretches after the words that name it, cut at the customer's purchase order beside the seller's order
(labels.customers_po). How much more a span must score from where it stands: labels.doubt.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

from asyncpage.extract import grounding
from asyncpage.extract.closed import is_denied
from asyncpage.extract.labels import (
    _ANOTHER,
    _BRACKETED,
    _PO,
    _PO_LABEL,
    _SELF_ORDER,
    _VALUE,
    MAX_IDS,
    MAX_NEAR,
    NEAR,
    TAIL,
    _ids,
    _naming,
    customers_po,
    labeled_id,
    numbered,
)
from asyncpage.extract.readings import LINE_END


def near(text: str, words: Sequence[str], field: str = "") -> list[str]:
    """The stretches of `text` right where it names a field: from each of `words` (for an order's id, a booking's or
    a reservation's word too) as a whole word or its plural ("order", "Orders", not "ordered"), not denied there ("I
    have no order number"), to NEAR characters past it and the rest of the word there ("order number: CF-00931-FR",
    at most TAIL more characters), from the start of the word holding the naming ("PO-ORDER-55123", at most TAIL
    characters back); cut, once it has held a word with a digit, at the line's end or another kind's label
    (_ANOTHER: "order HVN-3381045, model HK-17P" reads "order HVN-3381045, "). For an order's id, also what stands
    alone in brackets after the ordered thing's phrase ("I ordered a Zipvolt Urban X scooter (#55019)": "#55019"). An
    order's stretches are cut at the customer's purchase order beside the seller's order (`customers_po`); where the
    record labels an order's id, only those ids are read (`_labeled_windows`). Overlapping ones merged, at most
    MAX_NEAR, in the text's order. [] where none."""
    if not words:
        return []
    orders, own = _naming(words)
    if orders and (windows := _labeled_windows(text, tuple(words), field)):
        return [text[a:b] for a, b in windows]
    pattern = re.compile(r"\b(?:" + own + r")s?\b", re.IGNORECASE)
    found: list[tuple[int, int]] = []
    for m in pattern.finditer(text):
        if is_denied(text, m.start(), m.end()):
            continue
        start, end = m.start(), min(len(text), m.end() + NEAR)
        while start > max(0, m.start() - TAIL) and not text[start - 1].isspace():  # at most TAIL back: no run of
            start -= 1  # text without a space read again from each naming in it
        stop = min(len(text), end + TAIL)
        while end < stop and not text[end].isspace():
            end += 1
        if (value := _VALUE.search(text, m.end(), end)) and (cut := _ANOTHER.search(text, value.end(), end)):
            end = cut.start()
        found.append((start, end))
    if orders:
        found += [m.span("id") for m in _BRACKETED.finditer(text) if not is_denied(text, *m.span("verb"))]
    spans: list[list[int]] = []
    for start, end in sorted(found):
        if spans and start <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        elif len(spans) < MAX_NEAR:
            spans.append([start, end])
    pos = _customer_pos(text, tuple(words), field) if orders else ()
    if not pos:
        return [text[a:b] for a, b in sorted(spans)]
    return [part for a, b in sorted(spans) for part in _cut(text, a, b, pos)][:MAX_NEAR]


@functools.lru_cache(maxsize=8)
def _customer_pos(text: str, words: tuple[str, ...], field: str) -> tuple[str, ...]:
    """The ids `customers_po` reads as the customer's purchase order beside the seller's (of the first MAX_IDS
    id-shaped words)."""
    return tuple(m[0] for m in _ids(text)[:MAX_IDS] if customers_po(text, m[0], words, field))


def _cut(text: str, a: int, b: int, ids: Sequence[str]) -> list[str]:
    """text[a:b] with each whole-word place of `ids` cut out: what is left, blank parts dropped."""
    cut = re.compile(r"(?<![\w#/-])(?:" + "|".join(map(re.escape, ids)) + r")(?![\w/#-])")
    return [p for p in cut.split(text[a:b]) if p.strip()]


_PO_HEAD = re.compile(r"(?:(?<![\w.])" + _PO + r"[ \t]*#?|#)[ \t]*\Z")  # what a window opens with before its id
# The groups that may close an id: two or more capitals and digits, one a digit ("AUR 5519 0087", "A1B2-C3D4 E5F6").
_GROUPS = re.compile(r"(?:[ \t](?=[A-Z0-9]*\d)[A-Z0-9]{2,}(?![\w/#-])){0,3}")


def _by_po(text: str, m: re.Match[str]) -> bool:
    """Whether a purchase order's label labels the id at `m` ("PO 90357", "PO# 4471", "PO-4471982")."""
    return m[0].startswith("PO") or _PO_LABEL.search(text, max(0, m.start() - 32), m.start()) is not None or \
        re.search(r"(?<![\w.])" + _PO + r"[^\n]{0,12}\Z", text[max(0, m.start() - 16) : m.start()]) is not None


@functools.lru_cache(maxsize=8)
def _labeled_windows(text: str, words: tuple[str, ...], field: str) -> list[tuple[int, int]]:
    """Where the record labels an order's id (labeled_id; no customer's purchase order beside the seller's): each id's
    first place, with the label's first group, a "#" or a "PO" before it and the groups of capitals and digits after it
    ("order AUR 5519 0087" gives "AUR 5519 0087"), where the record holds at most MAX_IDS id-shaped words; not a work
    order's, a return's or an earlier order's (the label read without them, labels._PURCHASE, or a PO's). In the
    labeled sets (2,068 tickets with an order-id label, v2-v104) 1,338 label one so, and in each the answer is one of
    these: where one is, near reads only them."""
    out: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], [])  # labeled by a word, naming themselves
    ids = _ids(text)
    for m in ids if len(ids) <= MAX_IDS else ():  # more ids than read: a label past them would be missed
        if (value := labeled_id(text, m[0], words)) and m[0] not in _customer_pos(text, words, field) and (
                labeled_id(text, m[0], words, po=False) or _by_po(text, m)):  # no work order's, no earlier one's
            head = value[: len(value) - len(m[0])]
            start = m.start() - len(head) if head and text.endswith(head, 0, m.start()) else m.start()
            if (po := _PO_HEAD.search(text, max(0, start - 8), start)) is not None:
                start = po.start()  # "#DST-60233", "PO 90357", "PO#4471": as records and labels write them
            groups = _GROUPS.match(text, m.end())
            out[bool(_SELF_ORDER.fullmatch(m[0]))].append((start, groups.end() if groups else m.end()))
    return sorted((out[0] + out[1])[:MAX_NEAR])  # the ids naming themselves after those a word labels


def near_grammar(text: str, sources: Sequence[str], words: Sequence[str], field: str,
                 branch: dict[str, Any]) -> str | None:
    """The line grammar (grounding.line_grammar) of a nullable copied field's spans where `text` names it (`near`),
    holding a digit where its name says so (`numbered`: an id's likeliest span may be words), over all `sources`
    for an id the text never names. None: no such search (nothing names it, or no such span)."""
    digit = numbered(field) and not branch.get("pattern")
    spans = near(text, words, field) or (list(sources) if digit else [])
    return grounding.line_grammar(branch, spans, " ", LINE_END, digit=digit) if spans else None
