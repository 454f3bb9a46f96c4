"""A request (one caller, one prompt, n samples) and its sequences (the unit the scheduler runs).

vLLM V1's arithmetic: a sequence has `num_computed_tokens` and `num_tokens`; each step gives it
tokens until the first catches up with the second. Chunked prefill, prefix-cache hits (start with
computed > 0), preemption (computed back to 0) and decode are all the same thing.
The engine loop owns these objects; the worker thread only sees the snapshot built from them.
Outside the loop only one field is ever written: `abort_requested` (a flag, set from any thread);
`released` is read by callers waiting for the loop to let go of a request.
"""

from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from asyncpage.core.mailbox import Mailbox
from asyncpage.kv.cache import BlockTable
from asyncpage.outputs import FinishReason, TokenLogprob
from asyncpage.params import SamplingParams

if TYPE_CHECKING:
    from asyncpage.decoding.beam import BeamSearch
    from asyncpage.decoding.detokenizer import IncrementalDetokenizer
    from asyncpage.decoding.speculative import SpecState
    from asyncpage.guided import Matcher


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestTimes:
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    inter_token: list[float] = field(default_factory=list)


@dataclass(eq=False)
class Request:
    request_id: int  # internal, from the engine's counter: callers never pick ids, so never collide
    prompt_token_ids: list[int]
    params: SamplingParams
    mailbox: Mailbox
    stop_token_ids: frozenset[int]
    seqs: list[Sequence] = field(default_factory=list)
    times: RequestTimes = field(default_factory=RequestTimes)
    forked: bool = False  # n > 1: children are created when the prompt's last token is computed
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    priority: int = 0  # lower runs first (vLLM's convention); ties by arrival (Scheduler)
    cache_key: str | None = None  # a conversation whose blocks are kept past this request (kv/retention.py)
    abort_requested: bool = False  # set by abort() from anywhere; acted on by the loop only
    released: bool = False  # the loop is done with it: blocks freed, mailbox final
    released_event: Any = None  # an anyio.Event made by the first waiter (on the loop)
    # A beam search: `seqs` are its running beams (rebuilt every step), finished ones are hypotheses there.
    beam: BeamSearch | None = None
    spec_proposed_tokens: int = 0  # speculative decoding: drafts verified for this request
    spec_accepted_tokens: int = 0  # ...and kept
    spec_verify_steps: int = 0  # steps that verified drafts: mean kept run = accepted / steps
    # params.prompt_logprobs: entry i is prompt token i+1's, filled chunk by chunk as the prompt is computed.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def scoring_prompt(self) -> bool:
        """Prompt log-probabilities are asked and not all known yet: the prompt must be computed, not
        taken from the prefix cache (a cached token has no logits)."""
        return (self.params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1)

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return len(self.seqs) == self.params.n and all(s.status is SeqStatus.FINISHED for s in self.seqs)

    @functools.cached_property
    def stop_ids(self) -> frozenset[int]:
        """Token ids that end a sample: the caller's stop_token_ids, and the EOS ids unless ignore_eos."""
        return frozenset(self.params.stop_token_ids) | (frozenset() if self.params.ignore_eos
                                                        else self.stop_token_ids)

    @property
    def width(self) -> int:
        """Sequences this request runs at once once forked: n samples, or W beams."""
        return self.beam.width if self.beam is not None else self.params.n

    def aligned_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """params.prompt_logprobs aligned with the prompt (RequestStream.prompt_logprobs)."""
        if self.params.prompt_logprobs is None:
            return None
        got = list(self.prompt_logprobs)  # written by the loop only while the prompt is computed
        return [None, *got] + [None] * (len(self.prompt_token_ids) - 1 - len(got))


@dataclass(eq=False)
class Sequence:
    seq_id: int
    index: int  # which of the request's n samples
    request: Request
    token_ids: list[int]  # prompt + generated
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer | None
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    table: BlockTable = field(default_factory=BlockTable)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    # Guided decoding state; advanced only by the worker thread, right after this sequence is sampled.
    matcher: Matcher | None = None
    # Chained digests of this sequence's full blocks of tokens, computed once (tokens only ever
    # append): a waiting sequence blocked at the head of the queue is looked up every step.
    prefix_digests: list[bytes] = field(default_factory=list)
    spec: SpecState | None = None  # speculative decoding: this sequence's n-gram proposer
    queued_at: float = 0.0  # when it last joined the waiting queue (added or preempted): its aging
    rank: float = 0.0  # its rank when last admitted (Scheduler: what a waiting one must beat to preempt it)

    def fork(self, seq_id: int, index: int, table: BlockTable, generator: torch.Generator | None, *,
             detokenize: bool = True) -> Sequence:
        """A running child at this sequence's point (n > 1 samples, a beam chosen twice): its tokens,
        computed count, grammar state and (with `detokenize`) text so far; `table` is the parent's forked
        by the KV manager (copy-on-write), `generator` the child's own random stream."""
        return Sequence(
            seq_id=seq_id, index=index, request=self.request, token_ids=list(self.token_ids),
            generator=generator,
            detokenizer=self.detokenizer.fork() if detokenize and self.detokenizer is not None else None,
            num_prompt_tokens=self.num_prompt_tokens, num_computed_tokens=self.num_computed_tokens, table=table,
            status=SeqStatus.RUNNING, matcher=self.matcher.fork() if self.matcher is not None else None,
            queued_at=self.queued_at, rank=self.rank)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def params(self) -> SamplingParams:
        return self.request.params
