"""One request's own faults stay that request's: a detokenizer that raises, a token sequence on which
tokenizers' DecodeStream raises (vLLM #17448, the default model's Gemma 3 vocabulary), a beam search
whose step raises, a draft model that raises. The engine stays healthy and the next request works.
And admission: a full waiting queue refuses at once with QueueFullError; stop strings are bounded."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from asyncpage import (
    AsyncEngine,
    InvalidRequestError,
    QueueFullError,
    RequestFailedError,
    SamplingParams,
)
from asyncpage.params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from tests.test_faults import idle, tiny_engine

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

# vLLM's regression sequence (tests/v1/engine/test_fast_incdec_prefix_err.py, gemma-3-1b-it; the same
# 262k vocabulary as the default model): DecodeStream.step raises "Invalid prefix encountered" at token 111.
VLLM_PROMPT = [107, 4606, 236787, 107]
VLLM_TOKENS = [
    236840, 107, 138, 236782, 107, 140, 236775, 6265, 1083, 623, 121908, 147418, 827, 107, 140, 236775, 6265,
    236779, 2084, 1083, 623, 203292, 827, 107, 140, 236775, 6265, 236779, 7777, 1083, 623, 121908, 147418, 569,
    537, 236789, 65880, 569, 537, 236789, 62580, 853, 115693, 210118, 35178, 16055, 1270, 759, 215817, 4758, 1925,
    1117, 827, 107, 140, 236775, 5654, 1083, 623, 110733, 46291, 827, 107, 140, 236775, 5654, 236779, 2084, 1083,
    623, 136955, 56731, 827, 107, 140, 236775, 5654, 236779, 7777, 1083, 623, 194776, 2947, 496, 109811, 1608, 890,
    215817, 4758, 1925, 1117, 2789, 432, 398, 602, 31118, 569, 124866, 134772, 509, 19478, 1640, 33779, 236743,
    236770, 236819, 236825, 236771, 432, 398, 432, 237167, 827, 107, 140, 236775, 77984, 1083, 623, 2709, 236745,
    2555, 513, 236789, 602, 31118, 569]
VLLM_TEXT = (
    '[\n  {\n    "source": "Résultats",\n    "source_type": "CONCEPT",\n'
    '    "source_description": "Résultats de l\'analyse de l\'impact des opérations israéliennes sur la '
    'frontière libanaise",\n    "target": "Israël",\n    "target_type": "ORGANIZATION",\n'
    '    "target_description": "Pays qui a obtenu à sa frontière libanaise «\xa0un niveau de calme inédit '
    'depuis les années 1960\xa0»",\n    "relationship": "Obtention d\'un niveau de')


def token_grammar(tokens: list[int]) -> str:
    """A Lark grammar of llguidance token terminals: exactly these tokens, in this order."""
    return "start: " + " ".join(f"<[{t}]>" for t in tokens)


@pytest.mark.slow
async def test_the_vllm_invalid_prefix_sequence_decodes_to_its_text_and_the_engine_stays_healthy(
        default_engine: AsyncEngine) -> None:
    params = SamplingParams(grammar=token_grammar(VLLM_TOKENS), max_tokens=len(VLLM_TOKENS) + 4, temperature=0)
    out = await default_engine.generate(VLLM_PROMPT, params)
    assert out.token_ids == VLLM_TOKENS
    assert out.text == VLLM_TEXT
    assert out.finish_reason == "stop"
    assert default_engine.healthy
    after = await default_engine.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0))
    assert after.token_ids and after.finish_reason == "length"
    # The same tokens streamed one chunk at a time give the same text, never re-emitted or split.
    streamed = "".join([c.text async for c in default_engine.stream(VLLM_PROMPT, params)])
    assert streamed == VLLM_TEXT


@pytest.mark.slow
async def test_a_token_grammar_forces_exactly_its_special_and_byte_tokens(default_engine: AsyncEngine) -> None:
    tokens = [236840, 107, 138, 432, 398, 237167]  # '[', newline, spaces, a byte-fallback NBSP, '»'
    out = await default_engine.generate("x", SamplingParams(grammar=token_grammar(tokens), max_tokens=10))
    assert out.token_ids == tokens and out.finish_reason == "stop"


class _Broken:
    """A detokenizer whose every call raises (any fault in per-token output work)."""

    stopped = False

    def add(self, token_id: int, is_stop_token: bool = False) -> str:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    def finish(self) -> str:
        raise AssertionError("never reached")


async def test_a_detokenizer_that_raises_fails_only_its_request(tiny_llama: Path) -> None:
    async with tiny_engine(tiny_llama) as engine:
        expected = await engine.generate("Others keep going", GREEDY)
        others = [asyncio.ensure_future(engine.generate("Others keep going", GREEDY)) for _ in range(3)]
        req = await engine.submit("The victim", GREEDY)
        req.seqs[0].detokenizer = _Broken()  # type: ignore[assignment]  # before its first step commits
        with pytest.raises(RequestFailedError) as info:
            while True:
                await req.mailbox.get()
        assert isinstance(info.value.__cause__, UnicodeDecodeError)
        assert [o.token_ids for o in await asyncio.gather(*others)] == [expected.token_ids] * 3
        assert engine.healthy
        await idle(engine)
        assert (await engine.generate("Others keep going", GREEDY)).token_ids == expected.token_ids


async def test_a_request_whose_token_bookkeeping_raises_fails_alone(tiny_llama: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault in one sequence's step of Scheduler.update (its stop check here) fails that request
    with RequestFailedError; the requests beside it and after it are served (it killed the engine)."""
    async with tiny_engine(tiny_llama) as engine:
        expected = await engine.generate("Others keep going", GREEDY)
        sched = engine._core.scheduler
        real = sched._stop_reason
        victims: set[int] = set()

        def broken(seq: Any, token: int) -> Any:
            if seq.request.request_id in victims:
                raise KeyError("injected")
            return real(seq, token)

        monkeypatch.setattr(sched, "_stop_reason", broken)
        others = [asyncio.ensure_future(engine.generate("Others keep going", GREEDY)) for _ in range(3)]
        req = await engine.submit("The victim", GREEDY)
        victims.add(req.request_id)
        with pytest.raises(RequestFailedError) as info:
            while True:
                await req.mailbox.get()
        assert isinstance(info.value.__cause__, KeyError)
        assert [o.token_ids for o in await asyncio.gather(*others)] == [expected.token_ids] * 3
        assert engine.healthy and (await engine.generate("Others keep going", GREEDY)).token_ids == expected.token_ids
        await idle(engine)


async def test_a_finished_record_that_cannot_be_built_skips_its_hooks_only(tiny_llama: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """on_request_finished: a request whose record raises (its metrics here) is logged and its hooks
    skipped; the hooks still hear every other request, and the engine stays healthy (it died)."""
    import asyncpage.core.output as output

    heard: list[int] = []
    real = output.request_metrics
    victims: set[int] = set()

    def broken(req: Any) -> Any:
        if req.request_id in victims:
            raise ZeroDivisionError("injected")
        return real(req)

    monkeypatch.setattr(output, "request_metrics", broken)
    async with tiny_engine(tiny_llama) as engine:
        engine.on_request_finished(lambda f: heard.append(f.request_id))
        req = await engine.submit("The victim", GREEDY)
        victims.add(req.request_id)
        bystanders = [asyncio.ensure_future(engine.generate("A bystander", GREEDY)) for _ in range(2)]
        while not req.finished:
            await req.mailbox.get()
        outs = await asyncio.gather(*bystanders)
        assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs) and engine.healthy
        await idle(engine)
        assert req.request_id not in heard and len(heard) == 2


async def test_a_beam_search_whose_step_raises_fails_alone(tiny_llama: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    async with tiny_engine(tiny_llama) as engine:
        core = engine._core
        real = core.scheduler._step_beams

        def broken(req: Any, candidates: Any) -> Any:
            raise KeyError("injected")

        monkeypatch.setattr(core.scheduler, "_step_beams", broken)
        plain = asyncio.ensure_future(engine.generate("A plain request", GREEDY))
        with pytest.raises(RequestFailedError):
            await engine.beam_search("A beam search", beam_width=2, max_tokens=6)
        assert len((await plain).token_ids) == GREEDY.max_tokens
        monkeypatch.setattr(core.scheduler, "_step_beams", real)
        out = await engine.beam_search("A beam search", beam_width=2, max_tokens=6)
        assert len(out.beams) == 2 and engine.healthy
        await idle(engine)


async def test_a_draft_model_that_raises_costs_speculation_not_requests(tiny_llama: Path) -> None:
    draft = {"method": "draft", "model": str(tiny_llama), "num_speculative_tokens": 4, "auto_disable": False}
    async with tiny_engine(tiny_llama) as plain:
        expected = [o.token_ids for o in await asyncio.gather(*(plain.generate(f"Prompt {i}", GREEDY)
                                                                  for i in range(3)))]
    async with tiny_engine(tiny_llama, speculative_config=draft) as engine:
        proposer = engine._core.draft
        assert proposer is not None

        def broken(*args: Any) -> Any:
            raise RuntimeError("injected draft failure")

        proposer.propose = broken  # type: ignore[method-assign]
        got = [o.token_ids for o in await asyncio.gather(*(engine.generate(f"Prompt {i}", GREEDY) for i in range(3)))]
        assert got == expected
        assert engine.healthy
        assert engine._core.draft is None  # given up after failing steps in a row: speculation is off
        assert (await engine.generate("Prompt 0", GREEDY)).token_ids == expected[0]
        await idle(engine)


async def test_a_full_waiting_queue_refuses_at_once_and_serves_again_after(tiny_llama: Path) -> None:
    async with tiny_engine(tiny_llama, max_queued_requests=2, max_num_seqs=1) as engine:
        results = await asyncio.gather(*(engine.generate(f"Prompt {i}", GREEDY) for i in range(6)),
                                       return_exceptions=True)
        refused = [r for r in results if isinstance(r, QueueFullError)]
        served = [r for r in results if not isinstance(r, BaseException)]
        assert refused and served and len(refused) + len(served) == 6
        assert all(r.retry_after > 0 for r in refused)
        assert engine.healthy
        await idle(engine)
        assert len((await engine.generate("Prompt 0", GREEDY)).token_ids) == GREEDY.max_tokens


def test_max_queued_requests_must_be_a_positive_integer(tiny_llama: Path) -> None:
    with pytest.raises(InvalidRequestError, match="max_queued_requests"):
        tiny_engine(tiny_llama, max_queued_requests=0)


def test_stop_strings_are_bounded_in_count_and_length() -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])
    assert info.value.field == "stop"
    with pytest.raises(InvalidRequestError, match="stop"):
        SamplingParams(stop=["x" * (MAX_STOP_CHARS + 1)])
    SamplingParams(stop=["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS)  # at the bounds: accepted


def test_a_temperature_past_float32_range_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=3.5e38)


def test_an_integer_past_floats_range_is_refused_naming_its_field() -> None:
    with pytest.raises(InvalidRequestError, match="frequency_penalty"):
        SamplingParams(frequency_penalty=10**400)


def test_numeric_sampling_fields_are_stored_as_floats() -> None:
    # An int past int64 (from a JSON body) reached torch as int64 and overflowed in the batch's sampler.
    p = SamplingParams(repetition_penalty=10**30, temperature=1, presence_penalty=2)
    assert all(isinstance(v, float) for v in (p.repetition_penalty, p.temperature, p.presence_penalty))
