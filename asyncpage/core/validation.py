"""Submission checks that need the model or the pool (vocabulary, context, pool size, max_num_seqs).
Checks of the values alone live in params.py. Both raise a typed error naming the field."""

from __future__ import annotations

from collections.abc import Sequence

from asyncpage.errors import InvalidRequestError, PromptTooLongError
from asyncpage.params import SamplingParams


def check_token_ids(ids: Sequence[object]) -> list[int]:
    if not ids:
        raise InvalidRequestError("prompt", "must not be empty")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidRequestError("prompt", "token ids must be integers")
    return [int(t) for t in ids]  # type: ignore[call-overload]


def check_beam_search(ids: list[int], params: SamplingParams, beam_width: int, *, pool_tokens: int,
                      max_num_seqs: int, block_size: int = 1, max_num_batched_tokens: int | None = None,
                      max_model_len: int | None = None) -> None:
    """What a beam search needs beyond a request's own checks."""
    check_beam_engine(params, beam_width, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    # A preempted search is recomputed beam by beam: in the worst case nothing is shared, and each
    # beam holds whole blocks (its last step has prompt + max_tokens - 1 tokens in the cache, and
    # never more than the context holds: a beam stops at max_model_len).
    tokens = len(ids) + params.max_tokens - 1
    if max_model_len is not None:
        tokens = min(tokens, max_model_len)
    per_beam = -(-tokens // block_size)
    if beam_width * per_beam > pool_tokens // block_size:
        raise PromptTooLongError("max_tokens", f"{beam_width} beams of prompt ({len(ids)}) + max_tokens "
                                 f"({params.max_tokens}), {per_beam} blocks each, may exceed the KV pool "
                                 f"({pool_tokens // block_size} blocks of {block_size} tokens); lower "
                                 "beam_width or max_tokens, or raise num_kv_blocks")


def check_beam_engine(params: SamplingParams, beam_width: int, *, max_num_seqs: int,
                      max_num_batched_tokens: int | None = None) -> None:
    """The part of check_beam_search that does not depend on the prompt: a job whose every record
    would fail it is refused once, before its first record (extract_many)."""
    if beam_width > max_num_seqs:
        raise InvalidRequestError("beam_width", f"{beam_width} beams exceed max_num_seqs={max_num_seqs}")
    if max_num_batched_tokens is not None and beam_width > max_num_batched_tokens:
        # The beams step together, one token each: a step must hold them all or the search never moves.
        raise InvalidRequestError("beam_width", f"{beam_width} beams exceed max_num_batched_tokens="
                                  f"{max_num_batched_tokens}")
    if params.n != 1:
        raise InvalidRequestError("n", "a beam search returns beam_width beams: leave n at 1")
    if params.logprobs is not None:
        raise InvalidRequestError("logprobs", "not available with beam search (each beam has cumulative_logprob)")
    if params.prompt_logprobs is not None:
        raise InvalidRequestError("prompt_logprobs", "not available with beam search (score the prompt with generate)")


def check_context(ids: Sequence[int], max_model_len: int) -> None:
    if len(ids) >= max_model_len:
        raise PromptTooLongError("prompt", f"{len(ids)} tokens; the context holds {max_model_len} (prompt + output)")


def check_request(ids: list[int], params: SamplingParams, *, vocab_size: int, max_model_len: int,
                  pool_tokens: int, max_num_seqs: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError("prompt", f"token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise InvalidRequestError("stop_token_ids", f"token id {bad[0]} outside the vocabulary")
    if params.n > max_num_seqs:
        # Every sample is a sequence and counts against max_num_seqs: this one could never be admitted.
        raise InvalidRequestError("n", f"{params.n} samples exceed max_num_seqs={max_num_seqs}")
    check_context(ids, max_model_len)
    if len(ids) >= pool_tokens:
        raise PromptTooLongError("prompt", f"{len(ids)} tokens can never fit the KV pool ({pool_tokens} tokens)")
    need = min(len(ids) + params.max_tokens, max_model_len)
    if need > pool_tokens:
        raise PromptTooLongError(
            "max_tokens", f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) exceeds the KV pool "
            f"({pool_tokens} tokens); lower max_tokens or raise num_kv_blocks")


PRIORITY_RANGE = 1 << 31  # |priority| below this: any sensible scheme fits, nothing overflows a rank


def check_priority(priority: object) -> None:
    """`priority`: an int (lower runs first), not a bool, within +-2**31."""
    if not isinstance(priority, int) or isinstance(priority, bool) or not -PRIORITY_RANGE < priority < PRIORITY_RANGE:
        raise InvalidRequestError("priority", f"must be an integer within +-2**31 (lower runs first), got {priority!r}")


MAX_CACHE_KEY_CHARS = 256


def check_cache_key(key: object) -> None:
    """`cache_key`: None, or a non-empty string of at most MAX_CACHE_KEY_CHARS characters."""
    if key is not None and (not isinstance(key, str) or not key or len(key) > MAX_CACHE_KEY_CHARS):
        raise InvalidRequestError("cache_key", f"must be None or a non-empty string of at most {MAX_CACHE_KEY_CHARS} "
                                  f"characters, got {key!r:.80}")
