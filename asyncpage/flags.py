"""Yes/no fields decided by which reading explains the record, not by generating true or false.

Asked for a boolean inside JSON, the default model (270M, a base model) answers from the prompt, not
from the record: on examples/grounded its refund flag came out `false` for all 40 tickets, and the
log-odds of `true` against `false` ranked refund tickets no better than chance (AUC 0.49). Yes/no
questions and few-shot classification did no better, and transformers gives the same numbers: it is the
model. What it does know is which text is likely after which heading, the noisy-channel reading of
classification (Min et al., 2022): a ticket's own tokens are likelier after "Record where the customer
asks for money back." than after "Record." when it asks for money back (AUC 0.88 there). That heading's
form was chosen among five on examples/grounded's 60 tickets (the plain "Record." against "Record:" or
"Message:" headings moved 2-3 of them): a sentence, then a blank line.

So each top-level boolean property is scored on the record's text, with the engine's prompt
log-probabilities: the heading's gain, how much the field's statement raises the text's log-likelihood
over the plain heading, per token. Any heading raises the likelihood of any support message a little
(the gain is mostly the words the two share), by an amount of its own, so the gain is judged against the
same heading's gain on four reference records (`offsets`): true when it beats that. The JSON is
generated as before and the decision replaces the model's own boolean in the value. Not as a `const` in
the grammar: beams rank whole values, and a forced `"urgent": false` at the end scored differently after
each beam's name (one ticket's best name became its e-mail address); moved to the front, it changed the
names the model chose after it (two e-mail addresses). The statement is the field's description ("true
when the customer asks for money back" reads "the customer asks for money back"), else its title or
name.
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from asyncpage.errors import PromptTooLongError
from asyncpage.extract_prompt import DEMOS
from asyncpage.grounding import resolve
from asyncpage.params import SamplingParams

if TYPE_CHECKING:
    from asyncpage.engine import AsyncEngine

PLAIN = "Record.\n\n"
_KEPT = 256  # headings whose offsets an engine keeps
_SCORE = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
# How descriptions of a boolean usually open; what follows is the statement that makes it true.
_OPENING = re.compile(r"^\s*(?:(?:is\s+|set\s+to\s+)?true\s+(?:when|if|whenever)|set\s+(?:when|if)"
                      r"|(?:indicates\s+)?(?:whether(?:\s+or\s+not)?|if))\s+",
                      re.IGNORECASE)


def statements(schema: dict[str, Any]) -> dict[str, str]:
    """The top-level properties that are plain booleans (not nullable, no enum or const), each with
    the heading whose likelihood of the record says true."""
    obj = resolve(schema, schema) if isinstance(schema, dict) else None
    props = obj.get("properties") if isinstance(obj, dict) else None
    out = {}
    for name, prop in (props.items() if isinstance(props, dict) else ()):
        p = resolve(schema, prop)
        if not isinstance(p, dict) or p.get("type") != "boolean" or "enum" in p or "const" in p:
            continue
        said = " ".join(_text(p.get("description")).split()).rstrip(".?!")  # one line, a statement
        said = _OPENING.sub("", said) if said else " ".join((_text(p.get("title")) or name.replace("_", " ")).split())
        if said:
            out[name] = f"Record where {said}.\n\n"
    return out


def _text(x: Any) -> str:
    return x if isinstance(x, str) else ""


async def offsets(engine: AsyncEngine, schema: dict[str, Any]) -> dict[str, float]:
    """Each scored boolean's gain per token on the reference records (DEMOS: four short support
    messages), its threshold in `decide`. A heading raises the likelihood of any text of its kind
    by its own amount, so a gain means only as much as it beats that heading's gain on texts known
    beforehand (calibration by reference inputs, Zhao et al., 2021). Measured on examples/grounded's
    60 tickets, the threshold at 0 said true for 52 of them (25 true) with a name-only heading
    ("Record where refund.") and for 30 with a described one; against these offsets, for 21 and 22.
    All four references or none: where one does not fit the context or the pool, the offsets are 0
    (the threshold does not change with which of them fit). Kept on the engine, by heading."""
    known = engine.heading_offsets
    found = {}
    for name, h in statements(schema).items():
        if h in known:
            found[name] = known[h]
            continue
        # Each heading on its own: whether it fits is its own, not that of the schema it came with.
        gains = [await _gains(engine, {name: h}, text) for text, _ in DEMOS]
        found[name] = 0.0 if any(g is None for g in gains) else sum(g[name] for g in gains if g) / len(gains)
        if len(known) >= _KEPT:
            known.clear()  # bounded: a job's schema has a few; a server's callers may send many
        known[h] = found[name]
    return found


async def decide(engine: AsyncEngine, schema: dict[str, Any], text: str,
                 offset: dict[str, float] | None = None) -> dict[str, bool]:
    """Each scored boolean of `schema` for a record whose text is `text`: true when the heading's gain
    per token on the text beats its `offset` (from `offsets`; 0 when not given). {} when there is
    none, or the text does not fit the context after a heading (the model then generates them)."""
    gains = await _gains(engine, statements(schema), text)
    if not gains:
        return {}
    return {name: g > (offset or {}).get(name, 0.0) for name, g in gains.items()}


async def _gains(engine: AsyncEngine, headings: dict[str, str], text: str) -> dict[str, float] | None:
    """How much each heading raises the log-likelihood of `text` over the plain one, per token of
    the text (a long record gains more in total from any heading); None when it does not fit."""
    text = text.strip()
    if not headings or not text:
        return None
    encode = functools.partial(engine.tokenizer, add_special_tokens=False)  # BOS comes with the heading
    body = list((await anyio.to_thread.run_sync(encode, text))["input_ids"])
    prompts = {key: await engine.tokenize(h) + body for key, h in [("", PLAIN), *headings.items()]}
    if not body or max(len(p) for p in prompts.values()) >= engine.config.max_model_len:
        return None
    scores: dict[str, float] = {}
    errors: list[Exception] = []

    async def score(key: str, ids: list[int]) -> None:
        try:
            out = await engine.generate(ids, _SCORE)
        except Exception as exc:  # raised below as itself, not wrapped in the task group's ExceptionGroup
            errors.append(exc)
            return
        assert out.prompt_logprobs is not None
        scores[key] = sum(e.logprob for e in out.prompt_logprobs[len(ids) - len(body):] if e is not None)

    async with anyio.create_task_group() as tg:  # in one batch: the headings differ, the text is the same
        for key, ids in prompts.items():
            tg.start_soon(score, key, ids)
    if any(isinstance(e, PromptTooLongError) for e in errors):
        return None  # a heading pushed the record past the pool: the record's own request is checked as it is
    if errors:
        raise errors[0]  # the engine's failure (dead, closed): the record's, as its request would have met it
    return {name: (scores[name] - scores[""]) / len(body) for name in headings}


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
