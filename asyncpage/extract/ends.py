"""Where a copied value that may not be null ends (a decision of decisions.Plan): the value the model wrote, its
word prefixes and its widened forms (grounding.widened: "Juniperra Flame 6" beside the model's "Flame 6"), each read
on the field's described line after the record (" Marlow Duo\\n"), the likeliest kept. No opening article, never a
lone "my", none the field's schema refuses. The figures: docs/extraction.md, "Decisions by scoring"."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from asyncpage.extract import grounding
from asyncpage.extract.probes import Probe
from asyncpage.extract.readings import LINE_END

if TYPE_CHECKING:
    from asyncpage.core.client import EngineClient
    from asyncpage.extract.probes import Scored


def candidates(text: str, wrote: str, holds: Callable[[str], bool]) -> list[str]:
    """The ends read for a value the model wrote in `text`'s field: [] where there is nothing but its own."""
    value = wrote
    while (head := value.split(maxsplit=1))[0].lower() in grounding.ARTICLES and len(head) > 1:
        value = head[1]  # "The Glossvane Sleek 3 straightener": a name opens after its article
    cands = list(dict.fromkeys(c for v in (value, *grounding.widened(text, value))
                               for c in grounding.word_prefixes(v)))  # "Flame 6", "Juniperra Flame 6"
    cands = [c for c in cands if any(ch.isalnum() for ch in c) and c.lower() not in grounding.DETERMINERS and holds(c)]
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
