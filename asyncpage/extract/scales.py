"""Ordinal scales among a closed choice's options (severity, priority, urgency), and the words a record states a
level in.

A record seldom names its severity by an option ("this is critical"); it says "no rush", "a serious problem",
"this is an emergency". The default model maps few of those onto the options: on the 309 spent tickets of
tests/data that state a severity, the label-line reading with the named options put 204 right (66%), and read
sentence by sentence it did no better; nearly every miss was such a phrase read as "medium". So where a field's
string options are all levels of a scale (RANKS: "low", "medium", "high", "critical"; "minor", "major",
"blocker"; "normal", "urgent"...), a record that states a level in common words (WORDS) names the option of
that level, as an option named by its own word does (closed.named, mixed at closed.NAMED_WEIGHT): one level
stated wins, several are the model's choice among them. Only for a field whose name says it is a level
("severity", "priority", "urgency", "impact"). A level's words name the option nearest it on the
field's scale, none where two are as near ("moderate" on a low/high scale); a word that is itself an option
names that option alone ("urgent" on low/normal/high/urgent). Words denied in their clause ("not urgent",
"nothing serious") name nothing, and some are the lower level's own words. `score_choices=False` turns it off
with the rest of the scoring. Figures: docs/extraction.md, "Decisions by scoring".
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from asyncpage.extract.closed import named as own_words
from asyncpage.extract.closed import namings, phrasing

# An option's rank on a four-level scale (0 lowest, 3 highest); an option of several words is ranked by its first
# ("high_priority", "Low severity").
RANKS: dict[str, float] = {
    "trivial": 0, "lowest": 0, "low": 0, "minor": 0, "cosmetic": 0,
    "medium": 1, "moderate": 1, "normal": 1, "mid": 1, "average": 1,
    "high": 2, "major": 2, "serious": 2, "important": 2,
    "urgent": 2.5, "severe": 2.5,
    "critical": 3, "highest": 3, "blocker": 3, "emergency": 3, "catastrophic": 3,
}
# How a writer states each level in words, from the ordinary language of support messages and bug reports: the
# level itself ("a serious problem"), how soon it must be dealt with ("no rush", "it can't wait"), what it does to
# the writer ("a nuisance", "we are at a standstill") and, at the top, harm to people or property.
WORDS: dict[int, tuple[str, ...]] = {
    0: ("minor", "trivial", "cosmetic", "not urgent", "not serious", "nothing serious",
        "not pressing", "not a big deal", "no big deal", "no rush", "no hurry", "in no hurry", "small issue",
        "small problem", "small thing", "whenever you get a chance", "whenever you can", "when you get a chance",
        "when you have time", "low priority", "no biggie", "not a huge deal", "not a big issue", "not a big problem",
        "nothing major", "little consequence", "not a priority", "no urgency", "not time-sensitive", "it can wait",
        "barely noticeable", "hardly noticeable", "just a heads up", "whenever it suits you", "whenever suits you",
        "at your convenience", "in your own time", "not holding us up", "isn't holding us up",
        "not an emergency at all", "minor annoyance", "minor nuisance", "minor inconvenience", "slight inconvenience",
        "small inconvenience", "slightly annoying", "a little annoying", "not very urgent", "not really urgent",
        "not too urgent", "not so urgent", "not that urgent", "not terribly urgent", "not super urgent",
        "nothing urgent", "not very serious", "not too serious", "not that serious", "not really serious",
        "not the end of the world", "isn't very urgent", "isn't really urgent", "isn't very serious",
        "isn't really serious", "isn't that serious", "isn't the end of the world"),
    1: ("moderate", "moderately", "medium priority", "normal priority", "nuisance", "annoying", "irritating",
        "a hassle", "a real hassle", "a headache", "a bit of a headache", "inconvenient", "an inconvenience",
        "on my nerves", "fairly soon", "reasonably soon", "sooner rather than later", "somewhat urgent",
        "fairly urgent", "fairly time-sensitive", "within a week", "within the next week", "in the next week",
        "within two weeks", "next week or two", "within the next couple of weeks", "not desperately urgent",
        "can work around it", "slowing me down",
        "not an emergency"),  # said of what is no trifle either: writers mean the middle
    2: ("urgent", "urgently", "serious", "seriously affected", "major issue", "major problem", "asap",
        "high priority", "top priority", "big problem", "huge problem", "really big deal", "as a priority",
        "matter of priority", "this can't wait", "it can't wait", "really can't wait", "real urgency",
        "against the clock", "pretty pressing", "quite pressing", "very pressing", "really pressing",
        "seriously hurting", "extremely frustrated", "unusable", "badly affected", "getting desperate",
        "need it fixed today", "need it today", "need someone today", "genuinely worrying"),
    3: ("emergency", "dangerous", "danger", "hazardous", "unsafe", "safety hazard", "safety issue", "safety concern",
        "safety risk", "safety problem", "fire risk", "fire hazard", "life-threatening", "catastrophic",
        "critical", "extremely serious", "very serious", "extremely urgent", "a disaster", "a complete disaster",
        "a total disaster", "an emergency", "as bad as it gets", "as serious as it gets", "as urgent as it gets",
        "badly hurt", "seriously hurt", "get hurt", "injured", "injury", "caught fire", "start a fire",
        "burn the house", "burned down", "burning smell",
        "smell of burning", "smells of burning", "smelled burning", "gas smell",
        "smell of gas", "gas leak",
        "electric shock", "exploded", "complete standstill", "at a standstill", "immediate attention"),
}
# The top level's words that, denied, state the middle one ("not a disaster", "rather than an emergency"); a
# lower level's denied ("more irritating than serious") or harm denied ("nobody was hurt") state none.
_DENIABLE = frozenset(("an emergency", "a disaster"))
# The phrases, longest first: "very serious" is read before "serious", which it then hides.
_LONGEST_FIRST = sorted(((lv, w) for lv, ws in WORDS.items() for w in ws), key=lambda p: -len(p[1].split()))
# A field whose name says it is a level (its scale words are read only there: "Urgent: a budget laptop" is no
# "high" budget).
_LEVEL_FIELD = re.compile(r"sever|priorit|urgen|importan|impact|critical|seriousness|level|triage|escalat",
                          re.IGNORECASE)
_SUFFIX = re.compile(r"^(.+?)[\s_-]+(?:priority|severity|urgency|impact|level)$", re.IGNORECASE)


# Level words that also measure things ("too high", "low heat", "the high-voltage fault", "medium size"): named as a
# level only where some place is not such a measure's (measured). On the labeled tickets through v120, 21 tickets
# write such a word only so; for the 13 of them with a stated severity the options named move towards the label in
# 12 (a "too high" reading beside "This is critical", "Priority: High" beside "the low setting"), away in one ("a
# medium-size headache").
_MEASURES_TOO = frozenset(("low", "medium", "high"))
_MEASURED = (r"(?:heat|temperatures?|temp|pressure|speeds?|settings?|battery|volume|quality|end|resolution|"
             r"beam|gear|fat|res|voltage|power|flow|mode|tide|school|street|season|waist|rise|top|frequency|"
             r"pitch|pitched|density|definition|performance|output|light|noise|humidity|shelf|chair|gloss|"
             r"grade|rates?|prices?|bill|costs?|roast|sized?|rare|well|firmness|firm|flame|cycle|spin|load|"
             r"profile|range|readings?)")
_NOUN_AFTER = re.compile(rf"[- ]{_MEASURED}\b", re.IGNORECASE)  # "low heat", "high-voltage"
_NOUN_BEFORE = re.compile(rf"\b{_MEASURED}\s+(?:is\s+|was\s+)?(?:too\s+|very\s+|on\s+|at\s+)?$", re.IGNORECASE)
_LEVEL_NOUN = re.compile(r"[\s-]+(?:priority|severity|urgency|importance|impact|level|problem|issue|prio)\b",
                         re.IGNORECASE)
_LEVEL_BEFORE = re.compile(r"\b(?:priority|severity|urgency|importance|impact|prio)\b[ \t]*(?:[:=\-–—][ \t]*|(?:is|was)"
                           r"[ \t]+)(?:(?:very|extremely|quite|so|really|super|fairly|pretty)[ \t]+)?$", re.IGNORECASE)
# "medium" as a garment's size: "the medium is far too big", "size medium"; not "I'd rate it a medium", "put it in
# medium" (a level stated).
_SIZE_BEFORE = re.compile(r"\b(?:the|size)\s+$", re.IGNORECASE)
_SIZE_AFTER = re.compile(r"\s*(?:[,.;:!?)]|(?:is|was|fits?|size|one|instead|in|and|or|but)\b|$)", re.IGNORECASE)
_INTENSIFIED = re.compile(r"\b(?:too|so|very|extremely|abnormally|unusually|quite)\s+$", re.IGNORECASE)


def measured(word: str, text: str) -> bool:
    """Whether every place `text` writes `word` measures something: after "too", "very", "so" ... ("reads too high"),
    before a measured noun ("low heat", "high-voltage"), or after one ("chamber pressure low"), or a size ("the medium
    is too big"); never before a level's
    noun ("so high priority", "a medium problem") nor after one on its line ("Priority: Very High", "the urgency is
    extremely high"). False where `text` never writes it."""
    places = list(re.finditer(rf"(?<![\w-]){re.escape(word)}(?![\w])", text, re.IGNORECASE))
    for m in places:
        before, after = text[max(0, m.start() - 24) : m.start()], text[m.end() : m.end() + 24]
        noun_after = _NOUN_AFTER.match(after)
        if _LEVEL_NOUN.match(after) or (_LEVEL_BEFORE.search(before) and not noun_after):
            return False
        size = word.lower() == "medium" and _SIZE_BEFORE.search(before) and _SIZE_AFTER.match(after)
        if not (_INTENSIFIED.search(before) or noun_after or _NOUN_BEFORE.search(before) or size):
            return False
    return bool(places)


def ranks(options: Sequence[Any]) -> list[float | None] | None:
    """Each option's rank when the field's string options are all levels of a scale (two at least, no two of
    one rank), else None; null and other non-strings rank None."""
    found: list[float | None] = []
    for o in options:
        if not isinstance(o, str):
            found.append(None)
            continue
        word = " ".join(o.split())
        word = (m.group(1) if (m := _SUFFIX.match(word)) else word).lower()
        if word not in RANKS:
            return None
        found.append(RANKS[word])
    levels = [r for r in found if r is not None]
    return found if len(levels) >= 2 and len(set(levels)) == len(levels) else None


def named(options: Sequence[Any], text: str, field: str | None = None) -> list[bool] | None:
    """Which options `text` names: by their own words (closed.named), or, on a scale of a field whose name says it
    is a level (`field`: "severity", "priority", "urgency"; None: any), by the words of the level nearest each
    (WORDS). None where an option cannot be named at all (closed.named)."""
    hits = own_words(options, text)
    scale = ranks(options)
    if hits is None or scale is None or (field is not None and not _LEVEL_FIELD.search(field)):
        return hits
    for i, o in enumerate(options):
        if hits[i] and isinstance(o, str) and o.strip().lower() in _MEASURES_TOO and measured(o.strip(), text):
            hits[i] = False  # "reads 5 degrees too high", "the high-temperature alarm": no level stated
    own = {" ".join(o.split()).lower() for o in options if isinstance(o, str)}
    said = text
    for level, phrase in _LONGEST_FIRST:
        pattern = phrasing(phrase)
        if phrase in own or pattern is None or not pattern.search(said):
            continue
        stated, denied = namings(phrase, text)  # read where it still stands, its denial in the whole text
        at = level if stated else level - 2 if denied and phrase in _DENIABLE else -1
        near = [abs(r - at) if r is not None else 99.0 for r in scale]
        best = min(near)
        if at >= 0 and best <= 1 and near.count(best) == 1:  # an option of this level, one nearest
            hits[near.index(best)] = True
        said = pattern.sub(lambda m: " " * len(m.group()), said)  # a longer phrase hides the words inside it
    return hits
