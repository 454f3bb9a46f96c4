"""Scoring requests: how likely the model finds a text after a context, or which value a grammar allows there
is likeliest. What the scored decisions (booleans.py, decisions.py) are measured with.

Three kinds, each one request:
- `Probe.tokens(ctx, ids)`: the log-likelihood of the tokens `ids` after `ctx` (teacher-forced: a grammar of
  those token ids alone, `<[id]>`, each token's log-probability from the raw model output; fast-forward is off
  when log-probabilities are asked, so every token goes through the model). `text(engine, ctx, text)`: the
  same for a text, tokenized as it stands. `ctx` reaches the engine as
  token ids: its blocks come from the prefix cache (the record's prompt, the text a statement follows), and
  only the last partial block and `text` are computed, with one LM-head row per token. A record's probes
  share their context's KV blocks (copy-on-write), and run batched with everything else the engine does.
- `Probe.best(ctx, grammar)`: the likeliest value `grammar` allows after `ctx`: a beam search (4 beams,
  ranked by their total log-probability: length_penalty 0), its best hypothesis's text and log-probability;
  best_only: a beam that can no longer beat the best value found leaves the search at once.
- `Probe.scored(ids, n)`: the log-likelihood of the last `n` tokens of `ids`, from the prompt's own
  log-probabilities (the whole prompt is computed: what a reading that changes the start of the text needs).

A probe runs inside a job's loop (`submit`, then `result` once `done`: extract_many never waits on one);
decisions.Plan.run runs a record's probes to the end where nothing else waits on them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio

from asyncpage.core.mailbox import Mailbox
from asyncpage.decoding.beam import BeamParams
from asyncpage.errors import GrammarError, InvalidRequestError, PromptTooLongError, QueueFullError
from asyncpage.guided import GuidedSpec
from asyncpage.params import SamplingParams

if TYPE_CHECKING:
    from asyncpage.core.client import EngineClient
    from asyncpage.core.request import Request

BEST_BEAMS = 4
BEST_MAX_TOKENS = 32  # a value longer than this is not a closed choice's


class Scored(NamedTuple):
    logprob: float  # the sum over its tokens
    tokens: int
    text: str  # what was scored (for `best`, the value found)

    @property
    def per_token(self) -> float:
        return self.logprob / max(1, self.tokens)


class Probe:
    """One scoring request: build with `text`, `best` or `scored`, then `submit` (or `run`)."""

    def __init__(self, prompt: list[int], params: SamplingParams, beam: BeamParams | None = None,
                 scored: int = 0) -> None:
        # scored > 0: the prompt's last `scored` tokens; < 0: the first -scored generated (teacher-forced) ones
        self.prompt, self.params, self.beam, self.n_scored = prompt, params, beam, scored
        self.request: Request | None = None
        self.failed: BaseException | None = None  # refused at submission (a prompt past the pool, ...)
        self._read = False
        self._result: Scored | None = None

    @classmethod
    def tokens(cls, ctx: Sequence[int], ids: Sequence[int]) -> Probe:
        grammar = "%llguidance {}\nstart: " + " ".join(f"<[{int(t)}]>" for t in ids) + "\n"
        return cls(list(ctx), SamplingParams(max_tokens=len(ids) + 1, temperature=0, logprobs=0, grammar=grammar,
                                             budget_close=False), scored=-len(ids))

    @classmethod
    def text(cls, engine: EngineClient, ctx: Sequence[int], text: str) -> Probe:
        return cls.tokens(ctx, engine.tokenizer(text, add_special_tokens=False)["input_ids"])

    @classmethod
    def best(cls, ctx: Sequence[int], grammar: str) -> Probe:
        return cls(list(ctx), SamplingParams(max_tokens=BEST_MAX_TOKENS, temperature=0, grammar=grammar,
                                             budget_close=False),
                   beam=BeamParams(beam_width=BEST_BEAMS, length_penalty=0.0, best_only=True))

    @classmethod
    def scored(cls, ids: Sequence[int], n: int) -> Probe:
        return cls(list(ids), SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), scored=n)

    async def submit(self, engine: EngineClient, mailbox: Mailbox, *, priority: int = 0,
                     cache_key: str | None = None) -> None:
        """Queue it (waiting while the engine's queue is full); a refusal of this probe alone (too long for
        the context or the pool) is kept in `failed`, the engine's own failures raise."""
        try:
            self.request = await submit_when_room(engine, self.prompt, self.params, mailbox, self.beam,
                                                  priority=priority, cache_key=cache_key)
        except (PromptTooLongError, InvalidRequestError, GrammarError) as exc:  # this probe's alone
            self.failed = exc

    @property
    def done(self) -> bool:
        r = self.request
        return self.failed is not None or (r is not None and (r.finished or r.mailbox.error is not None))

    def result(self, engine: EngineClient) -> Scored | None:
        """What it measured, once done; None when it could not run (refused, failed, no value found), or is
        not done. Read once (its mailbox drains), then kept."""
        if not self._read and self.done:
            self._read, self._result = True, self._measure(engine)
        return self._result

    def _measure(self, engine: EngineClient) -> Scored | None:
        r = self.request
        if r is None or r.mailbox.error is not None:
            return None
        if self.n_scored < 0:  # teacher-forced tokens: the first -n_scored sampled ones
            n = -self.n_scored
            out = r.mailbox.drain().get(0)
            if out is None or out.logprobs is None or len(out.logprobs) < n or n == 0:
                return None
            return Scored(sum(e.logprob for e in out.logprobs[:n]), n, out.text)
        if self.n_scored:
            lps = r.aligned_prompt_logprobs() or []
            tail = lps[len(lps) - self.n_scored:]
            if len(tail) != self.n_scored or any(e is None for e in tail):
                return None
            return Scored(sum(e.logprob for e in tail if e is not None), self.n_scored, "")
        if self.beam is not None:
            hyps = [h for h in (r.beam.finished if r.beam is not None else []) if h.finish_reason == "stop"]
            if not hyps:
                return None
            best = max(hyps, key=lambda h: h.cumulative_logprob)
            text = engine.tokenizer.decode(best.token_ids, skip_special_tokens=True)
            return Scored(best.cumulative_logprob, len(best.token_ids), text)
        return None

    def abort(self, engine: EngineClient) -> None:
        if self.request is not None and not self.done:
            engine.abort(self.request)

    def forget(self, engine: EngineClient) -> None:
        """Drop its grammar from the engine's cache (a record's own: a value of it, its copied spans)."""
        engine.guided.forget(GuidedSpec.from_params(self.params))


async def submit_when_room(engine: EngineClient, prompt: list[int], params: SamplingParams, mailbox: Mailbox,
                           beam: BeamParams | None = None, *, priority: int = 0,
                           cache_key: str | None = None) -> Request:
    """engine.submit, waiting while the engine's queue is full (QueueFullError, max_queued_requests): a
    job shares its engine with other callers, and its records (and their probes) wait for room rather than
    fail. A dead or stopped engine raises its own error, so this never waits on an engine that cannot serve."""
    delay = 0.02
    while True:
        try:
            return await engine.submit(prompt, params, mailbox, beam=beam, priority=priority, cache_key=cache_key)
        except QueueFullError as exc:
            await anyio.sleep(min(delay, exc.retry_after))
            delay = min(delay * 2, 0.5)


async def gather(calls: Sequence[Awaitable[Any]]) -> list[Any]:
    """Await `calls` together (one batch in the engine), their results in order."""
    out: list[Any] = [None] * len(calls)

    async def one(i: int) -> None:
        out[i] = await calls[i]

    async with anyio.create_task_group() as tg:
        for i in range(len(calls)):
            tg.start_soon(one, i)
    return out
