"""ModelRunner: owns the model and the K/V tensors; turns a SchedulerOutput into one forward pass
and one sampling pass.

`prepare()` runs on the event loop: it copies everything the step needs out of the scheduler's
objects into tensors and plain lists, so `execute()` can run in a worker thread without ever
reading state the loop may change meanwhile (an abort, a new request).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from asyncpage.core.request import Sequence
from asyncpage.core.scheduler import SchedulerOutput
from asyncpage.decoding.sampling import SampleResult, SampleSpec, beam_candidates, needs_history, sample
from asyncpage.decoding.speculative import Verify, draft_masks, verify
from asyncpage.guided import Matcher
from asyncpage.guided.backend import apply_bitmask, bitmask_width
from asyncpage.guided.budget import ALTERNATIVES, Closer, Guards, MatcherError, guards_for, matcher_error
from asyncpage.model.attention import KV_QMAX, AttentionMetadata, PrefillChunk, paged_attention
from asyncpage.model.registry import CausalLM
from asyncpage.outputs import TokenLogprob

log = logging.getLogger("asyncpage")


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # [U] rows of the flat batch whose logits are needed
    spec_rows: torch.Tensor  # [N] index into logit_rows, one per sample (forks repeat a row)
    specs: list[SampleSpec]
    block_copies: list[tuple[int, int]]
    forked: bool  # logit rows are not one per sample (an n > 1 request forking, or drafts being verified)
    verifies: list[Verify] = field(default_factory=list)  # speculating sequences, verified after `specs`
    scored: list[PromptRows] = field(default_factory=list)  # prompt tokens whose log-probabilities are asked


@dataclass
class PromptRows:
    """Rows of one sequence's prompt chunk whose next prompt token is scored (params.prompt_logprobs)."""

    seq_id: int
    first: int  # index in Request.prompt_logprobs of the first row's entry
    rows: list[int]  # rows of the flat batch
    targets: list[int]  # the prompt token each row predicts
    top: int


@dataclass
class StepResult:
    seq_ids: list[int]
    sampled: SampleResult
    grammar_done: frozenset[int] = frozenset()  # sequences whose grammar is complete
    forced: dict[int, list[int]] | None = None  # tokens the grammar forces after the sampled one
    # Sequences whose sampled token must not be emitted (no valid token, or the grammar rejected it).
    failed: dict[int, str] | None = None
    beams: dict[int, tuple[list[int], list[float]]] | None = None  # beam search: each beam's best continuations
    accepted: dict[int, int] | None = None  # speculating sequences: how many of their drafts were kept
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprob]]] | None = None  # seq -> (first, entries)


def kv_bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block over all layers, K and V (and, for a one-byte pool, its float32 scales)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    scale = 4 if dtype in KV_QMAX else 0
    per_token = sum(2 * layer.self_attn.num_kv_heads * (layer.self_attn.head_dim * elem + scale)
                    for layer in model.model.layers)
    return int(per_token * block_size)


class FlatBatch:
    """A step's tokens from many sequences back to back (no padding between them), with the slots
    their K/V go to and what attention needs: a sequence's run of one token is a decode row, a
    longer run a prefill chunk over its cached context. Shared by the model runner and the draft
    model (draft.py)."""

    def __init__(self, block_size: int, pad_slot: int, device: torch.device,
                 attention: Callable[..., torch.Tensor]) -> None:
        self.block_size, self.pad_slot, self.device, self.attention = block_size, pad_slot, device, attention
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.slots: list[int] = []
        self.decode_rows: list[int] = []
        self.decode_tables: list[list[int]] = []
        self.decode_lens: list[int] = []
        self.prefills: list[PrefillChunk] = []

    def add(self, tokens: list[int], num_computed: int, table: list[int]) -> int:
        """Append a sequence's `tokens`, at positions from `num_computed` on; returns its first row."""
        bs, start, n = self.block_size, len(self.input_ids), len(tokens)
        self.input_ids += tokens
        self.positions += range(num_computed, num_computed + n)
        self.slots += [table[p // bs] * bs + p % bs for p in range(num_computed, num_computed + n)]
        if n == 1:
            self.decode_rows.append(start)
            self.decode_tables.append(table)
            self.decode_lens.append(num_computed + 1)
        else:
            self.prefills.append(PrefillChunk(start, start + n, num_computed, self._t(table)))
        return start

    def build(self) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input ids, positions, attention metadata). The batch is padded to a few bucket sizes: the
        CPU matmul libraries build a kernel per new shape (~0.5 ms per matmul), which cost a cold
        engine 30% of its throughput when every step had a new token count. Padding rows attend to
        nothing and write their K/V to the pad slot."""
        pad = _bucket(len(self.input_ids)) - len(self.input_ids)
        meta = AttentionMetadata(block_size=self.block_size, slot_mapping=self._t(self.slots + [self.pad_slot] * pad),
                                 prefills=self.prefills, attention=self.attention)
        if self.decode_rows:
            width = max(len(t) for t in self.decode_tables)
            meta.decode_rows = self._t(self.decode_rows)
            meta.decode_block_tables = self._t([t + [0] * (width - len(t)) for t in self.decode_tables])
            meta.decode_context_lens = self._t(self.decode_lens)
            meta.decode_tables_host, meta.decode_lens_host = self.decode_tables, self.decode_lens
        return self._t(self.input_ids + [0] * pad), self._t(self.positions + [0] * pad), meta

    def _t(self, xs: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.long, device=self.device)


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, mask_vocab_size: int | None = None,
                 kv_cache_dtype: torch.dtype | None = None) -> None:
        """`kv_cache_dtype` (default `dtype`): torch.int8 or torch.float8_e4m3fn make a quantized pool."""
        self.model = model
        self.block_size = block_size
        self.device = device
        self.vocab_size = int(model.config.vocab_size)
        # The grammar engines' vocabulary (may exceed the logits width); masks are sliced at use.
        self.mask_vocab_size = mask_vocab_size or self.vocab_size
        # The pool belongs to the runner, not to the model: two engines may share one set of weights.
        self.caches: list[tuple[torch.Tensor, ...]] = []
        # One block more than the pool hands out: padding tokens write their K/V there.
        self.pad_slot = num_blocks * block_size
        for layer in model.model.layers:
            attn = layer.self_attn
            shape = (num_blocks + 1, block_size, attn.num_kv_heads, attn.head_dim)
            # Written now, not zero-mapped lazily: on the CPU, first-touch page faults inside the decode
            # gathers made a cold engine ~40% slower than a warm one. Zeros, not garbage: padded decode
            # slots are read before the mask drops them, and NaN times a zero weight is still NaN.
            kv_dt = kv_cache_dtype or dtype
            layer_cache: tuple[torch.Tensor, ...] = (torch.empty(shape, dtype=kv_dt, device=device),
                                                     torch.empty(shape, dtype=kv_dt, device=device))
            if kv_dt in KV_QMAX:  # + a float32 scale per token and KV head for K and for V
                layer_cache += (torch.empty(shape[:3], dtype=torch.float32, device=device),
                                torch.empty(shape[:3], dtype=torch.float32, device=device))
            for t in layer_cache:
                t.view(torch.uint8).zero_()  # as bytes: float8 has no CPU fill kernel
            self.caches.append(layer_cache)
        self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="asyncpage-masks")
        # The attention backend (asyncpage.kernels.use_triton_attention swaps in the Triton kernels).
        self.attention: Callable[..., torch.Tensor] = paged_attention
        self.copy_blocks: Callable[[list[tuple[torch.Tensor, ...]], list[tuple[int, int]]], None] = \
            _copy_blocks

    # ---- on the event loop -----------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> StepBatch:
        flat = FlatBatch(self.block_size, self.pad_slot, self.device, self.attention)
        logit_rows: list[int] = []
        spec_rows: list[int] = []
        specs: list[SampleSpec] = []
        verifies: list[Verify] = []
        scored: list[PromptRows] = []
        for sched in out.scheduled:
            seq, n = sched.seq, sched.num_new_tokens
            nc = seq.num_computed_tokens
            start = flat.add(seq.token_ids[nc : nc + n - len(sched.draft)] + sched.draft, nc, seq.table.ids)
            req = seq.request
            if req.scoring_prompt:
                first = len(req.prompt_logprobs)
                span = range(max(nc, first), min(nc + n, len(req.prompt_token_ids) - 1))
                if span:
                    scored.append(PromptRows(seq.seq_id, span[0], [start + p - nc for p in span],
                                             [seq.token_ids[p + 1] for p in span],
                                             req.params.prompt_logprobs or 0))
            if sched.draft:
                # Speculating: its last real token and every draft get a logit row; verified in order.
                k = len(sched.draft)
                rows = list(range(len(logit_rows), len(logit_rows) + k + 1))
                logit_rows += range(start + n - k - 1, start + n)
                s = sched.samples[0]
                verifies.append(Verify(_sample_spec(s, out.max_model_len), sched.draft, rows,
                                       s.request.stop_ids))
            elif sched.samples:
                logit_rows.append(start + n - 1)
                for s in sched.samples:
                    spec_rows.append(len(logit_rows) - 1)
                    specs.append(_sample_spec(s, out.max_model_len))
        input_ids, positions, meta = flat.build()
        # Logit rows are not padded: the LM head is one matmul, a few new shapes cost little. Samples
        # take rows 0..n-1 in order unless a fork shares a row or verified drafts sit between them
        # (counting rows is not enough: a 2-row verify beside a 3-way fork balances the count).
        forked = spec_rows != list(range(len(specs)))
        return StepBatch(input_ids, positions, meta, self._t(logit_rows), self._t(spec_rows), specs,
                         list(out.block_copies), forked=forked, verifies=verifies, scored=scored)

    def _t(self, xs: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.long, device=self.device)

    # ---- in the worker thread --------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> StepResult:
        self.copy_blocks(self.caches, batch.block_copies)
        guided = [(i, s.matcher) for i, s in enumerate(batch.specs) if s.matcher is not None]
        bitmask = masks = None
        if guided:
            # Masks are filled on the CPU while the forward pass runs (the grammar engines release the GIL).
            bitmask = torch.full((len(batch.specs), bitmask_width(self.mask_vocab_size)), -1, dtype=torch.int32)
            masks = self._mask_pool.submit(_fill_masks, guided, bitmask)
        hidden = self.model(batch.input_ids, batch.positions, batch.meta, self.caches)
        every = self.model.compute_logits(hidden[batch.logit_rows]).cpu()
        prompt_logprobs = {r.seq_id: (r.first, _prompt_logprobs(self.model, hidden, r)) for r in batch.scored}
        if batch.forked:
            logits = every[batch.spec_rows]  # forked samples share their parent's row; drafts have several
        else:
            logits = every[: len(batch.specs)]  # one row per sample: drop the padding rows
        broken = masks.result() if masks is not None else {}
        result = sample(logits, batch.specs, bitmask)
        failed = {batch.specs[i].seq_id: "the model produced no valid next token (NaN/inf logits, or nothing "
                  "the grammar allows has a finite logit)" for i in result.invalid}
        failed.update((batch.specs[i].seq_id, why) for i, why in broken.items())
        beams = beam_candidates(logits, batch.specs, bitmask)
        done = set()
        forced: dict[int, list[int]] = {}
        for i, m in guided:
            spec = batch.specs[i]
            if spec.seq_id in failed or spec.beam_k:
                continue  # a beam's matcher advances once the search has chosen its token (scheduler)
            assert bitmask is not None
            try:
                stepped = _guided_step(m, spec, result, i, logits, bitmask)
            except Exception as exc:  # this sequence's grammar work: its request fails, the engine goes on
                failed[spec.seq_id] = _grammar_failure(exc)
                continue
            if stepped is None:
                failed[spec.seq_id] = str(matcher_error(m, f"sampled token {result.tokens[i]}"))
                continue
            ff, stopped = stepped
            if ff:
                forced[spec.seq_id] = ff
            if stopped:
                done.add(spec.seq_id)
        seq_ids = [s.seq_id for s in batch.specs]
        accepted: dict[int, int] = {}
        for v in batch.verifies:
            sid = v.spec.seq_id
            try:
                out = verify(v, every, draft_masks(v, self.mask_vocab_size), _guided_step)
            except Exception as exc:  # as in the loop above: this sequence fails alone
                seq_ids.append(sid)
                result.tokens.append(-1)
                result.logprobs.append(None)
                failed[sid] = _grammar_failure(exc)
                continue
            seq_ids.append(sid)
            result.tokens.append(out.tokens[0] if out.tokens else -1)
            result.logprobs.append(None)
            accepted[sid] = out.accepted
            if out.failed:
                failed[sid] = out.failed
                continue
            if out.tokens[1:] or out.forced:
                forced[sid] = out.tokens[1:] + out.forced
            if out.grammar_done:
                done.add(sid)
        return StepResult(seq_ids, result, frozenset(done), forced, failed, beams, accepted, prompt_logprobs)

    @torch.inference_mode()
    def forward_logits(self, batch: StepBatch) -> torch.Tensor:
        """Logits of every row of the batch (tests compare them with transformers)."""
        hidden = self.model(batch.input_ids, batch.positions, batch.meta, self.caches)
        return self.model.compute_logits(hidden)


SCORE_ROWS = 64  # prompt rows through the LM head at once: 64 x 262k float32 logits is 67 MB


def _prompt_logprobs(model: CausalLM, hidden: torch.Tensor, r: PromptRows) -> list[TokenLogprob]:
    """Each row's log-probability of the prompt token after it (and the top-N there), from the raw
    model output as sampled logprobs are."""
    out: list[TokenLogprob] = []
    for i in range(0, len(r.rows), SCORE_ROWS):
        rows, targets = r.rows[i : i + SCORE_ROWS], torch.tensor(r.targets[i : i + SCORE_ROWS])
        lp = torch.log_softmax(model.compute_logits(hidden[rows]).float().cpu(), dim=-1)
        own = lp.gather(1, targets[:, None])[:, 0].tolist()
        if r.top:
            vals, ids = lp.topk(r.top, dim=-1)
            tops = [dict(zip(t, v, strict=True)) for t, v in zip(ids.tolist(), vals.tolist(), strict=True)]
        else:
            tops = [{} for _ in rows]
        out += [TokenLogprob(t, v, top) for t, v, top in zip(targets.tolist(), own, tops, strict=True)]
    return out


def _sample_spec(s: Sequence, max_model_len: int) -> SampleSpec:
    p = s.params
    beam = s.request.beam
    budget = None
    if s.matcher is not None and p.budget_close and beam is None:
        budget = min(p.max_tokens - s.num_output_tokens, max_model_len - s.num_tokens)
    return SampleSpec(
        seq_id=s.seq_id, params=p, generator=s.generator,
        prompt_ids=list(s.token_ids[: s.num_prompt_tokens]) if p.repetition_penalty != 1 else None,
        output_ids=list(s.output_token_ids) if needs_history(p) else None, matcher=s.matcher, budget=budget,
        beam_k=beam.num_candidates if beam is not None else 0)


def _guided_step(m: Matcher, spec: SampleSpec, result: SampleResult, i: int, logits: torch.Tensor,
                 bitmask: torch.Tensor) -> tuple[list[int], bool] | None:
    """Take row i's sampled token through the sequence's grammar (budget closing may replace it in
    `result`). Returns (tokens the grammar forces next, grammar ended); None if it refuses the token."""
    closer = _closer(m, spec) if spec.budget is not None else None
    if closer is not None:
        return _budget_step(closer, i, spec, result, logits, bitmask)
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


def _closer(m: Matcher, spec: SampleSpec) -> Closer | None:
    make = getattr(m, "closer", None)  # matchers that support budget closing
    if make is None:
        return None
    p = spec.params

    def guards() -> Guards | None:  # asked once per sequence
        return guards_for(p.json_schema, p.max_number_digits, p.max_string_repeats) if p.json_schema is not None \
            else None

    closer: Closer | None = make(guards)
    return closer


def _budget_step(closer: Closer, i: int, spec: SampleSpec, result: SampleResult, logits: torch.Tensor,
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


def _fill_masks(guided: list[tuple[int, Matcher]], bitmask: torch.Tensor) -> dict[int, str]:
    """Fill each guided row's mask; returns the rows whose matcher raised, and why (their requests
    fail alone; the row keeps an all-allowed mask, and its sample is never used)."""
    broken: dict[int, str] = {}
    for row, matcher in guided:
        try:
            matcher.fill_bitmask(bitmask, row)
        except Exception as exc:
            broken[row] = _grammar_failure(exc)
    return broken


def _grammar_failure(exc: Exception) -> str:
    """The failure of one sequence whose grammar work raised: logged with its traceback (a backend
    bug shows there), reported to its caller as a SamplingError."""
    log.warning("guided decoding failed for one sequence: %r", exc, exc_info=not isinstance(exc, MatcherError))
    return f"guided decoding failed: {exc}"


def _bucket(n: int) -> int:
    """1..8 exactly (one stream must not pay for padding), then 16, 24, ..., 64, then multiples of 64."""
    if n <= 8:
        return n
    if n <= 64:
        return -(-n // 8) * 8
    return -(-n // 64) * 64


def _copy_blocks(caches: list[tuple[torch.Tensor, ...]], pairs: list[tuple[int, int]]) -> None:
    for src, dst in pairs:
        for layer in caches:
            for t in layer:  # K, V (and their scales in a quantized pool)
                t[dst].copy_(t[src])
