"""extract_many: a stream of records through the engine, at most `concurrency` in flight, each
record's value or its own error in completion order; waiting for room when the engine's queue is
full, retrying a refused value (extract/retry.py), scoring decisions (extract/decisions.py). One
record's decode is extract/run.py's."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio
import msgspec

from asyncpage.core.mailbox import Mailbox
from asyncpage.core.validation import check_cache_key, check_context, check_priority
from asyncpage.decoding.beam import BeamParams
from asyncpage.errors import (
    GrammarTimeoutError,
    InvalidRequestError,
    PromptTooLongError,
    SamplingError,
)
from asyncpage.extract import ends, grounding, types
from asyncpage.extract.beams import beam_for, refuse_asked_beams
from asyncpage.extract.decisions import Context, Plan
from asyncpage.extract.probes import submit_when_room
from asyncpage.extract.prompt import REFERENCES, PromptTemplate, copy_sources, render_prompt, schema_prompt
from asyncpage.guided import GuidedSpec
from asyncpage.params import SamplingParams

if TYPE_CHECKING:
    from asyncpage.core.client import EngineClient
    from asyncpage.core.request import Request

from asyncpage.extract.run import (
    _NO_BEAM,
    DEMOS_MIN_CONTEXT,
    Attempts,
    ExtractError,
    ExtractResult,
    Record,
    _check_retries,
    _forget,
    _joined,
    _token_logprobs,
    check_job,
    closed_validly,
    confidence_of,
    decider_for,
    decode_value,
    grounded,
    json_params,
    reference_context,
    retry_params,
)


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
                       confidence: bool = False, score_choices: bool | None = None, priority: int = 0,
                       cache_key: str | None = None) -> AsyncIterator[ExtractResult]:
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
    same after the reference records, not generated (asyncpage.extract.booleans). `score_choices` (default:
    on when a field is copied): each closed choice (an enum, `const` alternatives, the null-or-present choice
    of a nullable field) is decided by the model's likelihood of each option, calibrated on the reference
    records (asyncpage.extract.decisions).
    `max_retries`: a value the type's own validation refuses (a pydantic validator, a msgspec constraint or
    `__post_init__`) is decoded again, up to that many times, from its first refused top-level field, with the
    refused value excluded by the grammar (asyncpage.extract.retry; not for records with copied fields);
    `.attempts` counts the decodes. `confidence`: each result's `.confidence`, a probability per top-level
    field (`confidence_of`: a scored decision's share, a generated value's token probability). `priority`
    and `cache_key`: as engine.generate's, for every request of the job.

        async for r in engine.extract_many(docs, Invoice, concurrency=16):
            print(r.id, r.value if r.ok else r.error)
    """
    _check_retries(max_retries)
    check_priority(priority)
    check_cache_key(cache_key)
    check_job(prompt, examples, concurrency, schema, copy_fields)
    params, target = json_params(schema, params)
    spec = GuidedSpec.from_params(params)
    assert spec is not None and params.json_schema is not None
    await engine.guided.compile(spec)  # an unsupported schema fails the call here, before any record
    marked = ends.named_copies(grounding.mark(params.json_schema, copy_fields))
    copying = grounding.copied(marked)
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
    job_prompt = prompt
    decider = decider_for(marked, score_booleans, score_choices, copying)
    if decider is not None:  # measured once per engine on the reference records (kept on it)
        rendered = {}
        for text in REFERENCES:
            try:
                rendered[text] = _rendered(job_prompt, {"text": text})
            except InvalidRequestError:  # a prompt over other fields: no reference reads in it
                break

        async def reference(text: str) -> Context | None:
            if text not in rendered:
                return None
            return await reference_context(engine, rendered[text], params, marked, copying, beam_width, text,
                                           priority=priority, cache_key=cache_key)

        await decider.calibrate(engine, reference, "\0".join(rendered.values()), priority=priority,
                                cache_key=cache_key)

    wake = anyio.Event()

    def notify() -> None:
        wake.set()

    pending: dict[int, tuple[Any, int, Request]] = {}
    plans: dict[int, Plan] = {}  # a record's scored decisions in flight (decisions.py), by its position
    deciding: dict[int, tuple[Any, Request]] = {}  # records whose value waits for its plan
    decided_at: dict[int, dict[str, Any]] = {}  # a record's decided fields, by its position
    shares_at: dict[int, dict[str, float]] = {}  # their decisions' shares (confidence)
    states: dict[int, Attempts] = {}  # a record's decodes, by its position
    prompt_at: dict[int, list[int]] = {}  # its prompt's ids (a retry's prompt starts with them)
    base = msgspec.structs.replace(params, logprobs=0) if confidence else params  # a retry's, before its grammar
    ready: list[ExtractResult] = []
    source = _aiter(items).__aiter__()
    exhausted = False
    index = 0

    def mailbox() -> Mailbox:
        return Mailbox(notify)

    async def submit(ids: list[int], own: SamplingParams, beam: BeamParams | None = None) -> Request:
        return await submit_when_room(engine, ids, own, mailbox(), beam, priority=priority, cache_key=cache_key)

    async def finish(rid: Any, position: int, req: Request) -> None:
        """A record's decode is over: its result, or its next decode (a retry)."""
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
                again = await submit(prompt_at[position] + state.ids, nxt)
            except (PromptTooLongError, GrammarTimeoutError, InvalidRequestError):
                _forget(engine, nxt)  # the refusal stands
            else:
                state.n += 1
                pending[again.request_id] = (rid, position, again)
                return
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

    try:
        while True:
            while not exhausted and len(pending) + len(deciding) < concurrency and not ready:
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
                    own = grounded(params, marked, sources) if copying else params
                    beam = beam_for(engine, ids, own, beam_width, copying)
                    if beam is None and confidence:
                        own = msgspec.structs.replace(own, logprobs=0)
                    req = await submit(ids, own, beam)
                except (PromptTooLongError, GrammarTimeoutError, InvalidRequestError, RecursionError) as exc:
                    # RecursionError: a record nested past what its own preparation (copy sources, its
                    # grammar) can walk is that record's error, never the job's.
                    if copying and own is not params:
                        _forget(engine, own)  # a refusal is cached too
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
                if decider is not None and _joined(sources).strip():
                    # Its decisions, scored on its text (decisions.py), replace the model's in its value; the
                    # statements go now, beside its decode, the in-context probes once its value is there.
                    plans[index] = Plan(decider, _joined(sources), sources)
                    await plans[index].prepare(engine)
            for key in [k for k, (_, _, r) in pending.items() if r.finished or r.mailbox.error is not None]:
                rid, position, req = pending.pop(key)
                if beam_width is None and _greedy_retry(req):
                    try:
                        greedy = msgspec.structs.replace(req.params, logprobs=0) if confidence else req.params
                        again = await submit(list(req.prompt_token_ids), greedy)
                    except (PromptTooLongError, GrammarTimeoutError, InvalidRequestError):
                        pass  # the beams' own outcome stands
                    except BaseException:  # cancelled or the engine died: the grammar leaves with the record
                        if copying:
                            _forget(engine, req.params)
                        raise
                    else:
                        pending[again.request_id] = (rid, position, again)
                        continue
                plan = plans.get(position)
                if plan is not None:  # the value is there: its in-context decisions, then its result
                    out = req.mailbox.peek(0)
                    if req.mailbox.error is None and out is not None:
                        state = states[position]
                        plan.add_context(engine, Context(prompt_at[position], state.text + out.text,
                                                         state.ids + list(out.token_ids)))
                    deciding[position] = (rid, req)
                    continue
                await finish(rid, position, req)
            for position, plan in list(plans.items()):
                await plan.pump(engine, mailbox, priority=priority, cache_key=cache_key)
                if plan.done and position in deciding:
                    del plans[position]
                    decided_at[position], shares_at[position] = plan.outcome(engine)
                    plan.forget(engine)
                    rid, req = deciding.pop(position)
                    await finish(rid, position, req)
            if ready:
                yield ready.pop(0)
                continue
            if exhausted and not pending and not deciding:
                return
            await wake.wait()
            wake = anyio.Event()
    finally:
        # The caller stopped early (break, cancel, error): abort what is still in flight.
        for _, position, req in pending.values():
            engine.abort(req)
            if copying or (position in states and states[position].n > 1):
                _forget(engine, req.params)
        for plan in plans.values():
            plan.abort(engine)
        for _, req in deciding.values():
            if copying:
                _forget(engine, req.params)


def _greedy_retry(req: Request) -> bool:
    """Whether a default beam search's record is decoded again, greedy: its best beam did not finish
    the value (max_tokens, or every beam at a dead end). Beams have no budget closing, which closes a
    value validly at max_tokens; greedy does, so the record gets what it got before beams."""
    if req.beam is None or req.mailbox.error is not None:
        return False
    best = req.mailbox.peek(0)
    return best is None or best.finish_reason != "stop"


# Every beam stopped at a dead end (a copied field's opening quote where no span of the text fits).
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


def _result(rid: Any, req: Request, target: Any, decided: dict[str, Any], state: Attempts) -> Outcome:
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
