"""Sampling: greedy, seeded reproducibility, the top-k / top-p / min-p cuts, penalties, logprobs."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from asyncpage import AsyncEngine, InvalidRequestError, SamplingParams
from asyncpage.decoding.sampling import SampleSpec, sample

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


def test_greedy_takes_the_first_of_tied_maxima_as_argmax_does() -> None:
    # bfloat16 logits tie often; greedy output must not depend on how the maximum is found.
    logits = torch.randn(6, 262_144).bfloat16().float()
    logits[1, :] = 0.5
    logits[2, [7, 100_000, 262_143]] = 50.0
    greedy = SamplingParams(temperature=0)
    out = sample(logits, [SampleSpec(i, greedy, None) for i in range(6)])
    assert out.tokens == logits.argmax(-1).tolist()
    mixed = [SampleSpec(i, greedy if i % 2 else SamplingParams(temperature=0.7),
                        None if i % 2 else torch.Generator().manual_seed(i)) for i in range(6)]
    assert sample(logits, mixed).tokens[1::2] == logits[1::2].argmax(-1).tolist()


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


# ---- numerically hostile inputs (issue 11, defect 2) ---------------------------------------------
@pytest.mark.parametrize("t", [math.inf, -1.0, math.nan])
def test_non_finite_or_negative_temperature_is_refused_naming_the_field(t: float) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(temperature=t)
    assert e.value.field == "temperature"


def test_a_tiny_temperature_samples_the_argmax_instead_of_garbage() -> None:
    logits = torch.randn(64, 1000) * 30
    out = sample(logits, [SampleSpec(i, SamplingParams(temperature=1e-40), torch.Generator().manual_seed(i))
                          for i in range(64)])
    assert out.tokens == logits.argmax(-1).tolist()
    assert not out.invalid


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_nan_or_inf_logit_row_yields_no_token_and_leaves_other_rows_alone(temperature: float) -> None:
    logits = torch.randn(4, 50)
    logits[1, 7] = float("nan")
    logits[2, 3] = float("inf")
    specs = [SampleSpec(i, SamplingParams(temperature=temperature, seed=i), torch.Generator().manual_seed(i))
             for i in range(4)]
    out = sample(logits, specs)
    assert out.invalid == {1, 2}
    assert out.tokens[1] == out.tokens[2] == -1
    assert 0 <= out.tokens[0] < 50 and 0 <= out.tokens[3] < 50
    if temperature == 0:
        assert out.tokens[0] == int(logits[0].argmax())


def test_a_mask_that_leaves_no_finite_logit_yields_no_token() -> None:
    from asyncpage.guided.backend import bitmask_width

    logits = torch.randn(2, 64)
    bitmask = torch.zeros((2, bitmask_width(64)), dtype=torch.int32)  # nothing allowed
    bitmask[1] = -1  # row 1 unconstrained by its mask
    specs = [SampleSpec(i, SamplingParams(temperature=0), None, matcher=object()) for i in range(2)]  # type: ignore[arg-type]
    out = sample(logits, specs, bitmask)
    assert out.invalid == {0} and out.tokens[1] == int(logits[1].argmax())


def test_greedy_under_a_grammar_mask_picks_what_masking_the_whole_row_picks() -> None:
    # Rows whose own maximum the mask allows are not masked (guided.keeps_maximum): the token must be the
    # one masking gives, ties (coarse logits), a disallowed maximum, NaN / inf rows and an empty mask included.
    from asyncpage.decoding.speculative import _greedy
    from asyncpage.guided.backend import apply_bitmask, bitmask_width

    g = torch.Generator().manual_seed(0)
    n, v = 64, 300
    logits = torch.randint(0, 6, (n, v), generator=g).float()  # many tied maxima
    bitmask = torch.randint(-(2**31), 2**31 - 1, (n, bitmask_width(v)), generator=g, dtype=torch.int32)
    bitmask[0] = 0  # nothing allowed
    bitmask[1] = -1  # everything allowed
    logits[2, 5] = float("nan")
    logits[3, 9] = float("inf")
    logits[4, 11] = float("-inf")
    bitmask[2, 0] |= 1 << 5  # the NaN and the inf allowed: their rows have no token
    bitmask[3, 0] |= 1 << 9
    for r in range(5, 20):  # the row's first maximum disallowed
        t = int(logits[r].argmax())
        bitmask[r, t >> 5] &= ~(1 << (t & 31))
    masked = logits.clone()
    apply_bitmask(masked, bitmask)
    want = masked.argmax(-1).tolist()
    finite = torch.isfinite(masked.max(-1).values).tolist()
    specs = [SampleSpec(i, SamplingParams(temperature=0), None, matcher=object()) for i in range(n)]  # type: ignore[arg-type]
    out = sample(logits, specs, bitmask)
    assert out.invalid == {i for i in range(n) if not finite[i]} and {0, 2, 3} <= out.invalid
    assert [t for i, t in enumerate(out.tokens) if finite[i]] == [t for i, t in enumerate(want) if finite[i]]
    tops = list(zip(*(t.tolist() for t in logits.max(-1)), strict=True))  # every row's at once, as verify finds them
    assert [_greedy(logits[i], bitmask[i], tops[i]) for i in range(n)] == [t if finite[i] else None
                                                                          for i, t in enumerate(want)]
    assert logits[2, 5].isnan()  # the caller's logits are left raw


def test_top_k_then_top_p_renormalizes_over_the_top_k_like_transformers() -> None:
    """Defect 4: top-p ran over the full distribution instead of the top-k renormalized."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        logits = torch.randn(1, 200, generator=gen) * 3
        k = int(torch.randint(1, 50, (1,), generator=gen))
        p = float(torch.rand(1, generator=gen)) * 0.9 + 0.05
        hf = TopPLogitsWarper(top_p=p)(None, TopKLogitsWarper(top_k=k)(None, logits.clone()))  # type: ignore[arg-type]
        hf_kept = set(torch.nonzero(hf[0] > -math.inf).flatten().tolist())
        params = SamplingParams(top_k=k, top_p=p, temperature=1.0)
        ours = set(sample(logits.repeat(400, 1),
                          [SampleSpec(i, params, torch.Generator().manual_seed(trial * 1000 + i))
                           for i in range(400)]).tokens)
        assert ours <= hf_kept, (trial, k, p, sorted(ours - hf_kept))


def test_top_k_with_top_p_on_a_known_distribution() -> None:
    # top_k=2 keeps [0.5, 0.3] -> renormalized [0.625, 0.375]; top_p=0.6 then keeps the first alone.
    # Over the full distribution (the old behaviour) 0.5 < 0.6 kept the second as well.
    assert set(_draw(SamplingParams(top_k=2, top_p=0.6))) == {0}


@pytest.mark.parametrize("t", [1e-46, 1e-300, 5e-6])
def test_temperatures_below_float_range_are_greedy(t: float) -> None:
    logits = torch.randn(8, 320) * 5
    out = sample(logits, [SampleSpec(i, SamplingParams(temperature=t), torch.Generator().manual_seed(i))
                          for i in range(8)])
    assert out.tokens == logits.argmax(-1).tolist() and not out.invalid


def test_a_grammar_mask_leaves_exactly_the_allowed_tokens_and_refuses_a_narrow_mask() -> None:
    # apply_bitmask's numpy path (float32 on the CPU) against the bits read one by one.
    from asyncpage.guided.backend import apply_bitmask, bitmask_width

    g = torch.Generator().manual_seed(1)
    for n, v in ((1, 262_144), (3, 300), (2, 33), (4, 32)):
        logits = torch.randn(n, v, generator=g)
        logits[0, 0] = float("nan")  # disallowed below: masked to -inf like any other
        bitmask = torch.randint(-(2**31), 2**31 - 1, (n, bitmask_width(v)), generator=g, dtype=torch.int32)
        bitmask[0, 0] &= ~1
        masked = logits.clone()
        apply_bitmask(masked, bitmask)
        words = bitmask.tolist()
        allowed = torch.tensor([[(words[r][t >> 5] >> (t & 31)) & 1 == 1 for t in range(v)] for r in range(n)])
        assert torch.equal(masked[allowed], logits[allowed])
        assert bool((masked[~allowed] == float("-inf")).all())
        # The torch path (any other dtype) masks the same tokens.
        as64 = logits.double()
        apply_bitmask(as64, bitmask)
        assert torch.equal(torch.isinf(as64) & (as64 < 0), ~allowed)
    with pytest.raises(ValueError, match="does not cover"):
        apply_bitmask(torch.zeros(1, 65), torch.zeros(1, 2, dtype=torch.int32))


@pytest.mark.parametrize("few", [True, False])
def test_guided_greedy_and_beam_rows_decide_alike_over_few_allowed_tokens_or_the_masked_row(
        few: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # A row whose grammar allows few tokens is decided over those tokens alone (guided.allowed_tokens); the
    # masked row gives the same token, the same validity, the same beam candidates.
    from asyncpage.decoding import sampling
    from asyncpage.guided.backend import apply_bitmask, bitmask_width

    if not few:
        monkeypatch.setattr(sampling, "allowed_tokens", lambda *a, **k: None)
    g = torch.Generator().manual_seed(3)
    n, v = 12, 5000
    logits = torch.randn(n, v, generator=g)
    bitmask = torch.zeros(n, bitmask_width(v), dtype=torch.int32)
    for r in range(n):
        for t in torch.randperm(v, generator=g)[: r * 3].tolist():  # row 0 allows nothing
            bitmask[r, t >> 5] |= 1 << (t & 31)
    masked = logits.clone()
    apply_bitmask(masked, bitmask)
    specs = [SampleSpec(i, SamplingParams(temperature=0), None, matcher=object()) for i in range(n)]  # type: ignore[arg-type]
    out = sample(logits, specs, bitmask)
    assert out.invalid == {0}
    assert out.tokens[1:] == masked.argmax(-1).tolist()[1:]
    beams = [SampleSpec(i, SamplingParams(temperature=0), None, matcher=object(), beam_k=4)  # type: ignore[arg-type]
             for i in range(n)]
    got = sampling.beam_candidates(logits, beams, bitmask)
    lp = torch.log_softmax(logits, dim=-1)
    apply_bitmask(lp, bitmask)
    for i in range(n):
        vals, ids = lp[i].topk(4)
        keep = torch.isfinite(vals)
        assert got[i] == (ids[keep].tolist(), vals[keep].tolist())
    assert got[0] == ([], [])  # no candidate: the runner fails that beam's request
    assert sample(logits, beams, bitmask).invalid == frozenset()  # a beam row is not sampled here


def test_beams_take_tied_tokens_in_id_order_and_one_without_candidates_may_still_have_a_valid_token() -> None:
    from asyncpage.decoding.sampling import beam_candidates, has_valid_token
    from asyncpage.guided.backend import bitmask_width

    v = 256
    logits = torch.zeros(1, v)
    mask = torch.zeros(1, bitmask_width(v), dtype=torch.int32)
    mask[0, 0] = 0xFF  # tokens 0..7, all tied
    beam = [SampleSpec(0, SamplingParams(temperature=0), None, matcher=object(), beam_k=3)]  # type: ignore[arg-type]
    assert beam_candidates(logits, beam, mask)[0][0] == [0, 1, 2]
    # +inf at a disallowed token: no finite log-probability anywhere, but the allowed tokens are finite logits
    row = torch.tensor([[1.0, 2.0, float("inf"), 0.5]])
    small = torch.tensor([[0b1011]], dtype=torch.int32)
    assert beam_candidates(row, beam, small)[0] == ([], [])
    assert has_valid_token(row[0], small[0]) and not has_valid_token(row[0], None)
    assert not has_valid_token(torch.tensor([1.0, float("nan")]), torch.tensor([0b10], dtype=torch.int32))
