"""Budget closing (`SamplingParams(budget_close=True)`): guided output closes validly within max_tokens.

Without a model: every JSONSchemaBench dev schema that compiles is driven by a random policy over the
tokens its mask allows, through the same Closer the runner uses, with max_tokens just above the
shortest valid value and a little further; every output must take the grammar to an accepting state
and validate with jsonschema. With the tiny random model (one engine for the module): the engine
closes values (n > 1, fast-forward, extract, extract_many), says "length" when the budget forced the
close, searches each grammar's start completion on the grammar compile thread only, and closes
values without it while that search has not finished.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import numpy as np
import pytest

from asyncpage import AsyncEngine, SamplingParams
from asyncpage.decoding.guided_step import closer_for
from asyncpage.decoding.sampling import SampleSpec
from asyncpage.errors import ExtractionError, GrammarError, InvalidRequestError
from asyncpage.guided import GrammarManager, GuidedSpec, budget
from asyncpage.guided.budget import guards_for
from asyncpage.guided.guards import lex, refusal
from asyncpage.guided.xgr import XGrammarMatcher, XgrRaw
from asyncpage.model.weights import load_tokenizer
from tests.conftest import SHARED

# Disagreements between llguidance and jsonschema that exist without budget closing (a random policy
# finds them): year 0000 in `format: date`, and a `^.+$` patternProperties value the grammar lets through.
KNOWN_GRAMMAR_GAPS = {"Github_medium---o36591", "Glaiveai2K---book_flight_8c6c9028"}


@pytest.fixture(scope="module")
def gemma() -> tuple[Any, GrammarManager, list[int]]:
    tok, config, eos = load_tokenizer(None)
    return tok, GrammarManager(tok, config.vocab_size, sorted(eos), "llguidance"), sorted(eos)


class _Uniform:
    """Uniform draws among the tokens a mask allows: by rejection over the whole vocabulary where many
    are allowed (inside strings), else from the list of allowed ids (unpacking a 262k-bit mask each
    step was a third of this test's time)."""

    def __init__(self, mask: bytes, vocab: int, rng: random.Random, skip: frozenset[int] = frozenset()) -> None:
        self.words = np.frombuffer(mask, dtype=np.uint32)
        self.vocab, self.rng, self.skip = vocab, rng, skip
        self.ids: np.ndarray | None = None

    def __call__(self) -> int:
        for _ in range(32):
            t = self.rng.randrange(self.vocab)
            if (int(self.words[t >> 5]) >> (t & 31)) & 1 and t not in self.skip:
                return t
        if self.ids is None:
            ids = np.flatnonzero(np.unpackbits(self.words.view(np.uint8), bitorder="little"))
            self.ids = np.array([t for t in ids.tolist() if t < self.vocab and t not in self.skip])
        return int(self.ids[self.rng.randrange(len(self.ids))])


def _drive(compiled: Any, schema: Any, budget: int, rng: random.Random, eos: list[int], vocab: int,
           skip: frozenset[int] = frozenset()) -> tuple[list[int], Any, list[float]]:
    """A random policy over the allowed tokens (but `skip`), through the budget closer: (tokens,
    matcher, step seconds)."""
    m = compiled.new_matcher()
    closer = m.closer(lambda: guards_for(schema, 15, 8))
    raw = m._m if not isinstance(m, XGrammarMatcher) else XgrRaw(m._m, vocab)
    out: list[int] = []
    times: list[float] = []
    while len(out) < budget:
        draw = _Uniform(raw.compute_bitmask(), vocab, rng, skip)
        ends = [e for e in eos if raw.is_accepting()]
        sampled = ends[0] if ends and rng.random() < 0.3 else draw()
        t = time.perf_counter()
        step = closer.step(sampled, budget - len(out), True, lambda d=draw: [d() for _ in range(8)])
        times.append(time.perf_counter() - t)
        if step is None:
            return out, None, times  # the grammar refused a token its own mask allowed (not ours)
        token, forced, stopped = step
        out += [token, *forced][: budget - len(out)]
        if token in eos or stopped:
            break
    return out, m, times


@pytest.mark.heavy  # `make test-heavy`: every schema of the bench set driven by a random policy (~35 s)
@pytest.mark.skipif(not (SHARED / "jsonschemabench-dev").exists(), reason="../shared/data is not next to this checkout")
def test_random_policy_outputs_close_and_validate_within_budget(gemma: tuple[Any, GrammarManager, list[int]]) -> None:
    import jsonschema

    _tok, manager, eos = gemma
    planner_tok = manager.backend()._tok  # type: ignore[attr-defined]
    rng = random.Random(17)
    runs = no_start = refused_by_grammar = 0
    bad: list[str] = []
    steps: list[float] = []
    for i, f in enumerate(sorted((SHARED / "jsonschemabench-dev").glob("*.json"))):
        schema = json.loads(f.read_text())["schema"]
        try:
            compiled = manager.compile_sync(GuidedSpec("json_schema", json.dumps(schema)))
        except GrammarError:
            continue
        if compiled.start_completion() is None:  # type: ignore[attr-defined]
            no_start += 1  # the bounded search found no completion: closing starts without one
            continue
        shortest = len(compiled.start_plan.result[1])  # type: ignore[attr-defined]
        budget = shortest + [0, 1, 2, 3 + rng.randrange(14)][i % 4]
        tokens, matcher, times = _drive(compiled, schema, budget, rng, eos, manager.vocab_size)
        steps += times
        runs += 1
        if matcher is None:
            refused_by_grammar += 1
            continue
        text = planner_tok.decode_bytes([t for t in tokens if t not in eos]).decode("utf-8", "replace")
        assert len(tokens) <= budget
        if not matcher.is_accepting():
            bad.append(f"{f.stem}: not closed within {budget} (shortest {shortest}): {text[:200]!r}")
            continue
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        try:
            cls(schema).validate(json.loads(text))
        except (ValueError, jsonschema.ValidationError) as exc:
            if f.stem not in KNOWN_GRAMMAR_GAPS:
                bad.append(f"{f.stem}: {str(exc)[:200]} in {text[:200]!r}")
    steps.sort()
    print(f"{runs} runs, {no_start} schemas without a start completion, {refused_by_grammar} runs where the "
          f"grammar refused its own mask's token; step p50 {steps[len(steps) // 2] * 1e3:.2f} ms, "
          f"p99 {steps[int(0.99 * len(steps))] * 1e3:.1f} ms")
    assert bad == []
    assert runs > 300
    # 2 of 383 (scripts/budget_start_coverage.py says which, and why); 24 before the walk.
    assert no_start <= 4


@pytest.mark.skipif(not (SHARED / "jsonschemabench-dev").exists(), reason="../shared/data is not next to this checkout")
def test_xgrammar_closes_within_budget_too(tiny_llama: Any) -> None:
    """The same random policy through the xgrammar backend (its matchers behind XgrRaw), on every
    third dev schema it compiles; the tiny model's tokenizer keeps its compiles cheap."""
    import jsonschema
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    eos = [tok.eos_token_id]
    manager = GrammarManager(tok, vocab, eos, "xgrammar")
    backend: Any = manager.backend()
    # Never sampled: tokens the two libraries read differently (the tiny tokenizer's 0xFF byte, which
    # llguidance keeps for its own markers), and raw control characters, which xgrammar lets into a
    # string with minLength (its own gap, budget closing or not: `"\x00\x00"` for minLength 2).
    xgr_bytes = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=eos).decoded_vocab
    skip = frozenset(t for t in range(vocab) if backend.planner.token_bytes(t) != xgr_bytes[t]
                     or any(b < 0x20 for b in xgr_bytes[t]))
    rng = random.Random(11)
    runs = 0
    no_start: list[str] = []
    for i, f in enumerate(sorted((SHARED / "jsonschemabench-dev").glob("*.json"))[::3]):
        schema = json.loads(f.read_text())["schema"]
        try:
            compiled = manager.compile_sync(GuidedSpec("json_schema", json.dumps(schema)))
        except GrammarError:
            continue
        if compiled.start_completion() is None:  # type: ignore[attr-defined]
            # The search is bounded by its thread's CPU time (START_SECONDS): a slower CPU may give up
            # on a rare big schema, whose closing then starts without a plan.
            no_start.append(f.stem)
            continue
        budget = len(compiled.start_plan.result[1]) + [0, 2, 5][i % 3]  # type: ignore[attr-defined]
        tokens, matcher, _ = _drive(compiled, schema, budget, rng, eos, vocab, skip)
        assert matcher is not None and len(tokens) <= budget
        assert matcher.is_accepting() or matcher.is_terminated(), f"{f.stem}: not closed within {budget}"
        jsonschema.validate(json.loads(tok.decode([t for t in tokens if t not in eos])), schema)
        runs += 1
    assert runs > 50 and len(no_start) <= 2, no_start


def test_params_check_budget_fields() -> None:
    assert SamplingParams().budget_close is True
    with pytest.raises(InvalidRequestError, match="budget_close"):
        SamplingParams(budget_close=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="max_number_digits"):
        SamplingParams(max_number_digits=-1)


def test_guards_are_off_where_the_schema_asks_for_long_values() -> None:
    g = guards_for({"type": "object", "properties": {"n": {"type": "integer", "maximum": 10**20}}}, 15, 8)
    assert g.max_digits == 0 and g.max_repeats == 8
    g = guards_for({"type": "string", "minLength": 200}, 15, 8)
    assert g.max_digits == 15 and g.max_repeats == 0


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
    "type": "string"}}, "n": {"type": "integer"}}, "required": ["name", "tags", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
async def tiny_engine(tiny_llama: Any) -> AsyncIterator[AsyncEngine]:
    async with AsyncEngine.from_pretrained(str(tiny_llama), dtype="float32") as engine:
        yield engine


async def test_engine_closes_json_within_max_tokens_for_every_sample(tiny_engine: AsyncEngine) -> None:
    import jsonschema

    # 26: two tokens above SCHEMA's shortest value on the tiny tokenizer (24 in json.dumps' spelling, 22 compact).
    for max_tokens in (26, 40):
        out = await tiny_engine.generate("x", SamplingParams(json_schema=SCHEMA, max_tokens=max_tokens, n=3,
                                                             temperature=1.0, seed=3))
        for c in out.choices:
            assert len(c.token_ids) <= max_tokens
            jsonschema.validate(json.loads(c.text), SCHEMA)
            assert c.finish_reason in ("stop", "length")
    cut = await tiny_engine.generate("x", SamplingParams(json_schema=SCHEMA, max_tokens=24, temperature=1.0, seed=3,
                                                         budget_close=False))
    assert cut.finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(cut.text)  # without budget closing a random model's value is cut


class Item(msgspec.Struct):
    name: str
    tags: list[str]
    n: int


async def test_extract_marks_a_value_closed_early(tiny_engine: AsyncEngine) -> None:
    # Two tokens above the shortest value on the tiny tokenizer, `{"name": "", "tags": [], "n": 0}` (24 tokens
    # in json.dumps' spelling, 22 compact).
    params = SamplingParams(max_tokens=26, temperature=1.0, seed=5)
    with pytest.raises(ExtractionError) as e:
        await tiny_engine.extract("x", Item, params)
    assert e.value.reason == "closed_early" and e.value.has_value and isinstance(e.value.value, Item)
    results = [r async for r in tiny_engine.extract_many([{"text": "a"}, {"text": "b"}], Item, params=params)]
    assert all(r.ok and r.closed_early and isinstance(r.value, Item) for r in results)


def _schema(key: str) -> dict[str, Any]:
    """SCHEMA under a property name of its own: a grammar no other test compiled (the cache is per engine)."""
    return {**SCHEMA, "properties": {**SCHEMA["properties"], key: {"type": "boolean"}}, "required": [key, "n"]}


async def test_xgrammar_engine_closes_json_within_max_tokens(tiny_llama: Any) -> None:
    import jsonschema

    async with AsyncEngine.from_pretrained(str(tiny_llama), dtype="float32", guided_backend="xgrammar") as engine:
        out = await engine.generate("x", SamplingParams(json_schema=SCHEMA, max_tokens=26, n=3, temperature=1.0,
                                                        seed=3))
    for c in out.choices:
        assert len(c.token_ids) <= 26
        jsonschema.validate(json.loads(c.text), SCHEMA)


async def test_steps_never_run_the_start_search(tiny_engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 17's stall: the start search used to run on the compute thread at a grammar's first step.
    Now the grammar compile thread runs it, after the compile and outside its time bound."""
    real = budget.start_search
    threads: list[str] = []

    def recording(*args: Any, **kw: Any) -> Any:
        threads.append(threading.current_thread().name)
        return (yield from real(*args, **kw))

    monkeypatch.setattr(budget, "start_search", recording)
    spec = GuidedSpec.from_params(SamplingParams(json_schema=_schema("first")))
    assert spec is not None
    out = await tiny_engine.generate("x", SamplingParams(json_schema=_schema("first"), max_tokens=30, n=2,
                                                         temperature=1.0, seed=7))
    assert all(json.loads(c.text)["first"] in (True, False) for c in out.choices)
    compiled = await tiny_engine.guided.compile(spec)
    assert compiled.start_plan.done and compiled.start_plan.result is not None  # type: ignore[attr-defined]
    assert threads and all(t.startswith("asyncpage-grammar") for t in threads), threads


async def test_values_close_while_the_start_search_is_unfinished(tiny_engine: AsyncEngine,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A grammar whose start search has not finished (or found nothing) still closes: its sequences
    start without a start completion and repair one once their budget is near; nothing waits."""
    real = budget.start_search
    release = threading.Event()

    def held(*args: Any, **kw: Any) -> Any:
        while not release.is_set():
            release.wait(0.01)
            yield  # the compile thread runs it in slices: this one never ends until released
        return (yield from real(*args, **kw))

    monkeypatch.setattr(budget, "start_search", held)
    schema = _schema("held")
    try:
        out = await tiny_engine.generate("x", SamplingParams(json_schema=schema, max_tokens=24, n=2, temperature=1.0,
                                                             seed=9))
        spec = GuidedSpec.from_params(SamplingParams(json_schema=schema))
        assert spec is not None
        assert not (await tiny_engine.guided.compile(spec)).start_plan.done  # type: ignore[attr-defined]
        for c in out.choices:
            assert len(c.token_ids) <= 24
            json.loads(c.text)
    finally:
        release.set()


async def test_chat_tool_call_cut_by_max_tokens_is_closed_and_returned(tiny_models: dict[str, Any],
                                                                         tmp_path: Any) -> None:
    import shutil

    from asyncpage.chat import prepare
    from tests import chat_templates

    d = tmp_path / "qwen2"
    shutil.copytree(tiny_models["qwen2"][0], d)
    (d / "chat_template.jinja").write_text(chat_templates.HERMES)
    tools = [{"type": "function", "function": {"name": "w", "parameters": {
        "type": "object", "properties": {"c": {"type": "string"}}, "required": ["c"], "additionalProperties": False}}}]
    msgs = [{"role": "user", "content": "Weather?"}]
    engine = AsyncEngine.from_pretrained(d, dtype="float32", num_kv_blocks=64)
    async with engine:
        turn = await prepare(engine, msgs, tools=tools, tool_choice="required", parallel_tool_calls=False,
                             params=SamplingParams(max_tokens=200, seed=0))
        spec = GuidedSpec.from_params(turn.params)
        assert spec is not None
        compiled = engine.guided.compile_sync(spec)
        assert compiled.start_completion() is not None  # type: ignore[attr-defined]
        shortest = len(compiled.start_plan.result[1])  # type: ignore[attr-defined]
        res = await engine.chat(msgs, tools=tools, tool_choice="required", parallel_tool_calls=False,
                                params=SamplingParams(max_tokens=shortest + 4, seed=0))
        assert res.usage.completion_tokens <= shortest + 4
        assert [c.name for c in res.tool_calls] == ["w"], res
        assert isinstance(json.loads(res.tool_calls[0].arguments)["c"], str)
        assert res.finish_reason == "length"  # the budget closed the call: it is returned, and says so


def _scripted(manager: GrammarManager, eos: list[int], schema: Any, wanted: str, budget: int = 200,
              params: SamplingParams | None = None) -> str:
    """A model that wants to write `wanted` (one byte at a time, then its end token; once the closer
    took it elsewhere, the first token the grammar allows), through the budget closer with the
    guards of `params` (default: `schema` as its json_schema): the text it ends up with."""
    tok = manager.backend()._tok  # type: ignore[attr-defined]
    params = params or SamplingParams(json_schema=schema)
    spec = GuidedSpec("grammar", params.grammar) if params.grammar else GuidedSpec("json_schema", json.dumps(schema))
    compiled = manager.compile_sync(spec)
    compiled.start_completion()  # type: ignore[attr-defined]
    m = compiled.new_matcher()
    closer = closer_for(m, SampleSpec(seq_id=0, params=params, generator=None, budget=budget))
    assert closer is not None
    want, out = wanted.encode(), list[int]()
    while len(out) < budget:
        done = len(tok.decode_bytes([t for t in out if t not in eos]))
        sampled = tok.tokenize_bytes(want[done : done + 1])[0] if done < len(want) else eos[0]
        if m._m.validate_tokens([sampled]) != 1:  # type: ignore[attr-defined]
            mask = np.unpackbits(np.frombuffer(m._m.compute_bitmask(), np.uint8), bitorder="little")  # type: ignore[attr-defined]
            sampled = int(np.flatnonzero(mask)[0])
        step = closer.step(sampled, budget - len(out), True, lambda: [])
        assert step is not None
        token, forced, stopped = step
        out += [token, *forced]
        if stopped or token in eos:
            break
    text: str = tok.decode_bytes([t for t in out if t not in eos]).decode()
    return text


def test_long_numbers_a_float_bound_asks_for_are_not_cut_by_the_digit_guard(
        gemma: tuple[Any, GrammarManager, list[int]]) -> None:
    _tok, manager, eos = gemma
    assert guards_for({"type": "number", "minimum": 1e17}, 15, 8).max_digits == 0  # 18 digits, not `1e+17`
    assert guards_for({"type": "number", "exclusiveMaximum": 1e-17}, 15, 8).max_digits == 0
    assert guards_for({"type": "number", "maximum": 1e5}, 15, 8).max_digits == 15
    number = "123456789012345678901234"
    assert _scripted(manager, eos, {"type": "integer", "minimum": 1e17}, number) == number  # was ...345000000000


def test_a_runaway_top_level_number_ends_at_the_digit_limit(gemma: tuple[Any, GrammarManager, list[int]]) -> None:
    _tok, manager, eos = gemma
    assert _scripted(manager, eos, {"type": "integer"}, "1234567890123456789012345") == "123456789012345"


def test_a_json_grammar_keeps_the_guards_where_it_says_so(gemma: tuple[Any, GrammarManager, list[int]]) -> None:
    """Extraction's retry grammar (a Lark grammar of `%json` blocks) for a number that refused 12, and a model
    that wants 12345678: with json_guards (as extraction asks) the digit guard ends the number as soon as the
    grammar lets it past the limit; without, the model's digits run on, as any grammar's output may."""
    from asyncpage.extract.retry import rest_grammar

    _tok, manager, eos = gemma
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    lark = rest_grammar(schema, "n", " ", [12], {"item_separator": ", ", "key_separator": ": "})
    assert lark is not None
    guarded = SamplingParams(grammar=lark, json_guards=True, max_number_digits=2)
    assert _scripted(manager, eos, schema, " 12345678}", params=guarded) == " 120}"  # 12 may not end: one more digit
    free = SamplingParams(grammar=lark, max_number_digits=2)
    assert _scripted(manager, eos, schema, " 12345678}", params=free) == " 12345678}"


def test_repetition_guard_leaves_a_string_the_schema_keeps_open_as_written(
        gemma: tuple[Any, GrammarManager, list[int]]) -> None:
    """A repeating string that the schema does not let end yet is left to the model (it used to get
    the start completion's bytes written into it: `11111111011111111011`), and ends where it may."""
    _tok, manager, eos = gemma
    schema = {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[0-9]{20}$"}}, "required": ["id"]}
    value = '{"id":"' + "1" * 20 + '"}'
    assert _scripted(manager, eos, schema, value) == value
    assert _scripted(manager, eos, {"type": "string", "minLength": 30}, '"' + "ab" * 40 + '"') == '"' + "ab" * 15 + '"'
    assert _scripted(manager, eos, {"type": "string"}, '"' + "ab" * 40 + '"') == '"' + "ab" * 8 + 'a"'


async def test_extract_many_never_returns_a_forced_value_max_tokens_cut(tiny_engine: AsyncEngine) -> None:
    """`{"const": 12345678}` under max_tokens=3: the grammar forces all 8 digits, the output keeps
    `123`. The sequence's matcher took all of them (accepting), so extract_many used to return 123,
    `ok` and closed early, a value the schema refuses; it is cut, as extract() says."""
    schema = {"const": 12345678}
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=1)
    out = await tiny_engine.generate("x", msgspec.structs.replace(params, json_schema=schema))
    assert out.finish_reason == "length" and out.text == "123"
    [r] = [r async for r in tiny_engine.extract_many(["a"], schema, params=params)]
    assert not r.ok and not r.closed_early and r.error is not None and r.error.reason == "truncated"
    with pytest.raises(ExtractionError) as e:
        await tiny_engine.extract("x", schema, params)
    assert e.value.reason == "truncated"


def test_a_date_the_budget_closes_is_a_calendar_date(gemma: tuple[Any, GrammarManager, list[int]]) -> None:
    """`format: date` used to close as `0000-09-09` (llguidance lets year 0000 and Feb 30 through;
    zeros come first in the start search): a value jsonschema refuses. The format is narrowed to the
    calendar's dates."""
    import jsonschema

    _tok, manager, eos = gemma
    schema = {"type": "object", "properties": {"note": {"type": "string"}, "d": {"type": "string", "format": "date"}},
              "required": ["note", "d"], "additionalProperties": False}
    compiled = manager.compile_sync(GuidedSpec("json_schema", json.dumps(schema)))
    shortest = len(compiled.start_plan.result[1]) if compiled.start_completion() else 0  # type: ignore[attr-defined]
    text = _scripted(manager, eos, schema, '{"note":"the meeting moved to the week after","d":"2024-01-15"}',
                     budget=shortest + 3)
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    jsonschema.Draft202012Validator(schema, format_checker=checker).validate(json.loads(text))
    date = {"type": "string", "format": "date"}
    m = manager.compile_sync(GuidedSpec("json_schema", json.dumps(date))).new_matcher()
    tok = manager.backend()._tok  # type: ignore[attr-defined]
    for value, ok in [("2024-02-29", True), ("2023-12-31", True), ("0000-09-09", False), ("2023-02-29", False),
                      ("2023-04-31", False)]:
        ids = tok.tokenize_str(json.dumps(value))
        accepted = all(m.accept(t) for t in ids) and m.is_accepting()
        m.rollback(len(ids))
        assert accepted == ok == checker.conforms(value, "date"), value


def test_budget_closing_gives_up_on_a_branch_that_forces_bytes_forever(tiny_llama: Any) -> None:
    """xgrammar: past `{` of anyOf [a required self-reference, an integer], every state forces
    `"next":{` without end. The repair search drops such states in bounded time and memory (it ran
    out of memory asking xgrammar for the forced string), and an integer still closes."""
    from transformers import AutoTokenizer

    from asyncpage.guided import search

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    manager = GrammarManager(tok, vocab, [tok.eos_token_id], "xgrammar")
    endless = {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                               "required": ["next"], "additionalProperties": False}}}
    schema = {**endless, "anyOf": [{"$ref": "#/$defs/n"}, {"type": "integer"}]}
    g: Any = manager.compile_sync(GuidedSpec("json_schema", json.dumps(schema)))
    assert g.start_completion() is not None
    raw = g.byte_template.deep_copy()
    assert raw.consume_tokens(list(b"{"))
    t = time.monotonic()
    assert len(raw.compute_ff_bytes()) == search.FORCED_LIMIT
    assert search.search(raw) is None and search.run(search.start_search(raw)) is None
    assert time.monotonic() - t < 10


def test_number_exponents_stay_within_what_json_readers_take() -> None:
    """`8.76e30264` is valid JSON that msgspec refuses (out of range): the digit guard, which restarts
    at `e`, allows an exponent of two digits at most, in one token or several."""
    guards = guards_for({"type": "number"}, 12, 0)
    for before, token in [("8.76e30", b"2"), ("8.76e", b"302"), ("8.76", b"e+302"), ("1E-9", b"99")]:
        state = budget.CloseState()
        lex(state, before.encode())
        assert refusal(guards, state, 0, token) == "digits", (before, token)
    state = budget.CloseState()
    lex(state, b"8.76e3")
    assert refusal(guards, state, 0, b"0") is None
    state = budget.CloseState()
    lex(state, b"123456789")
    assert refusal(guards, state, 0, b"012") is None  # the mantissa keeps its own limit
