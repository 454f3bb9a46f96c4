"""Where a copied value that may not be null ends (a decision of decisions.Plan): the value the model wrote, its
word prefixes and its widened forms (widened: "Juniperra Flame 6" beside the model's "Flame 6"), each read
on the field's described line after the record (" Marlow Duo\\n"), the likeliest kept. No opening article, never a
lone "my", none the field's schema refuses. The figures: docs/extraction.md, "Decisions by scoring"."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from asyncpage.extract import grounding
from asyncpage.extract.employer import without_employer
from asyncpage.extract.probes import Probe
from asyncpage.extract.readings import LINE_END, described, name_words
from asyncpage.extract.starts import names_a_code

if TYPE_CHECKING:
    from asyncpage.core.client import EngineClient
    from asyncpage.extract.probes import Scored


# Words of a field's name or its described line that say its value is a brand: a proper name, never the noun
# phrase around it ("the product brand the ticket is about").
BRAND = frozenset("brand brands make manufacturer maker vendor".split())
# ...that say its value is the record's writer.
WRITER = frozenset("customer sender author requester reporter writer submitter complainant".split())
_WROTE = re.compile(r"\b(?:who|that)\s+(?:wrote|writes|sent|sends|submitted|filed|raised|opened)\b", re.I)

_MAX_WIDER = 3  # capitalized words a copied value is widened by at most (widened)


def word_prefixes(value: str) -> list[str]:
    """A value's word prefixes, itself last ("Flame", "Flame 6"); one that a comma, a semicolon, a colon or an
    opening bracket closes is read without it ("Rain Jacket" in "Rain Jacket, women's M" and "Rain Jacket (M)")."""
    cut = [value[:m.start()] for m in re.finditer(r"\s+", value)]
    return list(dict.fromkeys([p.rstrip(",;:([") or p for p in cut] + [value]))


def widened(text: str, value: str) -> list[str]:
    """`value` with the capitalized words that open its name in `text` right before it, on its line, after a
    lowercase word: the model wrote "Flame 6" where the record says "the Juniperra Flame 6 hob", and "Juniperra
    Flame 6" is read beside it. None after a line's or a sentence's start, a greeting or a heading ("Hi Flame 6",
    "Subject: Flame 6"): the word before the capitalized ones must be a lowercase word or a determiner ("My")."""
    if not value[:1].isupper():
        return []
    out: dict[str, None] = {}
    for m in re.finditer(re.escape(value) + r"(?![\w-])", text):
        if opening := _opening(text, m.start(), _cap_word):
            out[opening + " " + value] = None
    return list(out)


def _cap_word(word: str) -> bool:
    return bool(re.fullmatch(r"[^\W\d_][\w'’-]*", word)) and word[0].isupper() \
        and word.lower() not in grounding.DETERMINERS


def _opening(text: str, start: int, word_ok: Callable[[str], bool], after: frozenset[str] = frozenset(),
             quantity: bool = False) -> str:
    """The words (at most _MAX_WIDER, each `word_ok`) right before `start` on its line, a space or a tab between them
    and it, after a lowercase word of letters not in `after`, a determiner or, with `quantity`, a number of at most
    three digits ("12 Corvelle ErgoSeat 300 chairs"; not an id's "Order 4471 Amazon"): "" where there are none so."""
    words = re.split(r"[ \t]+", text[max(0, start - 200):start].rsplit("\n", 1)[-1])
    if len(words) < 2 or words[-1] != "":
        return ""  # not after a space
    words.pop()
    caps = 0
    while caps < min(_MAX_WIDER, len(words) - 1) and word_ok(words[-1 - caps]):
        caps += 1
    anchor = words[-1 - caps]
    after_word = anchor.isalpha() and (anchor.islower() or anchor.lower() in grounding.DETERMINERS)
    counted = quantity and anchor.isdigit() and len(anchor) <= 3
    if caps and (counted or (after_word and anchor not in after)):
        return " ".join(words[len(words) - caps:])
    return ""


# A common noun closing a name's phrase: a lowercase word ("sofa", "e-bike", "desk lamp") or a measure-led one
# ("3-seater", "3-door"); a bracket ("(Queen size)") and a comma's tail ("sofa, grey") go first.
_POSSESSIVES = frozenset("my our your his her their".split())
_COMMON = re.compile(r"[a-z][a-z'’]*(?:-[a-z]+)*|\d+-[a-z]+(?:-[a-z]+)*")
_TAIL = re.compile(r"(?:\s*\([^()]*\)|,[^,]*)$")


def names_a_brand(field: str, line: str = "") -> bool:
    """Whether a field's name or its described line (`line`) says its value is a brand (`BRAND`)."""
    return bool(BRAND.intersection(_words(field, line)))


def _words(field: str, line: str) -> set[str]:
    """The words of a field's name and of its described line, lowercase."""
    return {*name_words(field), *re.findall(r"[a-z]+", line.lower())}


def named_copies(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` (marked by grounding.mark) with `x-copy-name` on each top-level copied property that asks for a
    brand (names_a_brand on its name and its described line: its spans hold no code-shaped word, grounding.NAMED),
    and `x-copy-writer` on each that asks for the record's writer (names_the_writer: its spans leave the support
    staff's names out, grounding.WRITER). `schema` itself is untouched."""
    props = grounding.resolve(schema, schema).get("properties") or {}
    changed = {}
    for name, prop in props.items():
        p = grounding.resolve(schema, prop)
        if not (isinstance(p, dict) and p.get(grounding.COPY) is True):
            continue
        line = described(name, p)
        # A brand alone: not a code's field ("the order number the vendor assigned"), nor one asking for the model too
        # ("make and model of the car": "Peugeot 308").
        words = _words(name, line)
        brand = bool(BRAND & words) and not names_a_code(name) and "model" not in words
        flags = {grounding.NAMED: True} if brand else {}
        if names_the_writer(name, line):
            flags[grounding.WRITER] = True
        if flags:
            changed[name] = {**p, **flags}
    return grounding.with_properties(schema, changed) if changed else schema


def names_the_writer(field: str, line: str = "") -> bool:
    """Whether a field's name or its described line says its value is who wrote the record ("customer", "sender",
    "the person who wrote the ticket")."""
    return bool(WRITER.intersection(name_words(field))) or bool(_WROTE.search(line))


# Capitalized words that open no brand's name: days, months, titles, what a record capitalizes for emphasis ("my
# New Velora"), and the prepositions after which a capitalized word is a place or a shop ("bought at Harrow Dekko").
_NOT_NAME = frozenset("monday tuesday wednesday thursday friday saturday sunday january february march april may june "
                      "july august september october november december today yesterday tomorrow mr mrs ms mx dr prof "
                      "sir madam new brand jan feb mar apr jun jul aug sep sept oct nov dec mon tue tues wed thu thur "
                      "thurs fri sat sun".split())
_PLACES = frozenset("in at from to on via by for of into onto near since until after before during with".split())
_NAME_WORD = re.compile(r"[^\W\d_]+(?:[-'’][^\W\d_]+)*")  # letters, hyphens or apostrophes between them
_MOST_WORDS = 6  # a brand's span holds at most six words (grounding.NAMED)


def opened(text: str, value: str, sources: Sequence[str]) -> str:
    """A brand the model copied from inside a name ("V5" of "my Ventura V5", "Duo 2" of "my Corvani Duo 2 pram", "T10"
    of "our Payloop T10 card terminal ... affecting T10 terminals") with the capitalized words that open that name
    right before it on its line, at the first place the record writes it after such words, these after a determiner,
    a lowercase word ("my", "new"; not a preposition: "in Lisbon Velora", "from Amazon Velora") or a quantity ("12
    Corvelle ErgoSeat 300"), where the wider span is one of whole words the field's `sources` hold and no place writes
    the value alone before a model's word (a name word or one with a digit: "my Velora X5 ... the Manchester Velora
    store" keeps "Velora"); `value` itself otherwise. Such a word is of letters (no ALL-CAPS shout, no possessive
    "Harrow's", no day, month or title: _NOT_NAME), at most _MAX_WIDER of them. Until 2026-12-05 every place had to be
    so (a model name also written alone stayed alone): on the labeled tickets through v78, each accepted product's word
    prefixes and suffixes taken as the model's value, the first place gives an accepted answer 575 times more and a
    refused one never."""
    first = ""
    for m in re.finditer(r"(?<![\w-])" + re.escape(value) + r"(?![\w-])", text):
        if opening := _opening(text, m.start(), _name_word, _PLACES, quantity=True):
            first = first or opening + " " + value
        elif _opens_own_name(text, m.end()):
            return value  # "my Velora X5 ... the Manchester Velora store": alone before a model's word, itself a brand
    whole = re.compile(r"(?<![\w-])" + re.escape(first) + r"(?![\w-])") if first else None
    return first if whole is not None and len(first.split()) <= _MOST_WORDS and any(
        whole.search(s) for s in sources) else value


def _opens_own_name(text: str, end: int) -> bool:
    """Whether the word right after `end` (a space or a tab between) is a model's: a name word or one with a digit."""
    nxt = re.match(r"[ \t]+(\S+)", text[end:end + 200])
    word = nxt.group(1).rstrip(".,;:!?") if nxt else ""
    return bool(word) and (any(ch.isdigit() for ch in word) or _name_word(word))


def _name_word(word: str) -> bool:
    return bool(_NAME_WORD.fullmatch(word)) and word[0].isupper() and not (len(word) > 1 and word.isupper()) \
        and word.lower() not in grounding.DETERMINERS | _NOT_NAME and not word.endswith(("'s", "’s"))


def opened_brands(text: str, sources: Sequence[str], brands: set[str], decided: dict[str, Any],
                  written: dict[str, Any], holds: Callable[[str, Any], bool]) -> dict[str, str]:
    """The brand fields whose value (as decided, else as the model wrote it) opens wider (`opened`), with it, where
    the field's schema holds the wider one and it holds no other field's value ("my son Tom Kestrel bike" with the
    customer "Tom Kestrel")."""
    out: dict[str, str] = {}
    brand_sources: list[str] | None = None  # read once, for the first brand field that needs them
    for name in brands:
        value = decided.get(name, written.get(name))
        if not isinstance(value, str) or not value:
            continue
        if brand_sources is None:
            brand_sources = without_employer(sources)
        if (wide := opened(text, value, brand_sources)) == value:
            continue
        others = {v.casefold() for d in (decided, written) for n, v in d.items() if n != name and isinstance(v, str)}
        if holds(name, wide) and not any(o and o in wide.casefold() for o in others):
            out[name] = wide
    return out


def name_of(phrase: str) -> str:
    """A brand's name without the common nouns that close its phrase ("Havenbrook Mira" of "Havenbrook Mira 3-seater
    sofa", "Sleepmoor Cloud Hybrid" of "Sleepmoor Cloud Hybrid mattress (Queen size)"); the phrase itself where
    nothing closes it or nothing named is left ("baby monitor"). A lowercase word of a model's name goes too ("Pixel 8
    pro" gives "Pixel 8"): only for a field that asks for a brand."""
    rest = phrase
    while (cut := _TAIL.sub("", rest)) != rest and cut.strip():
        rest = cut
    words = rest.split()
    end = len(words)
    while end > 0 and _COMMON.fullmatch(words[end - 1]):
        end -= 1
    name = " ".join(words[:end])
    return name if name and any(ch.isupper() or ch.isdigit() for ch in name) else phrase


def after_nouns(phrase: str) -> str:
    """A brand's phrase from its first named word on, the common nouns and counts that open it left off ("Velosta
    City E5" of "e-bike Velosta City E5", "Novaro X5" of "18 of 40 Novaro X5"), and a possessive that opens a
    sentence ("My Cloudnest Home Backup 2TB"); the phrase itself where none opens it or nothing named follows. Read
    as one more candidate, never applied unread: "eero Pro 6" opens with its brand, "Our Place" with its "Our"."""
    words = phrase.split()
    i = 1 if words and words[0].lower() in _POSSESSIVES else 0  # "My Cloudnest Home Backup 2TB": read without it
    while i < len(words) and (_COMMON.fullmatch(words[i]) or words[i].isdigit()):
        i += 1
    return " ".join(words[i:]) if 0 < i < len(words) and any(ch.isupper() for ch in words[i]) else phrase


def candidates(text: str, wrote: str, holds: Callable[[str], bool], named: bool = False) -> list[str]:
    """The ends read for a value the model wrote in `text`'s field: [] where there is nothing but its own. `named`: the
    field asks for a brand (`names_a_brand`), so an end that runs on past its name into common nouns is not read where
    its name alone is ("Havenbrook Mira", not "Havenbrook Mira 3-seater sofa": on 80 spent tickets the line's reading
    kept the whole phrase for six products a name ends)."""
    value = wrote
    while (head := value.split(maxsplit=1))[0].lower() in grounding.ARTICLES and len(head) > 1:
        value = head[1]  # "The Glossvane Sleek 3 straightener": a name opens after its article
    heads = (value, *((after_nouns(value),) if named else ()), *widened(text, value))
    cands = list(dict.fromkeys(c for v in heads for c in word_prefixes(v)))  # "Flame 6", "Juniperra Flame 6"
    cands = [c for c in cands if any(ch.isalnum() for ch in c) and c.lower() not in grounding.DETERMINERS and holds(c)]
    if named:
        cands = [c for c in cands if name_of(c) == c or name_of(c) not in cands]
    return [] if not cands or cands == [wrote] else cands


async def probes(engine: EngineClient, text: str, lead: str, cands: list[str]) -> dict[str, Probe] | None:
    """Each candidate's probe on the line `lead` after `text` (None: the longest does not fit the model)."""
    ctx = await engine.tokenize(text + lead)
    found = {c: Probe.text(engine, ctx, f" {c}{LINE_END}") for c in cands}
    longest = max(len(p.prompt) + p.params.max_tokens for p in found.values())
    return found if longest <= engine.config.max_model_len else None


def outcome(found: dict[str, Probe], got: Callable[[Probe], Scored | None]) -> tuple[str, float] | None:
    """The likeliest end and its softmax share among the candidates (None: a probe did not run)."""
    read = {c: s.logprob for c, p in found.items() if (s := got(p)) is not None}
    if len(read) != len(found):
        return None
    end = max(read, key=lambda c: read[c])
    return end, 1 / sum(math.exp(v - read[end]) for v in read.values())
