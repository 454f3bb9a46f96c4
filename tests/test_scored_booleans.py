"""Boolean fields decided by scoring the record's text (asyncpage.extract.booleans): which fields, which statement,
and that the value returned is the one the scores chose."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import msgspec
import pytest

from asyncpage import AsyncEngine, ExtractionError, InvalidRequestError, SamplingParams
from asyncpage.extract import booleans as flags
from asyncpage.extract import decisions, decode_value, json_params, readings, scored_booleans
from asyncpage.extract.booleans import Reading
from asyncpage.extract.decisions import Decider, Plan
from asyncpage.extract.prompt import REFERENCES

TICKET = {
    "type": "object",
    "properties": {
        "customer": {"type": "string"},
        "refund": {"type": "boolean", "description": "True when the customer asks for money back."},
        "urgent": {"type": "boolean", "title": "Needs an answer today"},
        "vip_customer": {"type": "boolean"},
        "maybe": {"type": ["boolean", "null"], "description": "true when unsure"},
        "fixed": {"type": "boolean", "const": True},
    },
    "required": ["customer", "refund", "urgent", "vip_customer", "maybe", "fixed"],
}


class Order(msgspec.Struct):
    product: str
    paid: Annotated[bool, msgspec.Meta(description="whether the order was paid")]


def test_each_plain_boolean_reads_as_the_statement_that_makes_it_true() -> None:
    assert flags.statements(TICKET) == {
        "refund": Reading("the customer asks for money back", described=True, name="refund", asked="money back"),
        "urgent": Reading("Needs an answer today", described=False, name="urgent"),  # no description: its title
        "vip_customer": Reading("vip customer", described=False, name="vip customer"),  # nor a title: its name
    }  # nullable and const booleans are left to the grammar
    assert Reading("it is late", True).key == "\n\nIn this message, it is late."
    # The subject is read as context; what the statement says of it is scored (the key stays the whole).
    assert Reading("the customer asks for money back", True).after == ("\n\nIn this message, the customer",
                                                                        " asks for money back.")
    assert flags.subject_of("Her order is late") == ("Her order", "is late")
    for whole in ("payment failed twice", "Contains PII", "Did the customer ask for a refund", "the refund", "urgent"):
        assert flags.subject_of(whole) == ("", whole)  # no determiner first, or nothing after the subject
    # A space before the end mark (French typography) is no part of the statement: the offset's key and the
    # reading's agree, or the engine would look the offset up under another key and leave the field undecided.
    for description in ("Did the customer ask for a refund ?", "Whether the customer asks for money back !",
                        "the customer asks . .", "Refund ?!"):
        (r,) = flags.statements({"type": "object", "properties": {"x": {"type": "boolean",
                                                                         "description": description}}}).values()
        assert r.key == decisions.Said(*r.after).key and not r.statement.endswith((" ", ".", "?", "!")), r
    assert Reading("vip customer", False).key == "Record where vip customer.\n\n"
    schema = json_params(Order, None)[0].json_schema
    assert schema is not None
    assert flags.statements(schema) == {"paid": Reading("the order was paid", True)}  # "paid": too generic a name
    for alone in ("Whether", "true when", "True if.", "Whether or not?", "-", " ? "):  # no statement: the name
        one = {"type": "object", "properties": {"x": {"type": "boolean", "description": alone}}}
        assert flags.statements(one) == {"x": Reading("x", False)}, alone  # "x": no name a record could say
    said = {"Indicates whether the parcel arrived late.": "the parcel arrived late",
            "Set to true if the customer is angry": "the customer is angry",
            "Did the customer ask for a refund?": "Did the customer ask for a refund"}
    for description, statement in said.items():
        one = {"type": "object", "properties": {"x": {"type": "boolean", "description": description}}}
        assert flags.statements(one) == {"x": Reading(statement, True)}


def test_a_decided_boolean_replaces_the_one_the_model_wrote_before_the_type_judges_it() -> None:
    class Renamed(msgspec.Struct, rename="camel"):
        refund_asked: bool
        name: str

        def __post_init__(self) -> None:
            if self.refund_asked and self.name == "gift":
                raise ValueError("a gift is never refunded")

    assert readings.applied('{"name": "x", "refund": false}', {"refund": True}) == '{"name":"x","refund":true}'
    assert readings.applied('{"name": "x"}', {"refund": True}) == '{"name":"x","refund":true}'  # left out: set
    assert readings.applied('{"name": "x"', {"refund": True}) == '{"name": "x"'  # fails to decode as it would have
    assert readings.applied("[1]", {"refund": True}) == "[1]"
    text = readings.applied('{"refundAsked": false, "name": "x"}', {"refundAsked": True})
    assert decode_value(text, Renamed) == Renamed(True, "x")
    with pytest.raises(msgspec.ValidationError, match="never refunded"):  # the record's invalid_output
        decode_value(readings.applied('{"refundAsked": false, "name": "gift"}', {"refundAsked": True}), Renamed)


async def _scores(engine: Any, heading: str, text: str) -> float:
    """Log-likelihood of `text` after `heading`, computed here from prompt_logprobs by hand."""
    body = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = await engine.tokenize(heading) + body
    out = await engine.generate(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    return sum(e.logprob for e in out.prompt_logprobs[-len(body):])


async def _gain(engine: Any, heading: str, text: str) -> float:
    """How much `heading` raises the log-likelihood of `text` over the plain heading, per token."""
    n = len(engine.tokenizer(text.strip(), add_special_tokens=False)["input_ids"])
    return (await _scores(engine, heading, text.strip()) - await _scores(engine, flags.PLAIN, text.strip())) / n


async def _after(engine: Any, text: str, subject: str, rest: str) -> float:
    """Log-likelihood of a statement's `rest` read after `text` and its `subject`, by hand."""
    said = engine.tokenizer(f" {rest}.", add_special_tokens=False)["input_ids"]
    ids = await engine.tokenize(text.strip() + f"\n\nIn this message, {subject}") + said
    out = await engine.generate(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    return sum(e.logprob for e in out.prompt_logprobs[-len(said):])


async def _value(extraction: Any) -> Any:
    """The value, also when max_tokens closed it early (a tiny random model writes long names)."""
    try:
        return await extraction
    except ExtractionError as exc:
        assert exc.has_value, exc
        return exc.value


async def test_the_value_returned_is_the_one_the_scores_chose(tiny_llama: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    refund = {"type": "boolean", "description": "true when a refund is asked"}
    # Named so that no record names it ("money back"): what is decided is the score alone (named: below).
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "money_back": refund},
              "required": ["name", "money_back"]}
    texts = ["Anna Berg wants a refund for the lamp", "Tom Reyes says the app is slow", "Li Wei: refund please now"]
    async with AsyncEngine.from_pretrained(tiny_llama, dtype="float32") as engine:
        # The threshold: the statement's mean log-likelihood after the built-in reference records (its
        # subject, "a refund", read as context).
        offset = sum([await _after(engine, d, "a refund", "is asked") for d in REFERENCES]) / len(REFERENCES)
        assert offset != 0.0
        assert await scored_booleans.boolean_offsets(engine, schema) == {"money_back": pytest.approx(offset, rel=1e-4)}
        want = {t: await _after(engine, t, "a refund", "is asked") > offset for t in texts}
        assert set(want.values()) == {True, False}  # both readings occur: the grammar writes what was decided
        assert await scored_booleans.decide_booleans(engine, schema, "", {"money_back": offset}) == {}
        assert await scored_booleans.decide_booleans(engine, schema, texts[0], {}) == {}  # no offset: not scored
        params = SamplingParams(max_tokens=200, temperature=0)
        for t in texts:
            decided = await scored_booleans.decide_booleans(engine, schema, t, {"money_back": offset})
            assert decided == {"money_back": want[t]}
            value = await _value(engine.extract(f"{t}\nJSON: ", schema, params, copy_from=t, beam_width=1))
            assert value["money_back"] is want[t]
        got = {r.id: r.value["money_back"] async for r in engine.extract_many(
            [{"id": t, "text": t} for t in texts], schema, params=params, copy_fields="auto", beam_width=1)}
        assert got == want
        # One without a description: its name as a heading, its gain per token over the plain heading.
        named = {"type": "object", "properties": {"refund": {"type": "boolean"}}, "required": ["refund"]}
        heading = "Record where refund.\n\n"
        bar = sum([await _gain(engine, heading, d) for d in REFERENCES]) / len(REFERENCES)
        # (Scored in other batches than here: float32 sums in another order, ~4e-6 apart under torch's AVX2 kernels.)
        assert await scored_booleans.boolean_offsets(engine, named) == {"refund": pytest.approx(bar, rel=1e-4)}
        for t in texts:  # true by its gain, or where the record says "refund" (the first and the last)
            said = await _gain(engine, heading, t) > bar or t != texts[1]
            assert await scored_booleans.decide_booleans(engine, named, t, {"refund": bar}) == {"refund": said}

        # Asked off, or nothing copied in a job: nothing is scored, the model writes the boolean itself.
        async def refuse(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("scored")

        monkeypatch.setattr(Plan, "prepare", refuse)
        monkeypatch.setattr(Decider, "calibrate", refuse)
        off = await _value(engine.extract(f"{texts[0]}\nJSON: ", schema, params, copy_from=texts[0],
                                          beam_width=1, score_booleans=False, score_choices=False))
        assert isinstance(off["money_back"], bool)
        async for r in engine.extract_many([{"id": 1, "text": texts[0]}], schema, params=params):
            assert isinstance(r.value["money_back"], bool)


async def test_scoring_needs_the_record_text_and_steps_aside_when_it_does_not_fit(tiny_llama: Path) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    async with AsyncEngine.from_pretrained(tiny_llama, dtype="float32", max_model_len=64) as engine:
        with pytest.raises(InvalidRequestError, match="score_booleans"):
            await engine.extract("x", schema, score_booleans=True)
        long = " ".join(["word"] * 100)  # past the 64-token context with a heading: the model decides
        assert await scored_booleans.decide_booleans(engine, schema, long, {"ok": 0.0}) == {}
        assert await scored_booleans.decide_booleans(engine, schema, "a short record", {"ok": 0.0}) != {}
    async with AsyncEngine.from_pretrained(tiny_llama, dtype="float32", max_model_len=16) as engine:
        # no reference record fits: no offset, not scored
        assert await scored_booleans.boolean_offsets(engine, schema) == {}


async def test_the_offsets_use_all_the_reference_records_or_none(tiny_llama: Path) -> None:
    schema = {"type": "object", "properties": {"refund": {"type": "boolean"}}, "required": ["refund"]}
    async with AsyncEngine.from_pretrained(tiny_llama, dtype="float32") as engine:
        heading = next(iter(flags.statements(schema).values())).key
        lengths = [len(await engine.tokenize(heading)) + len(engine.tokenizer(d.strip(), add_special_tokens=False)
                                                             ["input_ids"]) for d in REFERENCES]
        full = await scored_booleans.boolean_offsets(engine, schema)
    assert full["refund"] != 0.0
    # Some references fit, some do not: the threshold does not move with which of them did.
    some = sorted(lengths)[1] + 1
    described = {"type": "object", "properties": {"name": {"type": "string"}, "refund": {
        "type": "boolean", "description": "true when a refund is asked"}}, "required": ["name", "refund"]}
    async with AsyncEngine.from_pretrained(tiny_llama, dtype="float32", max_model_len=some) as engine:
        assert await scored_booleans.boolean_offsets(engine, schema) == {}
        # No threshold stands in (a statement's log-likelihood is below any 0): the model writes it.
        assert await scored_booleans.boolean_offsets(engine, described) == {}
        results = [r async for r in engine.extract_many(
            [{"id": 1, "text": "refund pls"}, {"id": 2, "text": "refund now"}], described,
            params=SamplingParams(max_tokens=60, temperature=0), copy_fields="auto", beam_width=1,
            prompt="{text}")]
        assert {r.id for r in results} == {1, 2}
    # A heading too long for the references does not take a shorter one's offset with it.
    long = {"type": "object", "properties": {"refund": {"type": "boolean"}, "other": {
        "type": "boolean", "description": "the customer " + "really " * (max(lengths) + 1) + "asks"}}}
    async with AsyncEngine.from_pretrained(tiny_llama, dtype="float32", max_model_len=max(lengths) + 1) as engine:
        assert await scored_booleans.boolean_offsets(engine, long) == {"refund": pytest.approx(full["refund"])}
        assert await scored_booleans.boolean_offsets(engine, schema) == {"refund": pytest.approx(full["refund"])}


async def test_an_engine_keeps_a_bounded_number_of_offsets_and_answers_every_heading(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def nothing(plan: Plan, engine: Any) -> None:  # no probe: every heading gains 1.0
        plan.ready = True

    monkeypatch.setattr(Plan, "prepare", nothing)
    monkeypatch.setattr(Plan, "named_gain", lambda plan, name: 1.0)

    def booleans(names: list[str]) -> dict[str, Any]:
        return {"type": "object", "properties": {n: {"type": "boolean"} for n in names}}

    async with AsyncEngine.from_pretrained(tiny_llama, dtype="float32") as engine:
        many = [f"b{i}" for i in range(decisions._KEPT + 44)]
        assert await scored_booleans.boolean_offsets(engine, booleans(many)) == dict.fromkeys(many, 1.0)
        assert len(engine.reading_offsets) <= decisions._KEPT
        three = ["b0", "b299", "new"]
        assert await scored_booleans.boolean_offsets(engine, booleans(three)) == dict.fromkeys(three, 1.0)
        assert len(engine.reading_offsets) <= decisions._KEPT


async def test_the_offsets_decide_the_value_and_are_measured_once_per_engine(tiny_llama: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "refund": {"type": "boolean"}},
              "required": ["name", "refund"]}
    texts = ["Anna Berg wants her money back for the lamp", "Tom Reyes says the app is slow"]  # neither says "refund"
    params = SamplingParams(max_tokens=200, temperature=0)
    async with AsyncEngine.from_pretrained(tiny_llama, dtype="float32") as engine:
        first = await scored_booleans.boolean_offsets(engine, schema)
        measured = Plan.prepare

        async def count(plan: Plan, engine: Any) -> None:
            calls.append(plan.text)
            await measured(plan, engine)

        calls: list[str] = []
        monkeypatch.setattr(Plan, "prepare", count)
        assert await scored_booleans.boolean_offsets(engine, schema) == first and calls == []  # kept on the engine
        for bar, want in ((1e9, False), (-1e9, True)):  # what the threshold says is what the value holds
            engine.reading_offsets.update(dict.fromkeys(engine.reading_offsets, bar))
            got = [await _value(engine.extract(f"{t}\nJSON: ", schema, params, copy_from=t, beam_width=1))
                   for t in texts]
            got += [r.value async for r in engine.extract_many(
                [{"id": t, "text": t} for t in texts], schema, params=params, copy_fields="auto", beam_width=1)]
            assert [v["refund"] for v in got] == [want] * 4
        assert sorted(calls) == sorted(texts * 4)  # each record's own scoring only: no reference scored again

        async def refuse(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("scored")

        monkeypatch.setattr(Decider, "calibrate", refuse)  # a blank source is refused before anything is scored
        with pytest.raises(InvalidRequestError):
            await engine.extract("x\nJSON: ", schema, params, copy_from="   ", beam_width=1)


async def test_a_decided_boolean_that_is_not_required_still_comes_back_as_decided(tiny_llama: Path) -> None:
    class Claim(msgspec.Struct):
        name: str
        refund: Annotated[bool, msgspec.Meta(description="true when a refund is asked")] = False

    schema = json_params(Claim, None)[0].json_schema
    assert schema is not None
    texts = ["Anna Berg wants a refund for the lamp", "Tom Reyes says the app is slow", "Li Wei: refund please now",
             "Ola Nordmann asks about the invoice"]
    params = SamplingParams(max_tokens=200, temperature=0)
    async with AsyncEngine.from_pretrained(tiny_llama, dtype="float32") as engine:
        offset = await scored_booleans.boolean_offsets(engine, schema)
        want = {t: (await scored_booleans.decide_booleans(engine, schema, t, offset))["refund"] for t in texts}
        assert True in want.values()  # the default (False) alone would not show the decision was kept
        got = {r.id: r.value.refund async for r in engine.extract_many(
            [{"id": t, "text": t} for t in texts], Claim, params=params, copy_fields="auto", beam_width=1)}
    assert got == want


async def test_a_record_whose_scoring_prompt_outgrows_the_pool_is_generated_not_failed(tiny_llama: Path) -> None:
    long_statement = "the customer " + " ".join(["really"] * 15) + " asks for a refund"
    schema = {"type": "object", "properties": {"refund": {"type": "boolean", "description": long_statement}},
              "required": ["refund"]}
    text = "please refund my lamp now " * 4
    # A 200-token pool: the record's prompt fits, its text after the long heading does not.
    async with AsyncEngine.from_pretrained(tiny_llama, dtype="float32", block_size=4, num_kv_blocks=50) as engine:
        assert await scored_booleans.decide_booleans(engine, schema, text, {"refund": -1e9}) == {}
        results = [r async for r in engine.extract_many([{"id": 1, "text": text}], schema, prompt="{text}",
                                                         params=SamplingParams(max_tokens=20, temperature=0),
                                                         score_booleans=True)]
    assert len(results) == 1 and results[0].ok and isinstance(results[0].value["refund"], bool)


def test_a_boolean_is_named_in_a_record_by_its_name_s_telling_words() -> None:
    assert [flags.called(n) for n in ("refund", "refund_requested", "is_urgent", "wantsMoneyBack")] == \
        ["refund", "refund", "urgent", "money back"]
    assert [flags.called(n) for n in ("is_open", "has_order", "is_resolved", "ok", "x")] == [""] * 5  # say too little


def test_what_a_description_says_is_asked_for_names_the_field() -> None:
    assert flags.asked_for("the customer asks for money back") == "money back"
    assert flags.asked_for("the user requests a refund") == "refund"
    assert flags.asked_for("the caller wants a replacement") == "replacement"
    for statement in ("the order was paid", "the customer is angry", "the customer wants to cancel the subscription "
                      "and close the account", "the customer asks for", "the customer wants it"):
        assert flags.asked_for(statement) == "", statement


def test_a_boolean_declined_in_the_record_s_words_is_false_and_a_missing_one_is_still_asked_for() -> None:
    refund = flags.Reading("the customer asks for money back", True, "refund", "money back")
    for text in ("zip broke. dont need my money back, just a new zip", "I'd like a repair rather than a refund.",
                 "Not looking for a refund, only a replacement.", "Refund not needed, thanks.",
                 "replacement tensioner is fine, no refund needed",
                 "I saw that I could get a refund, but I'd rather just have a replacement lid sent.",
                 "Agent: Would you like a refund or a replacement?\nCustomer: replacement is fine, no refund needed",
                 "We are not looking for compensation or a refund at this point; we need an engineer.",
                 "Your agent offered a refund or a 20% discount, but I don't want either - send a new tabletop."):
        assert refund.decide(3.0, text)[0] is False, text  # declined: false whatever the score
    for text in ("I don't want excuses. I want a refund.", "I don't want to wait any longer, so please refund me.",
                 "No refund has been issued yet.", "I need a refund now! But I would rather not wait.",
                 "Agent: I can offer you a full refund or a new unit.\nMe: the refund please",
                 "I don't want to wait weeks or months for a refund.", "I want a refund, but I'd rather not wait.",
                 "I'd like a refund, but we would prefer it to go on the original card.",
                 "I can process the return myself, I just need a refund.",
                 "Do you want me to send it back for a refund or will you collect it?",
                 "I want a refund, but I don't want to wait for it.",
                 "I want a refund, but I don't want it to take three weeks.",
                 "Please process a refund, but I don't want that to go to my old card.",
                 "I don't want a repair or anything, I want a refund."):
        assert refund.decide(3.0, text)[0] is True, text  # not declined
    assert refund.decide(-3.0, "Refund needed asap, it broke twice.")[0] is True  # no negation: asked
    for text in ("I still haven't received my refund.", "Why can't I get a refund?", "I never got my money back."):
        assert refund.decide(3.0, text)[0] is True and refund.decide(-3.0, text)[0] is False, text  # the score's
    # Declined in more of the ways records decline it: whatever the score, false.
    for text in ("no need for refund", "no need for a refund, just the part", "Refund requested: No",
                 "No refund please. Send technician, I want to keep the filter.",
                 "We're not looking to get our money back, we just want it fixed.",
                 "Please understand: I want not my money back, I want a printer that is working.",
                 "Please do not refund, I want to keep this drone.", "Exchange for XL please, not refund.",
                 "I'm not after compensation or a refund, I want somebody competent to come out.",
                 "We are not requesting a credit or refund, we need the instrument repaired.",
                 "Could you repair it? I need it back working; a refund would not help me.",
                 "I would rather have it repaired than get a refund.",
                 "We'd rather have working trumpets than the money back, the students start on the 9th.",
                 "I'd rather a repair than a refund, I waited a long time for this.",
                 # in customers' other languages, in a wish that names something else first, by saying it is not
                 # needed further on, or by preferring the thing working
                 "Nie chcemy zwrotu pieniędzy, potrzebujemy naprawy.", "Ich möchte keine Rückerstattung, nur Ersatz.",
                 "Je ne veux pas de remboursement, juste une réparation.", "No quiero un reembolso, solo el cambio.",
                 "Das Geld zurück brauche ich nicht, nur ein neues Kabel.",
                 "I don't want to send it back or get a refund, please just send the missing part.",
                 "Support mentioned a refund and a new order - I hope that's not needed, just fix the invoice.",
                 "I could get a refund, but I'd rather just get it working.",
                 "Agent: I can refund the lamp or send a new one.\nMe: a new one please, no refund needed",
                 # a remedy's participle wished for before the refund's denied one
                 "Please send a technician - we'd like it repaired, not refunded.",
                 "I want the unit replaced and not refunded.", "We'd like it repaired \u2014 not refunded.",
                 "I'd prefer to have it exchanged, not refunded.", "We'd like it repaired or replaced, not refunded."):
        assert refund.decide(3.0, text)[0] is False, text
    # Named in another language otherwise (asked for, not received, a contrast after the negation, a policy, a refund
    # received), a refund someone had, or a customer's "I can refund myself?": the score's.
    for text in ("Bitte um Rückerstattung des Kaufpreises.", "Ich habe immer noch keine Rückerstattung erhalten.",
                 "Ich will keinen Ersatz sondern Rückerstattung.", "Sigo sin recibir el reembolso.",
                 "Nie chcę naprawy tylko zwrotu pieniędzy.", "Die Rückerstattung möchte ich nicht als Gutschein.",
                 "Votre politique de remboursement dit 30 jours.", "J'ai bien reçu le remboursement, merci.",
                 "My brother got a refund when his broke, I don't know what I want yet.",
                 "I received a partial refund last year for another order."):
        assert refund.decide(3.0, text)[0] is True and refund.decide(-3.0, text)[0] is False, text
    # Asked for beside a denied wish for something else, a "not needed" about another thing, "keep it working", a
    # customer's "if I can refund", a foreign negation before an English request: true whatever the score.
    for text in ("I don't want a replacement just a refund.", "I don't want to wait anymore just refund me.",
                 "Please just refund me, it is not necessary to send a technician.",
                 "I'd like a refund, and I hope that's not needed to escalate.",
                 "I need a refund but I would prefer to keep it working until it arrives.",
                 "I'd like to know if I can refund this order.", "The unit is broken, kein Ersatz, refund please",
                 "Can I be issued a refund please?"):
        assert refund.decide(-3.0, text)[0] is True, text
    # Asked for in other words than "refund" and "money back": whatever the score, true.
    for text in ("I'd like the $150 cleaning fee refunded please.", "I want to return it and get back the 680 yuan.",
                 "Honestly I prefer to receive back what I paid and not another one.",
                 "Please arrange pickup and return the full amount of 2,349.00 EUR to my card.",
                 "I only need you to give back the second payment, the duplicate one.",
                 "I don't think a new set would be any different, so please just credit the 78 euros back to my card.",
                 "I'd rather the €649 went back onto my credit union card and be done with it.",
                 "I prefer to return the whole unit and request the reimbursement of the full amount.",
                 "We'd like to cancel and be reimbursed for the unused 10 months.",
                 "Please reimburse the full deposit to our company account.",
                 "We will return the 14 failed units and request a credit note for their full amount.",
                 "We no longer need them this season, so please issue a credit note for the missing 36 frames.",
                 "I would rather have my money back than a replacement.",
                 # an agent's "would you rather ... than" is an offer, not a decline: the customer's answer stands
                 "Agent: Would you rather have a replacement than a refund?\nCustomer: A refund, please."):
        assert refund.decide(-3.0, text)[0] is True, text
    # Denied as a complaint, not declined ("still not refunded"), an agent's offer, a third party's past payment:
    # the score's. A plural names refunds in general ("Don't talk to me about refunds"): not the field.
    for text in ("You have still not refunded me.", "Why did you not refund me?", "I was never refunded.",
                 "Agent: Would you prefer a replacement or a refund?\nCustomer: replacement please",
                 "Agent: Are you looking for a repair or a refund?\nCustomer: repair",
                 "My employer reimbursed the purchase.", "Don't talk to me about refunds, I need it working."):
        assert refund.decide(3.0, text)[0] is True and refund.decide(-3.0, text)[0] is False, text
    for text in ("I want my 50 € back.", "I want my 50€ back.", "Refund requested? No answer yet.",
                 "Refund request: no. 4471, please process it"):
        assert refund.decide(-3.0, text)[0] is True, text
    # A participle denied (a complaint), a refund that happened, an amount sent back for another reason: the score's.
    for text in ("Order cancelled but not refunded.", "It was repaired but not refunded, and it broke again.",
                 "It was replaced and not refunded!", "They never fixed, not refunded, not even replied.",
                 "The item was serviced and not refunded although I returned it within 14 days.",
                 "I was already refunded by the shop, I only need a charger.",
                 "The delivery fee was refunded, thanks.", "I got reimbursement from my insurer.",
                 "Should I send the €20 part back or keep it?", "The price went back to 99 euros after the sale.",
                 "Return the payment slip to me please.", "Done. Credit note CN-4410 is on your account.",
                 # someone else reimburses, a policy says so, a credit note as a fact or a question
                 "Please send me a VAT invoice so that my company can reimburse the purchase.",
                 "Our insurer will reimburse the repair, we just need the invoice.",
                 "Your policy says you reimburse the full amount if the item is faulty.",
                 "Do I need a credit note to return the item?", "I want the credit note cancelled.",
                 "I already requested a credit note and received it, thanks."):
        assert refund.decide(3.0, text)[0] is True and refund.decide(-3.0, text)[0] is False, text
    # A field about something else reads none of the money-back wording, a refund's other facts included.
    urgent = flags.Reading("the issue is urgent", True, "urgent", "")
    assert urgent.namings("Please return the full amount of 20 EUR.") == []
    for name in ("refund denied", "refundable", "partial refund"):
        assert flags.Reading(f"the {name}", True, name, "").namings("Please return the full amount of 20 EUR.") == []
    # Every pattern is bounded: hostile records of 200k characters are read in linear time.
    for text in ("0.1234," * 30_000, "1" * 200_000, "my " * 70_000, "the " * 50_000, "refund" + " " * 200_000,
                 "refund" + "\u00a0" * 200_000 + "ok", "$1 000 " * 30_000, "rather " * 30_000 + "refund"):
        refund.decide(0.0, text)
    # A policy named is no request: "our refund policy", "a money-back guarantee".
    assert refund.decide(-3.0, "Does it come with a money-back guarantee? I read your refund policy.")[0] is False
    assert flags.asked_for("the customer asks about shipping") == "" and flags.asked_for("the user wants to know") == ""
    assert flags.asked_for("the user needs help") == "" and flags.asked_for("the customer claims damage") == ""
