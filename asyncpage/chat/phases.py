"""A turn's text as the engine generates it: one request, or two when the reasoning has a budget.

A bounded section (max_reasoning_tokens, reasoning_effort) runs as:
1. the thinking: the turn's prompt (its section opened), the caller's sampling without any grammar,
   at most the budget (and max_tokens), stopped by the closing marker;
2. the answer: the prompt, the thinking's own tokens (up to the marker), then the closing marker and
   its gap written by the engine (whether the model closed the section or the budget did), under the
   turn's grammar (tools, response_format) with what is left of max_tokens.
The answer's grammar is compiled before the thinking starts (a refusal fails the turn before any
token, as a one-request turn's does; cached, it costs nothing), and the second request finds the
first one's blocks in the prefix cache: it computes only the closing marker and the last partial
block. Both phases run at the turn's priority and cache key. JSON is never forced into the thinking
(it has no grammar) nor swallowed by it (the grammar starts after the marker).

Yields (text, completion tokens it adds, finish reason on the last); reading is api.Turn.parser's.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec

from asyncpage.errors import PromptTooLongError
from asyncpage.guided.backend import GuidedSpec
from asyncpage.params import SamplingParams

if TYPE_CHECKING:
    from asyncpage.chat.api import Budget, Turn
    from asyncpage.core.client import EngineClient

Piece = tuple[str, int, str | None]
# How far back from the end of the thinking its tokens are matched against its text (the marker's
# tokens and what a step generated past it); past that the thinking is tokenized again instead.
MAX_WALK_BACK = 32


class Run:
    """How a turn runs in the engine (priority, cache key), and what it found there: the prompt's
    cached tokens, the reasoning's tokens (when the engine counted them)."""

    def __init__(self, priority: int, cache_key: str | None) -> None:
        self.priority, self.cache_key = priority, cache_key
        self.cached = 0
        self.reasoning_tokens: int | None = None


async def pieces(engine: EngineClient, turn: Turn, run: Run) -> AsyncGenerator[Piece, None]:
    if turn.budget is None:
        async for p in _request(engine, turn.prompt, turn.params, run, True):
            yield p
        return
    async for p in _bounded(engine, turn, turn.budget, run):
        yield p


async def _request(engine: EngineClient, prompt: list[int], params: SamplingParams, run: Run,
                   counts: bool) -> AsyncIterator[Piece]:
    async for chunk in _chunks(engine, prompt, params, run, counts):
        yield chunk.text, len(chunk.token_ids), chunk.finish_reason


async def _chunks(engine: EngineClient, prompt: list[int], params: SamplingParams, run: Run,
                  counts: bool) -> AsyncIterator[Any]:
    """One engine request's chunks, to its last; `counts`: its prompt's cached tokens are the turn's."""
    async with engine.stream(prompt, params, priority=run.priority, cache_key=run.cache_key) as stream:
        async for chunk in stream:
            if counts and stream.request is not None:
                run.cached = stream.request.num_cached_prompt_tokens
            yield chunk
            if chunk.finish_reason is not None:
                return


async def _bounded(engine: EngineClient, turn: Turn, b: Budget, run: Run) -> AsyncIterator[Piece]:
    spec = GuidedSpec.from_params(turn.params)
    guided = getattr(engine, "guided", None)
    if spec is not None and guided is not None:
        await guided.compile(spec)  # refused before any thinking; cached for phase 2's submission
    ids: list[int] = []
    parts: list[str] = []
    reason: str | None = None
    async for chunk in _chunks(engine, turn.prompt, b.think, run, True):
        ids += chunk.token_ids
        parts.append(chunk.text)
        reason = chunk.finish_reason
        yield chunk.text, len(chunk.token_ids), None
    total = turn.params.max_tokens
    user_stop = bool(ids) and ids[-1] in turn.params.stop_token_ids and ids[-1] != b.close_token
    if user_stop or (reason == "length" and len(ids) >= total):
        # The caller's own stop token ended the turn, or max_tokens left nothing for an answer.
        yield "", 0, "stop" if user_stop else "length"
        return
    thought = "".join(parts)
    tok = engine.tokenizer
    kept, tail = kept_tokens(tok, turn.prompt, ids, thought, b)
    closing = list(tok(tail + b.close, add_special_tokens=False)["input_ids"])
    tail_tokens = len(tok(tail, add_special_tokens=False)["input_ids"]) if tail else 0
    run.reasoning_tokens = len(kept) + tail_tokens
    used = len(kept) + len(closing)
    room = total - used
    if room < 1:  # no token is left for an answer: the turn ends in its thinking, as max_tokens cut it
        yield "", 0, "length"
        return
    yield b.close, used - len(ids), None  # the tokens past the kept ones are the engine's marker instead
    answer = msgspec.structs.replace(turn.params, max_tokens=room)
    try:
        async for p in _request(engine, turn.prompt + kept + closing, answer, run, False):
            yield p
    except PromptTooLongError:  # the thinking filled the context: no room is left for an answer
        yield "", 0, "length"


def kept_tokens(tok: Any, prompt: list[int], ids: list[int], thought: str, b: Budget) -> tuple[list[int], str]:
    """The thinking's tokens that lie wholly before its closing marker, and the text of the rest of
    it before the marker (part of the token that began the marker). `thought` is the engine's text of
    `ids`, cut before the marker; tokens are decoded after a few prompt tokens, as the engine's
    detokenizer decodes them (a leading space is kept). Walks back at most MAX_WALK_BACK tokens; past
    that, none are kept and the whole thought is tokenized again (only the prefix cache loses)."""
    if b.close_token is not None and ids and ids[-1] == b.close_token:
        ids = ids[:-1]
    ctx = prompt[-4:]
    skip = b.skip_special_tokens
    base = tok.decode(ctx, skip_special_tokens=skip)
    for k in range(len(ids), max(-1, len(ids) - MAX_WALK_BACK - 1), -1):
        text = tok.decode(ctx + ids[:k], skip_special_tokens=skip)
        if text.startswith(base) and thought.startswith(text[len(base):]):
            return ids[:k], thought[len(text) - len(base):]
    return [], thought
