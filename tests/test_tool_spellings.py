"""Tool calls never leak as text (issue 34 item 6): under tool_choice="auto" a call written in another
of its spellings (a bare `{"name": <declared tool>, "arguments"|"parameters": ...}` object, anywhere in
the reply, or a list of them) opens the grammar like the family's own markers do, is held to the tool's
schema and comes back as a call; a reply that is not one stays content. Model-free checks of every
family's grammar and of the streaming parser, then tiny models steered (tests/steered.py) to write
each spelling themselves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from asyncpage import AsyncEngine, SamplingParams
from asyncpage.chat import FORMATS, GENERIC, HERMES, LLAMA3, MISTRAL, prepare
from asyncpage.chat.grammar import TurnSpec, build
from asyncpage.chat.messages import parse_tools
from asyncpage.chat.parse import StreamParser
from tests import chat_templates, steered

ARGS = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,4}$"}},
        "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": ARGS}},
         {"type": "function", "function": {"name": "get.time-2", "parameters": {
             "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}]
GOOD = '{"name": "get_weather", "arguments": {"city": "oslo"}}'
SPELLINGS = [GOOD, '{"name":"get_weather","arguments":{"city": "oslo"}}',
             '{"name": "get_weather", "parameters": {"city": "oslo"}}',
             ' \n{ "name" : "get.time-2" , "arguments" : {"n": 3} }',
             "Let me check.\n" + GOOD, "[" + GOOD + "]", 'Sure: [ {"name": "get.time-2", "arguments": {"n": 1}}]',
             GOOD + "\n" + '{"name": "get.time-2", "arguments": {"n": 2}}', "[" + GOOD + ", " + GOOD + "]"]
CONTENT = ["It is sunny.", '{"name": "Bob"}', '{"city": "x"}', "[1] a note", '[{"a": 1}]', "{", "",
           '{"name": "get_weatherman", "arguments": 1}']


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
def test_every_family_opens_calls_on_their_bare_spellings(tok: Any, name: str) -> None:
    fmt = FORMATS[name]
    g = build(TurnSpec(fmt, parse_tools(TOOLS), "auto", True, None, False, False), tok)
    assert g is not None
    for text in SPELLINGS:
        assert _accepts(g, text, tok), text
    for text in CONTENT:
        assert _accepts(g, text, tok), text
    assert _accepts(g, fmt.render([("get_weather", '{"city": "oslo"}')]), tok)  # the family's own spelling
    # Once a head names a tool, the rest is that tool's: bad arguments, trailing text, unknown keys refused.
    for text in ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', GOOD + " and more",
                 'Ok {"name": "get_weather", "arguments": {"town": "oslo"}}', '{"name": "get_weather"}',
                 '[{"name": "get_weather", "arguments": {"city": "OSLO"}}]'):
        assert not _accepts(g, text, tok), text
    single = build(TurnSpec(fmt, parse_tools(TOOLS), "auto", False, None, False, False), tok)
    assert single is not None and _accepts(single, GOOD, tok) and not _accepts(single, SPELLINGS[7], tok)
    # With a response_format the answer's own grammar decides, as before (no bare spelling is free text).
    with_answer = TurnSpec(fmt, parse_tools(TOOLS), "auto", True, {"type": "object"}, False, False)
    assert not with_answer.spelled


def _read(fmt: Any, text: str, step: int) -> StreamParser:
    p = StreamParser(fmt, calls_allowed=True, reasoning=False, in_reasoning=False,
                     names=frozenset(["get_weather", "get.time-2"]))
    seen = ""
    for i in range(0, len(text), step):
        p.feed(text[i:i + step], i + step >= len(text))
        now = p.text[p.content[0]:p.content[1]]
        assert now.startswith(seen), (text, now, seen)  # nothing shown is taken back
        seen = now
    if not text:
        p.feed("", True)
    return p


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL, GENERIC], ids=lambda f: f.name)
@pytest.mark.parametrize("step", [1, 3, 50])
def test_the_parser_reads_bare_spellings_as_calls_and_the_rest_as_content(fmt: Any, step: int) -> None:
    want = {GOOD: [("get_weather", '{"city": "oslo"}')], SPELLINGS[3]: [("get.time-2", '{"n": 3}')],
            SPELLINGS[4]: [("get_weather", '{"city": "oslo"}')], SPELLINGS[6]: [("get.time-2", '{"n": 1}')],
            SPELLINGS[7]: [("get_weather", '{"city": "oslo"}'), ("get.time-2", '{"n": 2}')],
            SPELLINGS[8]: [("get_weather", '{"city": "oslo"}')] * 2}
    for text, calls in want.items():
        p = _read(fmt, text, step)
        assert [(c.name, c.arguments) for c in p.calls] == calls, text
        content = p.text[p.content[0]:p.content[1]]
        assert "name" not in content and content.strip() in ("", "Let me check.", "Sure:"), (text, content)
    for text in CONTENT:
        p = _read(fmt, text, step)
        assert p.calls == [] and not p.has_calls and p.text[p.content[0]:p.content[1]] == text, text
    own = fmt.render([("get_weather", '{"city": "oslo"}')])
    assert [(c.name, c.arguments) for c in _read(fmt, own, step).calls] == [("get_weather", '{"city": "oslo"}')]


SMALL = {"type": "object", "properties": {"c": {"type": "string", "pattern": "^[a-z]{1,4}$"}},
         "required": ["c"], "additionalProperties": False}
TINY_TOOLS = [{"type": "function", "function": {"name": "w", "parameters": SMALL}}]
MSGS = [{"role": "user", "content": "Weather?"}]
PLAIN = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # no tools: the generic format
CASES = [  # (family template or None for the generic format, text the model is steered to write)
    ("hermes", chat_templates.HERMES, '{"name": "w"'),
    ("hermes-after-text", chat_templates.HERMES, 'Hi {"name": "w"'),
    ("llama3", chat_templates.LLAMA3, '{"name": "w"'),
    ("mistral-list", chat_templates.MISTRAL, '[{"name": "w"'),
    ("generic", PLAIN, '{"name": "w"'),
]


async def _prompt_end(path: Path) -> tuple[int, Any]:
    engine = AsyncEngine.from_pretrained(path, dtype="float32", num_kv_blocks=32)
    turn = await prepare(engine, MSGS, tools=TINY_TOOLS)
    return turn.prompt[-1], turn.spec.fmt


@pytest.mark.parametrize(("case", "template", "text"), CASES, ids=[c[0] for c in CASES])
async def test_a_model_writing_a_bare_call_gets_a_tool_call_back(
        tiny_models: dict[str, tuple[Path, Any]], tmp_path: Path, case: str, template: str, text: str) -> None:
    from transformers import AutoTokenizer

    src = steered.build(tiny_models["llama"][0], tmp_path / "plain", [], template=template)
    end, fmt = await _prompt_end(src)
    assert fmt is {"hermes": HERMES, "llama3": LLAMA3, "mistral": MISTRAL, "generic": GENERIC}[case.split("-")[0]]
    lead = text[: text.index("[") if text.startswith("[") else text.index("{")]
    chain = steered.chain_ids(AutoTokenizer.from_pretrained(src), end, text)
    engine = AsyncEngine.from_pretrained(steered.build(src, tmp_path / "steered", chain), dtype="float32",
                                         num_kv_blocks=64)
    async with engine:
        for seed in range(2):
            res = await engine.chat(MSGS, tools=TINY_TOOLS, parallel_tool_calls=False,
                                    params=SamplingParams(max_tokens=60, seed=seed))
            assert res.finish_reason == "tool_calls", res
            assert [c.name for c in res.tool_calls] == ["w"]
            jsonschema.validate(json.loads(res.tool_calls[0].arguments), SMALL)
            assert res.content == (lead or None), res
        deltas = [d async for d in engine.chat_stream(MSGS, tools=TINY_TOOLS, parallel_tool_calls=False,
                                                      params=SamplingParams(max_tokens=60, seed=0))]
        assert deltas[-1].finish_reason == "tool_calls" and [d.tool_call.name for d in deltas if d.tool_call] == ["w"]
        assert not any("name" in (d.content or "") for d in deltas)
        # Not a call: a head naming no declared tool stays content, and so does a random reply.
        plain = await engine.chat(MSGS, tools=[{"type": "function", "function": {"name": "q", "parameters": SMALL}}],
                                  params=SamplingParams(max_tokens=16, seed=0))
        assert plain.tool_calls == [] and plain.finish_reason in ("stop", "length")
        assert plain.content is not None and plain.content.lstrip("Hi [").startswith('{"name": "w"')
