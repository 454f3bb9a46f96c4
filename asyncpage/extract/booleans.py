"""Yes/no fields decided by how likely the model finds their statement, not by generating true or false.

Asked for a boolean inside JSON, the default model (270M, a base model) answers from the prompt, not
from the record: on examples/grounded its refund flag came out `false` for all 40 tickets, and the
log-odds of `true` against `false` ranked refund tickets no better than chance (AUC 0.49). Yes/no
questions and few-shot classification did no better, and transformers gives the same numbers: it is the
model. What it does know is which text is likely after which, so each top-level boolean property is
scored with the engine's prompt log-probabilities, in one of two readings:

- With a description, its statement read after the record: the log-likelihood of " asks for money back."
  after "<record>\n\nIn this message, the customer" (its subject read as context: Reading.after). Scored
  whole, it ranked the 60 refund tickets of examples/grounded at AUC 0.92, and put 8 of the extraction
  example's 10 urgent flags right.
- Without one (a bare `refund`), " refund." read after the record ranked them at 0.77 and put 11 of
  the 20 plain tickets right; its name as a heading before the record did better: how much "Record where
  refund.\n\n" raises the record's own log-likelihood over "Record.\n\n", per token (the noisy-channel
  reading, Min et al., 2022; 15 of the 20). That gain is mostly the words the two share, so it is read
  only where a name is all there is: a described refund read that way was right for 38 of 60 tickets
  ("the customer requests a refund") against 49 read after it, and `urgent` for 5 of 10 against 8.

Any score is judged against the same reading's mean score on the reference records (prompt.REFERENCES):
true when it beats that. "In this message," was chosen among three openings on those 60 tickets (the others
put 43 and 44 of them right, against 49), so the refund figures are somewhat optimistic; they were measured
with the four solved records as references, before the two plain ones were added. This module says how each
boolean reads; the scoring, the offsets and the decision are decisions.py's, as for every closed choice.

The JSON is generated as before and the decision replaces the model's own boolean in the value. Not as a
`const` in the grammar: beams rank whole values, and a forced `"urgent": false` at the end scored
differently after each beam's name (one ticket's best name became its e-mail address); moved to the
front, it changed the names the model chose after it (two e-mail addresses). The statement is the
field's description ("true when the customer asks for money back" reads "the customer asks for money
back"); without one, its title or name.
"""

from __future__ import annotations

import bisect
import itertools
import re
from typing import Any, NamedTuple

from asyncpage.extract.closed import NAMED_WEIGHT, is_denied, nameable, naming_spans
from asyncpage.extract.grounding import DETERMINERS, resolve
from asyncpage.extract.readings import logistic, name_words

PLAIN = "Record.\n\n"
AFTER = "\n\nIn this message,"
# How descriptions of a boolean usually open; what follows is the statement that makes it true.
_OPENING = re.compile(r"^\s*(?:(?:is\s+|set\s+to\s+)?true\s+(?:when|if|whenever)|set\s+(?:when|if)"
                      r"|(?:indicates\s+)?(?:whether(?:\s+or\s+not)?|if))(?:\s+|$)",
                      re.IGNORECASE)


# Verbs that open a boolean's name and say nothing of what a record names ("is_urgent", "wants_money_back").
_VERBS = frozenset("is are was were has have had did does do can should will wants want needs need asks ask "
                   "requires require requested".split())
# Verbs of a description that say a request; what it asks for follows "for" or a determiner ("asks for a refund",
# "wants the money back", "requests a callback"; not "asks about shipping", "wants to know").
_ASKS = frozenset("asks ask requests request wants want demands demand needs need expects expect seeks seek".split())
_LEADS = frozenset("for a an the their his her its my your some".split())
# Objects that say nothing a record could be read for ("asks for help", "wants something").
_VAGUE = frozenset("this that it something anything nothing more one help information info assistance support "
                   "answer response".split())
# A record declines what it names: a negated wish right before it ("I don't want a refund", "not looking for my
# money back", "not looking for compensation or a refund", "no need for a refund"), "rather than" / "instead of" it
# ("We'd rather have working trumpets than the money back"),
# "not needed" after it, a "no" with "needed" ("no refund needed"), a preference for another remedy in the next
# clause ("I could get a refund, but I'd rather just have a replacement sent"; not "but I'd rather not wait"), or a
# refusal of what was named ("offered a refund or a discount, but I don't want either"). Any other denial ("I still
# haven't received my refund", "why can't I get a refund?") is how a request is often made.
_DECLINED_BEFORE = re.compile(r"(?:\b(?:do\s*n[o'’]?t|dont|not|never)\s+(?:\w+\s+){0,2}?"
                              r"(?:want|need|require|wish|looking\s+(?:for|to(?:\s+(?:get|have|receive))?)"
                              r"|asking\s+for|interested\s+in|expecting|seeking|requesting|claiming|demanding|after)"
                              r"|\bno\s+need\s+(?:for|of)|\brather\s+(?:\w+\s+){0,4}?than|\binstead\s+of"
                              r"|\bthan\s+(?:get|getting|receive|receiving))\s+"
                              r"(?:(?:\w+\s+){0,2}|(?:\w+\s+){0,4}(?=or\s))(?:or\s+(?:\w+\s+){0,2})?$",
                              re.IGNORECASE)
# "not" or "do not" right before it where no verb is denied by it ("I want a new frame, not my money back", "I want
# not my money back", "Exchange for XL please, not refund", "Please do not refund"; not "you have still not refunded
# me", "why did you not refund me", nor a participle: "cancelled but not refunded").
_NOT_IT = re.compile(r"(?:(?:^|[,;:.!?(]|\b(?:please|and|but|just|want|wants|like))\s*(?:not|do\s+not|do\s*n['’]t)"
                     r"|\bplease\s+(?:do\s+not|do\s*n['’]t))\s+(?:(?:a|an|the|my|our|any|for|for\s+a)\s+)?$",
                     re.IGNORECASE)
# A remedy's participle wished for, then the refund's denied ("we'd like it repaired, not refunded", "I want the unit
# replaced and not refunded", "to be exchanged - not refunded"); not a remedy that happened ("it was replaced and not
# refunded!", "they never fixed, not refunded, not even replied"), nor "cancelled but not refunded".
_REMEDIES = r"(?:repaired|replaced|fixed|exchanged|swapped|serviced)"
_REMEDY_NOT = re.compile(r"(?:\b(?:like|want|wants|need|needs|prefer|have|get|rather)\s+"
                         r"(?:(?:it|this|that|them|one|the|my|our|unit|item)\s+){0,2}|\bto\s+)(?:be\s+)?"
                         rf"{_REMEDIES}(?:\s+(?:or|and)\s+{_REMEDIES})?\s*(?:(?:[,;]|[-\u2013\u2014])\s*)?"
                         r"(?:and\s+)?not\s+$", re.IGNORECASE)
# Answered no on a form, the "No" alone on its line ("Refund requested: No"; not "Refund? No answer yet"), or of no
# help ("a refund would not help me").
_ANSWERED_NO = re.compile(r"(?:[^\S\n]+(?:requested|wanted|needed|required|request))?[^\S\n]*[:?][^\S\n]*(?:no|none)"
                          r"[^\S\n]*(?:[.!](?![^\S\n]*\d)|$)|\s+(?:would|will|does|is|did)\s*(?:n['’]t|\s+not)\s+(?:help|solve|fix)\b"
                          r"|\s+won['’]t\s+(?:help|solve|fix)\b", re.IGNORECASE | re.MULTILINE)
# "No refund please", "no refund, thanks".
_NO_PLEASE = re.compile(r"[\s,]*(?:please|thanks|thank\s+you)\b", re.IGNORECASE)
# The ways a record asks for its money back beyond the words "money back" and "refund", for a field that is a refund
# (_REFUNDS): the verb's participle wished for ("I'd like the fee refunded", not "I was already refunded"),
# reimbursement, a charge reversed, a credit note asked for (a business's refund: "request a credit note for their full
# amount"), an amount reimbursed, returned, given, got or credited back ("get back the 680 yuan", "credit
# the 78 euros back to my card", "return the full amount", "I'd rather the €649 went back onto my card"). Every part
# bounded: the patterns are tried at each position of a record.
_AMOUNT = (r"(?:(?<![\w.,])(?:[$€£¥₹]|R\$)[^\S\n]?\d[\d,.]{0,12}(?:\s\d{3}){0,3}(?!\d)"
           r"|(?<![\w.,])\d[\d,.]{0,12}[^\S\n]?(?:€|(?:euros?|eur|usd|dollars?|pounds?|gbp|chf|cad|aud|nzd|yuan|rmb"
           r"|pln|sek|nok|dkk|yen|rupees?|inr|reais|brl|lira|zar|rand|mxn|pesos?)\b))")
_MONEY = (r"(?:(?:(?:the|my|our|full|whole|second|duplicate)\s+){0,3}(?:(?:money|payment|amount|purchase\s+price"
          rf"|deposit|charges?)\b(?!\s+(?:slip|tag|method|details|form|link|page|receipt|card))|{_AMOUNT})"
          r"|(?:what|everything)\s+(?:I|we)\s+(?:paid|spent))")
# Who asks the seller to reimburse or to issue a credit note: "Please (just) ...", "(can / could / would) you ...",
# "you to ...", "we / I (would like to) ...", "... and request"; not a third party ("my company can reimburse the
# purchase", "our insurer will reimburse") nor a policy ("your policy says you reimburse the full amount").
_ASKED = (r"(?:\bplease(?:\s+just)?\s+|(?<!says\s)\byou(?:\s+(?:can|could|would|will))?(?:\s+please)?\s+|\byou\s+to\s+"
          r"|\b(?:we|I)(?:\s+would\s+like\s+to|['\u2019]d\s+like\s+to)?\s+|\band\s+)")
_MONEY_BACK = re.compile(
    r"\brefunded\b(?!\s+(?:already|fine))|\breimbursement\b|\b(?:be|get|being|getting)\s+reimbursed\b"
    rf"|{_ASKED}reimburse\s+(?:me|us|the|these|this|that|those|my|our|all|it|them)\b"
    r"|\breverse\s+(?:the|that|this)\s+(?:charge|payment)\b"
    rf"|{_ASKED}(?:request|issue|send|raise|provide)\s+(?:us\s+|me\s+)?(?:a|the|your)\s+credit\s+note\b"
    r"|\b(?:(?:we|I)(?:['\u2019]d|\s+would)\s+(?:like|prefer)|(?:we|I)\s+(?:want|request|prefer))\s+a\s+credit\s+note"
    r"\s+(?:for|covering)\s+(?:(?:the|these|those)\s+)?(?:\d|[$€£]|(?:one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|twenty|all|full|total"
    r"|whole|missing|defective|damaged|faulty|broken|returned|unused)\b)"
    r"(?![^.!?\n]{0,60}\bto\s+be\s+(?:cancel|correct|reissu|amend|void|withdrawn))"
    rf"|\b(?:get|receive|give|pay|send|transfer)\s+(?:me\s+|us\s+)?back\s+(?:\w+\s+){{0,2}}?{_MONEY}"
    rf"|\b(?:credit|send|transfer|pay|put|give|get|want|need)\s+(?:me\s+|us\s+)?{_MONEY}(?:\s+for\s+(?:it|this|that))?\s+back\b"
    rf"|\b(?:return|repay)\s+{_MONEY}"
    rf"|\b(?:want|like|need|(?:(?<=like\sto\s)|(?<=want\sto\s)|(?<=need\sto\s)|(?<=wish\sto\s)|(?<=prefer\sto\s)"
    rf"|(?<=and\s)|(?<=or\s)|(?<=just\s))(?:have|get))\s+{_MONEY}"
    r"(?:\s+for\s+[^.!?\n]{0,40}?)?\s+"
    r"(?:reimbursed|refunded|paid\s+back|returned)\b(?!\s+(?:by|from|through|via)\b)"
    rf"|\b{_MONEY}\s+(?:went|to\s+go|be\s+\w+ed)\s+back\s+(?:to|onto|on|into)\s+(?:my|our|the\s+(?:original|same))\b",
    re.IGNORECASE)
# What makes "refunded" or "reimbursement" a fact, not a wish ("I was already refunded", "got reimbursement from").
_HAPPENED = re.compile(r"\b(?:was|were|been|is|are|have|has|had|got|received|already)\s+$", re.IGNORECASE)
# A field that is a refund asked for: its name's words or what its description says is asked for are these.
_REFUNDS = re.compile(r"refunds?|money\s+back|reimbursement|refund\s+(?:request|wanted)", re.IGNORECASE)
_REMEDY = (r"(?:replacement|repair|exchange|swap|new\s+one|store\s+credit|voucher|repaired|replaced|fixed"
           r"|working\s+(?:one|unit|device|product|machine)|(?<=get\s)it\s+(?:working|fixed|repaired|replaced)"
           r"|(?<=have\s)it\s+(?:working|fixed|repaired|replaced))")
_NEEDED_WORDS = r"(?:needed|necessary|required|wanted)\b"
_DECLINED_AFTER = re.compile(r"\s*(?:(?:is|was)\s+not|(?:isn|wasn)['\u2019]t|not)\s+" + _NEEDED_WORDS +
                             r"|[^.!?\n]{0,40}?\bbut\s+(?:I|we)(?:['\u2019]d|\s+would)\s+(?:just\s+|really\s+)?"
                             rf"(?:rather|prefer)\s+(?:\w+\s+){{0,4}}?{_REMEDY}\b"
                             r"|[^.!?\n]{0,60}?\bbut\s+(?:I|we)\s+(?:do\s*n['\u2019]?t|do\s+not)\s+want\s+"
                             r"(?:either|it|that|one|them|those|any)(?:\s+(?:either|of\s+(?:them|those)))?\s*"
                             r"(?:[.!,;\n]|[-–—]|$)"
                             r"|[^.!?\n]{0,60}?\b(?:I\s+hope|hopefully)\s+(?:that|this|it)(?:['\u2019]s|\s+is|\s+will\s+be"
                             r"|['\u2019]ll\s+be)\s+not\s+(?:needed|necessary|required)\s*(?:[,.;!\n]|[-–—]|$)",
                             re.IGNORECASE)
# What an agent offers, not what is asked for: "Would you like a refund or a replacement?", "Are you looking for a
# repair or a refund?", "I can offer you a full refund" (the naming within five words of the offer).
_OFFER = re.compile(r"\b(?:(?:would|do)\s+you\s+(?:like|want|prefer|rather)|are\s+you\s+looking\s+for"
                    r"|(?:I|we)\s+(?:can|could)\s+offer(?:\s+you)?)(?:\s+[\w-]+){0,5}?\s+$"
                    r"|(?:^|[:.!?]\s+)(?:I|we)(?:\s+(?:can|could|will)|['\u2019]ll)\s+(?:also\s+|gladly\s+|happily\s+)?$",
                    re.IGNORECASE | re.MULTILINE)
# A refund threatened on a condition, not asked for ("If it can't be fixed by Friday we'll be asking for a refund",
# "If this can't be solved I may ask for a refund later", "I'm going to demand a refund if ..."): a condition in the
# sentence, and the writer says it will ask, request, demand, claim or want it then. Declined: true only where another
# naming asks for it. Not a fallback asked for now ("If you can't repair it, I will need a refund", "If a repair is not
# possible, we would request a full refund", "If possible, please refund me"), nor the seller's act ("If you'll refund
# me").
_IF = re.compile(r"[ \t]*(?:[-*•][ \t]*)?(?:(?:and|but|so)\s+)?(?:if|unless|otherwise|should)\b", re.IGNORECASE)
_WILL_ASK = re.compile(r"\b(?:(?:I|we)(?:\s+(?:will|may|might|shall)|['\u2019]ll|\s+(?:am|are)\s+going\s+to)"
                       r"|(?:I['\u2019]m|we['\u2019]re)\s+going\s+to)\s+"
                       r"(?:then\s+|have\s+to\s+|be\s+|probably\s+|also\s+|have\s+no\s+choice\s+but\s+to\s+|be\s+forced\s+to\s+"
                       r"|escalate\s+and\s+)*(?:ask|asking|request|requesting|demand|demanding|claim|claiming|seek|seeking"
                       r"|insist|insisting|push|pushing|want)\b(?:\s+\w+){0,3}?\s+$", re.IGNORECASE)
# And a condition unmet by a deadline, the writer wanting it then, the want right after the condition ("If this isn't
# sorted by Friday I want a full refund", "... by Friday we will cancel and ask for a full refund"): a threat, where "If
# you can't repair it, I want my money back" asks now and "If you check, I returned it within 14 days, so I expect a
# refund" states a fact.
_DEADLINE_THREAT = re.compile(
    r"[ \t]*(?:(?:to\s+be\s+(?:honest|clear|frank|fair)|honestly|frankly|but|and|so|also)\s*,?\s+)?"  # a lead-in
    r"(?:(?:if|should)\b[^.!?\n]{0,60}?(?:\bnot\b|n['\u2019]t\b)|unless\b)[^.!?\n]{0,40}?"
    r"\b(?:by|before|until|within)\s+(?:(?:the\s+)?end\s+of|next|this|tomorrow|tonight|monday|tuesday|wednesday|thursday|"
    r"friday|saturday|sunday|\d|(?:a|one|two|three|\w+)\s+(?:days?|weeks?|hours?))[^.!?\n,;]{0,24}?[,;]?\s*(?:then\s+)?"
    r"(?:I|we)(?:\s+(?:will|shall)\s+|['\u2019]ll\s+|\s+)(?:(?:cancel|return|send)\s+(?:it\s+|them\s+|everything\s+)?(?:back\s+)?"
    r"and\s+)?(?:want|expect|demand|ask|request|claim)\b(?:\s+\w+){0,3}?\s+$", re.IGNORECASE)
_IF_AFTER = re.compile(r"[^.!?\n]{0,80}?\b(?:if|unless)\b", re.IGNORECASE)
# What was had, not asked for: "my sister got a refund", "I received a partial refund" (the naming neither said nor
# declined: the score decides).
_HAD = re.compile(r"\b(?:got|gotten|received|(?:was|were)\s+given)\s+(?:a|an|the|her|his|their|my|our)\s+"
                  r"(?:full\s+|partial\s+)?$", re.IGNORECASE)
# The words for a refund in customers' other languages (a field that is a refund: _REFUNDS). They only decline it: after
# a denied wish or need, with no contrast word between ("Nie chcemy zwrotu pieniędzy", "Ich möchte keine
# Rückerstattung", "Je ne veux pas de remboursement", "No quiero un reembolso"; not "Ich will keinen Ersatz, sondern
# Rückerstattung", "Sigo sin recibir el reembolso"); named otherwise (a request, a policy, a refund received) the
# score decides.
_FOREIGN_REFUND = re.compile(
    r"\b(?:r[üu]ckerstattung|erstattung|geld\s+zur[üu]ck|remboursement|rembourser|rembours[ée]e?|reembolsos?"
    r"|reembolsar|devoluci[óo]n\s+del?\s+(?:dinero|importe)|rimbors[oi]|rimborsare|terugbetaling|geld\s+terug"
    r"|zwrot\w*\s+(?:pieni[ęe]dzy|koszt[óo]w|got[óo]wki|należności)|devolu[çc][ãa]o\s+do\s+dinheiro"
    r"|[åa]terbetalning|pengarna\s+tillbaka)\b", re.IGNORECASE)
_FOREIGN_NOT = re.compile(
    r"(?:\bnie\s+(?:\w+\s+)?(?:chc[eęa]\w*|potrzebuj\w*|oczekuj\w*)"
    r"|\b(?:m[öo]chte\w*|will|wollen|brauche\w*|ben[öo]tige\w*)\s+(?:ich\s+|wir\s+)?(?:\w+\s+)?kein\w*"
    r"|\bne\s+(?:veux|voulons|souhaite|souhaitons|demande|demandons)\s+pas(?:\s+(?:de|d['’]|un|une|le|la|mon|notre))?"
    r"|\bpas\s+besoin\s+(?:de|d['’])|\bno\s+(?:quiero|queremos|necesito|necesitamos|busco|buscamos|pido|pedimos)"
    r"|\bnon\s+(?:voglio|vogliamo|chiedo|chiediamo)|\b(?:wil|willen|hoef|hoeven)\s+(?:ik\s+|we\s+|wij\s+)?geen"
    r"|\bn[ãa]o\s+(?:quero|queremos|preciso|precisamos)|\b(?:vill|beh[öo]ver)\s+(?:jag\s+|vi\s+)?(?:inte|ingen))"
    r"\s+(?:(?!(?:sondern|mais|ma|pero|sino|tylko|maar|utan|nur|solo|only|just|but)\b)\w+\s+){0,2}$", re.IGNORECASE)
# ... or a need or wish denied right after them ("Geld zurück brauche ich nicht", "geld terug hoef ik niet").
_FOREIGN_NOT_AFTER = re.compile(r"\s+(?:brauch\w*|m[öo]cht\w*|will|wollen|ben[öo]tig\w*|hoef|wil|willen)\s+"
                                r"(?:ich|wir|ik|we)\s+(?:\w+\s+)?(?:nicht|niet)\b(?!\s+(?:als|as|in|auf|per|via|on|to|op)\b)",
                                re.IGNORECASE)
_NO_BEFORE = re.compile(r"\bno\s+$", re.IGNORECASE)  # "no refund needed": with _NEEDED after
_NEEDED = re.compile(r"\s*(?:is\s+)?" + _NEEDED_WORDS, re.IGNORECASE)
# What names a policy, not a request ("a money-back guarantee", "our refund policy").
_POLICY = re.compile(r"[\s-]*(?:guarantee|policy|policies|terms|period|window)\b", re.IGNORECASE)
# Participles that close a boolean's name and say nothing of what a record names ("refund_requested").
_PARTICIPLES = frozenset("requested needed required wanted asked given made issued mentioned".split())
# Single words that name a state or a thing of most records, not the field ("resolved" in "it was not resolved").
_GENERIC = frozenset("open opened closed resolved solved fixed done complete completed new order ordered return "
                     "returned active valid paid read sent received available enabled disabled ok true false "
                     "success error".split())


class Reading(NamedTuple):
    """How one boolean is scored: `statement` read after the record ("<text>\n\nIn this message,
    <statement>.") when the field has a description, else as a heading before it ("Record where
    <name>.\n\n<text>", against "Record.\n\n<text>"). `name`: the words a record names it by (`called`)."""

    statement: str
    described: bool
    name: str = ""
    asked: str = ""  # what its description says is asked for ("money back": `asked_for`)

    def decide(self, score: float, text: str) -> tuple[bool, float]:
        """(true or false, how sure), from the score less its offset: true when that is positive, its logistic the
        share; or, where `text` names the field in its own words (its name's or what its description says is asked
        for) and never denies them ("I'd like a refund", not beside "I don't want a refund"), true, and where it
        only declines them ("I don't need my money back", `namings_declined`), false, each share mixed as a lone
        named option's (closed.NAMED_WEIGHT). Named and denied both (an agent's offer the customer declines), or
        only denied otherwise ("I still haven't received my refund"): the score's."""
        p = logistic(score) if score == score else 0.5  # NaN: no evidence
        said, denied, declined = namings_declined(self.namings(text), text)
        if said and not denied:
            return True, max(0.5, (1 - NAMED_WEIGHT) * p + NAMED_WEIGHT)
        if declined and not said:
            return False, max(0.5, (1 - NAMED_WEIGHT) * (1 - p) + NAMED_WEIGHT)
        return score > 0, max(p, 1 - p)

    def namings(self, text: str) -> list[tuple[int, int, bool]]:
        """Where `text` names the field (closed.naming_spans: start, end, denied in its clause), by its name's
        words or what its description says is asked for, and, for a field about a refund, the other ways a record
        asks for its money back (_MONEY_BACK) where they do not overlap those."""
        spans = sorted(sp for words in {self.name, self.asked} - {""} for sp in naming_spans(words, text))
        if any(_REFUNDS.fullmatch(w) for w in (self.name, self.asked)):
            spans += _apart(spans, [(m.start(), m.end(), is_denied(text, m.start(), m.end()))
                                    for m in _MONEY_BACK.finditer(text)
                                    if not (m.group().lower().startswith(("refunded", "reimbursement"))
                                            and _HAPPENED.search(text, max(0, m.start() - 20), m.start()))])
            spans += _apart(spans, [(m.start(), m.end(), False) for m in _FOREIGN_REFUND.finditer(text)])
        return sorted(spans)

    @property
    def key(self) -> str:
        """The words scored, as the engine keeps its offset."""
        return "".join(self.after) if self.described else f"Record where {self.statement}.\n\n"

    @property
    def after(self) -> tuple[str, str]:
        """A described statement as (lead, scored): its subject is read as context, not scored ("<record>\n\nIn
        this message, the customer" then " asks for money back."); what the statement says of it is the score.
        How likely " the customer" is after a record says how the record is framed (a chat's "Visitor", a
        form), not whether the statement holds: on 284 labeled tickets (tests/data: dev, v2-v14, 2026-12-04)
        the refund statement scored whole ranked them at AUC 0.87 (223 right), without its subject 0.92 (243
        right), no worse on any of the 14 sets."""
        subject, rest = subject_of(self.statement)
        return AFTER + (f" {subject}" if subject else ""), f" {rest}."


def statements(schema: dict[str, Any]) -> dict[str, Reading]:
    """The top-level properties that are plain booleans (not nullable, no enum or const), each with
    how it is read."""
    obj = resolve(schema, schema) if isinstance(schema, dict) else None
    props = obj.get("properties") if isinstance(obj, dict) else None
    out = {}
    for name, prop in (props.items() if isinstance(props, dict) else ()):
        p = resolve(schema, prop)
        if not isinstance(p, dict) or p.get("type") != "boolean" or "enum" in p or "const" in p:
            continue
        # One line, no end mark (a space before it, French-style, included).
        said = _OPENING.sub("", " ".join(_text(p.get("description")).split()).rstrip(".?! ")).rstrip(".?! ")
        heading = " ".join((_text(p.get("title")) or name.replace("_", " ")).split()).rstrip(".?!")
        if re.search(r"\w", said):  # a statement, not an opening alone ("Whether") or a dash
            out[name] = Reading(said, True, called(name), asked_for(said))
        elif heading:
            out[name] = Reading(heading, False, called(name))
    return out


def called(name: str) -> str:
    """The words a record names a boolean field by: its name's, less a verb opening them or a participle closing
    them ("refund" for `refund` and `refund_requested`, "urgent" for `is_urgent`, "money back" for
    `wants_money_back`); "" where a record cannot name it (closed.nameable) or where one word says too little to
    name it ("open" for `is_open`, "order" for `has_order`: _GENERIC)."""
    words = name_words(name)
    while len(words) > 1 and words[0] in _VERBS:
        words = words[1:]
    while len(words) > 1 and words[-1] in _PARTICIPLES:
        words = words[:-1]
    phrase = " ".join(words)
    return phrase if nameable(phrase) and phrase not in _GENERIC else ""


def _apart(spans: list[tuple[int, int, bool]], more: list[tuple[int, int, bool]]) -> list[tuple[int, int, bool]]:
    """The spans of `more` that overlap none of `spans` (a bisection each: a record naming a field thousands of times
    stays linear)."""
    spans = sorted(spans)
    starts = [a for a, _, _ in spans]
    reach = list(itertools.accumulate((b for _, b, _ in spans), max))
    return [(a, b, f) for a, b, f in more if not ((i := bisect.bisect_left(starts, b)) and reach[i - 1] > a)]


def namings_declined(spans: list[tuple[int, int, bool]], text: str) -> tuple[int, int, int]:
    """(stated, denied, declined) of a field's namings in `text` (`spans`: Reading.namings; declined: a negated
    wish before it, "rather than" it, a "not" that denies no verb, a remedy's participle before its own ("repaired,
    not refunded"), "not needed" after it, "No refund please", a
    form's "Refund requested: No", "would not help" after it, a part of its denied ones); none where it names a
    policy ("a money-back guarantee", "our refund policy") or offers it ("Would you like a refund?")."""
    said = denied = declined = 0
    for start, end, negated in spans:
        if _POLICY.match(text, end) or _OFFER.search(text, max(0, start - 60), start) \
                or _HAD.search(text, max(0, start - 40), start):
            continue
        if _threatened(text, start):
            declined += 1
            continue
        foreign = (m := _FOREIGN_REFUND.match(text, start)) is not None and m.end() == end
        if foreign:  # another language's word: only its decline counts (_FOREIGN_REFUND)
            if _FOREIGN_NOT.search(text, max(0, start - 50), start) or _FOREIGN_NOT_AFTER.match(text, end) \
                    or _DECLINED_BEFORE.search(text, max(0, start - 80), start):
                denied, declined = denied + 1, declined + 1
            continue
        no = _NO_BEFORE.search(text, max(0, start - 10), start)
        participle = text[start:end].lower().endswith("ed")
        turned_down = bool(_DECLINED_BEFORE.search(text, max(0, start - 80), start) or _DECLINED_AFTER.match(text, end)
                           or (not participle and _NOT_IT.search(text, max(0, start - 40), start))
                           or (participle and _REMEDY_NOT.search(text, max(0, start - 80), start))
                           or _ANSWERED_NO.match(text, end)
                           or (no and (_NEEDED.match(text, end) or _NO_PLEASE.match(text, end))))
        if turned_down or negated:
            denied, declined = denied + 1, declined + turned_down
        else:
            said += 1
    return said, denied, declined


def _threatened(text: str, start: int) -> bool:
    """Whether the naming at `start` is a refund threatened on a condition: the writer will ask for it (_WILL_ASK, in
    its sentence back to the last ".", "!", "?" or line end, at most 160 characters), the sentence opening with the
    condition (_IF: "if", "unless", "otherwise", "should") or holding it after the naming ("... if it isn't fixed");
    or the sentence a condition unmet by a deadline, the writer wanting it then (_DEADLINE_THREAT)."""
    lo = max(0, start - 160)
    cut = max(text.rfind(ch, lo, start) for ch in ".!?\n")
    sentence = text[cut + 1 if cut >= 0 else lo : start]
    if _DEADLINE_THREAT.match(sentence):
        return True
    if not _WILL_ASK.search(sentence):
        return False
    return bool(_IF.match(sentence) or _IF_AFTER.match(text, start, min(len(text), start + 200)))


def asked_for(statement: str) -> str:
    """What a described statement says is asked for, where it says a request: after a verb of asking, "for" or a
    determiner ("the customer asks for money back": "money back"; "whether the user requests a refund":
    "refund"), at most three words, none generic or vague (_GENERIC, _VAGUE, closed.nameable); "" for any other
    statement ("the order was paid", "the customer asks about shipping", "the user wants to know")."""
    words = subject_of(statement)[1].split()
    if len(words) < 3 or words[0].lower() not in _ASKS or words[1].lower() not in _LEADS:
        return ""
    words = words[1:]
    while words and words[0].lower() in _LEADS:
        words = words[1:]
    phrase = " ".join(words)
    return phrase if 0 < len(words) <= 3 and nameable(phrase) and phrase.lower() not in _GENERIC \
        and words[0].lower() not in _VAGUE else ""


def subject_of(statement: str) -> tuple[str, str]:
    """(subject, the rest) of a statement that opens with a noun phrase: a determiner (grounding.DETERMINERS)
    and the word after it ("the customer" | "asks for money back"). Any other statement ("Contains PII", "Did
    the customer ask for a refund", "payment failed") and one of no more words than its subject are scored
    whole ("", "the refund")."""
    words = statement.split()
    if len(words) <= 2 or words[0].lower() not in DETERMINERS:
        return "", " ".join(words)
    return " ".join(words[:2]), " ".join(words[2:])


def _text(x: Any) -> str:
    return x if isinstance(x, str) else ""

