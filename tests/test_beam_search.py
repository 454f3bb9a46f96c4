"""Beam search: the beams transformers' generate(num_beams=W, do_sample=False) returns, found over
copy-on-write block tables inside continuous batching."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncpage import AsyncEngine, InvalidRequestError, PromptTooLongError, SamplingError, SamplingParams
from tests.conftest import DATA
from tests.test_engine_lifecycle import PROMPTS, _idle, tiny_engine
from tests.test_faults import until

EOS = 1  # the tiny models' EOS id


def _hf_beams(hf: Any, ids: list[int], w: int, n: int, lp: float, es: bool | str, eos: list[int]) -> list[list[int]]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), num_beams=w, num_return_sequences=w, do_sample=False,
                          max_new_tokens=n, length_penalty=lp, early_stopping=es, eos_token_id=eos, pad_token_id=2)
    beams = []
    for seq in out.tolist():
        gen = seq[len(ids):]
        beams.append(gen[: next((j for j, t in enumerate(gen) if t in eos), len(gen))])
    return beams


def _peak_blocks(engine: AsyncEngine) -> list[int]:
    """Records the pool's used blocks after every schedule() (the step's allocation included)."""
    sched = engine._core.scheduler
    real, peaks = sched.schedule, [0]

    def schedule() -> Any:
        out = real()
        peaks[0] = max(peaks[0], engine._core.kv.pool.num_used)
        return out

    sched.schedule = schedule  # type: ignore[method-assign]
    return peaks


async def _frequent_tokens(engine: AsyncEngine, k: int) -> list[int]:
    counts: Counter[int] = Counter()
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for p in PROMPTS[:6]:
        counts.update((await engine.generate(p, greedy)).token_ids)
    return [t for t, _ in counts.most_common(k)]


async def test_beams_equal_transformers_for_every_width_penalty_and_stopping_rule(
        tiny_models: dict[str, tuple[Path, Any]]) -> None:
    path, hf = tiny_models["llama"]
    async with tiny_engine(path) as engine:
        # The random model never says EOS: frequent tokens made stop ids end beams often, so finished
        # hypotheses, early stopping and the length penalty all decide the result.
        stops = await _frequent_tokens(engine, 2)
        cases = [(w, lp, es, extra) for w in (1, 2, 4) for lp, es in ((1.0, False), (2.0, "never"), (-0.5, True))
                 for extra in ([], stops[:1], stops)]
        for w, lp, es, extra in cases:
            for prompt in PROMPTS[:3]:
                ids = engine.tokenizer(prompt).input_ids
                expected = _hf_beams(hf, ids, w, 10, lp, es, [EOS, *extra])
                out = await engine.beam_search(prompt, beam_width=w, max_tokens=10, length_penalty=lp,
                                               early_stopping=es, params=SamplingParams(stop_token_ids=extra))
                assert [b.token_ids for b in out.beams] == expected, (w, lp, es, extra, prompt)
                scores = [b.score for b in out.beams]
                assert scores == sorted(scores, reverse=True)
        await _idle(engine)


@pytest.mark.heavy  # `make test-heavy`: the default model end to end, slow on 2 cores
@pytest.mark.slow
async def test_beams_equal_transformers_on_the_default_model(default_engine: AsyncEngine) -> None:
    ref = json.loads((DATA / "gemma3_270m_beams.json").read_text())
    # The reference stops at the tokenizer's and generation config's EOS; the engine also stops at
    # <end_of_turn> (as llama.cpp does for this GGUF), which no beam here reaches.
    assert set(ref["eos_token_ids"]) <= set(default_engine.eos_token_ids)
    cases = ref["cases"]
    # All at once: the searches batch with each other as any requests do.
    outs = await asyncio.gather(*(default_engine.beam_search(
        c["prompt"], beam_width=c["beam_width"], max_tokens=c["max_tokens"], length_penalty=c["length_penalty"],
        early_stopping=c["early_stopping"]) for c in cases))
    for case, out in zip(cases, outs, strict=True):
        assert [b.token_ids for b in out.beams] == [b["token_ids"] for b in case["beams"]], case["prompt"]
        for got, want in zip(out.beams, case["beams"], strict=True):
            assert got.score == pytest.approx(want["score"], rel=2e-5, abs=1e-3)  # float sums differ by ISA
        assert out.beams[0].text == default_engine.tokenizer.decode(out.beams[0].token_ids, skip_special_tokens=True)


@pytest.mark.slow
async def test_four_beams_over_a_long_prompt_share_its_blocks(default_engine: AsyncEngine) -> None:
    ref = json.loads((DATA / "gemma3_270m_reference.json").read_text())
    long_ids = next(c["prompt_token_ids"] for c in ref["cases"] if c["prompt"] is None)
    bs = default_engine.config.block_size
    peaks = _peak_blocks(default_engine)
    try:
        out = await default_engine.beam_search(long_ids, beam_width=4, max_tokens=32)
    finally:
        del default_engine._core.scheduler.schedule
    assert len(out.beams) == 4
    separate = 4 * -(-(len(long_ids) + 32) // bs)
    print(f"\npeak KV blocks, 4 beams over {len(long_ids)} prompt tokens: {peaks[0]} shared vs {separate} "
          f"as 4 separate copies ({peaks[0] / separate:.0%})")
    assert peaks[0] < separate / 2
    await _idle(default_engine)


@pytest.mark.parametrize("caching", [True, False])
async def test_beam_searches_next_to_other_requests_under_preemption_equal_them_alone(
        tiny_llama: Path, caching: bool) -> None:
    async with tiny_engine(tiny_llama) as engine:
        alone = [await engine.beam_search(p, beam_width=w, max_tokens=12) for p in PROMPTS[:4] for w in (2, 4)]
    # A pool of 80 blocks of 4 tokens cannot hold everything at once: beam groups get preempted and
    # recomputed while sampled requests come and go; the pool's invariants are checked every step.
    async with tiny_engine(tiny_llama, num_kv_blocks=80, max_num_batched_tokens=16, debug_checks=True,
                           enable_prefix_caching=caching) as engine:
        jobs: list[Any] = [engine.beam_search(p, beam_width=w, max_tokens=12) for p in PROMPTS[:4] for w in (2, 4)]
        jobs += [engine.generate(p * 2, SamplingParams(max_tokens=16, temperature=0.8, seed=i, n=2))
                 for i, p in enumerate(PROMPTS[:6])]
        outs = await asyncio.gather(*jobs)
        assert engine.stats().num_preemptions > 0
        await _idle(engine)
    assert [[b.token_ids for b in o.beams] for o in outs[:8]] == [[b.token_ids for b in o.beams] for o in alone]


async def test_a_cancelled_beam_search_frees_every_block(tiny_llama: Path) -> None:
    async with tiny_engine(tiny_llama, max_num_batched_tokens=8) as engine:
        task = asyncio.ensure_future(engine.beam_search(PROMPTS[0] * 3, beam_width=4, max_tokens=64,
                                                        params=SamplingParams(ignore_eos=True)))
        await until(lambda: engine.stats().num_running >= 4)  # its four beams (64 steps of 8 tokens: seen in time)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _idle(engine)
        assert engine.stats().kv_blocks_used == 0
        assert engine._core.check_invariants()
        # The engine goes on serving.
        out = await engine.beam_search(PROMPTS[1], beam_width=2, max_tokens=4)
        assert len(out.beams) == 2


async def test_guided_beams_each_follow_the_grammar(tiny_llama: Path) -> None:
    choices = ["red", "green", "blue", "yellow"]
    async with tiny_engine(tiny_llama) as engine:
        out = await engine.beam_search("Colour:", beam_width=3, max_tokens=8, params=SamplingParams(choice=choices))
        assert len(out.beams) == 3
        assert len({b.text for b in out.beams}) == 3 and all(b.text in choices for b in out.beams)
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                  "additionalProperties": False}
        out = await engine.beam_search("JSON:", beam_width=2, max_tokens=12,
                                       params=SamplingParams(json_schema=schema, max_number_digits=3))
        for b in out.beams:
            if b.finish_reason == "stop":
                assert isinstance(json.loads(b.text)["n"], int)
        await _idle(engine)


async def test_a_beam_whose_matcher_breaks_leaves_the_search_and_the_others_finish(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # llguidance's lexer can run out of fuel on a costly state: the mask allowed a token its matcher then refuses.
    # That beam cannot go on; the search goes on without it, and fails only where no beam is left.
    from asyncpage.guided.llg import LLGuidanceMatcher

    choices = ["red", "green", "blue", "yellow"]
    real = LLGuidanceMatcher.accept
    async with tiny_engine(tiny_llama) as engine:
        broken = set(engine.tokenizer("green", add_special_tokens=False)["input_ids"][:1])
        monkeypatch.setattr(LLGuidanceMatcher, "accept", lambda self, t: t not in broken and real(self, t))
        monkeypatch.setattr(LLGuidanceMatcher, "error", lambda self: "lexer error: too many expressions constructed")
        out = await engine.beam_search("Colour:", beam_width=3, max_tokens=8, params=SamplingParams(choice=choices))
        assert out.beams and all(b.text in choices and b.text != "green" for b in out.beams)
        firsts = {engine.tokenizer(c, add_special_tokens=False)["input_ids"][0] for c in choices}
        monkeypatch.setattr(LLGuidanceMatcher, "accept", lambda self, t: t in firsts and real(self, t))
        with pytest.raises(SamplingError, match=r"rejected token .* a beam search chose \(lexer error"):
            await engine.beam_search("Colour:", beam_width=3, max_tokens=8, params=SamplingParams(choice=choices))
        monkeypatch.setattr(LLGuidanceMatcher, "accept", real)
        again = await engine.beam_search("Colour:", beam_width=3, max_tokens=8, params=SamplingParams(choice=choices))
        assert len(again.beams) == 3  # the engine goes on
        await _idle(engine)


async def test_a_callers_stop_id_ends_a_guided_beam_as_it_ends_a_greedy_sample(tiny_llama: Path) -> None:
    # Only EOS at an unfinished value is a dead end (dropped); a stop id the caller asked for ends
    # the beam where it ends greedy decoding, grammar complete or not.
    async with tiny_engine(tiny_llama) as engine:
        guided = SamplingParams(regex="[a-z ]{10,40}", max_tokens=24, temperature=0)
        free = await engine.generate(PROMPTS[0], guided)
        stop = free.token_ids[3]
        params = SamplingParams(regex="[a-z ]{10,40}", max_tokens=24, temperature=0, stop_token_ids=[stop])
        greedy = await engine.generate(PROMPTS[0], params)
        assert greedy.finish_reason == "stop" and len(greedy.token_ids) <= 4
        out = await engine.beam_search(PROMPTS[0], beam_width=1, max_tokens=24, params=params)
        assert out.beams[0].finish_reason == "stop"
        assert [*out.beams[0].token_ids, stop] == greedy.token_ids  # a beam's ids leave out its stop id
        await _idle(engine)


async def test_stop_strings_end_a_beam_and_are_cut_from_its_text(tiny_llama: Path) -> None:
    async with tiny_engine(tiny_llama) as engine:
        free = await engine.beam_search(PROMPTS[0], beam_width=2, max_tokens=16)
        text = free.beams[0].text
        pairs = Counter(text[i : i + 2] for i in range(len(text) - 1) if "\ufffd" not in text[i : i + 2])
        stop = pairs.most_common(1)[0][0]  # what the best beam says most often
        out = await engine.beam_search(PROMPTS[0], beam_width=2, max_tokens=16, params=SamplingParams(stop=[stop]))
        assert all(stop not in b.text for b in out.beams)
        assert out.beams[0].finish_reason == "stop"
        assert len(out.beams[0].text) < len(text)


async def test_bad_beam_search_arguments_are_refused_by_name(tiny_llama: Path) -> None:
    async with tiny_engine(tiny_llama, max_num_seqs=4) as engine:
        for kwargs, field in [({"beam_width": 0}, "beam_width"), ({"beam_width": 5}, "beam_width"),
                              ({"length_penalty": float("nan")}, "length_penalty"),
                              ({"early_stopping": "sometimes"}, "early_stopping"), ({"max_tokens": 0}, "max_tokens"),
                              ({"params": SamplingParams(n=2)}, "n"),
                              ({"params": SamplingParams(logprobs=2)}, "logprobs")]:
            with pytest.raises(InvalidRequestError) as err:
                await engine.beam_search(PROMPTS[0], **kwargs)
            assert err.value.field == field
        with pytest.raises(PromptTooLongError):
            await engine.beam_search(PROMPTS[0], beam_width=4, max_tokens=300)  # 4 x 300 tokens > 1024 in the pool
        assert (await engine.beam_search(PROMPTS[0], beam_width=2, max_tokens=4)).beams


def _preempt_search_at(engine: AsyncEngine, generated: int) -> list[int]:
    """Preempts the (first) beam search once, as a later request's growth would, when its beams
    have `generated` tokens each. Returns [times it fired]."""
    sched, fired = engine._core.scheduler, [0]
    real = sched.schedule

    def schedule() -> Any:
        for s in list(sched.running):
            search, beams = s.request.beam, s.request.seqs
            if (search is not None and search.generated == generated and not fired[0] and len(beams) > 1
                    and all(b in sched.running for b in beams)):
                fired[0] += 1
                sched._preempt(s)
                break
        return real()

    sched.schedule = schedule  # type: ignore[method-assign]
    return fired


async def test_a_beam_search_wider_than_a_step_is_refused_rather_than_hanging(tiny_llama: Path) -> None:
    # Its beams step together, one token each: a step budget of 2 tokens could never move 4 of them.
    async with tiny_engine(tiny_llama, max_num_batched_tokens=2, max_num_seqs=4) as engine:
        with pytest.raises(InvalidRequestError) as err:
            await asyncio.wait_for(engine.beam_search(PROMPTS[0], beam_width=4, max_tokens=4), 10)
        assert err.value.field == "beam_width"
        assert len((await asyncio.wait_for(engine.beam_search(PROMPTS[0], beam_width=2, max_tokens=4), 10)).beams) == 2


async def test_a_beam_search_that_fits_the_pool_in_tokens_but_not_in_blocks_is_refused(tiny_llama: Path) -> None:
    # 4 beams of 20 + 74 tokens are 376 tokens = the pool's 94 blocks of 4, but recomputed after a
    # preemption each beam holds 24 whole blocks (96 > 94): the search preempted itself forever.
    async with tiny_engine(tiny_llama, num_kv_blocks=94, max_num_batched_tokens=16,
                           enable_prefix_caching=False) as engine:
        ids = list(range(3, 23))
        with pytest.raises(PromptTooLongError):
            await engine.beam_search(ids, beam_width=4, max_tokens=74)
        # One token less fits (4 x 23 blocks): preempted near its end, it is recomputed and finishes.
        fired = _preempt_search_at(engine, 71)
        out = await asyncio.wait_for(engine.beam_search(ids, beam_width=4, max_tokens=73,
                                                        params=SamplingParams(ignore_eos=True)), 30)
        assert fired[0] == 1 and len(out.beams) == 4
        await _idle(engine)


async def test_a_beam_search_whose_max_tokens_runs_past_the_context_is_sized_by_the_context(
        tiny_llama: Path) -> None:
    # Each beam stops at max_model_len (64 tokens, 16 blocks of 4): 2 beams need 32 of the 40 blocks,
    # however large max_tokens is, as a request with n=2 does.
    async with tiny_engine(tiny_llama, num_kv_blocks=40, max_model_len=64, debug_checks=True) as engine:
        ids = list(range(5, 65))
        out = await asyncio.wait_for(engine.beam_search(ids, beam_width=2, max_tokens=100,
                                                        params=SamplingParams(ignore_eos=True)), 30)
        assert [(len(ids) + len(b.token_ids), b.finish_reason) for b in out.beams] == [(64, "length")] * 2
        with pytest.raises(PromptTooLongError):  # 3 beams of 16 blocks do not fit 40
            await engine.beam_search(ids, beam_width=3, max_tokens=100)
        await _idle(engine)


async def test_a_search_preempted_with_the_pool_exactly_full_is_readmitted_and_finishes(tiny_llama: Path) -> None:
    # 4 beams of 8 + 9 tokens fill all 16 blocks. Recomputed in one chunk each, the last beam found
    # exactly its 4 blocks free but was held to the watermark while its siblings waited for it.
    ids = list(range(5, 13))
    params = SamplingParams(ignore_eos=True)
    async with tiny_engine(tiny_llama, num_kv_blocks=16, max_num_batched_tokens=64,
                           enable_prefix_caching=False, debug_checks=True) as engine:
        alone = await engine.beam_search(ids, beam_width=4, max_tokens=9, params=params)
        fired = _preempt_search_at(engine, 7)
        out = await asyncio.wait_for(engine.beam_search(ids, beam_width=4, max_tokens=9, params=params), 30)
        assert fired[0] == 1
        assert [b.token_ids for b in out.beams] == [b.token_ids for b in alone.beams]
        await _idle(engine)


async def test_beam_searches_crowding_a_small_pool_all_finish(tiny_llama: Path) -> None:
    # A search partly readmitted after a preemption waits for the rest of its beams; a later search
    # preempted meanwhile jumped ahead of them in the queue, could not fit next to the waiting beams,
    # preempted itself, and so on forever.
    prompts = [PROMPTS[i] for i in (0, 1, 2, 4)]
    params = SamplingParams(ignore_eos=True)
    async with tiny_engine(tiny_llama, num_kv_blocks=84, max_num_batched_tokens=16, max_num_seqs=16,
                           enable_prefix_caching=False, debug_checks=True) as engine:
        jobs: list[Any] = [engine.beam_search(p, beam_width=4, max_tokens=24, params=params) for p in prompts]
        jobs += [engine.generate(p, SamplingParams(max_tokens=30, temperature=0.9, seed=1, n=2)) for p in PROMPTS[5:8]]
        outs = await asyncio.wait_for(asyncio.gather(*jobs), 60)
        assert all(len(o.beams) == 4 for o in outs[:4])
        await _idle(engine)
        assert engine._core.check_invariants()


async def test_on_request_finished_reports_a_searchs_beams(tiny_llama: Path) -> None:
    async with tiny_engine(tiny_llama) as engine:
        seen: list[Any] = []
        engine.on_request_finished(seen.append)
        before = engine.stats()
        out = await engine.beam_search(PROMPTS[0], beam_width=3, max_tokens=6, params=SamplingParams(ignore_eos=True))
        await _idle(engine)
        done = seen[-1]
        assert done.finish_reasons == [b.finish_reason for b in out.beams] == ["length"] * 3
        assert done.num_generated_tokens == sum(len(b.token_ids) for b in out.beams) == 18
        after = engine.stats()
        assert after.num_generated_tokens - before.num_generated_tokens == 18
        assert after.num_requests_finished - before.num_requests_finished == 1
