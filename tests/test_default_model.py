"""The real default model (gemma-3-270m, Q4_K_M GGUF dequantized to float32) gives transformers'
greedy tokens. The reference is made by scripts/make_reference.py with transformers loading the GGUF
by itself, so a mistake in asyncpage's GGUF mapping cannot hide in both."""

from __future__ import annotations

import asyncio
from typing import Any

from asyncpage import AsyncEngine, SamplingParams


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


async def test_nine_concurrent_prompts_match_transformers_greedy(default_engine: AsyncEngine,
                                                               reference: dict[str, Any]) -> None:
    cases = reference["cases"]
    assert len(cases) == 9 and max(len(c["prompt_token_ids"]) for c in cases) == 709
    # str prompts go through the engine's tokenizer (BOS included), the long one as token ids.
    prompts = [c["prompt"] if c["prompt"] is not None else c["prompt_token_ids"] for c in cases]
    outs = await asyncio.gather(*(default_engine.generate(p, _params(reference["new_tokens"])) for p in prompts))
    for case, out in zip(cases, outs, strict=True):
        assert out.prompt_token_ids == case["prompt_token_ids"]
        assert out.token_ids == case["greedy_token_ids"], case["prompt"]
    st = default_engine.stats()
    assert st.kv_blocks_used == 0 and st.num_running == 0


async def test_long_prompt_past_sliding_window_is_chunked_and_matches(default_engine: AsyncEngine,
                                                                      reference: dict[str, Any]) -> None:
    case = next(c for c in reference["cases"] if len(c["prompt_token_ids"]) > 512)
    # max_num_batched_tokens=256: the 709-token prompt is prefilled in three chunks.
    out = await default_engine.generate(case["prompt_token_ids"], _params(8))
    assert out.token_ids == case["greedy_token_ids"][:8]


async def test_first_step_logits_near_transformers(default_engine: AsyncEngine,
                                                   reference: dict[str, Any]) -> None:
    import torch

    case = reference["cases"][0]
    out = await default_engine.generate(case["prompt"], SamplingParams(max_tokens=1, temperature=0, logprobs=5))
    lp = out.choices[0].logprobs
    assert lp is not None
    ref = torch.tensor(case["first_step_top5"]["logits"])
    ref_lp = ref - torch.logsumexp(ref, 0)  # only relative values are comparable; check the ordering
    assert list(lp[0].top) == case["first_step_top5"]["ids"]
    got = torch.tensor(list(lp[0].top.values()))
    assert torch.allclose(got - got[0], ref_lp - ref_lp[0], atol=1e-3)


async def test_batch_invariance_alone_batched_and_small_budget(reference: dict[str, Any],
                                                               default_engine: AsyncEngine) -> None:
    """The same greedy tokens alone, in a batch of 9 (test above), and with a 32-token step budget,
    on a second engine sharing the weights."""
    case = reference["cases"][2]
    async with default_engine.clone(max_num_batched_tokens=32, num_kv_blocks=64) as small:
        out = await small.generate(case["prompt"], _params(24))
    assert out.token_ids == case["greedy_token_ids"][:24]
