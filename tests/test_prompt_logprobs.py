"""Scoring a text: `prompt_logprobs` gives each prompt token's log-probability given the ones before it,
as a full forward pass of transformers does, whatever chunks, cache hits or preemptions the prompt met."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from asyncpage import AsyncEngine, InvalidRequestError, SamplingParams
from tests.conftest import TINY_VOCAB

PROMPT = [(i * 37 + 11) % (TINY_VOCAB - 3) + 3 for i in range(45)]


def _reference(model: Any, ids: list[int]) -> torch.Tensor:
    """transformers' log-probability of ids[1:], each given the tokens before it."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def _scores(out: Any) -> torch.Tensor:
    assert out.prompt_logprobs[0] is None
    assert [e.token_id for e in out.prompt_logprobs[1:]] == out.prompt_token_ids[1:]
    return torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
async def test_prompt_logprobs_are_a_full_forward_pass_whatever_the_chunks(
        tiny_models: dict[str, tuple[Path, Any]], arch: str) -> None:
    path, hf = tiny_models[arch]
    # 45 prompt tokens through 16-token steps: three chunks, each continuing cached context.
    async with AsyncEngine.from_pretrained(path, dtype="float32", max_num_batched_tokens=16) as engine:
        out = await engine.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))
    assert len(out.prompt_logprobs) == len(PROMPT)
    torch.testing.assert_close(_scores(out), _reference(hf, PROMPT), atol=1e-4, rtol=1e-4)


async def test_a_prompt_in_the_prefix_cache_is_still_scored_in_full(tiny_llama: Path) -> None:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)
    async with AsyncEngine.from_pretrained(tiny_llama, dtype="float32", block_size=4) as engine:
        plain = await engine.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0))
        first = await engine.generate(PROMPT, params)
        again = await engine.generate(PROMPT, params)
    assert plain.prompt_logprobs is None  # only when asked
    assert first.metrics.num_cached_prompt_tokens == again.metrics.num_cached_prompt_tokens == 0
    assert first.prompt_logprobs == again.prompt_logprobs
    for entry in first.prompt_logprobs[1:]:
        assert len(entry.top) == 2 and max(entry.top.values()) >= entry.logprob - 1e-6
        assert max(entry.top.values()) == pytest.approx(max(entry.top.values()))


async def test_prompt_logprobs_are_whole_after_preemption_and_beside_other_requests(
        tiny_models: dict[str, tuple[Path, Any]]) -> None:
    path, hf = tiny_models["llama"]
    want = _reference(hf, PROMPT)
    prompts = [[3 + (i + k) % 50 for i in range(40)] for k in range(5)]
    # A pool of 24 four-token blocks for six 40-50 token requests that each generate 30: preemptions.
    async with AsyncEngine.from_pretrained(path, dtype="float32", block_size=4, num_kv_blocks=24,
                                           max_num_batched_tokens=12) as engine:
        results: dict[int, Any] = {}

        async def run(i: int, ids: list[int], params: SamplingParams) -> None:
            results[i] = await engine.generate(ids, params)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run, -1, PROMPT, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                          prompt_logprobs=0, n=2))
            for k, ids in enumerate(prompts):
                tg.start_soon(run, k, ids, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    assert sum(r.metrics.num_preemptions for r in results.values()) > 0
    torch.testing.assert_close(_scores(results[-1]), want, atol=1e-4, rtol=1e-4)


async def test_bad_prompt_logprobs_are_refused_naming_the_field(tiny_llama: Path) -> None:
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)  # type: ignore[arg-type]
    async with AsyncEngine.from_pretrained(tiny_llama, dtype="float32") as engine:
        with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
            await engine.beam_search(PROMPT, 2, 4, params=SamplingParams(temperature=0, prompt_logprobs=0))
        # One token: nothing before it to score it by.
        out = await engine.generate(PROMPT[:1], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    assert out.prompt_logprobs == [None]


async def test_a_stream_has_its_prompt_logprobs_once_its_first_chunk_has_come(
        tiny_models: dict[str, tuple[Path, Any]]) -> None:
    path, hf = tiny_models["llama"]
    async with AsyncEngine.from_pretrained(path, dtype="float32", max_num_batched_tokens=16) as engine:
        s = engine.stream(PROMPT, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=0))
        async with s:
            assert s.prompt_logprobs is None  # not submitted yet
            async for _ in s:
                got = s.prompt_logprobs
                break
        plain = engine.stream(PROMPT, SamplingParams(max_tokens=1, temperature=0))
        async with plain:
            async for _ in plain:
                pass
    assert got is not None and len(got) == len(PROMPT) and got[0] is None
    torch.testing.assert_close(torch.tensor([e.logprob for e in got[1:]]), _reference(hf, PROMPT),
                               atol=1e-4, rtol=1e-4)
    assert plain.prompt_logprobs is None
