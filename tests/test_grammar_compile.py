"""Grammar compilation as untrusted input (issue 11, defect 6), vocabularies wider than the logits
(defect 10), and backend choices a GPU would reject (defect 11)."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from asyncpage import AsyncEngine, GrammarError, InvalidRequestError, SamplingParams
from asyncpage.errors import GrammarTimeoutError
from asyncpage.guided.backend import Deadline, GuidedSpec
from asyncpage.guided.schema import enum_of_valid_candidates

# jsonschema takes milliseconds per candidate here: 20k values with `not` took 87 s unbounded.
HOSTILE = {"enum": list(range(20000)), "not": {"multipleOf": 7}, "uniqueItems": True}


def tiny_engine(path: Path, **kw: Any) -> AsyncEngine:
    opts: dict[str, Any] = dict(dtype="float32", block_size=4, num_kv_blocks=128, max_num_batched_tokens=32)
    opts.update(kw)
    return AsyncEngine.from_pretrained(str(path), **opts)


def test_a_deadline_stops_the_python_side_of_a_compile() -> None:
    t = time.monotonic()
    with pytest.raises(Exception, match="longer than"):
        enum_of_valid_candidates(HOSTILE, Deadline(0.2))
    assert time.monotonic() - t < 1.0


async def test_a_slow_schema_sent_20_times_costs_one_bounded_compile(tiny_llama: Path) -> None:
    engine = tiny_engine(tiny_llama, grammar_compile_timeout=0.5)
    backend = engine.guided.backend()
    real = backend.compile
    calls = 0
    busy = 0
    peak_busy = 0
    lock = threading.Lock()

    def counting(spec: GuidedSpec, deadline: Any = None) -> Any:
        nonlocal calls, busy, peak_busy
        with lock:
            calls += 1
            busy += 1
            peak_busy = max(peak_busy, busy)
        try:
            return real(spec, deadline)
        finally:
            with lock:
                busy -= 1

    backend.compile = counting  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=4, json_schema=HOSTILE)
    async with engine:
        t = time.monotonic()
        # ignore_eos: sampled from a random tiny model, it could end early on its own
        free = asyncio.create_task(engine.generate("The quick brown fox", SamplingParams(max_tokens=16,
                                                                                         ignore_eos=True)))
        results = await asyncio.gather(*(engine.generate("x", params) for _ in range(20)), return_exceptions=True)
        waited = time.monotonic() - t
        assert all(isinstance(r, GrammarTimeoutError) for r in results), results[:3]
        assert len((await free).token_ids) == 16  # served meanwhile
        assert calls == 1
        # A timeout is not remembered (it may be the moment's load): a benign schema that timed out in
        # the queue behind the hostile one compiles when asked again; the hostile one costs another bound.
        benign = SamplingParams(max_tokens=4, json_schema={"type": "boolean"})
        assert (await engine.generate("x", benign)).text in ("true", "false")
        with pytest.raises(GrammarTimeoutError):
            await engine.generate("x", params)
    assert calls == 3 and peak_busy == 1
    assert waited < 0.5 + 1.5


async def test_concurrent_compiles_with_a_small_cache_never_break(tiny_llama: Path) -> None:
    engine = tiny_engine(tiny_llama)
    engine.guided._cache_size = 3
    async with engine:
        outs = await asyncio.gather(*(engine.generate("n", SamplingParams(max_tokens=6, regex=f"{i}[a-z]{{2,4}}"))
                                      for i in range(30)))
    assert [o.text[: len(str(i))] for i, o in enumerate(outs)] == [str(i) for i in range(30)]


async def test_an_unserializable_schema_is_a_typed_error(tiny_llama: Path) -> None:
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(5000):
        node["items"] = {}
        node = node["items"]
    async with tiny_engine(tiny_llama) as engine:
        for schema in ({"type": "number", "maximum": float("nan")}, {"enum": [{1, 2}]}, deep):
            with pytest.raises(InvalidRequestError):
                await engine.generate("x", SamplingParams(max_tokens=2, json_schema=schema))
        assert engine.healthy


async def test_guided_decoding_works_when_the_tokenizer_is_wider_than_the_logits(tiny_llama: Path,
                                                                                  tmp_path: Path) -> None:
    """Defect 10: Gemma 3 hub checkpoints have 262,145 tokenizer entries for 262,144 logits."""
    from transformers import AutoTokenizer

    wide = tmp_path / "wide"
    shutil.copytree(tiny_llama, wide)
    tok = AutoTokenizer.from_pretrained(wide)
    vocab = json.loads((wide / "config.json").read_text())["vocab_size"]
    extra = [f"<extra_{i}>" for i in range(vocab - len(tok) + 1)]
    tok.add_special_tokens({"additional_special_tokens": extra})
    tok.save_pretrained(wide)
    assert len(tok) == vocab + 1
    async with tiny_engine(wide) as engine:
        out = await engine.generate("x", SamplingParams(max_tokens=8, json_schema={"type": "boolean"}))
        again = await engine.generate("y", SamplingParams(max_tokens=8, choice=["yes", "no"]))
    assert out.text in ("true", "false") and again.text in ("yes", "no")


def test_a_backend_that_cannot_use_the_tokenizer_fails_once_and_stays_failed() -> None:
    from asyncpage.guided.manager import GrammarManager

    class Broken:
        def __len__(self) -> int:
            raise RuntimeError("no vocabulary")

    manager = GrammarManager(Broken(), 10, [1])
    for _ in range(2):
        with pytest.raises(GrammarError, match="cannot use this tokenizer"):
            manager.backend()


def test_triton_refuses_block_sizes_the_gpu_would_reject() -> None:
    """Defect 11: tl.dot needs K >= 16; block_size 1-8 used to be accepted and fail at the first step."""
    from asyncpage.core.config import resolve_backend

    with pytest.raises(InvalidRequestError) as e:
        resolve_backend("triton", "cuda", 8)
    assert e.value.field == "block_size"
    assert resolve_backend("auto", "cuda", 8) == "torch"
    assert resolve_backend("auto", "cuda", 16) == "triton"


def test_attention_masks_are_built_on_the_batch_device() -> None:
    """Defect 11: the torch backend built torch.arange masks on the CPU next to CUDA tensors."""
    import torch

    from asyncpage.model.attention import AttentionMetadata, PrefillChunk

    dev = torch.device("meta")  # any non-CPU device shows where the mask lives
    meta = AttentionMetadata(block_size=4, slot_mapping=torch.zeros(6, dtype=torch.long, device=dev),
                             prefills=[PrefillChunk(0, 6, 2, torch.zeros(2, dtype=torch.long, device=dev))])
    meta.decode_block_tables = torch.zeros((1, 2), dtype=torch.long, device=dev)
    meta.decode_context_lens = torch.ones(1, dtype=torch.long, device=dev)
    mask = meta.prefill_mask(0, window=4)
    assert mask is not None and mask.device == dev
    assert meta.decode_mask(None).device == dev


# A required self-reference: every instance is infinite (`{"next":{"next":...`).
ENDLESS = {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"],
                           "additionalProperties": False}}, "$ref": "#/$defs/n"}


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
async def test_a_schema_with_no_finite_instance_is_refused_at_submission_and_the_engine_keeps_serving(
        tiny_llama: Path, backend: str) -> None:
    """Not output cut at `{` with finish "stop" (llguidance), nor a compile thread that runs out of
    memory forcing `{"next":` forever (xgrammar): a GrammarError when the request is submitted."""
    async with tiny_engine(tiny_llama, guided_backend=backend) as engine:
        asks = [SamplingParams(json_schema=ENDLESS, max_tokens=10),
                SamplingParams(json_schema=ENDLESS, max_tokens=10, budget_close=False)]
        if backend == "llguidance":
            asks.append(SamplingParams(grammar='start: "a" start', max_tokens=5))
        for params in asks:
            with pytest.raises(GrammarError, match="no finite instance"):
                await asyncio.wait_for(engine.generate("Hello", params), 30)
        free = await engine.generate("The quick", SamplingParams(max_tokens=8, ignore_eos=True))
        assert len(free.token_ids) == 8 and engine.healthy


def test_json_schema_true_means_any_json_and_false_is_refused_as_matching_nothing() -> None:
    spec = GuidedSpec.from_params(SamplingParams(json_schema=True))  # type: ignore[arg-type]
    assert spec is not None and spec.kind == "json_schema"
    # The empty schema (any JSON), with only how it is spelled added (json_separators, guided/style.py).
    assert {k: v for k, v in json.loads(spec.value).items() if k != "x-guidance"} == {}
    assert spec == GuidedSpec.from_params(SamplingParams(json_schema={}))
    with pytest.raises(GrammarError, match="matches nothing"):
        GuidedSpec.from_params(SamplingParams(json_schema=False))  # type: ignore[arg-type]


async def test_leaving_the_engine_ends_a_submission_waiting_for_its_grammar_compile_at_once(
        tiny_llama: Path) -> None:
    """EngineNotRunningError as the engine stops, not a GrammarTimeoutError at the compile timeout."""
    from asyncpage.errors import EngineNotRunningError

    engine = tiny_engine(tiny_llama, grammar_compile_timeout=5)
    async with engine:
        task = asyncio.create_task(engine.generate("x", SamplingParams(json_schema=HOSTILE, max_tokens=4)))
        await asyncio.sleep(0.3)
    t = time.monotonic()
    with pytest.raises(EngineNotRunningError):
        await asyncio.wait_for(task, 10)
    assert time.monotonic() - t < 2
    async with engine:  # the engine starts again and serves guided requests
        out = await engine.generate("Hi", SamplingParams(regex="[a-c]{3}", max_tokens=5))
        assert re.fullmatch("[a-c]{3}", out.text)
