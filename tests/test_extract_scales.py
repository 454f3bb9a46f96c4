"""A severity (priority, urgency) stated in a record's own words names the option of that level."""

from __future__ import annotations

from typing import Any

from asyncpage.extract.decisions import Decider, Plan
from asyncpage.extract.scales import named, ranks

SEVERITY = ["low", "medium", "high", "critical"]


def _said(options: list[Any], text: str) -> list[Any]:
    hits = named(options, text)
    assert hits is not None
    return [o for o, hit in zip(options, hits, strict=True) if hit]


def test_a_level_stated_in_common_words_names_its_option() -> None:
    stated = {
        "Not urgent at all, the left one still works": "low", "No rush, my trip is in August.": "low",
        "It's a minor annoyance": "low", "call me back whenever you get a chance": "low",
        "It's not an emergency at all": "low", "A moderate issue.": "medium", "Please treat this as urgent": "high",
        "this is a serious problem for us": "high", "URGENT - office offline": "high",
        "This is an emergency.": "critical", "I consider this a safety hazard": "critical",
        "This thing is dangerous.": "critical", "it's a fire risk": "critical", "This is critical": "critical",
        "It's a nuisance rather than a disaster": "medium", "It's not an emergency, but please look at it": "medium",
        "I'd like it sorted within the next week": "medium", "This really can't wait.": "high",
        "we are against the clock here": "high", "there was a burning smell": "critical",
        "our whole team is at a standstill": "critical",
        "I consider this extremely serious": "critical",  # a longer phrase hides the level word inside it
        "It really can\u2019t wait": "high",  # any apostrophe
        "a slight inconvenience, nothing more": "low",
        "This is about as bad as it gets for us.": "critical", "It isn't a disaster, but it's annoying": "medium",
        "we are getting desperate, three kids share that room": "high",
        "It is not very urgent, we can use the wardrobe for some weeks.": "low",
        "Not the end of the world, just disappointing.": "low", "It's not really serious": "low",
        "This is not very serious.": "low",  # the longer phrase hides "very serious" inside it
    }
    for text, level in stated.items():
        assert _said(SEVERITY, text) == [level], text
    # a level's word that measures something states no level ("reads too high", "the high-voltage fault")
    assert _said(SEVERITY, "The thermometer reads 5 degrees too high. Not urgent, a minor annoyance") == ["low"]
    assert _said(SEVERITY, "A high-voltage fault. This is critical.") == ["critical"]
    assert _said(SEVERITY, "Chamber pressure low, alarm on. Priority: High") == ["high"]
    for text in ("It is so high priority for me", "I'd say medium.", "a medium problem", "rate this issue as high"):
        assert len(_said(SEVERITY, text)) == 1, text  # the word used as a level still names it
    assert _said(SEVERITY, "nothing serious, just curious") == ["low"]  # "serious" denied in its clause
    for text in ("This is not urgent or serious.", "Nothing major or urgent", "It's not urgent right now."):
        assert _said(SEVERITY, text) == ["low"], text  # a longer phrase read first keeps its denial for the rest
    for text in ("The battery drains faster as it gets older.", "Our disaster recovery plan has a typo",
                 "I bought the laptop on fire sale", "The manual is translated pretty badly.",
                 "No emergency services were called."):
        assert _said(SEVERITY, text) == [], text  # words of a level only in those words' own sense
    for text in ("Nobody was injured.", "I can't wait to try the new version!", "Right now the app shows an error",
                 "I don't want to make a big deal of this, but the invoice is wrong."):
        assert _said(SEVERITY, text) == [], text
    assert _said(SEVERITY, "The firmware is majorly fine, seriousness aside") == []  # whole words only


def test_a_scale_is_found_in_the_options_and_each_level_names_the_nearest() -> None:
    assert ranks(SEVERITY) == [0, 1, 2, 3]
    assert ranks(["Low priority", "high_priority", None]) == [0, 2, None]
    assert ranks(["low", "banana"]) is None and ranks(["low", "minor"]) is None and ranks(["high"]) is None
    assert _said(["low", "medium", "high"], "This is an emergency") == ["high"]  # the top of a shorter scale
    assert _said(["low", "high"], "a moderate issue") == []  # two as near: none
    assert _said(["minor", "major", "critical"], "no rush") == ["minor"]
    assert _said(["low", "normal", "high", "urgent"], "urgent!") == ["urgent"]  # an option's own word: that option
    assert _said(["low", "normal", "high", "urgent"], "an emergency") == ["urgent"]
    assert _said(["red", "green"], "no rush, an emergency") == []  # not a scale: only the options' own words
    # Read only for a field whose name says it is a level: a budget's "high" is not an urgent message's.
    assert named(SEVERITY, "Urgent: a budget laptop", "budget") == [False] * 4
    assert named(SEVERITY, "Urgent: a budget laptop", "ticket_priority") == [False, False, True, False]
    assert _said(SEVERITY, "This is a non-urgent request") == [] and _said(SEVERITY, "hardly urgent") == []


def test_a_stated_level_wins_over_the_model_s_medium() -> None:
    d = Decider({"type": "object", "properties": {"severity": {"enum": SEVERITY}}, "required": ["severity"]},
                booleans=False, choices=True)
    opts = d.options["severity"]
    d.offsets = {said.key: 0.0 for said in opts}
    score = {"low": -2.0, "medium": 0.0, "high": -2.0, "critical": -3.0}  # the default model's usual reading
    for text, level in {"No rush at all, it still works.": "low", "This is an emergency!": "critical",
                        "It stopped working.": "medium"}.items():
        plan = Plan(d, text, [text])
        plan.statement_score = lambda said: score[opts[said]]  # type: ignore[method-assign]
        decided, shares = plan.outcome(None)  # type: ignore[arg-type]
        assert decided == {"severity": level}, text
        assert shares["severity"] >= 0.5
