"""The front end's side of one request: its mailbox (filled from the decode worker's chunks), its
timings, and the stream `DisaggEngine.stream()` returns (RequestStream's behaviour: leaving
`async for` early, `aclose()`, cancelling the task or dropping the stream aborts the request, and
after `await aclose()` both workers have let go of its blocks)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Self

import anyio

from asyncpage.core.stream import Mailbox
from asyncpage.outputs import Choice, FinishReason, GenerateOutput, RequestMetrics, StreamChunk, TokenLogprob
from asyncpage.params import SamplingParams

from .messages import Final

if TYPE_CHECKING:
    from .engine import DisaggEngine

# aclose() waits at most this long for both workers to acknowledge an abort.
RELEASE_TIMEOUT_S = 10.0


@dataclass(eq=False)
class FrontRequest:
    rid: int
    params: SamplingParams
    mailbox: Mailbox = field(default_factory=Mailbox)
    started: bool = False  # the decode worker has sent output: the prefill worker is done with it
    aborting: bool = False
    released: set[str] = field(default_factory=set)  # workers that hold nothing of it any more
    released_event: anyio.Event | None = None
    final: Final | None = None
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    inter_token: list[float] = field(default_factory=list)

    def on_chunk(self, chunk: StreamChunk, final: Final | None) -> None:
        now = time.monotonic()
        self.started = True
        if chunk.token_ids:
            if self.first_token is None:
                self.first_token = now
            elif self.last_token is not None:
                self.inter_token.append(now - self.last_token)
            self.last_token = now
        if final is not None:
            self.final = final
        if self.mailbox.error is not None:
            return  # it failed already (the engine closed, a worker died): nothing more reaches the reader
        self.mailbox.put(chunk.index, chunk.text, chunk.token_ids, None, chunk.finish_reason)
        if chunk.logprobs:
            pending = self.mailbox._pending[chunk.index]
            pending.logprobs = (pending.logprobs or []) + list(chunk.logprobs)

    def metrics(self) -> RequestMetrics:
        """Timings seen from the front end (the pipe hops included): no queue/prefill split."""
        first = self.first_token or self.arrival
        end = time.monotonic()
        cached = self.final.num_cached_prompt_tokens if self.final else 0
        return RequestMetrics(queue_time=0.0, ttft=first - self.arrival, prefill_time=first - self.arrival,
                              decode_time=(self.last_token or first) - first, e2e=end - self.arrival,
                              inter_token_latencies=list(self.inter_token), num_preemptions=0,
                              num_cached_prompt_tokens=cached)


class DisaggStream:
    def __init__(self, engine: DisaggEngine, prompt: str | list[int], params: SamplingParams) -> None:
        self._engine = engine
        self._prompt = prompt
        self._params = params
        self._request: FrontRequest | None = None
        self._buffer: deque[StreamChunk] = deque()
        self._done = False
        self._closed = False
        self._text: list[str] = []
        self._ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self._reason: FinishReason | None = None

    @property
    def request(self) -> FrontRequest | None:
        return self._request

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> StreamChunk:
        if self._closed:
            raise StopAsyncIteration
        try:
            if self._request is None:
                self._request = self._engine.submit(self._prompt, self._params)
            while not self._buffer:
                if self._done:
                    self._closed = True
                    raise StopAsyncIteration
                for chunk in await self._request.mailbox.get():
                    self._buffer.append(chunk)
                    self._text.append(chunk.text)
                    self._ids += chunk.token_ids
                    self._logprobs += chunk.logprobs or []
                    if chunk.finish_reason is not None:
                        self._reason = chunk.finish_reason
                        self._done = True
            return self._buffer.popleft()
        except BaseException as exc:
            if not isinstance(exc, StopAsyncIteration):
                self._abort()
            raise

    def output(self) -> GenerateOutput:
        """The finished request as AsyncEngine.generate returns it."""
        fr = self._request
        assert fr is not None and self._reason is not None, "the stream has not finished"
        prompt = list(fr.final.prompt_token_ids) if fr.final else []
        lps = self._logprobs if self._params.logprobs is not None else None
        return GenerateOutput(prompt, [Choice(0, "".join(self._text), self._ids, self._reason, lps)], fr.metrics())

    async def aclose(self) -> None:
        self._abort()
        fr = self._request
        if fr is None or fr.released.issuperset(("prefill", "decode")):
            return
        if fr.released_event is None:
            fr.released_event = anyio.Event()
        with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_TIMEOUT_S):
            await fr.released_event.wait()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        self._abort()

    def _abort(self) -> None:
        if not self._closed:
            self._closed = True
            if self._request is not None and not self._done:
                self._engine.abort(self._request.rid)
