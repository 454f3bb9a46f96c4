"""Tool calls in each family's own format, by grammar: on tiny random models of each architecture
(tokenizers trained in the test, family-style templates from chat_templates.py) the emitted text is
exactly the family's format and parses back to the same calls; model-free checks of the grammars
(lazy auto mode, reasoning, response_format with tools) and of the streaming parser."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from asyncpage import AsyncEngine, SamplingParams
from asyncpage.chat import FORMATS, GENERIC, HERMES, LLAMA3, MISTRAL, prepare
from asyncpage.chat.grammar import TurnSpec, build
from asyncpage.chat.messages import parse_tools
from asyncpage.chat.parse import parse
from tests import chat_templates

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,4}$"},
                                           "unit": {"enum": ["c", "f"]}},
          "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description": "time",
                                           "parameters": {"type": "object", "properties": {"n": {"type": "integer",
                                                          "minimum": 0, "maximum": 9}}, "required": ["n"]}}}]
# The tiny models hold 512 tokens and their tokenizers spell JSON almost by the character: small tools.
SMALL = {"type": "object",
         "properties": {"c": {"type": "string", "pattern": "^[a-z]{1,4}$"}, "u": {"enum": ["c", "f"]}},
         "required": ["c", "u"], "additionalProperties": False}
TINY_TOOLS = [{"type": "function", "function": {"name": "w", "parameters": SMALL}},
              {"type": "function", "function": {"name": "t", "parameters": {"type": "object", "properties": {
                  "n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
                  "additionalProperties": False}}}]
FAMILIES = [("qwen2", chat_templates.HERMES, HERMES), ("llama", chat_templates.LLAMA3, LLAMA3),
            ("mistral", chat_templates.MISTRAL, MISTRAL), ("gemma3", None, GENERIC)]


@pytest.fixture(scope="module")
def family_dirs(tiny_models: dict[str, tuple[Path, Any]], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat")
    out = {}
    for arch, template, _ in FAMILIES:
        d = root / arch
        shutil.copytree(tiny_models[arch][0], d)
        if template is not None:
            (d / "chat_template.jinja").write_text(template)
        out[arch] = d
    return out


@pytest.mark.parametrize(("arch", "fmt"), [(a, f) for a, _, f in FAMILIES], ids=[a for a, _, _ in FAMILIES])
async def test_tiny_model_emits_its_family_format_and_it_parses_back_exactly(
        family_dirs: dict[str, Path], arch: str, fmt: Any) -> None:
    engine = AsyncEngine.from_pretrained(family_dirs[arch], dtype="float32", num_kv_blocks=64)
    msgs = [{"role": "user", "content": "Weather?"}]
    async with engine:
        for seed in range(3):
            turn = await prepare(engine, msgs, tools=TINY_TOOLS, tool_choice="required", parallel_tool_calls=False,
                                 params=SamplingParams(max_tokens=90, seed=seed))
            assert turn.spec.fmt is fmt
            out = await engine.generate(turn.prompt, turn.params)
            assert out.finish_reason == "stop", out.text
            parsed = turn.parse(out.text, final=True)
            assert len(parsed.calls) == 1 and parsed.calls[0].complete and parsed.content == ""
            call = parsed.calls[0]
            assert out.text == fmt.render([(call.name, call.arguments)])  # the family's text, byte for byte
            schema = SMALL if call.name == "w" else TINY_TOOLS[1]["function"]["parameters"]
            jsonschema.validate(json.loads(call.arguments), schema)
        res = await engine.chat(msgs, tools=TINY_TOOLS, tool_choice={"type": "function", "function": {"name": "t"}},
                                params=SamplingParams(max_tokens=90, seed=7), parallel_tool_calls=False)
        assert res.finish_reason == "tool_calls" and [c.name for c in res.tool_calls] == ["t"]
        if fmt is MISTRAL:  # its templates refuse, on the next turn, any id but 9 alphanumerics
            assert len(res.tool_calls[0].id) == 9 and res.tool_calls[0].id.isalnum()
        deltas = [d async for d in engine.chat_stream(msgs, tools=TINY_TOOLS, tool_choice="required",
                                                      parallel_tool_calls=False,
                                                      params=SamplingParams(max_tokens=90, seed=1))]
        first = [d.tool_call for d in deltas if d.tool_call is not None]
        assert first[0].id and first[0].name and all(f.index == 0 for f in first)
        assert all(f.id is None and f.name is None for f in first[1:])
        jsonschema.validate(json.loads("".join(f.arguments for f in first)), SMALL if first[0].name == "w"
                            else TINY_TOOLS[1]["function"]["parameters"])
        assert deltas[-1].finish_reason == "tool_calls" and deltas[-1].usage is not None
        assert engine.stats().kv_blocks_used == 0


def _accepts(grammar: str, text: str, tok: Any) -> bool:
    import llguidance.hf
    from llguidance import LLMatcher

    lt = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=tok.eos_token_id)
    m = LLMatcher(lt, LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not m.is_error(), m.get_error()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return all(m.consume_token(t) for t in ids) and m.is_accepting()


@pytest.fixture(scope="module")
def tok(tiny_models: dict[str, tuple[Path, Any]]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models["llama"][0])


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_grammars_accept_the_format_and_refuse_invalid_arguments(tok: Any, name: str) -> None:
    fmt = FORMATS[name]
    tools = parse_tools(TOOLS)
    good = fmt.render([("get_weather", '{"city": "oslo", "unit": "c"}'), ("get_time", '{"n": 3}')])
    one = fmt.render([("get_weather", '{"city": "oslo", "unit": "c"}')])
    bad_args = fmt.render([("get_weather", '{"city": "Oslo", "unit": "c"}')])  # the pattern says lower case
    spec = TurnSpec(fmt, tools, "required", True, None, False, False)
    g = build(spec, tok)
    assert g is not None and _accepts(g, good, tok) and not _accepts(g, bad_args, tok)
    single = build(TurnSpec(fmt, tools, "required", False, None, False, False), tok)
    assert single is not None and _accepts(single, one, tok) and not _accepts(single, good, tok)
    named = build(TurnSpec(fmt, tools, "get_time", True, None, False, False), tok)
    assert named is not None and not _accepts(named, one, tok)
    auto = build(TurnSpec(fmt, tools, "auto", True, None, False, False), tok)
    assert auto is not None and _accepts(auto, "It is sunny.", tok) and _accepts(auto, good, tok)
    if not fmt.at_start:
        assert _accepts(auto, "Let me check. " + one, tok) and not _accepts(auto, "Let me check. " + bad_args, tok)
    assert build(TurnSpec(fmt, tools, "none", True, None, False, False), tok) is None
    combined = build(TurnSpec(fmt, tools, "auto", True, {"type": "object", "properties": {"a": {"type": "integer"}},
                                                         "required": ["a"]}, False, False), tok)
    assert combined is not None and _accepts(combined, '{"a": 1}', tok) and _accepts(combined, one, tok)
    assert not _accepts(combined, "free text", tok)
    # json_object with tools: any object is an answer, but one shaped like a call must be a valid call.
    loose = build(TurnSpec(fmt, tools, "auto", False, {"type": "object"}, False, False), tok)
    assert loose is not None and _accepts(loose, '{"b": [1]}', tok) and _accepts(loose, one, tok)
    if fmt.at_start:
        assert not _accepts(loose, bad_args, tok) and not _accepts(loose, good, tok)  # bad; or two calls
        assert not _accepts(loose, fmt.render([("nosuch", '{"x": 1}')]), tok)
    thinking = build(TurnSpec(fmt, tools, "required", True, None, True, False), tok)
    assert thinking is not None and _accepts(thinking, "<think>hmm</think>\n\n" + one, tok)
    assert _accepts(thinking, one, tok)


@pytest.mark.parametrize("fmt", [GENERIC, LLAMA3], ids=["generic", "llama3"])
def test_a_tool_and_the_answer_defining_the_same_name_keep_their_own_definitions(tok: Any, fmt: Any) -> None:
    # Both schemas define "Item", differently: each `$ref` must still reach its own schema's one.
    tool = {"type": "object", "properties": {"x": {"$ref": "#/$defs/Item"}, "self": {"$ref": "#"}},
            "required": ["x"], "additionalProperties": False, "$defs": {"Item": {"type": "integer"}}}
    answer = {"type": "object", "properties": {"y": {"$ref": "#/definitions/Item"}}, "required": ["y"],
              "definitions": {"Item": {"type": "string"}}}
    g = build(TurnSpec(fmt, parse_tools([{"type": "function", "function": {"name": "f", "parameters": tool}}]),
                       "auto", True, answer, False, False), tok)
    assert g is not None
    assert _accepts(g, fmt.render([("f", '{"x": 1}')]), tok)
    assert _accepts(g, fmt.render([("f", '{"x": 1, "self": {"x": 2}}')]), tok)  # "#" is the tool's own root
    assert not _accepts(g, fmt.render([("f", '{"x": "a"}')]), tok)
    assert not _accepts(g, fmt.render([("f", '{"x": 1, "self": {"y": "s"}}')]), tok)
    assert _accepts(g, '{"y": "s"}', tok) and not _accepts(g, '{"y": 1}', tok)


@pytest.mark.parametrize("lead", ["", "\n\n"])
def test_streaming_parser_is_prefix_stable_and_exact(lead: str) -> None:
    for fmt in FORMATS.values():
        calls = [("get_weather", '{"city": "oslo", "unit": "c"}'), ("get_time", '{"n": 3}')]
        text = (lead + "<think>plan\n</think>\n\n" + ("Sure. " if not fmt.at_start else "") + fmt.render(calls))
        seen: list[Any] = []
        for i in range(1, len(text) + 1):
            p = parse(text[:i], fmt, calls_allowed=True, reasoning=True, in_reasoning=False, final=False)
            if seen:  # nothing returned earlier is ever taken back
                prev = seen[-1]
                assert p.reasoning.startswith(prev.reasoning) and p.content.startswith(prev.content)
                for a, b in zip(prev.calls, p.calls, strict=False):
                    assert b.name == a.name and b.arguments.startswith(a.arguments)
            seen.append(p)
        p = parse(text, fmt, calls_allowed=True, reasoning=True, in_reasoning=False, final=True)
        assert p.reasoning == "plan" and [(c.name, c.arguments) for c in p.calls] == calls
        assert all(c.complete for c in p.calls)


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
def test_a_call_cut_before_its_name_is_not_returned_as_content(fmt: Any) -> None:
    lead = "" if fmt.at_start else "Checking. "
    for cut in (fmt.begin + '{"', fmt.begin + '{"na', fmt.head + "get_wea"):
        p = parse(lead + cut, fmt, calls_allowed=True, reasoning=False, in_reasoning=False, final=True)
        assert p.content == lead and p.calls == [], (cut, p)


async def _stream_vs_chat(engine: AsyncEngine, msgs: list[dict[str, Any]], **kw: Any) -> tuple[Any, list[Any]]:
    return await engine.chat(msgs, **kw), [d async for d in engine.chat_stream(msgs, **kw)]


async def test_a_forced_call_cut_by_max_tokens_is_never_returned_as_content(family_dirs: dict[str, Path]) -> None:
    engine = AsyncEngine.from_pretrained(family_dirs["qwen2"], dtype="float32", num_kv_blocks=64)
    msgs = [{"role": "user", "content": "Weather?"}]
    async with engine:
        for choice in ("required", {"type": "function", "function": {"name": "t"}}):
            for k in (1, 2, 3, 5):  # cut inside the "<tool_call>" marker (spelled almost by the character)
                res, deltas = await _stream_vs_chat(engine, msgs, tools=TINY_TOOLS, tool_choice=choice,
                                                    params=SamplingParams(max_tokens=k, seed=0))
                assert not res.content and not res.tool_calls and res.finish_reason == "length", (k, res)
                assert not any(d.content or d.tool_call for d in deltas), (k, deltas)


async def test_a_streamed_call_cut_by_max_tokens_is_dropped_as_chat_drops_it(family_dirs: dict[str, Path]) -> None:
    engine = AsyncEngine.from_pretrained(family_dirs["llama"], dtype="float32", num_kv_blocks=64)
    msgs = [{"role": "user", "content": "Weather?"}]
    async with engine:
        for k in (16, 20, 24):  # past the call's name, inside its arguments
            params = SamplingParams(max_tokens=k, seed=0, budget_close=False)
            res, deltas = await _stream_vs_chat(engine, msgs, tools=TINY_TOOLS, tool_choice="required", params=params)
            assert not res.tool_calls and res.finish_reason == "length", (k, res)
            assert [d.tool_call for d in deltas if d.tool_call] == [] and deltas[-1].finish_reason == "length"
        # A call that closes goes out whole, the same call chat() returns.
        params = SamplingParams(max_tokens=90, seed=0)
        res, deltas = await _stream_vs_chat(engine, msgs, tools=TINY_TOOLS, tool_choice="required", params=params,
                                            parallel_tool_calls=False)
        streamed = [d.tool_call for d in deltas if d.tool_call]
        assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in res.tool_calls]
        assert deltas[-1].finish_reason == res.finish_reason == "tool_calls"


async def test_a_whitespace_answer_without_tools_streams_as_it_is_generated(family_dirs: dict[str, Path]) -> None:
    engine = AsyncEngine.from_pretrained(family_dirs["qwen2"], dtype="float32", num_kv_blocks=64)
    msgs = [{"role": "user", "content": "Say nothing."}]
    async with engine:
        params = SamplingParams(max_tokens=24, seed=0, regex=r"[ \n]+")
        res, deltas = await _stream_vs_chat(engine, msgs, params=params)
    content = [d.content for d in deltas if d.content]
    assert res.content and not res.content.strip() and "".join(content) == res.content
    assert len(content) > 1, content  # not all held back to the end
