"""Input fuzzing on a tiny random Llama: hypothesis over SamplingParams values (hostile floats, huge
ints, bools and strings where numbers belong), prompts (unicode with surrogates and control
characters, empty, ~200k characters, token-id lists with negatives, out-of-vocabulary ids, bools,
numpy ints), JSON Schemas (JSONSchemaBench's, generated and mutated), regexes and Lark grammars (valid
and not).

Every outcome is a value or a typed AsyncPageError raised at submission; the engine never dies; a
request in flight next to each fuzzed one (and a long one started before all of them) completes
normally. An output under a grammar is accepted by that grammar, under a regex it matches, under a
schema it validates with jsonschema.

Each defect this found has its own test at the end of the file (they were strict xfails until fixed).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import jsonschema
import numpy as np
import pytest
from anyio.abc import TaskStatus
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from asyncpage import AsyncEngine, SamplingParams
from asyncpage.core.request import Request
from asyncpage.errors import AsyncPageError, GrammarError, InvalidRequestError, SamplingError
from asyncpage.guided import GuidedSpec

from .conftest import SHARED

EXAMPLES = int(os.environ.get("ASYNCPAGE_FUZZ_EXAMPLES", "30"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, print_blob=True,
                derandomize=not os.environ.get("ASYNCPAGE_FUZZ_RANDOM"),  # ASYNCPAGE_FUZZ_RANDOM=1: new examples
                phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large, HealthCheck.filter_too_much])
VOCAB = 320
TIMEOUT = 30.0

# Inputs that currently end in an untyped exception or kill the engine: each has an xfail test below.


# ---- the engine every example talks to (on a background loop, as an app thread would) --------------
@dataclass
class Served:
    engine: AsyncEngine
    portal: BlockingPortal
    long: Request

    def __repr__(self) -> str:
        return "Served(tiny llama)"

    def call(self, fn: Any, *args: Any) -> Any:
        async def bounded() -> Any:
            with anyio.fail_after(TIMEOUT):
                return await fn(*args)

        return self.portal.call(bounded)


@pytest.fixture(scope="module")
def served(tiny_llama: Path) -> Iterator[Served]:
    engine = AsyncEngine.from_pretrained(str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=160,
                                         max_num_batched_tokens=64, max_num_seqs=8, grammar_compile_timeout=3.0,
                                         debug_checks=True)
    stop = anyio.Event()

    async def host(*, task_status: TaskStatus[None]) -> None:
        nonlocal stop
        stop = anyio.Event()
        async with engine:
            task_status.started()
            await stop.wait()

    with start_blocking_portal() as portal:
        host_future, _ = portal.start_task(host)
        # A long request in flight from before the first fuzzed input to after the last: never read
        # until the end, so it also exercises merged output.
        long = portal.call(engine.submit, "The quick brown fox", SamplingParams(max_tokens=480, temperature=0,
                                                                               ignore_eos=True))
        yield Served(engine, portal, long)
        portal.call(stop.set)
        host_future.result(TIMEOUT)


async def run_request(engine: AsyncEngine, prompt: Any, params: Any) -> tuple[str, Any]:
    """("refused", error) when submission raised a typed error; ("done", outputs) with per-sample
    (text, token ids, finish reason); ("failed", error) for an error after submission."""
    try:
        req = await engine.submit(prompt, params)
    except AsyncPageError as exc:
        assert engine.healthy
        return "refused", exc
    return await read_all(engine, req)


async def read_all(engine: AsyncEngine, req: Request) -> tuple[str, Any]:
    n = req.params.n
    texts, ids, reasons = [""] * n, [[] for _ in range(n)], [None] * n  # type: list[str], list[list[int]], list[Any]
    try:
        while any(r is None for r in reasons):
            for c in await req.mailbox.get():
                texts[c.index] += c.text
                ids[c.index] += c.token_ids
                if c.finish_reason is not None:
                    reasons[c.index] = c.finish_reason
    except AsyncPageError as exc:
        return "failed", exc
    finally:
        engine.abort(req)
    return "done", list(zip(texts, ids, reasons, strict=True))


async def with_bystander(engine: AsyncEngine, prompt: Any, params: Any) -> tuple[str, Any]:
    """Run the fuzzed request next to an ordinary one, which must come out whole."""
    result: list[tuple[str, Any]] = []
    bystander: list[tuple[str, Any]] = []
    async with anyio.create_task_group() as tg:
        async def fuzzed() -> None:
            result.append(await run_request(engine, prompt, params))

        async def normal() -> None:
            bystander.append(await run_request(engine, "Paged attention",
                                               SamplingParams(max_tokens=6, ignore_eos=True)))

        tg.start_soon(fuzzed)
        tg.start_soon(normal)
    kind, outs = bystander[0]
    assert kind == "done" and len(outs[0][1]) == 6 and outs[0][2] == "length", bystander
    assert engine.healthy, engine.stats().engine_error
    return result[0]


def check_done(params: SamplingParams, outs: list[tuple[str, list[int], Any]]) -> None:
    assert len(outs) == params.n
    for text, toks, reason in outs:
        assert reason in ("stop", "length"), (text, toks, reason)
        assert 1 <= len(toks) <= params.max_tokens or (reason == "stop" and len(toks) <= params.max_tokens)
        assert all(0 <= t < VOCAB for t in toks)


# ---- SamplingParams ------------------------------------------------------------------------------
HOSTILE: st.SearchStrategy[Any] = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.0, 1e-40, 5e-324, 1e308, -1e308, 2**63, -(2**63),
                     2**62, -1, 0, 1, 2, 20, 21, True, False, None, "1", "", 1.5, -1.5, 0.5, 1.0, [1], {}]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**70), 2**70),
)
SMALL_TOKENS = st.one_of(st.integers(1, 8), st.integers(10**6, 2**70), HOSTILE)
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"]


@st.composite
def hostile_params(draw: st.DrawFn) -> dict[str, Any]:
    kw: dict[str, Any] = {"max_tokens": draw(SMALL_TOKENS)}
    for name in [*FLOAT_FIELDS, "top_k", "logprobs"]:
        if draw(st.booleans()):
            kw[name] = draw(HOSTILE)
    if draw(st.booleans()):
        kw["repetition_penalty"] = draw(st.one_of(st.sampled_from([math.nan, math.inf, 0.0, -1.0, 1e-40, 1e30, True,
                                                                   None, "1", 0.5, 2.0]), st.floats(1e-40, 1e30)))
    if draw(st.booleans()):
        kw["n"] = draw(st.one_of(st.integers(-3, 12), HOSTILE))
    if draw(st.booleans()):
        kw["seed"] = draw(st.one_of(st.none(), st.integers(-(2**80), 2**80), st.sampled_from([True, 1.5, "7"])))
    if draw(st.booleans()):
        kw["stop"] = draw(st.one_of(st.text(max_size=4), st.lists(st.one_of(st.text(max_size=4), st.integers(),
                                                                            st.none()), max_size=3)))
    if draw(st.booleans()):
        kw["stop_token_ids"] = draw(st.lists(st.one_of(st.integers(-5, 400), st.booleans(), st.just(2**70),
                                                       st.just(1.0)), max_size=3))
    if draw(st.booleans()):
        kw["ignore_eos"] = draw(st.booleans())
    if draw(st.booleans()):
        kw["cache_salt"] = draw(st.one_of(st.none(), st.text(max_size=5), st.integers(), st.just("\ud800")))
    if draw(st.booleans()):
        kw[draw(st.sampled_from(["not_a_field", "best_of"]))] = 1
    return kw


@FUZZ
@given(kw=hostile_params(), prompt=st.sampled_from(["The quick brown fox", [5, 6, 7], "x"]))
def test_any_sampling_params_give_a_value_or_a_typed_error(served: Served, kw: dict[str, Any],
                                                           prompt: Any) -> None:
    try:
        params = SamplingParams(**kw)
    except AsyncPageError:
        return
    except TypeError as exc:  # unknown field names: msgspec's own refusal, at construction
        assert "unexpected keyword" in str(exc).lower() and ("not_a_field" in kw or "best_of" in kw), exc
        return
    kind, out = served.call(with_bystander, served.engine, prompt, params)
    if kind == "refused":
        assert isinstance(out, InvalidRequestError), out
    else:
        assert kind == "done", out
        check_done(params, out)


# ---- prompts -------------------------------------------------------------------------------------
ANY_CHAR = st.characters(codec=None, exclude_categories=())  # surrogates and control characters included
HUGE = ["a" * 200_000, "🙂" * 70_000, "The quick brown fox. " * 10_000, "\x00" * 200_000]
PROMPTS = st.one_of(
    st.text(ANY_CHAR, max_size=40),
    st.text(st.sampled_from("abc \n\t\x00\x1b🙂日本é\u200b\ufeff\ud800\udfff"), max_size=30),
    st.sampled_from([*HUGE, "", " ", "\ud83d", "a\udc00b"]),
    st.lists(st.one_of(st.integers(-3, VOCAB + 3), st.integers(0, VOCAB - 1), st.booleans(), st.just(2**70),
                       st.builds(np.int64, st.integers(0, VOCAB - 1)), st.just(1.0), st.none()), max_size=20),
    st.lists(st.integers(0, VOCAB - 1), min_size=600, max_size=700),
    st.sampled_from([(), (5, 6), b"abc", 7, None, {"text": "hi"}]),
)


@FUZZ
@given(prompt=PROMPTS)
def test_any_prompt_gives_a_value_or_a_typed_error(served: Served, prompt: Any) -> None:
    params = SamplingParams(max_tokens=3, temperature=0.8, seed=1)
    kind, out = served.call(with_bystander, served.engine, prompt, params)
    if kind == "refused":
        assert isinstance(out, InvalidRequestError), out
    else:
        assert kind == "done", out
        check_done(params, out)


# ---- JSON Schemas --------------------------------------------------------------------------------
def _bench_schemas() -> list[Any]:
    root = SHARED / "jsonschemabench-dev"
    if not root.is_dir():
        return [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}]
    return [json.loads(p.read_text())["schema"] for p in sorted(root.glob("*.json"))]


BENCH = _bench_schemas()
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=3),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                      max_size=3), max_leaves=6)
KEYWORDS = ["type", "properties", "required", "items", "enum", "const", "minimum", "maximum", "pattern", "format",
            "minLength", "maxLength", "anyOf", "oneOf", "allOf", "not", "$ref", "additionalProperties",
            "uniqueItems", "minItems", "maxItems", "if", "then", "x-unknown"]


def _paths(schema: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(schema, dict):
        for k, v in schema.items():
            out += _paths(v, (*path, k))
    elif isinstance(schema, list):
        for i, v in enumerate(schema):
            out += _paths(v, (*path, i))
    return out


@st.composite
def mutated_schemas(draw: st.DrawFn) -> Any:
    base: Any = draw(st.one_of(st.sampled_from(BENCH), st.just({}), st.just(True), st.just(False)))
    schema = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(0, 3))):
        paths = [p for p in _paths(schema) if p]
        if not paths or not isinstance(schema, dict):
            break
        path = draw(st.sampled_from(paths))
        parent: Any = schema
        for part in path[:-1]:
            parent = parent[part]
        op = draw(st.sampled_from(["delete", "replace", "keyword", "wrap"]))
        key = path[-1]
        if op == "delete":
            del parent[key]
        elif op == "replace":
            parent[key] = draw(JSON_VALUES)
        elif op == "keyword" and isinstance(parent, dict):
            parent[draw(st.sampled_from(KEYWORDS))] = draw(JSON_VALUES)
        elif op == "wrap":
            parent[key] = {draw(st.sampled_from(["anyOf", "oneOf", "allOf"])): [parent[key], draw(JSON_VALUES)]}
    return schema


def validate_output(schema: Any, text: str) -> None:
    value = json.loads(text)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError:
        return  # not a valid schema: nothing to validate against (the engine compiled what it understood)
    try:
        cls(schema, format_checker=cls.FORMAT_CHECKER).validate(value)
    except jsonschema.exceptions._WrappedReferencingError:  # a remote $ref: not resolvable offline
        return


@FUZZ
@given(schema=mutated_schemas(), temperature=st.sampled_from([0.0, 1.0]))
def test_any_schema_gives_valid_json_or_a_grammar_error(served: Served, schema: Any, temperature: float) -> None:
    params = SamplingParams(json_schema=schema, max_tokens=24, temperature=temperature, seed=3)
    kind, out = served.call(with_bystander, served.engine, "As JSON: ", params)
    if kind == "refused":
        assert isinstance(out, GrammarError | InvalidRequestError), out
        return
    assert kind == "done", out
    check_done(params, out)
    for text, _toks, reason in out:
        if reason == "stop":
            validate_output(schema, text)


# ---- regexes and grammars ------------------------------------------------------------------------
REGEX_ATOMS = st.sampled_from(["a", "b", "[a-c]", "[0-9]", "x", r"\.", "(yes|no)", "[^a-z\\n]"])


@st.composite
def regexes(draw: st.DrawFn, depth: int = 0) -> str:
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        atom = draw(REGEX_ATOMS) if depth > 1 or draw(st.booleans()) else f"({draw(regexes(depth=depth + 1))})"
        lo = draw(st.integers(0, 2))
        atom += draw(st.sampled_from(["", "?", "*", "+", f"{{{lo},{lo + draw(st.integers(0, 3))}}}", f"{{{lo + 1}}}"]))
        parts.append(atom)
    alt = "".join(parts)
    return alt if not draw(st.booleans()) else f"{alt}|{draw(REGEX_ATOMS)}"


GRAMMARS = st.one_of(
    st.sampled_from(["json", "arithmetic", "sql_select", "nonexistent_name"]),
    st.builds(lambda a, b: f'start: "{a}" | "{b}" tail\ntail: "!"*', st.text("abcxyz", min_size=1, max_size=4),
              st.text("abc", min_size=1, max_size=4)),
    st.builds(lambda r: f"start: X\nX: /{r}/", regexes()),
    st.text(st.sampled_from('start:|"a*()?/ \n:=[]'), max_size=30),  # mostly not grammars at all
)


def accepted_by(engine: AsyncEngine, spec: GuidedSpec, tokens: list[int]) -> bool:
    matcher = engine.guided.compile_sync(spec).new_matcher()
    return all(matcher.accept(t) for t in tokens) and (matcher.is_accepting() or matcher.is_terminated())


@FUZZ
@given(regex=st.one_of(regexes(), st.text(st.sampled_from("ab()[]{}*+?|.^$\\-0-9,"), max_size=12)),
       temperature=st.sampled_from([0.0, 1.0]), n=st.sampled_from([1, 2]))
def test_any_regex_gives_a_full_match_or_a_grammar_error(served: Served, regex: str, temperature: float,
                                                         n: int) -> None:
    params = SamplingParams(regex=regex, max_tokens=12, temperature=temperature, n=n, seed=5)
    kind, out = served.call(with_bystander, served.engine, "Answer: ", params)
    if kind == "refused":
        assert isinstance(out, GrammarError), out
        return
    assert kind == "done", out
    check_done(params, out)
    spec = GuidedSpec("regex", regex)
    for text, toks, reason in out:
        if reason == "stop":
            assert accepted_by(served.engine, spec, [t for t in toks if t != 1]), (regex, text, toks)
            try:
                compiled = re.compile(regex)
            except re.error:
                continue
            assert compiled.fullmatch(text), (regex, text)


@FUZZ
@given(grammar=GRAMMARS, temperature=st.sampled_from([0.0, 1.0]))
def test_any_grammar_gives_accepted_text_or_a_grammar_error(served: Served, grammar: str,
                                                            temperature: float) -> None:
    params = SamplingParams(grammar=grammar, max_tokens=16, temperature=temperature, seed=9)
    kind, out = served.call(with_bystander, served.engine, "Example: ", params)
    if kind == "refused":
        assert isinstance(out, GrammarError), out
        return
    assert kind == "done", out
    check_done(params, out)
    spec = GuidedSpec.from_params(params)
    assert spec is not None
    for text, toks, reason in out:
        if reason == "stop":
            assert accepted_by(served.engine, spec, [t for t in toks if t != 1]), (grammar, text, toks)
            if grammar == "json":
                json.loads(text)


def test_after_all_the_fuzzing_the_engine_is_healthy_and_the_long_request_completed(served: Served) -> None:
    kind, out = served.call(read_all, served.engine, served.long)
    assert kind == "done" and len(out[0][1]) == 480 and out[0][2] == "length", (kind, out)

    async def idle() -> None:
        while (s := served.engine.stats()).num_running or s.num_waiting or s.kv_blocks_used:
            await anyio.sleep(0.01)

    served.call(idle)
    assert served.portal.call(served.engine._core.check_invariants)
    assert served.engine.healthy


# ---- defects found by this fuzzer, not fixed yet (asyncpage/ is being edited by the lead) -------------
def _fresh(tiny: Path) -> AsyncEngine:
    return AsyncEngine.from_pretrained(str(tiny), dtype="float32", block_size=4, num_kv_blocks=64,
                                       max_num_batched_tokens=32)


@pytest.mark.parametrize("salt", [5, "\ud800"], ids=["int", "lone-surrogate"])
def test_a_bad_cache_salt_is_refused_and_does_not_kill_the_engine(tiny_llama: Path, salt: Any) -> None:
    engine = _fresh(tiny_llama)

    async def main() -> None:
        async with engine:
            with pytest.raises(InvalidRequestError):
                # A prompt over one block: the scheduler hashes its first full block with the salt.
                await engine.generate("The quick brown fox jumps over the lazy dog", SamplingParams(
                    max_tokens=2, cache_salt=salt))
            assert engine.healthy, engine.stats().engine_error

    anyio.run(main)


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 2**200])
def test_any_integer_seed_samples_reproducibly(tiny_llama: Path, seed: int) -> None:
    """Seeds outside torch's 64-bit range used to raise its raw ValueError at submission."""
    engine = _fresh(tiny_llama)

    async def main() -> list[list[list[int]]]:
        async with engine:
            params = SamplingParams(max_tokens=6, seed=seed, temperature=1.0, n=2, ignore_eos=True)
            return [[c.token_ids for c in (await engine.generate("hi", params)).choices] for _ in range(2)]

    first, second = anyio.run(main)
    assert first == second and len(first[0]) == 6


@pytest.mark.parametrize("kw", [{"stop": None}, {"stop_token_ids": None}, {"stop_token_ids": 5}, {"stop": 5}],
                         ids=["stop-None", "stop_token_ids-None", "stop_token_ids-int", "stop-int"])
def test_none_or_a_scalar_for_a_list_field_is_accepted_or_refused_with_a_typed_error(kw: dict[str, Any]) -> None:
    try:
        SamplingParams(**kw)
    except InvalidRequestError:
        pass


def test_a_single_string_choice_is_not_split_into_letters() -> None:
    try:
        p = SamplingParams(choice="yes")  # type: ignore[arg-type]
    except InvalidRequestError:
        return
    assert p.choice == ("yes",)


@pytest.mark.parametrize("kw", [{"regex": ["a"]}, {"grammar": 5}, {"skip_special_tokens": "no"}],
                         ids=["regex-list", "grammar-int", "skip_special_tokens-str"])
def test_a_wrongly_typed_field_is_refused_with_a_typed_error(served: Served, kw: dict[str, Any]) -> None:
    try:
        params = SamplingParams(max_tokens=2, **kw)
    except InvalidRequestError:
        return
    kind, out = served.call(run_request, served.engine, "hi", params)
    assert kind == "refused", (kind, out)


def test_a_tiny_repetition_penalty_gives_a_value_or_is_refused_at_submission(served: Served) -> None:
    try:
        params = SamplingParams(max_tokens=4, repetition_penalty=1e-40)
    except InvalidRequestError:
        return
    kind, out = served.call(run_request, served.engine, "The quick brown fox", params)
    assert kind in ("done", "refused"), (kind, out)
    assert not isinstance(out, SamplingError)


def test_the_output_text_of_a_token_prompt_ending_mid_character_holds_only_output_text(served: Served) -> None:
    # 0x21 '!' and 0xA1 (byte-level '¡'): the prompt ends inside a UTF-8 sequence.
    params = SamplingParams(regex=r"[a-c]{1,4}", temperature=0, max_tokens=24)
    kind, out = served.call(run_request, served.engine, [3, 97] * 3, params)
    assert kind == "done", out
    text, toks, _ = out[0]
    assert text == served.engine.tokenizer.decode(toks), (text, toks)
    assert re.fullmatch(r"[a-c]{1,4}", text), text
