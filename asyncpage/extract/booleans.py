"""Yes/no fields decided by how likely the model finds their statement, not by generating true or false.

Asked for a boolean inside JSON, the default model (270M, a base model) answers from the prompt, not
from the record: on examples/grounded its refund flag came out `false` for all 40 tickets, and the
log-odds of `true` against `false` ranked refund tickets no better than chance (AUC 0.49). Yes/no
questions and few-shot classification did no better, and transformers gives the same numbers: it is the
model. What it does know is which text is likely after which, so each top-level boolean property is
scored with the engine's prompt log-probabilities, in one of two readings:

- With a description, its statement read after the record: the log-likelihood of " the customer asks
  for money back." after "<record>\n\nIn this message,". It ranked the 60 refund tickets of
  examples/grounded at AUC 0.92, and put 8 of the extraction example's 10 urgent flags right.
- Without one (a bare `refund`), " refund." read after the record ranked them at 0.77 and put 11 of
  the 20 plain tickets right; its name as a heading before the record did better: how much "Record where
  refund.\n\n" raises the record's own log-likelihood over "Record.\n\n", per token (the noisy-channel
  reading, Min et al., 2022; 15 of the 20). That gain is mostly the words the two share, so it is read
  only where a name is all there is: a described refund read that way was right for 38 of 60 tickets
  ("the customer requests a refund") against 49 read after it, and `urgent` for 5 of 10 against 8.

Any score is judged against the same reading's mean score on four reference records (`offsets`): true
when it beats that. "In this message," was chosen among three openings on those 60 tickets (the others
put 43 and 44 of them right, against 49), so the refund figures are somewhat optimistic.

The JSON is generated as before and the decision replaces the model's own boolean in the value. Not as a
`const` in the grammar: beams rank whole values, and a forced `"urgent": false` at the end scored
differently after each beam's name (one ticket's best name became its e-mail address); moved to the
front, it changed the names the model chose after it (two e-mail addresses). The statement is the
field's description ("true when the customer asks for money back" reads "the customer asks for money
back"); without one, its title or name.
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio
import msgspec

from asyncpage.errors import PromptTooLongError
from asyncpage.extract.grounding import resolve
from asyncpage.extract.prompt import DEMOS
from asyncpage.params import SamplingParams

if TYPE_CHECKING:
    from asyncpage.core.client import EngineClient

PLAIN = "Record.\n\n"
AFTER = "\n\nIn this message,"
_KEPT = 256  # readings whose offsets an engine keeps
_SCORE = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
# How descriptions of a boolean usually open; what follows is the statement that makes it true.
_OPENING = re.compile(r"^\s*(?:(?:is\s+|set\s+to\s+)?true\s+(?:when|if|whenever)|set\s+(?:when|if)"
                      r"|(?:indicates\s+)?(?:whether(?:\s+or\s+not)?|if))(?:\s+|$)",
                      re.IGNORECASE)


class Reading(NamedTuple):
    """How one boolean is scored: `statement` read after the record ("<text>\n\nIn this message,
    <statement>.") when the field has a description, else as a heading before it ("Record where
    <name>.\n\n<text>", against "Record.\n\n<text>")."""

    statement: str
    described: bool

    @property
    def key(self) -> str:
        """The words scored, as the engine keeps its offset."""
        return f"{AFTER} {self.statement}." if self.described else f"Record where {self.statement}.\n\n"


def statements(schema: dict[str, Any]) -> dict[str, Reading]:
    """The top-level properties that are plain booleans (not nullable, no enum or const), each with
    how it is read."""
    obj = resolve(schema, schema) if isinstance(schema, dict) else None
    props = obj.get("properties") if isinstance(obj, dict) else None
    out = {}
    for name, prop in (props.items() if isinstance(props, dict) else ()):
        p = resolve(schema, prop)
        if not isinstance(p, dict) or p.get("type") != "boolean" or "enum" in p or "const" in p:
            continue
        said = _OPENING.sub("", " ".join(_text(p.get("description")).split()).rstrip(".?!"))  # one line
        if re.search(r"\w", said):  # a statement, not an opening alone ("Whether") or a dash
            out[name] = Reading(said, True)
        elif named := " ".join((_text(p.get("title")) or name.replace("_", " ")).split()).rstrip(".?!"):
            out[name] = Reading(named, False)
    return out


def _text(x: Any) -> str:
    return x if isinstance(x, str) else ""


async def offsets(engine: EngineClient, schema: dict[str, Any]) -> dict[str, float]:
    """Each scored boolean's mean score on the reference records (DEMOS: four short support messages),
    its threshold in `decide`. A reading's score has a level of its own (a long statement is less
    likely than a short one; a heading raises the likelihood of any support message a little), so a
    score means only as much as it beats the same reading's score on texts known beforehand
    (calibration by reference inputs, Zhao et al., 2021). Measured on examples/grounded's 60 tickets,
    a bare refund's heading against 0 said true for 52 of them (25 true); against its offset, for 21.
    All four references or none: a boolean for which one does not fit the context or the pool has no
    offset and is left to the model (no threshold stands in for it: a statement's log-likelihood is
    always below 0). Kept on the engine, by reading."""
    known = engine.reading_offsets
    found: dict[str, float | None] = {}
    for name, reading in statements(schema).items():
        if reading.key in known:
            found[name] = known[reading.key]
            continue
        # Each on its own: whether it fits is its own, not that of the schema it came with.
        scores = [await _gains(engine, {name: reading}, text) for text, _ in DEMOS]
        found[name] = None if any(g is None for g in scores) else sum(g[name] for g in scores if g) / len(scores)
        if len(known) >= _KEPT:
            known.clear()  # bounded: a job's schema has a few; a server's callers may send many
        known[reading.key] = found[name]
    return {name: bar for name, bar in found.items() if bar is not None}


async def decide(engine: EngineClient, schema: dict[str, Any], text: str, offset: dict[str, float]) -> dict[str, bool]:
    """The booleans of `schema` that have an `offset` (from `offsets`), for a record whose text is
    `text`: true when its score on the text beats its offset. {} when there is none, or the text does
    not fit the context with one of their readings (the model then generates them all)."""
    readings = {name: r for name, r in statements(schema).items() if name in offset}
    gains = await _gains(engine, readings, text)
    if not gains:
        return {}
    return {name: g > offset[name] for name, g in gains.items()}


async def _gains(engine: EngineClient, readings: dict[str, Reading], text: str) -> dict[str, float] | None:
    """Each boolean's score on `text`: a described one, the log-likelihood of its statement after the
    text; a named one, how much its heading raises the log-likelihood of the text over the plain
    heading, per token of the text (a long record gains more in total from any heading). None when
    one does not fit."""
    text = text.strip()
    if not readings or not text:
        return None
    encode = functools.partial(engine.tokenizer, add_special_tokens=False)  # BOS comes with the prompt
    body = list((await anyio.to_thread.run_sync(encode, text))["input_ids"])
    # name -> (prompt, how many of its last tokens are scored); None: the plain heading's (no property's
    # name, which may be any string)
    prompts: dict[str | None, tuple[list[int], int]] = {}
    for name, r in readings.items():
        if r.described:
            said = list((await anyio.to_thread.run_sync(encode, f" {r.statement}."))["input_ids"])
            prompts[name] = (await engine.tokenize(text + AFTER) + said, len(said))
        else:
            prompts[name] = (await engine.tokenize(r.key) + body, len(body))
            prompts[None] = (await engine.tokenize(PLAIN) + body, len(body))
    if not body or max(len(p) for p, _ in prompts.values()) >= engine.config.max_model_len:
        return None
    scores: dict[str | None, float] = {}
    errors: list[Exception] = []

    async def score(key: str | None, ids: list[int], scored: int) -> None:
        try:
            out = await engine.generate(ids, _SCORE)
        except Exception as exc:  # raised below as itself, not wrapped in the task group's ExceptionGroup
            errors.append(exc)
            return
        assert out.prompt_logprobs is not None
        scores[key] = sum(e.logprob for e in out.prompt_logprobs[len(ids) - scored:] if e is not None)

    async with anyio.create_task_group() as tg:  # in one batch
        for key, (ids, scored) in prompts.items():
            tg.start_soon(score, key, ids, scored)
    if any(isinstance(e, PromptTooLongError) for e in errors):
        return None  # a prompt past the pool: the record's own request is checked as it is
    if errors:
        raise errors[0]  # the engine's failure (dead, closed): the record's, as its request would have met it
    return {name: scores[name] if r.described else (scores[name] - scores[None]) / len(body)
            for name, r in readings.items()}


def applied(text: str, decided: dict[str, bool]) -> str:
    """The generated JSON with each decided boolean in place of the model's own (set also where the model
    left an optional one out). On the text, before it is decoded into the caller's type: that type's own
    checks (constraints, __post_init__) then judge the value as they judge any output."""
    if not decided:
        return text
    try:
        value = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text  # decoding it fails the record as it would have
    if not isinstance(value, dict):
        return text
    return msgspec.json.encode({**value, **decided}).decode()
