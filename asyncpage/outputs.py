"""What callers get back: stream chunks and finished results (msgspec Structs)."""

from __future__ import annotations

from typing import Literal

import msgspec

FinishReason = Literal["stop", "length", "abort"]


class TokenLogprob(msgspec.Struct, frozen=True):
    """Log-probability of the sampled token and the top-N alternatives, from the raw model output."""

    token_id: int
    logprob: float
    top: dict[int, float]


class StreamChunk(msgspec.Struct, frozen=True):
    """New output of one sample since the previous chunk. When the consumer is slower than the
    engine, pending tokens are merged into one chunk (memory stays bounded, nothing is dropped)."""

    index: int  # which of the n samples
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None  # None until the sample's last chunk
    logprobs: list[TokenLogprob] | None = None


class Choice(msgspec.Struct, frozen=True):
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    logprobs: list[TokenLogprob] | None = None


class RequestMetrics(msgspec.Struct, frozen=True):
    """Per-request timings in seconds, measured on the engine loop."""

    queue_time: float  # submission -> first scheduled
    ttft: float  # submission -> first token
    prefill_time: float  # first scheduled -> first token
    decode_time: float  # first token -> last token
    e2e: float  # submission -> finished
    inter_token_latencies: list[float]
    num_preemptions: int
    num_cached_prompt_tokens: int
    spec_proposed_tokens: int = 0  # speculative decoding: drafts verified for this request...
    spec_accepted_tokens: int = 0  # ...and kept
    spec_verify_steps: int = 0  # steps that verified drafts: mean kept run = accepted / verify steps


class FinishedRequest(msgspec.Struct, frozen=True):
    """What `engine.on_request_finished` callbacks receive, once per request (aborted ones included)."""

    request_id: int
    num_prompt_tokens: int
    num_generated_tokens: int
    finish_reasons: list[FinishReason]
    metrics: RequestMetrics


class GenerateOutput(msgspec.Struct, frozen=True):
    """A finished request. `text`, `token_ids` and `finish_reason` are those of choices[0]."""

    prompt_token_ids: list[int]
    choices: list[Choice]
    metrics: RequestMetrics
    # params.prompt_logprobs: one per prompt token, aligned with prompt_token_ids (the first has no context: None).
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def finish_reason(self) -> FinishReason:
        return self.choices[0].finish_reason


class Beam(msgspec.Struct, frozen=True):
    """One beam of a beam search: generated tokens only (no prompt, no ending EOS)."""

    token_ids: list[int]
    text: str
    cumulative_logprob: float  # sum of the chosen tokens' log-probabilities (EOS included when it ended one)
    score: float  # what beams are ranked by: cumulative_logprob / length ** length_penalty
    finish_reason: FinishReason


class BeamSearchOutput(msgspec.Struct, frozen=True):
    """`engine.beam_search()`'s result: `beams` best first."""

    prompt_token_ids: list[int]
    beams: list[Beam]
    metrics: RequestMetrics


class EngineStats(msgspec.Struct, frozen=True):
    kv_blocks_total: int
    kv_blocks_used: int  # referenced by a live sequence
    kv_blocks_cached: int  # free, but still holding a reusable prefix (evicted on demand)
    kv_blocks_free: int
    block_size: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    kv_token_slots_allocated: int  # block_size x used blocks
    kv_token_slots_occupied: int  # tokens actually written in them (the PagedAttention waste measure)
    num_requests_finished: int
    num_generated_tokens: int
    engine_error: str | None = None
    # Cached blocks given up to make room: their prefix must be computed again if asked for.
    prefix_cache_evictions: int = 0
    spec_proposed_tokens: int = 0  # speculative decoding: drafts verified...
    spec_accepted_tokens: int = 0  # ...and kept (each kept draft is a decode step saved)
    # Running seats and waiting sequences by request priority (lower runs first; all 0 unless asked).
    num_running_by_priority: dict[int, int] = msgspec.field(default_factory=dict)
    num_waiting_by_priority: dict[int, int] = msgspec.field(default_factory=dict)
    kv_blocks_kept: int = 0  # held for keyed conversations between their turns (cache_key)
