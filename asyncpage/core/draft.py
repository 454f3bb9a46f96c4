"""The draft-model proposer: a second, smaller model with the target's tokenizer guesses each
speculating sequence's next k tokens; the target verifies them in its own step (speculative.py).

The draft keeps its own paged KV pool (its own KVCacheManager and K/V tensors, sized in blocks like
the target's) and, per sequence, how far its cache agrees with the sequence's tokens. A proposal is
one catch-up forward over every asking sequence's tokens the draft has not seen (its whole prompt
the first time, afterwards the tokens the target emitted last step, one or two when drafts were
kept), then k - 1 one-row steps, each sequence's rows batched together. Drafts are the draft's
greedy tokens: a one-hot proposal, which the target's verification turns into exact rejection
sampling (speculative.verify), so the output distribution is the target's whatever the draft says.

Rollback is bookkeeping only: a sequence's cache counts as valid up to the first token where what
the draft was fed differs from what the target kept; slots past it are overwritten when those
positions are fed again, and only blocks the target confirmed enter the draft's prefix cache.

It runs on the compute thread while the engine loop awaits it (core.py), so it never runs beside the
target's step; the loop's objects reach it only as plain lists (DraftAsk).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from asyncpage.core.request import Sequence
from asyncpage.core.runner import ModelRunner
from asyncpage.core.speculation import Speculation
from asyncpage.decoding.speculative import DraftAsk, SpeculativeConfig
from asyncpage.errors import ModelLoadError
from asyncpage.kv.cache import BlockTable, KVCacheManager
from asyncpage.model.batch import FlatBatch
from asyncpage.model.registry import CausalLM
from asyncpage.model.weights import LoadedModel, load
from asyncpage.runtime.compute import ComputeThread
from asyncpage.runtime.reduce import first_max

log = logging.getLogger("asyncpage")


def load_draft(config: SpeculativeConfig, target: LoadedModel, dtype: torch.dtype,
               device: torch.device) -> LoadedModel:
    """The draft model of `speculative_config={"method": "draft", "model": PATH}`, loaded like the
    target (same dtype and device). Its tokenizer must be the target's, a draft token being verified
    as the target's token of the same id: every id both vocabularies have names the same token (one
    may add special tokens at the end; a draft id past the target's logits is never proposed)."""
    assert config.model is not None
    draft = load(config.model, dtype, device, config.quantization)
    a, b = (dict(map(reversed, t.tokenizer.get_vocab().items())) for t in (draft, target))
    if any(a.get(i) != b.get(i) for i in range(min(len(a), len(b)))):
        raise ModelLoadError(f"the draft model {draft.source} has another tokenizer than the target "
                             f"{target.source}: speculative decoding needs the same token ids")
    return draft


class DraftGate:
    """Keeps the draft model on only while it pays, measured: a draft pays only when its step costs
    less than its kept drafts save, and one nearly as big as the target never does (the default
    model as its own draft ran at 0.74-0.84x here). It alternates a window of steps with drafts and
    one without, compares the tokens each decoding sequence got per second of engine loop (drafting,
    the step, and all between), keeps the faster for `hold` steps, then measures again. Only steps
    with a sequence the draft could serve count."""

    def __init__(self, window: int = 16, hold: int = 256) -> None:
        self.window, self.hold = window, hold
        self.drafting = True  # the window being measured (or, while held, the choice)
        self._held = 0  # steps left on the last choice
        self._steps = 0
        self._tokens = 0.0  # per decoding sequence
        self._seconds = 0.0
        self._rate_on = 0.0
        self.num_pauses = 0

    def allow(self) -> bool:
        return self.drafting

    def record(self, loop_s: float, verify_steps: int, accepted: int) -> None:
        """One loop iteration with sequences the draft could serve: its time, and (if it drafted)
        how many sequence-steps verified drafts and how many drafts they kept."""
        if self._held:
            self._held -= 1
            if not self._held:
                self.drafting = True  # measure again, from a window with drafts
            return
        self._steps += 1
        self._tokens += 1 + (accepted / verify_steps if verify_steps else 0)
        self._seconds += loop_s
        if self._steps < self.window:
            return
        rate = self._tokens / self._seconds if self._seconds > 0 else 0.0
        self._steps, self._tokens, self._seconds = 0, 0.0, 0.0
        if self.drafting:
            self._rate_on, self.drafting = rate, False  # now a window without
            return
        self.drafting = self._rate_on > rate
        self.num_pauses += not self.drafting
        self._held = self.hold


async def propose(draft: DraftProposer, gate: DraftGate | None, compute: ComputeThread, spec: Speculation,
                  running: list[Sequence], waiting: Iterable[Sequence]) -> bool | None:
    """The draft model's guesses for the sequences about to decode, on the compute thread (unless the
    gate has it paused). Returns whether a sequence could have used it (the gate counts the step), or
    None when the draft model failed."""
    asks = spec.draft_asks(running)
    if not asks or (gate is not None and not gate.allow()):
        spec.set_drafts(running, {})  # no proposal left over from an earlier step may be used
        return bool(asks)
    live = {s.seq_id for s in (*running, *waiting)}
    try:
        drafts = await compute.arun(draft.propose, asks, live)
    except Exception:
        # The draft model is an optimisation: its failure costs speculation, never a request. Its pool
        # is reset (what it held may be half-written); the loop turns it off after a few in a row.
        log.exception("the draft model failed; this step decodes without speculation")
        draft.release_all()
        spec.set_drafts(running, {})
        return None
    spec.set_drafts(running, drafts)
    return True


@dataclass(eq=False)
class _DraftSeq:
    table: BlockTable = field(default_factory=BlockTable)
    confirmed: int = 0  # the sequence's first tokens, whose K/V the draft's cache holds
    extra: list[int] = field(default_factory=list)  # drafts fed after them (kept or not: checked next time)
    digests: list[bytes] = field(default_factory=list)  # its full blocks' chained digests (prefix lookup)

    @property
    def fed(self) -> int:
        return self.confirmed + len(self.extra)


class DraftProposer:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, vocab_size: int, max_tokens_per_step: int,
                 enable_prefix_caching: bool = True, attention_backend: str = "torch") -> None:
        """`vocab_size`: the target's logits width (a draft token at or past it is never proposed);
        `max_tokens_per_step`: the most tokens one catch-up forward takes (the target's step budget)."""
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.runner = ModelRunner(model, num_blocks, block_size, dtype, device, attention_backend=attention_backend)
        self.vocab_size = vocab_size
        # Its embedding rows: a sequence holding a token past them (the target's vocabulary may be
        # wider) cannot be read by the draft, and does not speculate.
        self.readable = int(model.config.vocab_size)
        self.max_tokens = max_tokens_per_step
        self._seqs: dict[int, _DraftSeq] = {}
        self._unreadable: set[int] = set()  # sequences holding a token past the draft's embedding

    # ---- on the compute thread (the loop awaits it) -----------------------------------------------
    @torch.inference_mode()
    def propose(self, asks: list[DraftAsk], live: set[int]) -> dict[int, list[int]]:
        """Up to `ask.k` drafts for each ask (fewer, or none, when the draft's pool or the step's
        token budget is short). `live`: every sequence the engine still holds; the others' draft
        caches are freed."""
        for sid in [s for s in self._seqs if s not in live]:
            self.kv.free(self._seqs.pop(sid).table)
        flat = self._flat()
        going: list[tuple[DraftAsk, _DraftSeq, int]] = []  # (ask, state, its last row in the batch)
        budget = self.max_tokens
        asked = {a.seq_id for a in asks}
        self._unreadable &= live
        for a in asks:
            if a.seq_id in self._unreadable:
                continue
            st = self._seqs.setdefault(a.seq_id, _DraftSeq())
            start = self._valid(st, a)
            todo = a.tokens[start:]
            if todo and max(todo) >= self.readable:
                self.kv.free(self._seqs.pop(a.seq_id).table)
                self._unreadable.add(a.seq_id)
                continue
            chunk = todo[:budget]
            caught_up = len(chunk) == len(todo)
            drafted = max(a.k - 1, 0) if caught_up else 0  # positions its drafts (but the last) are fed at
            if not chunk or not self._grow(st, start, start + len(chunk) + drafted, asked):
                continue
            row = flat.add(chunk, start, st.table.ids)
            st.confirmed = start + len(chunk)
            budget -= len(chunk)
            if caught_up and a.k:  # its last row's logits give the first draft
                going.append((a, st, row + len(chunk) - 1))
        if not flat.input_ids:
            return {}
        next_tokens = self._greedy(flat, [row for _, _, row in going])  # runs catching-up chunks too
        drafts: dict[int, list[int]] = {a.seq_id: [] for a, _, _ in going}
        while True:
            step = self._flat()
            rows: list[tuple[DraftAsk, _DraftSeq, int]] = []
            for (a, st, _), t in zip(going, next_tokens, strict=True):
                if t >= self.vocab_size:
                    continue  # outside the target's vocabulary: the run of drafts ends here
                drafts[a.seq_id].append(t)
                if len(drafts[a.seq_id]) < a.k:
                    rows.append((a, st, step.add([t], st.fed, st.table.ids)))
                    st.extra.append(t)
            if not rows:  # (also when no sequence had caught up: nothing was drafted)
                return {sid: d for sid, d in drafts.items() if d}
            going = rows
            next_tokens = self._greedy(step, [row for _, _, row in rows])

    def _valid(self, st: _DraftSeq, a: DraftAsk) -> int:
        """How many of the sequence's tokens the draft's cache holds (never the last: its logits are
        needed); registers the confirmed full blocks and gives back blocks past them."""
        # Tokens only append, so the confirmed ones still agree; of the drafts fed after them, those the
        # target kept agree too, up to the first it did not.
        n = min(st.confirmed, len(a.tokens) - 1)
        for t in st.extra:
            if n >= len(a.tokens) - 1 or a.tokens[n] != t:
                break
            n += 1
        if not st.table.blocks:  # new here (or its cache was given up): start from the prefix cache
            cached = self.kv.find_cached_prefix(a.tokens, a.salt, st.digests)
            self.kv.allocate(st.table, 0, len(cached) * self.kv.block_size, cached)
            n = len(cached) * self.kv.block_size
        st.confirmed, st.extra = n, []
        self.kv.cache_full_blocks(st.table, a.tokens, n, a.salt)
        self.kv.trim(st.table, n)
        return n

    def _grow(self, st: _DraftSeq, num_computed: int, num_tokens: int, asked: set[int]) -> bool:
        """Blocks for `num_tokens` positions; when the pool is short, the caches of sequences not
        speculating this step go first (they catch up again, mostly from the prefix cache)."""
        while not self.kv.can_allocate(st.table, num_computed, num_tokens):
            idle = next((s for s in self._seqs if s not in asked), None)
            if idle is None:
                return False
            self.kv.free(self._seqs.pop(idle).table)
        copies = self.kv.allocate(st.table, num_computed, num_tokens)
        self.runner.copy_blocks(self.runner.caches, copies)
        return True

    def _flat(self) -> FlatBatch:
        r = self.runner
        return FlatBatch(r.block_size, r.pad_slot, r.device, r.attention, r.exact_rows)

    def _greedy(self, flat: FlatBatch, rows: list[int]) -> list[int]:
        input_ids, positions, meta = flat.build()
        model = self.runner.model
        hidden = model(input_ids, positions, meta, self.runner.caches)
        if not rows:
            return []
        logits = model.compute_logits(hidden[torch.tensor(rows, dtype=torch.long, device=self.runner.device)])
        return [int(t) for t in first_max(logits.contiguous())[1].tolist()]

    # ---- on the loop, while the compute thread is idle ---------------------------------------------
    def release_all(self) -> None:
        """The engine is idle: every draft cache goes back to the pool (full blocks stay cached)."""
        for st in self._seqs.values():
            self.kv.free(st.table)
        self._seqs.clear()

    # ---- checks ------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        self.kv.check_invariants([(st.table, sid) for sid, st in self._seqs.items()])

    @property
    def num_blocks_used(self) -> int:
        return self.kv.pool.num_used
