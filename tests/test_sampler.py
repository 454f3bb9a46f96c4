"""Sampling: greedy, seeded reproducibility, the top-k / top-p / min-p cuts, penalties, logprobs."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from asyncpage import AsyncEngine, InvalidRequestError, SamplingParams
from asyncpage.sampling import SampleSpec, sample

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def _draw(params: SamplingParams, n: int = 2000, seed: int = 0, logits: torch.Tensor = LOGITS) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    rows = logits.repeat(n, 1)
    return sample(rows, [SampleSpec(i, params, g) for i in range(n)]).tokens


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, 100)
    out = sample(logits, [SampleSpec(i, SamplingParams(temperature=0), None) for i in range(5)])
    assert out.tokens == logits.argmax(-1).tolist()


def test_samples_follow_the_distribution() -> None:
    draws = _draw(SamplingParams(temperature=1.0), n=4000)
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
    assert torch.allclose(freq, PROBS, atol=0.03), freq


@pytest.mark.parametrize(("params", "allowed"), [
    (SamplingParams(top_k=1), {0}),
    (SamplingParams(top_k=2), {0, 1}),
    (SamplingParams(top_p=0.7), {0, 1}),  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the third is cut
    (SamplingParams(top_p=0.5), {0}),
    (SamplingParams(min_p=0.5), {0, 1}),  # p >= 0.25
    (SamplingParams(min_p=0.2, top_k=3), {0, 1, 2}),  # 0.15 >= 0.1 survives min_p; top_k cuts 0.05
])
def test_cuts_only_ever_draw_allowed_tokens(params: SamplingParams, allowed: set[int]) -> None:
    assert set(_draw(params, n=600)) == allowed


def test_low_temperature_sharpens() -> None:
    cold = _draw(SamplingParams(temperature=0.2), n=1000)
    assert cold.count(0) > 900


def test_repetition_and_frequency_penalties_push_seen_tokens_down() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    spec = SampleSpec(0, SamplingParams(temperature=0, repetition_penalty=1.2), None, prompt_ids=[0], output_ids=[])
    assert sample(logits, [spec]).tokens == [1]
    spec = SampleSpec(0, SamplingParams(temperature=0, frequency_penalty=0.2), None, prompt_ids=None,
                      output_ids=[0])
    assert sample(logits, [spec]).tokens == [1]
    spec = SampleSpec(0, SamplingParams(temperature=0, presence_penalty=-1.0), None, output_ids=[2])
    assert sample(logits, [spec]).tokens == [0]  # negative presence penalty: 0 + 1 < 2


def test_logprobs_are_those_of_the_raw_distribution() -> None:
    logits = torch.randn(1, 50)
    out = sample(logits, [SampleSpec(0, SamplingParams(temperature=0, logprobs=3), None)])
    lp = out.logprobs[0]
    assert lp is not None
    ref = torch.log_softmax(logits[0], -1)
    assert math.isclose(lp.logprob, ref.max().item(), abs_tol=1e-5)
    assert list(lp.top) == ref.topk(3).indices.tolist()


@pytest.mark.parametrize(("field", "kwargs"), [
    ("max_tokens", {"max_tokens": 0}),
    ("temperature", {"temperature": -0.1}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.5}),
    ("top_k", {"top_k": -5}),
    ("min_p", {"min_p": 2.0}),
    ("n", {"n": 0}),
    ("logprobs", {"logprobs": 99}),
    ("regex", {"json_schema": {}, "regex": "a+"}),
])
def test_bad_sampling_params_name_the_field(field: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert e.value.field == field and field in str(e.value)


async def test_seeded_sampling_is_reproducible_whatever_else_is_in_the_batch(tiny_llama: Path) -> None:
    engine = AsyncEngine.from_pretrained(str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=256)
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    noise = SamplingParams(max_tokens=30, temperature=1.3, ignore_eos=True)
    async with engine:
        alone = await engine.generate("Paged attention keeps", params)
        crowd = await asyncio.gather(
            engine.generate("The quick brown fox", noise), engine.generate("Paged attention keeps", params),
            engine.generate("def add(a, b):", noise), engine.generate("Numbers: 1 2 3", noise))
        other_seed = await engine.generate("Paged attention keeps", SamplingParams(
            max_tokens=24, temperature=1.0, top_p=0.95, seed=99, ignore_eos=True))
    assert crowd[1].token_ids == alone.token_ids
    assert other_seed.token_ids != alone.token_ids
