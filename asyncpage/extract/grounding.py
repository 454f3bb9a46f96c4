"""Grounded extraction: string fields whose value must be copied from the record, never invented.

A schema marks such a field with `"x-copy": true` (or `copy_fields` marks them: a list of names,
or "auto" for every free string field). The schema then compiles to a Lark grammar (llguidance's
dialect) in which each copied value is a span of the record's text: llguidance's
`substring_chunks` lexeme (a suffix automaton of the source) intersected (`&`) with the field's own
length and pattern constraints. Everything else in the schema stays `%json`, so a copied field is
exactly the schema's string with one more constraint. Nullable copied fields may be null: the
way out when the record holds no such value (an order id it does not mention).

The grammar embeds the source, so it is specific to one record: the extraction layer compiles it
for that record only and drops it from the grammar cache when the record ends.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from asyncpage.errors import InvalidRequestError
from asyncpage.extract.employer import without_company, without_employer
from asyncpage.extract.staff import writer_sources

COPY = "x-copy"
# On a copied property whose value is a name (a brand: ends.named_copies): no word of its span is a code, three
# digits or more in one word ("TV-48812", "OPX-993-1148-A"; "Z-50", "X6", "7-Eleven" stay): the model copied the
# order id as the product brand where both were on hand (three fresh tickets); and its spans come from the record
# with its writer's employer cut out (employer.py: "Practice Manager, Westgate Family Clinic" names no product).
NAMED = "x-copy-name"
# On a copied property asking for the record's writer (ends.named_copies): its spans come from the record with
# its support staff's names cut out (staff.py): an agent's name is never the customer.
WRITER = "x-copy-writer"
# A word of a name (_short): at most two digits, or a lowercase run of three letters ("1-800-Flowers").
# The most words a name's span holds (a brand; a person's full name): never a sentence or a paragraph (a whole
# message was copied as the writer's name once, a sentence as the product: v49-v50).
_MOST_WORDS = {NAMED: 6, WRITER: 8}
# Words that open a noun phrase ("the customer", "her order"): a statement's subject runs past one to the next word
# (booleans.subject_of).
DETERMINERS = frozenset("the a an this that these those his her its their my our your each every any some no".split())
# A copied value's end is read without these at its start ("The Glossvane Sleek 3" as "Glossvane Sleek 3"); names
# that open with "My", "Our" or "No" keep them ("The Ordinary" does not: a name of that kind loses its article).
ARTICLES = frozenset(("the", "a", "an"))
# One JSON string character as the grammar sees it: escaped forms count as one.
_JSON_CHAR = r'(?:[^"\\\x00-\x1f]|\\(?:["\\\/bfnrt]|u[0-9a-fA-F]{4}))'
# A JSON string character that is not whitespace (escaped \n, \t, \r included), and a span that
# starts and ends with one.
_SOLID = r'(?:[^"\\\x00-\x20]|\\(?:["\\\/bf]|u[0-9a-fA-F]{4}))'
_TRIMMED = f"{_SOLID}(?:{_JSON_CHAR}*{_SOLID})?"
_NOTHING = r"/[^\s\S]/"  # a regex no text matches
# A span holds a letter or a digit: asked one field at a time, the default model answered ":" or ","
# (a lone punctuation mark is a whole span unit) for most names; no value is only punctuation.
_MEANINGFUL = rf"/{_JSON_CHAR}*[\p{{L}}\p{{N}}]{_JSON_CHAR}*/"  # a bare one: "\u0007" and "\b" hold none
_SLASH = re.compile(r"(\\.)|/")  # an unescaped "/" ends a Lark regex literal: escape only those
# json.dumps' separators: the JSON most often seen in a model's training text. Compact JSON
# ({"a":"x"}) made the default model answer "1" for every copied field; spaced JSON did not.
ITEM_SEP, KEY_SEP = ", ", ": "
_STYLE = {"whitespace_flexible": False, "lenient": False, "item_separator": ITEM_SEP, "key_separator": KEY_SEP}


def mark(schema: dict[str, Any], fields: Sequence[str] | str | None) -> dict[str, Any]:
    """`schema` with `"x-copy": true` on the named top-level string properties; "auto" marks every
    string property without enum, const or format (nullable ones included). None: as written."""
    if fields is None:
        return schema
    props = resolve(schema, schema).get("properties") or {}
    if isinstance(fields, str) and fields != "auto":
        fields = [f.strip() for f in fields.split(",") if f.strip()]
    names = [n for n, p in props.items() if _free_string(schema, resolve(schema, p))] if fields == "auto" \
        else list(fields)
    marked = {}
    for name in names:
        if name not in props:
            raise InvalidRequestError("copy_fields", f"the schema has no property {name!r} (it has {sorted(props)})")
        prop = resolve(schema, props[name])
        if _string_branch(schema, prop) is None:
            raise InvalidRequestError("copy_fields", f"{name!r} is not a string property: only strings are copied")
        marked[name] = {**prop, COPY: True}
    return with_properties(schema, marked)


def with_properties(schema: dict[str, Any], changed: dict[str, Any]) -> dict[str, Any]:
    """A copy of `schema` whose top-level object has the `changed` properties (`schema` is untouched)."""
    root = dict(schema)
    obj = dict(resolve(root, root))
    obj["properties"] = {**(obj.get("properties") or {}), **changed}
    if "$ref" in root:  # a msgspec schema: the object lives in $defs
        return {**obj, "$defs": root.get("$defs", {})}
    root.update(obj)
    return root


def copied(schema: Any) -> bool:
    """Whether any property anywhere in `schema` is marked `x-copy`."""
    if isinstance(schema, dict):
        return schema.get(COPY) is True or any(copied(v) for v in schema.values())
    if isinstance(schema, list):
        return any(copied(v) for v in schema)
    return False


def copied_names(schema: dict[str, Any]) -> set[str]:
    """The top-level properties marked `x-copy` (what the default prompt says is copied)."""
    props = resolve(schema, schema).get("properties") or {}
    return {n for n, p in props.items() if isinstance(p, dict) and p.get(COPY) is True}


def grammar(schema: dict[str, Any], sources: Sequence[str]) -> str:
    """Lark text for `schema` where every `x-copy` string is a span of one of `sources`."""
    b = _Builder(schema, sources)
    start = b.value(schema)
    if b.must_copy and not b.copyable:
        raise InvalidRequestError("copy_from", "the record has no text (no letter or digit) to copy a non-nullable "
                                               "field from")
    return "%llguidance {}\n" + "\n".join([f"start: {start}", *b.rules]) + "\n"


def _writer_sources(sources: Sequence[str]) -> list[str]:
    """What a field asking for the writer copies from: no staff (staff.writer_sources), no company (employer)."""
    return writer_sources(without_company(sources))


def line_grammar(branch: dict[str, Any], sources: Sequence[str], lead: str, end: str, *,
                 digit: bool = False) -> str | None:
    """Lark text for one copied value written bare on a label line: `lead`, a span of `sources` as it stands
    (whole words, one line, holding a letter or a digit, within the branch's length and patterns; with `digit`,
    holding a decimal digit), then `end`. What decisions.py reads a nullable copied field's present value with.
    None: nothing can be copied."""
    if branch.get(WRITER) is True:
        sources = _writer_sources(sources)
    elif branch.get(NAMED) is True:
        sources = without_employer(sources)
    if not any((ch.isdecimal() if digit else ch.isalnum()) for s in sources for ch in s):
        return None
    spans = " | ".join("%regex " + json.dumps({"substring_chunks": _WORDS.findall(s)}) for s in sources if s)
    lo = max(1, int(branch.get("minLength", 1)))
    hi = branch.get("maxLength")
    parts = ["SOURCES", r"/[^\s](?:[^\n]*[^\s])?/", r"/[^\n]*[\p{L}\p{N}][^\n]*/",
             f"/[^\\n]{{{lo},{'' if hi is None else int(hi)}}}/"]
    if digit:
        parts.append(r"/[^\n]*\p{Nd}[^\n]*/")
    parts += _short(branch, sources)
    for pattern in _patterns(branch):
        parts.append("/" + _SLASH.sub(lambda m: m.group(1) or "\\/", _unanchored(pattern)) + "/")
    return (f"%llguidance {{}}\nstart: {json.dumps(lead)} VALUE {json.dumps(end)}\n"
            f"VALUE: {' & '.join(parts)}\nSOURCES: {spans}\n")


def resolve(root: dict[str, Any], node: Any) -> Any:
    """Follow local `$ref`s (what msgspec and pydantic emit) to the schema they name."""
    seen = 0
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and seen < 32:
        ref = node["$ref"]
        if not ref.startswith("#/"):
            raise InvalidRequestError("schema", f"$ref {ref!r}: only local references are supported with x-copy")
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(target, dict) else None
        if target is None:
            raise InvalidRequestError("schema", f"$ref {ref!r} points nowhere")
        node = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        seen += 1
    return node


def _free_string(root: dict[str, Any], s: Any) -> bool:
    branch = _string_branch(root, s) if isinstance(s, dict) else None
    return branch is not None and not any(k in branch for k in ("enum", "const", "format"))


def _string_branch(root: dict[str, Any], s: dict[str, Any]) -> dict[str, Any] | None:
    """The string schema inside `s` (itself, or the string side of string-or-null), else None."""
    t = s.get("type")
    if t == "string" or (isinstance(t, list) and set(t) <= {"string", "null"} and "string" in t):
        return s
    for key in ("anyOf", "oneOf"):
        alts = s.get(key)
        if isinstance(alts, list) and alts:
            resolved = [resolve(root, x) for x in alts]
            if not all(isinstance(a, dict) for a in resolved):
                return None  # a boolean schema among the alternatives: not a plain string
            strings = [a for a in resolved if a.get("type") != "null"]
            if len(strings) == 1 and len(alts) - len(strings) <= 1:
                inner = _string_branch(root, strings[0])
                return None if inner is None else with_outer(s, inner)
    return None


def with_outer(outer: dict[str, Any], inner: dict[str, Any]) -> dict[str, Any]:
    """The string branch with the string keywords written beside its anyOf / oneOf, which hold as
    well: {"anyOf": [{"type": "string"}, {"type": "null"}], "maxLength": 3} caps the string at 3."""
    merged = dict(inner)
    for key in ("minLength", "maxLength"):
        for node in (outer, inner):
            v = node.get(key, 0)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
                raise InvalidRequestError("schema", f"{key} must be a non-negative integer, got {v!r}")
    if "minLength" in outer:
        merged["minLength"] = max(outer["minLength"], inner.get("minLength", 0))
    if "maxLength" in outer:
        merged["maxLength"] = min(outer["maxLength"], inner.get("maxLength", outer["maxLength"]))
    if _patterns(outer):
        merged[_PATTERNS] = (*_patterns(outer), *_patterns(inner))
    for key in ("enum", "const", "format"):  # they make the field not a free string: seen, to be refused
        if key in outer:
            merged.setdefault(key, outer[key])
    return merged


_PATTERNS = "x-asyncpage-patterns"  # every pattern a string branch must match (its own and its parents')


def _patterns(s: dict[str, Any]) -> tuple[str, ...]:
    if _PATTERNS in s:
        return tuple(s[_PATTERNS])
    return (s["pattern"],) if isinstance(s.get("pattern"), str) else ()


def _nullable(root: dict[str, Any], s: dict[str, Any]) -> bool:
    t = s.get("type")
    if isinstance(t, list) and "null" in t:
        return True
    return any(resolve(root, a).get("type") == "null" for k in ("anyOf", "oneOf") for a in s.get(k) or [])


# Whole words (joined by - / . :), single punctuation marks, runs of whitespace: spans start and
# end on these bounds.
_WORDS = re.compile(r"\w+(?:[-/.:]\w+)*|\s+|[^\w\s]")  # "ORD-48213", "4.2.1", "12:30" stay whole


def _short(prop: dict[str, Any], sources: Sequence[str], escaped: bool = False) -> list[str]:
    """A name's words as one lexeme's regex: at most _MOST_WORDS of them, and for a brand (NAMED, where a word of
    `sources` is no code) each no code (at most two digits, or a lowercase run of three letters); [] for other
    values. One regex for both: every lexeme more in a span's intersection costs llguidance's lexer (a beam search
    over six ran out of its fuel). `escaped`: the span is a JSON string's body, where a newline, a tab or a carriage
    return is written `\\n`, `\\t`, `\\r` and breaks words as they do in the raw text (an escaped backslash before
    an "n" does not)."""
    most = min((n for flag, n in _MOST_WORDS.items() if prop.get(flag) is True), default=0)
    coded = prop.get(NAMED) is True and _names_some(sources)
    if not most and not coded:
        return []
    char, gap = (r"(?:[^\s\\]|\\[^nrt])", r"(?:\s|\\[nrt])+") if escaped else (r"\S", r"\s+")
    if coded:  # at most two digits, or a lowercase run of three letters
        plain = char.replace("\\s", "\\s\\d") if escaped else r"[^\s\d]"
        word = rf"(?:{plain}*(?:\d{plain}*){{0,2}}|{char}*\p{{Ll}}{{3}}{char}*)"
    else:
        word = char + "+"
    return ["/" + word + "(?:" + gap + word + ")" + (f"{{0,{most - 1}}}" if most else "*") + "/"]


def _or_whole(cut: list[str], sources: Sequence[str]) -> list[str]:
    """What a writer's or a brand's spans come from: `cut` (the record less its staff, its greetings, its companies),
    or the whole record where the cut left no letter or digit ("Tesla Inc." alone): a required copied field must
    have a span to copy, or its grammar has no way through."""
    return cut if any(ch.isalnum() for part in cut for ch in part) else [s for s in sources if s.strip()]


def _names_some(sources: Sequence[str]) -> bool:
    """Whether a word of `sources` holding a letter is no code (a name's word, _short): where none is, a brand is
    left free to be a code rather than have no value at all."""
    return any(any(ch.isalpha() for ch in w) and (sum(ch.isdigit() for ch in w) <= 2 or re.search(r"[a-z]{3}", w))
               for s in sources for w in s.split())


def _spans_of(sources: Sequence[str]) -> str:
    """A lexeme of any run of whole span units (_chunks) of one of `sources`; one nothing matches when there is no
    text at all (nullable copied fields can then only be null)."""
    spans = " | ".join("%regex " + json.dumps({"substring_chunks": _chunks(s)}) for s in sources if s)
    return spans or _NOTHING


def _chunks(text: str) -> list[str]:
    """The source as span units, each written as inside a JSON string (so a span is a valid string
    body). Units are words, not characters: a value cannot start or stop mid-word, which is what a
    small model did when any character span was allowed ("1" from "$129" as a customer, "0091")."""
    return [json.dumps(w, ensure_ascii=False)[1:-1] for w in _WORDS.findall(text)]


class _Builder:
    def __init__(self, root: dict[str, Any], sources: Sequence[str]) -> None:
        self.root = root
        self.defs = {k: root[k] for k in ("$defs", "definitions") if isinstance(root.get(k), dict)}
        self.rules: list[str] = []
        self.rules.append("SOURCE_SPAN: " + _spans_of(sources))
        self.sources = list(sources)
        self.writer_span = ""  # WRITER_SPAN's rule, made for the first writer field
        self.brand_span = ""  # BRAND_SPAN's (SOURCE_SPAN where no signature names an employer), for the first brand
        self.n = 0
        self.must_copy = False  # a copied field that cannot be null
        # No letter or digit anywhere: no span can be copied, so a nullable copied field is just null
        # (an opening quote there would be a dead end: a beam search ranked such halves of values).
        self.copyable = any(ch.isalnum() for s in sources for ch in s)

    def _name(self, base: str) -> str:
        self.n += 1
        return f"{base}_{self.n}"

    def value(self, schema: Any) -> str:
        s = resolve(self.root, schema)
        if not copied(s):
            return self._json(s)
        if s.get(COPY) is True:
            return self._span(s)
        if s.get("type") == "object" or "properties" in s:
            return self._object(s)
        if s.get("type") == "array" and "items" in s:
            return self._array(s)
        raise InvalidRequestError("schema", "x-copy is supported on string properties of objects (and arrays of "
                                            "them), not under anyOf/oneOf/allOf")

    def _json(self, s: Any) -> str:
        body: Any = {**s, **self.defs} if isinstance(s, dict) else s
        if isinstance(body, dict):
            body = {**body, "x-guidance": _STYLE}
        return "%json " + json.dumps(body)

    def _span(self, s: dict[str, Any]) -> str:
        branch = _string_branch(self.root, s)
        if branch is None or any(k in branch for k in ("enum", "const", "format")):
            raise InvalidRequestError("schema", "x-copy applies to free string properties (no enum, const or format)")
        lo = max(1, int(branch.get("minLength", 1)))  # an empty span copies nothing: null is the way out
        hi = branch.get("maxLength")
        name = self._name("COPIED").upper()
        if hi is not None and int(hi) < lo:
            raise InvalidRequestError("schema", f"x-copy needs maxLength >= 1 and >= minLength (got maxLength {hi}, "
                                                f"minLength {branch.get('minLength', 1)})")
        # No whitespace at either end (a span of the text, not of its spacing), length in characters.
        source = self._writer_span() if s.get(WRITER) is True else self._brand_span() if s.get(NAMED) is True \
            else "SOURCE_SPAN"
        parts = [source, f"/{_TRIMMED}/", _MEANINGFUL, f"/{_JSON_CHAR}{{{lo},{'' if hi is None else int(hi)}}}/"]
        parts += _short(s, self.sources, escaped=True)
        patterns = _patterns(branch)
        if patterns:
            # A pattern is matched against the JSON text of the span, which equals the value only
            # when it has no escapes: with a pattern, spans needing escapes are left out.
            parts.append("/[^\\\\]*/")
        for pattern in patterns:
            parts.append("/" + _SLASH.sub(lambda m: m.group(1) or "\\/", _unanchored(pattern)) + "/")
        self.rules.append(f"{name}: " + " & ".join(parts))
        rule = f'"\\"" {name} "\\""'
        if _nullable(self.root, s):
            return f"({rule} | \"null\")" if self.copyable else '"null"'
        self.must_copy = True
        return rule

    def _writer_span(self) -> str:
        if not self.writer_span:
            self.rules.append("WRITER_SPAN: " + _spans_of(_or_whole(_writer_sources(self.sources), self.sources)))
            self.writer_span = "WRITER_SPAN"
        return self.writer_span

    def _brand_span(self) -> str:
        if not self.brand_span:
            brand = _or_whole(without_employer(self.sources), self.sources)
            self.brand_span = "SOURCE_SPAN"
            if brand != [s for s in self.sources if s.strip()]:
                self.rules.append("BRAND_SPAN: " + _spans_of(brand))
                self.brand_span = "BRAND_SPAN"
        return self.brand_span

    def _object(self, s: dict[str, Any]) -> str:
        props: dict[str, Any] = s.get("properties") or {}
        required = set(s.get("required") or [])
        # The object is written key by key from `properties`; what that cannot honour is refused.
        unsupported = [k for k in ("allOf", "anyOf", "oneOf", "not", "if", "dependentRequired", "dependentSchemas",
                                   "minProperties") if k in s and not (k == "minProperties" and
                                                                        s[k] <= len(required & set(props)))]
        if unsupported or not required <= set(props):
            raise InvalidRequestError("schema", "an object with x-copy fields is written from its properties; "
                                      f"it cannot also use {unsupported or 'required names missing from properties'}")
        # Properties in schema order; an optional one may be left out. Built from the last property
        # back: `after` is the rest once a pair was written (it opens with a comma), `first` the rest
        # while none was. `after` is a named rule (optional properties use it twice), so the text
        # grows linearly with the properties.
        after, first = "", ""
        for key in reversed(list(props)):
            pair = f"{json.dumps(json.dumps(key) + KEY_SEP)} {self.value(props[key])}"
            tail_after = f"{json.dumps(ITEM_SEP)} {pair} {after}".strip()
            tail_first = f"{pair} {after}".strip()
            if key not in required:
                tail_after = f"({tail_after} | {after})" if after else f"({tail_after})?"
                tail_first = f"({tail_first} | {first})" if first else f"({tail_first})?"
            after, first = self._rule("after", tail_after), tail_first
        return self._rule("obj", f'"{{" {first} "}}"'.replace("  ", " "))

    def _rule(self, base: str, body: str) -> str:
        name = self._name(base)
        self.rules.append(f"{name}: {body}")
        return name

    def _array(self, s: dict[str, Any]) -> str:
        if s.get("maxItems") is not None or int(s.get("minItems", 0)) > 1 or s.get("uniqueItems"):
            raise InvalidRequestError("schema", "x-copy inside an array supports no maxItems, minItems > 1 or "
                                                "uniqueItems")
        item = self.value(s["items"])
        items = f"{item} ({json.dumps(ITEM_SEP)} {item})*"
        body = items if int(s.get("minItems", 0)) == 1 else f"({items})?"
        return self._rule("arr", f'"[" {body} "]"')


def _unanchored(pattern: str) -> str:
    """A JSON Schema pattern (a search: unanchored unless it says ^ or $) as a whole-match regex.
    Each top-level alternative anchors on its own: "^A|B$" is "starts with A, or ends with B"."""
    return "(?:" + "|".join(_whole(alt) for alt in _alternatives(pattern)) + ")"


def _whole(alt: str) -> str:
    start = alt.startswith("^")
    # A final $ is an anchor unless escaped: an odd run of backslashes before it ("x\\\\$" ends in
    # a backslash, then the anchor).
    end = alt.endswith("$") and len(alt) > int(start) and (len(alt) - 1 - len(alt[:-1].rstrip("\\"))) % 2 == 0
    core = alt[int(start) : len(alt) - int(end)]
    return ("" if start else ".*") + f"(?:{core})" + ("" if end else ".*")


def _alternatives(pattern: str) -> list[str]:
    """`pattern` split at its top-level |: outside groups and character classes, not escaped."""
    alts: list[str] = []
    depth, begin, escaped = 0, 0, False
    class_from = -1  # where the body of the character class being read starts; -1 outside one
    for i, ch in enumerate(pattern):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif class_from >= 0:
            if ch == "^" and i == class_from:
                class_from += 1  # [^...]: the class body starts after the ^
            elif ch == "]" and i > class_from:  # a ] first in the body is a literal
                class_from = -1
        elif ch == "[":
            class_from = i + 1
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "|" and depth == 0:
            alts.append(pattern[begin:i])
            begin = i + 1
    alts.append(pattern[begin:])
    return alts
