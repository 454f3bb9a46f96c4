"""Reading a turn back: reasoning, content and tool calls, from the text the grammar shaped.

The parser knows the exact format the grammar imposed (formats.py), so it reads fields at fixed
places rather than guessing with per-model regexes. It is prefix-stable: before the end it holds
back whatever a later token could still turn into a marker, so what it has returned never changes.

StreamParser reads a stream chunk by chunk and keeps its place (the phase it is in, where each
search stopped, the JSON scanner's depth and string state), so each chunk costs work in
proportion to its own text: re-reading the whole text after every chunk, on the event loop, was
quadratic in a long turn. It keeps the text once and says where each field lies in it (spans), so
a streaming caller slices only what is new. parse() is one StreamParser fed the whole text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from asyncpage.chat import spellings
from asyncpage.chat.formats import ToolFormat
from asyncpage.chat.reasoning import THINK, ReasoningMarkers

THINK_OPEN, THINK_CLOSE = THINK.open, THINK.close

_SPACES = re.compile(r"\s*")  # what str.lstrip() strips (the same Unicode whitespace)
_NEWLINES = re.compile(r"\n*")
_OUTSIDE_STRING = re.compile(r'["{}\[\]]')
_INSIDE_STRING = re.compile(r'["\\]')
_SCALAR_END = re.compile(r"[,}\] \n]")


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text so far
    complete: bool


@dataclass
class Parsed:
    reasoning: str = ""
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


def _past(run: re.Pattern[str], s: str, pos: int) -> int:
    """Index just past the run of `run` (which matches the empty string too) at `pos`."""
    m = run.match(s, pos)
    return pos if m is None else m.end()


def held(text: str, marker: str) -> int:
    """Length of the longest proper suffix of `text` that starts `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class _JsonScan:
    """Where the JSON value starting at `start` ends, found across calls as the text grows."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.pos = start
        self.depth = 0
        self.in_str = False
        self.esc = False  # the last character read was a backslash inside a string
        self.scalar: bool | None = None  # undecided until the first character is there

    def end(self, s: str) -> tuple[int | None, int]:
        """(index just past the value or None if not complete yet, characters looked at now)."""
        n, p0 = len(s), self.pos
        if self.scalar is None:
            if self.start >= n:
                return None, 0
            self.scalar = s[self.start] not in "{[\""
        if self.scalar:
            # A scalar ends where the call's closing brace starts (more digits could still come).
            m = _SCALAR_END.search(s, self.pos)
            self.pos = n if m is None else m.start()
            return (None if m is None else m.start()), self.pos - p0
        p = self.pos
        if self.esc:
            if p >= n:
                return None, 0
            p, self.esc = p + 1, False
        while True:
            m = (_INSIDE_STRING if self.in_str else _OUTSIDE_STRING).search(s, p)
            if m is None:
                p = n
                break
            k = m.start()
            c, p = s[k], k + 1
            if self.in_str:
                if c == "\\":
                    if p >= n:
                        self.esc = True
                        break
                    p += 1
                    continue
                self.in_str = False
                if self.depth == 0:
                    self.pos = p
                    return p, p - p0
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    self.pos = p
                    return p, p - p0
        self.pos = p
        return None, p - p0


def json_end(s: str, i: int) -> int | None:
    """Index just past the JSON value starting at s[i], or None if it is not complete yet."""
    return _JsonScan(i).end(s)[0]


@dataclass
class _Call:
    name: str
    args_at: int  # where its arguments start; -1 before the key is complete
    arguments: str | None = None  # set once complete


class StreamParser:
    """The incremental parser of one turn. feed() each piece of text as it comes (`final` on the
    last); then `reasoning`, `content` (spans into `text`), `calls` (the complete ones, in order)
    and `has_calls` (a call has started, complete or not) describe what parse() would return for
    the text so far. `scanned` counts the characters its searches and scanners looked at.
    `markers`: the reasoning section's (default <think>/</think>); `names`: the declared tools, when the
    grammar also opens calls on their bare spellings (spellings.py, tool_choice="auto" without a
    response_format)."""

    def __init__(self, fmt: ToolFormat, *, calls_allowed: bool, reasoning: bool, in_reasoning: bool,
                 forced: bool = False, markers: ReasoningMarkers | None = None,
                 names: frozenset[str] | None = None) -> None:
        self.fmt, self.calls_allowed, self.forced = fmt, calls_allowed, forced
        m = markers or THINK
        self._open, self._close = m.open, m.close
        self.names = names if names and calls_allowed and not forced else None
        self._bare: spellings.BareReader | None = None
        self._bare_from = 0  # where the search for a bare head resumes
        self.text = ""
        self.final = False
        self.scanned = 0
        self.reasoning = (0, 0)
        self.content = (0, 0)
        self.calls: list[ParsedCall] = []
        self._pending: _Call | None = None  # the call being read (not complete yet)
        # phases: "lead" (a reasoning block may still open), "reasoning", "gap" (newlines after it),
        # "body" (content may still come), "calls", "done" (nothing more can be read)
        self._phase = "reasoning" if in_reasoning else "lead" if reasoning else "body"
        self._lead_from = 0  # where the whitespace before a possible <think> resumes
        self._r_open = 0  # the reasoning's first character (after <think>)
        self._nl_from = 0  # where the newlines opening the reasoning resume
        self._r_lead: int | None = None  # its first character that is not a newline
        self._r_end = 0  # just past its last character that is not a newline (so far)
        self._r_scanned = 0  # how far the reasoning was read for newlines
        self._close_from = 0  # where the search for </think> resumes
        self._body = 0  # where the body (after reasoning) starts
        self._head_from = 0  # where the search for the format's head resumes
        self._name_from = 0  # start of the call name being read
        self._quote_from = 0
        self._name_end = 0  # its closing quote
        self._json: _JsonScan | None = None
        self._after = 0  # just past the last complete call's arguments
        self._next_head = fmt.sep + '{"name": "'
        self._key = '", "' + fmt.key + '": '

    @property
    def thinking(self) -> bool:
        """Whether the text so far may still be (or open) the reasoning section."""
        return self._phase in ("lead", "reasoning")

    @property
    def has_calls(self) -> bool:
        return bool(self.calls) or self._pending is not None or self._bare is not None

    def feed(self, piece: str, final: bool = False) -> StreamParser:
        if self.final:
            raise RuntimeError("this turn's text has ended")
        # The text lives in a local while it grows: CPython then extends it in place, where
        # `self.text += piece` would copy it whole on every chunk.
        text = self.text
        self.text = ""
        text += piece
        self.text = text
        self.final = final
        self._advance()
        return self

    def parsed(self) -> Parsed:
        """What was read so far, as strings (this copies the fields: once at the end, not per chunk)."""
        s = self.text
        calls = list(self.calls)
        if self._pending is not None:
            p = self._pending
            calls.append(ParsedCall(p.name, "" if p.args_at < 0 else s[p.args_at:], False))
        return Parsed(s[self.reasoning[0]:self.reasoning[1]], s[self.content[0]:self.content[1]], calls)

    # ---- the phases, each resuming where it stopped -----------------------------------------------
    def _advance(self) -> None:
        s = self.text
        if self._phase == "lead":
            lead = self._lead_from = _past(_SPACES, s, self._lead_from)
            rest = s[lead:lead + len(self._open)]
            if rest == self._open:
                self._phase, self._r_open = "reasoning", lead + len(self._open)
                self._r_scanned = self._close_from = self._nl_from = self._r_end = self._r_open
            elif not self.final and self._open.startswith(rest):
                return  # maybe the start of a reasoning block (whitespace included: it may precede one)
            else:
                self._phase = "body"
        if self._phase == "reasoning":
            self._read_reasoning(s)
        if self._phase == "gap":
            at = self._body = _past(_NEWLINES, s, self._body)
            if at == len(s):
                return  # only newlines after </think> so far: the body has not started
            self._head_from = at
            self._phase = "body"
        if self._phase == "body":
            self._read_body(s)
        elif self._phase == "free":
            self.content = (self._body, len(s))
        if self._phase == "between":
            self._resume_between(s)
        if self._phase == "calls":
            self._read_calls(s)
        elif self._phase == "bare":
            self._read_bare(s)

    def _read_reasoning(self, s: str) -> None:
        if self._r_lead is None:
            at = self._nl_from = _past(_NEWLINES, s, self._nl_from)
            if at < len(s):
                self._r_lead = at
        close = self._close
        end = s.find(close, max(self._r_open, self._close_from - len(close) + 1))
        self.scanned += len(s) - self._close_from + len(close)
        self._close_from = len(s)
        if end < 0:
            cut = len(s) if self.final else len(s) - held(s[-len(close):], close)
            # Trailing newlines wait: if the block closes next, they are not part of the reasoning.
            self._newlines_to(s, cut)
            stop = cut if self.final else self._r_end
        else:
            self._newlines_to(s, end)
            stop = self._r_end
            self._phase, self._body = "gap", end + len(close)
        if self._r_lead is None:  # only newlines so far: no reasoning yet
            self.reasoning = (self._r_open, self._r_open)
        else:
            self.reasoning = (self._r_lead, max(self._r_lead, stop))

    def _newlines_to(self, s: str, cut: int) -> None:
        """Move the reasoning's end past its last character that is not a newline, before `cut`."""
        if cut > self._r_scanned:
            kept = s[self._r_scanned:cut].rstrip("\n")
            if kept:
                self._r_end = self._r_scanned + len(kept)
            self.scanned += cut - self._r_scanned
            self._r_scanned = cut

    def _read_body(self, s: str) -> None:
        b, fmt = self._body, self.fmt
        if not self.calls_allowed:
            self.content = (b, len(s))
            return
        if self.names is not None:
            self._read_body_spelled(s, self.names)
            return
        head = fmt.head
        if self.forced or fmt.at_start:
            # The head can only open the body: decided once the body is as long as the head.
            if s.startswith(head, b):
                self._start_calls(b + len(head))
            elif len(s) - b < len(head) and head.startswith(s[b:]):
                pass  # undecided yet, or at the end a call cut before its name: markup, not content
            elif self.forced:
                self._phase = "done"  # every character is forced markup: not a call, no content either
            else:
                self.content = (b, len(s))
                self._phase = "free"
            return
        at = s.find(head, max(b, self._head_from - len(head) + 1))
        self.scanned += len(s) - self._head_from + len(head)
        self._head_from = len(s)
        if at >= 0:
            self.content = (b, at)
            self._start_calls(at + len(head))
            return
        if not self.final:
            self.content = (b, len(s) - held(s[max(b, len(s) - len(head)):], head))
            return
        # Under the grammar the trigger always opens a call: after it, a call cut before its name.
        cut = s.find(fmt.trigger, b) if fmt.trigger else -1  # once, at the end
        self.content = (b, len(s) if cut < 0 else cut)

    def _read_body_spelled(self, s: str, names: frozenset[str]) -> None:
        """The body where a call may also open in a bare spelling: the first complete head of any
        spelling opens the calls (the grammar commits there); content is held back from the first
        place a head may still be completing."""
        b, fmt, head = self._body, self.fmt, self.fmt.head
        at, hold = -1, len(s)  # the family's own head (complete), where content must stop for now
        if fmt.at_start:
            # A JSON format's own turn opens the reply; Llama 3's is a bare call itself (read below).
            if fmt.begin and s.startswith(head, b):
                at = b
            elif fmt.begin and head.startswith(s[b:]) and (not self.final or len(s) - b >= len(fmt.begin)):
                hold = b  # undecided yet, or at the end a turn of calls cut before a name: markup
        else:
            at = s.find(head, max(b, self._head_from - len(head) + 1))
            self.scanned += len(s) - self._head_from + len(head)
            self._head_from = len(s)
            if at < 0 and not self.final:
                hold = len(s) - held(s[max(b, len(s) - len(head)):], head)
            elif at < 0 and fmt.trigger and (cut := s.find(fmt.trigger, b)) >= 0:
                hold = cut  # under the grammar the trigger always opens a call: one cut before its name
        opening, bare_hold = spellings.find(s, max(b, self._bare_from), b, names)
        self.scanned += len(s) - max(b, self._bare_from)
        self._bare_from = bare_hold
        if at >= 0 and (opening is None or at <= opening.at):
            self.content = (b, at)
            self._start_calls(at + len(head))
            return
        if opening is not None:
            self.content = (b, opening.at)
            self._bare = spellings.BareReader(opening, names)
            self._pending, self._phase = _Call(opening.name, -1), "bare"
            self._read_bare(s)
            return
        if self.final and bare_hold < len(s) and '"name"' not in s[bare_hold:]:
            bare_hold = len(s)  # only a brace or two at the end: text, not a call cut before its name
        self.content = (b, min(hold, bare_hold))

    def _read_bare(self, s: str) -> None:
        r = self._bare
        assert r is not None
        while True:
            if r.state == "args":
                assert self._json is not None
                end, looked = self._json.end(s)
                self.scanned += looked
                if end is None:
                    return
                self.calls.append(ParsedCall(r.name, s[r.args_at:end], True))
                self._pending, self._json = None, None
                r.closed(end)
            out = r.step(s, self.final)
            if r.state in ("key", "args") and self._pending is None:
                self._pending = _Call(r.name, -1)
            if out is None:
                if r.state == "done":
                    self._pending, self._phase = None, "done"
                return
            kind, at = out
            if kind == "args":
                assert self._pending is not None
                self._pending.args_at = at
                self._json = _JsonScan(at)

    def _start_calls(self, name_at: int) -> None:
        self._phase = "calls"
        self._name_from = self._quote_from = name_at

    def _read_calls(self, s: str) -> None:
        while self._phase == "calls":
            if self._json is None and self._pending is None:  # reading a call's name
                q = s.find('"', self._quote_from)
                self.scanned += len(s) - self._quote_from
                if q < 0:
                    self._quote_from = len(s)
                    return  # the name is not complete yet
                self._name_end = q
                self._pending = _Call(s[self._name_from:q], -1)
            p = self._pending
            assert p is not None
            if p.args_at < 0:
                key, q = self._key, self._name_end
                rest = s[q:q + len(key)]
                if rest != key:
                    if not key.startswith(rest):
                        self._pending, self._phase = None, "done"
                    return
                p.args_at = q + len(key)
                self._json = _JsonScan(p.args_at)
            assert self._json is not None
            end, looked = self._json.end(s)
            self.scanned += looked
            if end is None:
                return
            self.calls.append(ParsedCall(p.name, s[p.args_at:end], True))
            self._pending, self._json, self._after = None, None, end
            # The next call, if any, after the closing brace and the separator.
            nxt = s[end + 1:end + 1 + len(self._next_head)]
            if nxt != self._next_head:
                if not (len(nxt) < len(self._next_head) and self._next_head.startswith(nxt)):
                    self._phase = "done"
                else:
                    self._phase = "between"
                return
            self._start_calls(end + 1 + len(self._next_head))

    def _resume_between(self, s: str) -> None:
        end = self._after
        nxt = s[end + 1:end + 1 + len(self._next_head)]
        if nxt == self._next_head:
            self._start_calls(end + 1 + len(self._next_head))
        elif not (len(nxt) < len(self._next_head) and self._next_head.startswith(nxt)):
            self._phase = "done"


def parse(text: str, fmt: ToolFormat, *, calls_allowed: bool, reasoning: bool, in_reasoning: bool,
          final: bool, forced: bool = False) -> Parsed:
    """`forced`: tool_choice "required" or a named tool, where the grammar writes nothing but calls."""
    return StreamParser(fmt, calls_allowed=calls_allowed, reasoning=reasoning, in_reasoning=in_reasoning,
                        forced=forced).feed(text, final).parsed()
