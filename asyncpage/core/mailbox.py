"""A request's mailbox: the engine loop puts each step's output in, the caller's stream takes it out
(merged, so a slow reader gets one chunk per sample rather than a backlog). The loop side only puts
and closes; nothing here awaits on the loop's behalf."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import anyio

from asyncpage.outputs import FinishReason, StreamChunk, TokenLogprob


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

    def put(self, index: int, text: str, token_ids: list[int], logprob: TokenLogprob | list[TokenLogprob] | None,
            finish_reason: FinishReason | None) -> None:
        """Merge a step's output of sample `index` (a chunk's logprobs: one, or a list of them)."""
        p = self._pending.setdefault(index, _Pending())
        p.text += text
        p.token_ids += token_ids
        if logprob is not None:
            if p.logprobs is None:
                p.logprobs = []
            # Appended in place: an unread stream stays linear, not quadratic.
            if isinstance(logprob, list):
                p.logprobs.extend(logprob)
            else:
                p.logprobs.append(logprob)
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
