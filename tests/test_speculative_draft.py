"""Speculative decoding with a draft model: a second model with the same tokenizer proposes, the
target verifies; the output is the target's, whatever the draft says."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from asyncpage import AsyncEngine, InvalidRequestError, SamplingParams
from asyncpage.core.draft import DraftGate
from asyncpage.decoding.speculative import SpeculativeConfig, cli_config
from asyncpage.errors import ModelLoadError
from tests.conftest import ARCHS, build_tiny
from tests.test_engine_lifecycle import PROMPTS, _idle, tiny_engine
from tests.test_speculative import _outputs, _workload


@pytest.fixture(scope="module")
def drafts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Draft models sharing the tiny models' tokenizer: another llama (other weights, so its guesses
    are mostly wrong) and a qwen2 (another architecture, its tokenizer one special token longer)."""
    root = tmp_path_factory.mktemp("drafts")
    build_tiny("llama", root / "llama", seed=1)
    build_tiny("qwen2", root / "qwen2", seed=2)
    return {"llama": root / "llama", "qwen2": root / "qwen2"}


def _draft(path: Path, k: int = 4) -> dict[str, Any]:
    # Never paused for cost here (the tiny drafts cost what their targets do): every path is exercised.
    return {"method": "draft", "model": str(path), "num_speculative_tokens": k, "auto_disable": False}


@pytest.mark.parametrize("arch", ARCHS)
async def test_outputs_are_identical_with_a_draft_model_for_every_architecture(
        arch: str, tiny_models: dict[str, tuple[Path, Any]], drafts: dict[str, Path]) -> None:
    path = tiny_models[arch][0]
    jobs = _workload()
    async with tiny_engine(path) as plain:
        expected = await _outputs(plain, jobs, together=True)
    # The target as its own draft (its guesses are the target's own greedy tokens), and a draft of
    # another architecture; alone, then all at once in a pool small enough to preempt.
    for draft in (path, drafts["qwen2"]):
        async with tiny_engine(path, speculative_config=_draft(draft)) as spec:
            assert await _outputs(spec, jobs[:8], together=False) == expected[:8]
            assert spec.stats().spec_proposed_tokens > 0
        async with tiny_engine(path, speculative_config=_draft(draft), num_kv_blocks=48, debug_checks=True) as spec:
            assert await _outputs(spec, jobs, together=True) == expected
            assert spec.stats().num_preemptions > 0
            await _idle(spec)
            assert spec._core.check_invariants()
            assert spec._core.draft is not None and spec._core.draft.num_blocks_used == 0


async def test_a_draft_equal_to_the_target_has_its_greedy_drafts_accepted(tiny_llama: Path) -> None:
    """Every draft the target itself would have produced is kept: the draft's cache stays exact
    across catch-up, rollback and prefills longer than one step's budget."""
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    long_prompt = " ".join(PROMPTS[:6])  # over max_num_batched_tokens: the draft catches up in chunks
    async with tiny_engine(tiny_llama, speculative_config=_draft(tiny_llama, k=6)) as spec:
        outs = await asyncio.gather(*(spec.generate(p, greedy) for p in [*PROMPTS[:5], long_prompt]))
        st = spec.stats()
    assert all(len(o.token_ids) == 48 for o in outs)
    assert st.spec_proposed_tokens > 100 and st.spec_accepted_tokens == st.spec_proposed_tokens
    # Fewer verify steps than tokens: most steps emitted several.
    assert sum(o.metrics.spec_verify_steps for o in outs) < sum(len(o.token_ids) for o in outs) / 2


async def test_guided_output_with_a_draft_model_is_valid_and_identical(tiny_llama: Path) -> None:
    schema = {"type": "object", "required": ["name", "tags"], "additionalProperties": False,
              "properties": {"name": {"type": "string", "maxLength": 40},
                             "tags": {"type": "array", "items": {"enum": ["x", "yy", "zzz"]}, "maxItems": 8}}}
    params = [SamplingParams(max_tokens=64, temperature=0, json_schema=schema),
              SamplingParams(max_tokens=64, temperature=0.7, seed=3, json_schema=schema),
              SamplingParams(max_tokens=20, temperature=0, json_schema=schema),
              SamplingParams(max_tokens=40, temperature=0, regex=r"(ab|cd)+ [0-9]{2,5}")]
    jobs = [(p, q) for p in PROMPTS[:3] for q in params]
    async with tiny_engine(tiny_llama) as plain:
        expected = await _outputs(plain, jobs, together=True)
    async with tiny_engine(tiny_llama, speculative_config=_draft(tiny_llama)) as spec:
        outs = await asyncio.gather(*(spec.generate(p, q) for p, q in jobs))
        assert spec.stats().spec_accepted_tokens > 0
    assert [[(c.token_ids, c.finish_reason) for c in o.choices] for o in outs] == expected
    for (_, q), o in zip(jobs, outs, strict=True):
        if q.json_schema is not None:
            assert set(json.loads(o.text)) == {"name", "tags"}


async def test_stops_inside_a_drafted_run_end_the_sequence_at_the_right_token(tiny_llama: Path) -> None:
    async with tiny_engine(tiny_llama) as plain:
        free = await plain.generate(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        ids, text = free.token_ids, free.text
        jobs = [SamplingParams(max_tokens=40, temperature=0, stop=[text[12:15]]),
                SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[ids[17]]),
                SamplingParams(max_tokens=23, temperature=0, ignore_eos=True)]
        expected = [await plain.generate(PROMPTS[0], q) for q in jobs]
    async with tiny_engine(tiny_llama, speculative_config=_draft(tiny_llama, k=8)) as spec:
        got = [await spec.generate(PROMPTS[0], q) for q in jobs]
    for e, g in zip(expected, got, strict=True):
        assert (g.token_ids, g.text, g.finish_reason) == (e.token_ids, e.text, e.finish_reason)


async def test_a_wrong_draft_leaks_no_block_in_either_pool(tiny_llama: Path, drafts: dict[str, Path]) -> None:
    hot = SamplingParams(max_tokens=40, temperature=1.2, ignore_eos=True)
    async with tiny_engine(tiny_llama, speculative_config=_draft(drafts["llama"], k=6), num_kv_blocks=40,
                           debug_checks=True, max_num_batched_tokens=24) as engine:
        tasks = [asyncio.create_task(engine.generate(p, hot)) for p in PROMPTS[:10]]
        await asyncio.sleep(0.05)
        tasks[3].cancel()  # an abort between the draft's step and the target's
        await asyncio.gather(*tasks, return_exceptions=True)
        await _idle(engine)
        st = engine.stats()
        assert engine._core.check_invariants()
        assert engine._core.draft is not None and engine._core.draft.num_blocks_used == 0
    assert st.spec_proposed_tokens > 2 * st.spec_accepted_tokens
    assert st.kv_blocks_used == 0


async def test_a_draft_pool_too_small_for_everyone_still_gives_the_same_output(
        tiny_llama: Path, drafts: dict[str, Path]) -> None:
    """Sequences the draft's pool cannot hold this step just do not speculate."""
    jobs = [(p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)) for p in PROMPTS[:8]]
    async with tiny_engine(tiny_llama) as plain:
        expected = await _outputs(plain, jobs, together=True)
    async with tiny_engine(tiny_llama, speculative_config=_draft(tiny_llama), num_kv_blocks=64) as spec:
        assert spec._core.draft is not None
        spec._core.draft.kv = type(spec._core.draft.kv)(12, spec.config.block_size)  # room for ~1 sequence
        assert await _outputs(spec, jobs, together=True) == expected
        assert spec.stats().spec_accepted_tokens > 0


def test_a_draft_with_another_tokenizer_is_refused_at_load(tiny_llama: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(tiny_llama, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[40:42]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: same size, other meaning
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ModelLoadError, match="another tokenizer"):
        tiny_engine(tiny_llama, speculative_config=_draft(other))


@pytest.mark.parametrize("config", [{"method": "draft"}, {"method": "ngram", "model": "x"},
                                    {"method": "ngram", "quantization": "int8"},
                                    {"method": "draft", "model": "x", "quantization": "int3"}])
def test_bad_draft_configs_are_refused_by_name(config: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError, match="speculative_config"):
        SpeculativeConfig.parse(config)


def test_the_command_line_spells_a_draft_as_draft_path_and_k() -> None:
    assert cli_config("draft:/m/d") == {"method": "draft", "model": "/m/d"}
    assert cli_config("draft:/m/d:3") == {"method": "draft", "model": "/m/d", "num_speculative_tokens": 3}
    assert cli_config("draft:C:/m:x") == {"method": "draft", "model": "C:/m:x"}
    with pytest.raises(InvalidRequestError, match="speculative"):
        cli_config("draft:")


def test_a_missing_draft_model_fails_to_load_by_path(tiny_llama: Path, tmp_path: Path) -> None:
    with pytest.raises((ModelLoadError, OSError), match="nowhere"):
        AsyncEngine.from_pretrained(str(tiny_llama), dtype="float32",
                                    speculative_config=_draft(tmp_path / "nowhere"))


async def test_a_clone_with_a_draft_config_loads_its_draft_and_keeps_the_output(tiny_llama: Path) -> None:
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    base = tiny_engine(tiny_llama)
    spec = base.clone(speculative_config=_draft(tiny_llama))
    assert spec._core.draft is not None and base._core.draft is None
    async with base:
        expected = (await base.generate(PROMPTS[1], greedy)).token_ids
    async with spec:
        assert (await spec.generate(PROMPTS[1], greedy)).token_ids == expected
        assert spec.stats().spec_accepted_tokens > 0
    plain = spec.clone(speculative_config=None)
    assert plain._core.draft is None


async def test_a_fork_beside_a_short_verify_samples_each_request_from_its_own_row(tiny_llama: Path) -> None:
    """A 2-row verify and a 3-way fork in one step have as many logit rows as samples: rows must
    still be matched to samples by index, not by count (a seeded request once sampled a draft row)."""
    p = PROMPTS[0]
    jobs = [(p, SamplingParams(max_tokens=1, temperature=0)),
            (p, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)),
            (p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)),
            (p, SamplingParams(max_tokens=30, temperature=0.9, top_k=40, top_p=0.9, seed=0, ignore_eos=True)),
            (p, SamplingParams(max_tokens=30, temperature=0, repetition_penalty=1.3, ignore_eos=True)),
            (p, SamplingParams(max_tokens=30, temperature=1.0, seed=100, n=3, ignore_eos=True))]
    async with tiny_engine(tiny_llama) as plain:
        expected = await _outputs(plain, jobs, together=True)
    async with tiny_engine(tiny_llama, speculative_config=_draft(tiny_llama)) as spec:
        assert await _outputs(spec, jobs, together=True) == expected


async def test_a_draft_with_fewer_embedding_rows_than_the_target_skips_what_it_cannot_read(
        tiny_llama: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from tests.conftest import _tiny_tokenizer, tiny_config

    narrow = tmp_path / "narrow"
    config = tiny_config("llama")
    config.vocab_size = 312  # the tokenizer's size; the target's logits are 320 wide
    AutoModelForCausalLM.from_config(config).save_pretrained(narrow)
    _tiny_tokenizer(narrow)
    hot = SamplingParams(max_tokens=40, temperature=1.5, seed=1, ignore_eos=True)  # emits ids 312..319
    async with tiny_engine(tiny_llama) as plain:
        expected = await _outputs(plain, [(p, hot) for p in PROMPTS[:4]], together=True)
    assert max(t for o in expected for c in o for t in c[0]) >= 312
    async with tiny_engine(tiny_llama, speculative_config=_draft(narrow)) as spec:
        assert await _outputs(spec, [(p, hot) for p in PROMPTS[:4]], together=True) == expected


async def test_leaving_with_requests_in_flight_frees_the_draft_pool(tiny_llama: Path) -> None:
    engine = tiny_engine(tiny_llama, speculative_config=_draft(tiny_llama))
    assert engine._core.draft is not None
    for _ in range(2):
        async with engine:
            tasks = [asyncio.create_task(engine.generate(p, SamplingParams(max_tokens=200, ignore_eos=True)))
                     for p in PROMPTS[:6]]
            while engine.stats().num_generated_tokens < 30:
                await asyncio.sleep(0.01)
        await asyncio.gather(*tasks, return_exceptions=True)
        assert engine.stats().kv_blocks_used == 0 and engine._core.draft.num_blocks_used == 0


def test_the_gate_keeps_whichever_of_drafting_or_not_gave_more_tokens_per_second() -> None:
    gate = DraftGate(window=2, hold=3)
    for _ in range(2):  # with drafts: 3 tokens a step in 20 ms
        assert gate.allow()
        gate.record(0.02, verify_steps=1, accepted=2)
    for _ in range(2):  # without: 1 token in 10 ms (slower per token): drafting stays on
        assert not gate.allow()
        gate.record(0.01, verify_steps=0, accepted=0)
    assert gate.allow() and gate.num_pauses == 0
    for _ in range(3):  # held, then measured again
        gate.record(0.02, verify_steps=1, accepted=2)
    for _ in range(2):  # with drafts: 1.5 tokens in 30 ms
        assert gate.allow()
        gate.record(0.03, verify_steps=2, accepted=1)
    for _ in range(2):  # without: 1 token in 10 ms: faster, so the draft is paused for `hold` steps
        gate.record(0.01, verify_steps=0, accepted=0)
    assert not gate.allow() and gate.num_pauses == 1


async def test_a_draft_that_does_not_pay_is_paused_and_the_output_is_unchanged(
        tiny_llama: Path, drafts: dict[str, Path]) -> None:
    greedy = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    async with tiny_engine(tiny_llama) as plain:
        expected = (await plain.generate(PROMPTS[2], greedy)).token_ids
    wrong = {**_draft(drafts["llama"]), "auto_disable": True}  # other weights: almost nothing kept
    async with tiny_engine(tiny_llama, speculative_config=wrong) as spec:
        out = await spec.generate(PROMPTS[2], greedy)
        gate = spec._core.draft_gate
        assert gate is not None and gate.num_pauses >= 1
        assert out.token_ids == expected
        assert out.metrics.spec_verify_steps < 40  # paused after its first window, not drafting every step
