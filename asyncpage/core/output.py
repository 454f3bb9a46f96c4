"""OutputProcessor: one step's new tokens -> what callers see. Incremental detokenization, stop
strings, the request's mailbox, per-request timings, and the `on_request_finished` hooks.

Runs on the engine loop only, called by EngineCore between `Scheduler.update()` and the next step. It
never calls the scheduler: a stop string is its return value, which the loop hands to Scheduler.stop
(vLLM's output processor returning the requests to abort).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from asyncpage.core.request import Request, SeqStatus, Sequence
from asyncpage.decoding.detokenizer import IncrementalDetokenizer, StopStrings
from asyncpage.outputs import FinishedRequest, FinishReason, RequestMetrics, TokenLogprob
from asyncpage.params import SamplingParams

log = logging.getLogger("asyncpage")


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.hooks: list[Callable[[FinishedRequest], None]] = []
        self.num_finished = 0
        self.num_generated = 0

    def detokenizer(self, prompt_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop, params.skip_special_tokens)

    def process(self, seq: Sequence, tokens: list[int], logprob: TokenLogprob | None, now: float) -> int | None:
        """Detokenize `tokens` (just appended to `seq`), apply stop strings, post to the mailbox. Returns
        None, or where a stop string ended the sequence, how many of `tokens` came after the one that
        completed it: the loop then has the scheduler drop them and finish it (Scheduler.stop). Touches
        only the request's text, timings and mailbox, never the scheduler's state."""
        self.num_generated += len(tokens)
        req = seq.request
        t = req.times
        if t.first_token is None:
            t.first_token = now
        elif seq.index == 0 and t.last_token is not None:
            t.inter_token.append(now - t.last_token)
        if seq.index == 0:
            t.last_token = now
        detok = seq.detokenizer
        assert detok is not None
        text = ""
        dropped: int | None = None
        for i, token in enumerate(tokens):
            text += detok.add(token, is_stop_token=token in req.stop_ids)
            if detok.stopped:
                # A stop string inside a run of tokens (speculation, grammar fast-forward): nothing
                # after the token that completed it is emitted.
                dropped = len(tokens) - i - 1
                self.num_generated -= dropped
                tokens = tokens[: i + 1]
                break
        reason: FinishReason | None = "stop" if dropped is not None else seq.finish_reason
        if dropped is not None or seq.status is SeqStatus.FINISHED:
            text += detok.finish()
        req.mailbox.put(seq.index, text, tokens, logprob, reason)
        return dropped

    def stop_strings(self) -> StopStrings:
        """Beam search's stop-string check, on this tokenizer (handed to the scheduler)."""
        return StopStrings(self.tokenizer)

    def beams(self, req: Request) -> None:
        """A beam search is over: its hypotheses, best first, go to the mailbox as samples 0..W-1."""
        assert req.beam is not None
        p = req.params
        self.num_generated += sum(len(h.token_ids) for h in req.beam.finished)
        for i, hyp in enumerate(req.beam.finished):
            detok = self.detokenizer(req.prompt_token_ids, p)
            text = "".join(detok.add(t) for t in hyp.token_ids) + detok.finish()
            req.mailbox.put(i, text, hyp.token_ids, None, hyp.finish_reason)
        if not req.beam.finished:
            req.mailbox.put(0, "", [], None, "length")

    def report(self, req: Request) -> None:
        """The request is over (finished, aborted, failed): count it and call the hooks."""
        req.times.finished = req.times.finished or time.monotonic()
        if req.beam is not None:
            self.num_finished += req.beam.done
        elif all(s.finish_reason in ("stop", "length") for s in req.seqs) and len(req.seqs) == req.params.n:
            self.num_finished += 1
        if not self.hooks:
            return
        try:
            done = self._finished(req)
        except Exception:  # this request's own record (its timings, its samples): its hooks are skipped
            log.exception("request %d: its on_request_finished record could not be built", req.request_id)
            return
        for hook in self.hooks:
            try:
                hook(done)
            except Exception:
                log.exception("on_request_finished callback failed")

    def _finished(self, req: Request) -> FinishedRequest:
        reasons: list[FinishReason] = [s.finish_reason or "abort" for s in req.seqs]
        reasons += ["abort"] * (req.params.n - len(reasons))  # aborted before its samples forked
        generated = sum(s.num_output_tokens for s in req.seqs)
        if req.beam is not None and req.beam.done:
            # A finished search reports its beams (what beams() posted), not the sequences it last ran.
            reasons = [h.finish_reason for h in req.beam.finished] or ["length"]
            generated = sum(len(h.token_ids) for h in req.beam.finished)
        return FinishedRequest(
            request_id=req.request_id, num_prompt_tokens=len(req.prompt_token_ids),
            num_generated_tokens=generated, finish_reasons=reasons, metrics=request_metrics(req))


def request_metrics(req: Request) -> RequestMetrics:
    t = req.times
    first_sched = t.first_scheduled or t.arrival
    first = t.first_token or first_sched
    end = t.finished or t.last_token or first
    return RequestMetrics(
        queue_time=first_sched - t.arrival, ttft=first - t.arrival, prefill_time=first - first_sched,
        decode_time=(t.last_token or first) - first, e2e=end - t.arrival,
        inter_token_latencies=list(t.inter_token), num_preemptions=req.num_preemptions,
        num_cached_prompt_tokens=req.num_cached_prompt_tokens, spec_proposed_tokens=req.spec_proposed_tokens,
        spec_accepted_tokens=req.spec_accepted_tokens, spec_verify_steps=req.spec_verify_steps)
