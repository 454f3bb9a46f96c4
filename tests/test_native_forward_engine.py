"""The fused decode step seen from the engine: a GGUF loaded with quantization="auto" decodes through it
(one native call a step) and generates what the eager forward generates; with the step turned off
(ASYNCPAGE_FUSED_STEP=0), with no kernels (no compiler, ASYNCPAGE_NATIVE=0) or for a model it cannot
express, the engine runs today's eager path. The default model: heavy (greedy tokens and logits of a
few prompts against the eager forward)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from asyncpage import AsyncEngine, SamplingParams
from asyncpage.model import native, native_step
from asyncpage.model.weights import load
from tests.test_gguf_auto import tiny_quantized_gguf  # noqa: F401  (the fixture: a tiny Qwen2 GGUF, mixed formats)

pytestmark = pytest.mark.skipif(not native_step.available(), reason="the fused step's kernels did not build")

PROMPTS = ("The quick brown", "fox jumps", "def add(a, b):")


async def _greedy(engine: Any, tokens: int = 16) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    return [(await engine.generate(p, params)).token_ids for p in PROMPTS]


async def test_a_gguf_engine_decodes_through_the_fused_step_and_generates_the_eager_tokens(
        tiny_quantized_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    async with AsyncEngine.from_pretrained(tiny_quantized_gguf, quantization="auto", dtype="float32",
                                           num_kv_blocks=64) as engine:
        native = engine.model.native
        assert native is not None
        fused = await _greedy(engine)
        assert native.steps >= len(PROMPTS) * 15  # every decode step after the prompt's
    monkeypatch.setenv("ASYNCPAGE_FUSED_STEP", "0")
    async with AsyncEngine.from_pretrained(tiny_quantized_gguf, quantization="auto", dtype="float32",
                                           num_kv_blocks=64) as engine:
        assert engine.model.native is None
        eager = await _greedy(engine)
    assert fused == eager


async def test_greedy_tokens_come_from_the_lm_heads_own_search_and_match_the_samplers(
        tiny_quantized_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    # The head's block kernel finds each row's maximum as it writes the logits (GGUFLinear.with_max): greedy
    # decoding searches them no more, and gives what the sampler's own search of the logits gives.
    from asyncpage.decoding import sampling

    searches: list[int] = []
    real_search = sampling.first_max
    monkeypatch.setattr(sampling, "first_max", lambda x: searches.append(1) or real_search(x))
    async with AsyncEngine.from_pretrained(tiny_quantized_gguf, quantization="auto", dtype="float32",
                                           num_kv_blocks=64) as engine:
        by_head = await _greedy(engine)
        assert not searches
        model = engine.model
        monkeypatch.setattr(model, "compute_logits_max", lambda h: (model.compute_logits(h), None))
        assert await _greedy(engine) == by_head and searches


async def test_several_streams_at_once_decode_as_each_alone(tiny_quantized_gguf: Path) -> None:  # noqa: F811
    import asyncio

    async with AsyncEngine.from_pretrained(tiny_quantized_gguf, quantization="auto", dtype="float32", num_kv_blocks=64,
                                           block_size=4) as engine:
        alone = await _greedy(engine, 24)
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        together = await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS))
    assert [o.token_ids for o in together] == alone


async def test_greedy_speculation_in_bfloat16_gives_the_tokens_decoding_alone_gives(
        tiny_quantized_gguf: Path) -> None:  # noqa: F811
    # A verify of a stream's last token and its drafts (8 rows at most with the default k) goes through
    # the fused step row by row, as decode steps do: in bfloat16, where the eager forward rounds
    # otherwise, the tokens are still the same (before, a verify ran the eager forward as one chunk).
    opts: dict[str, Any] = dict(quantization="auto", dtype="bfloat16", num_kv_blocks=64)
    async with AsyncEngine.from_pretrained(tiny_quantized_gguf, **opts) as engine:
        plain = await _greedy(engine, 40)
    async with AsyncEngine.from_pretrained(tiny_quantized_gguf, speculative_config={"method": "ngram"},
                                           **opts) as engine:
        native = engine.model.native
        assert native is not None
        speculated = await _greedy(engine, 40)
        st = engine.stats()
        steps = native.steps
    assert speculated == plain
    assert st.spec_accepted_tokens > 0  # drafts were kept: verifies ran
    # Every step after the prompts' went through the fused step, verifies included.
    assert steps >= sum(len(t) for t in plain) - st.spec_accepted_tokens - len(PROMPTS)


def test_without_the_native_kernels_a_gguf_model_keeps_the_eager_forward(
        tiny_quantized_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    monkeypatch.setattr(native_step, "_lib", lambda: None)  # what a missing compiler or ASYNCPAGE_NATIVE=0 gives
    model: Any = load(tiny_quantized_gguf, torch.float32, torch.device("cpu"), quantization="auto").model
    assert model.native is None
    monkeypatch.undo()
    monkeypatch.setenv("ASYNCPAGE_NATIVE", "0")
    native.library.cache_clear()  # the variable is read once per process, at the first build
    native_step._lib.cache_clear()
    try:
        assert not native_step.available()
    finally:
        monkeypatch.undo()
        native.library.cache_clear()
        native_step._lib.cache_clear()
    assert native_step.available()


def test_float_weights_and_dequantized_ggufs_have_no_fused_step(tiny_llama: Path,
                                                                 tiny_quantized_gguf: Path) -> None:  # noqa: F811
    for path, quantization in ((tiny_llama, "auto"), (tiny_quantized_gguf, None)):
        model: Any = load(path, torch.float32, torch.device("cpu"), quantization=quantization).model
        assert model.native is None


def teacher_forced(model: Any, prompt: list[int], steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The eager prefill of `prompt`, then `steps` decode steps each run both ways on the same pool
    (the eager one's K/V kept, the fused one's written to a copy): (eager logits, fused logits) per
    step, the next token the eager argmax."""
    from asyncpage.model.attention import paged_attention
    from asyncpage.model.batch import FlatBatch

    a = model.model.layers[0].self_attn
    caches = [tuple(torch.zeros(64, 16, a.num_kv_heads, a.head_dim) for _ in range(2)) for _ in model.model.layers]
    table = list(range(1, 64))
    keep, out, tokens = model.native, [], list(prompt)

    def step(ids: list[int], start: int, kv: Any, native: bool) -> torch.Tensor:
        flat = FlatBatch(16, 0, torch.device("cpu"), paged_attention)
        flat.add(ids, start, table)
        x, pos, meta = flat.build()
        model.native = keep if native else None
        try:
            with torch.inference_mode():
                if native:
                    assert keep.applies(meta, 1, kv)
                return model.compute_logits(model(x, pos, meta, kv)[len(ids) - 1:len(ids)].float())[0]
        finally:
            model.native = keep

    tokens.append(int(step(tokens, 0, caches, False).argmax()))
    for _ in range(steps):
        fused = step(tokens[-1:], len(tokens) - 1, [tuple(t.clone() for t in kv) for kv in caches], True)
        eager = step(tokens[-1:], len(tokens) - 1, caches, False)
        out.append((eager, fused))
        tokens.append(int(eager.argmax()))
    return out


class _Noisy:
    """A stand-in for the fused step: the eager forward with the embedding's output moved by one ulp at
    random (the float noise floor of the eager path itself)."""

    def __init__(self, model: Any) -> None:
        self.model, self.gen = model, torch.Generator().manual_seed(0)

    def applies(self, *args: Any) -> bool:
        return True

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: Any, kv: Any) -> torch.Tensor:
        emb = self.model.model.embed_tokens

        def hook(mod: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
            return out * (1 + 2.0**-23 * torch.randint(-1, 2, out.shape, generator=self.gen).float())

        handle, keep = emb.register_forward_hook(hook), self.model.native
        self.model.native = None
        try:
            return self.model(ids, pos, meta, kv)
        finally:
            self.model.native = keep
            handle.remove()


@pytest.mark.heavy
def test_the_default_model_is_as_close_to_the_eager_forward_as_the_eager_forward_is_to_itself() -> None:
    """gemma-3-270m Q4_K_M, teacher-forced on the eager greedy tokens (both paths on the same K/V every
    step): the fused step's logits differ from the eager ones no more than the eager forward's own do
    when its embedding moves by one ulp, and it picks the eager token as often. Bit-exact agreement is
    not what two float computations give: each matrix input is rounded to int8, and a value within a
    float rounding of a rounding tie (about one in 10^5; this model rounds ~70,000 values a token)
    lands one int8 step apart, which a 270M model carries to a few percent of its logits."""
    loaded = load(None, torch.float32, torch.device("cpu"), quantization="auto")
    model: Any = loaded.model
    fused = model.native
    assert fused is not None
    figures = {}
    for name, step in (("fused", fused), ("eager + 1 ulp", _Noisy(model))):
        model.native = step
        errs, same = [], 0
        for text in ("The capital of France is", "def fibonacci(n):", "Once upon a time", "Water boils at"):
            for eager, other in teacher_forced(model, loaded.tokenizer.encode(text), 24):
                errs.append(((other - eager).norm() / eager.norm()).item())
                same += int(other.argmax() == eager.argmax())
        figures[name] = (sorted(errs)[len(errs) // 2], max(errs), same, len(errs))
    model.native = fused
    print("teacher-forced vs the eager step (median, max relative logit difference, argmax agreement):", figures)
    (med, top, same, n), (med0, top0, same0, _) = figures["fused"], figures["eager + 1 ulp"]
    assert med < 2 * med0 and top < 2 * top0 and same >= same0 - n // 20, figures
