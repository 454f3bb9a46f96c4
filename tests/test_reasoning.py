"""Reasoning models: the thinking section split from the answer, bounded by max_reasoning_tokens /
reasoning_effort (the engine writes the closing marker at the budget), and the answer's grammar
(response_format, tools) applied only after it. On tiny Qwen3 models (tests/reasoning_models.py):
one that never closes its thinking (the budget path), one that closes it by itself with probability
1/4 a token (steered weights), and one whose markers are plain text its tokenizer spells piece by
piece; the templates open the answer with `<think>` as DeepSeek-R1's and Qwen3-Thinking's do."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from asyncpage import AsyncEngine, SamplingParams
from asyncpage.chat import EFFORT_BUDGETS, prepare
from asyncpage.chat.reasoning import THINK, ReasoningMarkers, detect
from asyncpage.errors import InvalidRequestError
from tests import reasoning_models

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "b": {"enum": ["x", "y"]}}, "required": ["a", "b"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
TOOLS = [{"type": "function", "function": {"name": "w", "parameters": {
    "type": "object", "properties": {"c": {"type": "string", "pattern": "^[a-z]{1,4}$"}}, "required": ["c"]}}}]
MSGS = [{"role": "user", "content": "Think, then answer."}]


@pytest.fixture(scope="module")
def models(tiny_models: dict[str, tuple[Path, Any]], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root, src = tmp_path_factory.mktemp("reasoning"), tiny_models["qwen3"][0]
    T = reasoning_models
    return {
        "never": T.build(src, root / "never", template=T.THINKING_OPENED, close_probability=0.0),
        "closes": T.build(src, root / "closes", template=T.THINKING_OPENED, close_probability=0.25),
        "text": T.build(src, root / "text", template=T.PLAIN, marker_tokens=False),
        "optional": T.build(src, root / "optional", template=T.THINKING_OPTIONAL),
        "bare": T.build(src, root / "bare", template=None),
    }


def _engine(path: Path) -> AsyncEngine:
    return AsyncEngine.from_pretrained(path, dtype="float32", num_kv_blocks=96)


def _answer(res: Any) -> dict[str, Any]:
    value = json.loads(res.content)
    jsonschema.validate(value, SCHEMA)
    return value


@pytest.mark.parametrize("model", ["never", "text"])
async def test_a_budget_closes_the_thinking_and_the_answer_follows_its_schema(models: dict[str, Path],
                                                                             model: str) -> None:
    engine = _engine(models[model])
    async with engine:
        for seed in range(3):
            res = await engine.chat(MSGS, response_format=FORMAT, max_reasoning_tokens=24,
                                    params=SamplingParams(max_tokens=120, seed=seed))
            assert res.reasoning and res.finish_reason == "stop", res
            # The model never closes by itself: the engine closed it at exactly the budget.
            assert res.usage.reasoning_tokens == 24
            assert "</think>" not in res.reasoning and "<think>" not in res.content
            _answer(res)
        assert engine.stats().kv_blocks_used == 0


async def test_a_model_that_closes_its_thinking_itself_is_not_cut(models: dict[str, Path]) -> None:
    engine = _engine(models["closes"])
    async with engine:
        lengths = []
        for seed in range(8):
            res = await engine.chat(MSGS, response_format=FORMAT, max_reasoning_tokens=48,
                                    params=SamplingParams(max_tokens=160, seed=seed))
            _answer(res)
            # Closed by the model well before the budget (its chance to keep going 48 tokens is 1e-6).
            assert res.usage.reasoning_tokens < 48, res
            assert (res.reasoning is None) == (res.usage.reasoning_tokens == 0)
            lengths.append(res.usage.reasoning_tokens)
        assert sum(n > 0 for n in lengths) >= 3, lengths  # thought a while, then closed


async def test_the_second_phase_reuses_the_thinkings_blocks(models: dict[str, Path]) -> None:
    engine = _engine(models["never"])
    async with engine:
        before = engine.stats().prefix_cache_hit_tokens
        res = await engine.chat(MSGS, response_format=FORMAT, max_reasoning_tokens=40,
                                params=SamplingParams(max_tokens=120, seed=0))
        hit = engine.stats().prefix_cache_hit_tokens - before
        # The answer's request found the prompt and the thinking (all full blocks of both) cached.
        full = (res.usage.prompt_tokens + 40) // 16 * 16
        assert hit >= full - 16, (hit, res.usage)
        _answer(res)


async def test_tool_calls_follow_the_thinking_and_keep_their_schema(models: dict[str, Path]) -> None:
    engine = _engine(models["never"])
    async with engine:
        for seed in range(2):
            res = await engine.chat(MSGS, tools=TOOLS, tool_choice="required", max_reasoning_tokens=12,
                                    parallel_tool_calls=False, params=SamplingParams(max_tokens=160, seed=seed))
            assert res.reasoning and res.usage.reasoning_tokens == 12
            assert res.finish_reason == "tool_calls" and [c.name for c in res.tool_calls] == ["w"]
            jsonschema.validate(json.loads(res.tool_calls[0].arguments), TOOLS[0]["function"]["parameters"])
            assert res.content is None


async def test_streamed_reasoning_and_content_are_the_turns_own(models: dict[str, Path]) -> None:
    engine = _engine(models["never"])
    async with engine:
        kw: dict[str, Any] = dict(response_format=FORMAT, max_reasoning_tokens=16,
                                  params=SamplingParams(max_tokens=100, seed=3))
        res = await engine.chat(MSGS, **kw)
        deltas = [d async for d in engine.chat_stream(MSGS, **kw)]
        thought = [d.reasoning for d in deltas if d.reasoning]
        said = [d.content for d in deltas if d.content]
        assert "".join(thought) == res.reasoning and "".join(said) == res.content
        first_content = next(i for i, d in enumerate(deltas) if d.content)
        assert all(not d.reasoning for d in deltas[first_content:])  # reasoning first, then the answer
        usage = deltas[-1].usage
        assert deltas[-1].finish_reason == "stop" and usage is not None
        assert (usage.completion_tokens, usage.reasoning_tokens) == (res.usage.completion_tokens, 16)
        assert engine.stats().kv_blocks_used == 0


async def test_reasoning_effort_sets_the_budget_and_none_skips_the_thinking(models: dict[str, Path]) -> None:
    engine = _engine(models["never"])
    async with engine:
        turn = await prepare(engine, MSGS, reasoning_effort="low", params=SamplingParams(max_tokens=4000))
        assert turn.budget is not None and turn.budget.think.max_tokens == EFFORT_BUDGETS["low"]
        turn = await prepare(engine, MSGS, reasoning_effort="high", params=SamplingParams(max_tokens=300))
        assert turn.budget is not None and turn.budget.think.max_tokens == 300  # max_tokens counts the thinking
        res = await engine.chat(MSGS, response_format=FORMAT, reasoning_effort="none",
                                params=SamplingParams(max_tokens=60, seed=0))
        assert res.reasoning is None and res.usage.reasoning_tokens == 0
        _answer(res)
        turn = await prepare(engine, MSGS, reasoning_effort="none")
        assert engine.tokenizer.decode(turn.prompt).endswith("<think>\n</think>\n\n")  # the empty section
        for bad, field in (({"max_reasoning_tokens": -1}, "max_reasoning_tokens"),
                           ({"max_reasoning_tokens": True}, "max_reasoning_tokens"),
                           ({"reasoning_effort": "extreme"}, "reasoning_effort")):
            with pytest.raises(InvalidRequestError) as info:
                await engine.chat(MSGS, **bad)
            assert info.value.field == field


async def test_without_a_budget_the_grammar_still_starts_after_the_thinking(models: dict[str, Path]) -> None:
    engine = _engine(models["closes"])
    async with engine:
        thought = 0
        for seed in range(4):
            # One request: the section is free text in the grammar, the answer's schema applies after it.
            res = await engine.chat(MSGS, response_format=FORMAT, params=SamplingParams(max_tokens=80, seed=seed))
            assert res.finish_reason == "stop" and "</think>" not in (res.reasoning or "")
            _answer(res)
            # A caller's own json_schema is the answer's too, never forced into the opened section.
            res = await engine.chat(MSGS, params=SamplingParams(max_tokens=80, seed=seed, json_schema=SCHEMA))
            _answer(res)
            thought += res.usage.reasoning_tokens
        assert thought > 0
    engine = _engine(models["never"])
    async with engine:
        # Without a budget only max_tokens bounds the thinking (OpenAI's "length"): no JSON is forced into it.
        for kw in ({"response_format": FORMAT}, {}):
            res = await engine.chat(MSGS, **kw, params=SamplingParams(  # type: ignore[arg-type]
                max_tokens=30, seed=0, json_schema=None if kw else SCHEMA))
            assert res.finish_reason == "length" and res.reasoning and not res.content
            assert res.usage.completion_tokens == 30


async def test_a_template_that_only_may_think_is_opened_for_a_budget(models: dict[str, Path]) -> None:
    engine = _engine(models["optional"])
    async with engine:
        plain = await prepare(engine, MSGS)
        assert plain.plan.markers == THINK and not plain.plan.opened and plain.budget is None
        turn = await prepare(engine, MSGS, max_reasoning_tokens=8)
        assert engine.tokenizer.decode(turn.prompt).endswith("assistant\n<think>\n")
        res = await engine.chat(MSGS, response_format=FORMAT, max_reasoning_tokens=8,
                                params=SamplingParams(max_tokens=60, seed=0))
        assert res.reasoning and res.usage.reasoning_tokens == 8
        _answer(res)


async def test_a_per_request_chat_template_and_explicit_markers(models: dict[str, Path]) -> None:
    engine = _engine(models["bare"])  # no template of its own; its vocabulary has the markers
    async with engine:
        assert detect("", engine.tokenizer) == THINK
        with pytest.raises(InvalidRequestError):
            await engine.chat(MSGS)  # no template, none given
        res = await engine.chat(MSGS, chat_template=reasoning_models.PLAIN, response_format=FORMAT,
                                max_reasoning_tokens=10, params=SamplingParams(max_tokens=60, seed=0))
        assert res.reasoning and res.usage.reasoning_tokens == 10
        _answer(res)
        # Markers named by the caller, here ones no known family uses.
        template = reasoning_models.PLAIN.replace("<think>", "[[plan]]")
        turn = await prepare(engine, MSGS, chat_template=template, reasoning_markers=("[[plan]]", "[[/plan]]"),
                             max_reasoning_tokens=6)
        assert turn.plan.markers == ReasoningMarkers("[[plan]]", "[[/plan]]") and turn.plan.opened
        assert turn.budget is not None and turn.budget.think.stop == ("[[/plan]]",)
        none = await prepare(engine, MSGS, chat_template=reasoning_models.PLAIN, reasoning_markers=False)
        assert none.plan.markers is None
        # The same through the engine's own chat() and chat_stream().
        res = await engine.chat(MSGS, chat_template=template, reasoning_markers=("[[plan]]", "[[/plan]]"),
                                max_reasoning_tokens=6, params=SamplingParams(max_tokens=30, seed=0))
        assert res.reasoning and res.usage.reasoning_tokens == 6 and "[[/plan]]" not in (res.content or "")
        streamed = [d async for d in engine.chat_stream(MSGS, chat_template=template, max_reasoning_tokens=6,
                                                        reasoning_markers=("[[plan]]", "[[/plan]]"),
                                                        params=SamplingParams(max_tokens=30, seed=0))]
        assert "".join(d.reasoning or "" for d in streamed) == res.reasoning
        plain = await engine.chat(MSGS, chat_template=reasoning_models.PLAIN, reasoning_markers=False,
                                  params=SamplingParams(max_tokens=8, seed=0))
        assert not plain.reasoning
        for bad in ("", 7, "{% for %}"):
            with pytest.raises(InvalidRequestError) as info:
                await engine.chat(MSGS, chat_template=bad)
            assert info.value.field == "chat_template"


def test_markers_are_detected_from_the_template_then_the_vocabulary() -> None:
    class Tok:
        def __init__(self, vocab: dict[str, int]) -> None:
            self.vocab = vocab

        def get_vocab(self) -> dict[str, int]:
            return self.vocab

    assert detect("{{ '<think>\\n' }}", Tok({})) == THINK
    assert detect("{{ content.split('</think>')[-1] }}", Tok({})) == THINK
    assert detect("[THINK]", Tok({})) == ReasoningMarkers("[THINK]", "[/THINK]")
    assert detect("<|START_THINKING|>", Tok({})).close == "<|END_THINKING|>"  # type: ignore[union-attr]
    assert detect("plain", Tok({"<seed:think>": 5, "</seed:think>": 6})).open == "<seed:think>"  # type: ignore[union-attr]
    assert detect("plain", Tok({"<think>": 5})) is None  # both markers, or none
