"""One guided row's sampled token through its sequence's grammar: accepting it, fast-forwarding the
tokens the grammar forces, budget closing (guided/budget.py), and filling a step's masks. The one
grammar step of the engine: the model runner (core/runner.py) and speculative verification
(decoding/speculative.py) both call it. Touches only the matcher and the step's sampling result."""

from __future__ import annotations

import logging

import torch

from asyncpage.decoding.sampling import SampleResult, SampleSpec
from asyncpage.guided import Matcher
from asyncpage.guided.backend import apply_bitmask
from asyncpage.guided.budget import ALTERNATIVES, Closer, Guards, MatcherError, guards_for, matcher_error
from asyncpage.outputs import TokenLogprob

log = logging.getLogger("asyncpage")


def guided_step(m: Matcher, spec: SampleSpec, result: SampleResult, i: int, logits: torch.Tensor,
                 bitmask: torch.Tensor) -> tuple[list[int], bool] | None:
    """Take row i's sampled token through the sequence's grammar (budget closing may replace it in
    `result`). Returns (tokens the grammar forces next, grammar ended); None if it refuses the token."""
    closer = closer_for(m, spec) if spec.budget is not None else None
    if closer is not None:
        return budget_step(closer, i, spec, result, logits, bitmask)
    # A correct mask never lets the grammar reject the sampled token; if it ever does, the token is
    # dropped and the request fails, rather than emitting text outside the grammar.
    if not m.accept(result.tokens[i]):
        return None
    if m.is_terminated():
        return [], True
    ff = []
    if spec.params.logprobs is None:
        # Fast-forward: tokens the grammar leaves no choice about ('{"name":"' in a schema) join the
        # sequence now and are computed next step as one chunk, not one step each.
        for t in m.forced_tokens():
            if not m.accept(t):  # llguidance's matcher is in its error state then, which reads as ended
                raise matcher_error(m, f"token {t} it forced")
            ff.append(t)
    return ff, m.is_terminated()


def closer_for(m: Matcher, spec: SampleSpec) -> Closer | None:
    make = getattr(m, "closer", None)  # matchers that support budget closing
    if make is None:
        return None
    p = spec.params

    def guards() -> Guards | None:  # asked once per sequence
        if p.json_schema is not None:
            return guards_for(p.json_schema, p.max_number_digits, p.max_string_repeats)
        return Guards(p.max_number_digits, p.max_string_repeats) if p.grammar is not None and p.json_guards else None

    closer: Closer | None = make(guards)
    return closer


def budget_step(closer: Closer, i: int, spec: SampleSpec, result: SampleResult, logits: torch.Tensor,
                 bitmask: torch.Tensor) -> tuple[list[int], bool] | None:
    """Take row i's token through budget closing (it may be replaced by one that keeps a valid
    completion within the budget); returns (forced tokens, grammar ended), None if the grammar refuses."""
    sampled = result.tokens[i]

    def alternatives() -> list[int]:
        row = logits[i : i + 1].clone()
        apply_bitmask(row, bitmask[i : i + 1])
        vals, ids = row[0].topk(min(ALTERNATIVES, row.shape[1]))
        return [int(t) for t, v in zip(ids.tolist(), vals.tolist(), strict=True) if v != float("-inf")]

    assert spec.budget is not None
    out = closer.step(sampled, spec.budget, spec.params.logprobs is None, alternatives)
    if out is None:
        return None
    token, ff, stopped = out
    if token != sampled:
        result.tokens[i] = token
        old = result.logprobs[i]
        if old is not None:
            lp = float(torch.log_softmax(logits[i].float(), dim=-1)[token])
            result.logprobs[i] = TokenLogprob(token, lp, old.top)
    return ff, stopped


def fill_masks(guided: list[tuple[int, Matcher]], bitmask: torch.Tensor) -> dict[int, str]:
    """Fill each guided row's mask; returns the rows whose matcher raised, and why (their requests
    fail alone; the row keeps an all-allowed mask, and its sample is never used)."""
    broken: dict[int, str] = {}
    for row, matcher in guided:
        try:
            matcher.fill_bitmask(bitmask, row)
        except Exception as exc:
            broken[row] = grammar_failure(exc)
    return broken


def grammar_failure(exc: Exception) -> str:
    """The failure of one sequence whose grammar work raised: logged with its traceback (a backend
    bug shows there), reported to its caller as a SamplingError."""
    log.warning("guided decoding failed for one sequence: %r", exc, exc_info=not isinstance(exc, MatcherError))
    return f"guided decoding failed: {exc}"
