"""The front end's side of one request: its mailbox (filled from the decode worker's chunks) and its
timings. It is the handle `DisaggEngine.stream()`'s RequestStream (core/stream.py, the same stream
AsyncEngine returns) reads: leaving `async for` early, `aclose()`, cancelling the task or dropping the
stream aborts the request, and after `await aclose()` both workers have let go of its blocks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import anyio

from asyncpage.core.mailbox import Mailbox
from asyncpage.outputs import RequestMetrics, StreamChunk, TokenLogprob
from asyncpage.params import SamplingParams

from .messages import Final

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
    done: bool = False  # its last chunk has been put in the mailbox

    def aligned_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        return None  # prompt_logprobs is refused at submission (DisaggEngine.submit)

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
        self.mailbox.put(chunk.index, chunk.text, chunk.token_ids, list(chunk.logprobs) if chunk.logprobs else None,
                         chunk.finish_reason)
        if chunk.finish_reason is not None:
            self.done = True

    def metrics(self) -> RequestMetrics:
        """Timings seen from the front end (the pipe hops included): no queue/prefill split."""
        first = self.first_token or self.arrival
        end = time.monotonic()
        cached = self.final.num_cached_prompt_tokens if self.final else 0
        return RequestMetrics(queue_time=0.0, ttft=first - self.arrival, prefill_time=first - self.arrival,
                              decode_time=(self.last_token or first) - first, e2e=end - self.arrival,
                              inter_token_latencies=list(self.inter_token), num_preemptions=0,
                              num_cached_prompt_tokens=cached)
