"""chat() and chat_stream(): OpenAI-shaped messages and tools in, typed results or deltas out.

    res = await engine.chat([{"role": "user", "content": "Weather in Paris?"}], tools=[weather_tool],
                            tool_choice="required")
    res.tool_calls[0].name, json.loads(res.tool_calls[0].arguments)

Built only on the engine's public surface (tokenizer, stream(), SamplingParams): a turn is one
engine request whose prompt is the rendered template and whose grammar comes from grammar.py.

Preparing a turn (checking, rendering, tool grammars and their schema rewrites, tokenizing) runs in
a worker thread, never on the event loop, under a small limiter of its own (PREPARE_THREADS) and
one deadline (the engine's grammar_compile_timeout): a hostile request costs at most that much CPU,
and cannot take the threads every other to_thread caller of the process shares.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from anyio.lowlevel import RunVar

from asyncpage.chat import formats, grammar, messages
from asyncpage.chat.parse import THINK_CLOSE, THINK_OPEN, Parsed, StreamParser, held
from asyncpage.chat.types import ChatDelta, ChatFinishReason, ChatResult, ToolCall, ToolCallDelta, Usage
from asyncpage.errors import GrammarError, GrammarTimeoutError, InvalidRequestError, QueueFullError
from asyncpage.guided.backend import CompileTimeout, Deadline
from asyncpage.params import SamplingParams

if TYPE_CHECKING:
    from asyncpage.core.client import EngineClient


@dataclass(frozen=True)
class Turn:
    """One prepared turn: the prompt ids, the sampling params (grammar included), how to read it."""

    prompt: list[int]
    params: SamplingParams
    spec: grammar.TurnSpec
    stops: tuple[str, ...] = ()  # the caller's stop strings, when this layer applies them (see _prepare_sync)

    def parse(self, text: str, final: bool) -> Parsed:
        return self.parser().feed(text, final).parsed()

    def parser(self) -> StreamParser:
        """A parser for this turn's output, fed chunk by chunk as it streams."""
        s = self.spec
        return StreamParser(s.fmt, calls_allowed=s.calls_allowed, reasoning=s.reasoning,
                            in_reasoning=s.in_reasoning, forced=s.calls_allowed and s.mode != "auto")


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


def _prepare_sync(engine: EngineClient, msgs: Any, tools: Any, tool_choice: Any, parallel_tool_calls: bool,
                  response_format: Any, params: SamplingParams | None, tool_format: str | None,
                  deadline: Deadline) -> Turn:
    """The whole preparation, checking `deadline` between its steps and inside the schema rewrites:
    past it, a GrammarTimeoutError naming the part that was being prepared."""
    try:
        return _prepare_steps(engine, msgs, tools, tool_choice, parallel_tool_calls, response_format, params,
                              tool_format, deadline)
    except CompileTimeout:
        raise _too_slow("messages", deadline) from None
    except RecursionError:  # a template recursing over the caller's values: theirs to make smaller
        raise InvalidRequestError("messages", "are nested too deeply to render") from None


def _too_slow(field: str, deadline: Deadline) -> GrammarTimeoutError:
    return GrammarTimeoutError(field, f"preparing this chat turn took longer than {deadline.seconds:g} s")


def _prepare_steps(engine: EngineClient, msgs: Any, tools: Any, tool_choice: Any, parallel_tool_calls: bool,
                   response_format: Any, params: SamplingParams | None, tool_format: str | None,
                   deadline: Deadline) -> Turn:
    params = params if params is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError("params", f"must be SamplingParams, got {type(params).__name__}")
    if params.n != 1:
        raise InvalidRequestError("n", "a chat turn has one choice (send several requests for more)")
    tool_list = messages.parse_tools(tools)
    mode = messages.parse_tool_choice(tool_choice, tool_list)
    answer = messages.parse_response_format(response_format)
    norm = messages.normalize(msgs)
    deadline.check()
    tok = engine.tokenizer
    template = messages.template_of(tok, _model_type(engine))
    if tool_format is not None and tool_format not in formats.FORMATS:
        raise InvalidRequestError("tool_format", f"must be one of {sorted(formats.FORMATS)}")
    fmt = formats.FORMATS[tool_format] if tool_format else formats.detect(template.text, tok)
    # tool_choice="none": the tools stay out of the prompt too, so nothing tempts the model to call.
    shown = tool_list if mode != "none" else []
    text = messages.render(tok, template, norm, shown, fmt)
    deadline.check()
    in_reasoning = template.reasoning and text.rstrip().endswith(THINK_OPEN)
    spec = grammar.TurnSpec(fmt, tool_list, mode, bool(parallel_tool_calls), answer, template.reasoning,
                            in_reasoning, params.json_separators, params.json_closed_objects)
    try:
        lark = grammar.build(spec, tok, deadline)
    except CompileTimeout:
        raise _too_slow("tools" if spec.calls_allowed else "response_format", deadline) from None
    if lark is not None and params.guided:
        raise InvalidRequestError("params", "tools and response_format set the grammar; params must not "
                                  "carry json_schema, regex, choice or grammar as well")
    markers = [m for m in ((fmt.trigger if spec.calls_allowed else ""), THINK_OPEN if template.reasoning else "",
                           THINK_CLOSE if template.reasoning else "") if m]
    special = grammar._Lit(tok).special
    if lark is not None:
        params = msgspec.structs.replace(params, grammar=lark)
    stops: tuple[str, ...] = ()
    if spec.calls_allowed and params.stop:
        # A stop string met inside a call would cut its arguments mid-JSON, and a grammar-forced call
        # is not the model's text to stop: here they apply to reasoning and content only.
        stops, params = params.stop, msgspec.structs.replace(params, stop=())
    if any(m in special for m in markers):
        # The parser reads the markers from the text: special tokens must not be skipped.
        params = msgspec.structs.replace(params, skip_special_tokens=False)
    try:
        ids = list(tok(text, add_special_tokens=False)["input_ids"])
    except Exception as exc:  # a lone surrogate and the like (valid JSON): the caller's text, not our fault
        raise InvalidRequestError("messages", f"the tokenizer refused the rendered conversation: {exc}") from exc
    deadline.check()
    return Turn(ids, params, spec, stops)


@dataclass
class _Read:
    """The turn as read after a chunk: spans into the parser's text (cut at a stop string when one
    was met), the number of complete calls, whether a call has begun. It holds no text: a string
    kept alive between chunks could not grow in place (see StreamParser.feed)."""

    parser: StreamParser
    reasoning: tuple[int, int]
    content: tuple[int, int]
    n_calls: int
    has_calls: bool

    @classmethod
    def of(cls, p: StreamParser) -> _Read:
        return cls(p, p.reasoning, p.content, len(p.calls), p.has_calls)

    def field(self, name: str) -> str:
        a, b = getattr(self, name)
        return self.parser.text[a:b]


class _StopCut:
    """The caller's stop strings, applied to reasoning and content where this layer applies them
    (see _prepare_steps). Each chunk searches only what is new (plus a stop's length of overlap)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.longest = max(len(x) for x in stops)
        self.searched: dict[str, int] = {}

    def apply(self, r: _Read, final: bool) -> bool:
        """Cut `r` at the first stop string in its reasoning or content (dropping all after it) and
        say whether one was met; before the end, hold back a tail that could still grow into one."""
        s = r.parser.text
        for name in ("reasoning", "content"):
            a, b = getattr(r, name)
            # Searched before up to `done`: a stop found now ends past it (spans only grow at their end).
            done = self.searched.get(name)
            lo = a if done is None else max(a, done - self.longest + 1)
            self.searched[name] = b if done is None else max(b, done)
            hits = [i for i in (s.find(x, lo, b) for x in self.stops) if i >= 0]
            if hits:
                setattr(r, name, (a, min(hits)))
                if name == "reasoning":
                    r.content = (r.content[0], r.content[0])
                r.n_calls, r.has_calls = 0, False
                return True
        if not final and not r.has_calls:
            # Only the part still growing is held: content once it began, else the reasoning.
            name = "content" if r.content[1] > r.content[0] else "reasoning"
            a, b = getattr(r, name)
            tail = s[max(a, b - self.longest):b]
            setattr(r, name, (a, b - max(held(tail, x) for x in self.stops)))
        return False


async def prepare(engine: EngineClient, msgs: Any, *, tools: Any = None, tool_choice: Any = "auto",
                  parallel_tool_calls: bool = True, response_format: Any = None,
                  params: SamplingParams | None = None, tool_format: str | None = None) -> Turn:
    """The turn chat() and chat_stream() send: prompt ids, params with the turn's grammar, how to
    read the output. Prepared in a worker thread (see the module's docstring); raises
    InvalidRequestError (GrammarTimeoutError past the deadline) for what the request got wrong."""
    timeout = _timeout(engine)
    deadline = Deadline(timeout)

    def run() -> Turn:
        if deadline.at != -math.inf:  # not expired by a cancelled caller: its time starts now
            deadline.at = time.monotonic() + timeout
        return _prepare_sync(engine, msgs, tools, tool_choice, parallel_tool_calls, response_format, params,
                             tool_format, deadline)

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


def _call_id(fmt: formats.ToolFormat) -> str:
    if fmt is formats.MISTRAL:  # Mistral's own templates refuse any id but 9 alphanumerics
        return uuid.uuid4().hex[:9]
    return "call_" + uuid.uuid4().hex[:24]


def _finish(reason: str, has_calls: bool) -> ChatFinishReason:
    if reason == "length":
        return "length"
    return "tool_calls" if has_calls else "stop"


def _grammar_field(turn: Turn, exc: GrammarError) -> GrammarError:
    """The engine names `grammar`; the caller wrote tools or response_format."""
    field = "tools" if turn.spec.calls_allowed else "response_format"
    return GrammarError(field, exc.message)


class _Run:
    """How a turn runs in the engine (priority, cache key), and what it found there (cached tokens)."""

    def __init__(self, priority: int, cache_key: str | None) -> None:
        self.priority, self.cache_key, self.cached = priority, cache_key, 0

    def usage(self, turn: Turn, n_tokens: int) -> Usage:
        return Usage(len(turn.prompt), n_tokens, self.cached)


async def _parsed(engine: EngineClient, turn: Turn, run: _Run) -> AsyncIterator[tuple[_Read, str | None, int]]:
    """The turn as read after each chunk: (read so far, finish reason on the last one, tokens so far).
    The last item is always read as final; leaving early aborts the request and frees its blocks.
    One parser keeps its place across chunks: each chunk costs work in proportion to its own text."""
    parser, n_tokens = turn.parser(), 0
    cut = _StopCut(turn.stops) if turn.stops else None
    try:
        async with engine.stream(turn.prompt, turn.params, priority=run.priority, cache_key=run.cache_key) as stream:
            async for chunk in stream:
                if stream.request is not None:
                    run.cached = stream.request.num_cached_prompt_tokens
                n_tokens += len(chunk.token_ids)
                final = chunk.finish_reason is not None
                r = _Read.of(parser.feed(chunk.text, final))
                if cut is not None and cut.apply(r, final):
                    yield r, "stop", n_tokens  # closing the stream (leaving the block) aborts the request
                    return
                yield r, chunk.finish_reason, n_tokens
                if final:
                    return
    except GrammarError as exc:
        raise _grammar_field(turn, exc) from exc
    yield _Read.of(parser.feed("", True)), "stop", n_tokens  # the stream ended without a finish (never expected)


async def chat(engine: EngineClient, msgs: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               tool_choice: Any = "auto", parallel_tool_calls: bool = True,
               response_format: dict[str, Any] | None = None, params: SamplingParams | None = None,
               tool_format: str | None = None, priority: int = 0, cache_key: str | None = None) -> ChatResult:
    """One chat turn to the end. `tool_format` overrides the detected family format
    ("hermes", "llama3", "mistral", "generic"); `priority` and `cache_key` as AsyncEngine.stream's
    (a conversation's key keeps its blocks for its next turn; usage.cached_tokens says what was found)."""
    turn = await prepare(engine, msgs, tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
                         response_format=response_format, params=params, tool_format=tool_format)
    last: tuple[_Read, str | None, int] | None = None
    run = _Run(priority, cache_key)
    async for item in _parsed(engine, turn, run):
        last = item
    assert last is not None  # _parsed always yields a final read
    r, reason, n_tokens = last
    # Budget closing (on unless params turn it off) ends a call that meets max_tokens validly, marker
    # included, so it is returned (finish_reason "length"); a call still cut (budget_close=False) is dropped.
    calls = [ToolCall(_call_id(turn.spec.fmt), c.name, c.arguments) for c in r.parser.calls[:r.n_calls]]
    text, reasoning = r.field("content"), r.field("reasoning")
    content = text if text.strip() or not calls else None
    return ChatResult(content=content, reasoning=reasoning or None, tool_calls=calls,
                      finish_reason=_finish(reason or "stop", bool(calls)), usage=run.usage(turn, n_tokens))


_TEXT = re.compile(r"\S")  # a character str.strip() keeps


async def chat_stream(engine: EngineClient, msgs: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                      tool_choice: Any = "auto", parallel_tool_calls: bool = True,
                      response_format: dict[str, Any] | None = None, params: SamplingParams | None = None,
                      tool_format: str | None = None, priority: int = 0,
                      cache_key: str | None = None) -> AsyncIterator[ChatDelta]:
    """chat() as deltas: content, reasoning, tool calls (index, id, name and arguments, each call
    whole once its arguments close), and last one with finish_reason and usage. Leaving the
    loop early aborts the request and frees its blocks."""
    turn = await prepare(engine, msgs, tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
                         response_format=response_format, params=params, tool_format=tool_format)
    reason: str | None = None
    n_tokens = 0
    sent_reasoning = sent_content = 0
    sent_calls = 0
    text_at: int | None = None  # where the content's first non-whitespace character is, once seen
    blank_to = 0  # the content is whitespace up to here
    run = _Run(priority, cache_key)
    async for item in _parsed(engine, turn, run):
        r, reason, n_tokens = item
        (ra, rb), (ca, cb) = r.reasoning, r.content
        if rb - ra > sent_reasoning:
            yield ChatDelta(reasoning=r.parser.text[ra + sent_reasoning:rb])
            sent_reasoning = rb - ra
        if text_at is None and cb > max(ca, blank_to):
            m = _TEXT.search(r.parser.text, max(ca, blank_to), cb)
            text_at, blank_to = (m.start() if m else None), cb
        # Whitespace alone before a call is no content (chat() returns None): where a call may follow,
        # hold it until text follows. Without tools nothing can follow, so it goes out as it comes.
        if cb - ca > sent_content and ((text_at is not None and text_at < cb) or not turn.spec.calls_allowed
                                       or (reason is not None and not r.has_calls)):
            yield ChatDelta(content=r.parser.text[ca + sent_content:cb])
            sent_content = cb - ca
        # A call goes out whole, once its arguments close: one cut by max_tokens (when budget closing is
        # off, or the budget cannot even hold it) is dropped, as chat() drops it. Streamed piece by piece,
        # its first pieces could not be taken back, and a client would run a call with broken JSON.
        while sent_calls < r.n_calls:
            c = r.parser.calls[sent_calls]
            yield ChatDelta(tool_call=ToolCallDelta(sent_calls, _call_id(turn.spec.fmt), c.name, c.arguments))
            sent_calls += 1
    yield ChatDelta(finish_reason=_finish(reason or "stop", sent_calls > 0), usage=run.usage(turn, n_tokens))
