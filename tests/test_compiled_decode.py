"""compile=True (asyncpage.model.compiled): decode steps of up to 8 sequences run torch.compile'd
layers. In float32, the same greedy tokens and (within float rounding) the same logits as the eager
forward, on tiny models of the families that have the compiled path; every variant compiled at load,
none later. (In bfloat16 the fused loops round differently, so greedy tokens may part after a while.)"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncpage import AsyncEngine, SamplingParams
from asyncpage.core.loading import env_flag
from asyncpage.model import compiled as compiled_module
from asyncpage.model import native
from asyncpage.model.attention import paged_attention
from asyncpage.model.batch import FlatBatch

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


async def _greedy(engine: AsyncEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async with engine:
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    return [list(o.token_ids) for o in outs]


def _decode_logits(engine: AsyncEngine, rows: int, context: int, table: list[int] | None = None) -> torch.Tensor:
    """One decode step of `rows` sequences, each `context` tokens in, straight through the runner
    (on consecutive blocks, or on `table` for one row)."""
    runner = engine._core.runner
    bs = engine.config.block_size
    per = -(-(context + 1) // bs)
    flat = FlatBatch(bs, runner.pad_slot, runner.device, paged_attention)
    for r in range(rows):
        flat.add([3 + r], context, table or list(range(r * per, (r + 1) * per)))
    ids, pos, meta = flat.build()
    with torch.inference_mode():
        hidden = runner.model(ids, pos, meta, runner.caches)
        return runner.model.compute_logits(hidden)


@pytest.mark.parametrize("arch", ["gemma3", "qwen2"])
def test_compiled_decode_gives_the_eager_tokens_and_logits(tiny_models: dict[str, tuple[Path, Any]],
                                                           arch: str) -> None:
    path = tiny_models[arch][0]
    torch._dynamo.reset()  # graphs an earlier test compiled for the same shapes would be reused, not counted
    eager = AsyncEngine.from_pretrained(path, dtype="float32", num_kv_blocks=64, compile=False)
    compiled = AsyncEngine.from_pretrained(path, dtype="float32", num_kv_blocks=64, compile=True)
    assert not eager.config.compiled and compiled.config.compiled
    model = compiled.model
    assert model.compiled is not None and model.compiled.graphs > 0
    # 1 stream, then 5 at once (batched decode steps of 5 rows, then fewer as they finish).
    prompts = [[0, 5 + i, 17, 40 + 3 * i, 9][: 2 + i] for i in range(5)]
    from torch._dynamo.utils import counters  # not at import: torch._dynamo imports triton (see kernels/)

    graphs = counters["stats"]["unique_graphs"]
    for batch in (prompts[:1], prompts):
        assert asyncio.run(_greedy(compiled, batch, 24)) == asyncio.run(_greedy(eager, batch, 24))
    assert model.compiled.steps > 0  # the compiled path ran
    assert counters["stats"]["unique_graphs"] == graphs  # everything was compiled at load: no step compiled
    for rows, context in ((1, 3), (2, 17), (8, 40)):
        a = _decode_logits(eager, rows, context)
        b = _decode_logits(compiled, rows, context)
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (rows, context, (a - b).abs().max())


def test_one_stream_reads_its_context_as_one_slice_of_the_pool_where_its_blocks_are_consecutive(
        tiny_models: dict[str, tuple[Path, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """With torch's ops (no native kernels): a single decode row on consecutive blocks attends to a
    slice of the pool (no gather, no mask; the local layers to their last 8 positions); on scattered
    blocks it takes the gathering path. Both give the eager logits, before and past the window and
    at a block's last slot."""
    monkeypatch.setattr(native, "load", lambda: None)
    path = tiny_models["gemma3"][0]
    eager = AsyncEngine.from_pretrained(path, dtype="float32", num_kv_blocks=64, compile=False)
    compiled = AsyncEngine.from_pretrained(path, dtype="float32", num_kv_blocks=64, compile=True)
    bs = compiled.config.block_size
    spans: list[tuple[int, int] | None] = []
    real = compiled_module.contiguous_span
    monkeypatch.setattr(compiled_module, "contiguous_span", lambda meta: spans.append(real(meta)) or spans[-1])
    for context in (0, 5, bs - 1, 3 * bs + 2):
        blocks = -(-(context + 1) // bs)
        for table in ([*range(7, 7 + blocks), 2], [40 - 3 * i for i in range(blocks)]):
            a = _decode_logits(eager, 1, context, table)
            b = _decode_logits(compiled, 1, context, table)
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (context, table, (a - b).abs().max())
    # Consecutive (a spare block after them does not matter): the slice from block 7's first slot.
    assert spans[0::2] == [(7 * bs, c + 1) for c in (0, 5, bs - 1, 3 * bs + 2)]
    # Scattered blocks: the gathering path; a context within one block is a slice by itself.
    assert spans[1::2] == [(40 * bs, 1), (40 * bs, 6), (40 * bs, bs), None]


@pytest.mark.parametrize("arch", ["gemma3", "qwen2"])
def test_with_the_native_kernel_every_compiled_step_attends_in_one_call_and_gives_the_eager_logits(
        tiny_models: dict[str, tuple[Path, Any]], arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One row on consecutive or scattered blocks (a shared prefix block first), and steps of
    several rows: each layer's attention is one native call (asyncpage.model.native), and the logits are
    the eager forward's."""
    kernels = native.load()
    assert kernels is not None  # a C compiler is part of this project's setup (torch.compile needs one)
    calls: list[int] = []
    real_attend = kernels.attend_rows
    monkeypatch.setattr(kernels, "attend_rows", lambda *a: calls.append(1) or real_attend(*a))
    monkeypatch.setattr(native, "load", lambda: kernels)
    path = tiny_models[arch][0]
    eager = AsyncEngine.from_pretrained(path, dtype="float32", num_kv_blocks=64, compile=False)
    compiled = AsyncEngine.from_pretrained(path, dtype="float32", num_kv_blocks=64, compile=True)
    bs = compiled.config.block_size
    calls.clear()  # the warm-up's steps
    steps = 0
    for context in (0, 5, bs - 1, 3 * bs + 2):
        blocks = -(-(context + 1) // bs)
        for table in ([*range(7, 7 + blocks), 2], [2, *(40 - 3 * i for i in range(blocks - 1))]):
            a = _decode_logits(eager, 1, context, table)
            b = _decode_logits(compiled, 1, context, table)
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (context, table, (a - b).abs().max())
            steps += 1
    for rows in (2, 5, 8):
        a = _decode_logits(eager, rows, 9)
        b = _decode_logits(compiled, rows, 9)
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (rows, (a - b).abs().max())
        steps += 1
    assert len(calls) == len(compiled.model.model.layers) * steps  # every step, every layer: one call


def test_two_models_of_the_same_shapes_compiled_in_one_process_each_run_their_own_graphs(
        tiny_models: dict[str, tuple[Path, Any]]) -> None:
    """Each compiled model has graphs of its own (they skip the guards on its modules, so a graph
    holds its model's plain attributes as constants): a second model of the same shapes but another
    norm epsilon, compiled after the first, never runs the first one's graph, nor the reverse."""
    path = tiny_models["gemma3"][0]
    first = AsyncEngine.from_pretrained(path, dtype="float32", num_kv_blocks=64, compile=True)
    second = AsyncEngine.from_pretrained(path, dtype="float32", num_kv_blocks=64, compile=False)
    for layer in second.model.model.layers:
        layer.input_layernorm.eps = 4.0  # a float the graph bakes in, not a tensor it reads per call
    rows_cases = (1, 3)
    want_second = [_decode_logits(second, rows, 9) for rows in rows_cases]  # eager: nothing compiled yet
    compiled_module.enable(second.model, torch.float32)
    assert second.model.compiled is not None and first.model.compiled is not None
    eager_first = AsyncEngine.from_pretrained(path, dtype="float32", num_kv_blocks=64, compile=False)
    for rows, expected in zip(rows_cases, want_second, strict=True):
        for engine, want in ((second, expected), (first, _decode_logits(eager_first, rows, 9))):
            before = engine.model.compiled.steps
            got = _decode_logits(engine, rows, 9)
            assert engine.model.compiled.steps == before + 1  # the compiled path served it
            assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (rows, (got - want).abs().max())
        assert not torch.allclose(expected, _decode_logits(eager_first, rows, 9), atol=1e-2)


@pytest.mark.parametrize("layers", ["gguf blocks", "torch quantized"])
def test_compiled_decode_with_quantized_weights(tiny_models: dict[str, tuple[Path, Any]], layers: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The int8 / int4 kernels inside the compiled layers compute what they do eagerly: the GGUF block
    kernels (the CPU's int8 / int4, the fused native step turned off so that the compiled steps run) and
    torch's quantized layers (where the block kernels do not run)."""
    from asyncpage.model import gguf_linear

    monkeypatch.setenv("ASYNCPAGE_FUSED_STEP", "0")
    if layers == "torch quantized":
        monkeypatch.setattr(gguf_linear, "available", lambda: False)
    path = tiny_models["gemma3"][0]
    for kind in ("int8", "int4"):
        torch._dynamo.reset()  # as above: so that `graphs` counts this engine's
        eager = AsyncEngine.from_pretrained(path, dtype="float32", num_kv_blocks=64, quantization=kind)
        compiled = AsyncEngine.from_pretrained(path, dtype="float32", num_kv_blocks=64, quantization=kind,
                                               compile=True)
        for rows, context in ((1, 5), (3, 20)):
            a = _decode_logits(eager, rows, context)
            b = _decode_logits(compiled, rows, context)
            # The kernels take bfloat16 activations here (quant_kernels.kernel_dtype): a norm summed in
            # another order can round one of them to the next bfloat16 value.
            assert (a - b).abs().max() <= 1e-2 * a.abs().max(), (kind, rows, (a - b).abs().max())
        assert compiled.model.compiled.steps == 2 and compiled.model.compiled.graphs > 0


@pytest.mark.heavy  # ~40 s (a second load of the default model, compiled): `make test-heavy`
def test_default_model_compiled_matches_transformers_greedy(reference: dict[str, Any]) -> None:
    """The real default model, float32, compile=True: transformers' greedy tokens for one stream
    (1-row steps) and for eight at once (8-row steps), as the eager path gives them (test_default_model)."""
    # quantization=None: the dequantized float32 weights transformers' reference was made with (the default,
    # "auto", keeps the GGUF's blocks: tests/test_gguf_auto.py checks that one).
    engine = AsyncEngine.from_pretrained(dtype="float32", max_num_batched_tokens=256, compile=True,
                                         quantization=None)
    assert engine.model.compiled is not None
    print(f"\ncompiled in {engine.model.compiled.compile_s:.1f} s")
    cases = reference["cases"]
    params = SamplingParams(max_tokens=reference["new_tokens"], temperature=0, ignore_eos=True)

    async def run() -> None:
        async with engine:
            for group in (cases[:1], cases[1:]):
                prompts = [c["prompt"] if c["prompt"] is not None else c["prompt_token_ids"] for c in group]
                outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
                for case, out in zip(group, outs, strict=True):
                    assert out.token_ids == case["greedy_token_ids"], case["prompt"]

    asyncio.run(run())
    assert engine.model.compiled.steps >= 2 * (reference["new_tokens"] - 1)


def test_a_failed_compile_leaves_a_working_eager_engine(tiny_models: dict[str, tuple[Path, Any]],
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    from asyncpage.model import compiled as compiled_module

    def no_compiler(*args: Any, **kwargs: Any) -> float:
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

    monkeypatch.setattr(compiled_module.CompiledDecode, "warm_up", no_compiler)
    path = tiny_models["llama"][0]
    engine = AsyncEngine.from_pretrained(path, dtype="float32", num_kv_blocks=64, compile=True)
    assert engine.model.compiled is None and not engine.config.compiled
    assert "compiling the decode layers failed" in caplog.text
    eager = AsyncEngine.from_pretrained(path, dtype="float32", num_kv_blocks=64)
    assert asyncio.run(_greedy(engine, [[0, 5, 17]], 8)) == asyncio.run(_greedy(eager, [[0, 5, 17]], 8))


def test_compile_is_not_done_where_no_step_could_use_it(tiny_models: dict[str, tuple[Path, Any]],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny_models["llama"][0]
    engine = AsyncEngine.from_pretrained(path, dtype="float32", num_kv_blocks=64, compile=True,
                                         kv_cache_dtype="int8")  # compiled steps need the model's dtype
    assert engine.model.compiled is None and not engine.config.compiled
    for off in ("0", "false", "No", "off", ""):
        monkeypatch.setenv("ASYNCPAGE_COMPILE", off)
        assert not env_flag("ASYNCPAGE_COMPILE"), off
    monkeypatch.setenv("ASYNCPAGE_COMPILE", "1")
    assert env_flag("ASYNCPAGE_COMPILE")
