"""Preparing a chat turn: OpenAI-shaped messages, tools and options in, the engine request(s) to send
and how to read their output back out (chat() and chat_stream() are run.py's).

    turn = await prepare(engine, [{"role": "user", "content": "Weather in Paris?"}], tools=[weather_tool])
    turn.prompt, turn.params.grammar, turn.parser()

Built only on the engine's public surface (tokenizer, the grammar manager, SamplingParams): a turn is
the rendered template's ids, params whose grammar comes from grammar.py (kept per tool set, cache.py),
and, when its reasoning has a budget, the free first phase that phases.py runs before the answer.

Preparing a turn (checking, rendering, tool grammars and their schema rewrites, tokenizing) runs in
a worker thread, never on the event loop, under a small limiter of its own (PREPARE_THREADS) and
one deadline (the engine's grammar_compile_timeout): a hostile request costs at most that much CPU,
and cannot take the threads every other to_thread caller of the process shares.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from anyio.lowlevel import RunVar

from asyncpage.chat import formats, grammar, messages, reasoning
from asyncpage.chat.cache import cached_build
from asyncpage.chat.parse import Parsed, StreamParser
from asyncpage.chat.read import _Read, _StopCut  # noqa: F401 (read here by tests and older callers)
from asyncpage.errors import GrammarTimeoutError, InvalidRequestError, QueueFullError
from asyncpage.guided.backend import CompileTimeout, Deadline
from asyncpage.guided.guards import guards_for
from asyncpage.params import SamplingParams

if TYPE_CHECKING:
    from asyncpage.core.client import EngineClient


@dataclass(frozen=True)
class Options:
    """What a caller may ask of a chat turn besides its messages (chat()'s keywords)."""

    tools: Any = None
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True  # under "auto" and "required"; a named tool_choice is one call
    response_format: Any = None
    params: SamplingParams | None = None
    tool_format: str | None = None  # "hermes" | "llama3" | "mistral" | "generic": overrides the detected format
    max_reasoning_tokens: int | None = None
    reasoning_effort: str | None = None  # reasoning.EFFORT_BUDGETS
    chat_template: str | None = None  # a Jinja template for this turn, in place of the engine's
    reasoning_markers: Any = None  # (open, close) | ReasoningMarkers | False (no reasoning) | None: detected


@dataclass(frozen=True)
class Budget:
    """A turn whose reasoning is bounded (phases.py): `think` generates the section freely, up to the
    budget, and stops at its closing marker (a stop string, or `close_token` when the marker is one
    special token); then the engine writes `close` (the marker and its gap) and the answer runs
    under the turn's params (its grammar applies from there on)."""

    think: SamplingParams
    close: str
    close_token: int | None
    skip_special_tokens: bool


@dataclass(frozen=True)
class Turn:
    """One prepared turn: the prompt ids, the sampling params (grammar included), how to read it."""

    prompt: list[int]
    params: SamplingParams
    spec: grammar.TurnSpec
    stops: tuple[str, ...] = ()  # the caller's stop strings, when this layer applies them (see _prepare_steps)
    plan: reasoning.Plan = field(default_factory=lambda: reasoning.Plan(None))
    budget: Budget | None = None
    parts: tuple[tuple[str, str], ...] = ()  # grammar.parts_alone's, compiled before the turn runs (run.py)

    def parse(self, text: str, final: bool) -> Parsed:
        return self.parser().feed(text, final).parsed()

    def parser(self) -> StreamParser:
        """A parser for this turn's output, fed chunk by chunk as it streams (the engine's closing
        marker included, where phases.py wrote one)."""
        s, p = self.spec, self.plan
        return StreamParser(s.fmt, calls_allowed=s.calls_allowed, reasoning=p.markers is not None,
                            in_reasoning=p.opened, forced=s.calls_allowed and s.mode != "auto",
                            markers=p.markers, names=frozenset(t.name for t in s.tools) if s.spelled else None)


def _model_type(engine: EngineClient) -> str:
    return str(getattr(getattr(engine, "model_config", None), "model_type", "") or "")


# Threads that prepare chat turns at once (per event loop). Preparation is Python holding the GIL,
# so more threads would add no throughput, only let more hostile requests burn CPU together.
PREPARE_THREADS = 2
# The preparation deadline when the engine states none (its grammar_compile_timeout otherwise).
PREPARE_TIMEOUT = 5.0
_LIMITER: RunVar[anyio.CapacityLimiter] = RunVar("asyncpage_chat_prepare_limiter")


def _limiter() -> anyio.CapacityLimiter:
    try:
        return _LIMITER.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(PREPARE_THREADS)
        _LIMITER.set(limiter)
        return limiter


def _timeout(engine: EngineClient) -> float:
    t = getattr(getattr(engine, "guided", None), "compile_timeout", None)
    return float(t) if isinstance(t, int | float) and 0 < t < math.inf else PREPARE_TIMEOUT


def _prepare_sync(engine: EngineClient, msgs: Any, options: Options, deadline: Deadline) -> Turn:
    """The whole preparation, checking `deadline` between its steps and inside the schema rewrites:
    past it, a GrammarTimeoutError naming the part that was being prepared."""
    try:
        return _prepare_steps(engine, msgs, options, deadline)
    except CompileTimeout:
        raise _too_slow("messages", deadline) from None
    except RecursionError:  # a template recursing over the caller's values: theirs to make smaller
        raise InvalidRequestError("messages", "are nested too deeply to render") from None


def _too_slow(field: str, deadline: Deadline) -> GrammarTimeoutError:
    return GrammarTimeoutError(field, f"preparing this chat turn took longer than {deadline.seconds:g} s")


def _prepare_steps(engine: EngineClient, msgs: Any, o: Options, deadline: Deadline) -> Turn:
    params = o.params if o.params is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError("params", f"must be SamplingParams, got {type(params).__name__}")
    if params.n != 1:
        raise InvalidRequestError("n", "a chat turn has one choice (send several requests for more)")
    tool_list = messages.parse_tools(o.tools)
    mode = messages.parse_tool_choice(o.tool_choice, tool_list)
    answer = messages.parse_response_format(o.response_format)
    limit = reasoning.budget(o.max_reasoning_tokens, o.reasoning_effort)
    norm = messages.normalize(msgs)
    deadline.check()
    tok = engine.tokenizer
    template = messages.template_of(tok, _model_type(engine), o.chat_template, o.reasoning_markers)
    if o.tool_format is not None and o.tool_format not in formats.FORMATS:
        raise InvalidRequestError("tool_format", f"must be one of {sorted(formats.FORMATS)}")
    fmt = formats.FORMATS[o.tool_format] if o.tool_format else formats.detect(template.text, tok)
    # tool_choice="none": the tools stay out of the prompt too, so nothing tempts the model to call.
    shown = tool_list if mode != "none" else []
    text = messages.render(tok, template, norm, shown, fmt)
    deadline.check()
    plan = reasoning.Plan.of(text, template.markers, limit)
    if plan.opened and plan.budget is None and params.guided:
        # The caller's own grammar must not be forced into the section the prompt opened: it applies
        # to the answer, after the section (phases.py), with only max_tokens bounding the section.
        plan = reasoning.Plan(plan.markers, True, params.max_tokens)
    text += plan.suffix
    marks = plan.markers or reasoning.THINK
    two_phase = plan.budget is not None
    # With a budget the grammar is the answer's alone: the section before it is phase 1's free text.
    # A named tool_choice is one call of that tool (vLLM's and OpenAI's behaviour, and what instructor's
    # TOOLS mode and other forced-function clients read back); parallel_tool_calls applies to the others.
    parallel = bool(o.parallel_tool_calls) and mode in ("auto", "required")
    spec = grammar.TurnSpec(fmt, tool_list, mode, parallel, answer,
                            plan.markers is not None and not two_phase, plan.opened and not two_phase,
                            params.json_separators, params.json_closed_objects, markers=marks)
    try:
        lark = cached_build(spec, tok, deadline)
    except CompileTimeout:
        raise _too_slow("tools" if spec.calls_allowed else "response_format", deadline) from None
    if lark is not None and params.guided:
        raise InvalidRequestError("params", "tools and response_format set the grammar; params must not "
                                  "carry json_schema, regex, choice or grammar as well")
    special = grammar.lit_of(tok).special
    if lark is not None:
        # A turn that is JSON only (an answer schema, or calls forced, and no reasoning section) gets the runaway
        # guards json_schema has: "age": 18000... ran to max_tokens under chat.completions.parse (the review).
        only_json = not spec.reasoning and not two_phase and (
            spec.answer_schema is not None or (spec.calls_allowed and spec.mode != "auto"))
        params = msgspec.structs.replace(params, grammar=lark, json_guards=only_json)
        if only_json:  # each guard off where the schemas ask for long values, as under json_schema
            schemas = [spec.answer_schema] if spec.answer_schema is not None else \
                [t.parameters for t in spec.callable_tools]
            g = guards_for(schemas, params.max_number_digits, params.max_string_repeats)
            params = msgspec.structs.replace(params, max_number_digits=g.max_digits, max_string_repeats=g.max_repeats)
    stops: tuple[str, ...] = ()
    if params.stop and (spec.calls_allowed or two_phase):
        # A stop string met inside a call would cut its arguments mid-JSON, and a grammar-forced call
        # is not the model's text to stop; a budgeted turn runs in two requests: here they apply to
        # reasoning and content only, across both.
        stops, params = params.stop, msgspec.structs.replace(params, stop=())
    shown_markers = [fmt.trigger if spec.calls_allowed else "", *((marks.open, marks.close) if plan.markers else ())]
    if any(m in special for m in shown_markers if m):
        # The parser reads the markers from the text: special tokens must not be skipped.
        params = msgspec.structs.replace(params, skip_special_tokens=False)
    budget = _budget(plan, params, special) if two_phase else None
    try:
        ids = list(tok(text, add_special_tokens=False)["input_ids"])
    except Exception as exc:  # a lone surrogate and the like (valid JSON): the caller's text, not our fault
        raise InvalidRequestError("messages", f"the tokenizer refused the rendered conversation: {exc}") from exc
    deadline.check()
    return Turn(ids, params, spec, stops, plan, budget, grammar.parts_alone(lark))


def _budget(plan: reasoning.Plan, params: SamplingParams, special: dict[str, int]) -> Budget:
    """Phase 1 of a bounded section: the caller's sampling, no grammar, at most the budget (and
    max_tokens), stopped by the closing marker."""
    assert plan.markers is not None and plan.budget is not None
    close = plan.markers.close
    token = special.get(close)
    think = msgspec.structs.replace(
        params, max_tokens=max(1, min(plan.budget, params.max_tokens)), grammar=None, json_schema=None, regex=None,
        choice=None, stop=() if token is not None else (close,),
        stop_token_ids=tuple(params.stop_token_ids) + ((token,) if token is not None else ()))
    return Budget(think, close + plan.markers.gap, token, params.skip_special_tokens)


async def prepare(engine: EngineClient, msgs: Any, **options: Any) -> Turn:
    """The turn chat() and chat_stream() send: prompt ids, params with the turn's grammar, how to
    read the output; `options` are Options' fields. Prepared in a worker thread (see the module's
    docstring); raises InvalidRequestError (GrammarTimeoutError past the deadline) for what the
    request got wrong."""
    try:
        opts = Options(**options)
    except TypeError as exc:
        raise InvalidRequestError("options", str(exc)) from None
    timeout = _timeout(engine)
    deadline = Deadline(timeout)

    def run() -> Turn:
        if deadline.at != -math.inf:  # not expired by a cancelled caller: its time starts now
            deadline.at = time.monotonic() + timeout
        return _prepare_sync(engine, msgs, opts, deadline)

    return await _in_worker(run, deadline, timeout)


async def _in_worker(fn: Callable[[], Turn], deadline: Deadline, wait: float) -> Turn:
    """`fn` in a thread of the preparation limiter, its deadline counted from when the thread starts
    (time spent waiting behind other callers' preparations is not this one's). Waiting more than
    `wait` s for a thread is a QueueFullError (HTTP 429 with Retry-After): the preparation threads are
    busy. A caller that goes away (a client disconnect cancels it) expires `deadline`, so the thread
    stops at its next check instead of running on to the end; the limiter's token is held until the
    thread has really ended."""
    limiter = _limiter()
    with anyio.move_on_after(wait) as waiting:
        await limiter.acquire()
    if waiting.cancelled_caught:
        raise QueueFullError(f"chat preparation is busy (its {limiter.total_tokens:g} threads were taken for "
                             f"{wait:g} s); retry later", retry_after=1.0)
    try:
        return await _in_thread(fn, deadline)
    finally:
        limiter.release()


async def _in_thread(fn: Callable[[], Turn], deadline: Deadline) -> Turn:
    result: list[Turn] = []
    failure: list[BaseException] = []

    async def expire_on_cancel() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            deadline.at = -math.inf

    async with anyio.create_task_group() as tg:
        tg.start_soon(expire_on_cancel)
        try:
            result.append(await anyio.to_thread.run_sync(fn))  # not abandoned: the token outlives the thread
        except Exception as exc:  # raised below, outside the task group (no ExceptionGroup around it)
            failure.append(exc)
        finally:
            tg.cancel_scope.cancel()
    # A caller cancelled meanwhile gets its cancellation, not the timeout its cancelling caused.
    await anyio.lowlevel.checkpoint_if_cancelled()
    if failure:
        raise failure[0]
    return result[0]


