"""What a caller holds while a request runs: its Mailbox (filled by the engine loop) and the
RequestStream that `engine.stream()` returns.

A stream never touches engine state: it submits through the engine's public `submit()` and leaves
through `abort()`, which only queues (the loop applies aborts at its safe points). That is what makes
a stream safe to drop anywhere: in a finalizer, inside a reference cycle collected mid-step, or on
another thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Self

import anyio

from asyncpage.outputs import FinishReason, StreamChunk, TokenLogprob
from asyncpage.params import SamplingParams

if TYPE_CHECKING:
    from asyncpage.core.request import Request
    from asyncpage.engine import AsyncEngine, Prompt


@dataclass
class _Pending:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None


class Mailbox:
    """Single-slot mailbox per request: output that arrives before the consumer reads is merged into
    one pending chunk per sample. Memory stays bounded by the request's own output and the engine
    never waits for a slow reader. Written and read on the engine's loop only."""

    def __init__(self, notify: Callable[[], None] | None = None) -> None:
        self._pending: dict[int, _Pending] = {}
        self._event: anyio.Event | None = None
        self.error: BaseException | None = None
        self._notify = notify  # extract_many: one wake-up shared by many requests

    def put(self, index: int, text: str, token_ids: list[int], logprob: TokenLogprob | None,
            finish_reason: FinishReason | None) -> None:
        p = self._pending.setdefault(index, _Pending())
        p.text += text
        p.token_ids += token_ids
        if logprob is not None:
            if p.logprobs is None:
                p.logprobs = []
            p.logprobs.append(logprob)  # appended in place: an unread stream stays linear, not quadratic
        if finish_reason is not None:
            p.finish_reason = finish_reason
        self._wake()

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        if self._event is not None:
            self._event.set()
        if self._notify is not None:
            self._notify()

    def peek(self, index: int = 0) -> _Pending | None:
        """What sample `index` has pending, left in place."""
        return self._pending.get(index)

    def drain(self) -> dict[int, _Pending]:
        """Everything pending, without waiting (for a reader that only looks once the request is done)."""
        out, self._pending = self._pending, {}
        return out

    async def get(self) -> list[StreamChunk]:
        while not self._pending and self.error is None:
            self._event = anyio.Event()
            await self._event.wait()
            self._event = None
        if self._pending:
            chunks = [StreamChunk(i, p.text, p.token_ids, p.finish_reason, p.logprobs)
                      for i, p in sorted(self._pending.items())]
            self._pending.clear()
            return chunks
        assert self.error is not None
        raise self.error


class RequestStream:
    """What `engine.stream()` returns: an async iterator of StreamChunk, and an async context
    manager. Leaving `async for` early, `aclose()`, cancelling the consuming task or dropping the
    object all abort the request; after `await aclose()` its blocks are back in the pool."""

    def __init__(self, engine: AsyncEngine, prompt: Prompt, params: SamplingParams) -> None:
        self._engine = engine
        self._prompt = prompt
        self._params = params
        self._request: Request | None = None
        self._buffer: deque[StreamChunk] = deque()
        self._open = 0  # samples not finished yet
        self._closed = False

    @property
    def request(self) -> Request | None:
        return self._request

    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """params.prompt_logprobs: each prompt token's log-probability given the ones before it, aligned
        with the prompt's token ids (the first is None, as is any the request did not get to: an abort
        before its prompt was computed). Whole once the first chunk has come: the prompt is computed
        before any token is sampled."""
        req = self._request
        if req is None or req.params.prompt_logprobs is None:
            return None
        got = list(req.prompt_logprobs)  # written by the loop only while the prompt is computed
        return [None, *got] + [None] * (len(req.prompt_token_ids) - 1 - len(got))

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> StreamChunk:
        if self._closed:
            raise StopAsyncIteration
        try:
            if self._request is None:
                self._request = await self._engine.submit(self._prompt, self._params)
                self._open = self._params.n
                if self._closed:  # closed from elsewhere while it was being submitted: never run it
                    self._engine.abort(self._request)
                    raise StopAsyncIteration
            while not self._buffer:
                if self._open == 0:
                    self._closed = True
                    raise StopAsyncIteration
                for chunk in await self._request.mailbox.get():
                    self._buffer.append(chunk)
                    if chunk.finish_reason is not None:
                        self._open -= 1
            return self._buffer.popleft()
        except BaseException as exc:
            # CancelledError (asyncio) / trio.Cancelled / GeneratorExit / an engine error: abort, pass it on.
            if not isinstance(exc, StopAsyncIteration):
                self._abort()
            raise

    async def aclose(self) -> None:
        self._abort()
        if self._request is not None:
            await self._engine.wait_released(self._request)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        # `break` out of `async for` drops the last reference at once: queue the abort now rather than
        # whenever an async-generator finalizer would run. Only queues: safe on any thread, mid-step.
        self._abort()

    def _abort(self) -> None:
        if not self._closed:
            self._closed = True
            if self._request is not None:
                self._engine.abort(self._request)
