"""What a caller holds while a request runs: the RequestStream that `engine.stream()` returns, reading
the request's Mailbox (core/mailbox.py, filled by the engine loop).

A stream never touches engine state: it submits through a Submitter's `submit()` (core/client.py:
AsyncEngine and DisaggEngine are both one) and leaves through `abort()`, which only queues (the loop
applies aborts at its safe points). That is what makes a stream safe to drop anywhere: in a finalizer,
inside a reference cycle collected mid-step, or on another thread.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, Protocol, Self, TypeVar

from asyncpage.core.mailbox import Mailbox
from asyncpage.outputs import StreamChunk, TokenLogprob
from asyncpage.params import Prompt, SamplingParams


class Handle(Protocol):
    """A submitted request as its stream sees it: where its output arrives, what it asked for."""

    @property
    def mailbox(self) -> Mailbox: ...

    @property
    def params(self) -> SamplingParams: ...

    def aligned_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """params.prompt_logprobs aligned with the prompt's tokens (None where not asked or offered)."""
        ...


H = TypeVar("H", bound=Handle)


class Submitter(Protocol[H]):
    async def submit(self, prompt: Prompt, params: SamplingParams, *, priority: int = 0,
                     cache_key: str | None = None) -> H:
        """Validate and queue a request; raises a typed error before anything is queued."""
        ...

    def abort(self, request: H) -> None:
        """Queue an abort (safe from anywhere); the loop frees the request's blocks at a safe point."""
        ...

    async def wait_released(self, request: H) -> None:
        """Return once the engine is done with `request` (its blocks are back)."""
        ...


class RequestStream(Generic[H]):
    """What `engine.stream()` returns: an async iterator of StreamChunk, and an async context
    manager. Leaving `async for` early, `aclose()`, cancelling the consuming task or dropping the
    object all abort the request; after `await aclose()` its blocks are back in the pool."""

    def __init__(self, engine: Submitter[H], prompt: Prompt, params: SamplingParams, *, priority: int = 0,
                 cache_key: str | None = None) -> None:
        self._engine = engine
        self._prompt = prompt
        self._params = params
        self._priority = priority
        self._cache_key = cache_key
        self._request: H | None = None
        self._buffer: deque[StreamChunk] = deque()
        self._open = 0  # samples not finished yet
        self._closed = False

    @property
    def request(self) -> H | None:
        return self._request

    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """params.prompt_logprobs: each prompt token's log-probability given the ones before it, aligned
        with the prompt's token ids (the first is None, as is any the request did not get to: an abort
        before its prompt was computed). Whole once the first chunk has come: the prompt is computed
        before any token is sampled."""
        return None if self._request is None else self._request.aligned_prompt_logprobs()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> StreamChunk:
        if self._closed:
            raise StopAsyncIteration
        try:
            if self._request is None:
                self._request = await self._engine.submit(self._prompt, self._params, priority=self._priority,
                                                          cache_key=self._cache_key)
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
