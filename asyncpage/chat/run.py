"""chat() and chat_stream(): OpenAI-shaped messages and tools in, typed results or deltas out.

    res = await engine.chat([{"role": "user", "content": "Weather in Paris?"}], tools=[weather_tool],
                            tool_choice="required")
    res.tool_calls[0].name, json.loads(res.tool_calls[0].arguments)
    res = await engine.chat(msgs, response_format=schema_format, max_reasoning_tokens=256)
    res.reasoning, json.loads(res.content)       # the thinking, then the answer its grammar shaped

A turn is prepared (api.py), run in the engine (phases.py: one request, or two when the reasoning has
a budget), and read back chunk by chunk (parse.py); this module only joins them up.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from asyncpage.chat import formats
from asyncpage.chat.api import Turn, prepare
from asyncpage.chat.grammar import ANSWER_ALONE
from asyncpage.chat.phases import Run, pieces
from asyncpage.chat.read import _Read, _StopCut
from asyncpage.chat.types import ChatDelta, ChatFinishReason, ChatResult, ToolCall, ToolCallDelta, Usage
from asyncpage.errors import GrammarError, GrammarTimeoutError
from asyncpage.guided.backend import GuidedSpec
from asyncpage.params import SamplingParams

if TYPE_CHECKING:
    from asyncpage.core.client import EngineClient


def _call_id(fmt: formats.ToolFormat) -> str:
    if fmt is formats.MISTRAL:  # Mistral's own templates refuse any id but 9 alphanumerics
        return uuid.uuid4().hex[:9]
    return "call_" + uuid.uuid4().hex[:24]


def _finish(reason: str, has_calls: bool) -> ChatFinishReason:
    if reason == "length":
        return "length"
    return "tool_calls" if has_calls else "stop"


# llguidance places a failure in the Lark text ("at 8(14): failed to compile JSON schema: ...") and
# quotes the lines around it ("   6 | call_0_args: %json {...}"): the text this layer built, not the caller's.
_AT_LINE = re.compile(r"at (\d+)\(\d+\): ")
_LISTING = re.compile(r"\n\s*\d+ \| ")
_TOOL_ARGS = re.compile(r"call_(\d+)_args")
# A JSON format's turn under tool_choice "auto" with an answer schema (grammar.py): one JSON Schema
# holds the answer and the calls, and llguidance compiles only the rules the body reaches.
_COMBINED = "\nbody: answer_or_calls\n"
# The engine's refusal of a grammar that forces a run without end (guided/llg.py, xgr.py); llguidance's
# reason ("Too many items ...; try avoiding single-byte/short lexemes") speaks of its grammar, not of a schema.
_NO_END = "has no finite instance"


def _located(grammar: str, message: str) -> tuple[str, str]:
    """(the rule of `grammar` the failure is in, "" when it does not say; the message without the
    place and the listing)."""
    message = _LISTING.split(message, maxsplit=1)[0]
    at = _AT_LINE.search(message)
    if at is None:
        return "", message
    lines = grammar.split("\n")
    line = int(at.group(1))
    rule = lines[line - 1].split(":", 1)[0].strip() if 0 < line <= len(lines) else ""
    return rule, message[:at.start()] + message[at.end():]


def _grammar_field(turn: Turn, exc: GrammarError, grammar: str | None = None, part: str = "") -> GrammarError:
    """The engine names `grammar` and quotes the Lark text grammar.py built (`grammar`, else the
    turn's); the caller wrote a tool's parameters or response_format's schema. The rule the failure
    is in (else `part`, the rule that grammar starts with) says which (tools or response_format when
    it cannot), and the message keeps what is wrong without the grammar."""
    field = "tools" if turn.spec.calls_allowed else "response_format"
    rule, message = _located((turn.params.grammar or "") if grammar is None else grammar, exc.message)
    rule = rule or part
    if rule and _NO_END in message:
        message = ("the schema has no finite instance: the JSON it forces never ends (a required property "
                   "that refers back to the object holding it, say)")
    tool = _TOOL_ARGS.fullmatch(rule)
    if tool is not None and int(tool.group(1)) < len(turn.spec.callable_tools):
        name = turn.spec.callable_tools[int(tool.group(1))].name
        index = next(i for i, t in enumerate(turn.spec.tools) if t.name == name)  # names are unique
        field = f"tools[{index}].function.parameters"
    elif rule == "answer":
        field = "response_format.json_schema.schema"
    return GrammarError(field, message)


async def _grammar_failure(engine: EngineClient, turn: Turn, exc: GrammarError) -> GrammarError:
    """_grammar_field's error; one in the schema that holds both the answer and the calls is the
    part's that fails alone: the turn's grammar with the answer, then the calls, as its body, compiled
    as the engine compiles any grammar (cached, bounded in time), on this error's path only. When
    neither fails alone (or it cannot tell), the two together are what failed: response_format, which
    brought the answer into the calls' schema, is named, and the message says so."""
    grammar = turn.params.grammar or ""
    if _COMBINED not in grammar or _located(grammar, exc.message)[0] != "answer_or_calls":
        endless = grammar.startswith(ANSWER_ALONE) and _NO_END in exc.message  # the answer's endless run
        return _grammar_field(turn, exc, part="answer" if endless else "")
    for part in ("answer", "calls"):
        alone = grammar.replace(_COMBINED, f"\nbody: {part}\n", 1)
        try:
            await engine.guided.compile(GuidedSpec("grammar", alone))
        except GrammarTimeoutError:
            break
        except GrammarError as failed:
            rule = _located(alone, failed.message)[0]
            if rule == "answer" or _TOOL_ARGS.fullmatch(rule):
                return _grammar_field(turn, failed, alone)
    return GrammarError("response_format", "with tools, this model's calls and the answer are one JSON Schema, "
                                           f"which failed to compile: {_grammar_field(turn, exc).message}")


async def _check_parts(engine: EngineClient, turn: Turn) -> None:
    """Refuses, naming it, a tool's parameters or the answer's schema without a finite instance,
    before the turn runs: each of turn.parts (grammar.parts_alone) compiled as the engine compiles any
    grammar (cached, single-flight, bounded in time), whose check sees the run it forces from its start.
    In the turn's grammar the run was only met mid-decoding (the request failed, a 500)."""
    for rule, alone in turn.parts:
        try:
            await engine.guided.compile(GuidedSpec("grammar", alone))
        except GrammarError as exc:
            engine.check_usable()  # the engine stopped meanwhile (as its submit): that is the error
            raise _grammar_field(turn, exc, alone, rule) from exc


def _usage(turn: Turn, run: Run, n_tokens: int) -> Usage:
    return Usage(len(turn.prompt), n_tokens, run.cached, run.reasoning_tokens or 0)


async def _parsed(engine: EngineClient, turn: Turn, run: Run) -> AsyncGenerator[tuple[_Read, str | None, int], None]:
    """The turn as read after each chunk: (read so far, finish reason on the last one, tokens so far).
    The last item is always read as final; leaving early aborts the request and frees its blocks.
    One parser keeps its place across chunks: each chunk costs work in proportion to its own text."""
    await _check_parts(engine, turn)
    parser, n_tokens = turn.parser(), 0
    cut = _StopCut(turn.stops) if turn.stops else None
    try:
        async with aclosing(pieces(engine, turn, run)) as chunks:
            async for text, n, reason in chunks:
                n_tokens += n
                final = reason is not None
                r = _Read.of(parser.feed(text, final))
                if run.reasoning_tokens is None and turn.plan.markers is not None and (final or not parser.thinking):
                    # Counted to the chunk that closed the section (its marker included), or to the end.
                    run.reasoning_tokens = n_tokens if r.reasoning[1] > r.reasoning[0] else 0
                if cut is not None and cut.apply(r, final):
                    yield r, "stop", n_tokens  # closing the stream (leaving the block) aborts the request
                    return
                yield r, reason, n_tokens
                if final:
                    return
    except GrammarError as exc:
        if not turn.spec.calls_allowed and turn.spec.answer_schema is None:
            raise  # the caller's own regex, choice, grammar or schema (vLLM's fields): named as it is
        raise await _grammar_failure(engine, turn, exc) from exc
    yield _Read.of(parser.feed("", True)), "stop", n_tokens  # the stream ended without a finish (never expected)


async def chat(engine: EngineClient, msgs: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               tool_choice: Any = "auto", parallel_tool_calls: bool = True,
               response_format: dict[str, Any] | None = None, params: SamplingParams | None = None,
               tool_format: str | None = None, priority: int = 0, cache_key: str | None = None,
               max_reasoning_tokens: int | None = None, reasoning_effort: str | None = None,
               chat_template: str | None = None, reasoning_markers: Any = None) -> ChatResult:
    """One chat turn to the end. `tool_format` overrides the detected family format
    ("hermes", "llama3", "mistral", "generic"); `priority` and `cache_key` as AsyncEngine.stream's
    (a conversation's key keeps its blocks for its next turn; usage.cached_tokens says what was found).
    `max_reasoning_tokens` / `reasoning_effort` (reasoning.EFFORT_BUDGETS) bound the reasoning section:
    at the budget the engine writes the closing marker and the answer's grammar applies; max_tokens
    counts the reasoning too. `chat_template`: this turn's Jinja template in place of the engine's.
    `reasoning_markers`: (open, close) when detection (reasoning.detect) would miss them, False for none."""
    turn = await prepare(engine, msgs, tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
                         response_format=response_format, params=params, tool_format=tool_format,
                         max_reasoning_tokens=max_reasoning_tokens, reasoning_effort=reasoning_effort,
                         chat_template=chat_template, reasoning_markers=reasoning_markers)
    last: tuple[_Read, str | None, int] | None = None
    run = Run(priority, cache_key)
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
                      finish_reason=_finish(reason or "stop", bool(calls)), usage=_usage(turn, run, n_tokens))


_TEXT = re.compile(r"\S")  # a character str.strip() keeps


async def chat_stream(engine: EngineClient, msgs: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                      tool_choice: Any = "auto", parallel_tool_calls: bool = True,
                      response_format: dict[str, Any] | None = None, params: SamplingParams | None = None,
                      tool_format: str | None = None, priority: int = 0, cache_key: str | None = None,
                      max_reasoning_tokens: int | None = None, reasoning_effort: str | None = None,
                      chat_template: str | None = None, reasoning_markers: Any = None) -> AsyncIterator[ChatDelta]:
    """chat() as deltas: reasoning as it is written, content, tool calls (index, id, name and
    arguments, each call whole once its arguments close), and last one with finish_reason and usage.
    Leaving the loop early aborts the request and frees its blocks."""
    turn = await prepare(engine, msgs, tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
                         response_format=response_format, params=params, tool_format=tool_format,
                         max_reasoning_tokens=max_reasoning_tokens, reasoning_effort=reasoning_effort,
                         chat_template=chat_template, reasoning_markers=reasoning_markers)
    reason: str | None = None
    n_tokens = 0
    sent_reasoning = sent_content = 0
    sent_calls = 0
    text_at: int | None = None  # where the content's first non-whitespace character is, once seen
    blank_to = 0  # the content is whitespace up to here
    run = Run(priority, cache_key)
    async with aclosing(_parsed(engine, turn, run)) as reads:
        async for item in reads:
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
    yield ChatDelta(finish_reason=_finish(reason or "stop", sent_calls > 0), usage=_usage(turn, run, n_tokens))
