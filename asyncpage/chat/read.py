"""A turn as read after each chunk, and the caller's stop strings applied to what was read.

_Read holds spans into the parser's text (no text of its own: a string kept alive between chunks
could not grow in place, see parse.StreamParser.feed); _StopCut cuts reasoning and content at the
caller's stop strings where this layer applies them (api._prepare_steps), searching only what each
chunk added.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncpage.chat.parse import StreamParser, held


@dataclass
class _Read:
    """The turn as read after a chunk: spans into the parser's text (cut at a stop string when one
    was met), the number of complete calls, whether a call has begun. It holds no text: a string
    kept alive between chunks could not grow in place (see StreamParser.feed)."""

    parser: StreamParser
    reasoning: tuple[int, int]
    content: tuple[int, int]
    n_calls: int
    has_calls: bool

    @classmethod
    def of(cls, p: StreamParser) -> _Read:
        return cls(p, p.reasoning, p.content, len(p.calls), p.has_calls)

    def field(self, name: str) -> str:
        a, b = getattr(self, name)
        return self.parser.text[a:b]


class _StopCut:
    """The caller's stop strings, applied to reasoning and content where this layer applies them
    (see _prepare_steps). Each chunk searches only what is new (plus a stop's length of overlap)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.longest = max(len(x) for x in stops)
        self.searched: dict[str, int] = {}

    def apply(self, r: _Read, final: bool) -> bool:
        """Cut `r` at the first stop string in its reasoning or content (dropping all after it) and
        say whether one was met; before the end, hold back a tail that could still grow into one."""
        s = r.parser.text
        for name in ("reasoning", "content"):
            a, b = getattr(r, name)
            # Searched before up to `done`: a stop found now ends past it (spans only grow at their end).
            done = self.searched.get(name)
            lo = a if done is None else max(a, done - self.longest + 1)
            self.searched[name] = b if done is None else max(b, done)
            hits = [i for i in (s.find(x, lo, b) for x in self.stops) if i >= 0]
            if hits:
                setattr(r, name, (a, min(hits)))
                if name == "reasoning":
                    r.content = (r.content[0], r.content[0])
                r.n_calls, r.has_calls = 0, False
                return True
        if not final and not r.has_calls:
            # Only the part still growing is held: content once it began, else the reasoning.
            name = "content" if r.content[1] > r.content[0] else "reasoning"
            a, b = getattr(r, name)
            tail = s[max(a, b - self.longest):b]
            setattr(r, name, (a, b - max(held(tail, x) for x in self.stops)))
        return False
