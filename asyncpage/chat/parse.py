"""Reading a turn back: reasoning, content and tool calls, from the text the grammar shaped.

The parser knows the exact format the grammar imposed (formats.py), so it reads fields at fixed
places rather than guessing with per-model regexes. It re-reads the whole text on each call (a
turn is a few thousand characters at most) and is prefix-stable: with `final=False` it holds back
whatever a later token could still turn into a marker, so what it has returned never changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncpage.chat.formats import ToolFormat

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


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


def held(text: str, marker: str) -> int:
    """Length of the longest proper suffix of `text` that starts `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def json_end(s: str, i: int) -> int | None:
    """Index just past the JSON value starting at s[i], or None if it is not complete yet."""
    if i >= len(s):
        return None
    if s[i] not in "{[\"":
        # A scalar: it ends where the call's closing brace starts (more digits could still come).
        j = i
        while j < len(s) and s[j] not in ",}] \n":
            j += 1
        return j if j < len(s) else None
    depth, in_str, esc = 0, False, False
    for j in range(i, len(s)):
        c = s[j]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
                if depth == 0:
                    return j + 1
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def parse(text: str, fmt: ToolFormat, *, calls_allowed: bool, reasoning: bool, in_reasoning: bool,
          final: bool, forced: bool = False) -> Parsed:
    """`forced`: tool_choice "required" or a named tool, where the grammar writes nothing but calls."""
    out = Parsed()
    body = text
    if in_reasoning or (reasoning and text.lstrip().startswith(THINK_OPEN)):
        start = 0 if in_reasoning else text.index(THINK_OPEN) + len(THINK_OPEN)
        end = text.find(THINK_CLOSE, start)
        if end < 0:
            cut = len(text) if final else len(text) - held(text, THINK_CLOSE)
            # Trailing newlines wait: if the block closes next, they are not part of the reasoning.
            out.reasoning = text[start:cut].lstrip("\n") if final else text[start:cut].strip("\n")
            return out
        out.reasoning = text[start:end].strip("\n")
        body = text[end + len(THINK_CLOSE):].lstrip("\n")
    elif reasoning and not final and THINK_OPEN.startswith(text.lstrip()):
        return out  # maybe the start of a reasoning block (whitespace included: it may precede one)
    if not calls_allowed:
        out.content = body
        return out
    head = fmt.head
    if forced and not body.startswith(head):
        return out  # every character is forced markup: a call cut before its name (by max_tokens) is no content
    if fmt.at_start:
        if not body.startswith(head):
            if body and head.startswith(body):
                return out  # undecided yet, or at the end a call cut before its name: markup, not content
            out.content = body
            return out
        at = 0
    else:
        at = body.find(head)
        if at < 0:
            if not final:
                out.content = body[: len(body) - held(body, head)]
                return out
            # Under the grammar the trigger always opens a call: after it, a call cut before its name.
            cut = body.find(fmt.trigger) if fmt.trigger else -1
            out.content = body if cut < 0 else body[:cut]
            return out
        out.content = body[:at]
    _calls(body, at + len(head), fmt, out.calls)
    return out


def _calls(body: str, j: int, fmt: ToolFormat, calls: list[ParsedCall]) -> None:
    next_head = fmt.sep + '{"name": "'
    key = '", "' + fmt.key + '": '
    while True:
        q = body.find('"', j)
        if q < 0:
            return  # the name is not complete yet
        name = body[j:q]
        rest = body[q : q + len(key)]
        if rest != key:
            if key.startswith(rest):
                calls.append(ParsedCall(name, "", False))
            return
        a = q + len(key)
        end = json_end(body, a)
        if end is None:
            calls.append(ParsedCall(name, body[a:], False))
            return
        calls.append(ParsedCall(name, body[a:end], True))
        if not body.startswith(next_head, end + 1):
            return
        j = end + 1 + len(next_head)
