"""chat() and chat_stream(): OpenAI-shaped messages and tools in, typed results or deltas out.

    res = await engine.chat([{"role": "user", "content": "Weather in Paris?"}], tools=[weather_tool],
                            tool_choice="required")
    res.tool_calls[0].name, json.loads(res.tool_calls[0].arguments)

Built only on the engine's public surface (tokenizer, stream(), SamplingParams): a turn is one
engine request whose prompt is the rendered template and whose grammar comes from grammar.py.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from asyncpage.chat import formats, grammar, messages
from asyncpage.chat.parse import THINK_CLOSE, THINK_OPEN, Parsed, held, parse
from asyncpage.chat.types import ChatDelta, ChatFinishReason, ChatResult, ToolCall, ToolCallDelta, Usage
from asyncpage.errors import GrammarError, InvalidRequestError
from asyncpage.params import SamplingParams

if TYPE_CHECKING:
    from asyncpage.engine import AsyncEngine


@dataclass(frozen=True)
class Turn:
    """One prepared turn: the prompt ids, the sampling params (grammar included), how to read it."""

    prompt: list[int]
    params: SamplingParams
    spec: grammar.TurnSpec
    stops: tuple[str, ...] = ()  # the caller's stop strings, when this layer applies them (see _prepare_sync)

    def parse(self, text: str, final: bool) -> Parsed:
        s = self.spec
        return parse(text, s.fmt, calls_allowed=s.calls_allowed, reasoning=s.reasoning,
                     in_reasoning=s.in_reasoning, final=final, forced=s.calls_allowed and s.mode != "auto")


def _model_type(engine: AsyncEngine) -> str:
    return str(getattr(getattr(engine, "model_config", None), "model_type", "") or "")


def _prepare_sync(engine: AsyncEngine, msgs: Any, tools: Any, tool_choice: Any, parallel_tool_calls: bool,
                  response_format: Any, params: SamplingParams | None, tool_format: str | None) -> Turn:
    params = params if params is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError("params", f"must be SamplingParams, got {type(params).__name__}")
    if params.n != 1:
        raise InvalidRequestError("n", "a chat turn has one choice (send several requests for more)")
    tool_list = messages.parse_tools(tools)
    mode = messages.parse_tool_choice(tool_choice, tool_list)
    answer = messages.parse_response_format(response_format)
    norm = messages.normalize(msgs)
    tok = engine.tokenizer
    template = messages.template_of(tok, _model_type(engine))
    if tool_format is not None and tool_format not in formats.FORMATS:
        raise InvalidRequestError("tool_format", f"must be one of {sorted(formats.FORMATS)}")
    fmt = formats.FORMATS[tool_format] if tool_format else formats.detect(template.text, tok)
    # tool_choice="none": the tools stay out of the prompt too, so nothing tempts the model to call.
    shown = tool_list if mode != "none" else []
    text = messages.render(tok, template, norm, shown, fmt)
    in_reasoning = template.reasoning and text.rstrip().endswith(THINK_OPEN)
    spec = grammar.TurnSpec(fmt, tool_list, mode, bool(parallel_tool_calls), answer, template.reasoning,
                            in_reasoning)
    lark = grammar.build(spec, tok)
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
    return Turn(ids, params, spec, stops)


def _cut_at_stop(p: Parsed, stops: tuple[str, ...], final: bool) -> bool:
    """Cut `p` at the first stop string in its reasoning or content (dropping all after it) and
    say whether one was met; before the end, hold back a tail that could still grow into one."""
    for name in ("reasoning", "content"):
        text = getattr(p, name)
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            setattr(p, name, text[: min(hits)])
            if name == "reasoning":
                p.content = ""
            p.calls.clear()
            return True
    if not final and not p.calls:
        # Only the part still growing is held: content once it began, else the reasoning.
        name = "content" if p.content else "reasoning"
        text = getattr(p, name)
        setattr(p, name, text[: len(text) - max(held(text, s) for s in stops)])
    return False


async def prepare(engine: AsyncEngine, msgs: Any, *, tools: Any = None, tool_choice: Any = "auto",
                  parallel_tool_calls: bool = True, response_format: Any = None,
                  params: SamplingParams | None = None, tool_format: str | None = None) -> Turn:
    # Rendering and tokenizing run in a worker thread: a long conversation never holds the loop.
    return await anyio.to_thread.run_sync(lambda: _prepare_sync(
        engine, msgs, tools, tool_choice, parallel_tool_calls, response_format, params, tool_format))


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


async def _parsed(engine: AsyncEngine, turn: Turn) -> AsyncIterator[tuple[Parsed, str | None, int]]:
    """The turn as read after each chunk: (parsed so far, finish reason on the last one, tokens so far).
    The last item is always a final parse; leaving early aborts the request and frees its blocks."""
    text, n_tokens = "", 0
    try:
        async with engine.stream(turn.prompt, turn.params) as stream:
            async for chunk in stream:
                text += chunk.text
                n_tokens += len(chunk.token_ids)
                final = chunk.finish_reason is not None
                p = turn.parse(text, final)
                if turn.stops and _cut_at_stop(p, turn.stops, final):
                    yield p, "stop", n_tokens  # closing the stream (leaving the block) aborts the request
                    return
                yield p, chunk.finish_reason, n_tokens
                if final:
                    return
    except GrammarError as exc:
        raise _grammar_field(turn, exc) from exc
    yield turn.parse(text, True), "stop", n_tokens  # the stream ended without a finish (never expected)


async def chat(engine: AsyncEngine, msgs: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               tool_choice: Any = "auto", parallel_tool_calls: bool = True,
               response_format: dict[str, Any] | None = None, params: SamplingParams | None = None,
               tool_format: str | None = None) -> ChatResult:
    """One chat turn to the end. `tool_format` overrides the detected family format
    ("hermes", "llama3", "mistral", "generic")."""
    turn = await prepare(engine, msgs, tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
                         response_format=response_format, params=params, tool_format=tool_format)
    last: tuple[Parsed, str | None, int] = (Parsed(), None, 0)
    async for item in _parsed(engine, turn):
        last = item
    p, reason, n_tokens = last
    # Budget closing (on unless params turn it off) ends a call that meets max_tokens validly, marker
    # included, so it is returned (finish_reason "length"); a call still cut (budget_close=False) is dropped.
    calls = [ToolCall(_call_id(turn.spec.fmt), c.name, c.arguments) for c in p.calls if c.complete]
    content = p.content if p.content.strip() or not calls else None
    return ChatResult(content=content, reasoning=p.reasoning or None, tool_calls=calls,
                      finish_reason=_finish(reason or "stop", bool(calls)), usage=Usage(len(turn.prompt), n_tokens))


async def chat_stream(engine: AsyncEngine, msgs: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                      tool_choice: Any = "auto", parallel_tool_calls: bool = True,
                      response_format: dict[str, Any] | None = None, params: SamplingParams | None = None,
                      tool_format: str | None = None) -> AsyncIterator[ChatDelta]:
    """chat() as deltas: content, reasoning, tool calls (index, id, name and arguments, each call
    whole once its arguments close), and last one with finish_reason and usage. Leaving the
    loop early aborts the request and frees its blocks."""
    turn = await prepare(engine, msgs, tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
                         response_format=response_format, params=params, tool_format=tool_format)
    reason: str | None = None
    n_tokens = 0
    sent_reasoning = sent_content = 0
    sent_calls = 0
    async for item in _parsed(engine, turn):
        p, reason, n_tokens = item
        if len(p.reasoning) > sent_reasoning:
            yield ChatDelta(reasoning=p.reasoning[sent_reasoning:])
            sent_reasoning = len(p.reasoning)
        # Whitespace alone before a call is no content (chat() returns None): where a call may follow,
        # hold it until text follows. Without tools nothing can follow, so it goes out as it comes.
        if len(p.content) > sent_content and (p.content.strip() or not turn.spec.calls_allowed
                                              or (reason is not None and not p.calls)):
            yield ChatDelta(content=p.content[sent_content:])
            sent_content = len(p.content)
        # A call goes out whole, once its arguments close: one cut by max_tokens (when budget closing is
        # off, or the budget cannot even hold it) is dropped, as chat() drops it. Streamed piece by piece,
        # its first pieces could not be taken back, and a client would run a call with broken JSON.
        while sent_calls < len(p.calls) and p.calls[sent_calls].complete:
            c = p.calls[sent_calls]
            yield ChatDelta(tool_call=ToolCallDelta(sent_calls, _call_id(turn.spec.fmt), c.name, c.arguments))
            sent_calls += 1
    yield ChatDelta(finish_reason=_finish(reason or "stop", sent_calls > 0), usage=Usage(len(turn.prompt), n_tokens))
