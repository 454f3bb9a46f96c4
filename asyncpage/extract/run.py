"""Extraction jobs: typed values from many records, with bounded concurrency.

`extract_many` keeps at most `concurrency` requests in the engine and pulls the next record only
when one finishes, so memory stays flat whatever the number of records. Results come in completion
order, each tagged with its record's id, carrying the value or that record's own error; one bad
record never stops the job.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio
import msgspec

from asyncpage.core.mailbox import Mailbox
from asyncpage.core.validation import check_context
from asyncpage.decoding.beam import BeamParams
from asyncpage.errors import (
    ExtractionError,
    GrammarTimeoutError,
    InvalidRequestError,
    PromptTooLongError,
    QueueFullError,
    SamplingError,
)
from asyncpage.extract import booleans as flags
from asyncpage.extract import grounding, types
from asyncpage.extract import retry as redo
from asyncpage.extract.beams import beam_for, beam_params, refuse_asked_beams
from asyncpage.extract.prompt import PromptTemplate, copy_sources, render_prompt, schema_prompt
from asyncpage.guided import GuidedSpec
from asyncpage.outputs import Beam, GenerateOutput
from asyncpage.params import SamplingParams

if TYPE_CHECKING:
    from asyncpage.core.client import EngineClient
    from asyncpage.core.request import Request

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
    """See AsyncEngine.extract."""
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


async def _aiter(items: Iterable[Record] | AsyncIterable[Record]) -> AsyncIterator[Record]:
    if isinstance(items, AsyncIterable):
        async for x in items:
            yield x
    else:
        for x in items:
            yield x


async def extract_many(engine: EngineClient, items: Iterable[Record] | AsyncIterable[Record], schema: Any, *,
                       prompt: PromptTemplate | None = None, concurrency: int = 32,
                       params: SamplingParams | None = None,
                       id_field: str = "id", max_prompt_tokens: int | None = None,
                       copy_fields: Sequence[str] | str | None = None,
                       examples: Sequence[Mapping[str, Any]] = (), beam_width: int | None = None,
                       score_booleans: bool | None = None, max_retries: int = 0,
                       confidence: bool = False) -> AsyncIterator[ExtractResult]:
    """Extract a typed value from each record, at most `concurrency` in flight.

    `items`: records (dicts, or plain strings as {"text": ...}), sync or async iterable, read
    lazily. `prompt`: a template over the record's fields, a function of the record, or by
    default one written from the schema (each field, its description and allowed values) over
    the record's "text", with `examples` (records with their labeled "value") as solved cases.
    `copy_fields` (names, or "auto") or `"x-copy": true` in the schema: those string fields are
    copied from the record (the fields its prompt shows), never invented. `beam_width`: each value
    is the best of that many beams (up to concurrency x beam_width sequences run at once); by
    default 4 when a field is copied (4x the time, more values right: see extract_beams.beam_params), else 1.
    Yields ExtractResult in completion order, each with the record's `id_field` (or its 1-based
    position), its value or its own error. `score_booleans` (default: on when a field is copied):
    each top-level boolean property is decided by how likely its statement is after the record's
    text (the fields its prompt shows; its name as a heading, without a description), against the
    same after four reference records, not generated (asyncpage.extract.booleans).
    `max_retries`: a value the type's own validation refuses (a pydantic validator, a msgspec constraint or
    `__post_init__`) is decoded again, up to that many times, from its first refused top-level field, with the
    refused value excluded by the grammar (asyncpage.extract.retry; not for records with copied fields);
    `.attempts` counts the decodes. `confidence`: each result's `.confidence`, a probability per top-level
    field (`confidence_of`).

        async for r in engine.extract_many(docs, Invoice, concurrency=16):
            print(r.id, r.value if r.ok else r.error)
    """
    _check_retries(max_retries)
    check_job(prompt, examples, concurrency, schema, copy_fields)
    params, target = json_params(schema, params)
    spec = GuidedSpec.from_params(params)
    assert spec is not None and params.json_schema is not None
    await engine.guided.compile(spec)  # an unsupported schema fails the call here, before any record
    marked = grounding.mark(params.json_schema, copy_fields)
    copying = grounding.copied(marked)
    scoring = (copying if score_booleans is None else score_booleans) and bool(flags.statements(marked))
    c = engine.config
    refuse_asked_beams(params, beam_width, max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens)
    if copying:
        # An x-copy the grammar cannot express (or a pattern llguidance refuses) fails the call here,
        # not every record: compile the grammar once over a stand-in text.
        probe = GuidedSpec.from_params(grounded(params, marked, ["x"]))
        try:
            await engine.guided.compile(probe)  # type: ignore[arg-type]  # never None: params are guided
        finally:
            engine.guided.forget(probe)
    if prompt is None:
        prompt = schema_prompt(marked, examples=examples, copied=grounding.copied_names(marked),
                               demos=engine.config.max_model_len >= DEMOS_MIN_CONTEXT)

    wake = anyio.Event()

    def notify() -> None:
        wake.set()

    pending: dict[int, tuple[Any, int, Request]] = {}
    decided_at: dict[int, dict[str, bool]] = {}  # a record's scored booleans, by its position
    shares_at: dict[int, dict[str, float]] = {}  # their decisions' shares (confidence)
    states: dict[int, Attempts] = {}  # a record's decodes, by its position
    prompt_at: dict[int, list[int]] = {}  # its prompt's ids (a retry's prompt starts with them)
    base = msgspec.structs.replace(params, logprobs=0) if confidence else params  # a retry's, before its grammar
    ready: list[ExtractResult] = []
    source = _aiter(items).__aiter__()
    exhausted = False
    index = 0
    try:
        while True:
            while not exhausted and len(pending) < concurrency and not ready:
                try:
                    record = await source.__anext__()
                except StopAsyncIteration:
                    exhausted = True
                    break
                index += 1
                if isinstance(record, str):
                    record = {"text": record}
                rid = record.get(id_field, index) if isinstance(record, Mapping) else index
                own = params
                try:
                    if not isinstance(record, Mapping):
                        raise InvalidRequestError("record", f"must be a JSON object or a string, got "
                                                            f"{type(record).__name__}")
                    text = _rendered(prompt, record)
                    ids = await engine.tokenize(text)
                    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
                        raise PromptTooLongError("prompt", f"{len(ids)} tokens > max_prompt_tokens={max_prompt_tokens}")
                    # Before its grammar: a record too long for the context is refused at once, not
                    # after seconds spent building the spans of megabytes of text.
                    check_context(ids, engine.config.max_model_len)
                    sources = copy_sources(prompt, record, id_field)
                    if scoring:  # its booleans, decided on its text (flags.py), replace the model's in its value
                        offset = await flags.offsets(engine, marked)  # measured once, kept on the engine
                        decided_at[index], shares_at[index] = await _decide(engine, marked, _joined(sources), offset,
                                                                            confidence)
                    own = grounded(params, marked, sources) if copying else params
                    beam = beam_for(engine, ids, own, beam_width, copying)
                    if beam is None and confidence:
                        own = msgspec.structs.replace(own, logprobs=0)
                    req = await _submit_when_room(engine, ids, own, Mailbox(notify), beam)
                except (PromptTooLongError, GrammarTimeoutError, InvalidRequestError, RecursionError) as exc:
                    # RecursionError: a record nested past what its own preparation (copy sources, its
                    # grammar) can walk is that record's error, never the job's.
                    if copying and own is not params:
                        _forget(engine, own)  # a refusal is cached too
                    decided_at.pop(index, None)
                    shares_at.pop(index, None)
                    ready.append(ExtractResult(rid, error=_submit_error(exc), position=index))
                    continue
                except BaseException:  # cancelled while compiling: the record's grammar leaves with it
                    if copying and own is not params:
                        _forget(engine, own)
                    raise
                states[index] = Attempts()
                states[index].n = 1
                prompt_at[index] = ids
                pending[req.request_id] = (rid, index, req)
            for key in [k for k, (_, _, r) in pending.items() if r.finished or r.mailbox.error is not None]:
                rid, position, req = pending.pop(key)
                if beam_width is None and _greedy_retry(req):
                    try:
                        greedy = msgspec.structs.replace(req.params, logprobs=0) if confidence else req.params
                        again = await _submit_when_room(engine, list(req.prompt_token_ids), greedy,
                                                        Mailbox(notify))
                    except (PromptTooLongError, GrammarTimeoutError, InvalidRequestError):
                        pass  # the beams' own outcome stands
                    except BaseException:  # cancelled or the engine died: the grammar leaves with the record
                        if copying:
                            _forget(engine, req.params)
                        raise
                    else:
                        pending[again.request_id] = (rid, position, again)
                        continue
                state = states[position]
                outcome = _result(rid, req, target, decided_at.get(position, {}), state)
                if state.n > 1:
                    _forget(engine, req.params)  # a retry's grammar embeds the refused values
                nxt = None
                if outcome.refused is not None and state.n <= max_retries and not copying:
                    nxt = retry_params(engine, base, state, outcome.text, outcome.token_ids, outcome.logprobs,
                                       outcome.refused)
                if nxt is not None:
                    try:
                        again = await _submit_when_room(engine, prompt_at[position] + state.ids, nxt,
                                                        Mailbox(notify))
                    except (PromptTooLongError, GrammarTimeoutError, InvalidRequestError):
                        _forget(engine, nxt)  # the refusal stands
                    else:
                        state.n += 1
                        pending[again.request_id] = (rid, position, again)
                        continue
                result = outcome.result
                extra: dict[str, Any] = {"attempts": state.n, "position": position}
                if confidence and result.ok:
                    extra["confidence"] = confidence_of(engine, outcome.text, outcome.token_ids, outcome.logprobs,
                                                        shares_at.get(position, {}))
                ready.append(msgspec.structs.replace(result, **extra))
                for at in (decided_at, shares_at, states, prompt_at):
                    at.pop(position, None)
                if copying:
                    _forget(engine, req.params)  # this record's grammar ends with it
            if ready:
                yield ready.pop(0)
                continue
            if exhausted and not pending:
                return
            await wake.wait()
            wake = anyio.Event()
    finally:
        # The caller stopped early (break, cancel, error): abort what is still in flight.
        for _, position, req in pending.values():
            engine.abort(req)
            if copying or (position in states and states[position].n > 1):
                _forget(engine, req.params)


async def _submit_when_room(engine: EngineClient, prompt: list[int], params: SamplingParams, mailbox: Mailbox,
                            beam: BeamParams | None = None) -> Request:
    """engine.submit, waiting while the engine's queue is full (QueueFullError, max_queued_requests): a
    job shares its engine with other callers, and its records wait for room rather than fail. A dead
    or stopped engine raises its own error, so this never waits on an engine that cannot serve."""
    delay = 0.02
    while True:
        try:
            return await engine.submit(prompt, params, mailbox, beam=beam)
        except QueueFullError as exc:
            await anyio.sleep(min(delay, exc.retry_after))
            delay = min(delay * 2, 0.5)


def _forget(engine: EngineClient, params: SamplingParams) -> None:
    """Drop a record's own grammar (its copied spans) from the engine's cache: it ends with the record."""
    engine.guided.forget(GuidedSpec.from_params(params))


def _greedy_retry(req: Request) -> bool:
    """Whether a default beam search's record is decoded again, greedy: its best beam did not finish
    the value (max_tokens, or every beam at a dead end). Beams have no budget closing, which closes a
    value validly at max_tokens; greedy does, so the record gets what it got before beams."""
    if req.beam is None or req.mailbox.error is not None:
        return False
    best = req.mailbox.peek(0)
    return best is None or best.finish_reason != "stop"


# Every beam stopped at a dead end (a copied field's opening quote where no span of the text fits).
_NO_BEAM = "none of the {} beams completed a value the grammar accepts"


def _rendered(prompt: PromptTemplate, record: Mapping[str, Any]) -> str:
    """The record's prompt; a field the template writes as JSON that cannot be (nested past json's
    depth limit, a set, a cycle: extract_many takes any mapping) is the record's InvalidRequestError."""
    try:
        return render_prompt(prompt, record)
    except InvalidRequestError:
        raise
    except RecursionError:
        raise InvalidRequestError("record", "nested too deeply to write into the prompt") from None
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError("record", f"cannot be written into the prompt: {exc}") from None


def _submit_error(exc: Exception) -> ExtractError:
    if isinstance(exc, RecursionError):
        return ExtractError("invalid_input", "the record is nested too deeply to prepare")
    if isinstance(exc, PromptTooLongError):
        return ExtractError("prompt_too_long", exc.message)
    if isinstance(exc, GrammarTimeoutError):  # the engine's moment, not the record's: retriable
        return ExtractError("engine_error", str(exc))
    return ExtractError("invalid_input", str(exc))


class Outcome(NamedTuple):
    """A finished request's result, and what a retry needs: the refusal, the whole value's text, tokens and
    their log-probabilities (the kept prefix's included)."""

    result: ExtractResult
    refused: types.Refused | None = None
    text: str = ""
    token_ids: Sequence[int] = ()
    logprobs: Sequence[float | None] = ()


def _result(rid: Any, req: Request, target: Any, decided: dict[str, bool], state: Attempts) -> Outcome:
    n_prompt = len(req.prompt_token_ids) - len(state.ids)
    if isinstance(req.mailbox.error, SamplingError):  # this record's own failure
        return Outcome(ExtractResult(rid, error=ExtractError("invalid_output", str(req.mailbox.error)),
                                     prompt_tokens=n_prompt))
    if req.mailbox.error is not None:  # the engine's failure, not the record's: a job retries these
        return Outcome(ExtractResult(rid, error=ExtractError("engine_error", str(req.mailbox.error)),
                                     prompt_tokens=n_prompt))
    if req.beam is not None and req.beam.done and not req.beam.finished:
        return Outcome(ExtractResult(rid, error=ExtractError("invalid_output", _NO_BEAM.format(req.beam.width)),
                                     prompt_tokens=n_prompt))
    out = req.mailbox.drain().get(0)
    n_out = len(out.token_ids) if out else 0
    state.output_tokens += n_out
    n_all = state.output_tokens
    text = state.text + (out.text if out else "")
    token_ids = state.ids + (list(out.token_ids) if out else [])
    logprobs = state.logprobs + _token_logprobs(out.logprobs if out else None, n_out)
    if out is not None and out.finish_reason == "length" and closed_validly(req.seqs[0].matcher if req.seqs else None,
                                                                              req.params, out.token_ids):
        try:
            value = decode_value(text, target, decided)
        except msgspec.DecodeError:
            pass
        else:
            return Outcome(ExtractResult(rid, value=value, prompt_tokens=n_prompt, output_tokens=n_all,
                                         closed_early=True), None, text, token_ids, logprobs)
    if out is None or out.finish_reason != "stop":
        reason = out.finish_reason if out else "abort"
        return Outcome(ExtractResult(rid, error=ExtractError(
            "truncated", f"generation ended by {reason} after {n_out} tokens: {text[-80:]!r}"),
            prompt_tokens=n_prompt, output_tokens=n_all))
    try:
        value = decode_value(text, target, decided)
    except msgspec.DecodeError as exc:
        return Outcome(ExtractResult(rid, error=ExtractError("invalid_output", str(exc)), prompt_tokens=n_prompt,
                                     output_tokens=n_all), exc if isinstance(exc, types.Refused) else None,
                       text, token_ids, logprobs)
    return Outcome(ExtractResult(rid, value=value, prompt_tokens=n_prompt, output_tokens=n_all), None, text,
                   token_ids, logprobs)
