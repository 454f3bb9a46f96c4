"""Beam search: which continuations survive each step, and when the search is over.

The rules are transformers' (`GenerationMixin._beam_search`, the 2025 rewrite), so a beam search
here returns the beams `generate(num_beams=W, do_sample=False)` returns, token for token:
- each step keeps the K = max(2, 1 + #EOS) * W best continuations over all beams by cumulative
  log-probability (K > W so that W beams can go on when the best ones end);
- a continuation that ends (EOS, a stop id or string, the length limit) becomes a finished
  hypothesis only if it ranks among the first W, scored cumulative / length ** length_penalty, the
  length counting the ending token; the best W hypotheses are kept;
- the W best continuations that do not end are the next beams;
- beam_width=1 is greedy search (transformers runs generate(num_beams=1) as such);
- the search stops once no running beam can beat the worst kept hypothesis (transformers' heuristic:
  the best running score at the current length, or at max_tokens with early_stopping="never" and a
  positive length penalty), once W hypotheses exist with early_stopping=True, or when every kept
  continuation ends.
- `best_only` (not transformers'; a scoring probe's): only the best hypothesis is wanted, so with no
  length penalty a beam whose cumulative log-probability is already no better than the best finished
  hypothesis's leaves the search (it can only fall), and the search ends once no beam is left. The best
  hypothesis is the one the full search finds: the beams above that bound, and their ranks, are the
  same in both searches (the pruned ones' continuations rank below it); only the work below it is skipped.

This module is pure bookkeeping over numbers and token lists; the scheduler forks the beams' block
tables along the choices made here (scheduler.py), the runner supplies each beam's top candidates
(sampling.beam_candidates). It is touched by the engine loop only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from asyncpage.errors import InvalidRequestError
from asyncpage.outputs import FinishReason

EarlyStopping = bool | Literal["never"]


class BeamParams(msgspec.Struct, frozen=True, kw_only=True):
    """How one beam search runs (`engine.beam_search`'s arguments), checked at construction."""

    beam_width: int
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False
    # Only the best hypothesis is wanted (a scoring probe's likeliest value): a running beam that cannot beat
    # the best finished one leaves the search, which ends once none can. Exact only without a length penalty
    # (log-probabilities only fall, so a beam's final score is at most its score now) and without
    # early_stopping=True (which stops at W hypotheses, and pruning changes which come first): refused otherwise.
    best_only: bool = False

    def __post_init__(self) -> None:
        w = self.beam_width
        if not isinstance(w, int) or isinstance(w, bool) or w < 1:
            raise InvalidRequestError("beam_width", f"must be an integer >= 1, got {w!r}")
        lp = self.length_penalty
        if not isinstance(lp, int | float) or isinstance(lp, bool) or lp != lp or abs(lp) == float("inf"):
            raise InvalidRequestError("length_penalty", f"must be a finite number, got {lp!r}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise InvalidRequestError("early_stopping", f"must be true, false or 'never', got {self.early_stopping!r}")
        if self.best_only is not False and (self.best_only is not True or self.length_penalty != 0
                                            or self.early_stopping is True):
            # early_stopping=True ends the search at W hypotheses, and pruning changes which W come first.
            raise InvalidRequestError("best_only", "must be a bool, and true only with length_penalty 0 and "
                                      f"early_stopping False or 'never' (its pruning is exact only then), got "
                                      f"{self.best_only!r} with length_penalty {self.length_penalty!r} and "
                                      f"early_stopping {self.early_stopping!r}")


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens (the ending EOS or stop id not included)."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float  # cumulative_logprob / length ** length_penalty
    finish_reason: FinishReason


@dataclass
class Choice:
    """One continuation kept as a running beam: beam `parent` extended by `token`."""

    parent: int
    token: int
    cumulative_logprob: float


# Ends a continuation of beam `parent` by `token`: (reason, whether `token` stays in the output), or None
# (it goes on); a None reason is a dead end (half of a grammar's value): dropped, not a hypothesis.
EndCheck = Callable[[int, int], tuple[FinishReason | None, bool] | None]


@dataclass
class BeamSearch:
    params: BeamParams
    max_tokens: int
    num_eos: int  # how many ids end a sequence: transformers keeps (1 + that) * W candidates
    scores: list[float] = field(default_factory=lambda: [0.0])  # cumulative logprob of each running beam
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most W
    generated: int = 0  # tokens each running beam has generated (they all advance together)
    improvable: bool = True  # transformers' is_early_stop_heuristic_unsatisfied
    done: bool = False

    @property
    def width(self) -> int:
        return self.params.beam_width

    @property
    def num_candidates(self) -> int:
        """How many continuations each step keeps, and so how many each beam must offer."""
        return max(2, 1 + self.num_eos) * self.width

    def step(self, beams: list[list[int]], candidates: list[tuple[list[int], list[float]]],
             ends: EndCheck) -> list[Choice]:
        """One step. `beams[i]`: running beam i's generated tokens; `candidates[i]`: its best
        (token ids, log-probabilities), at least `num_candidates` of them unless fewer are allowed.
        Returns the next running beams (best first); finished ones go to `self.finished`."""
        assert len(beams) == len(candidates) == len(self.scores)
        pool = [(self.scores[i] + lp, i, tok) for i, (toks, lps) in enumerate(candidates)
                for tok, lp in zip(toks, lps, strict=True)]
        # Stable on ties: beam order, then the candidates' own order, as a topk over [beams x vocab] does.
        pool.sort(key=lambda c: -c[0])
        # One beam is greedy search, as in transformers: the best continuation, and the first end is final.
        top = pool[: self.num_candidates if self.width > 1 else 1]
        p = self.params
        length = self.generated + 1
        beams_full_before = len(self.finished) == self.width and p.early_stopping is True
        running: list[Choice] = []
        new: list[Hypothesis] = []
        for rank, (cum, parent, tok) in enumerate(top):
            end = ends(parent, tok)
            if end is None and length >= self.max_tokens:
                end = ("length", True)
            if end is None:
                if len(running) < self.width:
                    running.append(Choice(parent, tok, cum))
                continue
            reason, keep = end
            if reason is None:
                continue  # a dead end (a grammar's half value): neither running nor a hypothesis
            if rank < self.width and self.improvable and not beams_full_before:
                tokens = beams[parent] + [tok] if keep else list(beams[parent])
                new.append(Hypothesis(tokens, cum, cum / length ** p.length_penalty, reason))
        # Stable: an earlier hypothesis wins a tie against a new one, as in transformers' merge.
        self.finished = sorted(self.finished + new, key=lambda h: -h.score)[: self.width]
        self.generated = length
        self.scores = [c.cumulative_logprob for c in running]
        self._check_done(all_ended=not running)
        return running

    def retire(self, beam: int, tokens: list[int], reason: FinishReason, *, valid: bool = True) -> None:
        """A running beam that cannot go on (its grammar is complete) ends here, with its tokens;
        `valid=False`: its grammar stopped where the value is incomplete (a dead end: no token can
        follow), so it leaves the search without becoming a hypothesis."""
        cum = self.scores.pop(beam)
        if self.improvable and valid:
            score = cum / max(1, self.generated) ** self.params.length_penalty
            self.finished = sorted([*self.finished, Hypothesis(tokens, cum, score, reason)],
                                   key=lambda h: -h.score)[: self.width]
        self._check_done(all_ended=not self.scores)

    def hopeless(self) -> list[int]:
        """With best_only: the running beams (their indices) that cannot beat the best hypothesis found: with
        no length penalty a beam's final score is at most its cumulative log-probability now. A tie is
        hopeless too (an earlier hypothesis wins a tie). Empty otherwise."""
        if not self.params.best_only or not self.finished:
            return []
        bound = self.finished[0].cumulative_logprob
        return [i for i, s in enumerate(self.scores) if s <= bound]

    def drop(self, beams: list[int]) -> None:
        """Running beams `beams` (indices) leave the search without becoming hypotheses (hopeless)."""
        for i in sorted(beams, reverse=True):
            self.scores.pop(i)
        self._check_done(all_ended=not self.scores)

    def _check_done(self, all_ended: bool) -> None:
        p = self.params
        if p.early_stopping == "never" and p.length_penalty > 0:
            best_length = self.max_tokens
        else:
            best_length = self.generated
        full = len(self.finished) == self.width
        if self.scores and full:
            best_running = max(self.scores) / best_length ** p.length_penalty
            self.improvable = self.improvable and best_running > self.finished[-1].score
        self.done = all_ended or not self.improvable or (full and p.early_stopping is True)
