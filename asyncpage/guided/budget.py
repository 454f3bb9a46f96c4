"""Budget-aware closing of guided output, and runaway guards (`SamplingParams(budget_close=True)`).

The decoder keeps, for every budget-closing sequence, one concrete valid completion from its current
grammar state (`CloseState.path`: the bytes that would finish the value, and their token count). It
is worked out from the grammar itself through llguidance's matcher, never from JSON rules: forced
bytes, byte-by-byte probes (`validate_tokens`), `deep_copy` and `rollback`, and a bounded
breadth-first search over bytes. So it holds for every grammar that compiles (JSON schemas, Lark,
regex), and it is an upper bound: whatever it finds is checked by the matcher, so it always closes.

After each sampled token the completion is repaired incrementally (the model usually keeps to it, or
to one of its suffixes); only when the model opens something new is a small search run, whose goal is
"accepting, or back on a suffix of the previous completion". The sampled token is kept when
1 + forced tokens + the new completion's length still fits the remaining budget (minus a small
margin for tokenization differences); otherwise the best allowed alternatives by logit are tried, and
last the first token of the known completion, which always fits. So once the budget gets down to the
shortest completion, the output walks to a valid end instead of being cut.

Runaway guards (JSON only, where the schema permits): a digit run past `max_number_digits` in a number
is refused (the number ends), and a string whose tail repeats the same 1-8 token n-gram more than
`max_string_repeats` times is closed. Both are off when the schema asks for long values.

Cost: the repair is a few microseconds; a search is ~0.1 ms per node, bounded by MAX_NODES. Only the
worker thread touches a CloseState (as it does the matcher it belongs to).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

# Tokens kept in reserve: the token count of a completion is the count of one tokenization of its bytes;
# forced tokens and the model's own tokens may split the same bytes differently.
MARGIN = 2
MAX_NODES = 80  # expanded states per repair search
RETRY_EVERY = 16  # tokens between two searches from states where one failed
ROOT_NODES = 1500  # the grammar's start state: searched once per compiled grammar
# Sequences further than this from their budget are only repaired, never searched: a search there
# would only bound a completion that has plenty of room. Checked again when they come closer.
FAR = 96
REPEAT_PENALTY = 1  # search priority cost of coming back to a fingerprint already met
GOALS = 24  # suffixes of the previous completion tried as search goals
ALTERNATIVES = 8  # model's best allowed tokens tried when its sampled token does not fit


def _byte_class(b: int) -> int:
    """Bytes in one class lead to grammar states alike often enough that one representative is
    explored (a search heuristic only: what it finds is still checked by the matcher)."""
    if 97 <= b <= 122:
        return 1
    if 65 <= b <= 90:
        return 2
    if 48 <= b <= 57:
        return 3
    if b >= 0xC0:
        return 4
    if b >= 0x80:
        return 5
    return 100 + b


# Punctuation first, from the top of ASCII down: closing brackets sort above their openers (`}` over
# `{`, `]` over `[`, `)` over `(`, `>` over `<`), so among equally short paths the closing one is tried
# first (a tie-break, not a rule: every path is still checked by the matcher).
_ORDER = sorted(range(256), key=lambda b: (_byte_class(b) < 100, -b))


class Planner:
    """Per tokenizer (one per llguidance backend): the single-byte token of every byte, token bytes,
    and the searches. Stateless apart from caches; safe to share between sequences."""

    def __init__(self, lltok: Any) -> None:
        self.tok = lltok
        self.byte_token: list[int] = []
        for b in range(256):
            ids = lltok.tokenize_bytes(bytes([b]))
            self.byte_token.append(ids[0] if len(ids) == 1 else -1)
        self.usable = all(t >= 0 for t in self.byte_token)
        self._bytes: dict[int, bytes] = {}
        self.quote = lltok.tokenize_bytes(b'"')

    def token_bytes(self, t: int) -> bytes:
        b = self._bytes.get(t)
        if b is None:
            b = self._bytes[t] = bytes(self.tok.decode_bytes([t]))
        return b

    def _bt(self, data: bytes) -> list[int]:
        return [self.byte_token[b] for b in data]

    def completes(self, m: Any, data: bytes) -> bool:
        """Does `data` take matcher `m` to an accepting state? (m is unchanged.)"""
        toks = self._bt(data)
        if m.validate_tokens(toks) < len(toks):
            return False
        if not m.consume_tokens(toks):
            return False  # pragma: no cover - validated just above
        ok = bool(m.is_accepting())
        m.rollback(len(toks))
        return ok

    def tokens_for(self, m: Any, path: bytes) -> list[int]:
        """A short tokenization of `path` that `m` accepts to the end (else the byte tokens)."""
        if not path:
            return []
        ids = list(self.tok.tokenize_bytes(path))
        if len(ids) < len(path):
            n = m.try_consume_tokens(ids)
            ok = n == len(ids) and m.is_accepting()
            m.rollback(n)
            if ok:
                return ids
        return self._bt(path)

    def allowed_bytes(self, m: Any) -> list[int]:
        return [b for b in _ORDER if m.validate_tokens([self.byte_token[b]]) == 1]

    def signature(self, m: Any) -> tuple[Any, ...]:
        """A cheap fingerprint of a state: accepting, forced bytes, and which of a few probe bytes it
        allows (equal fingerprints merge in the search; a wrong merge only costs optimality)."""
        bits = 0
        for i, b in enumerate(_PROBES):
            if m.validate_tokens([self.byte_token[b]]) == 1:
                bits |= 1 << i
        return (bool(m.is_accepting()), bytes(m.compute_ff_bytes()), bits)

    def search(self, m: Any, goals: Iterable[bytes] = (), max_nodes: int = MAX_NODES) -> bytes | None:
        """The shortest byte path found (breadth first) from m's state to an accepting state, or to a
        state from which one of `goals` completes. A node is dropped when a node with the same
        fingerprint, after the same last two runs of forced bytes, met as often since them, was seen:
        a free string's letters are one node, `0,` and `-0,` merge once the next key is forced, while
        counted repeats (minLength, minItems) still advance. m is unchanged."""
        goal_list = [g for g in sorted(set(goals), key=len)[:GOALS] if g]
        # A node: (priority, tie, path, penalty, the last two runs of forced bytes on the path,
        # fingerprints met since the last of them).
        # Priority is the path length plus a penalty for each revisit of a fingerprint, so counted
        # repeats are explored only after everything that makes progress.
        heap: list[tuple[int, int, bytes, int, tuple[bytes, bytes], tuple[Any, ...]]] = [
            (0, 0, b"", 0, (b"", b""), ())]
        seen: set[tuple[Any, ...]] = set()
        nodes = tie = 0
        best: bytes | None = None
        while heap and nodes < max_nodes:
            prio, _, path, pen, last_forced, since = heapq.heappop(heap)
            if best is not None and prio >= len(best):
                break
            toks = self._bt(path)
            if not m.consume_tokens(toks):  # pragma: no cover - every node was probed
                m.rollback(len(toks))
                continue
            try:
                if m.is_accepting():
                    return path
                sig = self.signature(m)
                if not sig[1]:
                    count = since.count(sig)
                    key = (sig, last_forced, count)
                    if key in seen:
                        continue  # checked before the goals: most nodes end here, cheaply
                    seen.add(key)
                for g in goal_list:
                    i = _PROBE_INDEX.get(g[0], -1)
                    if i >= 0 and not (sig[2] >> i) & 1:
                        continue  # its first byte is not allowed here
                    if (best is None or len(path) + len(g) < len(best)) and self.completes(m, g):
                        best = path + g
                        break
                if best is not None:
                    continue
                if sig[1]:
                    recent = (last_forced[-1], sig[1])  # the last two forced runs
                    tie += 1  # forced bytes: the only way on
                    heapq.heappush(heap, (prio + len(sig[1]), tie, path + sig[1], pen, recent, ()))
                    continue
                nodes += 1
                allowed = self.allowed_bytes(m)
            finally:
                m.rollback(len(toks))
            pen += REPEAT_PENALTY if count else 0
            taken: set[int] = set()
            for b in allowed:
                c = _byte_class(b)
                if c < 100 and c in taken:
                    continue
                taken.add(c)
                tie += 1
                heapq.heappush(heap, (len(path) + 1 + pen, tie, path + bytes([b]), pen, last_forced, (*since, sig)))
        if best is None:
            best = self._walk(m)
        return best

    def _walk(self, m: Any, max_steps: int = 256) -> bytes | None:
        """Fallback when the search runs out of nodes: a greedy walk that prefers, among a few allowed
        bytes, one leading to a state not met before on the walk (progress), else the first."""
        path = b""
        sigs: set[tuple[Any, ...]] = set()
        consumed = 0
        try:
            for _ in range(max_steps):
                if m.is_accepting():
                    return path
                sig = self.signature(m)
                if sig[1]:
                    m.consume_tokens(self._bt(sig[1]))
                    consumed += len(sig[1])
                    path += sig[1]
                    continue
                sigs.add(sig)
                allowed = self.allowed_bytes(m)
                if not allowed:
                    return None
                pick = allowed[0]
                taken: set[int] = set()
                for b in allowed:
                    c = _byte_class(b)
                    if c in taken or len(taken) >= 12:
                        continue
                    taken.add(c)
                    m.consume_token(self.byte_token[b])
                    novel = m.is_accepting() or self.signature(m) not in sigs
                    m.rollback(1)
                    if novel:
                        pick = b
                        break
                m.consume_token(self.byte_token[pick])
                consumed += 1
                path += bytes([pick])
            return None
        finally:
            m.rollback(consumed)


_PROBES = bytes(sorted({*range(0x20, 0x30), *range(0x3A, 0x41), *range(0x5B, 0x61), *range(0x7B, 0x7F)}
                       | set(b"aezAEZ019")))
_PROBE_INDEX = {b: i for i, b in enumerate(_PROBES)}


@dataclass
class Guards:
    """JSON runaway guards for one request (0 = off)."""

    max_digits: int = 0
    max_repeats: int = 0


@dataclass
class CloseState:
    """Per sequence: a valid completion from the current matcher state (None: unknown or stale),
    the JSON lexical position for the guards, and whether the budget ever replaced a token."""

    path: bytes | None = None
    tokens: list[int] | None = None
    known_at: int = 0  # the completion length when last known (to tell when a stale one gets close)
    anchor: bytes = b""  # the last known completion (its suffixes guide searches once it is stale)
    retry_below: int = 1 << 62  # after a failed search: no other until the budget is below this
    forced: bool = False
    guards: Guards | None = None
    in_string: bool = False
    escape: bool = False
    digit_run: int = 0
    string_tokens: list[int] = field(default_factory=list)

    def copy(self) -> CloseState:
        return CloseState(self.path, None if self.tokens is None else list(self.tokens), self.known_at, self.anchor,
                          self.retry_below, self.forced, self.guards, self.in_string, self.escape, self.digit_run,
                          list(self.string_tokens))

    @property
    def length(self) -> float:
        return len(self.tokens) if self.tokens is not None else math.inf


def _lex(state: CloseState, data: bytes) -> None:
    """Advance the JSON lexical state (inside a string? trailing digit run outside strings?)."""
    for b in data:
        if state.in_string:
            if state.escape:
                state.escape = False
            elif b == 0x5C:
                state.escape = True
            elif b == 0x22:
                state.in_string = False
                state.string_tokens.clear()
        elif b == 0x22:
            state.in_string = True
            state.digit_run = 0
        elif 48 <= b <= 57:
            state.digit_run += 1
        else:
            state.digit_run = 0


def _repeats(tokens: list[int], max_unit: int = 8) -> int:
    """How many times the tail of `tokens` repeats one n-gram (n <= max_unit), at most."""
    best = 1
    n = len(tokens)
    for p in range(1, max_unit + 1):
        if 2 * p > n:
            break
        k = 1
        while (k + 1) * p <= n and tokens[n - (k + 1) * p : n - k * p] == tokens[n - p :]:
            k += 1
        best = max(best, k)
    return best


def guards_for(schema: Any, max_digits: int, max_repeats: int) -> Guards:
    """Turn each guard off where the schema asks for long values: numbers whose bounds or listed
    values need more digits than the limit; strings with minLength or maxLength past 64 characters."""
    long_numbers = long_strings = False

    def walk(s: Any) -> None:
        nonlocal long_numbers, long_strings
        if isinstance(s, dict):
            for k, v in s.items():
                if k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "const", "multipleOf"):
                    long_numbers |= _digits(v) >= max_digits
                elif k == "enum" and isinstance(v, list):
                    long_numbers |= any(_digits(x) >= max_digits for x in v)
                elif k in ("minLength", "maxLength") and isinstance(v, int) and not isinstance(v, bool):
                    long_strings |= v > 64
                walk(v)
        elif isinstance(s, list):
            for x in s:
                walk(x)

    walk(schema)
    return Guards(0 if long_numbers else max_digits, 0 if long_strings else max_repeats)


def _digits(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return 0
    text = repr(abs(v))
    return max((len(run) for run in text.replace("e", " ").replace(".", " ").replace("-", " ").split()), default=0)


class Closer:
    """One sequence's step: keep the sampled token when it fits, else the best token that does."""

    def __init__(self, planner: Planner, matcher: Any, state: CloseState) -> None:
        self.p = planner
        self.m = matcher  # the raw llguidance matcher of the sequence
        self.s = state

    def _near(self, budget: int) -> bool:
        return budget - self.s.known_at <= FAR

    def _search(self, budget: int, goals: list[bytes]) -> bytes | None:
        """A bounded search, not repeated every step where one just failed (a state the search cannot
        close costs one search per RETRY_EVERY tokens, not one per token)."""
        s = self.s
        if budget > s.retry_below:
            return None
        path = self.p.search(self.m, goals)
        s.retry_below = budget if path is not None else budget - RETRY_EVERY
        return path

    def _refresh(self, prev: bytes | None, consumed: bytes, budget: int) -> None:
        """After `consumed` joined the matcher: a completion from the new state, from the previous
        one when the model kept to it (or to a suffix of it), else by a search if the budget is near
        (far from it, the completion is left stale and searched for once it gets near)."""
        m, p = self.m, self.p
        path: bytes | None = None
        if prev is not None and prev.startswith(consumed):
            path = prev[len(consumed):]
        else:
            # A stale completion (skipped while far) still lends its closing tail: `"}]}` outlives it.
            base = prev if prev is not None else self.s.anchor
            for i in range(len(base) + 1):
                if p.completes(m, base[i:]):
                    path = base[i:]
                    break
            if path is None and self._near(budget):
                path = self._search(budget, [base[i:] for i in range(len(base))])
        self._set(path)

    def _set(self, path: bytes | None) -> None:
        s = self.s
        s.path = path
        s.tokens = None if path is None else self.p.tokens_for(self.m, path)
        if path is not None and s.tokens is not None:
            s.known_at = len(s.tokens)
            s.anchor = path

    def _guard(self, token: int, data: bytes) -> str | None:
        """Which guard refuses `token` here ("digits" / "repeat"), if any."""
        g, s = self.s.guards, self.s
        if g is None:
            return None
        if g.max_digits and not s.in_string:
            run = s.digit_run
            for b in data:
                if not 48 <= b <= 57:
                    break
                run += 1
                if run > g.max_digits:
                    return "digits"
        if g.max_repeats and s.in_string and data and 0x22 not in data:
            tail = [*s.string_tokens[-8 * (g.max_repeats + 1):], token]
            if _repeats(tail) > g.max_repeats:
                return "repeat"
        return None

    def _try(self, token: int, budget: int, fast_forward: bool, check: bool) -> tuple[str | None, list[int], bool]:
        """Consume `token` (+ the tokens the grammar then forces) when it fits: returns (None, forced
        tokens, the grammar ended). Else the matcher and the state are as before and the first item
        says why: "invalid" (the grammar refuses it), "budget", or a guard's name."""
        m, s, p = self.m, self.s, self.p
        if m.validate_tokens([token]) != 1:
            return "invalid", [], False
        data = p.token_bytes(token)
        if check and (why := self._guard(token, data)) is not None:
            return why, [], False
        saved = s.copy()
        m.consume_token(token)
        ff: list[int] = []
        if fast_forward and not m.is_stopped():
            for t in m.compute_ff_tokens():
                if not m.consume_token(t):  # pragma: no cover - forced tokens are accepted
                    break
                ff.append(t)
        stopped = bool(m.is_stopped())
        consumed = data + b"".join(p.token_bytes(t) for t in ff)
        if stopped:
            s.path, s.tokens = b"", []
        else:
            self._refresh(saved.path, consumed, budget - 1 - len(ff))
        if check:
            rest = budget - 1 - len(ff)
            if s.tokens is None:
                fits = not self._near(rest)  # unknown: fine while far, refused when near
            else:
                fits = rest >= (len(s.tokens) + MARGIN if s.tokens else 0)
            if not fits:
                m.rollback(1 + len(ff))
                retry_below = s.retry_below  # a failed search stays failed for the next candidates
                s.__dict__.update(saved.__dict__)
                s.retry_below = min(s.retry_below, retry_below)
                return "budget", [], False
        for t in [token, *ff]:
            d = p.token_bytes(t)
            _lex(s, d)
            if s.in_string and 0x22 not in d:
                s.string_tokens.append(t)
        return None, ff, stopped

    def step(self, sampled: int, budget: int, fast_forward: bool,
             alternatives: Callable[[], list[int]]) -> tuple[int, list[int], bool] | None:
        """Consume the token this sequence emits now; None when the grammar refuses `sampled` (the
        request then fails, as without budget closing). Returns (token, forced tokens, grammar
        ended). `budget`: the tokens this sequence may still emit, this one included."""
        s = self.s
        if s.path is None and self._near(budget):
            self._set(self._search(budget, [s.anchor[i:] for i in range(len(s.anchor))]))
        why, ff, stopped = self._try(sampled, budget, fast_forward, check=True)
        if why is None:
            return sampled, ff, stopped
        if why == "invalid":
            return None
        fallback = list(s.tokens[:1]) if s.tokens else []
        options: list[int] = []
        if why == "repeat":
            fallback = self.p.quote[:1] + fallback  # end the string, where the grammar allows it
        else:
            options = [c for c in alternatives() if c != sampled]
        tries = [(c, True) for c in options] + [(c, False) for c in fallback]
        for c, check in tries:
            r = self._try(c, budget, fast_forward, check=check)
            if r[0] is None:
                if why == "budget":
                    s.forced = True  # a guard's replacement is a policy, not the budget closing
                return c, r[1], r[2]
        # Nothing fits (the budget was below the shortest completion from the start): the model's own.
        r = self._try(sampled, budget, fast_forward, check=False)
        return sampled, r[1], r[2]
