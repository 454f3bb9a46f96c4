"""Bad input is refused at submission with a typed error naming the field, and nothing else in
flight is disturbed."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from asyncpage import AsyncEngine, InvalidRequestError, PromptTooLongError, SamplingParams


async def test_bad_requests_fail_at_submission_while_others_keep_going(default_engine: AsyncEngine) -> None:
    long_run = asyncio.create_task(default_engine.generate(
        "Once upon a time", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)))
    await asyncio.sleep(0.3)
    vocab = default_engine.vocab_size
    cases: list[tuple[Any, Any, type[Exception], str]] = [
        ("", None, InvalidRequestError, "prompt"),
        ([], None, InvalidRequestError, "prompt"),
        ([2, vocab], None, InvalidRequestError, "prompt"),
        ([2, -1], None, InvalidRequestError, "prompt"),
        ([2] * (default_engine.config.max_model_len + 1), None, PromptTooLongError, "prompt"),
        ([2, 3], SamplingParams(stop_token_ids=[vocab + 5]), InvalidRequestError, "stop_token_ids"),
        (123, None, InvalidRequestError, "prompt"),
        ("hi", {"max_tokens": 3}, InvalidRequestError, "params"),
    ]
    for prompt, params, exc, field in cases:
        with pytest.raises(exc) as e:
            await default_engine.generate(prompt, params)
        assert e.value.field == field, (prompt if not isinstance(prompt, list) else len(prompt), e.value)
    out = await long_run
    assert len(out.token_ids) == 40 and out.finish_reason == "length"
    st = default_engine.stats()
    assert st.num_running == 0 and st.num_waiting == 0 and st.kv_blocks_used == 0


async def test_a_request_that_could_never_fit_the_pool_is_refused(default_engine: AsyncEngine) -> None:
    async with default_engine.clone(num_kv_blocks=8) as small:  # 128 token slots
        with pytest.raises(PromptTooLongError) as e:
            await small.generate([2] * 200, SamplingParams(max_tokens=4))
        assert e.value.field == "prompt"
        with pytest.raises(PromptTooLongError) as e:
            await small.generate([2] * 100, SamplingParams(max_tokens=100))
        assert e.value.field == "max_tokens"
        ok = await small.generate([2] * 100, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert len(ok.token_ids) == 8


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"block_size": 12}, "block_size"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"num_kv_blocks": 0}, "num_kv_blocks"),
    ({"attention_backend": "flash"}, "attention_backend"),
    ({"dtype": "int3"}, "dtype"),
    ({"device": "tpu"}, "device"),
])
def test_bad_engine_options_name_the_option(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        AsyncEngine.from_pretrained("/nonexistent-model-dir", **kwargs)
    assert e.value.field == field


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"num_threads": -1}, "num_threads"),
    ({"num_threads": "2"}, "num_threads"),
    ({"num_threads": True}, "num_threads"),
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching"),
    ({"debug_checks": "no"}, "debug_checks"),
    ({"compile": "no"}, "compile"),
])
def test_a_mistyped_engine_option_is_refused_naming_it_not_coerced(tiny_llama: Any, kwargs: dict[str, Any],
                                                                    field: str) -> None:
    """A thread count torch would refuse, or a string where a switch is expected ("no" is truthy)."""
    with pytest.raises(InvalidRequestError) as e:
        AsyncEngine.from_pretrained(tiny_llama, dtype="float32", **kwargs)
    assert e.value.field == field


def test_a_clone_refuses_a_mistyped_switch(tiny_llama: Any) -> None:
    engine = AsyncEngine.from_pretrained(tiny_llama, dtype="float32", num_kv_blocks=16)
    for name in ("enable_prefix_caching", "debug_checks"):
        with pytest.raises(InvalidRequestError) as e:
            engine.clone(**{name: "no"})
        assert e.value.field == name


def test_unknown_model_path_is_a_model_load_error() -> None:
    from asyncpage import ModelLoadError

    with pytest.raises(ModelLoadError):
        AsyncEngine.from_pretrained("/nonexistent-model-dir", dtype="float32")


async def test_use_outside_async_with_is_a_clear_error(default_engine_unstarted: AsyncEngine) -> None:
    from asyncpage import EngineNotRunningError

    fresh = default_engine_unstarted.clone(num_kv_blocks=16)
    with pytest.raises(EngineNotRunningError):
        await fresh.generate("hello")


async def test_a_chat_template_given_at_load_is_what_chat_renders_with(tiny_llama: Path) -> None:
    """from_pretrained(chat_template=...) overrides the checkpoint's template; an empty one is refused."""

    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}{% if add_generation_prompt %}=>{% endif %}"
    engine = AsyncEngine.from_pretrained(str(tiny_llama), dtype="float32", num_kv_blocks=32, chat_template=template)
    text = engine.tokenizer.decode(engine.apply_chat_template("hi there"))
    assert "<<hi there>>=>" in text
    with pytest.raises(InvalidRequestError) as info:
        AsyncEngine.from_pretrained(str(tiny_llama), dtype="float32", num_kv_blocks=32, chat_template="  ")
    assert info.value.field == "chat_template"
