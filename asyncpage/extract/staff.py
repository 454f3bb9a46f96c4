"""Who in a record speaks for the seller: the support staff's names, which a field asking for the record's writer
(the customer who wrote a ticket) must not copy.

A support conversation names its agents beside the customer: a chat's speaker labels ("Hannah Brooks (Support):",
"Agent Priya:"), a quoted reply's header ("Emily Carter (Vantiq Support) wrote:"), a signature ("Tom, Acme
Support"). A small model copied such a name as the customer (three of forty fresh tickets, v43-v46). `staff_names`
finds the names a record marks as staff by one of three shapes, each a role word beside a capitalized name:

- the name, then a role in brackets: "Hannah Brooks (Support)", "Emily Carter (Vantiq Support)", "Li (agent)";
- a role, then the name as a speaker or in a sentence: "Agent Priya:", "Agent (Priya):", "representative Marco";
- the name, then a team: "Tom, Acme Support", "Ana from the Customer Care team".

`without_staff` cuts every occurrence of those names out of the texts, leaving the rest as separate texts: what a
writer field's spans come from (grounding.WRITER), so a span never holds or crosses a staff name.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_CAP = r"[A-ZÀ-ÖØ-Þ][\w'’-]*"
_NAME = rf"{_CAP}(?:[ \t]+{_CAP}){{0,3}}"
# Seller-side roles only: "admin", "operator", "team" or "staff" may be the customer's own ("Maria (IT admin)").
_ROLE = (r"support|agent|customer care|customer service|help ?desk|representative|rep|advisor|adviser|specialist|"
         r"moderator|concierge|csr")
# The name, then a bracket holding a role word, not the customer's IT ("Maria (IT support, Foo Ltd)").
_BRACKET = re.compile(rf"({_NAME})[ \t]*\((?![^()\n]*\bIT\b)(?:[^()\n]*\b)?(?i:{_ROLE})\b[^()\n]*\)")
# A role word (not a team: "Support" alone opens sentences), then the name: a speaker label, or in a sentence.
_BEFORE = re.compile(rf"\b(?i:agent|support agent|representative|rep|advisor|adviser|specialist|technician|operator|"
                     rf"moderator|concierge)[ \t]*\(?({_NAME})\)?")
# The name, then (after a comma, a dash, a bar, "from" or "at") a team: "Acme Support", "the Customer Care team".
_TEAM = re.compile(rf"({_NAME})[ \t]*(?:,|-|–|—|\||\bfrom\b|\bat\b)[ \t]*(?:(?i:the)[ \t]+)?(?:{_CAP}[ \t]+){{0,3}}"
                   r"(?i:support|customer care|customer service|help ?desk|care team|service team)\b")
# Capitalized words that open a sentence or a label rather than a name ("Thanks Priya", "Hi Hannah").
_NOT_NAMES = frozenset("hi hello hey dear thanks thank cheers regards best kind from agent support customer visitor "
                       "team the a an i my our your this that chat live".split())


def staff_names(text: str) -> list[str]:
    """The names `text` marks as its support staff's, longest first (each as written, greetings left off)."""
    found: set[str] = set()
    for pattern in (_BRACKET, _BEFORE, _TEAM):
        for m in pattern.finditer(text):
            words = m.group(1).split()
            while words and words[0].casefold().strip("'’-") in _NOT_NAMES:
                words = words[1:]
            while words and words[-1].casefold().strip("'’-") in _NOT_NAMES:
                words = words[:-1]
            if words and len(" ".join(words)) >= 2:
                found.add(" ".join(words))
    return sorted(found, key=len, reverse=True)


def without_staff(sources: Sequence[str]) -> list[str]:
    """`sources` with every occurrence of their staff names cut out, what is left of each as separate texts."""
    names = sorted({n for s in sources for n in staff_names(s)}, key=len, reverse=True)
    if not names:
        return list(sources)
    cut = re.compile("|".join(rf"(?<!\w){re.escape(n)}(?!\w)" for n in names))
    return [part for s in sources for part in cut.split(s) if part.strip()]
