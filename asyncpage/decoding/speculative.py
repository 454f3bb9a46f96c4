"""Speculative decoding (n-gram prompt lookup or a draft model): propose, then verify in the same
flat batch.

On a CPU one decode step of a sequence costs about the same for 1 token as for 5 (the weights are
read once either way), and extraction copies long spans of its input into its output. So a
sequence's step can carry, after its last token, up to k guessed tokens (drafts); one forward scores
them all, and as many as the model itself would have produced are kept, plus the model's own next
token after them.

Proposing: with "ngram" (engine loop, scheduler.py) the longest recent suffix of the sequence
(prompt_lookup_max down to prompt_lookup_min tokens, compared by text; a word alone; a field's
label) found earlier in its own tokens proposes what followed it there (ngram.py); with "draft" a
second model's greedy tokens (draft.py, run on the compute thread just before the step is
scheduled). Drafts the grammar refuses are cut before verification; where an n-gram draft is cut (a
record's field copied into a JSON string runs on into a line break), the drafts go on with the token
the model wrote at such cuts before (`",`), the run the grammar then forces and the next lookup's
drafts (core/speculation.py), and verify() keeps a forced run the drafts hold.

Verifying (worker thread, runner.py): position i of the run is sampled exactly as a normal decode
step would sample it (mask from the grammar state after the tokens before it, penalties over the
output before it, the sequence's own generator), and the run goes on while the sampled token equals
the draft. A draft is deterministic (a one-hot proposal q), and for that case rejection sampling
(accept d with probability min(1, p(d)/q(d)) = p(d), else draw from p with d removed) is exactly
"draw from p, keep going while it equals d": the output distribution is the target's, and a seeded
request draws the same random numbers in the same order as without speculation, so its output is
the same.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
import torch

from asyncpage.decoding.guided_step import guided_step
from asyncpage.decoding.ngram import NgramIndex, TokenForms
from asyncpage.decoding.sampling import SampleResult, SampleSpec, masked_max, needs_history, sample
from asyncpage.errors import InvalidRequestError
from asyncpage.guided.backend import bitmask_width
from asyncpage.model.batch import EXACT_ROWS, consecutive
from asyncpage.runtime.reduce import first_max

# Each draft row costs compute (here ~7 ms a row on the default model in float32, LM head included),
# and a big batch is already compute-bound: measured on free text (71% of drafts kept), speculation
# gave 1.43x at 1 stream, 1.29x at 4, 1.51x at 8, 1.23x at 16; on the 32-request mixed bench, 1.07x
# with drafts off above 8 running. Kept at 8: the gain at 16 is smaller and shrinks with acceptance.
DISABLE_BY_BATCH_SIZE = 8


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`from_pretrained(speculative_config={"method": "ngram", "num_speculative_tokens": 4})`, or
    `{"method": "draft", "model": PATH}`: any model with the target's tokenizer, loaded like it."""

    method: str
    # The most drafts per sequence per step (k adapts below it). 7: one stream's verify (its last token
    # and 7 drafts) is 8 rows, what the fused decode step takes (model/batch.py EXACT_ROWS), so each row
    # is computed as a decode step computes it and greedy output stays the same (at 8 drafts, 9 rows
    # took the eager path: other bf16 rounding, other tokens; `asyncpage bench --speculative ngram`).
    num_speculative_tokens: int = 7
    model: str | None = None  # "draft": what from_pretrained's `model` takes (None is not allowed)
    quantization: str | None = None  # "draft": weight-only quantization of the draft (None, "int8", "int4")
    prompt_lookup_max: int = 4  # longest suffix looked up
    prompt_lookup_min: int = 2  # shortest suffix looked up (1 proposes after any repeated token)
    disable_by_batch_size: int = DISABLE_BY_BATCH_SIZE  # no drafts while more sequences than this run
    # "draft": keep the draft model on only while it measurably speeds decoding up (draft.DraftGate)
    auto_disable: bool = True

    @staticmethod
    def parse(value: object) -> SpeculativeConfig | None:
        if value is None:
            return None
        if isinstance(value, SpeculativeConfig):
            value = msgspec.structs.asdict(value)  # built directly: its fields were never checked
        try:
            config = msgspec.convert(value, SpeculativeConfig)
        except msgspec.ValidationError as exc:
            raise InvalidRequestError("speculative_config", str(exc)) from None
        if config.method not in ("ngram", "draft"):
            raise InvalidRequestError("speculative_config", f"method must be 'ngram' or 'draft', got {config.method!r}")
        if (config.model is None) != (config.method == "ngram"):
            raise InvalidRequestError("speculative_config", "'model' (the draft model's path) is required with "
                                      "method 'draft' and meaningless with 'ngram'")
        if config.quantization is not None and config.method != "draft":
            raise InvalidRequestError("speculative_config", "'quantization' applies to a draft model only")
        if config.quantization not in (None, "int8", "int4"):
            raise InvalidRequestError("speculative_config", f"quantization must be None, 'int8' or 'int4', "
                                      f"got {config.quantization!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            if getattr(config, name) < 1:
                raise InvalidRequestError("speculative_config", f"{name} must be >= 1")
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise InvalidRequestError("speculative_config", "prompt_lookup_min must be <= prompt_lookup_max")
        return config


def cli_config(value: str) -> dict[str, Any]:
    """A command line's `--speculative ngram`, `ngram:K` (K drafts at most per step), `draft:PATH`
    or `draft:PATH:K`, checked."""
    method, _, k = value.partition(":")
    config: dict[str, Any] = {"method": method}
    if method == "draft":
        path, sep, last = k.rpartition(":")
        path, k = (path, last) if sep and last.isdigit() else (k, "")
        if not path:
            raise InvalidRequestError("speculative", "draft needs the draft model's path: draft:PATH[:K]")
        config["model"] = path
    if k:
        if not k.isdigit():
            raise InvalidRequestError("speculative", f"K must be a whole number of drafts, got {k!r}")
        config["num_speculative_tokens"] = int(k)
    SpeculativeConfig.parse(config)  # refused now, not after minutes of loading the model
    return config


@dataclass(eq=False)
class SpecState:
    """One sequence's proposer: its n-gram index (ngram.py), extended as tokens arrive, and how many
    drafts to offer next."""

    config: SpeculativeConfig
    forms: TokenForms | None = None  # the tokenizer's view of tokens (None: n-grams compared by id)
    k: int = 0  # drafts to offer next step
    acceptance: float | None = None  # moving average of the share of drafts kept (None: nothing verified yet)
    pending: list[int] = field(default_factory=list)  # "draft": what the draft model proposed for this step
    broken: bool = False  # its proposer raised once: no more drafts for this sequence
    # "ngram": what the model wrote where the grammar refused a draft (a copied value's source text runs on
    # with what the value cannot hold: `",` after a record's field, before its line break)
    endings: Counter[int] = field(default_factory=Counter)
    _refused: tuple[int, list[int]] | None = None  # the last such proposal: where it started, its drafts kept
    _index: NgramIndex | None = None

    def __post_init__(self) -> None:
        self.k = self.config.num_speculative_tokens

    def propose(self, tokens: list[int], limit: int, known: int | None = None) -> list[int]:
        """Up to min(k, limit) drafts to follow `tokens`, or [] when no lookup matches (n-gram), or the
        draft model proposed none this step. `known`: tokens past it are drafts (ngram.NgramIndex.propose)."""
        c = self.config
        if c.method == "draft":
            drafts, self.pending = self.pending[: min(self.k, limit)], []
            return drafts
        if self._index is None:
            self._index = NgramIndex(c.prompt_lookup_min, c.prompt_lookup_max, self.forms)
        return self._index.propose(tokens, min(self.k, limit), known)

    @property
    def by_label(self) -> bool:
        """The last n-gram proposal came from a field's label (a value's start: ngram.NgramIndex)."""
        return self._index is not None and self._index.by_label

    def refused(self, start: int, kept: list[int]) -> bool:
        """The grammar refused a draft proposed at position `start` after `kept`: what the model writes
        there is learned (ending()), unless a label's draft was refused before any of it was kept (where a
        value starts, not where a copy runs past a value's end). Returns whether it is learned."""
        if self._index is None or (self._index.by_label and not kept):
            return False
        self._refused = (start, list(kept))
        return True

    def ending(self, tokens: list[int]) -> int | None:
        """The token the model most often wrote where the grammar refused a draft, learning first from
        `tokens` (the sequence now) what it wrote after the last refusal, if its drafts before were kept."""
        if self._refused is not None:
            start, kept = self._refused
            at = start + len(kept)
            if len(tokens) > at:
                if tokens[start:at] == kept:
                    self.endings[tokens[at]] += 1
                self._refused = None
        if not self.endings:
            return None
        return self.endings.most_common(1)[0][0]

    def observe(self, proposed: int, accepted: int) -> None:
        """Adapt k to the measured acceptance: the expected run of kept drafts is a / (1 - a)."""
        if not proposed:
            return
        share = accepted / proposed
        # The first verify sets it: from a prior of 1/2, six drafts of six kept left k at 3 for the next.
        self.acceptance = share if self.acceptance is None else 0.7 * self.acceptance + 0.3 * share
        a = min(self.acceptance, 0.95)
        self.k = max(1, min(self.config.num_speculative_tokens, round(a / (1 - a)) + 1))


@dataclass
class DraftAsk:
    """One sequence that may speculate this step, as the loop hands it over (copies, not its objects)."""

    seq_id: int
    tokens: list[int]  # its tokens so far: drafts follow the last
    k: int  # the most drafts wanted (0: only read its tokens, e.g. a prompt the target is still prefilling)
    salt: str | None = None  # its prefix-cache salt: the draft's cache is partitioned the same way


@dataclass
class Verify:
    """One speculating sequence of a step, as the worker thread sees it."""

    spec: SampleSpec  # how its tokens are sampled (its grammar matcher, generator, penalties)
    draft: list[int]
    rows: list[int]  # its 1 + len(draft) rows in the step's logits
    stop_ids: frozenset[int]  # a sampled stop token ends the run


@dataclass
class Verified:
    tokens: list[int]  # what the sequence emits: the kept drafts, then the model's own next token
    accepted: int  # drafts kept
    failed: str | None = None
    grammar_done: bool = False
    forced: list[int] = field(default_factory=list)  # tokens the grammar forces after them


def draft_masks(v: Verify, mask_vocab: int) -> torch.Tensor | None:
    """The grammar's mask for each row of a speculating sequence: row i's is the state after the
    first i drafts (the only state in which row i matters), by walking the drafts and rolling back.
    Computed after the forward, not beside it: on 2 cores the mask thread slowed the forward's own
    threads more than it saved (measured: 105 vs 91 ms a step)."""
    m = v.spec.matcher
    if m is None:
        return None
    masks = torch.full((len(v.rows), bitmask_width(mask_vocab)), -1, dtype=torch.int32)
    m.fill_bitmask(masks, 0)
    taken = 0
    for i, d in enumerate(v.draft):
        if m.is_terminated() or not m.accept(d):
            break  # drafts are checked when proposed; past an end, later rows are never reached
        taken += 1
        if not m.is_terminated():
            m.fill_bitmask(masks, i + 1)
    m.rollback(taken)
    return masks


def _greedy(row: torch.Tensor, mask: torch.Tensor | None, top: tuple[float, int]) -> int | None:
    """Row's greedy token under its grammar mask (None: no finite one; sample() then says why). `top`:
    the row's maximum and its first index (found for every row of the verify at once); the mask is
    applied only where neither that token nor a few allowed ones decide it (masked_max)."""
    value, token = masked_max(row, mask, top)
    return token if math.isfinite(value) else None


def verify(v: Verify, logits: torch.Tensor, masks: torch.Tensor | None) -> Verified:
    """Sample each position of a speculating sequence in order, as plain decode steps would, while
    the sampled token equals the draft. `logits` holds the step's rows (v.rows index it), `masks`
    the grammar's mask of each of them (draft_masks)."""
    s = v.spec
    m = s.matcher
    greedy = s.params.greedy and not needs_history(s.params)  # no draws: a row's token is its own
    tops: list[tuple[float, int]] = []
    if greedy:  # every row's maximum in one call (one search of 262k logits a row, threaded)
        r = v.rows
        span = consecutive(r)
        block = logits[span[0] : span[1]] if span else logits[r]  # a view, no copy
        values, ids = first_max(block.contiguous())
        tops = list(zip(values.tolist(), ids.tolist(), strict=True))
    tokens: list[int] = []
    i = 0
    while i < len(v.rows):
        mask = masks[i : i + 1] if masks is not None else None
        spec = replace(s, output_ids=s.output_ids + tokens if s.output_ids is not None else None,
                       budget=s.budget - i if s.budget is not None else None)
        if greedy and (g := _greedy(logits[v.rows[i]], masks[i] if masks is not None else None, tops[i])) is not None:
            result = SampleResult([g], [None])
        else:  # sampled (a seeded draw per emitted token, in order), penalized, or an invalid row
            result = sample(logits[v.rows[i] : v.rows[i] + 1], [spec], mask)
        if result.invalid:
            return Verified(tokens, 0, "the model produced no valid next token (NaN/inf logits, or nothing "
                            "the grammar allows has a finite logit)")
        ff: list[int] = []
        done = False
        if m is not None:
            assert mask is not None
            stepped = guided_step(m, spec, result, 0, logits[v.rows[i] : v.rows[i] + 1], mask)
            if stepped is None:
                return Verified(tokens, 0, f"the grammar rejected sampled token {result.tokens[0]}")
            ff, done = stepped
        token = result.tokens[0]
        tokens.append(token)
        matched = i < len(v.draft) and token == v.draft[i]  # its KV was computed in this step too
        if matched and 1 + len(ff) > EXACT_ROWS:
            # Without drafts this token and the run its grammar forces are computed next step as one
            # chunk; kept here, it would be a decode row and the run a chunk one token shorter, each
            # rounded otherwise (greedy JSON changed): it is computed again with its run instead.
            matched = False
        if matched and ff and not done and token not in v.stop_ids and (
                held := v.draft[i + 1 : i + 1 + len(ff)]) == ff[: len(held)] and held:
            # The drafts go on with the run the grammar forces after this token (a copied value's end,
            # core/speculation.py): their rows were computed in this step, so they are kept; the row
            # after them is verified next, or, where the drafts end inside the run, the rest of it follows.
            tokens += ff
            i += 1 + len(held)
            if len(held) < len(ff):
                return Verified(tokens, i, grammar_done=done)
            continue
        # Forced tokens were consumed by the grammar already: they end the run, and follow it.
        if done or ff or token in v.stop_ids or not matched:
            return Verified(tokens, len(tokens) if matched else len(tokens) - 1, grammar_done=done, forced=ff)
        i += 1
    raise AssertionError("unreachable: the last row always ends the run")
