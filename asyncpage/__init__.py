"""asyncpage: an asyncio-native, embeddable LLM inference runtime with a paged KV cache."""

from asyncpage.engine import AsyncEngine, RequestStream
from asyncpage.errors import (
    AsyncPageError,
    EngineDeadError,
    EngineLoopError,
    EngineNotRunningError,
    ExtractionError,
    GrammarError,
    GrammarTimeoutError,
    InvalidRequestError,
    ModelLoadError,
    PromptTooLongError,
    QueueFullError,
    RequestFailedError,
    SamplingError,
)
from asyncpage.outputs import Choice, EngineStats, GenerateOutput, RequestMetrics, StreamChunk, TokenLogprob
from asyncpage.params import SamplingParams

__all__ = [
    "AsyncEngine",
    "AsyncPageError",
    "Choice",
    "EngineDeadError",
    "EngineLoopError",
    "EngineNotRunningError",
    "EngineStats",
    "ExtractionError",
    "GenerateOutput",
    "GrammarError",
    "GrammarTimeoutError",
    "InvalidRequestError",
    "ModelLoadError",
    "PromptTooLongError",
    "QueueFullError",
    "RequestFailedError",
    "RequestMetrics",
    "RequestStream",
    "SamplingError",
    "SamplingParams",
    "StreamChunk",
    "TokenLogprob",
]
__version__ = "0.1.0"
