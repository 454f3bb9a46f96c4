"""asyncpage: an asyncio-native, embeddable LLM inference runtime with a paged KV cache."""

from asyncpage.engine import AsyncEngine, RequestStream
from asyncpage.errors import (
    AsyncPageError,
    EngineDeadError,
    EngineNotRunningError,
    ExtractionError,
    GrammarError,
    InvalidRequestError,
    ModelLoadError,
    PromptTooLongError,
)
from asyncpage.outputs import Choice, EngineStats, GenerateOutput, RequestMetrics, StreamChunk, TokenLogprob
from asyncpage.params import SamplingParams

__all__ = [
    "AsyncEngine",
    "AsyncPageError",
    "Choice",
    "EngineDeadError",
    "EngineNotRunningError",
    "EngineStats",
    "ExtractionError",
    "GenerateOutput",
    "GrammarError",
    "InvalidRequestError",
    "ModelLoadError",
    "PromptTooLongError",
    "RequestMetrics",
    "RequestStream",
    "SamplingParams",
    "StreamChunk",
    "TokenLogprob",
]
__version__ = "0.1.0"
