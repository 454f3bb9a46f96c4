"""Each architecture, as a tiny random model, gives transformers' logits and greedy tokens.

The batch is the real thing: several sequences of different lengths in one flat batch, one prefill
split into chunks that continue cached context, and decode steps, all through the scheduler,
the block tables and the paged cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from asyncpage import AsyncEngine, SamplingParams
from asyncpage.core.request import Request, Sequence
from asyncpage.core.runner import ModelRunner
from asyncpage.core.scheduler import Scheduler
from asyncpage.kv.cache import KVCacheManager
from asyncpage.model.weights import load
from tests.conftest import ARCHS, TINY_VOCAB


def _teacher_forced_logits(path: Path, sequences: list[list[int]], prompt_lens: list[int],
                           budget: int, block_size: int = 4) -> dict[tuple[int, int], torch.Tensor]:
    """Run `sequences` through scheduler + runner with a small token budget, feeding the known next
    token instead of sampling; return the logits of every (sequence, position) row computed."""
    loaded = load(path, torch.float32, torch.device("cpu"))
    kv = KVCacheManager(64, block_size, enable_prefix_caching=False)
    sched = Scheduler(kv, budget, 8, 512)
    runner = ModelRunner(loaded.model, 64, block_size, torch.float32, torch.device("cpu"))
    seqs = []
    for i, (toks, n) in enumerate(zip(sequences, prompt_lens, strict=True)):
        req = Request(i, toks[:n], SamplingParams(max_tokens=1000, temperature=0), None, frozenset())  # type: ignore[arg-type]
        seq = Sequence(seq_id=sched.new_seq_id(), index=0, request=req, token_ids=list(toks[:n]), generator=None,
                       detokenizer=None, num_prompt_tokens=n)
        req.seqs.append(seq)
        sched.add(seq)
        seqs.append(seq)
    out_rows: dict[tuple[int, int], torch.Tensor] = {}
    steps = 0
    chunked = False
    mixed = False
    while any(len(s.token_ids) < len(full) for s, full in zip(seqs, sequences, strict=True)):
        out = sched.schedule()
        assert out, "scheduler made no progress"
        chunked |= any(s.num_new_tokens > 1 and s.seq.num_computed_tokens > 0 for s in out.scheduled)
        mixed |= len({s.num_new_tokens == 1 for s in out.scheduled}) == 2
        batch = runner.prepare(out)
        logits = runner.forward_logits(batch)
        row = 0
        for s in out.scheduled:
            i = seqs.index(s.seq)
            for pos in range(s.seq.num_computed_tokens, s.seq.num_computed_tokens + s.num_new_tokens):
                out_rows[(i, pos)] = logits[row]
                row += 1
        sampled = {}
        for s in out.scheduled:
            i = seqs.index(s.seq)
            if s.samples and len(s.seq.token_ids) < len(sequences[i]):
                sampled[s.seq.seq_id] = sequences[i][len(s.seq.token_ids)]
        sched.update(out, sampled)
        for s in out.scheduled:  # finished sequences leave the batch, as in the engine
            i = seqs.index(s.seq)
            if len(s.seq.token_ids) == len(sequences[i]) and s.seq in sched.running:
                sched.finish(s.seq, "length")
        steps += 1
    assert chunked and mixed, "the batch never mixed prefill chunks with decodes"
    assert kv.pool.num_used == 0
    return out_rows


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_logits_match_transformers(arch: str, tiny_models: dict[str, tuple[Path, Any]]) -> None:
    path, hf = tiny_models[arch]
    g = torch.Generator().manual_seed(1)
    # Lengths cross block boundaries (block 4) and the sliding windows (8) of mistral and gemma3.
    sequences = [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in (23, 9, 30, 14)]
    prompt_lens = [17, 3, 21, 12]
    rows = _teacher_forced_logits(path, sequences, prompt_lens, budget=12)
    worst = 0.0
    for i, toks in enumerate(sequences):
        with torch.no_grad():
            ref = hf(torch.tensor([toks])).logits[0].float()
        for pos in range(len(toks)):
            if (i, pos) in rows:
                worst = max(worst, (rows[(i, pos)] - ref[pos]).abs().max().item())
    assert worst < 1e-4, f"{arch}: max |logit diff| {worst:.2e}"


@pytest.mark.parametrize("arch", ARCHS)
async def test_greedy_generation_matches_transformers_generate(arch: str,
                                                               tiny_models: dict[str, tuple[Path, Any]]) -> None:
    path, hf = tiny_models[arch]
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in (5, 13, 26)]
    hf.generation_config.eos_token_id = None
    expected = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, pad_token_id=2)
        expected.append(out[0, len(p):].tolist())
    engine = AsyncEngine.from_pretrained(str(path), dtype="float32", block_size=4, num_kv_blocks=64,
                                         max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    async with engine:
        import asyncio

        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        assert engine.stats().kv_blocks_used == 0
    assert [o.token_ids for o in outs] == expected
