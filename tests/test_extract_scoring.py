"""Closed choices decided by scoring (asyncpage.extract.closed, decisions, probes): which fields are closed,
how each option reads, that the value and its confidence are what the scores chose, that null-or-present
follows its calibrated margin, and that a job's priority and cache_key reach every request it makes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

import anyio
import msgspec
import pytest

from asyncpage import AsyncEngine, ExtractionError, InvalidRequestError, SamplingParams
from asyncpage.extract import json_params, starts
from asyncpage.extract.closed import Closed, closed_fields, mentions, named, namings
from asyncpage.extract.decisions import Context, Decider, Plan, Said, reading
from asyncpage.extract.grounding import mark
from asyncpage.extract.jobs import run_job
from asyncpage.extract.probes import Probe, Scored
from asyncpage.extract.prompt import REFERENCES
from asyncpage.extract.starts import START_MARGIN

SEVERITY = {"enum": ["low", "medium", "high", "critical"], "description": "how severe the issue is"}
TICKET = {
    "type": "object",
    "properties": {
        "customer": {"type": "string"},
        "order_id": {"type": ["string", "null"]},
        "severity": SEVERITY,
    },
    "required": ["customer", "order_id", "severity"],
}
TEXTS = ["Anna Berg: the lamp is broken, this is critical", "Tom Reyes says the app is a little slow, minor",
         "Li Wei: order ORD-12345 never came, urgent"]
PARAMS = SamplingParams(max_tokens=120, temperature=0)


class Shipment(msgspec.Struct):
    carrier: Literal["dhl", "ups"]
    status: Literal["sent", "lost"] | None
    weight: float | None
    fragile: bool | None
    paid: bool
    note: str


def test_closed_choices_are_enums_consts_literals_and_nullable_scalars() -> None:
    schema = json_params(Shipment, None)[0].json_schema
    assert schema is not None
    assert closed_fields(schema) == {
        "carrier": Closed(("dhl", "ups")),
        "status": Closed(("lost", "sent", None)),  # msgspec lists a Literal sorted
        "weight": Closed((None,), {"type": "number"}),  # null or a value: the value is searched for
        "fragile": Closed((True, False, None)),
    }  # a plain boolean is booleans.py's; a free string has nothing to choose from
    consts = {"type": "object", "properties": {
        "kind": {"oneOf": [{"const": "a"}, {"const": "b"}, {"type": "null"}]},
        "one": {"const": "x"},  # a single option: nothing to decide
        "many": {"enum": list(range(40))},  # more than MAX_OPTIONS: left to the grammar
        "order": {"anyOf": [{"type": "string", "x-copy": True}, {"type": "null"}], "maxLength": 9},
        "items": {"type": ["array", "null"], "items": {"type": "string"}},
    }}
    assert closed_fields(consts) == {
        "kind": Closed(("a", "b", None)),
        "order": Closed((None,), {"type": "string", "x-copy": True, "maxLength": 9}),
    }
    marked = mark(TICKET, "auto")
    assert closed_fields(marked)["order_id"] == Closed((None,), {"type": "string", "x-copy": True})


def test_each_option_reads_on_its_field_s_label_line_after_the_record() -> None:
    assert reading("severity", SEVERITY, "critical") == Said("\n\nSeverity:", " critical")
    assert reading("order_status", {"title": "order status"}, None) == Said("\n\nOrder status:", " not given")
    assert reading("level", {}, 3) == Said("\n\nLevel:", " 3")
    assert reading("api", {"title": "API version"}, "v2").key == "\n\nAPI version: v2"
    d = Decider(mark(TICKET, "auto"), booleans=True, choices=True)
    assert d.options == {"severity": {reading("severity", SEVERITY, o): o for o in SEVERITY["enum"]}}
    assert set(d.spans) == {"order_id"} and not d.present and not d.readings  # copied: read on its label line
    assert set(Decider(TICKET, booleans=True, choices=True).present) == {"order_id"}  # not copied: in context
    assert not Decider(TICKET, booleans=True, choices=False).active


async def _after(engine: Any, text: str, said: Said) -> float:
    """Log-likelihood of a reading after `text`, by hand from prompt_logprobs."""
    ids = engine.tokenizer(said.text, add_special_tokens=False)["input_ids"]
    prompt = await engine.tokenize(text.strip() + said.lead) + ids
    out = await engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    return sum(e.logprob for e in out.prompt_logprobs[-len(ids):])


async def _value(extraction: Any) -> Any:
    try:
        return await extraction
    except ExtractionError as exc:  # a tiny random model writes long values: closed early, still valid
        assert exc.has_value, exc
        return exc.value


async def test_the_option_returned_is_the_one_its_calibrated_scores_chose(tiny_llama: Path) -> None:
    async with AsyncEngine.from_pretrained(tiny_llama, dtype="float32") as engine:
        said = {o: reading("severity", SEVERITY, o) for o in SEVERITY["enum"]}
        prior = {o: sum([await _after(engine, r, s) for r in REFERENCES]) / len(REFERENCES) for o, s in said.items()}
        want, share = {}, {}
        for t in TEXTS:
            scores = {o: await _after(engine, t, s) - prior[o] for o, s in said.items()}
            total = sum(math.exp(v) for v in scores.values())
            mix = {o: math.exp(v) / total for o, v in scores.items()}
            # Each record states a level (scales.py): half the decision is an even share among named options.
            stated = next(o for w, o in (("critical", "critical"), ("minor", "low"), ("urgent", "high")) if w in t)
            mix = {o: p / 2 + (o == stated) / 2 for o, p in mix.items()}
            want[t] = max(mix, key=lambda o: mix[o])
            share[t] = mix[want[t]]
        assert want[TEXTS[0]] == "critical"
        for t in TEXTS:
            res = await engine.extract(f"{t}\nJSON: ", TICKET, PARAMS, copy_from=t, beam_width=1, confidence=True)
            assert res.value["severity"] == want[t]
            assert res.confidence["severity"] == pytest.approx(share[t], rel=1e-3)
        got = {r.id: r for r in [r async for r in engine.extract_many(
            [{"id": t, "text": t} for t in TEXTS], TICKET, params=PARAMS, copy_fields="auto", beam_width=1,
            confidence=True)]}
        assert {t: r.value["severity"] for t, r in got.items()} == want
        for t, r in got.items():
            assert r.confidence is not None and r.confidence["severity"] == pytest.approx(share[t], rel=1e-3)
        # Asked off: the grammar's own choice, nothing scored.
        off = [r async for r in engine.extract_many([{"id": 1, "text": TEXTS[0]}], TICKET, params=PARAMS,
                                                    copy_fields="auto", beam_width=1, score_choices=False)]
        assert off[0].ok and off[0].value["severity"] in SEVERITY["enum"]


def test_an_option_is_named_by_its_words_in_the_record_whole_and_in_any_case() -> None:
    opts = ["low", "medium", "high", "critical", None, 3]
    assert named(opts, "URGENT and Critical, high-priority") == [False, False, True, True, False, False]
    assert named(opts, "slow, highly, Critically, HIGH_TEMP, support@critical.io") == [False] * len(opts)
    assert named(opts, "This is not critical, isn't that high? A low\nMEDIUM") == [True, True, False, False,
                                                                                   False, False]
    assert named(["high_priority", "low_priority"], "High priority please") == [True, False]
    assert named(["high_priority", "low_priority"], "Impact: high\nPriority: low") == [False, False]  # not across lines
    # A string option that cannot be named: none is, so no option wins for being nameable.
    for unfair in (["yes", "no"], ["C", "C++", "Java"], ["A++", "B"], ["a.*", "abc"], [" ".join(["w"] * 9), "abc"]):
        assert named(unfair, "yes C++ A++ abc w w w w w w w w w a.*") is None


def test_a_naming_the_record_denies_in_its_clause_is_no_naming() -> None:
    denied = ["I don't want a refund, just a new strap", "I'm not asking for a refund", "No refund needed",
              "I do not wish for a refund", "rather than a refund, a repair", "instead of a refund",
              "i dont want a refund", "A refund isn't the point", "a refund would not help me", "no refund, thanks"]
    for text in denied:
        assert not mentions("refund", text), text
    said = ["I want a refund", "No, I want a refund", "a refund, not a repair", "not the box but a refund",
            "Not urgent. I'd like a full refund", "Subject: refund request", "I never got it and I want a refund"]
    for text in said:
        assert mentions("refund", text), text
    assert named(["low", "critical"], "Not urgent at all, but critical for us") == [False, True]
    # Hyphens, answers, hard-wrapped lines, other apostrophes; no denial in a condition or of "the refund".
    for text in ("a non-refund policy", "Refund: No", "I don't\nwant a refund", "I donʼt want a refund",
                 "a repair than a refund", "refund isnt needed"):
        assert not mentions("refund", text), text
    for text in ("If I don't get a refund by Friday, I'll call my bank", "The refund wasn't processed",
                 "I have waited longer than promised for a refund"):
        assert mentions("refund", text), text
    assert namings("refund", "I asked for a refund. Actually, I don't want a refund.") == (1, 1)


def _boolean(text: str, score: float) -> tuple[dict[str, Any], dict[str, float]]:
    """A record's outcome for a described `refund` boolean whose statement scores `score` over its offset."""
    d = Decider({"type": "object", "properties": {"refund": {"type": "boolean", "description": "true when the "
                 "customer asks for money back"}}, "required": ["refund"]}, booleans=True, choices=False)
    d.offsets = {d.readings["refund"].key: 0.0}
    plan = Plan(d, text, [text])
    plan.statement_score = lambda said: score  # type: ignore[method-assign]
    return plan.outcome(None)  # type: ignore[arg-type]


def test_a_boolean_the_record_names_is_true_as_a_lone_named_option_wins() -> None:
    # "I'd like a refund" read as not asking for money back (the default model's commonest miss): the words win.
    decided, shares = _boolean("The lid leaks. I'd like a refund, please.", -3.0)
    assert decided == {"refund": True} and shares["refund"] == pytest.approx(0.5 + 0.5 / (1 + math.e ** 3))
    assert _boolean("The lid leaks. I don't want a refund, just a new lid.", -3.0)[0] == {"refund": False}
    assert _boolean("The lid leaks. Send my money back.", -2.0) == ({"refund": True}, {"refund": pytest.approx(
        0.5 + 0.5 / (1 + math.e ** 2))})  # named by what its description says is asked for
    assert _boolean("The lid leaks.", 2.0) == ({"refund": True}, {"refund": pytest.approx(1 / (1 + math.e ** -2))})
    # Only denied ("dont need my money back"): false, however the score reads it.
    assert _boolean("zip broke, can i get a replacement? dont need my money back", 3.0) == (
        {"refund": False}, {"refund": pytest.approx(0.5 + 0.5 / (1 + math.e ** 3))})
    assert _boolean("The lid leaks.", -40000.0)[0] == {"refund": False}  # no overflow far below the offset
    assert _boolean("I'd like a refund, please.", -40000.0) == ({"refund": True}, {"refund": 0.5})  # still named
    # Named and denied in one record (an agent's offer, declined): no naming; the score alone decides.
    assert _boolean("Agent: I can offer a refund. Customer: no, I don't want a refund.", -3.0)[0] == {"refund": False}


def _decide(enum: list[Any], text: str, scores: list[float], **extra: Any) -> tuple[dict[str, Any], dict[str, float]]:
    """A record's outcome for one enum field whose calibrated option scores are `scores` (no model)."""
    d = Decider({"type": "object", "properties": {"f": {"enum": enum, **extra}}, "required": ["f"]},
                booleans=False, choices=True)
    opts = d.options["f"]
    d.offsets = {said.key: 0.0 for said in opts}
    plan = Plan(d, text, [text])
    score = dict(zip(enum, scores, strict=True))
    plan.statement_score = lambda said: score[opts[said]]  # type: ignore[method-assign]
    return plan.outcome(None)  # type: ignore[arg-type]


def test_a_named_option_wins_even_when_the_model_s_share_rounds_to_nothing() -> None:
    assert _decide(["low", "critical"], "this is critical", [0.0, -40.0])[0] == {"f": "critical"}
    assert _decide(["critical", "low"], "this is critical", [-40.0, 0.0])[0] == {"f": "critical"}


def test_naming_every_string_option_of_a_nullable_enum_leaves_the_model_s_choice() -> None:
    decided, shares = _decide(["low", "high", None], "high or low", [0.0, 0.0, 1.0])
    assert decided == {"f": None} and shares["f"] == pytest.approx(math.e / (2 + math.e))


def test_the_likeliest_option_the_field_s_schema_holds_is_decided() -> None:
    # "critical" is named, but maxLength refuses it: the best the schema holds is decided, not nothing.
    assert _decide(["a", "critical", "low"], "this is critical", [-5.0, -1.0, 0.0], maxLength=3)[0] == {"f": "low"}


async def test_a_lone_named_option_wins_and_several_named_are_the_model_s_choice(tiny_llama: Path) -> None:
    schema = {"type": "object", "properties": {"severity": SEVERITY}, "required": ["severity"]}
    async with AsyncEngine.from_pretrained(tiny_llama, dtype="float32") as engine:
        for text in ["this is critical", "Low severity, nothing broke", "a medium problem"]:
            res = await engine.extract(f"{text}\nJSON: ", schema, PARAMS, copy_from=text, beam_width=1,
                                       confidence=True)
            word = next(o for o in SEVERITY["enum"] if o in text.lower())
            assert res.value == {"severity": word} and res.confidence["severity"] >= 0.5
        text = "high or low, you decide"
        d = Decider(mark(schema, "auto"), booleans=False, choices=True)
        await d.calibrate(engine, None)
        plan = Plan(d, text, [text])
        await plan.run(engine)
        scores = {o: plan.statement_score(s) - d.offsets[s.key] for s, o in d.options["severity"].items()}
        between = max(("high", "low"), key=lambda o: scores[o])
        total = sum(math.exp(v) for v in scores.values())
        mix = {o: math.exp(v) / total / 2 + (o in ("high", "low")) / 4 for o, v in scores.items()}
        decided, shares = plan.outcome(engine)
        assert decided["severity"] == between  # the model's pick among the named two (0.25 each from the words)
        assert shares["severity"] == pytest.approx(mix[between], rel=1e-6)


async def test_a_copied_nullable_field_is_null_or_the_likeliest_span_on_its_label_line(tiny_llama: Path) -> None:
    # "order_ref", not "order_id": the tiny random model's likeliest span may hold no digit, which an id never lacks.
    schema = {"type": "object", "properties": {"order_ref": {"type": ["string", "null"], "maxLength": 12}},
              "required": ["order_ref"]}
    text = "Li Wei: order ORD-12345 never came"
    async with AsyncEngine.from_pretrained(tiny_llama, dtype="float32") as engine:
        first = [r async for r in engine.extract_many([{"id": 1, "text": text}], schema, params=PARAMS,
                                                      copy_fields="auto", beam_width=1)]
        cached = set(engine.guided._cache)  # what a record leaves: nothing of its own
        keys = [k for k in engine.reading_offsets if k.startswith("span\0")]
        assert first[0].ok and len(keys) == 1 and engine.reading_offsets[keys[0]] is not None
        assert not [k for k in engine.reading_offsets if k.startswith("present\0")]
        # The span read by hand: the best of the beams over the record's spans after "Order ref:", as the plan found.
        spans = {text[i:j] for i in range(len(text)) for j in range(i + 1, len(text) + 1)}
        for offset, present in ((1e9, False), (-1e9, True)):  # what the margin says is what the value holds
            engine.reading_offsets[keys[0]] = offset
            for prompt in (None, "Ticket: {text}\nIts order id as JSON: "):  # read after the record, any prompt
                [r] = [r async for r in engine.extract_many([{"id": 1, "text": text}], schema, params=PARAMS,
                                                            copy_fields="auto", beam_width=1, confidence=True,
                                                            prompt=prompt)]
                assert r.ok and r.confidence is not None and 0.5 <= r.confidence["order_ref"] <= 1
                if present:
                    got = r.value["order_ref"]
                    assert isinstance(got, str) and got in spans and len(got) <= 12  # a span, within maxLength
                    assert got == got.strip() and "\n" not in got
                else:
                    assert r.value["order_ref"] is None
        # Nothing of the record's grammars stays cached.
        assert set(engine.guided._cache) <= cached


async def test_an_id_s_field_reads_the_likeliest_span_holding_a_digit(tiny_llama: Path) -> None:
    # The tiny random model's likeliest span on "Order id:" is words more often than not; an id's is the likeliest
    # span with a digit, judged against " not given" the same way. A record with no digit has no id.
    schema = {"type": "object", "properties": {"order_id": {"type": ["string", "null"], "maxLength": 12}},
              "required": ["order_id"]}
    text = "Li Wei: my order ORD-12345 never came, please help"
    async with AsyncEngine.from_pretrained(tiny_llama, dtype="float32") as engine:
        [r] = [r async for r in engine.extract_many([{"id": 1, "text": text}], schema, params=PARAMS,
                                                    copy_fields="auto", beam_width=1)]
        [key] = [k for k in engine.reading_offsets if k.startswith("span\0")]
        engine.reading_offsets[key] = -1e9  # any span beats " not given"
        for record, want_digit in ((text, True), ("Li Wei: my lamp never came, please help", False)):
            [r] = [r async for r in engine.extract_many([{"id": 1, "text": record}], schema, params=PARAMS,
                                                        copy_fields="auto", beam_width=1, confidence=True)]
            got = r.value["order_id"]
            if want_digit:
                assert isinstance(got, str) and got in record and any(c.isdigit() for c in got), got
            else:
                assert got is None


async def test_a_nullable_field_not_copied_follows_its_margin_in_context(tiny_llama: Path) -> None:
    # Short values (maxLength): the tiny random model's reference values then end, and are measured.
    schema = {"type": "object", "properties": {"order_id": {"type": ["string", "null"], "maxLength": 4}},
              "required": ["order_id"]}
    text = "Li Wei: order ORD-12345 never came"
    async with AsyncEngine.from_pretrained(tiny_llama, dtype="float32") as engine:
        first = [r async for r in engine.extract_many([{"id": 1, "text": text}], schema, params=PARAMS,
                                                      beam_width=1, score_choices=True)]
        keys = [k for k in engine.reading_offsets if k.startswith("present\0")]
        assert first[0].ok and len(keys) == 1 and engine.reading_offsets[keys[0]] is not None
        for offset, present in ((1e9, False), (-1e9, True)):
            engine.reading_offsets[keys[0]] = offset
            [r] = [r async for r in engine.extract_many([{"id": 1, "text": text}], schema, params=PARAMS,
                                                        beam_width=1, score_choices=True, confidence=True)]
            assert r.ok and r.confidence is not None and 0.5 <= r.confidence["order_id"] <= 1
            assert (r.value["order_id"] is not None) is present
        # A prompt that does not hold the record's text has no reference: null-or-present stays the model's.
        d = Decider(schema, booleans=True, choices=True)
        await d.calibrate(engine, None)
        assert d.margins == {}


async def test_a_job_s_priority_and_cache_key_reach_every_request(tiny_llama: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    async with AsyncEngine.from_pretrained(tiny_llama, dtype="float32") as engine:
        seen: list[tuple[int, str | None]] = []
        submit = engine.submit

        async def spy(*args: Any, priority: int = 0, cache_key: str | None = None, **kwargs: Any) -> Any:
            seen.append((priority, cache_key))
            return await submit(*args, priority=priority, cache_key=cache_key, **kwargs)

        monkeypatch.setattr(engine, "submit", spy)
        rs = [r async for r in engine.extract_many([{"id": t, "text": t} for t in TEXTS], TICKET, params=PARAMS,
                                                   copy_fields="auto", priority=3, cache_key="job-7")]
        assert len(rs) == len(TEXTS) and all(r.ok or r.closed_early for r in rs)
        v = await _value(engine.extract(f"{TEXTS[0]}\nJSON: ", TICKET, PARAMS, copy_from=TEXTS[0], priority=3,
                                        cache_key="job-7"))
        assert v["severity"] in SEVERITY["enum"]
        # The records' decodes, their probes and the reference records' all carry them.
        assert len(seen) > 4 * len(TEXTS) and set(seen) == {(3, "job-7")}
        for bad in ({"priority": True}, {"priority": 2 ** 40}, {"cache_key": ""}):
            with pytest.raises(InvalidRequestError):
                [r async for r in engine.extract_many(TEXTS, TICKET, **bad)]
            with pytest.raises(InvalidRequestError):
                await engine.extract("x", TICKET, **bad)


async def test_a_job_row_carries_the_decision_s_share_with_confidence(tiny_llama: Path, tmp_path: Path) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(TEXTS)))
    async with AsyncEngine.from_pretrained(tiny_llama, dtype="float32") as engine:
        await run_job(engine, TICKET, src, out, copy_fields="auto", max_tokens=120, progress=False,
                      beam_width=1, confidence=True)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == len(TEXTS)
    for row in rows:
        assert "value" in row, row
        assert 0 < row["confidence"]["severity"] <= 1 and 0.5 <= row["confidence"]["order_id"] <= 1


async def test_a_record_too_long_for_its_statements_is_left_to_the_model(tiny_llama: Path) -> None:
    async with AsyncEngine.from_pretrained(tiny_llama, dtype="float32", max_model_len=64) as engine:
        d = Decider(mark(TICKET, "auto"), booleans=True, choices=True)
        plan = Plan(d, " ".join(["word"] * 100), [])
        await plan.run(engine)
        assert plan.outcome(engine) == ({}, {})
        with pytest.raises(InvalidRequestError, match="score_choices"):
            await engine.extract("x", TICKET, score_choices=True)


async def test_a_copied_value_ends_where_its_described_line_reads_likeliest(tiny_llama: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(starts, "START_MARGIN", math.inf)  # its start stays the model's (the test below)
    schema = mark({"type": "object", "properties": {
        "product": {"type": "string", "description": "the product brand the ticket is about", "minLength": 7},
        "customer": {"type": "string"}}, "required": ["product", "customer"]}, "auto")
    text = ("Anna Berg: the Marlow Duo coffee grinder is broken, a long story of one two three four five six seven"
            " eight nine ten eleven twelve")
    lead = "\n\nThe product brand the ticket is about:"
    async with AsyncEngine.from_pretrained(tiny_llama, dtype="float32") as engine:
        d = Decider(schema, booleans=True, choices=True)
        assert d.ends == {"product": lead, "customer": "\n\nCustomer:"}

        async def decide(product: str, customer: str) -> tuple[dict[str, Any], dict[str, float]]:
            value = json.dumps({"product": product, "customer": customer})
            ids = engine.tokenizer(value, add_special_tokens=False)["input_ids"]
            plan = Plan(d, text, [text])
            plan.add_context(engine, Context(await engine.tokenize("JSON: "), value, ids))
            cached = set(engine.guided._cache)
            await plan.run(engine)
            got = plan.outcome(engine)
            plan.forget(engine)
            assert set(engine.guided._cache) <= cached  # the prefixes' grammars are the record's own: let go
            return got

        decided, shares = await decide("Marlow Duo coffee grinder", "Anna")
        ends = ["Marlow Duo", "Marlow Duo coffee", "Marlow Duo coffee grinder"]  # "Marlow" is under minLength
        scores = {e: await _after(engine, text, Said(lead, f" {e}\n")) for e in ends}
        best = max(scores, key=lambda e: scores[e])
        assert decided == {"product": best}  # a word prefix of what the model wrote, never a new value
        assert shares["product"] == pytest.approx(1 / sum(math.exp(v - scores[best]) for v in scores.values()),
                                                  rel=1e-3)
        # A name opens after its article: "the Marlow Duo coffee grinder" is read as its prefixes without "the"
        # (a lone "the" was the likeliest end of such a value on two fresh tickets).
        decided, _ = await decide("the Marlow Duo coffee grinder", "Anna")
        assert decided == {"product": best}
        # One word left: it is the value, where the schema holds it ("Marlow" is under minLength: left alone).
        decided, shares = await decide("The Marlow", "the Anna")
        assert decided == {"customer": "Anna"} and shares["customer"] == 1.0
        # Never a lone determiner; names that open with "My" or "No" keep it (only articles are dropped).
        decided, _ = await decide("Marlow Duo", "the a")
        assert "customer" not in decided
        decided, _ = await decide("Marlow Duo", "My Little Pony")
        assert decided.get("customer", "My Little Pony") in ("My Little", "My Little Pony")
        # One word, or more than MAX_END_WORDS: the end stays the model's (a name or a brand, not a paragraph).
        decided, _ = await decide("Marlow", "Anna")
        assert decided == {}
        decided, _ = await decide("a long story of one two three four five six seven eight nine", "Anna Berg")
        assert decided.keys() <= {"customer"} and decided.get("customer", "Anna Berg") in ("Anna", "Anna Berg")


async def test_a_copied_value_s_start_gives_way_to_its_line_s_likeliest_span_only_by_a_margin(
        tiny_llama: Path) -> None:
    schema = mark({"type": "object", "properties": {
        "customer": {"type": "string", "description": "full name of the person who wrote the ticket"},
        "note": {"type": "string"}}, "required": ["customer", "note"]}, "auto")
    text = "From: Anna Berg <anna.berg@mail.example>\nMy Marlow Duo grinder broke. Tracking 1Z 99 8812."
    async with AsyncEngine.from_pretrained(tiny_llama, dtype="float32") as engine:
        d = Decider(schema, booleans=True, choices=True)
        value = json.dumps({"customer": "anna.berg@mail.example", "note": "Marlow Duo"})
        ids = engine.tokenizer(value, add_special_tokens=False)["input_ids"]
        plan = Plan(d, text, [text])
        plan.add_context(engine, Context(await engine.tokenize("JSON: "), value, ids))
        cached = set(engine.guided._cache)
        await plan.run(engine)
        found = plan.starts.found["customer"].result(engine)
        assert found is not None
        span = found.text.strip()
        mine, in_json = plan.starts.values["customer"]
        assert mine == "anna.berg@mail.example" and engine.tokenizer.decode(in_json).endswith('{"customer": "')
        decided, shares = plan.outcome(engine)
        plan.forget(engine)
        assert set(engine.guided._cache) <= cached  # the line's span grammar is the record's own: let go
        if span == mine:
            assert plan.starts.pairs["customer"] == {}
            return
        assert span in text and list(plan.starts.pairs["customer"]) == [mine, span]
        read = {c: sum(p.result(engine).logprob for p in pair)  # type: ignore[union-attr]
                for c, pair in plan.starts.pairs["customer"].items()}
        margin = read[span] - read[mine]
        assert (decided.get("customer") == span) == (margin > START_MARGIN)
        if margin > START_MARGIN:
            assert shares["customer"] == pytest.approx(1 / (1 + math.exp(-margin)))


def test_the_span_replaces_the_model_s_value_past_start_margin_and_not_below() -> None:
    schema = mark({"type": "object", "properties": {"customer": {"type": "string"}}, "required": ["customer"]},
                  "auto")
    d = Decider(schema, booleans=False, choices=True)
    for gain, switched in ((START_MARGIN + 0.5, True), (START_MARGIN - 0.5, False)):
        plan = Plan(d, "x", ["x"])
        line, in_json = Probe([1], SamplingParams()), Probe([1], SamplingParams())
        span_line, span_json = Probe([1], SamplingParams()), Probe([1], SamplingParams())
        plan.starts.pairs["customer"] = {"Obrigado": (line, in_json), "Anna Berg": (span_line, span_json)}
        got = {line: -9.0, in_json: -6.0, span_line: -9.0 + gain / 2, span_json: -6.0 + gain / 2}
        plan._got = lambda p, got=got: None if p is None else Scored(got[p], 3, "")  # type: ignore[method-assign]
        decided, _ = plan.outcome(None)  # type: ignore[arg-type]
        assert (decided.get("customer") == "Anna Berg") is switched


async def test_a_decided_value_the_field_s_whole_schema_refuses_is_not_applied(tiny_llama: Path) -> None:
    # The anyOf's own keywords hold beside its string branch's: both bounds, both patterns.
    text = "Li Wei: order ORD-12345 never came"
    props = {"order_id": {"anyOf": [{"type": "string", "minLength": 8}, {"type": "null"}], "maxLength": 30},
             "ref": {"anyOf": [{"type": "string", "pattern": "^[A-Z]"}, {"type": "null"}], "pattern": r"\d"}}
    schema = {"type": "object", "properties": props, "required": list(props)}
    d = Decider(mark(schema, "auto"), booleans=False, choices=True)
    assert d.spans["order_id"][1]["minLength"] == 8 and d.spans["order_id"][1]["maxLength"] == 30
    assert d.holds("ref", "ORD-12345") and not d.holds("ref", "ORD") and not d.holds("ref", "order 1")
    assert d.holds("order_id", None) and not d.holds("order_id", "Li Wei")
    async with AsyncEngine.from_pretrained(tiny_llama, dtype="float32") as engine:
        await d.calibrate(engine, None)
        for name in d.spans:
            d.offsets[d.span_key(name)] = -1e9  # present wins: the span found is the value
        plan = Plan(d, text, [text])
        await plan.run(engine)
        decided, shares = plan.outcome(engine)
        plan.forget(engine)
        assert decided.keys() == shares.keys() and all(d.holds(n, v) for n, v in decided.items())
        import jsonschema

        [r] = [r async for r in engine.extract_many([{"id": 1, "text": text}], schema, params=PARAMS,
                                                    copy_fields="auto", beam_width=1)]
        assert r.ok and jsonschema.Draft202012Validator(schema).is_valid(r.value)


@pytest.mark.parametrize("product", [
    {"anyOf": [{"$ref": "#/$defs/Brand"}], "description": "the product brand"},  # a reference to the root's $defs
    {"type": "string", "pattern": r"^\p{L}[\p{L} ]{1,999}$", "description": "the product brand"},  # beyond RE2
])
async def test_a_copied_value_whose_schema_cannot_be_checked_keeps_the_model_s_end(tiny_llama: Path,
                                                                                   product: dict[str, Any]) -> None:
    schema = {"type": "object", "$defs": {"Brand": {"type": "string", "pattern": " "}},
              "properties": {"product": product}, "required": ["product"]}
    texts = ["the Marlow Duo grinder broke", "Zen Brew Pro is dead", "Nord Lamp flickers"] * 2
    async with AsyncEngine.from_pretrained(tiny_llama, dtype="float32") as engine:
        records = [{"id": i, "text": t} for i, t in enumerate(texts)]
        got = [r async for r in engine.extract_many(records, schema, copy_fields="auto", concurrency=2, params=PARAMS)]
        assert len(got) == len(texts)
        for r in got:  # each record ends on its own: a value of its text, or its own typed error
            assert (r.ok and r.value["product"] in texts[r.id]) or (not r.ok and r.error is not None)
        stats = engine.stats()
        assert stats.num_running == stats.num_waiting == stats.kv_blocks_used == 0 and stats.engine_error is None


def test_a_decided_value_the_caller_s_type_refuses_gives_way_to_the_model_s() -> None:
    from pydantic import BaseModel, field_validator

    from asyncpage.extract.run import decode_value
    from asyncpage.extract.types import Refused, describe

    class Ticket(BaseModel):
        product: str
        urgent: bool

        @field_validator("product")
        @classmethod
        def whole(cls, v: str) -> str:
            if not v.endswith("grinder"):
                raise ValueError("the whole product name")
            return v

    _, target = describe(Ticket)
    text = '{"product": "Marlow Duo grinder", "urgent": false}'
    # The refused decision gives way; the other stands.
    got = decode_value(text, target, {"product": "Marlow Duo", "urgent": True})
    assert got == Ticket(product="Marlow Duo grinder", urgent=True)
    with pytest.raises(Refused):  # the model's own refused: refused, as without decisions (a retry's cue)
        decode_value('{"product": "Marlow", "urgent": false}', target, {"product": "Marlow Duo grinder x"})

    class Plain(msgspec.Struct):
        product: str
        count: int = msgspec.field(default=0)

    assert decode_value('{"product": "A", "count": 2}', Plain, {"count": "two"}) == Plain("A", 2)


async def test_a_record_whose_start_search_is_refused_still_finishes(tiny_llama: Path) -> None:
    # Four beams exceed max_num_seqs=2: the start's search is refused at submission (done, nothing to wake on).
    schema = {"type": "object", "properties": {"customer": {"type": "string"}}, "required": ["customer"]}
    text = "From: Anna Berg <anna.berg@mail.example>"
    async with AsyncEngine.from_pretrained(tiny_llama, dtype="float32", max_num_seqs=2) as engine:
        with anyio.fail_after(60):
            res = await engine.extract(f"{text}\nJSON: ", schema, PARAMS, copy_from=text, beam_width=1)
            assert isinstance(res["customer"], str) and res["customer"] in text
            got = [r async for r in engine.extract_many([{"id": 1, "text": text}], schema, params=PARAMS,
                                                        copy_fields="auto", beam_width=1)]
            assert got[0].ok and got[0].value["customer"] in text


def test_a_start_never_takes_another_field_s_value_and_gives_way_when_the_model_copied_one() -> None:
    from types import SimpleNamespace

    def run(written: dict[str, Any], decided: dict[str, Any], margins: dict[str, tuple[str, float]],
            brands: frozenset[str] = frozenset(), text: str = "") -> dict[str, Any]:
        """`margins`: field -> (its line's span, how much likelier than the model's value)."""
        s = starts.Starts()
        s.written = dict(written)
        s.values = {k: (v, []) for k, v in written.items() if k != "order_id"}  # the copied fields that are not null
        scores: dict[int, float] = {}
        for name, (span, margin) in margins.items():
            pairs = {c: (object(), object()) for c in (written[name], span)}  # (the model's, the span)
            s.pairs[name] = pairs
            scores[id(pairs[written[name]][0])], scores[id(pairs[span][0])] = -20.0, -20.0 + margin
        return {n: v[0] for n, v in s.outcome(lambda p: SimpleNamespace(logprob=scores.get(id(p), 0.0)),
                                              decided, brands, text).items()}

    clock = {"product": "Marlisse Dawn 6 alarm clock", "order_id": None}
    # Likelier by the margin, but the order id's value (as written, or as decided): the product stays the model's.
    assert run(clock, {"order_id": "M-40218"}, {"product": ("M-40218", 5)}) == {}
    assert run({**clock, "order_id": "m-40218 "}, {}, {"product": ("M-40218", 5)}) == {}  # stripped, any case
    assert run({**clock, "order_id": "M-40218"}, {"order_id": "M-4"}, {"product": ("M-40218", 5)}) == {}  # both
    assert run(clock, {}, {"product": ("M-40218", 5)}) == {"product": "M-40218"}
    assert run(clock, {}, {"product": ("M-40218", 3)}) == {}  # under START_MARGIN
    # The model wrote another field's value as this one: any margin lets the span in.
    serial = {"product": "HX/2024/5518", "order_id": "HX/2024/5518"}
    assert run(serial, {}, {"product": ("Hexwold", 1)}) == {"product": "Hexwold"}
    assert run(serial, {}, {"product": ("Hexwold", -1)}) == {}
    assert run({**serial, "order_id": None}, {"order_id": "HX/2024/5518"}, {"product": ("Hexwold", 1)}) == \
        {"product": "Hexwold"}  # the order id as decided on its line
    # A code where the field names none and the span is not one (a serial as the product, a phone number as the
    # name): any margin lets the span in; a code field, or a span that is a code too, keeps START_MARGIN.
    coded = {"product": "SN QMT6-22-0841907", "customer": "+34 611 29 40 87", "order_id": None}
    assert run(coded, {}, {"product": ("Quenmark Tilt 6", 1), "customer": ("Montserrat Vilaplana", 1)}) == \
        {"product": "Quenmark Tilt 6", "customer": "Montserrat Vilaplana"}
    assert run(coded, {}, {"product": ("QMT6-22", 1)}) == {}
    assert run({"sku": "KP3-77A-01942"}, {}, {"sku": ("Korrigan", 1)}) == {}
    assert starts.coded("X100") and not starts.coded("Glow 2") and not starts.coded("iPhone 15")
    for name in ("Anne-Marie", "Li Na", "LG", "7-Eleven", "华为 P60", "देवांश खुराना", "T-Mobile"):  # names, not codes
        assert not starts.coded(name), name
    assert starts.names_a_code("serialNumber") and starts.names_a_code("orderid") and starts.names_a_code("imei")
    assert not starts.names_a_code("product_brand") and not starts.names_a_code("paid")
    # Only as written: a product trimmed to the brand's value does not let the brand give way at a small margin.
    two = {"product": "Marlisse Dawn 6 alarm clock", "brand": "Marlisse"}
    assert run(two, {"product": "Marlisse"}, {"brand": ("Dawn", 1)}) == {}
    # Two fields never take the same span: the larger margin has it.
    assert run({"product": "Dawn 6", "brand": "Marlisse"}, {}, {"product": ("Zed", 6), "brand": ("Zed", 9)}) == \
        {"brand": "Zed"}
    # A common noun in a field asking for a brand, where the span is a name: the span unless START_MARGIN less likely,
    # or made of another field's words; a field asking for no brand, or a span that is a common noun too, keeps
    # START_MARGIN.
    vacuum = {"product": "vacuum", "order_id": None, "customer": "Rukmini Rao"}
    assert run(vacuum, {}, {"product": ("Sweeply V8", 1)}, frozenset({"product"})) == {"product": "Sweeply V8"}
    assert run(vacuum, {}, {"product": ("Sweeply V8", -3)}, frozenset({"product"})) == {"product": "Sweeply V8"}
    assert run(vacuum, {}, {"product": ("Sweeply V8", -5)}, frozenset({"product"})) == {}
    assert run(vacuum, {}, {"product": ("Rukmini", 1)}, frozenset({"product"})) == {}
    assert run(vacuum, {}, {"product": ("Sweeply V8", 1)}) == {}
    assert run(vacuum, {}, {"product": ("cordless vacuum", 1)}, frozenset({"product"})) == {}
    # A word capitalized only where a line or a sentence opens, and written lowercase elsewhere, is such a noun too.
    fryer = "Subject: Air fryer basket peeling\n\nThe coating of my Crispwell AF-6 air fryer is off. Air it out?"
    air = {"product": "Air", "order_id": None, "customer": "Tom Becker"}
    assert run(air, {}, {"product": ("Crispwell AF-6", -3)}, frozenset({"product"}), fryer) == \
        {"product": "Crispwell AF-6"}
    assert run(air, {}, {"product": ("Crispwell AF-6", -3)}, frozenset({"product"}), fryer.lower()) == {}
    assert run(air, {}, {"product": ("Crispwell AF-6", -5)}, frozenset({"product"}), fryer) == {}
    assert starts.capitalized_by_place("Re: Baby monitor\n> - Baby monitor is dead. Our baby monitor.", "Baby")
    # a phrase so opened is such a noun too, and never replaces a name in a brand field (v135)
    thermo = "Subject: Smart thermostat keeps going offline\n\nMy Thermiq T3 smart thermostat drops off the Wi-Fi."
    assert starts.placed_noun(thermo, "Smart thermostat") and not starts.placed_noun(thermo, "Thermiq T3")
    named = {"product": "Thermiq T3 smart thermostat", "order_id": None, "customer": "Olusegun Bakare"}
    assert run(named, {}, {"product": ("Smart thermostat", 7)}, frozenset({"product"}), thermo) == {}
    assert run(named, {}, {"product": ("Smart thermostat", 7)}, frozenset(), thermo) == {"product": "Smart thermostat"}
    jug = "Subject: Blender jug cracked on arrival\n\nMy Kestrava BL-900 blender arrived cracked."
    blender = {"product": "Blender jug", "order_id": None, "customer": "Amara Okonkwo"}
    assert run(blender, {}, {"product": ("Kestrava", 3.7)}, frozenset({"product"}), jug) == {"product": "Kestrava"}
    for text, word in ((fryer, "Crispwell"), ("Tidepool app crashes.\nTidepool is slow.", "Tidepool"),  # never lower
                       ("I love Air fryers and air.", "Air"), ("Subject: Air fryer\nair fryer AIR", "AIR"),
                       ("Subject: Air fryer", "Air"), ("Subject: iPhone broke\nmy iphone", "iPhone"),
                       ("Brand: Ring\nProduct: Video Doorbell 4\nIt does not ring.", "Ring")):  # a label's value
        assert not starts.capitalized_by_place(text, word), (text, word)
    assert starts.common("tile cutter") and starts.common("e-bike") and starts.common("café")
    for name in ("iPhone", "Sweeply V8", "3-seater", "LG", "", "--", "小米", "ソニー", "삼성"):  # no case: no noun
        assert not starts.common(name), name


def test_an_optional_copied_field_s_span_needs_more_where_the_record_does_not_name_the_field_near_it() -> None:
    from asyncpage.extract.labels import ELSEWHERE, LABELED, NAMELESS, NEAR, NO_DIGIT, anchors, doubt, numbered

    assert anchors("order_id", {}) == ("order",) and anchors("orderNumber", {}) == ("order",)
    assert anchors("x", {"title": "Tracking number"}) == ("tracking",) and anchors("id", {}) == ()
    assert anchors("order_ref", {"title": "Reference"}) == ("order",)  # the name's words and the title's
    assert anchors("pedido", {"title": "Número de pedido"}) == ("pedido", "número")  # any script
    assert anchors("sku", {}) == () and anchors("tax_id", {}) == ()  # 3 letters open too many words ("taxi")
    far = "I ordered a lamp from your shop last month and it broke on the second day. Tracking 1Z999 8812."
    assert far.index("1Z999") - far.index("ordered") > NEAR
    assert doubt(far, "1Z999", ("order",)) == ELSEWHERE  # the record names orders, not there: a tracking number
    assert doubt("Order #A-1 arrived broken", "A-1", ("order",)) == 0.0  # "Order #" right before it
    assert doubt("Ticket about ORDER-55123: a broken lamp", "ORDER-55123", ("order",)) == -LABELED  # names itself
    assert doubt("Ticket about PO-ORDER-55123: a broken lamp", "PO-ORDER-55123", ("order",)) == 0.0  # inside it
    assert doubt("\u0130" * 100 + " Order #A-1", "A-1", ("order",)) == 0.0  # no lower() shifting the positions
    assert doubt("Border " + "x " * 40 + "1Z999", "1Z999", ("order",)) == NAMELESS  # "Border" names no order
    assert doubt("Ref 1Z999, the lamp broke", "1Z999", ("order",)) == NAMELESS  # never named: more evidence
    # a booking's or a reservation's word names an order's id as "order" does (labeled_id and near read them so)
    chat = "Agent: And the booking reference?\nCustomer: Confirmation code QX7RTN. Flight SH 418 to Boston."
    assert doubt(chat, "QX7RTN", ("order",)) == 0.0 and doubt(chat, "QX7RTN", ("tracking",)) == NAMELESS
    assert doubt("Reserva " + "x " * 40 + "1Z999", "1Z999", ("order",)) == NAMELESS  # "Reserva" is no word of them
    # A field whose name says it holds a digit never takes a span without one (a form's "(left blank)").
    form = "Order number: (left blank)\nProduct: Lindqvar Glow 2"
    assert doubt(form, "(left blank)", ("order",), "order_id") == NO_DIGIT == math.inf
    # A form's order field left empty names the field away from any value: the next field's number is no order's.
    empty = "Order number:\nSubject: Nimbra FoldDesk 120 - missing hardware"
    assert doubt(empty, "120", ("order",), "order_id") == ELSEWHERE
    assert doubt(empty.replace("\n", " 55120\n"), "55120", ("order",), "order_id") == -LABELED  # filled in
    assert doubt("Order number:\n  55120-B\nProduct: lamp", "55120-B", ("order",), "order_id") == 0.0  # below it
    assert doubt("  - Order ID: \r\nInvoice no.: INV-7712", "INV-7712", ("order",), "order_id") == ELSEWHERE
    for chat in ("Agent: Please provide your order number:\nMaria: 55123", "Bot: Enter your order number:\nYou: 55123",
                 "Hi, about my order:\nSent 10:42 today, ref 55123",  # a prompt, a time: no form's empty field
                 "Support:\nOrder number:\nMaria: 55123"):  # the next label's value is the answer
        assert doubt(chat, "55123", ("order",), "order_id") == 0.0, chat
    assert doubt("Order #A-1 arrived broken", "A-1", ("order",), "order_id") == 0.0
    assert doubt("Promo code SUMMERSALE", "SUMMERSALE", ("promo",), "promo_code") == 0.0  # a code may be a word
    assert numbered("orderId") and numbered("phone") and not numbered("promo_code") and not numbered("product")
    assert numbered("customerNo") and numbered("ordernumber") and numbered("ORDER_IDS")
    for head in ("tracking_status", "phone_type", "invoice_email", "id_type", "valid", "android", "notes"):
        assert not numbered(head), head  # its last word says what it is
    # A pattern of the field's own says what its values look like: a digit-less booking reference stays possible.
    assert doubt("Booking XKQZTB", "XKQZTB", (), "booking_id", {"type": "string", "pattern": "^[A-Z]{6}$"}) == 0.0
    assert doubt("Booking XKQZTB", "XKQZTB", (), "booking_id", {"type": "string"}) == NO_DIGIT
    assert doubt(far, "1Z999", ()) == 0.0  # a field with no naming word ("id") is left to the margin alone


def test_a_span_without_a_digit_is_no_id_and_its_confidence_is_the_model_s() -> None:
    from asyncpage.extract.labels import LABELED  # "Order number: ORD-12345" labels it: it needs that less

    schema = mark({"type": "object", "properties": {"order_id": {"type": ["string", "null"]}},
                   "required": ["order_id"]}, "auto")
    d = Decider(schema, booleans=False, choices=True)
    d.offsets = {d.span_key("order_id"): 0.0}
    for span, margin, want, share in (("(left blank)", 3.0, None, 1 / (1 + math.e ** 3)),
                                      ("ORD-12345", 3.0, "ORD-12345", 1 / (1 + math.e ** -(3 + LABELED))),
                                      ("(left blank)", math.inf, None, 0.0)):
        text = f"Order number: {span}"
        plan = Plan(d, text, [text])
        plan.line_best["order_id"] = plan.line_nulls["order_id"] = Probe([1], SamplingParams())
        plan._got = lambda p, span=span: None if p is None else Scored(0.0, 3, f" {span}")  # type: ignore[method-assign]
        plan.span_margin = lambda name, near=False, margin=margin: margin  # type: ignore[method-assign]
        decided, shares = plan.outcome(None)  # type: ignore[arg-type]
        assert decided == {"order_id": want} and shares["order_id"] == pytest.approx(share), span


def test_an_id_named_in_the_record_wins_over_a_likelier_number_far_from_its_naming() -> None:
    from asyncpage.extract.labels import LABELED, NEAR
    from asyncpage.extract.near import near

    text = "Subject: Freezer stopped - order CF-00931-FR\n\n" + "It was delivered six weeks ago. " * 3 + \
        "(ref 1Z84F3309211784402) and stopped cooling."
    assert text.index("1Z84F") - text.index("order") > NEAR
    [window] = near(text, ("order",))
    assert "CF-00931-FR" in window and "1Z84F" not in window and near(text, ()) == []
    assert near("I don't have an order number yet, call me on 0161 496 0000", ("order",)) == []  # denied there
    assert near("I ordered it on 12 March", ("order",)) == []  # the word itself, or its plural: not "ordered"
    assert near("my reference is PO-ORDER-55123 and", ("order",)) == ["PO-ORDER-55123 and"]  # from its word's start
    assert near("order 1 " * 4000, ("order",)) == ["order 1 " * 4000]  # overlapping stretches: one
    schema = mark({"type": "object", "properties": {"order_id": {"type": ["string", "null"]}},
                   "required": ["order_id"]}, "auto")
    d = Decider(schema, booleans=False, choices=True)
    d.offsets = {d.span_key("order_id"): 0.0}
    plan = Plan(d, text, [text])
    best, close = Probe([1], SamplingParams()), Probe([2], SamplingParams())
    plan.line_best["order_id"], plan.line_near["order_id"] = best, close
    plan.line_nulls["order_id"] = Probe([3], SamplingParams())
    spans = {id(best): " 1Z84F3309211784402", id(close): " CF-00931-FR"}
    plan._got = lambda p: None if p is None else Scored(0.0, 3, spans.get(id(p), ""))  # type: ignore[method-assign]
    # "order CF-00931-FR": its own word labels it, so it needs LABELED less than the offset
    for far, close_m, want in ((5.0, 3.0, "CF-00931-FR"), (5.0, -1.0, "CF-00931-FR"), (5.0, -LABELED - 1.0, None),
                               (9.0, -LABELED - 1.0, "1Z84F3309211784402")):
        plan.span_margin = lambda name, near=False, far=far, close_m=close_m: close_m if near else far  # type: ignore
        decided, _ = plan.outcome(None)  # type: ignore[arg-type]
        assert decided == {"order_id": want}, (far, close_m)
    # The same number labeled as another kind ("tracking", "Account ID", "Support PIN") is never the order id.
    plan.text = text.replace("(ref ", "(tracking ")
    decided, _ = plan.outcome(None)  # type: ignore[arg-type]
    assert decided == {"order_id": None}


def test_an_id_the_record_labels_as_another_kind_of_number_is_refused() -> None:
    from asyncpage.extract.labels import LABELED, OTHERWISE, doubt

    def need(text: str, span: str, words: tuple[str, ...] = ("order",), field: str = "order_id") -> float:
        return doubt(text, span, words, field)

    assert need("Operations Manager\nAccount ID: ACC-55190\nSupport case: 00418827", "ACC-55190") == OTHERWISE
    assert need("two payments, transaction IDs 4410298873 and 4410298874.", "4410298874") == OTHERWISE
    assert need("Subscription order: VR-ENT-2023-00418\nSupport PIN: 7720", "7720") == OTHERWISE
    assert need("Order: DC-FR-0093-2217. Warranty card serial 88-2019-A.", "DC-FR-0093-2217") == -LABELED
    # its own word on the label, in the span, or a field named by that kind: not refused
    assert need("Order / tracking number 55120", "55120") == 0.0
    assert need("Account ID: ORDER-55190", "ORDER-55190") == -LABELED  # it names itself an order's
    tracking = "tracking number 1Z999AA10123456784"
    assert need(tracking, "1Z999AA10123456784", ("tracking",), "tracking_number") == -LABELED
    assert need("Merchant ID 600218847\nSofia", "600218847") == need("Acct no. 55120", "55120") == OTHERWISE
    # a kind's word that labels nothing, or its label away from the span: not refused
    for text in ("Hi, the parcel for 55120 never arrived.", "In case it helps: 55120", "The device I bought, 55120",
                 "My order, placed with my credit card on the 3rd, is 55120", "tracking shows delivered (55120)"):
        assert need(text, "55120") != OTHERWISE, text
    assert need("Order ref on my business account: 5512", "5512") != OTHERWISE  # its own word on the line
    # ...but in an earlier clause of that line it labels another value, not this one
    assert need("(order EV-55190-B, customer account 100-4432)", "100-4432") == OTHERWISE
    assert need("I have no online order number, but the serial is NBX14-77A02-K", "NBX14-77A02-K") == OTHERWISE
    assert need("Order KR-7731-G2, frame no. KG2-118840.", "KG2-118840") == OTHERWISE
    assert need("Order KR-7731-G2, frame no. KG2-118840.", "KR-7731-G2") == -LABELED  # its own word labels it
    for text, span in (("I placed two orders on my account: 55120, 55121", "55121"),
                       ("Order number, as shown in my account: 55120", "55120"),
                       ("Order ref, on my business account: 5512", "5512")):
        assert need(text, span) != OTHERWISE, text  # the own word names no value of its own first: it labels this
    # a field that is itself such a number, or any but an order's, is not refused one labeled by a kin's word
    assert need("Mobile: 07700 900123", "07700 900123", ("callback",), "callback_number") != OTHERWISE
    assert need("RMA number: 5512", "5512", ("return",), "return_id") != OTHERWISE
    assert need("Mobile: 07700 900123", "07700 900123", ("phone",), "phone") != OTHERWISE
    assert need("Member ID: 12345", "12345", ("customer",), "customer_id") != OTHERWISE
    # labeled so in one place and plainly in another: not refused; a field whose name holds no digit: not read so
    assert need("Merchant ID 600218847. My order was 600218847.", "600218847") == -LABELED
    assert need("Merchant ID 600218847. The order came 600218847.", "600218847") == 0.0
    assert need("Account: Mosswell Health", "Mosswell Health", ("company",), "company") != OTHERWISE


def test_an_id_its_field_s_own_word_labels_right_before_it_is_taken_whole_and_needs_less() -> None:
    from asyncpage.extract.labels import ELSEWHERE, LABELED, OTHERWISE, doubt, labeled, labeled_id
    from asyncpage.extract.near import near

    text = "Re the Havrenn Kettle Pro 1.7 from your store (order HVN-3381045, model HK-17P). It leaks."
    assert doubt(text, "HVN-3381045", ("order",), "order_id") == -LABELED
    assert doubt(text, "HK-17P", ("order",), "order_id") == OTHERWISE
    # an id the record labels as the order's is all near reads (in every labeled set, the answer is one of them)
    assert near(text, ("order",)) == ["HVN-3381045"]
    assert near("We ordered 6 units (our PO 4410-22, your order confirmation WEB-339017). We received the PX-3100 "
                "instead.", ("order",)) == ["WEB-339017"]
    assert near("Order #DST-60233 and PO 90357", ("order",)) == ["#DST-60233"]  # as records and labels write it
    # not a work order's, a replacement's, an earlier one's or "order" as a verb: the stretches are read then
    for text in ("The technician's work order WO-77120 says fixed. My order was placed on 3 May, ref 55190-22.",
                 "I'd like to order XR-200 blades separately. My original order, placed in March, number 4471-2231-88",
                 "Agent: Your order number?\nCustomer: it's SO-3381-42 I think\nAgent: I've made replacement order "
                 "RP-55120 for you."):
        assert any(("55190-22" in p or "4471-2231-88" in p or "SO-3381-42" in p) for p in near(text, ("order",)) or
                   [text]), text
    many = "Order number WX-22222. " + " ".join(f"SKU-{i:04d}" for i in range(40)) + " order number KX-10293."
    assert any("KX-10293" in p for p in near(many, ("order",)))  # more ids than read: no window hides a later one
    # a naming the record denies is none: "no order number - only the tracking number, 1W882 7730 114"
    denied = "I don't have an order number - only the tracking number from the parcel, 1W882 7730 114. Thanks"
    assert doubt(denied, "1W882 7730 114", ("order",), "order_id") == ELSEWHERE
    assert doubt("I haven't received my order yet. It's #88123.", "88123", ("order",), "order_id") == 0.0  # named
    for none in ("so I don't have an online order number - receipt no. 88123", "I have no order details, only 88123"):
        assert doubt(none, "88123", ("order",), "order_id") == ELSEWHERE, none
    # with none labeled, the stretch naming the order ends at the next kind's label once it held a value, or at its
    # line's end
    assert near("My order came late, ref HVN-3381045, model HK-17P.", ("order",)) == \
        ["order came late, ref HVN-3381045, "]
    assert near("My order came late, ref LMV-209-88413, invoice INV-55102 attached", ("order",)) == \
        ["order came late, ref LMV-209-88413, "]
    assert near("Ma commande est arrivée cassée: CMD-884120, facture F-55019", ("order",)) == \
        ["commande est arrivée cassée: CMD-884120, "]  # French
    assert near("Meine Bestellung kam kaputt an: DW-5590213, Rechnung R-2291", ("order",)) == \
        ["Bestellung kam kaputt an: DW-5590213, "]
    # an order's confirmation no naming word's stretch reaches is a stretch of its own
    assert near("I booked the VIP package for the March 22 game, confirmation ARL-QX7731, and", ("order",)) == \
        ["ARL-QX7731"]

    assert near("Order: 55120\nSerial: 99812", ("order",)) == ["55120"]
    assert near("Order / account no. 55120", ("order",)) == ["Order / account no. 55120"]  # a label before its value
    for label, span in (("order #KS90817.", "KS90817"), ("Order number: 55019", "55019"),
                        ("ORDER NO. 7781-22", "7781-22"), ("booking ref RLN-8K2Q7", "RLN-8K2Q7"),
                        ("Reservation code is QX7P22", "QX7P22")):
        assert labeled(f"Hi,\n{label} and more", span, ("order",)), label
    # the label's first group is the id's: the span found after it is read with it
    assert labeled_id("order GLM#559203. i want", "559203", ("order",)) == "GLM#559203"
    assert labeled_id("headphones, order AUR 5519 0087. Left", "5519 0087", ("order",)) == "AUR 5519 0087"
    assert labeled_id("Order No 55190 was late", "55190", ("order",)) == "55190"  # an id noun is the label's
    assert labeled_id("ORDER REF NO 55019", "55019", ("order",)) == labeled_id("Order #: 55019", "55019", ("order",)) \
        == "55019"
    assert labeled_id("Tracking: DHL 1234567890", "1234567890", ("tracking",)) == "1234567890"  # orders' ids only
    assert labeled_id("order number NOV 55019", "55019", ("order",)) == "NOV 55019"  # "NO" is no id noun there
    assert labeled("Order 55019 packaging was damaged", "55019", ("order",))  # "pack" is no count's unit there
    # an order's id alone in brackets after the ordered thing
    assert labeled("the Parlour 12 I ordered (MF-0911-2287) came cracked", "MF-0911-2287", ("order",))
    assert labeled("I ordered a Zipvolt Urban X scooter (#55019) on 4 October", "55019", ("order",))
    assert not labeled("I ordered a Zentorq drill (model ZD-2000)", "ZD-2000", ("order",))
    assert not labeled("I ordered it. The drill (ZD-2000) broke", "ZD-2000", ("order",))
    # a price, a catalogue code, a model number, a year, or a denied order in brackets is no order's id
    for text, span in (("I bought the headphones ($249.99) and", "$249.99"), ("I bought it on Amazon (B08XYZ1234)",
                       "B08XYZ1234"), ("I bought a MacBook Pro (A2338)", "A2338"), ("I bought it (2019)", "2019"),
                       ("I never ordered anything (#55019)", "#55019")):
        assert not labeled(text, span, ("order",)) and near(text, ("order",)) == [], text
    assert near("Hi, I ordered a Zipvolt Urban X scooter (#55019) and my order is late", ("order",)) == \
        ["#55019"]
    # not an id's shape, on another line, part of a longer word, another field's word, or a verb: not labeled
    for text, span in (("order 12 arrived", "12"), ("order number\n[06:51]", "[06:51]"),
                       ("order: 14-02-2024", "14-02-2024"), ("order 55120X", "55120"), ("reorder 55120", "55120"),
                       ("I ordered it, 55019", "55019"), ("order 2024-66153", "2024"), ("order GLM#\n559203", "559203"),
                       ("We need to order 2500 more units", "2500"), ("order 25000 units", "25000"),
                       ("My order 1,299.00 was charged twice", "1,299.00"), ("The order SKU 88123 came", "88123"),
                       ("tracking 1Z999AA1", "1Z999AA1")):
        assert not labeled(text, span, ("order",)), text
    assert not labeled("booking ref RLN-8K2Q7", "RLN-8K2Q7", ("tracking",))  # a booking labels an order's id only
    # the word for an order in the customer's own language, an id that names itself an order's, a chat's answer
    for text, span in (("Klantnummer: 0048821\nBestelnummer: DW-5590213", "DW-5590213"),
                       ("Subject: leaking – Bestellung #VL-20931", "VL-20931"),
                       ("numéro de commande: FR-88120", "FR-88120"), ("Bestellung Nr. 55019 kam", "55019"),
                       ("Subject: Damaged in transit - ORD-5562190", "ORD-5562190"),
                       ("Agent: Could you confirm your order number?\nCustomer: #LQ-3390\nAgent: thanks", "LQ-3390"),
                       ("Jo: what's the order number?\nZR 4471 0092", "ZR 4471 0092"),
                       ("Commande n° KF-884120 (facture F-55019)", "KF-884120"),
                       ("commande nº 2024-19-5527", "2024-19-5527"),
                       ("Zamówienie: ZAM/2024/07/1182", "ZAM/2024/07/1182")):
        assert labeled(text, span, ("order",)), text
    # an order's confirmation number labels its id; a cancellation's does not; an id naming itself an order's may
    # open with a short group
    for text, span in (("two chairs last month (confirmation number FJ88-1273). The lift", "FJ88-1273"),
                       ("Name: Dan\nConfirmation number: 2024-ALB-66120\nSerial: X1", "2024-ALB-66120"),
                       ("your order confirmation #2024-88130 says", "2024-88130"),
                       ("the shoes I got (ORD-58-99321) are small", "ORD-58-99321")):
        assert labeled(text, span, ("order",)), text
    assert labeled("Please cancel my order. Confirmation number: ABC-12345", "ABC-12345", ("order",))
    assert labeled("I cancelled my booking (booking confirmation no. SLY-844209) on 2 April", "SLY-844209", ("order",))
    for text, span in (("I cancelled my plan on 28 April (confirmation code CNX-4410) but", "CNX-4410"),
                       ("I cancelled my plan on 28 April (confirmation no. CNX-4410) but", "CNX-4410"),
                       ("my refund confirmation number RF-88123, order 55120", "RF-88123"),
                       ("I never got the confirmation code 483920 to reset my password", "483920"),
                       ("the shoes (ORD-58-9) are small", "ORD-58-9"), ("(ORD5-SORT) bin", "ORD5-SORT"),
                       ("call PO-1-800-555-1234 today", "PO-1-800-555-1234")):
        assert not labeled(text, span, ("order",)), text
    # a field of its own named so keeps its label
    assert labeled("I cancelled my plan (confirmation code CNX-4410) but", "CNX-4410", ("confirmation", "code"))
    assert not labeled("confirmation number FJ88-1273", "FJ88-1273", ("tracking",))  # an order's id only
    # a chat's answer to the agent's question: the id alone on its line, or its first sentence
    asked = "Agent: Do you have your order number?\nCustomer: CF-55102-UK"
    assert labeled(asked, "CF-55102-UK", ("order",))
    assert labeled(asked + ". It went back once.", "CF-55102-UK", ("order",))
    assert not labeled(asked + " is my account, not the order.", "CF-55102-UK", ("order",))
    # an id naming itself an order's is where the record names the order, wherever it stands
    assert near("I bought a Kelvora AirPure 450 from your shop three weeks ago (ORD-48213). It", ("order",)) == \
        ["ORD-48213"]
    assert near("XORD-5562190 and ORD-1234x", ("order",)) == []
    history = "History: " + ", ".join(f"ORD-{1000 + i}" for i in range(20)) + ".\nThe kettle: order number 77777."
    assert near(history, ("order",))[-1] == "77777"  # after what the record's words label, never for it
    # groups like a date's that are no date are an id; a bracket after another kind's word is that kind's id
    assert not labeled("order: 2024-06-03", "2024-06-03", ("order",))
    assert not labeled("I bought a licence and the invoice (INV-2024-118734) is wrong", "INV-2024-118734", ("order",))
    for text, span in (("I ordered a new phone (MF-0911-2287)", "MF-0911-2287"),
                       ("I bought a gift card (GC-5521-88)", "GC-5521-88")):  # a thing's word, not another number's
        assert labeled(text, span, ("order",)), text
    for text, span in (("Agent: Could you confirm your phone number?\nCustomer: 5550-1234", "5550-1234"),
                       ("Agent: Your order number?\nCustomer: it is 55019 I think", "55019"),
                       ("Agent: Any order number?\nCustomer: 55019 and serial 88123", "55019"),
                       ("ORDINAL-5521 and ORDX-9981", "ORDX-9981")):
        assert not labeled(text, span, ("order",)), text
    assert not labeled("Bestellnummer: DW-5590213", "DW-5590213", ("tracking",))  # an order's word, not a tracking's
    # a purchase order's "PO" in capitals labels an order's id (four digits too: no amount after it); not a post
    # office box, a lowercase "po", or another field's
    for text, span in (("the 12 printers we bought under PO 8823 went offline", "8823"),
                       ("Our Voltrane PX-12 PDU (PO 4471) tripped", "4471"), ("(PO 4471) tripped", "PO 4471"),
                       ("speakers (PO-2024-3312). Two", "PO-2024-3312"), ("P.O. 20817 has", "20817"),
                       ("PO#: 55102 is", "55102"), ("PO number 4471", "4471"), ("PO No. 4471", "4471")):
        assert labeled(text, span, ("order",)), text
    for text, span in (("Send it to PO Box 4471, Springfield", "4471"), ("send to P.O. box 4471", "4471"),
                       ("PO\u00a0Boxes 44712", "44712"), ("the repo 4471 is", "4471"), ("po 4471", "4471"),
                       ("Po 4471", "4471"), ("I paid at your store's POS #55190", "55190"), ("POS ID: 44712", "44712")):
        assert not labeled(text, span, ("order",)) and not near(text, ("order",)), text
    assert doubt("PO raised for a replacement, ref 558812", "558812", ("order",), "order_id") == 0.0  # named near it
    assert not labeled("under PO 8823 went", "8823", ("tracking",))
    for text, span in (("Agent: Could you confirm your order number?\r\nSarah: LQ-3390\r\nAgent: thanks", "LQ-3390"),
                       ("[14:04] Agent: Do you have your order number?\n[14:04] Sarah: 7730019245", "7730019245")):
        assert labeled(text, span, ("order",)), text
    # the chat's answer is the field's own label, not a customer's number
    assert doubt("Agent: Could you confirm your order number?\nCustomer: #LQ-3390", "LQ-3390", ("order",),
                 "order_id") == -LABELED
    # a question about the order that asks for another number, or an answer under another kind's label; an
    # "ORD" that is no order's id; a count in another language
    for text, span in (("Agent: What's the tracking number on your order?\nSarah: 1Z999AA10123456784",
                        "1Z999AA10123456784"), ("Which phone number is on the order?\nSarah: 555-201-8890",
                                                "555-201-8890"),
                       ("In order to help, could you share your case number?\nSarah: CS-44810", "CS-44810"),
                       ("Agent: Could you give me your order number?\nInvoice: INV-2231", "INV-2231"),
                       ("Shipped from facility ORD2 on Monday", "ORD2"), ("Departed ORD5-SORT hub", "ORD5-SORT"),
                       ("nothing here", "ORD-5562190"), ("ordine 12500 pezzi", "12500"),
                       ("Bestellung 12000 Stück", "12000")):
        assert not labeled(text, span, ("order",)), text
    hostile = "AB-1234\n" * 50_000  # read in linear time
    assert not labeled(hostile, "AB-1234", ("order",))


def test_the_customer_s_purchase_order_beside_the_seller_s_order_is_never_the_order_id() -> None:
    from asyncpage.extract.labels import LABELED, OTHERWISE, customers_po, doubt
    from asyncpage.extract.near import near

    both = "12 units under your order KX-ORD-33018 (our PO 4500123987). Since"
    assert doubt(both, "4500123987", ("order",), "order_id") == OTHERWISE
    assert doubt(both, "KX-ORD-33018", ("order",), "order_id") == -LABELED
    assert near(both, ("order",)) == ["KX-ORD-33018"]
    assert near("My order came late, ref KX-ORD-33018 (our PO 4500123987). Since", ("order",)) == \
        ["PO 4500123987"]  # no seller's label: the PO is the order's
    confirmed = "scanner (order confirmation OC-2210-559, our PO 78812) shows"
    assert customers_po(confirmed, "78812", ("order",)) and not customers_po(confirmed, "OC-2210-559", ("order",))
    assert customers_po("our purchase order 7781-HB, your order confirmation SO-55120", "7781-HB", ("order",))
    # the sole reference: the PO is the order's id; and a field asking for the PO reads it as its own
    for sole in ("under our purchase order PO-4471982. Serial number: LP9-00A-339120.", "Our PO 4471; invoice INV-1"):
        span = "PO-4471982" if "PO-" in sole else "4471"
        assert not customers_po(sole, span, ("order",)) and doubt(sole, span, ("order",), "order_id") == -LABELED
    assert not customers_po(both, "4500123987", ("purchase", "order"))
    for field in ("order_po_number", "customerOrderNumber", "purchase_order"):  # a field asking for the PO reads it
        assert not customers_po(both, "4500123987", ("order",), field), field
    assert near(both, ("order",), "order_po_number") == ["KX-ORD-33018", "PO 4500123987"]
    for other in ("The driver's work order WO-77120", "You opened return order RT-55210", "paid by money order MO-44",
                  "the replacement order RPL-2231"):  # no seller's order: the PO stays
        assert not customers_po(f"Our PO 4500123987 covers it. {other} lists 18.", "4500123987", ("order",)), other
    for hostile in ("our PO 4500123987. " + "order AB-1234, " * 20_000, "order 12345 PO 55123 " * 5_000):
        assert len(near(hostile, ("order",))) <= 16 and doubt(hostile, "4500123987", ("order",), "order_id") > 0


def test_a_product_s_value_is_its_name_without_the_common_nouns_that_close_its_phrase() -> None:
    from asyncpage.extract import ends

    for phrase, name in (("Havenbrook Mira 3-seater sofa", "Havenbrook Mira"), ("Velocita Strada 3 e-bike",
                         "Velocita Strada 3"), ("Sleepmoor Cloud Hybrid mattress (Queen)", "Sleepmoor Cloud Hybrid"),
                         ("iRobot Roomba i7 robot vacuum", "iRobot Roomba i7"),
                         ("Zephyra Phone 8 Lite", "Zephyra Phone 8 Lite"),
                         ("baby monitor", "baby monitor")):  # nothing named left: the phrase as it is
        assert ends.name_of(phrase) == name, phrase
    assert ends.name_of("Havenbrook Mira sofa, grey") == "Havenbrook Mira"
    assert ends.name_of("Havenbrook Mira sofa (5th gen)") == "Havenbrook Mira"
    assert ends.names_a_brand("product", "\n\nThe product brand the ticket is about:") and ends.names_a_brand("make")
    for field in ("product", "product_issue", "device_problem", "company_address", "deviceModel"):
        assert not ends.names_a_brand(field, f"\n\n{field}:"), field  # a thing, not its brand: never trimmed
    # the common nouns and counts that open a brand's phrase: its name without them is read too, never applied unread
    for phrase, name in (("e-bike Velosta City E5", "Velosta City E5"), ("18 of 40 Novaro X5", "Novaro X5"),
                         ("eero Pro 6", "Pro 6"), ("air purifier", "air purifier"), ("Novaro X5", "Novaro X5"),
                         ("2 boxes", "2 boxes"), ("iPhone 15", "iPhone 15"),
                         ("My Cloudnest Home Backup 2TB", "Cloudnest Home Backup 2TB"), ("Our Place", "Place")):
        assert ends.after_nouns(phrase) == name, phrase
    bike = "I buy the e-bike Velosta City E5 in your shop."
    assert {"Velosta", "Velosta City E5"} <= set(ends.candidates(bike, "e-bike Velosta City E5", lambda c: True,
                                                                 named=True))
    assert "Velosta City E5" not in ends.candidates(bike, "e-bike Velosta City E5", lambda c: True)  # no brand asked
    text = "We love the Havenbrook Mira 3-seater sofa we got."
    everything = ends.candidates(text, "Havenbrook Mira 3-seater sofa", lambda c: True)
    assert everything[-1] == "Havenbrook Mira 3-seater sofa"  # any field: every end is read
    assert ends.candidates(text, "Havenbrook Mira 3-seater sofa", lambda c: True, named=True) == \
        ["Havenbrook", "Havenbrook Mira"]  # a thing's name: none past it into common nouns
