"""How a record names a copied field: the words that name it (`anchors`), the labels right before a span ("Order
no.: 55019", `labeled_id`), another kind's label on it (`named_otherwise`: a tracking or serial number where an
order's id was asked), the customer's purchase order beside the seller's order (`customers_po`), and how much more a
span must score from all that (`doubt`). Read by asyncpage.extract.decisions for a nullable copied field; the
stretches a span is searched in: asyncpage.extract.near.
"""

from __future__ import annotations

import bisect
import functools
import math
import re
from collections.abc import Sequence
from typing import Any

from asyncpage.extract.closed import is_denied
from asyncpage.extract.grounding import WRITER
from asyncpage.extract.readings import name_words

_GENERIC = frozenset("id ids identifier number num no nr code ref reference name value key the of a an".split())
NEAR = 60  # characters before a copied span that may name its field ("Order #", "order number was")
NAMELESS = 4.0  # nats more a span needs where the record never names its field (doubt)
ELSEWHERE = 8.0  # nats more where the record names it only away from the span (doubt)
TAIL = 40  # characters a near stretch may run on to end its word (near)
MAX_NEAR = 16  # near stretches read at most
NO_DIGIT = math.inf  # a span without a digit for a field whose name says it holds one (doubt): never
OTHERWISE = math.inf  # an id's span the record labels as another kind of number (doubt): never
NOT_A_NAME = math.inf  # a writer's span of words no one is named (doubt): never
# Words no one is named, any case: what a small model copied as the writer of a ticket that gives no name ("Please",
# "Your", an all-lowercase ticket's "my", v125-v126). No customer of the labeled tickets is one of them.
# Not "An", "Can", "Do", "No", "Or", "So": names too ("An Do").
_NOT_NAMES = frozenset("please your my our their the this that these those it its we you they he she i me us him them "
                       "there here what when where why how could would should are was were not but if also just still "
                       "order hello hi hey dear thanks thank sorry help urgent refund a".split())
LABELED = 6.0  # nats less a span needs where the field's own word labels it right before it (doubt)
# Kinds of number a record may label right before one ("Account ID: ACC-55190", "Merchant ID 600218847", "Support
# PIN: 7720", "transaction IDs 4410298873 and 4410298874", "Warranty card serial 88-2019-A"), and the words of
# fields that are such numbers themselves (a phone, an account, a tracking number...), which are not read so: one
# kind is often labeled by another's word ("Mobile:" for a phone, "Member ID" for a customer id).
_KINDS = ("account acct tracking transaction merchant case ticket serial pin warranty phone tel telephone mobile "
          "member membership policy claim fault licence license imei iban vat tax sku model part device incident "
          "session parcel shipment consignment waybill courier bank card rma customer client user contact frame "
          "chassis batch lot asset tenant contract").split()
_KIND_WORDS = frozenset(_KINDS)
# The fields read so: an order's id ("order_id", "purchaseNumber", "booking_ref"), whose record's other numbers are
# labeled as other kinds; a field of another kind has kin that label its own ("Mobile:" for a callback number).
_ORDERS = frozenset("order orders purchase booking reservation".split())
# Within a line: a contrast, past which the field's own word never labels the span ("no order number, but the serial
# is ..."), and the clauses before it, in which it does unless it names a value of its own first ("(order EV-55190-B,
# customer account 100-4432"; not "Order number, as shown in my account: 55120").
_CONTRAST = re.compile(r";|\b(?:but|however)\b", re.IGNORECASE)
# The field's own word labeling the span right before it, on its line: the word (or its plural), an id noun, a colon
# or "#", then the span ("order HVN-3381045", "Order number: #55019", "booking ref RLN-8K2Q7"); an order's id is
# labeled by a booking's or a reservation's word too. A date or a time is never such an id ("purchase: 14-02-2024").
# A label may hold the id's first group ("order GLM#559203", "order AUR 5519 0087", "order HF 33-0912"): a span found
# after it is read with it (labeled_id).
_ID_NOUNS = r"(?:(?:ids?|numbers?|no|nr|num|ref|reference|code|nummer|numéro|número|numero)\b|n\.?[°º])\.?"
_LABEL_TAIL = (rf")s?(?:[ \t]+(?:{_ID_NOUNS})){{0,2}}[ \t]*(?:[:#][ \t]*){{0,2}}(?:is[ \t]+|was[ \t]+)?#?"
               rf"((?<![A-Za-z0-9])(?!{_ID_NOUNS}|(?:" + "|".join(_KINDS) + r")\b)(?-i:[A-Z][A-Z0-9]{0,4})[ #])?\Z")
# What else names an order's id: a booking's or a reservation's word, and the word for an order in the languages
# customers write it in beside English ("Bestellnummer: DW-5590213", "Bestellung #VL-20931", "commande LUM-2291").
_BOOKINGS = ("booking", "reservation", "bestellung", "bestellnummer", "bestelnummer", "bestelling", "commande",
             "pedido", "encomenda", "ordine", "zamówienie", "zamowienie", "tilaus", "tilausnumero", "ordrenummer",
             "bestilling", "bestillingsnummer", "beställning", "ordernummer", "sipariş", "objednávka", "rendelés")
# A purchase order's abbreviation, in capitals, naming an order as "order" does ("under PO 8823", "(PO# 4471)", "P.O.
# 20817"); not a post office's ("PO Box 118"). Every labeled set that writes one (15 tickets of v9-v90) labels the PO
# number the order's id where the ticket gives no other; beside the seller's own order number ("order CBX-11902, our
# internal PO 7781") that one.
_PO = r"(?-i:P\.?O\.?(?!S))(?!\.?\s*(?i:box))"
# An order's confirmation labels its id as the order's own word does ("confirmation number FJ88-1273", "Confirmation
# number: 2024-ALB-66120"); not a code's ("confirmation code CNX-4410", a cancellation's in every labeled set that
# writes one, or a password reset's), another kind's ("refund confirmation number RF-88123"), or one after a
# cancellation's word in its sentence ("I cancelled my plan (confirmation no. CNX-4410)") but an order's or a
# booking's ("I cancelled my booking (booking confirmation no. SLY-844209)"): _NOT_ORDER_CONFIRMED. Spent v9-v100.
_CONFIRMED = "confirmation"
_NOT_ORDER_CONFIRMED = re.compile(r"(?:\b(?:refund|return|returns|payment|delivery|shipping|shipment|cancellation|"
                                  r"password|reset|account|e-?mail|verification|appointment|rma)[ \t]+)\Z"
                                  r"|[^.!?\n]*\bcancel[^.!?\n]*(?<!order )(?<!booking )(?<!reservation )\Z",
                                  re.IGNORECASE)
# An id that names itself an order's ("ORD-5562190", "ORDER-55123", "Ord-20931-B", "PO-2024-117", "ORD-58-99321": four
# digits first, or two groups of two or more; not "ORD2", "ORD5-SORT", "PO-1-800-555-1234").
_SELF_ORDER = re.compile(r"(?:(?:ORD|Ord|ORDER|Order)[-_#/]?|PO[-_#/ ]?)(?=\d{4}|\d{2,}-\d{2})\d+(?:-[A-Z0-9]{1,6})*")
# A purchase order's label right before a span: a number of four digits after it is its id, not an amount.
_PO_LABEL = re.compile(r"(?<![\w.])" + _PO + rf"(?:[ \t]+{_ID_NOUNS}){{0,2}}[ \t]*(?:[:#][ \t]*){{0,2}}\Z",
                       re.IGNORECASE)
# An order's id in brackets right after the ordered thing's phrase: "the Parlour 12 I ordered (MF-0911-2287)", "I
# ordered a Zipvolt Urban X scooter (#55019)".
# Only an id's shape: "#" and digits, or groups of capitals and digits joined by hyphens ("MF-0911-2287"); not a
# price, a year, a model number or a catalogue code ("($249.99)", "(2019)", "(A2338)", "(B08XYZ1234)").
_BRACKET_ID = r"#\d{4,}[\w-]*|#?[A-Z0-9]+(?:-[A-Z0-9]+)+"
_BRACKETED = re.compile(r"\b(?P<verb>ordered|purchased|bought|booked)\b[^.\n()]{0,60}\(\s*"
                        rf"(?-i:(?P<id>{_BRACKET_ID}))\s*\)", re.IGNORECASE)
# What reads as an amount or a count, not an id, right after an order's word ("order 2500 more units", "My order
# 1,299.00"): four digits or fewer, thousands separators, decimals, or a unit after it.
_AMOUNT = re.compile(r"[\d,.]*\d|\d{1,4}")
_UNIT = re.compile(r"[ \t]*(?:units?|pcs|pieces?|items?|boxes|cases|packs?|kg|lbs?|pairs?|sets?|more|stück|stk|pezzi"
                   r"|pz|piezas|unidades|unités|pièces|sztuk|szt|stuks|stycken|kpl)\b", re.IGNORECASE)
# A date (a year first, then a month and a day; or two groups of one or two digits, then a year of two or four) or a
# time; not an id of date-like groups ("2024-19-5527", "ZAM/2024/07/1182").
_DATE = re.compile(r"(?<!\d)(?:\d{4}[-/.](?:0?[1-9]|1[0-2])[-/.](?:0?[1-9]|[12]\d|3[01])"
                   r"|\d{1,2}[-/.]\d{1,2}[-/.](?:\d{4}|\d{2}))(?!\d)|\d{1,2}:\d{2}(?::\d{2})?")
# An invoice's or a receipt's word, in the languages customers write it in beside English ("commande n° CMD-884120,
# facture F-55019": the facture's number was read as the order's id once).
_INVOICES = ("invoice", "receipt", "facture", "factura", "fattura", "fatura", "faktura", "rechnung", "rechnungsnummer",
             "quittung", "lasku", "kuitti", "kvitto", "kvittering", "ricevuta", "recibo", "reçu")
# Where a stretch naming the field ends once it has held a value (a word with a digit): the line's end, or another
# kind's label ("order HVN-3381045, model HK-17P", "Order LMV-209-88413, invoice INV-55102").
_ANOTHER = re.compile(r"\n|\b(?:" + "|".join([*_KINDS, *_INVOICES]) + r")\b", re.IGNORECASE)
# A document's or another number's word right before the bracket: the bracket is its id ("bought a licence and the
# invoice (INV-2024-1187) is wrong"); not a thing's ("I ordered a new phone (MF-0911-2287)", "a gift card (GC-55)").
_KIND_BRACKET = re.compile(r"\b(?:" + "|".join(_INVOICES) + r"|serial|tracking|ticket|rma|claim|imei|sku|iban|vat|"
                           r"waybill|account|transaction)s?(?:[ \t]+(?:no|nr|number|id)\.?)?[ \t]*\([ \t]*$",
                           re.IGNORECASE)
_VALUE = re.compile(r"(?=\S*\d)\S{4,}")  # an id's shape: four characters or more, one a digit
_CLAUSE = re.compile(r"[,!?()]")
# The label: a kind, an id noun, a colon or "#", at most one more id of a list before the span, then the span.
_LABELED = re.compile(r"\b(?:" + "|".join(_KINDS) + r")s?(?:\s+(?:id|ids|number|numbers|no\.?|nr\.?|num|code|"
                      r"ref|reference|pin))?\s*(?:[:#]\s*)?(?:is\s+|was\s+)?(?:\S+(?:,\s*|\s+and\s+))?$",
                      re.IGNORECASE)
# Words of a field's name that say its value holds a digit (an id, a number, a phone): not "code" or "ref", which
# may be words ("SUMMERSALE").
_NUMBERED = frozenset("id identifier number num no nr serial phone telephone tel zip postcode iban imei vin isbn ean "
                      "upc tracking invoice".split())
_RUN_TOGETHER = r"(?:order|customer|account|ticket|case|booking|transaction|user|member|reference)(?:id|number|nr|no)"
MAX_ANCHORS = 8


def anchors(name: str, prop: dict[str, Any]) -> tuple[str, ...]:
    """The words that name a field in a record: its name's and its title's words (camelCase and snake_case split,
    any script, casefolded), generic ones and those of 3 letters or fewer left out ("tax" opens "taxi"), at most
    MAX_ANCHORS. () where none is left: the field is not read for them."""
    title = prop.get("title") if isinstance(prop.get("title"), str) else ""
    split = re.sub(r"(?<=[a-z])(?=[A-Z])", " ", f"{name} {title}")
    words = (w.casefold() for w in re.findall(r"[^\W\d_]+", split))
    return tuple(dict.fromkeys(w for w in words if w not in _GENERIC and len(w) > 3))[:MAX_ANCHORS]


def numbered(field: str) -> bool:
    """Whether a field's name says its value holds a digit: its last word an id, a number, a phone ("order_id",
    "serialNumber", "customerNo", "ORDER_IDS", "ordernumber"); not "tracking_status" or "phone_type", whose head
    word says otherwise."""
    words = re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[^\W\d_A-Za-z]+", field)
    last = words[-1].lower() if words else ""
    last = last[:-1] if last.endswith("s") and last[:-1] in _NUMBERED else last
    return last in _NUMBERED or re.fullmatch(_RUN_TOGETHER, last) is not None


def doubt(text: str, span: str, words: Sequence[str], field: str = "", branch: dict[str, Any] | None = None) -> float:
    """How much more a nullable copied field's span must beat its offset by, from where the record names the field
    (a word of `words` opening one of its words, any case: "order", "ordered"; for an order's id a booking's or a
    reservation's word and a purchase order's "PO" too, as `_naming` gives them): nothing where one comes within
    NEAR characters before the span or inside it ("Order #A-1", "ORDER-55123"), or where the field has no such
    word; NAMELESS where the record never names it; ELSEWHERE (e^8) where it names it only away from the span:
    the span is then likely another number (a tracking or serial number where the order id was asked);
    OTHERWISE (never) for an order's id (_ORDERS) the record labels as another kind of number (`named_otherwise`) or
    as the customer's purchase order beside the seller's order (`customers_po`). And
    NO_DIGIT (never) where `field`'s name says its value holds a digit (`numbered`) and the span has none: a form's
    "(left blank)" or "N/A (bought in a shop)" as the order id. So a digit-less id ("XKQZTB") is null there, unless
    the field's schema (`branch`) gives its own `pattern`, which then says what its values look like. NOT_A_NAME
    (never) for a writer's span (`branch` marked grounding.WRITER) of words no one is named ("Please"). And LABELED
    less (a negative doubt) where the field's own word labels the span right before it (`labeled`): the record
    says which number it is."""
    if span and numbered(field) and not (branch or {}).get("pattern") and not any(ch.isdecimal() for ch in span):
        return NO_DIGIT
    if span and (branch or {}).get(WRITER) is True and \
            all(w.strip(".,;:!?'\"()").casefold() in _NOT_NAMES for w in span.split()):
        return NOT_A_NAME
    if not words or not span:
        return 0.0
    pattern = re.compile(r"\b(?:" + _naming(words)[1] + ")", re.IGNORECASE)  # "booking ref", "PO" name an order too
    own_label = labeled(text, span, words)  # the field's own label wins over another kind's ("Customer: #LQ-3390")
    if numbered(field) and _ORDERS.intersection(words) and not _KIND_WORDS.intersection(words) and \
            not own_label and named_otherwise(text, span, pattern):
        return OTHERWISE
    if own_label:
        return OTHERWISE if customers_po(text, span, words, field) else -LABELED
    if not pattern.search(text):
        return NAMELESS
    named = [m.span() for m in pattern.finditer(text) if not _no_number(text, m) and not _empty_field(text, m)]
    starts = [a for a, _ in named]
    for i in _places(text, span):
        k = bisect.bisect_left(starts, max(0, i - NEAR))
        if k < len(named) and named[k][1] <= i + len(span):
            return 0.0
    return ELSEWHERE


def _no_number(text: str, m: re.Match[str]) -> bool:
    """Whether the record says it has no such number where `m` names the field: the naming word after _NO_NUMBER,
    before an id noun, its details or the clause's end ("I don't have an order number - only the tracking number ...,
    1W882 7730 114"); not a denied verb's object ("I haven't received my order yet. It's #88123")."""
    return _NO_NUMBER.search(text, max(0, m.start() - 40), m.start()) is not None and \
        _NUMBER_AFTER.match(text, m.end()) is not None


# Saying there is none, right before the naming word: "I don't have an order number", "no order no.", "without a
# booking reference", "I don't have an online order number", "I cannot find the order number", "have no order
# details", "I do not have an online order." (nine spent tickets, each labeled null).
_NO_NUMBER = re.compile(r"\b(?:no|without|(?:do|does|did)(?:n['’]t|[ \t]+not)[ \t]+(?:have|get)|have[ \t]+no|"
                        r"haven['’]t[ \t]+got|never[ \t]+(?:had|got|received)|no[ \t]+longer[ \t]+have|"
                        r"(?:can['’]t|cannot|can[ \t]+not|couldn['’]t)[ \t]+find)[ \t]+"
                        r"(?:(?:an?|any|the|my|our)[ \t]+)?(?:(?:online|original|web|e-?mail)[ \t]+)?\Z", re.IGNORECASE)
# ... and what follows the naming word there: an id noun, its details, or the clause's end.
_NUMBER_AFTER = re.compile(rf"[ \t]*(?:{_ID_NOUNS}|#|details\b|info\b|information\b|confirmation\b|[.,;:!)–-]|\r?$)",
                           re.IGNORECASE | re.MULTILINE)


# A form's field the naming word labels, left empty: the word opens its line, the line ends at its colon and the next
# line is another field, a label of words ("Order number:\nSubject: Nimbra FoldDesk 120", "Order ID: \nInvoice no.:
# ..."): the record names the field away from any value (ten spent tickets, each labeled null). Not a chat's prompt
# ("Agent: Please provide your order number:\nMaria: 55123"), nor a time or an id before a colon ("Sent 10:42").
_EMPTY_FIELD = re.compile(rf"(?:[ \t]+{_ID_NOUNS}){{0,2}}[ \t]*:[ \t]*\r?\n[^\S\n]*[^\W\d_][^\n:\d]{{0,30}}:"
                          r"(?![ \t]*(?:#?\d[\w-]*)?\r?$)", re.IGNORECASE)  # not a chat's answer ("Maria: 55123")
_LINE_OPENS = re.compile(r"[^\S\n]*(?:[-*•][^\S\n]*)?")  # only blanks (and a bullet) before it on its line


def _empty_field(text: str, m: re.Match[str]) -> bool:
    """Whether the naming `m` labels a form's field left empty (_EMPTY_FIELD)."""
    return _EMPTY_FIELD.match(text, m.end()) is not None and \
        _LINE_OPENS.fullmatch(text, text.rfind("\n", 0, m.start()) + 1, m.start()) is not None


def _naming(words: Sequence[str], po: bool = True) -> tuple[bool, str]:
    """(whether `words` name an order's id, the alternation of what names the field in a record: its words, and for
    an order's id a booking's or a reservation's word and, with `po`, a purchase order's "PO" too)."""
    orders = bool(_ORDERS.intersection(words))
    return orders, "|".join([*map(re.escape, (*words, *(_BOOKINGS if orders else ()))),
                             *([_PO] if orders and po else [])])


def labeled(text: str, span: str, words: Sequence[str]) -> bool:
    """Whether some place `text` holds `span` has one of `words` labeling it right before it on its line, the label
    holding the id's first group or not (`labeled_id` finds it)."""
    return bool(labeled_id(text, span, words))


def labeled_id(text: str, span: str, words: Sequence[str], po: bool = True) -> str:
    """`span` as the record labels it: where one of `words` (for an order's id, a booking's or a reservation's word
    too) labels it right before it on its line (_LABEL_TAIL: "order HVN-3381045", "Order no.: 55019", "booking ref
    RLN-8K2Q7"), for an order's id with the id's first group the label holds ("order GLM#559203" for "559203",
    "order AUR 5519 0087" for "5519 0087"; never an id noun or a kind's word: "ORDER REF NO 55019", "order SKU
    88123"), or alone in brackets after the ordered thing's phrase ("I ordered a scooter (#55019)", _BRACKETED, not
    denied). Only an id's shape is read so: four characters or more, a digit, not a date, a time, an amount or a
    count ("order 2500 more units", "order 1,299.00"; four digits after a purchase order's "PO" are its id). "" where no
    place is labeled so. Without `po`, a purchase order's label labels nothing ("PO 4471", "purchase order 7781-HB",
    "PO-4471982"): what the record labels as the seller's order (`customers_po`)."""
    if len(span) < 4 or not any(ch.isdecimal() for ch in span) or _DATE.search(span) or not words:
        return ""
    orders, own = _naming(words, po)
    if _AMOUNT.fullmatch(span) and (len(span) <= 4 or not span.isdecimal()) and not (  # no PO's id (read only then)
            orders and po and span.isdecimal()
            and any(_PO_LABEL.search(text, max(0, i - 32), i) for i in _places(text, span))):
        return ""
    if orders and _SELF_ORDER.fullmatch(span) and (po or not span.startswith("PO")) and \
            re.search(r"(?<![\w-])" + re.escape(span) + r"(?![\w-])", text):
        return span
    confirmed = orders and _CONFIRMED not in words  # an order's confirmation labels it too (_CONFIRMED)
    label = re.compile(r"\b(?:" + own + ("|" + _CONFIRMED if confirmed else "") + _LABEL_TAIL, re.IGNORECASE)
    for i in _places(text, span):
        end = i + len(span)
        after = text[end : end + 2]
        if not after[:1].isalnum() and not (after[:1] in "-/._#" and after[1:].isalnum()) and \
                not (span.isdecimal() and _UNIT.match(text, end)):  # the id's end, and no count's unit after it
            if (m := label.search(before := text[max(0, i - 48) : i])) and not (
                    confirmed and m[0].lower().startswith(_CONFIRMED) and (re.match(r"\w+[ \t]+code", m[0], re.I)
                    or _NOT_ORDER_CONFIRMED.search(text, max(0, i - 120), i - len(m[0])))) and \
                    (po or not _PURCHASE.search(before, 0, m.start())):
                return (m.group(1) or "" if orders else "") + span
            if _answers(text, i, end, own):
                return span
            if orders and any(m.end("id") == end and m.start("id") in (i, i - (text[i - 1 : i] == "#"))
                              and not is_denied(text, *m.span("verb"))
                              and not _KIND_BRACKET.search(text, max(0, m.start("id") - 40), m.start("id"))
                              for m in _BRACKETED.finditer(text, max(0, i - 80), min(len(text), end + 4))):
                return span
    return ""


# Not the seller's order (customers_po) nor the order asked about (_labeled_windows): a purchase order, a work order, a
# return's, a replacement's, a money order, an earlier one, "order" as a verb ("the driver's work order WO-77120",
# "return order RT-55210", "purchase-order 7781-HB", "my previous order ORD-4471234", "I'd like to order XR-200").
_PURCHASE = re.compile(r"\b(?:purchase|work|return|returns|replacement|money|repair|service|exchange|credit|postal|"
                       r"transfer|previous|earlier|old|first|other|to|re)[ \t-]+\Z", re.IGNORECASE)
# An id's shape as a record writes it, for the ids it labels (`customers_po`): a digit in it ("#55019" gives "55019").
_AN_ID = re.compile(r"(?<![\w/-])[A-Za-z0-9][\w/#-]*\d[\w/#-]*(?<![-/#])")
MAX_IDS = 32  # distinct id-shaped words read for the seller's order and the labeled windows (_ids)


def _asks_po(words: Sequence[str], field: str) -> bool:
    """Whether a field asks for the customer's purchase order itself: "purchase" or "PO" in its words or its name
    ("purchase_order_number", "order_po_number"), or the customer's order ("customer_order_number", B2B's name for
    it). Its name is read whole: anchors leave out words of three letters or fewer."""
    named = {*words, *name_words(field)}
    return bool({"purchase", "po"} & named) or {"customer", "order"} <= named


def customers_po(text: str, span: str, words: Sequence[str], field: str = "") -> bool:
    """Whether `span`, read as an order's id, is the customer's purchase order beside the seller's own order: only a
    purchase order's label labels it ("our PO 4500123987", "purchase order 7781-HB"), and the record labels another
    id with the order's own word ("your order KX-ORD-33018", "order confirmation OC-2210-559"). Every labeled set
    that gives both labels the seller's id the order's (seven tickets of v62-v104). Never for a field that asks for
    the purchase order (`_asks_po`: "purchase_order_number", "order_po_number"), nor beside a work order, a return's
    or a money order (_PURCHASE). The first MAX_IDS id-shaped words are read."""
    if not _ORDERS.intersection(words) or _asks_po(words, field) or \
            not labeled_id(text, span, words) or labeled_id(text, span, words, po=False):
        return False
    return any(other != span for other in _sellers(text, tuple(words)))


@functools.lru_cache(maxsize=8)
def _ids(text: str) -> tuple[re.Match[str], ...]:
    """The first place of each distinct id-shaped word of `text` (_AN_ID), the first MAX_IDS of them, and one more
    where there are more (`_labeled_windows` then reads none)."""
    first: dict[str, re.Match[str]] = {}
    for m in _AN_ID.finditer(text):
        if m[0] not in first:
            first[m[0]] = m
            if len(first) > MAX_IDS:
                break
    return tuple(first.values())


@functools.lru_cache(maxsize=8)
def _sellers(text: str, words: tuple[str, ...]) -> tuple[str, ...]:
    """The ids `text` labels as an order's with the order's own word, no purchase order's (of its first MAX_IDS
    id-shaped words)."""
    return tuple(m[0] for m in _ids(text)[:MAX_IDS] if labeled_id(text, m[0], words, po=False))


def _places(text: str, span: str) -> list[int]:
    """Where `text` holds `span`."""
    out, i = [], text.find(span)
    while i >= 0:
        out.append(i)
        i = text.find(span, i + 1)
    return out


# A chat's answer: the span alone on its line after its speaker, or its first sentence ("Customer: #LQ-3390",
# "[14:04] Sarah: 77300192", "Customer: CF-55102-UK. It already went back once"),
# the line before a question asking for the field's id ("Could you confirm your order number?"; not "What's the
# tracking number on your order?", "When did you place the order?"). A speaker is no kind's label ("Invoice:").
_SPEAKER = re.compile(r"[^\S\n]*(?:\[[^\]\n]{1,24}\][^\S\n]*)?(?:[^\n:\[\]]{1,40}:)?[^\S\n]*#?")
_KIND_SPEAKER = re.compile(r"\b(?:" + "|".join([k for k in _KINDS if k not in ("customer", "client", "user", "contact")]
                                               + ["invoice", "receipt", "order", "ref", "reference"]) + r")\b", re.I)
_LINE = 200  # characters a chat's answer line and its question are read over at most


def _answers(text: str, start: int, end: int, own: str) -> bool:
    line = text.rfind("\n", max(0, start - _LINE), start) + 1
    stop = text.find("\n", end, end + _LINE)
    rest = text[end : stop if stop >= 0 else end + _LINE]
    if not line or not _SPEAKER.fullmatch(text, line, start) or _KIND_SPEAKER.search(text, line, start) or \
            (rest.strip(" \t\r.!") and not re.match(r"[.!][ \t]+[A-Z]", rest)):  # alone, or its answer's sentence
        return False
    above = text.rfind("\n", max(0, line - 1 - _LINE), line - 1) + 1
    asked = text[max(above, line - 1 - _LINE) : line - 1].rstrip()
    ids = re.compile(r"\b(?:" + own + rf")s?[ \t]*(?:{_ID_NOUNS}|#)", re.IGNORECASE)
    return asked.endswith("?") and bool(ids.search(asked))


def named_otherwise(text: str, span: str, own: re.Pattern[str]) -> bool:
    """Whether every place `text` holds `span` is labeled, right before it, as another kind of number than the field
    `own` matches the words of (_LABELED: "Account ID: ", "Merchant ID ", "transaction IDs 4410298873 and "), and
    the field's own word does not label it too (`_owned`, within the 48 characters before it on its line, and not in
    the span: "Order / account no. 55120", "Order ref on my business account: 5512", "orders on my account: 55120,
    55121", "ORDER-55123" are not; "(order EV-55190-B, customer account 100-4432" and "no online order number, but
    the serial is NBX14-7" are). False where the span is not in the text."""
    if not span or own.search(span):
        return False
    places = _places(text, span)
    for i in places:
        line = text[max(0, i - 48) : i].rsplit("\n", 1)[-1]
        m = _LABELED.search(line)
        if m is None or _owned(line[: m.start()], line[m.start() :], own):
            return False
    return bool(places)


def _owned(before: str, label: str, own: re.Pattern[str]) -> bool:
    """Whether the field's own word (`own`) labels the span after `label` (another kind's label, _LABELED): inside
    that label, or in `before` it on the line back to a contrast, unless the clause it is in holds a digit after it
    (then it labels that other value)."""
    if own.search(label):
        return True
    for clause in reversed(_CLAUSE.split(_CONTRAST.split(before)[-1])):
        found = list(own.finditer(clause))
        if found:
            return not any(ch.isdigit() for ch in clause[found[-1].end() :])
    return False
