"""Budget closing's cost per step is bounded whatever the schema (issue 31 item 3): a schema whose
shortest value was ~22k tokens made every engine step take seconds, for every request in the batch.

What is asserted is the structure of the bound stated in asyncpage.guided.budget's docstring, never
a time: a start completion past search.MAX_COMPLETION turns budget closing off for its grammar (the
request still runs); a step that keeps to a long completion sends at most the token it split through
the tokenizer, never the completion; the suffix a model comes back to is found with bounded checks;
a repair search gets GOALS short goals and runs at most SEARCHES_PER_STEP times a step. Times are
printed by scripts/budget_cost.py.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from asyncpage import AsyncEngine, SamplingParams
from asyncpage.guided import GrammarManager, GuidedSpec, budget, search
from asyncpage.guided.budget import ALTERNATIVES, SEARCHES_PER_STEP, guards_for
from asyncpage.model.weights import load_tokenizer

WORDS = "customer shipping address billing invoice account payment status reference total currency region".split()


def long_names(properties: int, name_words: int = 50) -> dict[str, Any]:
    """`properties` required booleans with names of `name_words` words: ~420 bytes a property."""
    rng = random.Random(properties)
    names = [f"p{i}_" + "_".join(rng.choice(WORDS) for _ in range(name_words)) for i in range(properties)]
    return {"type": "object", "properties": {n: {"type": "boolean"} for n in names}, "required": names,
            "additionalProperties": False}


@pytest.fixture(scope="module")
def gemma() -> tuple[GrammarManager, list[int]]:
    tok, config, eos = load_tokenizer(None)
    return GrammarManager(tok, config.vocab_size, sorted(eos), "llguidance"), sorted(eos)


class Counting:
    """Counts the items passed to some methods of the object it stands for."""

    def __init__(self, inner: Any, names: tuple[str, ...]) -> None:
        self._inner, self._names, self.items = inner, names, 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in self._names:
            return attr

        def counted(arg: Any, *rest: Any) -> Any:
            self.items += len(arg)
            return attr(arg, *rest)

        return counted


def _compiled(manager: GrammarManager, schema: Any) -> Any:
    compiled: Any = manager.compile_sync(GuidedSpec("json_schema", json.dumps(schema)))
    compiled.start_completion()
    return compiled


def test_a_schema_whose_shortest_value_passes_the_cap_has_no_budget_closing(
        gemma: tuple[GrammarManager, list[int]]) -> None:
    """~17 KB of required names: the start walk gives up past MAX_COMPLETION (it used to return the
    whole 84 KB value of the issue's schema, and every step re-tokenized it), the plan says so, and
    the grammar's sequences get no closer: they run as with budget_close=False."""
    manager, _ = gemma
    schema = long_names(40)
    compiled = _compiled(manager, schema)
    plan = compiled.start_plan
    assert plan.done and plan.result is None and plan.too_long
    assert compiled.new_matcher().closer(lambda: None) is None
    reached: list[bytes] = []
    assert search.run(search.walk_steps(compiled.byte_template.deep_copy(), search.START_WALK_STEPS, None,
                                        reached)) is None
    assert search.MAX_COMPLETION < len(reached[0]) <= search.MAX_COMPLETION + search.FORCED_LIMIT
    # Under the cap, the same kind of schema is closed as before.
    small = _compiled(manager, long_names(4))
    assert not small.start_plan.too_long and small.start_plan.result is not None
    assert small.new_matcher().closer(lambda: None) is not None


def _drive(manager: GrammarManager, eos: list[int], compiled: Any, schema: Any, want: bytes, slack: int,
           fast_forward: bool, monkeypatch: pytest.MonkeyPatch, rng: random.Random) -> list[dict[str, int]]:
    """A model that writes `want` in its own tokens, while the closer lets it (else the closer's
    completion), with max_tokens `slack` above the shortest value and random allowed alternatives:
    what each step cost, counted (tokenizer bytes, model-matcher tokens checked, tries, searches,
    bytes of the searches' results)."""
    planner = compiled.planner
    real_tok = planner.tok
    counting_tok = Counting(real_tok, ("tokenize_bytes",))
    monkeypatch.setattr(planner, "tok", counting_tok)
    tries = {"n": 0}
    real_try = budget.Closer._try

    def counted_try(self: Any, *args: Any, **kw: Any) -> Any:
        tries["n"] += 1
        return real_try(self, *args, **kw)

    found: list[int] = []
    real_search = budget.search

    def counted_search(*args: Any, **kw: Any) -> Any:
        path = real_search(*args, **kw)
        found.append(len(path) if path is not None else 0)
        return path

    monkeypatch.setattr(budget.Closer, "_try", counted_try)
    monkeypatch.setattr(budget, "search", counted_search)
    m = compiled.new_matcher()
    budget_left = len(compiled.start_plan.result[1]) + slack
    written = b""
    costs: list[dict[str, int]] = []
    while budget_left > 0:
        closer = m.closer(lambda: guards_for(schema, 15, 8))
        assert closer is not None
        counting_m = Counting(closer.m, ("try_consume_tokens", "validate_tokens"))
        closer.m = counting_m
        state = closer.s
        on_script = want.startswith(written) and len(written) < len(want)
        sampled = real_tok.tokenize_bytes(want[len(written): len(written) + 64])[0] if on_script else \
            (state.tokens[0] if state.tokens else eos[0])
        mask = np.unpackbits(np.frombuffer(m._m.compute_bitmask(), np.uint8), bitorder="little")
        allowed = np.flatnonzero(mask[: manager.vocab_size]).tolist()
        options = [rng.choice(allowed) for _ in range(ALTERNATIVES)]
        before = (counting_tok.items, tries["n"], len(found))
        step = closer.step(sampled, budget_left, fast_forward, lambda o=options: o)
        assert step is not None
        costs.append({"tokenized": counting_tok.items - before[0], "checked": counting_m.items,
                      "tries": tries["n"] - before[1], "searches": len(found) - before[2],
                      "searched_bytes": sum(found[before[2]:])})
        token, forced, stopped = step
        written += b"".join(planner.token_bytes(t) for t in [token, *forced] if t not in eos)
        budget_left -= 1 + len(forced)
        if stopped or token in eos:
            break
    assert m.is_accepting(), "the value was not closed"
    return costs


@pytest.mark.parametrize(("slack", "fast_forward"), [(200, True), (2, True), (200, False), (2, False)])
def test_a_step_on_a_long_completion_tokenizes_a_token_not_the_completion(
        gemma: tuple[GrammarManager, list[int]], monkeypatch: pytest.MonkeyPatch, slack: int,
        fast_forward: bool) -> None:
    """A ~6.7 KB (~1.7k-token) completion, a model that writes `false` where it says `true` (so it
    leaves the completion at every property and comes back to its suffix): every try sends at most
    the one token it split through the tokenizer (the longest gemma token here is under 64 bytes),
    and the model's matcher checks as little, beside what a repair search found. It used to be the
    whole remaining completion at every try: 43 KB a step. With max_tokens 2 above the shortest
    value, most tokens do not fit and every alternative is tried. Fast-forward takes each forced name
    in one step; without it (logprobs asked) every name is a hundred steps."""
    manager, eos = gemma
    schema = long_names(16)
    compiled = _compiled(manager, schema)
    path, tokens = compiled.start_plan.result
    assert 6000 < len(path) <= search.MAX_COMPLETION and len(tokens) > 1500
    want = path.replace(b"true", b"false")
    costs = _drive(manager, eos, compiled, schema, want, slack, fast_forward, monkeypatch, random.Random(slack))
    assert len(costs) >= (16 if fast_forward else 1000)
    for c in costs:
        assert c["tries"] <= ALTERNATIVES + 5
        assert c["searches"] <= SEARCHES_PER_STEP
        assert c["tokenized"] <= 64 * c["tries"] + c["searched_bytes"], c
        assert c["checked"] <= 66 * c["tries"] + c["searched_bytes"] + c["searches"], c
    assert max(c["tokenized"] for c in costs if not c["searches"]) <= 64 * (ALTERNATIVES + 5)
    assert 64 * (ALTERNATIVES + 5) < len(path) // 4
    if slack == 200:  # far from the budget: no search, no alternative, no more than one token tokenized
        assert all(c["searches"] == 0 and c["tries"] == 1 and c["tokenized"] <= 64 for c in costs)


def _byte_state(compiled: Any, prefix: bytes) -> Any:
    b = compiled.byte_template.deep_copy()
    assert b.consume_tokens(list(prefix))
    return b


def test_the_suffix_a_model_comes_back_to_is_found_with_bounded_checks(
        gemma: tuple[GrammarManager, list[int]]) -> None:
    """`false` written where the completion has `true`, 16 long properties from the end: the rest
    of the completion is found at once, as the old first-to-last scan found it (which copied every
    suffix: O(n^2) bytes), with at most SUFFIX_BYTES + one suffix checked by the byte matcher."""
    manager, _ = gemma
    compiled = _compiled(manager, long_names(16))
    path = compiled.start_plan.result[0]
    at = path.index(b":true") + 1  # the first value
    shadow = Counting(_byte_state(compiled, path[:at] + b"false"), ("validate_tokens",))
    base = path[at:]
    i, checked = search.suffix_at(shadow, base)
    # Found at the first position tried.
    assert checked <= len(base) + search.PREFIX_CHECK and shadow.items <= len(base) + search.PREFIX_CHECK + 1
    assert i == 4 and base[i:].startswith(b',"p1_')
    assert i == next(j for j in range(len(base) + 1) if search.completes(shadow, base[j:]))
    # Inside a free string every position may start a suffix, and each is checked up to its end:
    # the scan stops after SUFFIX_BYTES, not after len(base) checks of len(base)/2 bytes each.
    two = {"type": "object", "properties": {"s": {"type": "string"}, "n": {"type": "integer"}},
           "required": ["s", "n"], "additionalProperties": False}
    lost = Counting(_byte_state(_compiled(manager, two), b'{"s":"'), ("validate_tokens",))
    base = b"x" * 6000 + b'"}'  # closes s, then lacks n: no suffix of it completes
    assert search.suffix_at(lost, base)[0] is None
    assert lost.items <= search.SUFFIX_BYTES + len(base) + search.SUFFIX_TRIES * (search.PREFIX_CHECK + 2)


def test_a_repair_search_aims_at_the_last_suffixes_only(gemma: tuple[GrammarManager, list[int]],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A sequence without a completion near its budget: the search gets the GOALS shortest suffixes
    of the last known completion, as before, but no longer after building all of them (n^2/2 bytes
    for an n-byte completion, before it even decided whether to search)."""
    manager, _ = gemma
    compiled = _compiled(manager, long_names(16))
    anchor = compiled.start_plan.result[0]
    goals_seen: list[list[bytes]] = []
    real = budget.search

    def recording(m: Any, goals: Any = (), *args: Any) -> Any:
        goals_seen.append(list(goals))
        return real(m, goals, *args)

    monkeypatch.setattr(budget, "search", recording)
    m = compiled.new_matcher()
    closer = m.closer(lambda: None)
    assert closer is not None
    closer.s.path, closer.s.tokens = None, None  # stale: the sequence wandered off while far
    closer.step(compiled.planner.tok.tokenize_bytes(b"{")[0], 40, True, lambda: [])
    assert goals_seen
    old = sorted({anchor[i:] for i in range(len(anchor))}, key=len)[: search.GOALS]
    assert goals_seen[0] == old == [anchor[-k:] for k in range(1, search.GOALS + 1)]


def test_a_search_returns_nothing_longer_than_the_cap(gemma: tuple[GrammarManager, list[int]]) -> None:
    manager, _ = gemma
    compiled = _compiled(manager, long_names(40))
    start = compiled.byte_template.deep_copy()
    assert search.run(search.start_search(start)) is None
    found = search.run(search.search_steps(start, (), search.START_NODES, walk_limit=search.START_WALK_STEPS))
    assert found is None
    small = search.run(search.search_steps(start, (), 10, walk_limit=search.START_WALK_STEPS, max_bytes=1 << 20))
    assert small is not None and len(small) > search.MAX_COMPLETION  # the cap is what stopped it


def test_tokens_kept_for_the_repetition_guard_stay_bounded_in_a_long_string(
        gemma: tuple[GrammarManager, list[int]]) -> None:
    """Every try copies the state; its string tokens were every token of the string so far."""
    manager, _ = gemma
    schema = {"type": "string"}
    compiled = _compiled(manager, schema)
    m = compiled.new_matcher()
    tok = compiled.planner.tok
    words = [tok.tokenize_bytes(w.encode())[0] for w in ("alpha ", "beta ", "gamma ", "delta ", "omega ")]
    rng = random.Random(1)
    guards = guards_for(schema, 15, 8)
    keep = 8 * (guards.max_repeats + 1) + 1
    first = True
    for _ in range(600):
        closer = m.closer(lambda: guards)
        assert closer is not None
        sampled = tok.tokenize_bytes(b'"')[0] if first else rng.choice(words)
        first = False
        step = closer.step(sampled, 10_000, True, lambda: [])
        assert step is not None and not step[2]
        assert len(closer.s.string_tokens) <= 2 * keep
    assert len(closer.s.string_tokens) >= keep  # the guard still sees its whole window


def test_rest_spells_the_suffix_from_the_kept_tokens(gemma: tuple[GrammarManager, list[int]]) -> None:
    manager, _ = gemma
    compiled = _compiled(manager, long_names(8))
    path, tokens = compiled.start_plan.result
    planner = compiled.planner
    tokens_m = compiled.new_matcher()._m
    for i in [*range(0, 40), *range(40, len(path), 97), len(path) - 3, len(path)]:
        rest = planner.rest(tokens_m, path, tokens, i)
        assert b"".join(planner.token_bytes(t) for t in rest) == path[i:]
        assert rest[-len(tokens) // 3:] == tokens[-len(tokens) // 3:] or i > len(path) * 2 // 3


@pytest.fixture(scope="module")
async def tiny_engine(tiny_llama: Any) -> AsyncIterator[AsyncEngine]:
    async with AsyncEngine.from_pretrained(str(tiny_llama), dtype="float32") as engine:
        yield engine


async def test_a_request_past_the_cap_still_runs_and_others_still_close(tiny_engine: AsyncEngine) -> None:
    """The grammar over the cap: its request runs to max_tokens, cut as without budget closing; a
    request with an ordinary schema next to it is still closed within its max_tokens."""
    import jsonschema

    schema = long_names(40)
    spec = GuidedSpec.from_params(SamplingParams(json_schema=schema))
    assert spec is not None
    compiled: Any = await tiny_engine.guided.compile(spec)
    for _ in range(200):
        if compiled.start_plan.done:
            break
        await asyncio.sleep(0.05)
    assert compiled.start_plan.too_long
    cut = await tiny_engine.generate("x", SamplingParams(json_schema=schema, max_tokens=12, temperature=1.0, seed=2))
    assert cut.finish_reason == "length" and len(cut.choices[0].token_ids) <= 12
    small = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
             "required": ["a", "b"], "additionalProperties": False}
    out = await tiny_engine.generate("x", SamplingParams(json_schema=small, max_tokens=16, temperature=1.0, seed=2))
    assert len(out.choices[0].token_ids) <= 16
    jsonschema.validate(json.loads(out.text), small)
