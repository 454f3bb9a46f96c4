"""Whom a record's writer works for: the organization a signature names after the writer's job title ("Practice
Manager, Westgate Family Clinic", "Head Chef, La Marea, 22 Quay Street", "Customer Service Manager at Bakery Co"),
which a field asking for a product's brand must not copy. A small model took that company for the product in four
of forty tickets (spent v47-v52: "Westgate Family Clinic" for "Rostera Teams", "Threnody Design Ltd" for "Caffiora
Barista S").

`without_employer` cuts each such company out of the texts, leaving the rest as separate texts: what a brand
field's spans come from (grounding.NAMED). A job title is read as one only in a signature: in the record's last
SIGNATURE characters, on the line after a name alone on its line, or after the name and a comma ("Ana Silva,
Customer Service Manager at Bakery Co"); a role noun in it ("Manager", "Head Chef", "Head of Sales Operations"),
then a comma or "at", then the capitalized words of the company up to the line's end or the next comma. "Kind
regards, Maria", "Order 55120, Foo Ltd" and a product's line ("Office Chair, Herman Miller Aeron") are not.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from asyncpage.extract.staff import cut_out

_ROLES = ("Manager|Director|Head|Chef|Officer|Coordinator|Administrator|Assistant|Lead|Owner|Founder|Co-founder|"
          "Partner|Engineer|Supervisor|Secretary|Accountant|Analyst|Consultant|President|Principal|Teacher|Nurse|Buyer|"
          "Planner|Technician|Controller|Executive|CEO|CTO|CFO|COO|VP|Receptionist|Clerk|Architect|Developer|"
          "Designer|Editor|Producer|Pharmacist|Dentist|Physician|Librarian|Caretaker|Superintendent|Registrar|Bursar|"
          "Treasurer|Chair|Chairman|Chairwoman|Trustee|Proprietor|Landlord")
_CAP = r"[A-Z0-9À-ÖØ-Þ][\w'’.&-]*"
SIGNATURE = 300  # the characters at a record's end a signature is looked for in
# A person's name: two to four capitalized words, no digit.
_PERSON = r"[A-ZÀ-ÖØ-Þ][^\W\d_]*(?:[-'’][^\W\d_]+)*\.?(?:[ \t]+[A-ZÀ-ÖØ-Þ][^\W\d_]*(?:[-'’][^\W\d_]+)*\.?){1,3}"
# A job title at a line's start (after the writer's name and a comma, at most): capitalized words (or "of", "and",
# "&", "the") ending in a role noun, then "," or "at", then the company: capitalized words (an "&", "and", "of" or
# "the" between them), up to the line's end or a comma. Case matters: "My manager, John, said" is no signature.
_TITLE = re.compile(
    rf"(?:^[ \t]*{_PERSON}[ \t]*\r?\n[ \t]*|^[ \t]*{_PERSON},[ \t]*)"  # the writer's name: its own line, or a comma
    rf"(?:(?:[A-Z][\w'’.&/-]*|of|and|&|the)[ \t]+){{0,5}}?(?:{_ROLES})\b[^,\n]{{0,40}}?"  # the title
    rf"(?:,|[ \t]at)[ \t]+(?P<org>{_CAP}(?:[ \t]+(?:&|and|of|the|{_CAP})){{0,5}})[ \t]*(?=,|\r?$)",  # the company
    re.MULTILINE)


def employers(text: str) -> list[tuple[int, int]]:
    """Where `text` names its writer's employer after a job title (see the module's docstring): (start, end) each."""
    start = max(0, len(text) - SIGNATURE)
    start = text.rfind("\n", 0, start) + 1 if start else 0  # from a line's start
    return [m.span("org") for m in _TITLE.finditer(text, start)]


def without_employer(sources: Sequence[str]) -> list[str]:
    """`sources` with each employer a signature names cut out, what is left of each as separate texts."""
    return cut_out(sources, employers)
