"""Sampler: logits -> next tokens, vectorized over the rows of a step.

Order (as in vLLM/transformers): guided-decoding mask, penalties, then greedy argmax, or temperature,
top-k, top-p, min-p and a draw. The draw uses the exponential race (argmax p / E with E ~ Exp(1)),
which is an exact sample of p, with noise from each sequence's own generator: a seeded request draws
the same numbers whatever else is in the batch.
Log-probabilities are those of the raw model output (before penalties and temperature).
A row with no valid token (a NaN or +inf logit, e.g. float16 overflow, or a mask that leaves no finite
logit) is reported in `SampleResult.invalid`, never turned into some token id.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from asyncpage.guided import Matcher, apply_bitmask
from asyncpage.guided.backend import allowed_tokens, keeps_maximum
from asyncpage.outputs import TokenLogprob
from asyncpage.params import SamplingParams
from asyncpage.runtime.reduce import first_max


@dataclass
class SampleSpec:
    seq_id: int
    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int] | None = None  # only when a repetition penalty needs them
    output_ids: list[int] | None = None  # only when a penalty needs them
    matcher: Matcher | None = None  # guided decoding: its mask row is applied before anything else
    # budget_close: tokens this sequence may still emit, the one sampled now included (None: not closing)
    budget: int | None = None
    beam_k: int = 0  # a beam of a beam search: its beam_k best continuations are wanted, not a sample


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[TokenLogprob | None]
    invalid: frozenset[int] = frozenset()  # rows without a valid token: their `tokens` entry is -1


def needs_history(p: SamplingParams) -> bool:
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1


def sample(logits: torch.Tensor, specs: list[SampleSpec], bitmask: torch.Tensor | None = None,
           searched: tuple[torch.Tensor, torch.Tensor] | None = None) -> SampleResult:
    """logits: [N, V] float32, one row per spec (rows may repeat for forked samples).
    bitmask: [N, ceil(V/32)] int32 guided-decoding masks (rows of unconstrained specs are ignored).
    searched: each row's maximum and first index in `logits` (as `first_max`), where the LM head's kernel
    found them as it wrote the logits: not searched again.
    A beam's row (`beam_k`) is not sampled: beam_candidates chooses among its continuations (and finds it has
    none); its entry here is its raw maximum's index, never in `invalid`."""
    n = logits.shape[0]
    asking = [i for i, s in enumerate(specs) if s.params.logprobs is not None]
    raw_logprobs: dict[int, torch.Tensor] = {}
    if asking:  # only the rows that ask (a row's log_softmax does not depend on the others)
        lsm = torch.log_softmax(logits if len(asking) == n else logits[asking], dim=-1)
        raw_logprobs = {i: lsm[i if len(asking) == n else j] for j, i in enumerate(asking)}
    beam_rows = {i for i, s in enumerate(specs) if s.beam_k}
    penalized = [i for i, s in enumerate(specs) if needs_history(s.params) and i not in beam_rows]
    guided_rows = [i for i, s in enumerate(specs) if s.matcher is not None and i not in beam_rows] \
        if bitmask is not None else []
    picked: dict[int, tuple[float, int]] = {}  # greedy guided rows: (maximum, token) under their masks
    found = searched  # each row's maximum and its first index, while `logits` are the caller's
    if guided_rows:
        # A greedy row is decided under its mask row by row (masked_max: mostly without masking it); only the
        # other guided rows are masked here.
        assert bitmask is not None
        found = found if found is not None else first_max(logits)  # before any mask: one search for all
        tops = list(zip(found[0].tolist(), found[1].tolist(), strict=True))
        for i in guided_rows:
            if specs[i].params.greedy and i not in penalized:
                picked[i] = masked_max(logits[i], bitmask[i], tops[i])
        guided_rows = [i for i in guided_rows if i not in picked]
    if guided_rows or penalized:
        found = None
        logits = logits.clone()  # the caller's logits stay raw (logprobs and beams are computed from them)
        if guided_rows:
            assert bitmask is not None
            masked = logits[guided_rows]
            apply_bitmask(masked, bitmask[guided_rows])
            logits[guided_rows] = masked
        for i in penalized:
            _apply_penalties(logits[i], specs[i])

    rand = [i for i, s in enumerate(specs) if not s.params.greedy and i not in beam_rows]
    # The maximum propagates NaN and +inf, and is -inf only when nothing is allowed: one pass finds
    # every bad row. For greedy rows the same pass gives the tokens (the first maximal value, NaN
    # counted as the maximum): runtime/reduce.py's search.
    row_max, tokens = found if found is not None else first_max(logits)
    # Checked in Python, not by torch ops on an n-element tensor (~0.1 ms of dispatch at one row).
    maxima = row_max.tolist()
    token_list = tokens.tolist()
    for i, (value, token) in picked.items():
        maxima[i], token_list[i] = value, token
    invalid = frozenset(i for i, m in enumerate(maxima) if not math.isfinite(m) and i not in beam_rows)
    if rand:
        if invalid:
            logits = logits.clone()
            logits[list(invalid)] = 0.0  # sampled, then discarded: keeps NaN out of the other rows' math
        row_max = torch.tensor([0.0 if i in invalid else m for i, m in enumerate(maxima)], dtype=row_max.dtype)
        if len(rand) == n:  # every row sampled: no row copies (a 262k row is ~50 us to copy)
            drawn = _sample_random(logits, row_max, specs).tolist()
        else:
            drawn = _sample_random(logits[rand], row_max[rand], [specs[i] for i in rand]).tolist()
        for i, t in zip(rand, drawn, strict=True):
            token_list[i] = t
    for i in invalid:
        token_list[i] = -1
    out_logprobs: list[TokenLogprob | None] = [None] * n
    for i, row in raw_logprobs.items():
        k = specs[i].params.logprobs
        top = {}
        if k:
            vals, ids = row.topk(k)
            top = dict(zip(ids.tolist(), vals.tolist(), strict=True))
        if i not in invalid:
            out_logprobs[i] = TokenLogprob(token_list[i], float(row[token_list[i]]), top)
    return SampleResult(token_list, out_logprobs, invalid)


def masked_max(row: torch.Tensor, bitmask_row: torch.Tensor | None,
               top: tuple[float, int] | None = None) -> tuple[float, int]:
    """The first maximal logit of `row` (one row of logits) among the tokens `bitmask_row` allows (every token
    without one) and its token: what masking the row and searching it gives, NaN counted as the maximum; (-inf, 0)
    when nothing is allowed. The row is masked only when its own maximum is not allowed (keeps_maximum) and more
    than a few tokens are (allowed_tokens). `top`: the row's unmasked maximum and its index, when known."""
    if top is None:
        value, token = first_max(row)
        top = float(value), int(token)
    if bitmask_row is None:
        return top
    if (t := keeps_maximum(row, bitmask_row, top)) is not None:
        return top[0], t
    allowed = allowed_tokens(bitmask_row, row.numel())  # a mask narrower than the row is refused here, loudly
    if allowed is not None:
        if not allowed.numel():
            return float("-inf"), 0
        value, j = first_max(row[allowed].contiguous())
        return float(value), int(allowed[int(j)])
    masked = row[None].clone()
    apply_bitmask(masked, bitmask_row[None])
    value, token = first_max(masked[0])
    return float(value), int(token)


def has_valid_token(row: torch.Tensor, bitmask_row: torch.Tensor | None) -> bool:
    """Whether `row` has a finite maximum among the tokens `bitmask_row` allows (masked_max): what sampling it
    would find. A beam with no candidate (beam_candidates: log-probabilities not finite) but a valid token goes on
    without one; one without a valid token fails, as a sampled row does."""
    return math.isfinite(masked_max(row, bitmask_row)[0])


def beam_candidates(logits: torch.Tensor, specs: list[SampleSpec], bitmask: torch.Tensor | None = None,
                    ) -> dict[int, tuple[list[int], list[float]]]:
    """Each beam row's `beam_k` best (token ids, log-probabilities), keyed by seq_id. As transformers'
    beam search scores them: log_softmax of the raw logits, then the processors (the grammar mask,
    penalties) on the log-probabilities, without renormalizing. A beam whose grammar allows no token with a
    finite log-probability (or a NaN / inf row) gets no candidate (the runner fails its request where the row has
    no valid token either: has_valid_token)."""
    rows = [i for i, s in enumerate(specs) if s.beam_k]
    if not rows:
        return {}
    lp = torch.log_softmax((logits if len(rows) == logits.shape[0] else logits[rows]).float(), dim=-1)
    out = {}
    for j, i in enumerate(rows):
        s = specs[i]
        row = lp[j]
        allowed = None
        if s.matcher is not None and bitmask is not None:
            # Few tokens allowed: their values are the candidates (no masked copy of the row, no search of it).
            allowed = allowed_tokens(bitmask[i], row.numel())
            if allowed is None:
                apply_bitmask(row[None], bitmask[i : i + 1])
        if needs_history(s.params):
            _apply_penalties(row, s)
        if allowed is not None:
            # Ties in the order of their token ids (what the whole row's topk gave for tied values).
            sub = row[allowed]
            at = torch.sort(sub, descending=True, stable=True).indices[: s.beam_k]
            vals, ids = sub[at], allowed[at]
        else:
            vals, ids = row.topk(min(s.beam_k, row.numel()))
        keep = torch.isfinite(vals)
        out[s.seq_id] = (ids[keep].tolist(), vals[keep].tolist())
    return out


def _apply_penalties(row: torch.Tensor, s: SampleSpec) -> None:
    p = s.params
    out = torch.tensor(s.output_ids or [], dtype=torch.long)
    if p.repetition_penalty != 1:
        # transformers' RepetitionPenaltyLogitsProcessor: every token seen (prompt and output).
        seen = torch.cat([torch.tensor(s.prompt_ids or [], dtype=torch.long), out]).unique()
        vals = row[seen]
        penalized = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        # A tiny penalty divides a positive logit past the float range: keep it the largest finite value.
        row[seen] = penalized.clamp(max=torch.finfo(row.dtype).max)
    if (p.presence_penalty or p.frequency_penalty) and out.numel():
        # OpenAI semantics: generated tokens only.
        counts = torch.bincount(out, minlength=row.numel())[: row.numel()].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


# Truncating samplers (top-k, top-p) work on this many most likely tokens: a full sort of a 262k
# vocabulary cost ~9 ms a row here, a top-1024 ~0.3 ms. A row whose top-p mass is not reached within
# them (a very flat distribution) falls back to the full sort, so the result is always exact.
CANDIDATES = 1024


def _sample_random(logits: torch.Tensor, row_max: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
    """Inverse-CDF sampling with one uniform draw per row from the sequence's own generator (a
    262k-wide noise vector per row cost ~4 ms; one number costs nothing)."""
    n, vocab = logits.shape
    temps = torch.tensor([s.params.temperature for s in specs], dtype=logits.dtype)
    # The row maximum comes off before dividing: a tiny temperature then sends every other logit to
    # -inf and the best to 0 (greedy in the limit) instead of overflowing to inf - inf = NaN.
    probs = ((logits - row_max[:, None]) / temps[:, None]).softmax(dim=-1)
    u = torch.cat([torch.rand(1, generator=s.generator, dtype=torch.float64) for s in specs])
    out = torch.empty(n, dtype=torch.long)

    trunc = [i for i, s in enumerate(specs) if 0 < s.params.top_k < vocab or s.params.top_p < 1]
    truncated = set(trunc)
    full = [i for i in range(n) if i not in truncated]
    if full:
        p = probs if len(full) == n else probs[full]
        min_ps = torch.tensor([specs[i].params.min_p for i in full], dtype=p.dtype)
        if bool((min_ps > 0).any()):
            p = p.masked_fill(p < min_ps[:, None] * p.max(dim=-1, keepdim=True).values, 0.0)
        out[full] = _inverse_cdf(p, u[full])
    if trunc:
        k = min(vocab, max(CANDIDATES, max(specs[i].params.top_k for i in trunc)))
        cand_p, cand_idx = probs[trunc].topk(k, dim=-1)  # sorted, most likely first
        for row, i in enumerate(trunc):
            p, idx = cand_p[row], cand_idx[row]
            params = specs[i].params
            if params.top_p < 1 and float(p.sum()) < params.top_p and not 0 < params.top_k <= k:
                p, idx = probs[i].sort(descending=True)  # the flat-distribution fallback
            if 0 < params.top_k < p.numel():
                p, idx = p[: params.top_k], idx[: params.top_k]
            keep = torch.ones_like(p, dtype=torch.bool)
            if params.top_p < 1:
                # Over the top-k renormalized, as transformers and vLLM do (top-k first, then top-p):
                # drop a token when the mass before it already reaches top_p (the first always stays).
                q = p / p.sum()
                keep &= (q.cumsum(0) - q) < params.top_p
            if params.min_p > 0:
                keep &= p >= params.min_p * p[0]
            kept = p * keep
            out[i] = idx[_inverse_cdf(kept[None, :], u[i : i + 1])[0]]
    return out


def _inverse_cdf(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Rows of unnormalized probabilities, one uniform in [0, 1) per row -> sampled column indices."""
    cdf = p.double().cumsum(dim=-1)
    target = (u * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, target, right=True)[:, 0]
    return idx.clamp_(max=p.shape[1] - 1)


def seeded_generator(params: SamplingParams, index: int, rng: random.Random) -> torch.Generator | None:
    """Sample `index`'s random stream: None when greedy; a seeded request's sample i gets its own
    stream, reproducible on its own; an unseeded one a fresh seed from `rng`."""
    if params.greedy:
        return None
    if params.seed is None:
        seed = rng.getrandbits(63)
    else:
        seed = params.seed if index == 0 else hash((params.seed, index))
        seed &= (1 << 64) - 1  # any Python int is a seed; torch takes 64 bits
    g = torch.Generator()
    g.manual_seed(seed)
    return g
