"""How grounded extraction reads a business's ticket: the brand its greeting addresses, the writer's own company
wherever the record names it, and a refund threatened on a condition (the rules of asyncpage/extract/addressed.py,
employer.py and booleans.py; the figures they moved: docs/extraction.md)."""

from __future__ import annotations

from typing import Any

from asyncpage.extract import booleans as flags
from asyncpage.extract.addressed import addressed, addressed_brands
from asyncpage.extract.employer import signed_company, without_employer


def _holds(_field: str, _value: Any) -> bool:
    return True


def test_the_brand_a_greeting_addresses_replaces_a_word_the_model_took_from_the_subject() -> None:
    text = ("Subject: Chef jackets - sizes mixed up\n\nDear Stitchwell team,\n\nOur order of 60 Stitchwell ProChef "
            "jackets arrived on Monday.\n\nBest regards,\nNguyen Thi Lan")
    assert addressed(text) == "Stitchwell"
    assert addressed_brands(text, ["product"], {}, {"product": "Chef", "customer": "Nguyen Thi Lan"}, _holds) == \
        {"product": "Stitchwell"}
    # a value holding the name is kept, as is one the decisions made that holds it
    assert addressed_brands(text, ["product"], {"product": "Stitchwell ProChef"}, {"product": "Chef"}, _holds) == {}
    # the longest opening words the body writes again: "Boreal Air" of "Dear Boreal Air Group Sales"
    text = "Dear Boreal Air Group Sales,\n\nThe flight for our Boreal Air group booking was cancelled."
    assert addressed(text) == "Boreal Air"
    assert addressed("Hello Skyvale Group Desk,\nSkyvale Airways LIS-CPH on 9 September") == "Skyvale"


def test_no_brand_is_read_from_a_greeting_to_a_generic_team_or_a_name_the_body_never_repeats() -> None:
    for text in ("Dear Customer Service,\nMy Velmora ComfortLine broke.", "Dear Accounts Team,\nInvoice wrong.",
                 "Hi Maria,\nMy Velmora ComfortLine broke.",  # a person, no team
                 "Dear Wanderbay team,\nThe tent leaks.",  # the name is never written again
                 "Dear\n\nStitchwell team", "", "Dear " * 10_000,
                 "Dear TechHaus Support,\nI bought a Lumisse lamp from TechHaus last week."):  # a seller
        assert addressed(text) == "", text[:40]
    # the customer's own name is never the brand
    text = "Hello Ortega Support,\nThis is Ana Ortega; my Lumisse lamp flickers."
    assert addressed_brands(text, ["product"], {}, {"product": "Lumisse", "customer": "Ana Ortega"}, _holds) == {}
    # nor a name the field's schema refuses
    text = "Dear Stitchwell team,\nThe Stitchwell ProChef jackets are small."
    assert addressed_brands(text, ["product"], {}, {"product": "Chef"}, lambda f, v: v != "Stitchwell") == {}


def test_the_writer_s_company_is_cut_from_a_brand_s_spans_wherever_the_record_writes_it() -> None:
    text = ("I own Golden Lotus restaurant in Manchester. We bought an Aquelle DW-900 dishwasher.\n\n"
            "Nguyen Van Minh\nOwner, Golden Lotus")
    assert not any("Golden Lotus" in part for part in without_employer([text]))
    # a job title written in lowercase signs too
    text = "Combi oven arrived cracked. Voltari CombiPro 10, order 4471-XK.\nTomasz Wierzbicki\nowner, Bistro Lipa"
    assert not any("Bistro Lipa" in part for part in without_employer([text]))
    assert any("Voltari CombiPro 10" in part for part in without_employer([text]))


def test_a_last_line_signed_with_a_name_and_a_company_names_the_writer_s_company() -> None:
    def named(text: str) -> list[str]:
        return [text[a:b] for a, b in signed_company(text)]

    assert named("Zephrix Talon mice double-click. want replacements.\nInes Duarte, PixelPit Café") == \
        ["PixelPit Café"]
    assert named("Terminal keeps rebooting. Order 20240611-338.\n- Tomás Ibarra, Taquería El Sol, Monterrey\n") == \
        ["Taquería El Sol"]
    assert named("Thanks\nAnna Berg, Berg Bakery") == ["Berg Bakery"]
    for text in ("Order details\nOffice Chair, Herman Miller Aeron",  # a heading's item
                 "Items:\n- Desk, Fjell\n- Office Chair, Herman Miller Aeron",  # a list's last item
                 "I bought it.\nKind Regards, Anna", "Anna Berg, Berg Bakery",  # a closing; nothing above it
                 "The lamp broke.\nAnna Berg, 12 Main Street", "", "\n\n", "x\n" + "Aa " * 30_000 + ", B"):
        assert named(text) == [], text[:40]


def test_a_refund_threatened_on_a_condition_is_not_asked_for() -> None:
    refund = flags.Reading("the customer asks for money back", True, "refund", "money back")
    for text in ("Please send a technician this week. If it can't be fixed by Friday we'll be asking for a refund.",
                 "Please send replacement toners. If this can't be solved I may ask for a refund later.",
                 "Fix it please. Unless it works by Monday, I will request a refund."):
        assert refund.decide(3.0, text)[0] is False, text
    for text in ("If it can't be fixed, please refund me.",  # a conditional request: asked
                 "I want the difference refunded. If I don't get my money back by Friday I'll file a chargeback.",
                 "We have lost confidence in the unit. We want the purchase price reimbursed.",
                 "I would like to send it back and have the purchase price reimbursed.",
                 "We'd like a credit note for the 31 defective units (31 x EUR 39.90) against our next invoice."):
        assert refund.decide(-3.0, text)[0] is True, text
    assert refund.decide(3.0, "I do not wish to return it or have my money refunded.")[0] is False


def test_an_agent_signing_for_a_service_desk_is_never_the_writer() -> None:
    from asyncpage.extract.staff import without_staff

    quoted = ("Dr. Amara Okafor\nPractice Manager\n\n----- Forwarded message -----\nFrom: Meditherm Service Desk\n"
              "Dear Dr. Okafor, please descale the chamber.\nBest regards, Stefan, Meditherm Service Desk")
    parts = without_staff([quoted])
    assert not any("Stefan" in p for p in parts) and any("Amara Okafor" in p for p in parts)
    assert any("Ana Lopez" in p for p in without_staff(["Ana Lopez, Service Desk Manager at Foo"]))  # her title
