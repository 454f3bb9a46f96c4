"""Only the best beam wanted (`beam_search(..., best_only=True)`, a scoring probe's likeliest value): beams that
can no longer beat the best hypothesis found leave the search, which finds the same best hypothesis as the
full search with fewer beam rows computed."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from asyncpage import InvalidRequestError, SamplingParams
from asyncpage.decoding.beam import BeamParams, BeamSearch
from tests.test_engine_lifecycle import PROMPTS, _idle, tiny_engine

EOS, DONE, VOCAB = 0, 1, 12  # EOS ends a beam as a stop id does; DONE as a grammar that is complete does

Model = Callable[[tuple[int, ...], int], tuple[list[int], list[float]]]


def _model(seed: int) -> Model:
    """A made-up model: each prefix's next-token log-probabilities, fixed by the prefix and the seed."""

    def next_tokens(prefix: tuple[int, ...], k: int) -> tuple[list[int], list[float]]:
        rng = random.Random(f"{seed}:{prefix}")
        logits = [rng.gauss(0, 2.5) for _ in range(VOCAB)]
        top = max(logits)
        norm = top + math.log(sum(math.exp(x - top) for x in logits))
        ranked = sorted(range(VOCAB), key=lambda t: -logits[t])[:k]
        return ranked, [logits[t] - norm for t in ranked]

    return next_tokens


def _search(model: Model, params: BeamParams, max_tokens: int) -> tuple[BeamSearch, int]:
    """One search as the scheduler runs it (core/beams.py): step, retire the complete, drop the hopeless.
    Returns it and the beam rows it computed."""
    search, beams, rows = BeamSearch(params, max_tokens, num_eos=1), [[]], 0
    while not search.done:
        rows += len(beams)
        cands = [model(tuple(b), search.num_candidates) for b in beams]
        choices = search.step(beams, cands, lambda parent, tok: ("stop", False) if tok == EOS else None)
        beams = [beams[c.parent] + [c.token] for c in choices]
        for i in range(len(beams) - 1, -1, -1):
            if beams[i][-1] == DONE:
                search.retire(i, beams.pop(i), "stop")
        for i in reversed(search.hopeless()):
            search.drop([i])
            beams.pop(i)
    return search, rows


def _best(search: BeamSearch) -> tuple[list[int], float] | None:
    stops = [h for h in search.finished if h.finish_reason == "stop"]
    if not stops:
        return None
    h = max(stops, key=lambda h: h.cumulative_logprob)
    return h.token_ids, h.cumulative_logprob


def test_only_the_best_beam_wanted_finds_the_full_searchs_best_with_fewer_rows() -> None:
    saved = total = 0
    for seed in range(300):
        for width, stopping in ((1, False), (2, False), (4, False), (2, "never"), (4, "never")):
            model = _model(seed)
            full, full_rows = _search(model, BeamParams(beam_width=width, length_penalty=0.0,
                                                        early_stopping=stopping), 12)
            best, best_rows = _search(model, BeamParams(beam_width=width, length_penalty=0.0,
                                                        early_stopping=stopping, best_only=True), 12)
            assert _best(best) == _best(full), (seed, width, stopping)
            assert best_rows <= full_rows
            saved, total = saved + full_rows - best_rows, total + full_rows
    assert saved > total // 10  # it prunes, not only agrees


def test_only_the_best_beam_is_refused_with_a_length_penalty_or_early_stopping() -> None:
    for lp in (1.0, -0.5, 2.0):
        with pytest.raises(InvalidRequestError) as err:
            BeamParams(beam_width=4, length_penalty=lp, best_only=True)
        assert err.value.field == "best_only"
    with pytest.raises(InvalidRequestError):
        BeamParams(beam_width=4, length_penalty=0.0, best_only=1)  # type: ignore[arg-type]
    # early_stopping=True ends the search at W hypotheses: pruning would change which W come first.
    with pytest.raises(InvalidRequestError) as err:
        BeamParams(beam_width=4, length_penalty=0.0, early_stopping=True, best_only=True)
    assert err.value.field == "best_only"


async def test_the_engines_best_beam_is_the_same_when_only_the_best_is_wanted(tiny_llama: Path) -> None:
    choices = ["red", "green", "blue", "yellow", "purple", "orange"]
    rows = {False: [0, 0], True: [0, 0]}  # free text, choices -> [beam rows computed: full, best only]
    async with tiny_engine(tiny_llama) as engine:
        sched, counted = engine._core.scheduler, [0]
        real = sched.update

        def update(out: Any, *args: Any, **kwargs: Any) -> Any:  # a beam's row: one scheduled with samples
            counted[0] += sum(1 for s in out.scheduled if s.seq.request.beam is not None and s.samples)
            return real(out, *args, **kwargs)

        sched.update = update  # type: ignore[method-assign]
        for params in (SamplingParams(temperature=0), SamplingParams(choice=choices)):
            for prompt in PROMPTS[:4]:
                for width in (2, 4):
                    # The first computes the prompt, the others take it from the prefix cache (as rounded there).
                    await engine.beam_search(prompt, beam_width=width, max_tokens=10, params=params)
                    before = counted[0]
                    full = await engine.beam_search(prompt, beam_width=width, max_tokens=10, length_penalty=0.0,
                                                    params=params)
                    between = counted[0]
                    best = await engine.beam_search(prompt, beam_width=width, max_tokens=10, length_penalty=0.0,
                                                    params=params, best_only=True)
                    done = [between - before, counted[0] - between]
                    rows[params.choice is not None] = [a + b for a, b in zip(rows[params.choice is not None], done,
                                                                             strict=True)]
                    top = max(full.beams, key=lambda b: b.cumulative_logprob)
                    assert (best.beams[0].token_ids, best.beams[0].cumulative_logprob) == \
                        (top.token_ids, top.cumulative_logprob), (prompt, width, params.choice)
        # Free text never ends before max_tokens here (the random model says no EOS): nothing to prune. Choices end
        # within a few tokens, and the beams below the best one found stop there.
        assert rows[False][1] == rows[False][0] and rows[True][1] <= rows[True][0] * 3 // 4  # 92 -> 60 when written
        await _idle(engine)
