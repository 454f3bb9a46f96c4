"""Who in a record speaks for the seller: the support staff's names, which a field asking for the record's writer
(the customer who wrote a ticket) must not copy.

A support conversation names its agents beside the customer: a chat's speaker labels ("Hannah Brooks (Support):",
"Agent Priya:"), a quoted reply's header ("Emily Carter (Vantiq Support) wrote:"), a signature ("Tom, Acme
Support"). A small model copied such a name as the customer (three of forty fresh tickets, v43-v46). `staff_names`
finds the names a record marks as staff by one of three shapes, each a role word beside a capitalized name:

- the name, then a role in brackets: "Hannah Brooks (Support)", "Emily Carter (Vantiq Support)", "Li (agent)";
- a role, then the name as a chat's speaker label: "Agent Priya:", "Support (Hannah):", or "(agent: Hyun-woo Bae)";
- the name, then a team: "Tom, Acme Support", "Ana from the Customer Care team".

`without_staff` cuts those places out of the texts, leaving the rest as separate texts: what a writer field's spans
come from (grounding.WRITER, through `writer_sources`, which also cuts words holding a digit and titles), so a span
never holds or crosses a name where the record marks it as staff, nor one the writer gives by its relation to them
("my colleague Thomas Berger": `related`). Each
shape needs the role word to stand as a role (a whole bracket, a label, a team ending its phrase): "Jane Doe,
support told me", "Submitted by Maria Lopez (via support portal)" and "Fleet operator Jan Novak" are not staff.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Sequence

# A capitalized word, from a word's start (possessive: no backtracking into it on a long run of capitals).
_CAP = r"(?<![\w'’-])[A-ZÀ-ÖØ-Þ][\w'’-]*+"
_NAME = rf"{_CAP}(?:[ \t]+{_CAP}){{0,3}}"
# Seller-side roles only: "admin", "operator" or "staff" may be the customer's own ("Maria (IT admin)").
_ROLE = r"support|agent|customer care|customer service|help ?desk|representative|rep|advisor|adviser|specialist|" \
    r"moderator|concierge|csr"
# The name, then a bracket that is only a role, after at most three capitalized words (a company; not "IT"):
# "Hannah Brooks (Support)", "Emily Carter (Vantiq Support)", "Li (agent)"; not "(via support portal)",
# "(IT support)", "(Support Engineer at Globex)".
_BRACKET = re.compile(rf"({_NAME})[ \t]*\((?:(?!IT\b)[A-ZÀ-ÖØ-Þ][\w&'’.-]*+[ \t]+){{0,3}}(?i:{_ROLE})"
                      r"(?:[ \t]+(?i:team|agent|specialist|rep|representative))?\)")
# A role, then the name, as a chat's speaker label at a line's start ("Agent Priya:", "Support (Hannah):"), or a
# bracketed note of who answered ("(agent: Hyun-woo Bae)").
_LABEL = re.compile(rf"^[ \t]*(?i:agent|support agent|support|representative|rep|advisor|adviser|concierge|"
                    rf"moderator)\b[ \t]*\(?({_NAME})\)?[ \t]*:|\((?i:agent|rep|representative|advisor|adviser)"
                    rf"[ \t]*:[ \t]*({_NAME})\)", re.MULTILINE)
# The name, then (after a comma, a dash, a bar, "from" or "at") a capitalized team that ends the phrase: "Tom, Acme
# Support", "Ana from the Customer Care team"; not "Jane Doe - Support request", "support told me".
_TEAM = re.compile(rf"({_NAME})[ \t]*(?:,|-|–|—|\||\bfrom\b|\bat\b)[ \t]*(?:the[ \t]+)?(?:(?!IT\b){_CAP}[ \t]+){{0,3}}"
                   r"(?:Support|Customer Care|Customer Service|Help ?[Dd]esk|Care Team|Service Team)(?:[ \t]+[Tt]eam)?"
                   r"(?=[ \t]*(?:\r?$|[\r\n,.;)]))", re.MULTILINE)
# Where a forwarded or quoted message starts (a quoted line's ">", a "---- Forwarded message", "Original Message" or
# "Quoted message" line, "... wrote:"): the seller's reply, where a desk signs ("Stefan, Meditherm Service Desk").
QUOTED = re.compile(r"^[ \t]*(?:>|-{2,}+[ \t]*(?:begin[ \t]+)?(?:forward|original|quoted)"
                    r"|[^\n]{0,120}\bwrote:[ \t]*\r?$|(?:begin )?forwarded message)", re.IGNORECASE | re.MULTILINE)
# In a quoted message only (a customer's own "IT Service Desk" or "Facilities Service Desk" signs as the writer): the
# name, then a comma and the seller's desk ("Stefan, Meditherm Service Desk"), or the desk alone on the next line
# ("> Marta Kowalski\n> Pumptek Parts Desk", "Emily Tran\nGlowCrate Care Team").
_DESK = re.compile(rf"({_NAME})[ \t]*,[ \t]*(?:(?!IT\b){_CAP}[ \t]+){{1,3}}(?:Service|Support|Parts)[ \t]+Desk"
                   r"(?=[ \t]*(?:\r?$|[\r\n,.;)]))", re.MULTILINE)
_TEAM_UNDER = re.compile(rf"^[ \t>]*({_NAME})[ \t]*\r?\n[ \t>]*(?:(?!IT\b){_CAP}[ \t]+){{0,3}}"
                         r"(?:Support(?:[ \t]+(?:Team|Desk))?|Customer[ \t]+(?:Care|Service)|Care[ \t]+Team"
                         r"|Service[ \t]+(?:Team|Desk)|Parts[ \t]+Desk)"
                         # and the desk's role ("Daniel Mertens\nCustomer Care Specialist" under "Original Message")
                         r"(?:[ \t]+(?:Specialist|Agent|Representative|Advisor|Adviser|Associate|Coordinator"
                         r"|Consultant|Officer|Executive|Engineer|Technician|Lead))?"
                         r"(?:[ \t]*[,|][ \t]*[^\n]{1,60}?)?[ \t]*\r?$", re.MULTILINE)  # ", Harlow Trade Supplies"
# Capitalized words that open a sentence or a label rather than a name ("Thanks Priya", "Hi Hannah").
_NOT_NAMES = frozenset("hi hello hey dear thanks thank cheers regards best kind from agent support customer visitor "
                       "team the a an i my our your this that chat live".split())


def _quoted_reply(text: str, m: re.Match[str], quoted: re.Match[str] | None, own: set[str]) -> bool:
    """Whether a desk's signature `m` stands in a quoted message that is not the writer's own: past the first quoted
    marker, on a quoted line where that marker is a ">" (a bottom-posted reply's own signature is not), its name
    not written before the marker (the writer forwarding an earlier mail of theirs signs above it too), nor its first
    name alone on a line there (`own`: "Jane" above a quoted "Jane Okafor\nCustomer Service Lead")."""
    if quoted is None or m.start() < quoted.start():
        return False
    if quoted.group().lstrip().startswith(">") and \
            not text[text.rfind("\n", 0, m.end(1)) + 1 : m.end(1)].lstrip().startswith(">"):
        return False
    name = m.group(1).strip(" \t>")
    return name not in text[: quoted.start()] and not (name.split() and name.split()[0] in own)


def _spans(text: str) -> Iterator[tuple[int, int]]:
    """Where `text` names a member of its support staff: each name's (start, end), greetings left off."""
    quoted = QUOTED.search(text)
    own = {ln.strip() for ln in text[: quoted.start()].splitlines()} if quoted else set()  # the record's own lines
    for pattern in (_BRACKET, _LABEL, _TEAM, _DESK, _TEAM_UNDER):
        for m in pattern.finditer(text):
            if pattern in (_DESK, _TEAM_UNDER) and not _quoted_reply(text, m, quoted, own):
                continue
            g = next(i for i in range(1, (m.lastindex or 1) + 1) if m.group(i) is not None)
            start = m.start(g)
            words = [(w.start() + start, w.end() + start) for w in re.finditer(r"\S+", m.group(g))]
            while words and text[words[0][0] : words[0][1]].casefold().strip("'’-") in _NOT_NAMES:
                words = words[1:]
            while words and text[words[-1][0] : words[-1][1]].casefold().strip("'’-") in _NOT_NAMES:
                words = words[:-1]
            name = text[words[0][0] : words[-1][1]] if words else ""
            if len(name) >= 2 and not (name.isupper() and name.isascii()):  # "Support PIN:" names no one
                yield words[0][0], words[-1][1]


def staff_names(text: str) -> list[str]:
    """The names `text` marks as its support staff's, longest first (each as written)."""
    return sorted({text[a:b] for a, b in _spans(text)}, key=len, reverse=True)


# What is never part of a person's name: a word holding a digit (a phone number, an account id, "+61 412 555 983" was
# copied as the customer once), a title before a capitalized name ("Mrs. Adaeze Okonkwo-Bell": the name without it),
# and a greeting, in any of the languages customers greet in ("Kia ora, Ngaio Te Rangi here": "Kia" was copied twice).
_GREETINGS = ("Kia ora|Tēnā koe|Hola|Buenos días|Bonjour|Bonsoir|Ciao|Salve|Hallo|Moin|Servus|Hej|Hei|Goedemorgen|"
              "Namaste|Namaskar|Salaam|Salam|Assalamu alaikum|Shalom|Aloha|Konnichiwa|Merhaba|Olá|Oi|Jambo|Sawubona|"
              "Habari|Xin chào|Sawasdee|Selamat pagi|Kumusta|Privet|Dzień dobry|Ahoj|G'day|Howdy|Hiya|Greetings|Dear|"
              "Hello|Hi|Hey")
# A team is no one's name: a seller's role word and the capitalized words before it ("Boreal Support", "Aurelis
# Care", "Customer Service"; no customer of 1,244 labeled tickets holds one, 184 of their texts do).
_TEAM_WORDS = r"Support|Care|Service|Services|Team|Helpdesk|Desk|Bot|Chatbot"  # "Lanterra Bot:" too
# A seller's department signs its mail so too ("From: Ergonova Shipping <shipping@...>" was copied as the customer),
# where no capitalized word follows it (not a title's "Jane Doe Sales Director", "Jane Doe Accounts Payable").
_DEPARTMENTS = r"Shipping|Sales|Billing|Orders|Notifications|Delivery|Deliveries|Accounts|Returns|Bookings|" \
    r"Reservations|Dispatch|Logistics|Travel"
# And a letter's closing, in the languages customers close in ("Ystävällisin terveisin" was copied as a name; no
# customer of 1,284 labeled tickets holds one, 564 of their texts do), longest first, any case.
_CLOSINGS = "|".join(re.escape(c) for c in sorted((
    "Mit freundlichen Grüßen", "Med vänliga hälsningar", "Met vriendelijke groet", "Ystävällisin terveisin",
    "Vriendelijke groeten", "Med vennlig hilsen", "Vänliga hälsningar", "Bien cordialement", "Freundliche Grüße",
    "Med venlig hilsen", "Saludos cordiales", "Thanks in advance", "Yours faithfully", "Cordiali saluti",
    "Distinti saluti", "Kindest regards", "Srdačan pozdrav", "Teşekkür ederim", "Warmest regards", "Yours sincerely",
    "Atenciosamente", "Merci beaucoup", "Muchas gracias", "Vennlig hilsen", "Lijep pozdrav", "Venlig hilsen",
    "Best regards", "Cordialement", "Cumprimentos", "Grazie mille", "Kind regards", "S uvazheniem", "Saygılarımla",
    "Terima kasih", "Thanks again", "Warm regards", "Z poważaniem", "Amicalement", "Atentamente", "Best wishes",
    "Beste Grüße", "Bien à vous", "Liebe Grüße", "Many thanks", "S pozdravem", "Salutations", "Teşekkürler",
    "Viele Grüße", "Vielen Dank", "Yours truly", "Üdvözlettel", "Dhanyavaad", "Hälsningar", "Pozdrawiam",
    "Fa'afetai", "Fa’afetai", "Mulțumesc", "Sincerely", "Terveisin", "Thank you", "Un saludo", "Arigatou",
    "Cu stimă", "Dziękuję",
    "Köszönöm", "Ngā mihi", "Obrigada", "Obrigado", "Abraços", "Arigato", "Bedankt", "Gracias", "Groeten", "Regards",
    "Saludos", "Shukran", "Spasibo", "Abraço", "Cheers", "Cảm ơn", "Diolch", "Děkuji", "Grazie", "Hilsen", "Kiitos",
    "Mahalo", "Saluti", "Thanks", "Danke", "Grüße", "Hvala", "Merci",
), key=len, reverse=True)).replace("\\ ", r"\s+")  # its words apart by any spacing ("Kind\xa0regards")
_TITLE_WORDS = "Mrs|Mr|Ms|Miss|Mx|Dr|Prof"
_SHOUTS = ("URGENT|CRITICAL|ASAP|HELP|IMPORTANT|PLEASE|NOT|NO|STILL|AGAIN|NOW|TODAY|BROKEN|WRONG|NEVER|DOWN|STOPPED|"
           "OUTAGE|FAILED|FAILURE|DEAD|EMERGENCY|REFUND|ALL|EVERY|ANY")
_DETERMINER_WORDS = "The|A|An|This|That|These|Those|My|Our|Your|His|Her|Its|Their"
_DETERMINERS = frozenset(_DETERMINER_WORDS.lower().split("|"))
# A brand before its model's code, whose digit-holding word is cut ("the Vantor M27Q": "Vantor" was copied as the
# customer once): capitalized words after a lowercase word, a determiner or a dash, before a code of capitals and
# digits or a size ("Your Kestrow WaveClean 8kg"; not an e-mail's "jsmith84@", "2pm", "3rd"; not after a label:
# "Name: Priya Nair Unit 4B").
_UNITS = "kg|g|mg|lb|lbs|oz|ml|cl|l|cm|mm|m|in|w|kw|v|mah|wh|kwh|gb|tb|mb|hz|mp"
_BRAND_RUN = re.compile(rf"(?!(?:{_DETERMINER_WORDS})\b)(?:{_CAP}[ \t]+){{1,3}}"
                        rf"(?=(?:(?=[\w-]*[A-Z])(?=[\w-]*\d)[\w-]+|\d+(?i:{_UNITS}))(?![\w'’@-])(?!\.\w))")
# Capitalized words owned ("my", "our", "your", "their") before a lowercase word: a product, never the writer ("Your
# Glintwave earbuds died": "Glintwave" was copied as the customer once); not "my colleague Thomas" (`related`).
_OWNED = re.compile(rf"(?<![\w'’-])(?i:my|our|your|their)[ \t]+({_CAP}(?:[ \t]+{_CAP}){{0,2}})(?=[ \t]+[a-z])")
_NO_NAME = re.compile(rf"(?<!\S)[^\s\d]*+\d\S*|(?<![\w'’-])(?:{_TITLE_WORDS})\.?(?=[ \t]+[A-ZÀ-ÖØ-Þ])|"
                      # and the pronoun "I" ("I'm": "I" was copied once; an initial has its dot), the article "A"
                      # before a lowercase word
                      rf"(?<![\w'’-])(?:{_GREETINGS}|I(?:['’](?:m|d|ll|ve))?|A(?=[ \t]+[a-zß-öø-ÿ]))(?![\w'’.-])|"
                      rf"(?<![\w'’-])(?i:{_CLOSINGS})(?![\w'’-])|"
                      # a shouted word ("this is CRITICAL" was copied as the customer once)
                      rf"(?<![\w'’-])(?:{_SHOUTS})(?![\w'’-])|"
                      rf"(?:{_CAP}[ \t]+){{0,3}}(?<![\w'’-])(?:{_TEAM_WORDS})(?![\w'’-])|"
                      rf"(?:{_CAP}[ \t]+){{1,3}}(?<![\w'’-])(?:{_DEPARTMENTS})(?![\w'’-])(?![ \t]+[A-ZÀ-ÖØ-Þ])")


# The record's first line (after a subject line at most) greets whom it is written to: "Hi Sophie,", "Dear Meeplewick
# Games,". That addressee is never the writer (41 of 1,204 labeled tickets, tests/data through v60, open so; none greets
# its writer; two fresh ones had the model copy the agent they greet, "Sophie Laurent" of a quoted reply's header). A
# title ("Dear Mr Karimi,": an agent's reply on top greets its customer so) leaves it alone.
_TITLES = frozenset(_TITLE_WORDS.lower().split("|")) | {"sir", "madam"}
# Greeted words that name no one ("Hello Team,", "Dear All,"), and what an agent's greeting on top says ("Hi Maria,
# thanks for contacting us! How can I help?", "Hi Ana, thanks for your patience"): then the rule stays out.
_NOBODY = frozenset("team all everyone everybody there folks guys sirs support customer colleagues friends hello "
                    "hi".split())
_AGENT_WORDS = re.compile(r"thanks?\s+(?:you\s+)?for\s+(?:contacting|reaching\s+out|your\s+patience|choosing|"
                          r"waiting|getting\s+in\s+touch)|how\s+(?:can|may)\s+(?:I|we)\s+help|"
                          r"(?:I|we)\s+(?:have|'ve)\s+(?:received|looked\s+into)\s+your", re.IGNORECASE)
_ADDRESSED = re.compile(rf"\A(?:[ \t]*(?:Subject|Re|RE|Fwd?|FW|Title)\b[^\n]*\n)?\s*(?:{_GREETINGS}|Good[ \t]+"
                        rf"(?:morning|afternoon|evening)|Morning)[ \t]+({_NAME})[ \t]*(?=[,!]|\r?\n)")


# The record's own lines: not a quoted line or a quote's header ("> ...", "On Mon, Ana wrote:"), and before a
# forwarded or replied-to message that runs to the end ("-----Original Message-----", "From: ...").
_QUOTE_LINE = re.compile(r"[ \t]*+(?:>|.*\bwrote:[ \t]*\r?$)", re.IGNORECASE)
_FORWARDED = re.compile(r"^[ \t]*(?:-{2,}[ \t]*(?:Original|Forwarded)|From:)", re.MULTILINE | re.IGNORECASE)


def addressed(text: str) -> list[tuple[int, int]]:
    """Where `text` names the one its first line greets: each whole-word place of that name, with the capitalized
    words after it on its line ("Sophie" greeted: "Sophie Laurent (Zephyrine Care) wrote:" too). None where the
    greeting holds a title or no one's name ("Hello Team,"), where the first 300 characters of the record's own lines
    after it read as an agent's ("thanks for contacting us", "how can I help"), or where the last of those lines holds
    the greeted name (own: no quoted line, none of a forwarded message): then the top greets the writer."""
    m = _ADDRESSED.match(text)
    if m is None or m.group(1).split()[0].casefold().rstrip(".") in _TITLES | _NOBODY:
        return []
    forwarded = _FORWARDED.search(text, m.end())
    own: list[str] = []
    lines = [ln for ln in text[m.end() : forwarded.start() if forwarded else len(text)].splitlines() if ln.strip()]
    for i, ln in enumerate(lines):
        if not _QUOTE_LINE.match(ln):
            own.append(ln)
        elif not ln.lstrip().startswith(">") and not (i + 1 < len(lines) and lines[i + 1].lstrip().startswith(">")):
            break  # "... wrote:" with no quoted lines after it: the quote runs to the end unmarked
    if _AGENT_WORDS.search("\n".join(own)[:300]):
        return []  # an agent's greeting on top: the one greeted is the customer
    greeted = rf"(?<![\w'’-]){re.escape(m.group(1))}(?![\w'’-])"
    if own and re.search(greeted, own[-1]):
        return []  # the record signs with the name it greets: the greeting on top is to its writer
    return [n.span() for n in re.finditer(rf"{greeted}(?:[ \t]+{_CAP}){{0,3}}", text)]


# A name the writer gives by its relation to them ("my colleague Thomas Berger", "Our director, Mr. Adebayo Ogunleye,",
# "her husband Declan", "my downstairs neighbour, Herr Eberhard Stimmel"): someone else than the record's writer. Of
# the 86 such names in the labeled tickets (v5-v94), 83 are not their ticket's customer; the 3 others (v5, v8) label
# the account holder a relative writes for, where the later sets label the one who writes and signs.
_RELATIONS = ("colleague|co-?worker|manager|director|boss|supervisor|assistant|husband|wife|partner|son|daughter|"
              "mother|father|mum|mom|dad|brother|sister|friend|neighbou?r|flatmate|roommate|driver|technician|"
              "engineer|installer|courier|sous-chef|chef|employee|deputy|secretary|receptionist|accountant|lawyer|"
              "solicitor|landlord|tenant|nanny|carer|caregiver|electrician|plumber|contractor")
# Not the writer saying who they are ("I am her husband, Tom Smith", "I'm their manager, Jane Doe").
_RELATED = re.compile(rf"(?<![\w'’-])(?<!\bam[ \t])(?<![’']m[ \t])(?i:my|our|your|his|her|their)[ \t]+"
                      rf"(?:(?i:[a-z-]+)[ \t]+)?(?i:{_RELATIONS})s?,?[ \t]+"
                      rf"(?:(?:{_TITLE_WORDS}|Herr|Frau|Mme)\.?[ \t]+)?({_CAP}(?:[ \t]+{_CAP}){{0,2}})")


def related(text: str) -> list[tuple[int, int]]:
    """Where `text` names someone by their relation to the writer (_RELATED), and that name wherever else it stands
    as whole words, with the capitalized words after it on its line ("My husband Gareth booked this ... To: Gareth
    Hutchins ... Dear Gareth,": the model copied "Gareth" as the customer once; of 2,043 labeled tickets, none but
    the three the module's note names has a customer holding such a name): each (start, end). MAX_STAFF names at
    most, the longest; no one-letter one."""
    marked = [m.span(1) for m in _RELATED.finditer(text)]
    names = sorted({text[a:b] for a, b in marked if b - a > 1}, key=len, reverse=True)[:MAX_STAFF]
    if names:
        again = re.compile(r"(?<![\w'’-])(?:" + "|".join(map(re.escape, names)) +
                           rf")(?![\w'’-])(?:[ \t]+{_CAP}){{0,2}}")
        marked += [m.span() for m in again.finditer(text) if not _own_name(text, *m.span())]
    return marked


def _own_name(text: str, i: int, j: int) -> bool:
    """Whether text[i:j] may be the writer's own name there: after a capitalized word (a longer name's end: the
    relative "Mr. Smith" in "Jane Smith"; not a label's "To:") or alone on its line (a signature: "My friend Will" and
    "Will Turner")."""
    before, word, after = _around(text, i, j)
    return (word[:1].isupper() and not word.endswith(":") and word.casefold().strip(",.!") not in _NOT_NAMES) or \
        not (before.strip(" \t-–—") or after.strip(" \t\r.,!"))


def writer_sources(sources: Sequence[str]) -> list[str]:
    """What a field asking for the record's writer copies from: `sources` without the support staff's names
    (without_staff) and the names given by their relation to the writer there (`related`), the words holding a
    digit, a title before a name, greetings, closings and teams, what is left of each as separate texts."""
    return [part for s in cut_out(without_staff(sources), lambda t: [*related(t), *_brands(t)])
            for part in _NO_NAME.split(s) if part.strip()]


def _brands(text: str) -> list[tuple[int, int]]:
    """Where `text` writes a brand: before its model's code (_BRAND_RUN) after a lowercase word, a dash or a count
    ("3 of the 20 Plumbrix PX-12 filters"), or owned before a lowercase noun (_OWNED: "Your Glintwave earbuds"). Not
    at a line's start: "Netharbor NH-6 router drops" and a chat's "Emma Watson 9AM: my speaker" read alike."""
    out = [m.span(1) for m in _OWNED.finditer(text)]
    for m in _BRAND_RUN.finditer(text):
        head = text[max(0, m.start() - 40) : m.start()]
        prev = head.rsplit(None, 1)[-1] if head.strip() and head[-1:] in " \t" else ""
        if prev in ("-", "–", "—") or prev.isdigit() or \
                (prev.isalpha() and (prev.islower() or prev.casefold() in _DETERMINERS)):
            out.append(m.span())
    return out


def without_staff(sources: Sequence[str]) -> list[str]:
    """`sources` with each place that marks a name as staff cut out, and that name wherever else it stands with no
    capitalized word after it ("Marco (Brevo Support): ..." cuts "Hi Marco," and "chatting with Marco" too; "Agent
    Tom:" leaves "Tom Brown" whole), and the name the first line greets wherever it stands (`addressed`), what is left
    of each as separate texts."""
    return cut_out(sources, lambda text: [*_staff_places(text), *addressed(text)])


MAX_STAFF = 16  # staff names looked for again elsewhere (a support conversation has a few agents), the longest
_LINE = 200  # characters of its line read either side of a staff name found again


def _staff_places(text: str) -> list[tuple[int, int]]:
    """The places _spans marks as staff, and each of those names in the running text elsewhere: not inside a longer
    name (a capitalized word before it, a greeting's aside, or after it), not a speaker's label ("Maria: ...") and
    not alone on its line (a signature): there it may be a customer's own name."""
    marked = list(_spans(text))
    names = sorted({text[a:b] for a, b in marked}, key=len, reverse=True)[:MAX_STAFF]
    if not names:
        return marked
    again = re.compile(r"(?<![\w'’-])(?:" + "|".join(map(re.escape, names)) + r")(?![\w'’-])(?![ \t]+[A-ZÀ-ÖØ-Þ])")
    for m in again.finditer(text):
        i, j = m.span()
        before, word, after = _around(text, i, j)
        if (word[:1].isupper() and word.casefold().strip(",.!:") not in _NOT_NAMES) or \
                re.match(r"[ \t]*:", after) or not (before.strip() or after.strip(" \t\r.,!")):
            continue
        marked.append((i, j))
    return marked


def _around(text: str, i: int, j: int) -> tuple[str, str, str]:
    """text[i:j]'s line around it, at most _LINE characters either side: (what stands before it, the word right before
    it where a space or a tab parts them, what stands after it)."""
    before = text[max(text.rfind("\n", max(0, i - _LINE), i) + 1, i - _LINE) : i]
    stop = text.find("\n", j, j + _LINE)
    head = before.rstrip(" \t")
    word = head.rsplit(None, 1)[-1] if head and len(head) < len(before) else ""
    return before, word, text[j : stop if stop >= 0 else j + _LINE]


def cut_out(sources: Sequence[str], find: Callable[[str], Iterable[tuple[int, int]]]) -> list[str]:
    """`sources` with the (start, end) places `find` gives in each cut out (overlapping ones as their union: an
    employer "Acme Ltd Warehouse Services" holding the company "Acme Ltd" is cut whole), what is left of each as
    separate texts, blank ones dropped."""
    out: list[str] = []
    for s in sources:
        at = 0
        for a, b in sorted(set(find(s))):
            if a >= at:
                out.append(s[at:a])
            at = max(at, b)
        out.append(s[at:])
    return [part for part in out if part.strip()]
