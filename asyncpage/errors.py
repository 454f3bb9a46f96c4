"""Typed errors: the small hierarchy every caller can catch.

AsyncPageError
├── InvalidRequestError (also a ValueError)   bad input, raised at submission; names the field
│   ├── PromptTooLongError                    longer than the context or the whole KV pool
│   └── GrammarError                          unsupported schema, grammar that fails or times out
│       └── GrammarTimeoutError               over the compile time bound (transient: not cached)
├── ExtractionError                           extract(): output cut at max_tokens or not decodable
├── QueueFullError (also a RuntimeError)      the waiting queue is at max_queued_requests: retry later
│                                             (HTTP 429 with Retry-After)
├── RequestFailedError (also a RuntimeError)  this request failed inside the loop (its detokenizer, a
│                                             hook, its draft proposals); the engine goes on
├── EngineDeadError (also a RuntimeError)     the engine loop failed; every caller hears it
├── EngineNotRunningError                     used outside `async with engine:`
├── EngineLoopError (also a RuntimeError)     used from a thread or event loop other than the engine's
├── SamplingError (also a RuntimeError)       no valid next token (NaN logits, a grammar with no way on):
│                                             that request fails, everything else keeps running
└── ModelLoadError                            weights, config or tokenizer could not be loaded
"""

from __future__ import annotations

from typing import Any


class AsyncPageError(Exception):
    """Base class of every error asyncpage raises on purpose."""


class InvalidRequestError(AsyncPageError, ValueError):
    """A request was refused before it touched the engine. `field` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus max_tokens) exceeds the model context or could never fit the KV pool."""


class GrammarError(InvalidRequestError):
    """A guided-decoding spec that cannot be compiled (unsupported keyword, timeout, syntax)."""


class GrammarTimeoutError(GrammarError):
    """Compiling took longer than the time bound (the grammar may be hostile, or the compile thread
    busy). Not remembered: asking again later compiles again."""


class ExtractionError(AsyncPageError):
    """extract() could not produce a complete typed value. `reason` is "truncated" (max_tokens reached
    before the value was complete), "invalid" (the text did not decode into the requested type), or
    "closed_early": budget closing ended the value at max_tokens; it is valid and decoded, in `value`
    (`has_value` is True), but may be shorter than what the model would have written."""

    def __init__(self, reason: str, message: str, text: str, value: Any = None, has_value: bool = False) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.text = text
        self.value = value
        self.has_value = has_value


class QueueFullError(AsyncPageError, RuntimeError):
    """The engine already holds `max_queued_requests` requests waiting to start; nothing was queued.
    Transient: retry after `retry_after` seconds (the HTTP app answers 429 with Retry-After)."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestFailedError(AsyncPageError, RuntimeError):
    """This request's own per-step work failed on the engine loop (detokenizing its tokens, its stop
    strings, its grammar or draft proposals). Only this request ends; the engine and every other
    request go on. The cause is chained as __cause__."""


class EngineDeadError(AsyncPageError, RuntimeError):
    """The engine loop stopped on an unexpected error; the cause is chained as __cause__."""


class EngineNotRunningError(AsyncPageError, RuntimeError):
    """stream()/generate() were called outside `async with engine:` (or after it closed)."""


class EngineLoopError(AsyncPageError, RuntimeError):
    """The engine was called from a thread or event loop other than the one running it. An engine
    belongs to one loop; to use it from elsewhere, hop onto that loop (anyio.from_thread, a portal)."""


class SamplingError(AsyncPageError, RuntimeError):
    """The model gave this request no valid next token (a NaN or +inf logit row, or a grammar mask that
    left no finite logit). The token is never emitted; only this request fails."""


class ModelLoadError(AsyncPageError, RuntimeError):
    """The model, its config or its tokenizer could not be loaded."""
