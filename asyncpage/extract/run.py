"""Extraction jobs: typed values from many records, with bounded concurrency.

`extract_many` keeps at most `concurrency` requests in the engine and pulls the next record only
when one finishes, so memory stays flat whatever the number of records. Results come in completion
order, each tagged with its record's id, carrying the value or that record's own error; one bad
record never stops the job.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from asyncpage.core.validation import check_cache_key, check_priority
from asyncpage.errors import (
    ExtractionError,
    InvalidRequestError,
    PromptTooLongError,
)
from asyncpage.extract import ends, grounding, types
from asyncpage.extract import retry as redo
from asyncpage.extract.beams import beam_for, beam_params
from asyncpage.extract.decisions import Context, Decider, Plan
from asyncpage.extract.prompt import PromptTemplate, schema_prompt
from asyncpage.extract.readings import applied
from asyncpage.guided import GuidedSpec
from asyncpage.guided.guards import guards_for
from asyncpage.outputs import Beam, GenerateOutput
from asyncpage.params import SamplingParams

if TYPE_CHECKING:
    from asyncpage.core.client import EngineClient
    from asyncpage.decoding.beam import BeamParams

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
    # decision's, its share: asyncpage.extract.decisions)
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
    """`params` with the schema's grammar where its `x-copy` fields are spans of `sources`; the digit guard kept,
    not the repetition guard, which would cut a copied span that repeats itself ("Tok tok tok ... Drum"): a copy is
    never longer than its record."""
    return json_grammar(params, grounding.grammar(schema, sources), schema, repeats=False)


def json_grammar(params: SamplingParams, lark: str, schema: dict[str, Any], repeats: bool = True) -> SamplingParams:
    """`params` decoding the Lark grammar `lark` that writes a value of `schema`, with json_schema's runaway guards
    (each off where `schema` asks for long values, as under json_schema; the repetition guard off without
    `repeats`): a retry that excludes an age of 52 used to write 52 and a thousand zeros to max_tokens."""
    g = guards_for(schema, params.max_number_digits, params.max_string_repeats if repeats else 0)
    return msgspec.structs.replace(params, json_schema=None, grammar=lark, json_guards=True,
                                   max_number_digits=g.max_digits, max_string_repeats=g.max_repeats)


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
                             target: Any, decided: dict[str, Any] | None = None) -> ExtractionError | None:
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


def decode_value(text: str, target: Any, decided: dict[str, Any] | None = None) -> Any:
    """The generated JSON as `target` (json_params' target: a msgspec type, a pydantic one, or None for plain
    JSON values), with the `decided` fields (decisions.py: scored booleans and closed choices) in place of the
    model's own; raises msgspec.DecodeError (types.Refused, a msgspec.ValidationError, where the type's
    validation refuses it). A decided value the type refuses gives way to the model's own there."""
    fields = redo.top_fields(text)
    order = [f.key for f in fields or ()]
    decided = dict(decided or {})
    while True:
        try:
            return types.decode(applied(text, decided), target, order)
        except types.Refused as exc:
            if not decided:
                raise
            if exc.field in decided:
                del decided[exc.field]
            else:  # another field, or the whole value: judged on the model's own values alone
                decided = {}


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
        inside = redo.in_string(text)
        while k and ends[k - 1] <= len(text) and inside[ends[k - 1]]:
            k -= 1  # the rest starts outside a string, where the guards' lexer starts (a `":` token ends the key)
        kept = engine.tokenizer.decode(list(token_ids[:k]), skip_special_tokens=True) if k else ""
        item, key = params.json_separators  # the rest spelled as the first decode was
        options = {**JSON_OPTIONS, "item_separator": item, "key_separator": key}
        lark = redo.rest_grammar(schema, field.key, text[len(kept):field.start], excluded, options) \
            if text.startswith(kept) else None
        if lark is not None and params.max_tokens > k:
            state.ids, state.text, state.logprobs = list(token_ids[:k]), kept, list(logprobs[:k])
            return json_grammar(msgspec.structs.replace(params, max_tokens=params.max_tokens - k), lark, schema)
    whole = redo.whole_schema(schema, field.key, excluded)
    if whole is None:
        return None
    state.ids, state.text, state.logprobs = [], "", []
    return msgspec.structs.replace(params, json_schema=whole)


def _token_logprobs(logprobs: Sequence[Any] | None, n: int) -> list[float | None]:
    return [e.logprob for e in logprobs] if logprobs is not None and len(logprobs) == n else [None] * n


def confidence_of(engine: EngineClient, text: str, token_ids: Sequence[int], logprobs: Sequence[float | None],
                  shares: dict[str, float]) -> dict[str, float]:
    """Per top-level field: a scored decision's share (decisions.py), else its value tokens' joint probability
    (asyncpage.extract.retry.field_confidence); a field decoded without log-probabilities (beams) is left out."""
    out = {}
    if any(lp is not None for lp in logprobs):
        out = redo.field_confidence(text, redo.token_ends(engine.tokenizer, token_ids), logprobs)
    return {**out, **shares}


def decider_for(marked: dict[str, Any], score_booleans: bool | None, score_choices: bool | None,
                copying: bool) -> Decider | None:
    """The job's scored decisions (asyncpage.extract.decisions): booleans and closed choices, each on by
    default where a field is copied; None when there is nothing to decide."""
    d = Decider(marked, booleans=copying if score_booleans is None else score_booleans,
                choices=copying if score_choices is None else score_choices)
    return d if d.active else None


async def reference_context(engine: EngineClient, prompt: str | list[int], params: SamplingParams,
                            marked: dict[str, Any], copying: bool, beam_width: int | None, text: str, *,
                            priority: int = 0, cache_key: str | None = None) -> Context | None:
    """A reference record's value (`text`, in its `prompt`), decoded as the job decodes a record (its beams):
    what the in-context decisions are calibrated on. Decoded greedy, the references' order ids margins moved
    the offset: two of the 24 dev tickets' absent order ids came out present. None when it does not decode."""
    ids = await engine.tokenize(prompt)
    own = grounded(params, marked, [text]) if copying else params
    out: GenerateOutput | Beam | None = None
    try:
        beam = beam_for(engine, ids, own, beam_width, copying)
        if beam is None:
            out = await engine.generate(ids, own, priority=priority, cache_key=cache_key)
        else:
            out = next(iter(await _beams(engine, ids, beam, own, priority, cache_key)), None)
    except (PromptTooLongError, InvalidRequestError):
        return None
    finally:
        if copying:
            _forget(engine, own)
    if out is None or out.finish_reason != "stop":
        return None
    return Context(ids, out.text, list(out.token_ids))


async def _beams(engine: EngineClient, ids: list[int], beam: BeamParams, params: SamplingParams, priority: int,
                 cache_key: str | None) -> list[Beam]:
    """engine.beam_search's beams (best first) for one record's value, as `beam` asks."""
    out = await engine.beam_search(ids, beam.beam_width, params.max_tokens, beam.length_penalty, beam.early_stopping,
                                   params, priority=priority, cache_key=cache_key)
    return out.beams


def _check_retries(max_retries: int) -> None:
    if type(max_retries) is not int or max_retries < 0:
        raise InvalidRequestError("max_retries", f"must be an int >= 0, got {max_retries!r}")


async def extract_one(engine: EngineClient, prompt: str | list[int], schema: Any, params: SamplingParams | None, *,
                      chat: bool, copy_from: str | Sequence[str] | None,
                      copy_fields: Sequence[str] | str | None, beam_width: int | None = None,
                      score_booleans: bool | None = None, max_retries: int = 0, confidence: bool = False,
                      score_choices: bool | None = None, priority: int = 0, cache_key: str | None = None) -> Any:
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
    against the same after the reference records, not generated (asyncpage.extract.booleans).
    `score_choices` (default: on with `copy_from`): each closed choice (an enum, `const` alternatives, the
    null-or-present choice of a nullable field) is decided by the model's likelihood of each option, calibrated
    on the reference records (asyncpage.extract.decisions); the reference records are read in `prompt` with
    their text in place of `copy_from`'s (a prompt that does not hold it leaves null-or-present to the model).
    `priority` and `cache_key`: as engine.generate's, for every request of the record.

        class Invoice(msgspec.Struct):
            number: str
            total: float
        inv = await engine.extract("Invoice INV-7, total 12.50 EUR. JSON:", Invoice)
    """
    _check_retries(max_retries)
    check_priority(priority)  # before any probe: a probe's refusal is its own, left to the model
    check_cache_key(cache_key)
    beam_params(beam_width, copying=False)  # a bad width fails first, before any grammar is made
    params, target = json_params(schema, params)
    copying = False  # a field is copied: the default is beams (beam_params)
    decided: dict[str, Any] = {}  # scored decisions on the source (decisions.py): they replace the model's own
    shares: dict[str, float] = {}
    plan: Plan | None = None
    for name, asked in (("score_booleans", score_booleans), ("score_choices", score_choices)):
        if copy_from is None and asked:
            raise InvalidRequestError(name, "decisions are scored on the record's text: pass copy_from")
    if copy_from is not None:
        assert params.json_schema is not None
        if copy_fields is None and not grounding.copied(params.json_schema):
            copy_fields = "auto"
        sources = [copy_from] if isinstance(copy_from, str) else list(copy_from)
        marked = ends.named_copies(grounding.mark(params.json_schema, copy_fields))
        copying = grounding.copied(marked)
        plain = params
        params = grounded(params, marked, sources)
        decider = decider_for(marked, score_booleans, score_choices, True) if _joined(sources).strip() else None
        if decider is not None:
            source = _joined(sources)

            async def reference(text: str) -> Context | None:
                if not isinstance(prompt, str) or len(sources) != 1 or source not in prompt:
                    return None
                ref = prompt.replace(source, text)
                return await reference_context(engine, engine.apply_chat_template(ref) if chat else ref, plain,
                                               marked, copying, beam_width, text, priority=priority,
                                               cache_key=cache_key)

            await decider.calibrate(engine, reference, prompt if isinstance(prompt, str) else "", priority=priority,
                                    cache_key=cache_key)
            plan = Plan(decider, source, sources)
            await plan.prepare(engine)
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
                    out = await engine.generate(ids, own, priority=priority, cache_key=cache_key)
                else:
                    beams = await _beams(engine, ids, beam, params, priority, cache_key)
                    if beams and (beams[0].finish_reason == "stop" or beam_width is not None):
                        out = beams[0]
                    elif beam_width is None:  # see _greedy_retry
                        out = await engine.generate(ids, params, priority=priority, cache_key=cache_key)
                    else:
                        raise ExtractionError("invalid", _NO_BEAM.format(beam.beam_width), "")
            else:
                out = await engine.generate(ids + state.ids, own, priority=priority, cache_key=cache_key)
            state.output_tokens += len(out.token_ids)
            text = state.text + out.text
            token_ids = state.ids + list(out.token_ids)
            chosen = out.choices[0].logprobs if isinstance(out, GenerateOutput) else None  # beams have none
            logprobs = state.logprobs + _token_logprobs(chosen, len(out.token_ids))
            if plan is not None:  # decided once, on the first decode's value
                plan.add_context(engine, Context(ids, text, token_ids))
                await plan.run(engine, priority=priority, cache_key=cache_key)
                decided, shares = plan.outcome(engine)
                plan.forget(engine)
                plan = None
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
        if plan is not None:
            plan.abort(engine)
        if copy_from is not None:
            _forget(engine, params)  # the grammar embeds this source only
        if state.n > 1:
            _forget(engine, own)  # a retry's grammar embeds the refused values
    if confidence:
        return ExtractResult(None, value=value, prompt_tokens=len(ids), output_tokens=state.output_tokens,
                             attempts=state.n, confidence=confidence_of(engine, text, token_ids, logprobs, shares))
    return value


def _joined(sources: Sequence[str]) -> str:
    """The text decisions are scored on: every source the values may come from."""
    return "\n\n".join(s for s in sources if s.strip())


def _forget(engine: EngineClient, params: SamplingParams) -> None:
    """Drop a record's own grammar (its copied spans) from the engine's cache: it ends with the record."""
    engine.guided.forget(GuidedSpec.from_params(params))


_NO_BEAM = "none of the {} beams completed a value the grammar accepts"
