"""Speculative decoding (n-gram prompt lookup): the same output as without it, fewer steps."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from asyncpage import AsyncEngine, InvalidRequestError, SamplingParams
from asyncpage.bench.spec import RECORD, SCHEMA
from asyncpage.decoding.sampling import SampleSpec
from asyncpage.decoding.speculative import SpecState, SpeculativeConfig, Verify, verify
from tests.conftest import ARCHS
from tests.test_engine_lifecycle import PROMPTS, _idle, tiny_engine

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
TINY_SCHEMA = {"type": "object", "required": ["a", "b"], "additionalProperties": False,
               "properties": {"a": {"type": "string", "maxLength": 24},
                              "b": {"type": "array", "items": {"type": "integer"}, "maxItems": 6}}}


def _workload() -> list[tuple[str, SamplingParams]]:
    """Greedy, seeded sampling (temperature, top-k, top-p, min-p), penalties, a schema, stops, n=2."""
    jobs: list[tuple[str, SamplingParams]] = []
    for i, p in enumerate(PROMPTS[:6]):
        jobs += [(p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)),
                 (p, SamplingParams(max_tokens=40, temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, seed=i)),
                 (p, SamplingParams(max_tokens=40, temperature=0, repetition_penalty=1.2, presence_penalty=0.5,
                                    ignore_eos=True)),
                 (p, SamplingParams(max_tokens=48, temperature=0, json_schema=TINY_SCHEMA, max_number_digits=4))]
    jobs.append((PROMPTS[3], SamplingParams(max_tokens=30, temperature=0.8, seed=7, n=2)))
    return jobs


async def _outputs(engine: AsyncEngine, jobs: list[tuple[str, SamplingParams]], together: bool) -> list[Any]:
    if together:
        outs = await asyncio.gather(*(engine.generate(p, q) for p, q in jobs))
    else:
        outs = [await engine.generate(p, q) for p, q in jobs]
    return [[(c.token_ids, c.finish_reason) for c in o.choices] for o in outs]


@pytest.mark.parametrize("arch", ARCHS)
async def test_outputs_are_identical_with_speculation_for_every_architecture(
        arch: str, tiny_models: dict[str, tuple[Path, Any]]) -> None:
    path = tiny_models[arch][0]
    jobs = _workload()
    async with tiny_engine(path) as plain:
        expected = await _outputs(plain, jobs, together=True)
    # Alone, then all at once in a pool small enough to preempt, the pool checked after every step.
    async with tiny_engine(path, speculative_config=NGRAM) as spec:
        assert await _outputs(spec, jobs[:8], together=False) == expected[:8]
        st = spec.stats()
        assert st.spec_accepted_tokens > 0 and st.spec_proposed_tokens >= st.spec_accepted_tokens
    async with tiny_engine(path, speculative_config=NGRAM, num_kv_blocks=48, debug_checks=True) as spec:
        assert await _outputs(spec, jobs, together=True) == expected
        assert spec.stats().num_preemptions > 0
        await _idle(spec)


@pytest.mark.heavy  # `make test-heavy`: the default model end to end, slow on 2 cores
@pytest.mark.slow
async def test_default_model_with_speculation_matches_transformers_and_copies_faster(
        default_engine: AsyncEngine, reference: dict[str, Any]) -> None:
    spec = default_engine.clone(speculative_config={"method": "ngram"})
    cases = reference["cases"]
    prompts = [c["prompt"] if c["prompt"] is not None else c["prompt_token_ids"] for c in cases]
    greedy = SamplingParams(max_tokens=reference["new_tokens"], temperature=0, ignore_eos=True)
    extract = SamplingParams(max_tokens=96, temperature=0, json_schema=SCHEMA)
    prompt = RECORD + "\n\nThe order above as JSON:\n"
    plain = await default_engine.generate(prompt, extract)
    async with spec:
        outs = await asyncio.gather(*(spec.generate(p, greedy) for p in prompts))
        alone = await spec.generate(prompts[2], greedy)
        fast = await spec.generate(prompt, extract)
        st = spec.stats()
    for case, out in zip(cases, outs, strict=True):
        assert out.token_ids == case["greedy_token_ids"], case["prompt"]
    assert alone.token_ids == cases[2]["greedy_token_ids"]
    assert fast.token_ids == plain.token_ids
    if fast.finish_reason == "stop":
        jsonschema.validate(json.loads(fast.text), SCHEMA)
    # Copying the record's values: most drafts are kept, several tokens per step.
    m = fast.metrics
    assert m.spec_accepted_tokens >= len(fast.token_ids) // 3, m
    assert m.spec_accepted_tokens / m.spec_verify_steps > 1  # the mean kept run
    assert st.spec_accepted_tokens > 0 and st.kv_blocks_used == 0


async def test_guided_output_with_speculation_is_valid_and_identical(tiny_llama: Path) -> None:
    schema = {"type": "object", "required": ["name", "tags"], "additionalProperties": False,
              "properties": {"name": {"type": "string", "maxLength": 40},
                             "tags": {"type": "array", "items": {"enum": ["x", "yy", "zzz"]}, "maxItems": 8}}}
    params = [SamplingParams(max_tokens=64, temperature=0, json_schema=schema),
              SamplingParams(max_tokens=64, temperature=0.7, seed=3, json_schema=schema),
              SamplingParams(max_tokens=20, temperature=0, json_schema=schema),  # closed by the budget
              SamplingParams(max_tokens=40, temperature=0, regex=r"(ab|cd)+ [0-9]{2,5}")]
    jobs = [(p, q) for p in PROMPTS[:4] for q in params]
    async with tiny_engine(tiny_llama) as plain:
        expected = await _outputs(plain, jobs, together=True)
    async with tiny_engine(tiny_llama, speculative_config=NGRAM) as spec:
        outs = await asyncio.gather(*(spec.generate(p, q) for p, q in jobs))
    assert [[(c.token_ids, c.finish_reason) for c in o.choices] for o in outs] == expected
    for (_, q), o in zip(jobs, outs, strict=True):
        if q.json_schema is not None:
            jsonschema.validate(json.loads(o.text), schema)


async def test_stops_inside_an_accepted_run_end_the_sequence_at_the_right_token(tiny_llama: Path) -> None:
    async with tiny_engine(tiny_llama) as plain:
        free = await plain.generate(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        ids, text = free.token_ids, free.text
        jobs = [(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0, stop=[text[12:15]])),
                (PROMPTS[0], SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[ids[17]])),
                (PROMPTS[0], SamplingParams(max_tokens=23, temperature=0, ignore_eos=True)),
                (PROMPTS[0], SamplingParams(max_tokens=40, temperature=0, stop=[text[20:22]], ignore_eos=True))]
        expected = [await plain.generate(p, q) for p, q in jobs]
    async with tiny_engine(tiny_llama, speculative_config=NGRAM) as spec:
        got = [await spec.generate(p, q) for p, q in jobs]
        assert spec.stats().spec_accepted_tokens > 0
    for e, g in zip(expected, got, strict=True):
        assert (g.token_ids, g.text, g.finish_reason) == (e.token_ids, e.text, e.finish_reason)


async def test_many_rejections_leak_no_block(tiny_llama: Path) -> None:
    hot = SamplingParams(max_tokens=48, temperature=1.5, ignore_eos=True)  # drafts mostly rejected
    async with tiny_engine(tiny_llama, speculative_config={"method": "ngram", "num_speculative_tokens": 6,
                                                          "prompt_lookup_min": 1},
                           num_kv_blocks=40, debug_checks=True, max_num_batched_tokens=24) as engine:
        await asyncio.gather(*(engine.generate(p, hot) for p in PROMPTS[:10]))
        await _idle(engine)
        st = engine.stats()
        assert engine._core.check_invariants()
    assert st.spec_proposed_tokens > 2 * st.spec_accepted_tokens
    assert st.kv_blocks_used == 0 and st.num_running == 0


def _target(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a sampler must draw from: softmax(logits / T), then top-k, then top-p over
    the top-k renormalized (transformers' and vLLM's order), written out independently here."""
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    kept = order[: p.top_k] if p.top_k > 0 else order
    q = probs[kept] / probs[kept].sum()
    mass_before = q.cumsum(0) - q
    keep[kept[mass_before < p.top_p]] = True
    out = probs * keep
    return out / out.sum()


def _chi2_ok(counts: torch.Tensor, expected: torch.Tensor) -> bool:
    """Pearson's chi-square at p = 0.001 (Wilson-Hilferty approximation of the quantile)."""
    n = counts.sum()
    mask = expected > 0
    e = expected[mask] * n
    stat = float(((counts[mask] - e) ** 2 / e).sum())
    assert counts[~mask].sum() == 0, "a token outside the target's support was emitted"
    df = int(mask.sum()) - 1
    crit = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    return stat < crit


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
                                    SamplingParams(temperature=1.3, top_p=0.8)], ids=["temperature", "top_k", "top_p"])
def test_speculated_tokens_follow_the_target_distribution(params: SamplingParams) -> None:
    vocab, draws = 12, 6000
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=gen) * 1.5
    targets = [_target(logits[i], params) for i in range(3)]
    # Drafts the target finds likely, so that later positions are reached often.
    draft = [int(targets[0].argmax()), int(targets[1].argmax())]
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for seed in range(draws):
        g = torch.Generator().manual_seed(seed)
        spec = SampleSpec(seq_id=1, params=params, generator=g)
        out = verify(Verify(spec, draft, [0, 1, 2], frozenset()), logits, None)
        first[out.tokens[0]] += 1
        if out.tokens[0] == draft[0]:
            second[out.tokens[1]] += 1  # the position after a kept draft: sampled from row 1
        kept = 0
        while kept < min(len(draft), len(out.tokens)) and out.tokens[kept] == draft[kept]:
            kept += 1
        assert out.accepted == kept
    assert _chi2_ok(first, targets[0])
    assert second.sum() > 500 and _chi2_ok(second, targets[1])


def test_ngram_proposer_continues_the_latest_earlier_occurrence() -> None:
    state = SpecState(SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3))
    tokens = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 8, 4, 5, 6]
    assert state.propose(tokens, 10) == [7, 8, 4]  # "5 6" last seen before the end at index 7
    assert state.propose([*tokens, 7], 10) == [8, 4, 5]  # "5 6 7": the longest suffix wins
    assert state.propose([*tokens, 7, 99], 10) == []  # nothing ends in "7 99"
    fresh = SpecState(SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3))
    assert fresh.propose([*tokens, 7], 2) == [8, 4]  # never more than the room


def test_bad_speculative_configs_are_refused_by_name() -> None:
    for bad in [{"method": "medusa"}, {"method": "ngram", "num_speculative_tokens": 0},
                {"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, {"method": "ngram", "k": 3},
                "ngram"]:
        with pytest.raises(InvalidRequestError) as err:
            SpeculativeConfig.parse(bad)
        assert err.value.field == "speculative_config"


def test_a_speculative_config_object_with_bad_fields_is_refused_not_run_as_ngram() -> None:
    # A struct built directly skips msgspec's checks: method="draft" ran as n-gram, min 0 matched anything.
    for bad in [SpeculativeConfig(method="draft"), SpeculativeConfig(method="ngram", prompt_lookup_min=0),
                SpeculativeConfig(method="ngram", num_speculative_tokens="4")]:  # type: ignore[arg-type]
        with pytest.raises(InvalidRequestError) as err:
            SpeculativeConfig.parse(bad)
        assert err.value.field == "speculative_config"
    good = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert SpeculativeConfig.parse(good) == good


def test_bench_speculative_refuses_a_bad_setting_before_loading_the_model() -> None:
    from asyncpage.decoding.speculative import cli_config as parse

    assert parse("ngram:5") == {"method": "ngram", "num_speculative_tokens": 5}
    for bad in ["ngram:x", "ngram:0", "medusa", "ngram:-2"]:  # "ngram:x" was a bare ValueError traceback
        with pytest.raises(InvalidRequestError):
            parse(bad)


async def test_the_speculation_bench_reports_each_stream_from_runs_taking_turns(tiny_llama: Path) -> None:
    from asyncpage.bench.spec import format_rows, speculative_figures

    engine = tiny_engine(tiny_llama, num_kv_blocks=512, max_num_batched_tokens=256)
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    streams = {"extraction": ("Name: Ann Lee\nAs JSON: ", SamplingParams(max_tokens=24, temperature=0,
                                                                          json_schema=schema)),
               "free text": ("the cat sat on the mat, the cat sat", SamplingParams(max_tokens=24, temperature=0))}
    rows = await speculative_figures(engine, {"method": "ngram"}, num_requests=0, repeat=2, streams=streams)
    assert [r["workload"] for r in rows] == ["extraction (1 stream)", "free text (1 stream)"]
    for r in rows:  # greedy: every run of a stream, on either engine, the same tokens
        assert r["identical"] is True and r["speedup"] > 0 and r["decode_speedup"] is not None
    assert "decode" in format_rows(rows, {"method": "ngram"})


def test_extract_cli_with_speculation_writes_the_same_lines(tiny_llama: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from asyncpage.cli import main as cli

    records = [{"id": i, "text": f"Ticket {i}: the printer on floor {i} jams, the printer on floor {i} jams again"}
               for i in range(6)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "schema.json").write_text(json.dumps(TINY_SCHEMA))
    args = ["extract", "--schema", str(tmp_path / "schema.json"), "--input", str(tmp_path / "in.jsonl"),
            "--model", str(tiny_llama), "--dtype", "float32", "--max-tokens", "40", "--no-progress",
            "--prompt", "{text}\\nJSON: "]
    assert cli([*args, "--output", str(tmp_path / "plain.jsonl")]) == 0
    assert cli([*args, "--output", str(tmp_path / "spec.jsonl"), "--speculative", "ngram:4"]) == 0
    lines = [sorted((tmp_path / f).read_text().splitlines()) for f in ("plain.jsonl", "spec.jsonl")]
    assert lines[0] == lines[1] and len(lines[0]) == 6
    # A bad setting is refused by name before any model loads.
    assert cli([*args, "--output", str(tmp_path / "x.jsonl"), "--speculative", "ngram:x"]) == 2
    assert "speculative" in capsys.readouterr().err


def test_drafts_are_capped_to_the_rows_the_block_kernels_take_so_greedy_output_stays_the_same() -> None:
    from asyncpage.core.loading import verified_in_kernels
    from asyncpage.decoding.speculative import SpeculativeConfig

    k12 = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 12})
    assert k12 is not None
    capped = verified_in_kernels(k12, 8)  # the portable form's 8 rows: a verify of 8 rows at most
    assert capped is not None and capped.num_speculative_tokens == 7 and capped.method == "ngram"
    for rows in (0, 1 << 62, 48):  # no block kernels (torch), no bound, or room for 13 rows: as asked
        assert verified_in_kernels(k12, rows) is k12
    assert verified_in_kernels(None, 8) is None
