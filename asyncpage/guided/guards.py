"""JSON runaway guards for budget closing: a digit run past `max_number_digits` in a number is
refused (the number ends), and a string whose tail repeats the same 1-8 token n-gram more than
`max_string_repeats` times is closed. Both are off when the schema asks for long values. The
lexical position they need (inside a string? the trailing digit run?) is kept per sequence by the
closer (asyncpage.guided.budget) through `lex`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Protocol

# Exponent digits the digit guard allows: `e99` is the most every reader of a double takes (msgspec
# refuses `8.76e30264` as out of range; the digit run restarts at `e`, so max_digits alone allows it).
EXPONENT_DIGITS = 2


@dataclass
class Guards:
    """JSON runaway guards for one request (0 = off)."""

    max_digits: int = 0
    max_repeats: int = 0


class LexState(Protocol):
    in_string: bool
    escape: bool
    digit_run: int
    exponent: bool
    string_tokens: list[int]


def lex(state: LexState, data: bytes) -> None:
    """Advance the JSON lexical state (inside a string? trailing digit run outside strings? in a
    number's exponent?)."""
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
            state.exponent = False
        elif 48 <= b <= 57:
            state.digit_run += 1
        elif b in b"eE" or (b in b"+-" and state.exponent):
            state.digit_run = 0
            state.exponent = True  # an `e` of true/false is followed by no digit: harmless
        else:
            state.digit_run = 0
            state.exponent = False


def refusal(guards: Guards | None, state: LexState, token: int, data: bytes) -> str | None:
    """Which guard refuses `token` (its bytes: `data`) in `state` ("digits" / "repeat"), if any."""
    g, s = guards, state
    if g is None:
        return None
    if g.max_digits and not s.in_string:
        run, exp = s.digit_run, s.exponent
        for b in data:
            if 48 <= b <= 57:
                run += 1
                if run > (min(g.max_digits, EXPONENT_DIGITS) if exp else g.max_digits):
                    return "digits"
            elif b in b"eE" or (exp and b in b"+-"):
                run, exp = 0, True  # `5e+123` may come in one token
            else:
                break
    if g.max_repeats and s.in_string and data and 0x22 not in data:
        tail = [*s.string_tokens[-8 * (g.max_repeats + 1):], token]
        if repeats(tail) > g.max_repeats:
            return "repeat"
    return None


def repeats(tokens: list[int], max_unit: int = 8) -> int:
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
    """The longest digit run of `v` written out in full: a bound of 1e17 needs 18 digits, 1e-17 a
    fraction of 17 (repr would say `1e+17`, runs of 1 and 2)."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return 0
    text = str(abs(v)) if isinstance(v, int) else format(Decimal(repr(abs(v))), "f")
    return max((len(run) for run in text.split(".")), default=0)
