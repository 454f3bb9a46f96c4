"""Extraction jobs: typed values from many records, with bounded concurrency.

`extract_many` keeps at most `concurrency` requests in the engine and pulls the next record only
when one finishes, so memory stays flat whatever the number of records. Results come in completion
order, each tagged with its record's id, carrying the value or that record's own error; one bad
record never stops the job.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from asyncpage.errors import (
    ExtractionError,
    InvalidRequestError,
)
from asyncpage.extract import booleans as flags
from asyncpage.extract import grounding, types
from asyncpage.extract import retry as redo
from asyncpage.extract.beams import beam_for, beam_params
from asyncpage.extract.prompt import PromptTemplate, schema_prompt
from asyncpage.guided import GuidedSpec
from asyncpage.outputs import Beam, GenerateOutput
from asyncpage.params import SamplingParams

if TYPE_CHECKING:
    from asyncpage.core.client import EngineClient

DEMOS_MIN_CONTEXT = 2048  # below this context the default prompt's built-in solved records are left out


class ExtractError(msgspec.Struct, frozen=True):
    # invalid_input | prompt_too_long | truncated | invalid_output: the record's own outcome, final;
    # engine_error: the engine died or closed under it: `asyncpage extract` writes no line, so a resume retries it.
    reason: str
    message: str


class ExtractResult(msgspec.Struct, frozen=True, omit_defaults=True):
    id: Any
    value: Any = None
    error: ExtractError | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    position: int = 0  # 1-based position of the record in the input: unique even when ids are not
    # The budget (max_tokens) closed the value early: it validates, but may be shorter than the model's own.
    closed_early: bool = False
    attempts: int = 1  # decodes of the value: 1, or more where max_retries decoded a refused one again
    # confidence=True: a probability per top-level field (asyncpage.extract.retry.field_confidence; a scored
    # boolean's, its decision's share: see _decide)
    confidence: dict[str, float] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


Record = Mapping[str, Any] | str


def json_params(schema: Any, params: SamplingParams | None) -> tuple[SamplingParams, Any]:
    """The sampling params for extracting `schema` (a msgspec type, a pydantic type or a JSON Schema dict:
    asyncpage.extract.types) and the target to decode into (None for a dict schema). `params` defaults to
    greedy, max_tokens=1024; any other guided-decoding field in it is replaced by the schema."""
    json_schema, target = types.describe(schema)
    base = params or SamplingParams(max_tokens=1024, temperature=0)
    return msgspec.structs.replace(base, json_schema=json_schema, regex=None, choice=None, grammar=None), target


def beams_per_record(schema: Any, copy_fields: Sequence[str] | str | None, beam_width: int | None) -> int:
    """The sequences each record of an extraction job runs at once (what a job sizes max_num_seqs by):
    its beams, or 1 when it decodes greedy (nothing copied and no width asked). A bad width or an
    unknown copied field is refused here, before anything loads."""
    json_schema = json_params(schema, None)[0].json_schema
    assert json_schema is not None
    beam = beam_params(beam_width, grounding.copied(grounding.mark(json_schema, copy_fields)))
    return 1 if beam is None else beam.beam_width


def grounded(params: SamplingParams, schema: dict[str, Any], sources: list[str]) -> SamplingParams:
    """`params` with the schema's grammar where its `x-copy` fields are spans of `sources`."""
    return msgspec.structs.replace(params, json_schema=None, grammar=grounding.grammar(schema, sources))


def check_job(prompt: PromptTemplate | None, examples: Sequence[Mapping[str, Any]], concurrency: int, schema: Any,
              copy_fields: Sequence[str] | str | None) -> None:
    """A job's options that do not depend on the engine (the Ray driver checks them too, before a
    cluster starts): the examples among them, each against the schema."""
    if concurrency < 1:
        raise InvalidRequestError("concurrency", "must be >= 1")
    if examples and prompt is not None:
        raise InvalidRequestError("examples", "examples go into the default prompt; a prompt of your own "
                                              "carries its examples itself")
    if examples:
        json_schema = json_params(schema, None)[0].json_schema
        if isinstance(json_schema, dict):
            schema_prompt(grounding.mark(json_schema, copy_fields), examples=examples)  # refuses a bad one


def closed_validly(matcher: Any, params: SamplingParams, token_ids: list[int]) -> bool:
    """A request that ended by length has a complete value when budget closing brought its grammar to
    an accepting state with the tokens it emitted (read once the sequence is finished: nothing else
    touches its matcher then). They are replayed on a fresh matcher (`replays`): the sequence's own
    may be ahead of its output, by forced tokens max_tokens cut (`{"const": 12345678}` cut at `123`)."""
    if not params.budget_close or matcher is None:
        return False
    replays = getattr(matcher, "replays", None)
    return bool(replays(token_ids) if replays is not None else matcher.is_accepting())


async def closed_early_error(engine: EngineClient, params: SamplingParams, token_ids: list[int], text: str,
                             target: Any, decided: dict[str, bool] | None = None) -> ExtractionError | None:
    """For extract(): the ExtractionError("closed_early") carrying the value when an output cut by
    max_tokens was closed validly by budget closing (its tokens take a fresh matcher of the same
    grammar to an accepting state, and it decodes), else None."""
    spec = GuidedSpec.from_params(params)
    if not params.budget_close or spec is None:
        return None
    matcher = (await engine.guided.compile(spec)).new_matcher()
    if not all(matcher.accept(t) for t in token_ids) or not matcher.is_accepting():
        return None
    try:
        value = decode_value(text, target, decided)
    except msgspec.DecodeError:
        return None
    return ExtractionError("closed_early", f"max_tokens={params.max_tokens} closed the value early (it is valid: "
                           "see .value)", text, value, has_value=True)


def decode_value(text: str, target: Any, decided: dict[str, bool] | None = None) -> Any:
    """The generated JSON as `target` (json_params' target: a msgspec type, a pydantic one, or None for plain
    JSON values), with the `decided` booleans (flags.py) in place of the model's own; raises
    msgspec.DecodeError (types.Refused, a msgspec.ValidationError, where the type's validation refuses it)."""
    fields = redo.top_fields(text)
    text = flags.applied(text, decided or {})
    return types.decode(text, target, [f.key for f in fields or ()])


class Attempts:
    """A record's decodes so far: how many, the kept prefix of its value (tokens, text, their log-probabilities)
    the next decode continues, and the refused values of each field retried."""

    def __init__(self) -> None:
        self.n = 0
        self.ids: list[int] = []
        self.text = ""
        self.logprobs: list[float | None] = []
        self.excluded: dict[str, list[Any]] = {}
        self.output_tokens = 0


def retry_params(engine: EngineClient, params: SamplingParams, state: Attempts, text: str,
                 token_ids: Sequence[int], logprobs: Sequence[float | None],
                 refused: types.Refused) -> SamplingParams | None:
    """The params of the next decode of a refused value (asyncpage.extract.retry), with `state` moved to the
    prefix it keeps; None when it cannot be decoded again (no field to retry, a value that cannot be
    excluded). `params`: the record's first decode's, under its JSON schema."""
    schema = params.json_schema
    fields = redo.top_fields(text)
    if not isinstance(schema, dict) or not fields:
        return None
    named = [f for f in fields if f.key == refused.field]
    field = named[0] if named else fields[-1]
    try:
        value = msgspec.json.decode(text[field.start:field.end])
    except msgspec.DecodeError:
        return None
    excluded = state.excluded.setdefault(field.key, [])
    excluded.append(value)
    if getattr(engine.guided, "backend_name", None) == "llguidance":
        from asyncpage.guided.llg import JSON_OPTIONS

        ends = redo.token_ends(engine.tokenizer, token_ids)
        k = redo.kept_tokens(ends, field.start)
        kept = engine.tokenizer.decode(list(token_ids[:k]), skip_special_tokens=True) if k else ""
        lark = redo.rest_grammar(schema, field.key, text[len(kept):field.start], excluded, dict(JSON_OPTIONS)) \
            if text.startswith(kept) else None
        if lark is not None and params.max_tokens > k:
            state.ids, state.text, state.logprobs = list(token_ids[:k]), kept, list(logprobs[:k])
            return msgspec.structs.replace(params, json_schema=None, grammar=lark, max_tokens=params.max_tokens - k)
    whole = redo.whole_schema(schema, field.key, excluded)
    if whole is None:
        return None
    state.ids, state.text, state.logprobs = [], "", []
    return msgspec.structs.replace(params, json_schema=whole)


def _token_logprobs(logprobs: Sequence[Any] | None, n: int) -> list[float | None]:
    return [e.logprob for e in logprobs] if logprobs is not None and len(logprobs) == n else [None] * n


def confidence_of(engine: EngineClient, text: str, token_ids: Sequence[int], logprobs: Sequence[float | None],
                  shares: dict[str, float]) -> dict[str, float]:
    """Per top-level field: a scored boolean's decision share, else its value tokens' joint probability
    (asyncpage.extract.retry.field_confidence); a field decoded without log-probabilities (beams) is left out."""
    out = {}
    if any(lp is not None for lp in logprobs):
        out = redo.field_confidence(text, redo.token_ends(engine.tokenizer, token_ids), logprobs)
    return {**out, **shares}


async def _decide(engine: EngineClient, marked: dict[str, Any], text: str, offset: dict[str, float],
                  confidence: bool) -> tuple[dict[str, bool], dict[str, float]]:
    """flags.decide, and with `confidence` each decision's share: the logistic of its score's margin over its
    offset (1/2 at the threshold; not calibrated beyond that: a bare name's per-token gains stay near 1/2)."""
    if not confidence:
        return await flags.decide(engine, marked, text, offset), {}
    readings = {name: r for name, r in flags.statements(marked).items() if name in offset}
    gains = await flags._gains(engine, readings, text)  # decide's own scores, kept
    if not gains:
        return {}, {}
    return ({name: g > offset[name] for name, g in gains.items()},
            {name: 1 / (1 + math.exp(-abs(g - offset[name]))) for name, g in gains.items()})


def _check_retries(max_retries: int) -> None:
    if type(max_retries) is not int or max_retries < 0:
        raise InvalidRequestError("max_retries", f"must be an int >= 0, got {max_retries!r}")


async def extract_one(engine: EngineClient, prompt: str | list[int], schema: Any, params: SamplingParams | None, *,
                      chat: bool, copy_from: str | Sequence[str] | None,
                      copy_fields: Sequence[str] | str | None, beam_width: int | None = None,
                      score_booleans: bool | None = None, max_retries: int = 0, confidence: bool = False) -> Any:
    """Generate one JSON value constrained to `schema` and return it typed.

    `schema` is a msgspec.Struct type (or any type msgspec can describe: its JSON Schema is used and
    the result is decoded into it), a pydantic v2 model (or any type pydantic's TypeAdapter takes: the
    value is validated by pydantic and returned as its instance) or a JSON Schema dict (the result is the
    decoded JSON). `max_retries`: a value the type's own validation refuses is decoded again (at most
    that many times) from its first refused field, the prompt's and the kept prefix's KV reused, the
    refused value excluded by the grammar; after the last, ExtractionError("invalid") names the field.
    `confidence=True`: returns the ExtractResult (`.value`, `.attempts`, `.confidence`: a probability per
    top-level field) instead of the value. `params`
    defaults to greedy with max_tokens=1024; its json_schema is replaced by `schema`. With
    `chat=True` the prompt is wrapped in the model's chat template. Raises GrammarError for an
    unsupported schema, ExtractionError when the output is cut at max_tokens or does not decode.
    A value that budget closing (`budget_close`, on by default) ended at max_tokens is valid but
    may be cut short: it raises ExtractionError("closed_early") with the typed value in `.value`.
    `copy_from`: the source text (or texts); string fields marked `"x-copy": true` in the schema,
    or named by `copy_fields` (a list, or "auto": every string without enum, const or format;
    the default when nothing is marked) must then be spans copied from it (grounded extraction).
    `beam_width`: the value is the best of that many beams (the likeliest whole value, not token by
    token); by default 4 when `copy_from` has a field copied, else 1 (greedy).
    `score_booleans` (default: on with `copy_from`): each top-level boolean property is decided by
    how likely its statement is after the source text (its name as a heading, without a description),
    against the same after four reference records, not generated (asyncpage.extract.booleans).

        class Invoice(msgspec.Struct):
            number: str
            total: float
        inv = await engine.extract("Invoice INV-7, total 12.50 EUR. JSON:", Invoice)
    """
    _check_retries(max_retries)
    beam_params(beam_width, copying=False)  # a bad width fails first, before any grammar is made
    params, target = json_params(schema, params)
    copying = False  # a field is copied: the default is beams (beam_params)
    decided: dict[str, bool] = {}  # booleans scored on the source (flags.py): they replace the model's own
    shares: dict[str, float] = {}
    if copy_from is None and score_booleans:
        raise InvalidRequestError("score_booleans", "booleans are scored on the record's text: pass copy_from")
    if copy_from is not None:
        assert params.json_schema is not None
        if copy_fields is None and not grounding.copied(params.json_schema):
            copy_fields = "auto"
        sources = [copy_from] if isinstance(copy_from, str) else list(copy_from)
        marked = grounding.mark(params.json_schema, copy_fields)
        copying = grounding.copied(marked)
        params = grounded(params, marked, sources)
        if score_booleans is not False and flags.statements(marked) and _joined(sources).strip():
            decided, shares = await _decide(engine, marked, _joined(sources), await flags.offsets(engine, marked),
                                            confidence)
    if chat:
        prompt = engine.apply_chat_template(prompt)
    state = Attempts()
    own = params  # this decode's params: the record's, or a retry's (retry_params)
    try:
        out: GenerateOutput | Beam
        ids = await engine.tokenize(prompt)
        while True:
            state.n += 1
            if state.n == 1:
                beam = beam_for(engine, ids, params, beam_width, copying)
                if beam is None:
                    if confidence:
                        own = msgspec.structs.replace(params, logprobs=0)
                    out = await engine.generate(ids, own)
                else:
                    beams = (await engine.beam_search(ids, beam.beam_width, params.max_tokens, params=params)).beams
                    if beams and (beams[0].finish_reason == "stop" or beam_width is not None):
                        out = beams[0]
                    elif beam_width is None:
                        out = await engine.generate(ids, params)  # see _greedy_retry
                    else:
                        raise ExtractionError("invalid", _NO_BEAM.format(beam.beam_width), "")
            else:
                out = await engine.generate(ids + state.ids, own)
            state.output_tokens += len(out.token_ids)
            text = state.text + out.text
            token_ids = state.ids + list(out.token_ids)
            chosen = out.choices[0].logprobs if isinstance(out, GenerateOutput) else None  # beams have none
            logprobs = state.logprobs + _token_logprobs(chosen, len(out.token_ids))
            if out.finish_reason == "length":
                # Closed validly by the budget: raised with the value attached (see closed_early_error).
                raise await closed_early_error(engine, own, out.token_ids, text, target, decided) or ExtractionError(
                    "truncated", f"output reached max_tokens={params.max_tokens} before the value was complete",
                    text)
            try:
                value = decode_value(text, target, decided)
            except types.Refused as exc:
                nxt = None
                if state.n <= max_retries and not copying:
                    base = msgspec.structs.replace(params, logprobs=0) if confidence else params
                    nxt = retry_params(engine, base, state, text, token_ids, logprobs, exc)
                if nxt is None:
                    raise ExtractionError("invalid", str(exc), text) from exc
                if own is not params and state.n > 1:
                    _forget(engine, own)
                own = nxt
                continue
            except msgspec.DecodeError as exc:
                raise ExtractionError("invalid", str(exc), text) from exc
            break
    finally:
        if copy_from is not None:
            _forget(engine, params)  # the grammar embeds this source only
        if state.n > 1:
            _forget(engine, own)  # a retry's grammar embeds the refused values
    if confidence:
        return ExtractResult(None, value=value, prompt_tokens=len(ids), output_tokens=state.output_tokens,
                             attempts=state.n, confidence=confidence_of(engine, text, token_ids, logprobs, shares))
    return value


def _joined(sources: Sequence[str]) -> str:
    """The text booleans are scored on: every source the values may come from."""
    return "\n\n".join(s for s in sources if s.strip())


def _forget(engine: EngineClient, params: SamplingParams) -> None:
    """Drop a record's own grammar (its copied spans) from the engine's cache: it ends with the record."""
    engine.guided.forget(GuidedSpec.from_params(params))


_NO_BEAM = "none of the {} beams completed a value the grammar accepts"
