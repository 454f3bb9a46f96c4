"""The other spellings of a tool call, under tool_choice="auto": written, they are held to a valid
call and returned as one, never left in the content.

Models leave their family's own markers out (Qwen2.5 answers `{"name": "get_weather", "arguments":
{...}}` without Hermes' <tool_call> tags; Mistral's `[{...}]` comes without [TOOL_CALLS]; Llama writes
"arguments" for "parameters"; spacing varies). Every family's lazy grammar (grammar.py) therefore also
opens on:
- a bare call object naming a declared tool, anywhere in the reply:
  `{"name": "<tool>", "arguments" | "parameters": <arguments>}` (up to 8 whitespace characters between
  its parts), and then more of them (whitespace, `,` or `;` between) when calls may be parallel;
- a list of them, `[{...}, {...}]`.
The grammar commits at the tool's name (its closing quote: `{"name": "Bob"}` stays content when no tool
is called Bob), and from there the arguments follow that tool's schema and nothing but calls may
follow. A reply that never writes such a head is content as before. The head text is matched by the
grammar (Rust regexes) and by the reader below (Python) from the same parts, so the two agree.

Owns the spellings' grammar rules and their reading; the family formats are formats.py's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

WS_MAX = 8  # whitespace characters allowed between two parts of a head
_WS = "[ \\t\\r\\n]{0,%d}" % WS_MAX  # noqa: UP031 (a regex, braces included)
_SPACE = " \t\r\n"
KEYS = ("arguments", "parameters")


def _re(name: str) -> str:
    """A tool name ([A-Za-z0-9_.-], messages.py checks it) as Rust regex text."""
    return name.replace(".", "\\.").replace("-", "\\-")


def rules(names: Sequence[str], args_rules: Sequence[str], parallel: bool) -> tuple[list[str], list[str]]:
    """(Lark rules, body alternatives) of the bare spellings for tools `names`, whose arguments are
    the rules `args_rules`. `TEXT` (free text) must be defined by the caller."""
    w = _WS
    out = [f"BARE_KEY: /{w},{w}\"({'|'.join(KEYS)})\"{w}:{w}/", f"BARE_END: /{w}\\}}/",
           # The text before a bare head may not end with "[": a list's head is read as one (below).
           r"BARE_TEXT: /(?s:.*)/ & ~/(?s:.*)\[[ \t\r\n]*/"]
    bare, opened, listed = [], [], []
    for i, (name, args) in enumerate(zip(names, args_rules, strict=True)):
        head = f'\\{{{w}"name"{w}:{w}"{_re(name)}"'
        out += [f"BARE_HEAD_{i}: /{head}/", f"LIST_HEAD_{i}: /\\[{w}{head}/",
                f"bare_pre_{i}[lazy]: BARE_TEXT BARE_HEAD_{i}", f"list_pre_{i}[lazy]: TEXT LIST_HEAD_{i}",
                f"bare_rest_{i}: BARE_KEY {args} BARE_END", f"bare_{i}: BARE_HEAD_{i} bare_rest_{i}"]
        bare.append(f"bare_{i}")
        opened.append(f"bare_pre_{i} bare_rest_{i}")
        listed.append(f"list_pre_{i} bare_rest_{i}")
    out += ["bare_call: " + " | ".join(bare), "bare_open: " + " | ".join(opened),
            "list_open: " + " | ".join(listed), f"LIST_END: /{w}\\]/"]
    if parallel:
        out += [f"BARE_SEP: /[ \\t\\r\\n]{{1,{WS_MAX}}}|{w}[,;]{w}/", f"LIST_SEP: /{w},{w}/",
                "bare_calls: bare_open (BARE_SEP bare_call)*", "list_calls: list_open (LIST_SEP bare_call)* LIST_END"]
    else:
        out += ["bare_calls: bare_open", "list_calls: list_open LIST_END"]
    return out, ["bare_calls", "list_calls"]


NO, PARTIAL = 0, -1  # _head's answers besides the index just past a complete head


def _ws(s: str, i: int) -> int:
    j = i
    while j < len(s) and j - i < WS_MAX and s[j] in _SPACE:
        j += 1
    return j


def _parts(s: str, i: int, parts: Sequence[str | tuple[str, ...] | None]) -> int:
    """Match `parts` at s[i:]: a literal, a choice of literals, or None for whitespace. The index just
    past them, PARTIAL when the text ends inside (they may still follow), NO when they cannot."""
    for p in parts:
        if p is None:
            j = _ws(s, i)
            if j == len(s) and j - i < WS_MAX:
                return PARTIAL
            i = j
            continue
        options = p if isinstance(p, tuple) else (p,)
        rest = s[i:]
        full = next((o for o in options if rest.startswith(o)), None)
        if full is None:
            return PARTIAL if any(o.startswith(rest) for o in options) else NO
        i += len(full)
    return i


_HEAD = ("{", None, '"name"', None, ":", None, '"')
_KEY = (None, ",", None, tuple(f'"{k}"' for k in KEYS), None, ":", None)


def head(s: str, i: int, names: frozenset[str], listed: bool = False) -> tuple[int, str]:
    """(index just past the head at s[i:] or NO / PARTIAL, the tool it names)."""
    j = _parts(s, i, (("[", None) if listed else ()) + _HEAD)
    if j <= 0:
        return j, ""
    q = s.find('"', j)
    if q < 0:
        rest = s[j:]
        return (PARTIAL if any(n.startswith(rest) for n in names) else NO), ""
    name = s[j:q]
    return (q + 1, name) if name in names else (NO, "")


@dataclass
class Opening:
    """Where a bare spelling begins in the text and the index past its head."""

    at: int
    end: int
    name: str
    listed: bool


def find(s: str, start: int, body: int, names: frozenset[str]) -> tuple[Opening | None, int]:
    """The first complete bare or list head in s[start:] (the grammar commits at the first), and how
    far the text is certainly content: up to the first place where a head may still be completing
    (a search resumes there: a place found to hold no head never will). `body`: where the reply starts."""
    hold = len(s)
    i = start
    while True:
        a, b = s.find("{", i), s.find("[", i)
        at = min(x for x in (a, b, len(s)) if x >= 0)
        if at >= len(s):
            return None, hold
        listed = s[at] == "["
        end, name = head(s, at, names, listed)
        if end > 0 and (listed or not _after_bracket(s, body, at)):
            return Opening(at, end, name, listed), at
        if end == PARTIAL and hold == len(s):
            hold = at
        i = at + 1


def _after_bracket(s: str, start: int, at: int) -> bool:
    """Whether the text before `at` ends with "[" and whitespace (then the list head is the one)."""
    j = at
    while j > start and s[j - 1] in _SPACE:
        j -= 1
    return j > start and s[j - 1] == "["


class BareReader:
    """Reads the calls after a bare (or list) head, chunk by chunk: each call's key, its arguments
    (the caller's JSON scanner), its closing brace, then a separator and the next head, or the list's
    end. The grammar guarantees the shape; the reader only finds the places."""

    def __init__(self, opening: Opening, names: frozenset[str]) -> None:
        self.names, self.listed = names, opening.listed
        self.name, self.pos = opening.name, opening.end
        self.state = "key"  # key | args | end | next | done
        self.args_at = -1

    def step(self, s: str, final: bool) -> tuple[str, int] | None:
        """Advance over s (the whole text so far). Returns (state reached, index) at each point the
        caller acts on: ("args", where the arguments start) once the key is read, ("next", ...) after
        a call's closing brace; None when more text is needed (or all is read: state "done")."""
        if self.state == "key":
            j = _parts(s, self.pos, _KEY)
            if j == PARTIAL or (j > 0 and j == len(s) and not final):
                return None  # more whitespace may come before the arguments
            if j == NO or j >= len(s):
                self.state = "done"
                return None
            self.state, self.args_at = "args", j
            return "args", j
        if self.state == "end":
            j = _parts(s, self.pos, (None, "}"))
            if j <= 0:
                if j == NO:
                    self.state = "done"
                return None
            self.state, self.pos = "next", j
            return "next", j
        if self.state == "next":
            return self._next(s, final)
        return None

    def closed(self, end: int) -> None:
        """The caller's scanner found the arguments' end."""
        self.state, self.pos = "end", end

    def _next(self, s: str, final: bool) -> tuple[str, int] | None:
        i = _ws(s, self.pos)
        if i < len(s) and s[i] in ",;" and not (self.listed and s[i] == ";"):
            i = _ws(s, i + 1)
        elif self.listed and i < len(s) and s[i] == "]":
            self.state = "done"
            return None
        if i >= len(s):
            if final:
                self.state = "done"
            return None
        end, name = head(s, i, self.names)
        if end == PARTIAL and not final:
            return None
        if end <= 0:
            self.state = "done"
            return None
        self.name, self.pos, self.state = name, end, "key"
        return self.step(s, final)
