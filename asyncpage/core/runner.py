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
from asyncpage.decoding.guided_step import fill_masks, grammar_failure, guided_step
from asyncpage.decoding.sampling import (
    SampleResult,
    SampleSpec,
    beam_candidates,
    has_valid_token,
    needs_history,
    sample,
)
from asyncpage.decoding.speculative import Verify, draft_masks, verify
from asyncpage.guided.backend import bitmask_width
from asyncpage.guided.budget import matcher_error
from asyncpage.model.attention import KV_QMAX, AttentionMetadata, paged_attention
from asyncpage.model.batch import EXACT_ROWS, FlatBatch, consecutive, long_tensor
from asyncpage.model.gguf_linear import unpadded_rows
from asyncpage.model.registry import CausalLM
from asyncpage.outputs import TokenLogprob

log = logging.getLogger("asyncpage")
_CPU = torch.device("cpu")


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # [U] rows of the flat batch whose logits are needed
    logit_span: tuple[int, int] | None  # logit_rows as (first, end) when they are consecutive: a view, no gather
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


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, mask_vocab_size: int | None = None,
                 kv_cache_dtype: torch.dtype | None = None, attention_backend: str = "torch") -> None:
        """`kv_cache_dtype` (default `dtype`): torch.int8 or torch.float8_e4m3fn make a quantized pool.
        `attention_backend`: "torch" (model/attention.py) or "triton" (model/attention_triton.py), resolved
        by core/config.py."""
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
        # Steps of up to this many tokens are not padded to a bucket (FlatBatch.build).
        self.exact_rows = unpadded_rows(model.model)
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
        self.attention: Callable[..., torch.Tensor] = paged_attention
        self.copy_blocks: Callable[[list[tuple[torch.Tensor, ...]], list[tuple[int, int]]], None] = \
            _copy_blocks
        if attention_backend == "triton":  # imported only here: Triton is needed only for this backend
            from asyncpage.model import attention_triton

            self.attention, self.copy_blocks = attention_triton.paged_attention, attention_triton.copy_blocks

    # ---- on the event loop -----------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> StepBatch:
        flat = FlatBatch(self.block_size, self.pad_slot, self.device, self.attention, self.exact_rows)
        logit_rows: list[int] = []
        spec_rows: list[int] = []
        specs: list[SampleSpec] = []
        verifies: list[Verify] = []
        scored: list[PromptRows] = []
        # A step within the rows a decode step takes unpadded (the fused and compiled decode steps): each
        # token a decode row of its own (FlatBatch.add), drafts, a run a grammar forced and a short prompt
        # alike, so that a row's arithmetic does not depend on what shares its step (a forced run of 4
        # computed as one chunk, and the same 4 with 4 drafts as rows, rounded differently and changed
        # greedy output). Larger steps keep a run as one chunk (one gather of its context, not one per row).
        as_rows = sum(s.num_new_tokens for s in out.scheduled) <= EXACT_ROWS
        for sched in out.scheduled:
            seq, n = sched.seq, sched.num_new_tokens
            nc = seq.num_computed_tokens
            start = flat.add(seq.token_ids[nc : nc + n - len(sched.draft)] + sched.draft, nc, seq.table.ids,
                             rows=as_rows)
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
        # spec_rows index the logits after they are moved to the CPU (execute): a CPU tensor on every device.
        return StepBatch(input_ids, positions, meta, self._t(logit_rows), consecutive(logit_rows),
                         long_tensor(spec_rows, _CPU),
                         specs, list(out.block_copies), forked=forked, verifies=verifies, scored=scored)

    def _t(self, xs: list[int] | list[list[int]]) -> torch.Tensor:
        return long_tensor(xs, self.device)

    # ---- in the worker thread --------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> StepResult:
        self.copy_blocks(self.caches, batch.block_copies)
        guided = [(i, s.matcher) for i, s in enumerate(batch.specs) if s.matcher is not None]
        bitmask = masks = None
        if guided:
            # Masks are filled on the CPU while the forward pass runs (the grammar engines release the GIL).
            bitmask = torch.full((len(batch.specs), bitmask_width(self.mask_vocab_size)), -1, dtype=torch.int32)
            masks = self._mask_pool.submit(fill_masks, guided, bitmask)
        hidden = self.model(batch.input_ids, batch.positions, batch.meta, self.caches)
        rows = hidden[batch.logit_span[0] : batch.logit_span[1]] if batch.logit_span else hidden[batch.logit_rows]
        # found: each row's greedy search, done by the head's kernel as it wrote the logits (a verify searches its
        # own rows: not asked for then)
        model = self.model
        every, found = (model.compute_logits(rows), None) if batch.verifies else model.compute_logits_max(rows)
        if not every.is_cpu:
            every = every.cpu()
        prompt_logprobs = {r.seq_id: (r.first, _prompt_logprobs(self.model, hidden, r)) for r in batch.scored}
        logits = every  # one row per sample, and no others: as they are
        if batch.forked or every.shape[0] != len(batch.specs):
            # forked samples share their parent's row, drafts have several; else one row per sample, then others
            pick: torch.Tensor | slice = batch.spec_rows if batch.forked else slice(0, len(batch.specs))
            logits = every[pick]
            found = None if found is None else (found[0][pick], found[1][pick])
        broken = masks.result() if masks is not None else {}
        result = sample(logits, batch.specs, bitmask, found)
        failed = {batch.specs[i].seq_id: NO_VALID_TOKEN for i in result.invalid}
        failed.update((batch.specs[i].seq_id, why) for i, why in broken.items())
        beams = beam_candidates(logits, batch.specs, bitmask)
        for i, s in enumerate(batch.specs):  # a beam is not sampled: without a candidate, is there a valid token?
            if s.beam_k and s.seq_id not in failed and not beams.get(s.seq_id, ([], []))[0] and not has_valid_token(
                    logits[i], bitmask[i] if bitmask is not None and s.matcher is not None else None):
                failed[s.seq_id] = NO_VALID_TOKEN
        done = set()
        forced: dict[int, list[int]] = {}
        for i, m in guided:
            spec = batch.specs[i]
            if spec.seq_id in failed or spec.beam_k:
                continue  # a beam's matcher advances once the search has chosen its token (scheduler)
            assert bitmask is not None
            try:
                stepped = guided_step(m, spec, result, i, logits, bitmask)
            except Exception as exc:  # this sequence's grammar work: its request fails, the engine goes on
                failed[spec.seq_id] = grammar_failure(exc)
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
                out = verify(v, every, draft_masks(v, self.mask_vocab_size))
            except Exception as exc:  # as in the loop above: this sequence fails alone
                seq_ids.append(sid)
                result.tokens.append(-1)
                result.logprobs.append(None)
                failed[sid] = grammar_failure(exc)
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


NO_VALID_TOKEN = ("the model produced no valid next token (NaN/inf logits, or nothing the grammar allows has a "
                  "finite logit)")
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


def _copy_blocks(caches: list[tuple[torch.Tensor, ...]], pairs: list[tuple[int, int]]) -> None:
    for src, dst in pairs:
        for layer in caches:
            for t in layer:  # K, V (and their scales in a quantized pool)
                t[dst].copy_(t[src])
