"""Where a copied value that may not be null starts (a decision of decisions.Plan, one `Starts` per record).

The model writes a copied field's value in its JSON; its start is usually right, but an e-mail address, a
greeting ("Obrigado") or a tracking number is sometimes what it copies as the customer or the product. The
likeliest span of the record on the field's described line ("<record>\\n\\nFull name of the person who wrote the
ticket:" + " Anna Berg\\n", a beam search over the spans the field allows) is read beside the model's value, both
on that line and in the model's JSON (after the field's opening quote, its closing quote scored); the span
replaces the model's value when the two log-likelihoods summed find it likelier by START_MARGIN. Each reading
alone got it wrong as often as right (the line alone prefers a model name without its brand, a generic noun, an
agent's name); summed, with the margin, the name wins where the model's value was an address or an id. A span
inside the model's value is not a start: where that value ends is read on the same line (decisions.Plan's
`trims`). The figures: docs/extraction.md, "Decisions by scoring".
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from asyncpage.extract.probes import Probe
from asyncpage.extract.readings import LINE_END, logistic, name_words

if TYPE_CHECKING:
    from asyncpage.core.client import EngineClient
    from asyncpage.extract.probes import Scored

# The span replaces the model's value when its log-likelihood on the line plus in the JSON beats the model's
# value's by this much (e^4: 55 times likelier); a nearly as likely span does not.
START_MARGIN = 4.0
# Words of a field's name that say its value is a code ("order_id", "serial_number", "phone", "orderid").
_CODE_NAMES = frozenset("id ids identifier number num no nr code ref reference serial sku phone tel zip postcode iban "
                        "vat ean upc isbn imei vin model tracking invoice version mac plate account".split())
_CODE_END = re.compile(r"(?:id|number|num|code|ref)$")


class Starts:
    """One record's start decisions: `search` (a field's line and its beam, before the value), `wrote` (the
    model's value and its JSON context), `build` (the four readings, once both are there), `outcome`."""

    def __init__(self) -> None:
        self.found: dict[str, Probe] = {}  # field -> the likeliest span on its described line (a beam search)
        self.lines: dict[str, list[int]] = {}  # field -> its described line's context (record + lead)
        self.values: dict[str, tuple[str, list[int]]] = {}  # field -> (the model's value, its JSON context)
        self.pairs: dict[str, dict[str, tuple[Probe, Probe]]] = {}  # field -> {value, span: (line, JSON)}; {}: none
        self.written: dict[str, Any] = {}  # every top-level field -> its value as the model wrote it

    def search(self, name: str, line: list[int], grammar: str) -> Probe:
        self.lines[name], self.found[name] = line, Probe.best(line, grammar)
        return self.found[name]

    def wrote(self, name: str, value: str, in_json: list[int]) -> None:
        self.values[name] = (value, in_json)

    @property
    def waiting(self) -> bool:
        """A field whose value is written and whose readings are not built yet (the record is not done)."""
        return any(n in self.values and n not in self.pairs for n in self.found)

    def build(self, engine: EngineClient, holds: Callable[[str, str], bool]) -> list[Probe]:
        """The readings of each field whose span is found and value written (none where the span is the value,
        inside it, refused by the field's schema (`holds`), or past the context)."""
        out: list[Probe] = []
        for name in [n for n in self.found if n in self.values and n not in self.pairs and self.found[n].done]:
            found = self.found[name].result(engine)
            mine, in_json = self.values[name]
            span = found.text.strip() if found is not None else ""
            self.pairs[name] = {}
            if not span or span in mine or not holds(name, span):
                continue
            pairs = {c: (Probe.text(engine, self.lines[name], f" {c}{LINE_END}"),
                         Probe.text(engine, in_json, json.dumps(c, ensure_ascii=False)[1:])) for c in (mine, span)}
            if max(len(p.prompt) + p.params.max_tokens for pair in pairs.values() for p in pair) \
                    <= engine.config.max_model_len:
                self.pairs[name] = pairs
                out += [p for pair in pairs.values() for p in pair]
        return out

    def probes(self) -> list[Probe]:
        """Every probe it made (their grammars are the record's own: forgotten with it)."""
        return [*self.found.values(), *(p for pairs in self.pairs.values() for pair in pairs.values() for p in pair)]

    def outcome(self, got: Callable[[Probe], Scored | None], decided: dict[str, Any],
                brands: frozenset[str] | set[str] = frozenset(), text: str = "") -> dict[str, tuple[str, float]]:
        """field -> (the span, its share against the model's value) where the span wins by START_MARGIN (by any
        margin where the model's value is another field's, the order id as the product, or a code where the field
        is no code and the span is not: a serial number as the product, a phone number as the name; even up to
        START_MARGIN less likely, in a field asking for a brand (`brands`), where the model's value is a common noun
        and the span a name that is no other field's words: "vacuum" or "tile cutter" where the record names the
        Sweeply V8 or Hirewell Tools, four of 200 spent tickets, against nine of 1,564 labeled products with no name;
        a word capitalized only where a line or a sentence opens, which `text` writes lowercase elsewhere, counts as
        such a noun: `capitalized_by_place`) and is no
        other field's value (as written, as `decided`, or as a start decided here, the larger margin first): the
        line of "the product brand" found the record's order id, and once the person's name, likelier than a long
        product name the model wrote (two fresh tickets). Values compare stripped and casefolded."""
        written = {n: _key(v) for n, v in self.written.items()}
        taken = {n: {written.get(n), _key(decided.get(n))} - {None} for n in {*written, *decided}}
        ranked: list[tuple[float, str, str]] = []
        for name, pairs in self.pairs.items():
            both = {c: (got(pair[0]), got(pair[1])) for c, pair in pairs.items()}
            sums = {c: a.logprob + b.logprob for c, (a, b) in both.items() if a is not None and b is not None}
            if len(sums) == 2:
                mine, span = pairs
                # Another field's as the model wrote it, or as decided where that is no copied value's end (a trim
                # to "Marlisse" does not make the brand "Marlisse" a copy).
                copied = any(_key(mine) == v for n, v in written.items() if n != name) or \
                    any(_key(mine) == _key(v) for n, v in decided.items() if n != name and n not in self.values)
                copied = copied or (coded(mine) and not coded(span) and not names_a_code(name))
                mine_noun, span_noun = (placed_noun(text, mine), placed_noun(text, span)) if name in brands \
                    else (False, False)
                if span_noun and not mine_noun:
                    continue  # a common noun never replaces a name in a brand field ("Smart thermostat", v135)
                # A common noun is no brand: the name its line found replaces it unless the model's own value reads
                # START_MARGIN likelier ("vacuum" read 3.4 nats likelier than the record's "V8" of "the Sweeply V8"),
                # and not with a word of another field's value ("Rukmini" of the customer "Rukmini Rao").
                noun = mine_noun and not span_noun and not _within(span, written, name)
                if (margin := sums[span] - sums[mine]) > (-START_MARGIN if noun else 0.0 if copied else START_MARGIN):
                    ranked.append((margin, name, span))
        out: dict[str, tuple[str, float]] = {}
        for margin, name, span in sorted(ranked, reverse=True):
            if not any(_key(span) in keys for n, keys in taken.items() if n != name):
                out[name] = (span, logistic(margin))
                taken[name] = {_key(span)}
        return out


def _within(span: str, written: dict[str, Any], name: str) -> bool:
    """Whether every word of `span` is a word of another field's value as written."""
    words = set(span.casefold().split())
    return any(words <= set(v.split()) for n, v in written.items() if n != name and isinstance(v, str))


def common(value: str) -> bool:
    """Whether a value is a common noun's phrase, no name: letters, none uppercase, no digit ("vacuum", "tile
    cutter", "e-bike"; not "iPhone", "Sweeply V8", "3-seater")."""
    cased = [ch for ch in value if ch.isalpha() and ch.lower() != ch.upper()]  # no case in CJK, Thai, Arabic: no noun
    return bool(cased) and not any(ch.isupper() or ch.isdigit() for ch in value)


# A line's opening before a word capitalized by its place: quote marks, bullets, a "Subject:", "Re:" or "Fwd:" label.
_LINE_OPENING = re.compile(r"[ \t>*•-]*(?:(?:Subject|Re|RE|Fwd?|FW|Title)[ \t]*:[ \t]*)*")


def capitalized_by_place(text: str, value: str) -> bool:
    """Whether `value` is one word capitalized only by its place in `text` (a line's or a sentence's start) and written
    lowercase elsewhere in it: "Air" of "Subject: Air fryer basket peeling" over "my Crispwell AF-6 air fryer", "Baby"
    of "Baby monitor losing connection" (three fresh tickets, v133 and H121; no label of the 2,752 labeled products
    is such a word: a brand named only where lines open, "Tidepool app crashes", is never written lowercase)."""
    if not re.fullmatch(r"[A-Z][a-z]+", value):
        return False
    word = r"(?<![\w-]){}(?![\w-])"
    found = False
    for m in re.finditer(word.format(value), text):
        at = m.start()  # a line's opening is short, and a sentence's end right before: bounded looks, never the line
        nl = text.rfind("\n", max(0, at - 40), at)
        opens_line = (nl >= 0 or at <= 40) and _LINE_OPENING.fullmatch(text, nl + 1, at) is not None
        near = text[max(0, at - 8):at]
        kept = near.rstrip(" \t")
        if not (opens_line or (kept != near and kept.endswith((".", "!", "?")))):  # not "Brand: Ring"
            return False
        found = True
    return found and re.search(word.format(value.lower()), text) is not None


def placed_noun(text: str, value: str) -> bool:
    """Whether `value` is a common noun's phrase (`common`), or one whose first word is capitalized only by its place
    and the rest lowercase ("Blender jug" of "Subject: Blender jug cracked on arrival" over "my Kestrava BL-900
    blender", "Smart thermostat"; v135)."""
    first, _, rest = value.partition(" ")
    return common(value) or (capitalized_by_place(text, first) and (not rest or common(rest)))


def coded(value: str) -> bool:
    """Whether a value is shaped as a code or a number: a digit in it, and no part (between spaces, hyphens and
    other marks) that is a word: letters only, three or more, or any outside ASCII ("KP3-77A-01942", "SN
    QMT6-22-0841907", "+34 611 29 40 87"; not "7-Eleven", "Model-3", "华为 P60", "Li Na", "LG")."""
    if not any(ch.isdigit() for ch in value):
        return False
    for part in re.split(r"[^\w\u0300-\u036f\u0900-\u0dff]+|_", value):
        if part and all(unicodedata.category(ch)[0] in "LM" for ch in part) and (len(part) >= 3 or not part.isascii()):
            return False
    return True


def names_a_code(field: str) -> bool:
    """Whether a field's name says its value is a code ("order_id", "serialNumber", "phone", "orderid")."""
    return any(w in _CODE_NAMES or (len(w) > 5 and _CODE_END.search(w)) for w in name_words(field))


def _key(value: Any) -> Any:
    """A value as compared with another field's: a string stripped and casefolded, else None (numbers, lists and
    objects are not spans)."""
    return " ".join(value.split()).casefold() if isinstance(value, str) else None
