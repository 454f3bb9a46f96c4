"""Issue 12's acceptance, offline: an instruct model loaded from a GGUF path (Qwen2 family, chat
template in the file) answers a weather question by calling the tool and 'say hello' without one.

No real Qwen2 instruct GGUF is available offline. The stand-in: a tiny random Qwen2 checkpoint shaped
like Qwen2.5-Instruct (byte-level BPE with Qwen's pre-tokenizer; <|endoftext|>, <|im_start|> and
<|im_end|> as special tokens, <tool_call> and </tool_call> as plain added ones; a Hermes-style
template; <|im_end|> as EOS), written as GGUF the way llama.cpp's converter writes one
(tests/gguf_writer.py: F16 matrices, F32 norms and QKV biases, tied embeddings, the vocabulary,
merges, special ids and `tokenizer.chat_template` as metadata). A random model cannot decide *whether*
to call a tool, so the weather question forces the call (tool_choice="required") and 'say hello' is
asked with tool_choice="none"; what is checked is everything between the file and the answer."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from asyncpage import AsyncEngine, SamplingParams
from asyncpage.chat import HERMES, prepare
from asyncpage.chat.formats import detect
from asyncpage.chat.messages import template_of
from tests import chat_templates
from tests.conftest import build_tiny
from tests.gguf_writer import write_gguf

# The tiny model holds 512 tokens and its tokenizer spells JSON almost by the character: a small tool.
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                                   "unit": {"enum": ["c", "f"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                            "parameters": WEATHER_PARAMS}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HELLO = [{"role": "user", "content": "say hello"}]


def _qwen2_instruct_dir(d: Path) -> Path:
    """The conftest tiny Qwen2 (QKV biases, tied embeddings), its tokenizer and config made
    Qwen2.5-Instruct-shaped. Matrices are rounded to float16 here, so the F16 GGUF holds exactly
    the checkpoint's weights."""
    from safetensors.torch import load_file, save_file
    from tokenizers import AddedToken, Regex, Tokenizer, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    build_tiny("qwen2", d)
    weights = d / "model.safetensors"
    state = {k: (v.half().float() if v.ndim == 2 else v) for k, v in load_file(str(weights)).items()}
    save_file(state, str(weights), metadata={"format": "pt"})
    tk = Tokenizer.from_file(str(d / "tokenizer.json"))
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), "isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.post_processor = processors.ByteLevel(trim_offsets=False)  # no BOS, as Qwen2
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = chat_templates.HERMES
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).unlink()
    fast.save_pretrained(d)
    end, im_end = fast.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    config = json.loads((d / "config.json").read_text())
    config.update(bos_token_id=end, eos_token_id=im_end)
    config.pop("pad_token_id", None)
    (d / "config.json").write_text(json.dumps(config, indent=2))
    (d / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": end, "eos_token_id": [im_end, end], "pad_token_id": end}))
    return d


@pytest.fixture(scope="module")
def qwen2_files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """(the HF checkpoint directory, the .gguf written from it); GGUF caches in a temporary folder."""
    root = tmp_path_factory.mktemp("gguf")
    hf_dir = _qwen2_instruct_dir(root / "qwen2-tiny-instruct")
    gguf_path = write_gguf(hf_dir, root / "qwen2-tiny-instruct-f16.gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ASYNCPAGE_CACHE", str(root / "cache"))
        yield hf_dir, gguf_path


@pytest.fixture(scope="module")
async def gguf_engine(qwen2_files: tuple[Path, Path]) -> AsyncIterator[AsyncEngine]:
    async with AsyncEngine.from_pretrained(qwen2_files[1], dtype="float32", num_kv_blocks=64) as engine:
        yield engine


async def test_gguf_model_generates_exactly_what_its_source_checkpoint_does(
        qwen2_files: tuple[Path, Path], gguf_engine: AsyncEngine) -> None:
    hf = AsyncEngine.from_pretrained(qwen2_files[0], dtype="float32", num_kv_blocks=64)
    g = gguf_engine
    assert g.model_config.model_type == "qwen2" and g.model_config.tie_word_embeddings
    # It stops where the checkpoint's generation config says (<|im_end|> and <|endoftext|>).
    assert g.eos_token_ids == hf.eos_token_ids and len(g.eos_token_ids) == 2
    # The tokenizer converted from the file's metadata splits text as the checkpoint's does.
    chat_prompt = g.tokenizer.apply_chat_template(ASK, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    # Decomposed text too: Qwen2's tokenizer normalizes it to NFC (cafe + U+0301, the Angstrom sign, Zu + U+0308).
    for text in (chat_prompt, "héllo wörld 2024-06-01\n\n  x", '<tool_call>\n{"a": 1}\n</tool_call><|im_end|>',
                 "cafe\u0301 \u212b Zu\u0308rich"):
        assert g.tokenizer(text)["input_ids"] == hf.tokenizer(text)["input_ids"], text
    async with hf:
        for params in (SamplingParams(max_tokens=24, temperature=0, logprobs=3, ignore_eos=True),
                       SamplingParams(max_tokens=24, temperature=1.0, seed=5, logprobs=3, ignore_eos=True)):
            a, b = await g.generate(chat_prompt, params), await hf.generate(chat_prompt, params)
            assert a.prompt_token_ids == b.prompt_token_ids and a.token_ids == b.token_ids
            assert a.choices[0].logprobs is not None and b.choices[0].logprobs is not None
            for x, y in zip(a.choices[0].logprobs, b.choices[0].logprobs, strict=True):
                assert x.top.keys() == y.top.keys()
                assert all(abs(x.top[k] - y.top[k]) < 1e-4 for k in x.top)


def test_chat_template_comes_from_the_gguf_file(gguf_engine: AsyncEngine) -> None:
    template = template_of(gguf_engine.tokenizer, gguf_engine.model_config.model_type)
    assert template.text == chat_templates.HERMES and template.knows_tools and not template.reasoning
    assert detect(template.text, gguf_engine.tokenizer) is HERMES


async def test_weather_question_gets_a_valid_tool_call_in_hermes_format(gguf_engine: AsyncEngine) -> None:
    tok = gguf_engine.tokenizer
    for seed in range(3):
        params = SamplingParams(max_tokens=100, seed=seed)
        turn = await prepare(gguf_engine, ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                             params=params)
        assert "<tool_call>" in tok.decode(turn.prompt) and "get_weather" in tok.decode(turn.prompt)
        out = await gguf_engine.generate(turn.prompt, turn.params)
        assert out.finish_reason == "stop", out.text
        # Written with Qwen's own marker tokens, as a Qwen model writes them, then <|im_end|>.
        assert out.token_ids[0] == tok.convert_tokens_to_ids("<tool_call>")
        assert tok.convert_tokens_to_ids("</tool_call>") in out.token_ids
        parsed = turn.parse(out.text, final=True)
        assert len(parsed.calls) == 1 and parsed.content == ""
        assert out.text == HERMES.render([(parsed.calls[0].name, parsed.calls[0].arguments)])
        res = await gguf_engine.chat(ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                                     params=params)
        assert res.finish_reason == "tool_calls" and res.content is None
        assert [c.name for c in res.tool_calls] == ["get_weather"]
        jsonschema.validate(json.loads(res.tool_calls[0].arguments), WEATHER_PARAMS)
    assert gguf_engine.stats().kv_blocks_used == 0


async def test_say_hello_gets_an_answer_without_a_tool_call(gguf_engine: AsyncEngine) -> None:
    res = await gguf_engine.chat(HELLO, tools=[WEATHER], tool_choice="none",
                                 params=SamplingParams(max_tokens=16, temperature=0))
    assert res.tool_calls == [] and res.finish_reason in ("stop", "length")
    assert isinstance(res.content, str) and res.content
    assert res.usage.prompt_tokens < 40  # the tools stay out of the prompt


async def test_openai_client_gets_the_forced_tool_call(gguf_engine: AsyncEngine) -> None:
    client: Any = gguf_engine.openai_client()
    r = await client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], tool_choice="required",
                                             parallel_tool_calls=False, max_tokens=100, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls or []) == 1
    call = ch.message.tool_calls[0]
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)
    hello = await client.chat.completions.create(model="m", messages=HELLO, tools=[WEATHER], tool_choice="none",
                                                 max_tokens=16, temperature=0)
    assert not hello.choices[0].message.tool_calls and isinstance(hello.choices[0].message.content, str)
