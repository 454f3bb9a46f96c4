"""Companies a field asking for a product's brand must not copy: whom a record's writer works for, the organization a
signature names after the writer's job title ("Practice Manager, Westgate Family Clinic", "Head Chef, La Marea, 22
Quay Street", "Customer Service Manager at Bakery Co"), and any company named with its legal form ("Hoshino Packaging
GmbH", "VENDORA HOME LTD", "Tengri Logistics LLP": `legal_names`). A small model took the employer for the product in
four of forty tickets (spent v47-v52: "Westgate Family Clinic" for "Rostera Teams", "Threnody Design Ltd" for
"Caffiora Barista S"), and a company with its legal form in two of forty (spent v59-v60: the customer's employer
after a department, the merchant in a quoted bank letter). A brand is not written with a legal form: in 1,244
labeled tickets (tests/data through v60) no product's answer holds one, and each of the 12 tickets naming a company
so named a courier, a bank, an employer or a seller. "& Co." stays (a brand's style: "Maribel & Co. Sienna").

Also no brand (2026-12-06, from business customers' fresh tickets v117-v122): the line under a signature's name
("Declan Murphy\nMurphy & Sons Plumbing": `under_name`), a last line's company after the name ("Ines Duarte, PixelPit
Café": `signed_company`), a seller named by its role ("your authorised reseller PrintSys Iberia": `sellers`), and a
month's name or a salutation ("The May box", "Buna ziua,"); and wherever the record writes a company so found again
("I own Golden Lotus restaurant").

`without_employer` cuts each such company out of the texts, leaving the rest as separate texts: what a brand
field's spans come from (grounding.NAMED). `without_company` cuts the writer's companies (not the line under a name,
nor sellers or words) from what a field asking for the writer copies from (grounding.WRITER). A job title is read
as one only in a signature: in the record's last SIGNATURE characters, on the line after a name alone on its line,
or after the name and a comma ("Ana Silva, Customer Service Manager at Bakery Co"; a dash before the name at most:
"— Matteo Rossi"); a role noun in it
("Manager", "Head Chef", "Head of Sales Operations"), then a comma or "at", then the capitalized words of the company
up to the line's end or the next comma. "Kind regards, Maria", "Order 55120, Foo Ltd" and a product's line ("Office
Chair, Herman Miller Aeron") are not.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from asyncpage.extract.staff import cut_out

_ROLES = ("Manager|Director|Head|Chef|Officer|Coordinator|Administrator|Assistant|Lead|Owner|Founder|Co-founder|"
          "Partner|Engineer|Supervisor|Secretary|Accountant|Analyst|Consultant|President|Principal|Teacher|Nurse|Buyer|"
          "Planner|Technician|Controller|Executive|CEO|CTO|CFO|COO|VP|Receptionist|Clerk|Architect|Developer|"
          "Designer|Editor|Producer|Pharmacist|Dentist|Physician|Librarian|Caretaker|Superintendent|Registrar|Bursar|"
          "Treasurer|Chair|Chairman|Chairwoman|Trustee|Proprietor|Landlord")
# Roles a signature may write in lowercase ("owner, Bistro Lipa"); not "head", "lead" or "chair", which are things too.
_LOWER_ROLES = "owner|co-owner|manager|director|founder|co-founder|proprietor|buyer|purchaser"
_CAP = r"[A-Z0-9À-ÖØ-Þ][\w'’.&-]*"
SIGNATURE = 300  # the characters at a record's end a signature is looked for in
# A person's name: two to four capitalized words, no digit, a surname's lowercase particle before one ("Sanne de Vries",
# "Ludwig van der Berg", "Aisha bin Saleh", "Rhys ap Gwynedd").
_PARTICLES = (r"(?:(?:de|van|von|der|den|da|di|du|del|della|dos|das|do|le|la|bin|binti|ibn|al|el|ter|ten|zu|ap|ab)"
              r"[ \t]+){0,2}")
PERSON = (r"[A-ZÀ-ÖØ-Þ][^\W\d_]*(?:[-'’][^\W\d_]+)*\.?"
           rf"(?:[ \t]+{_PARTICLES}[A-ZÀ-ÖØ-Þ][^\W\d_]*(?:[-'’][^\W\d_]+)*\.?){{1,3}}")
DASH = r"(?:[–—][ \t]*)?"  # a dash the name may sign after ("— Matteo Rossi"; not a list's "- Standing Desk")
# A job title at a line's start (after the writer's name and a comma, at most): capitalized words (or "of", "and",
# "&", "the") ending in a role noun, then ",", "at" or a bar, then the company: capitalized words (an "&", "and", "of"
# or "the" between them), up to the line's end or a comma. Case matters: "My manager, John, said" is no signature.
_TITLE = re.compile(
    rf"(?:^[ \t]*{DASH}{PERSON}[ \t]*\r?\n[ \t]*|^[ \t]*{DASH}{PERSON},[ \t]*)"  # the name: own line, or a comma
    rf"(?P<title>(?:(?:[A-Z][\w'’.&/-]*|of|and|&|the)[ \t]+){{0,5}}?(?:{_ROLES}|{_LOWER_ROLES})\b)"  # the title
    rf"(?:[^,\n|]{{0,40}}?(?:,|[ \t]at|[ \t]*[|·•])[ \t]+"  # then ",", "at" or a bar ("Owner | Little Fern Café"), or
    rf"|(?P<own>(?:[ \t]+(?:of|for|to)[ \t]+[^,\n]{{1,40}}?)?[ \t]*\r?\n[ \t]*))"
    rf"(?P<org>{_CAP}(?:[ \t]+(?:&|and|of|the|{_CAP})){{0,5}})[ \t]*(?=,|\r?$)",  # the company
    re.MULTILINE)


# Legal forms that close a company's name, case as written, on one line, after one to five capitalized words of
# letters ("&", "and", "of", "the" between them). Left out, as the review found them in products' names: "Co." alone
# ("Maribel & Co."), "SE" ("iPhone SE"), "Limited" (an edition, a car's trim), "PLC" (a controller), "ASA", "SAS",
# "AB", "KG", "KK", "NV" (a firewall, a drive, an ab roller, "9 KG").
_LEGAL_FORMS = (r"Ltd\.?|LTD\.?|GmbH|GMBH|Inc\.?|INC\.?|LLC|L\.L\.C\.|LLP|plc|Plc|AG|S\.A\.(?:S\.)?|SARL|"
                r"S\.à[ \t]?r\.l\.|S\.r\.l\.|Srl|SRL|S\.p\.A\.|SpA|S\.L\.(?:U\.)?|B\.V\.|BV|N\.V\.|"
                r"Pty(?:[ \t]+Ltd\.?)?|Pte\.?[ \t]+Ltd\.?|Sdn\.?[ \t]+Bhd\.?|Bhd|Corp\.?|Corporation|"
                r"Co\.,?[ \t]*Ltd\.?|Oyj?|ApS|A/S|Kft\.?|s\.r\.o\.|a\.s\.|Sp\.[ \t]?z[ \t]?o\.o\.|K\.K\.|GbR|OHG|"
                r"e\.K\.|Ltda\.?|AB(?![ \t]+[A-Z0-9À-ÖØ-Þ])")  # Sweden's AB: not "Perfect Fitness AB Carver Pro"
_NAME_WORD = r"[A-ZÀ-ÖØ-Þ][^\W\d_]*(?:[-'’&][^\W\d_]+)*"  # letters only: not "M20", "9", "Express." (a sentence's end)
_LEGAL = re.compile(rf"(?<![\w'’&.-]){_NAME_WORD}[ \t]+(?:(?:&|and|of|the|{_NAME_WORD})[ \t]+){{0,4}}?"
                    rf"(?:{_LEGAL_FORMS})(?![\w/-])")


# A job title cut with the employer only where its words before the role are a department's or a rank's ("Finance
# Director", "Office Manager", "Head of Customer Service"): a product's line after a name ("Zentro Pro Controller")
# or a product's role ("Ledgerly Administrator") keeps its brand.
_DEPARTMENT = re.compile(
    r"(?:(?:Finance|Financial|Sales|IT|HR|Office|Practice|Operations|Customer|Service|Services|Senior|Junior|General|"
    r"Marketing|Procurement|Purchasing|Facilities|Facility|Fleet|Travel|Events|Event|Account|Accounts|Regional|Store|"
    r"Shop|Restaurant|Kitchen|Clinic|Project|Technical|Logistics|Warehouse|Supply|Chain|Quality|Maintenance|Site|"
    r"Plant|Production|Human|Resources|Executive|Managing|Deputy|Assistant|Chief|Operating|Technology|Information|"
    r"Front|Desk|Food|Beverage|F&B|Guest|Relations|Admin|Administrative|School|Business|Head|of|and|&|the)[ \t]+)*"
    rf"(?:{_ROLES})")
# A form's field naming the writer's organization ("Company: Sahel Consulting Group", "Organisation name: ..."): its
# value, a name's capitalized words to the line's end. A form a customer fills in names its own company so, never
# the seller's; a chat's speaker so labeled says a sentence, no name ("Company: Which Nimbra model do you have?").
_COMPANY_FIELD = re.compile(r"^[ \t]*(?i:company|organi[sz]ation|business|employer)(?i:[ \t]+name)?[ \t]*:[ \t]*"
                            rf"(?P<org>{_CAP}(?:[ \t]+(?:&|and|of|the|de|{_CAP})){{0,5}})(?=[ \t]*\r?$)", re.MULTILINE)


# A record's last line signed with a name, a comma and the writer's company ("Ines Duarte, PixelPit Café", "- Tomás
# Ibarra, Taquería El Sol, Monterrey"; a closing's words are no name: "Kind Regards, Anna"). On the labeled tickets
# through v120, eight such lines, none naming the product.
_SIGNED = re.compile(rf"[ \t]*(?:[-–—~][ \t]*)?(?!(?:Best|Kind|Warm|Warmest|Many|Regards|Thanks|Thank|Cheers|Sincerely|"
                     rf"Yours|With|Greetings|Respectfully|Cordially)\b){PERSON},[ \t]*"
                     rf"(?P<org>[A-ZÀ-ÖØ-Þ][\w'’.&-]*(?:[ \t]+(?:&|and|of|the|de|{_CAP})){{0,5}})[ \t]*(?:,[^\n]*)?")


_CLOSING = re.compile(r"(?i:thanks|thank you|thx|cheers|regards|best|best regards|kind regards|sincerely|br|rgds"
                      r"|many thanks|warm regards|yours|greetings|viele grüße|liebe grüße|beste grüße|mit freundlichen "
                      r"grüßen|saludos|cordialement|cordiali saluti|grazie|obrigad[oa]|merci|gracias|muchas gracias"
                      r"|pozdrawiam|met vriendelijke groet|mvh|hälsningar|med vänlig hälsning|multumesc|dziękuję)"
                      r"[ \t,.!]*")
# The first words of closings that read as a name ("Vielen Dank, Hans Müller", "Kindest Regards", "Take Care"; the
# second review's list): a line opening with one signs no name before its comma.
_CLOSING_WORDS = frozenset(
    "best kind kindest warm warmest many vielen viele liebe beste freundliche freundlichen mit muchas saludos cordiali "
    "cordialement cordiales grazie merci bien un met sincere sincerely all take stay talk much with thanks thank "
    "regards cheers yours greetings respectfully love hugs hasta à a atentamente un saludo tack groeten".split())


def _closing(words: str) -> bool:
    """Whether a line's words before a comma are a closing's ("Vielen Dank", "Kindest Regards"), not a name."""
    first = words.strip(" \t\r-–—~").split(maxsplit=1)
    return (bool(first) and first[0].casefold() in _CLOSING_WORDS) or bool(_CLOSING.fullmatch(words.strip()))


def signed_company(text: str) -> list[tuple[int, int]]:
    """Where a record's last non-blank line names the writer's company after the name and a comma (_SIGNED), the
    line above it blank, a sentence's end or a closing ("Thanks"); not a heading's item ("Order details\nOffice
    Chair, Herman Miller Aeron"), nor a list's ("- Desk, Fjell\n- Office Chair, Herman Miller Aeron")."""
    end = len(text.rstrip())
    start = text.rfind("\n", 0, end) + 1
    above = text[text.rfind("\n", 0, max(0, start - 1)) + 1 : max(0, start - 1)].strip()
    if not start or (above and not (above.endswith((".", "!", "?", ",")) or _CLOSING.fullmatch(above))) \
            or above[:1] in ("-", "*", "•"):
        return []
    m = _SIGNED.fullmatch(text, start, end)
    if m is not None and (_closing(text[start : m.start("org")].rsplit(",", 1)[0])
                          or re.search(rf"\b(?:{_ROLES})[ \t]*,", text[start : m.start("org")])):
        return []  # "Vielen Dank, Hans Müller", "Store Manager, Anna Berg": the name follows the comma
    if m is None or any(ch.isdigit() for ch in m.group("org")) or (
            re.search(rf"\b(?:{_ROLES})$", m.group("org")) and not _DEPARTMENT.fullmatch(m.group("org"))):
        return []  # a product's model ("Max Mustermann, Brisa KX-300") or its role ("Ledgerly Administrator")
    return [m.span("org")]


# A heading's words: a line holding one is no signature's name ("Product Details", "Issue Description").
_HEADING = re.compile(r"\b(?:Details|Description|Summary|Information|Info|Issue|Problem|Order|Product|Subject|"
                      r"Request|Notes?|Message|Comments?|Reason|Type|Category|Status|Priority|Severity)\b")
_JOINS = frozenset(("&", "and", "of", "the", "de", "du", "des", "la", "le", "van", "von", "der", "y", "e", "und", "-"))
# A signature's name alone on its line (a dash before it at most).
_NAME_LINE = re.compile(rf"^[ \t]*{DASH}{PERSON}[ \t]*\r?$", re.MULTILINE)
# The line under it, where it names the writer's company (or a title, a city: no brand either): capitalized words, no
# digit, "@" or ":", at most six words before its first comma ("Murphy & Sons Plumbing", "Seaview B&B, Strand
# Street"). On the labeled tickets through v122, 351 lines under the writer's name so, none naming the product.
_UNDER_NAME = re.compile(r"[ \t]*(?P<org>[A-ZÀ-ÖØ-Þ][^\d@:,\n]*?)[ \t]*(?:,[^\n]*)?\r?(?:\n|$)")


def under_name(text: str, names: bool = False) -> list[tuple[int, int]]:
    """Where the line under a signature's name alone on its line (in the record's last SIGNATURE characters, under a
    blank line or a closing, never the record's first line) names the writer's company (_UNDER_NAME): (start, end) of
    its words before the first comma, in title case ("Murphy & Sons Plumbing"; not a sentence, "Velora Pro user since
    launch"), the name no heading's ("Product Details", "Issue Description": the second review's). With `names`,
    where those signatures' names stand instead: no brand's words ("Gareth Lowndes" over "Owner, Lowndes Plumbing &
    Heating" gave the brand "Lowndes", v129)."""
    start = max(0, len(text) - SIGNATURE)
    start = text.rfind("\n", 0, start) + 1 if start else 0
    out: list[tuple[int, int]] = []
    for m in _NAME_LINE.finditer(text, start):
        line = text[m.start() : m.end()]
        if not m.start() or _closing(line) or _HEADING.search(line):
            continue
        above = text[text.rfind("\n", 0, m.start() - 1) + 1 : m.start() - 1].strip()
        nxt = text.find("\n", m.end())
        u = _UNDER_NAME.match(text, nxt + 1) if nxt >= 0 else None
        # under a sentence too where the company's is the record's last line ("Call me on 07700 900 271.\nKemal
        # Aydın\nMeze House Kitchen": the company was copied as the brand, v127)
        last = u is not None and not text[u.end("org") :].strip(" \t\r\n,")
        if above and not (_CLOSING.fullmatch(above) or (_closing(above.rstrip(",")) and above.endswith(","))
                          or (last and above.endswith((".", "!", "?")))):
            continue
        if names:
            out.append(m.span())
            continue
        org = u.group("org").split() if u is not None else []
        if u is not None and len(org) <= 6 and not org[-1].endswith((".", "!", "?")) \
                and all(w[:1].isupper() or w[:1].isdigit() or w in _JOINS for w in org):
            out.append(u.span("org"))
    return out


# A seller, an installer or a distributor named by its role ("your authorised reseller PrintSys Iberia", "distributor,
# Bakequip Supplies"): no maker. Not "installed by", "supplied by", "shipped by", which a maker does too ("installed by
# Tesla", "shipped by Aurel"). On the labeled tickets through v122, none of such names the product's brand.
_SELLER = re.compile(r"\b(?:(?:authori[sz]ed[ \t]+|local[ \t]+|official[ \t]+)?(?:reseller|dealer|distributor|retailer|"
                     r"stockist|installer|integrator)s?)"
                     r"[ \t,:]+(?:the[ \t]+|our[ \t]+|your[ \t]+)?"
                     rf"(?P<org>{_CAP}(?:[ \t]+(?:&[ \t]+)?{_CAP}){{0,3}})")


# Words no brand is: a month's or a day's name before a lowercase word, a digit or the line's end ("The May box" gave
# "May"; not "August Wi-Fi Smart Lock", "Sunday Riley"), and a salutation in the customer's language opening a greeting
# line ("Buna ziua," gave "Buna"; not "Ola S1 Pro battery"). No product of the labeled tickets through v122 holds one.
_NO_BRAND = re.compile(
    r"(?<![\w-])(?:January|February|March|April|May|June|July|August|September|October|November|December|Monday|"
    r"Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday)(?![\w-])(?![ \t]+[A-ZÀ-ÖØ-Þ])"
    r"|^[ \t]*(?i:bun[aă] ziua|hallo|hola|bonjour|guten tag|dzie[nń] dobry|ciao|ol[aá]|hej|merhaba|namaste|salut"
    r"|goedemiddag|goedemorgen|god dag|buongiorno|buenos d[ií]as|buenas tardes|boa tarde|bom dia|moin|servus|gr[üu]ezi"
    r"|szia|ahoj|tere|labas|sveiki|zdravo|dobr[yý] den|kalimera|shalom|salaam|konnichiwa)(?![\w-])"
    r"(?=(?:[ \t]+[^\W\d_][\w'’-]*){0,2}[ \t]*(?:[,!]|\r?$))", re.MULTILINE)


# The shop a product named by its brand was bought from ("I bought a Brellin Oslo 3-seat sofa from Casa Mundo": "Casa
# Mundo" was copied as the brand, v126): a word with a capital letter between the verb and "from"/"at"/"on" (not "I",
# not a count), and the shop's first word not among the words before it; "I bought a sofa from Brellin" and "I
# purchased the Dyson V15 from Dyson" (bought from its maker) name none.
_BOUGHT_FROM = re.compile(r"\b(?:bought|purchased|ordered)\b[^.!?\n]{0,60}?(?<![\w'’-])(?P<item>(?!I\b)[A-ZÀ-ÖØ-Þ]"
                          r"[\w'’.&-]*+)[^.!?\n]{0,60}?[ \t](?:from|at|on|through|via)[ \t]+(?:the[ \t]+)?"
                          r"(?P<org>[A-Z0-9À-ÖØ-Þ][\w'’&-]*+(?:[ \t]+[A-Z0-9À-ÖØ-Þ][\w'’&-]*+){0,3})")


def sellers(text: str) -> list[tuple[int, int]]:
    """Where `text` names a seller, an installer or a distributor by its role (_SELLER), or the shop a branded
    product was bought from (_BOUGHT_FROM) and that shop's name wherever else it stands: (start, end) each."""
    found = [(m.start("org"), m.end("org") - m.group("org").endswith(".")) for m in _SELLER.finditer(text)]
    shops = {org for m in _BOUGHT_FROM.finditer(text)
             if (org := m.group("org").rstrip(".")).split()[0] not in text[m.start("item") : m.start("org")]}
    return found + _wherever(text, shops)


# The writer introducing their company: "This is Rajesh Iyer from Coldstream Foods", "it's Anjali from Corvid Design
# Studio", "I run Trailwise Adventures", "I'm the office manager at Maplewood Urgent Care", "I work for Halden
# Logistics", and a line opening "Bark & Bloom Dog Daycare here" (an "&" or "and" in it: "Jan Novak here" is the
# writer). v129-v130 had the model copy each as the brand or the writer.
_WORD = rf"{_NAME_WORD}(?![\w'’-])"  # a whole word: not "AX" of "AX6"
_ORG = rf"{_WORD}(?:[ \t]+(?:&|and|of|{_WORD})){{0,4}}"
_INTRO = re.compile(
    rf"(?<![\w'’-])(?:(?:(?i:this[ \t]+is|it['’]?s|it[ \t]+is|I['’]m|I[ \t]+am)[ \t]+{_WORD}"
    rf"(?:[ \t]+{_WORD}){{0,3}}[ \t]+(?:from|at|with)"
    rf"|I(?:['’]m|[ \t]+am)[ \t]+(?:the|an?)[ \t]+(?:[a-z-]+[ \t]+){{1,3}}?(?:at|for)|I[ \t]+work[ \t]+(?:at|for))"
    rf"[ \t]+(?:the[ \t]+)?(?P<org>{_ORG})"
    # "I run Trailwise Adventures, a small guiding company" (not "I run the Velora app": the appositive says it)
    rf"|(?:I|[Ww]e)[ \t]+(?:run|own|manage)[ \t]+(?P<run>{_ORG})(?=,[ \t]+(?:a|an|our)[ \t]))"
    rf"|^[ \t]*(?P<here>{_WORD}(?:[ \t]+{_WORD})*[ \t]+(?:&|and)[ \t]+{_WORD}(?:[ \t]+{_WORD}){{0,3}})[ \t]+here\b",
    re.MULTILINE)


def introduced(text: str) -> list[tuple[int, int]]:
    """Where the writer names their own company introducing themselves (_INTRO): (start, end) each."""
    return [m.span(next(g for g in ("org", "run", "here") if m.group(g))) for m in _INTRO.finditer(text)]


def company_fields(text: str) -> list[tuple[int, int]]:
    """Where a form's field names the writer's organization: (start, end) each (_COMPANY_FIELD)."""
    return [m.span("org") for m in _COMPANY_FIELD.finditer(text)]


def legal_names(text: str) -> list[tuple[int, int]]:
    """Where `text` names a company with its legal form ("Hoshino Packaging GmbH", "VENDORA HOME LTD"): (start, end)
    each. Not a model number that holds the letters of one ("Forgeline AG-115")."""
    return [m.span() for m in _LEGAL.finditer(text)]


def employers(text: str, titles: bool = False) -> list[tuple[int, int]]:
    """Where `text` names its writer's employer after a job title (see the module's docstring): (start, end) each;
    with `titles`, the job title's too ("Finance Director": its first word was once taken for the brand)."""
    orgs, cut_titles = _employer_spans(text)
    return orgs + (cut_titles if titles else [])


def _employer_spans(text: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(the employers' spans, the job titles' that are a department's or a rank's), from one search of the signature."""
    start = max(0, len(text) - SIGNATURE)
    start = text.rfind("\n", 0, start) + 1 if start else 0  # from a line's start
    signed = [m for m in _TITLE.finditer(text, start) if m.group("own") is None or _signs(text, m)]
    return [m.span("org") for m in signed], [m.span("title") for m in signed if _DEPARTMENT.fullmatch(m.group("title"))]


def _signs(text: str, m: re.Match[str]) -> bool:
    """Whether a name, a title alone on its line and a company on the next one sign the record: the company has no
    digit (not "Sorrelgate Breeze 16"), and the name's line opens the signature (after a blank line, a closing's
    comma or a short closing: "Best regards,", "Thanks"; not a list's "two items damaged:")."""
    if any(ch.isdigit() for ch in m.group("org")):
        return False
    prev = text[text.rfind("\n", 0, max(0, m.start() - 1)) + 1 : max(0, m.start() - 1)].strip() if m.start() else None
    return prev is not None and (not prev or prev.endswith(",") or (
        len(prev) <= 30 and prev[:1].isupper() and not any(ch in prev for ch in ":.;")))


def without_employer(sources: Sequence[str]) -> list[str]:
    """`sources` with each employer a signature, its last line, the line under its name, a form's company field or
    the writer's introduction names (and the writer's job title before it), wherever the text writes that name ("I
    own Golden Lotus restaurant" signed "Owner, Golden Lotus"), each company named with its legal form, each seller
    named by its role or as the shop bought from, the signature's own name and the words no brand is (a month, a
    salutation: _NO_BRAND) cut out, what is left of each as separate texts."""
    return cut_out(sources, _writers_companies)


def without_company(sources: Sequence[str]) -> list[str]:
    """`sources` with the writer's company as a signature after a title, its last line or a form's company field name
    it, wherever the text writes it, and each company named with its legal form cut out: what a field asking for the
    writer copies from ("Partner, Kessler Steuerberatung" is no one's name). Not the line under a name (`under_name`),
    which a closing read as a name ("Viele Grüße") would make the writer's own."""
    return cut_out(sources, lambda text: _writers_companies(text, under=False))


def companies(text: str) -> list[tuple[int, int]]:
    """Where `text` names the writer's company or a seller (what `without_employer` cuts, less titles and words)."""
    return _writers_companies(text, under=True, words=False)


# The writer's companies looked for again elsewhere in the record: at most this many, of two to six words and at most
# _NAME_CHARS characters each ("Golden Lotus" of "I own Golden Lotus restaurant"; not "Bosch" of "Facilities Manager,
# Bosch", which the record may also name as the brand), in one pass.
_AGAIN = 16
_NAME_CHARS = 80


def _wherever(text: str, names: set[str]) -> list[tuple[int, int]]:
    """Where `text` writes any of `names` as whole words: the _AGAIN longest of at most _NAME_CHARS characters, in one
    pass (one alternation)."""
    kept = sorted((n for n in names if len(n) <= _NAME_CHARS), key=len, reverse=True)[:_AGAIN]
    if not kept:
        return []
    return [m.span() for m in re.finditer(r"(?<![\w-])(?:" + "|".join(map(re.escape, kept)) + r")(?![\w-])", text)]


def _writers_companies(text: str, under: bool = True, words: bool = True) -> list[tuple[int, int]]:
    employed, titles = _employer_spans(text)
    orgs = employed + company_fields(text) + signed_company(text) + introduced(text) + \
        (under_name(text) if under else [])
    again = _wherever(text, {n for a, b in orgs if 2 <= len((n := text[a:b]).split()) <= 6})
    seller = sellers(text) if under else []
    no_brand = [m.span() for m in _NO_BRAND.finditer(text)] + under_name(text, names=True) if under and words else []
    return (titles if under and words else []) + orgs + again + legal_names(text) + seller + no_brand
