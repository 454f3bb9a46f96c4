"""Budget-aware closing of guided output (`SamplingParams(budget_close=True)`): the closer that the
runner puts between sampling and the grammar, and each grammar's start completion.

The decoder keeps, for every budget-closing sequence, one concrete valid completion from its current
grammar state (`CloseState.path`: the bytes that would finish the value, and their token count). It
is worked out from the grammar itself through the matcher, never from JSON rules
(asyncpage.guided.search), so it holds for every grammar that compiles (JSON schemas, Lark, regex),
and it is an upper bound: whatever it finds is checked by the matcher, so it always closes.

A new sequence starts from its grammar's start completion (`StartPlan`), searched once per compiled
grammar on the grammar compile thread after the compile (GrammarManager). Until it is ready (or when
the search found nothing), a sequence starts without one and gets one from a small repair search once
its budget is near, as any sequence that wandered off its completion does.

After each sampled token the completion is repaired incrementally (the model usually keeps to it, or
to one of its suffixes); only when the model opens something new is a small search run, whose goal is
"accepting, or back on a suffix of the previous completion". The sampled token is kept when
1 + forced tokens + the new completion's length still fits the remaining budget (minus a small
margin for tokenization differences); otherwise the best allowed alternatives by logit are tried, and
last the first token of the known completion, which always fits. So once the budget gets down to the
shortest completion, the output walks to a valid end instead of being cut. The runaway guards
(asyncpage.guided.guards) refuse tokens on the same path.

The searches run on `CloseState.shadow`, the sequence's state in the grammar compiled for a 256-byte
vocabulary (search.byte_tokenizer), fed every token's bytes: ~1 us a probe (the model's mask: 25 us+).

Bounded cost per step (issue 31: a schema whose shortest value was ~22k tokens made every engine step
take 1-4 s, for every request in the batch). No completion is longer than L = search.MAX_COMPLETION
(8 KiB): a grammar whose start search finds none within L (the walk runs past it) has
`StartPlan.too_long`, and its requests run without budget closing, as with budget_close=False (cut
at max_tokens, finish_reason "length"); a repair search never returns one longer either. A
completion's tokens are kept, not recomputed: a step that keeps to its completion (or to a suffix of
one known) drops the tokens it passed and spells again only the one token it split. So one step,
whatever the completion's length, does at most:
- ALTERNATIVES + 5 tries of a token (the sampled one; a quote and the sampled one again where the
  repetition guard refused it; the alternatives; the completion's first token; last the model's own);
- per try: one token's bytes (and forced tokens) through the model's matcher and the byte matcher;
  the tokenizer and the model's matcher on at most the bytes of the token it split; O(L) byte and
  tuple copies (memcpy, ~1 us at L) and, where it came back to a suffix, a walk over the tokens
  between it and the completion's nearer end (Planner.rest; a dict look-up a token);
- in all tries together: the byte matcher checks at most search.SUFFIX_BYTES (4 L) bytes, plus one
  L a try, finding the suffix the model came back to (search.suffix_at, at most SUFFIX_TRIES
  positions a try);
- at most SEARCHES_PER_STEP repair searches (search.MAX_NODES states, a WALK_STEPS walk, GOALS goals
  of at most GOALS bytes each), each result (at most L bytes) tokenized and validated once.
Measured per step by scripts/budget_cost.py (a random policy, max_tokens 2 above the shortest value):
a 7 KB completion 2-4 ms at the median, 6-10 ms at most; a ten-field extraction schema 0.15 ms.
Only the worker thread touches a CloseState (as it does the matchers it belongs to).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncpage.guided.guards import Guards, guards_for, lex, refusal
from asyncpage.guided.search import GOALS, MAX_COMPLETION, SUFFIX_BYTES, Steps, run, search, start_search, suffix_at

__all__ = ["ALTERNATIVES", "CloseState", "Closer", "Guards", "MatcherError", "Planner", "StartPlan", "guards_for",
           "matcher_error"]

# Tokens kept in reserve: the token count of a completion is the count of one tokenization of its bytes;
# forced tokens and the model's own tokens may split the same bytes differently.
MARGIN = 2
RETRY_EVERY = 16  # tokens between two searches from states where one failed
# Sequences further than this from their budget are only repaired, never searched: a search there
# would only bound a completion that has plenty of room. Checked again when they come closer.
FAR = 96
ALTERNATIVES = 8  # model's best allowed tokens tried when its sampled token does not fit
# A start search's own time bound: a hostile grammar's cost on the compile thread, on top of its
# compile. The search's node bounds end it well before on every dev-set schema but one.
START_SECONDS = 2.0
SEARCHES_PER_STEP = 2  # repair searches one step may run, whatever the number of tokens it tries


class MatcherError(RuntimeError):
    """A sequence's matcher refused a token its own mask allowed, or forced (llguidance does so in a
    grammar with no finite instance, `start: "a" start`, and is then in its error state, which
    `is_stopped` also reports): that sequence's request fails with it, never the engine."""


def matcher_error(m: Any, what: str) -> MatcherError:
    """The MatcherError for `m` (a raw matcher, or a backend Matcher), with its own error text where
    it has one (llguidance's get_error)."""
    get = getattr(m, "get_error", None) or getattr(m, "error", None)
    detail = str(get()) if get is not None else ""
    return MatcherError(f"the grammar rejected {what}" + (f": {detail}" if detail else ""))


class Planner:
    """Per tokenizer (one per backend): the single-byte token of every byte, token bytes, and token
    counts of byte paths. Stateless apart from a cache; safe to share between sequences and threads."""

    def __init__(self, lltok: Any) -> None:
        self.tok = lltok
        self.byte_token: list[int] = []
        for b in range(256):
            ids = lltok.tokenize_bytes(bytes([b]))
            self.byte_token.append(ids[0] if len(ids) == 1 else -1)
        # Without a token for every byte a completion cannot always be spelled: no budget closing.
        self.usable = all(t >= 0 for t in self.byte_token)
        self._bytes: dict[int, bytes] = {}
        self.quote = lltok.tokenize_bytes(b'"')
        self.eos: int = lltok.eos_token if lltok.eos_token is not None else -1

    def token_bytes(self, t: int) -> bytes:
        b = self._bytes.get(t)
        if b is None:
            b = self._bytes[t] = bytes(self.tok.decode_bytes([t]))
        return b

    def tokens_for(self, m: Any, path: bytes, whole: bool = True) -> tuple[int, ...]:
        """A short tokenization of `path` that `m` (a model-vocabulary matcher) accepts (to an
        accepting state when `whole`; else `path` begins a completion), else its byte tokens (m is
        unchanged). Work: len(path)."""
        if not path:
            return ()
        ids = list(self.tok.tokenize_bytes(path))
        if len(ids) < len(path):
            if not whole or self.eos >= 0:
                # Validated, not consumed (~10x cheaper a token); the end token, which the matcher
                # allows only where it accepts, stands for is_accepting.
                ends = [self.eos] if whole else []
                ok = m.validate_tokens(ids + ends) == len(ids) + len(ends)
            else:
                n = m.try_consume_tokens(ids)
                ok = n == len(ids) and m.is_accepting()
                m.rollback(n)
            if ok:
                return tuple(ids)
        return tuple(self.byte_token[b] for b in path)

    def rest(self, m: Any, path: bytes, tokens: tuple[int, ...], i: int) -> tuple[int, ...]:
        """A tokenization of path[i:] from `tokens`, one of `path`, for `m` at the state before
        path[i:] (m is unchanged): the tokens wholly past byte i as they are, and the rest of the
        token byte i falls in spelled again. Work: the tokens between byte i and the nearer end of
        `path` (a step that keeps to its completion: its own tokens), never a tokenization of the
        whole of path[i:] (issue 31: that ran through the tokenizer and the model's matcher up to
        ten times a step, seconds for a 22k-token completion). Byte tokens are the tokens' own
        bytes, so what the byte matcher accepted the model's matcher accepts as well."""
        n = len(path)
        if i <= 0:
            return tokens
        if i >= n:
            return ()
        if i <= n - i:
            k = at = 0
            while at < i and k < len(tokens):
                at += len(self.token_bytes(tokens[k]))
                k += 1
        else:
            k, at = len(tokens), n
            while k and at - len(self.token_bytes(tokens[k - 1])) >= i:
                k -= 1
                at -= len(self.token_bytes(tokens[k]))
        if at < i or at > n:  # pragma: no cover - `tokens` are not a tokenization of `path`
            return self.tokens_for(m, path[i:])
        return (*self.tokens_for(m, path[i:at], whole=at == n), *tokens[k:])


class StartPlan:
    """A compiled grammar's completion from its start state. `steps()` searches it (once: the
    grammar compile thread drives it in slices); `result` is read by new sequences on the compute
    thread, which never search it. The result is published as one tuple, so a reader sees all of it
    or none."""

    def __init__(self, planner: Planner, template: Any, byte_template: Any) -> None:
        self.planner = planner
        self._template = template  # the grammar's matchers at the start state, never consumed into:
        self._bytes = byte_template  # the model's vocabulary, and the byte one the search runs on
        self.result: tuple[bytes, tuple[int, ...]] | None = None
        self.done = False  # searched (result None: nothing found within the search's bounds)
        # The shortest value found is longer than search.MAX_COMPLETION: no budget closing for
        # this grammar (sequence_closer), whose every step would cost what its length does.
        self.too_long = False

    def steps(self, seconds: float = START_SECONDS) -> Steps:
        """The search as a generator (see search.start_search), given up after `seconds` of this thread's
        CPU time (pauses and other processes' load not counted); publishes the result at the end."""
        if self.done:
            return self.path
        reached: list[bytes] = []
        inner = start_search(self._bytes.deep_copy(), self._tokens, reached)
        path: bytes | None = None
        spent = 0.0
        try:
            while spent <= seconds:
                t = time.thread_time()
                try:
                    next(inner)
                except StopIteration as stop:
                    path = stop.value
                    break
                spent += time.thread_time() - t
                yield
        finally:
            inner.close()
            if path is not None:
                self.result = (path, self.planner.tokens_for(self._template.deep_copy(), path))
            else:
                self.too_long = bool(reached) and len(reached[0]) > MAX_COMPLETION
            self.done = True
        return path

    def _tokens(self, path: bytes) -> int:
        return len(self.planner.tokens_for(self._template.deep_copy(), path))

    def run(self) -> bytes | None:
        """Search now, in the calling thread (tools and tests; the engine's compile thread uses steps)."""
        return run(self.steps())

    @property
    def path(self) -> bytes | None:
        r = self.result
        return r[0] if r is not None else None


@dataclass
class CloseState:
    """Per sequence: a valid completion from the current matcher state (None: unknown or stale) and
    its tokens, the grammar's byte matcher at the same state (what the searches run on; None if it
    ever fell out of step), the JSON lexical position for the guards, and whether the budget ever
    replaced a token. Tokens are tuples: a snapshot (copy) shares them."""

    shadow: Any = None
    path: bytes | None = None
    tokens: tuple[int, ...] | None = None
    known_at: int = 0  # the completion length when last known (to tell when a stale one gets close)
    anchor: bytes = b""  # the last known completion (its suffixes guide searches once it is stale)
    anchor_tokens: tuple[int, ...] = ()  # its tokens
    retry_below: int = 1 << 62  # after a failed search: no other until the budget is below this
    forced: bool = False
    guards: Guards | None = None
    in_string: bool = False
    escape: bool = False
    digit_run: int = 0
    exponent: bool = False
    string_tokens: list[int] = field(default_factory=list)

    def copy(self, fork: bool = False) -> CloseState:
        """A copy; `fork`: for another sequence (its own byte matcher), else a snapshot to restore."""
        shadow = self.shadow.deep_copy() if fork and self.shadow is not None else self.shadow
        return CloseState(shadow, self.path, self.tokens, self.known_at, self.anchor, self.anchor_tokens,
                          self.retry_below, self.forced, self.guards, self.in_string, self.escape, self.digit_run,
                          self.exponent, list(self.string_tokens))

    @property
    def length(self) -> float:
        return len(self.tokens) if self.tokens is not None else math.inf

    def start(self, plan: StartPlan | None) -> None:
        """At the grammar's start state: take its start completion when it is ready."""
        r = plan.result if plan is not None else None
        if r is not None:
            self.path, self.tokens, self.known_at = r[0], r[1], len(r[1])
            self.anchor, self.anchor_tokens = r

    def adopt_anchor(self, plan: StartPlan | None) -> None:
        """A sequence that started before its grammar's start completion was ready: the completion's
        tail (`"}]}` and the like) still guides its repairs once it is there."""
        r = plan.result if plan is not None else None
        if r is not None and self.path is None and not self.anchor:
            self.anchor, self.anchor_tokens = r


def _string_window(guards: Guards | None) -> int:
    """The string tokens the repetition guard looks back on (guards.refusal): all a state keeps."""
    return 8 * (guards.max_repeats + 1) + 1 if guards is not None and guards.max_repeats else 0


class Closer:
    """One sequence's step: keep the sampled token when it fits, else the best token that does. One
    Closer is made per step (the matcher's `closer()`), so its counters are the step's."""

    def __init__(self, planner: Planner, matcher: Any, state: CloseState) -> None:
        self.p = planner
        self.m = matcher  # the raw matcher of the sequence (llguidance's, or one with its methods)
        self.s = state
        self.searches = 0  # repair searches run in this step (at most SEARCHES_PER_STEP)
        self.checked = 0  # bytes the byte matcher checked finding suffixes in this step (SUFFIX_BYTES)

    def _near(self, budget: int) -> bool:
        return budget - self.s.known_at <= FAR

    def _search(self, budget: int, base: bytes) -> bytes | None:
        """A bounded search, aiming at the last GOALS suffixes of `base` (a completion known before),
        not repeated every step where one just failed (a state the search cannot close costs one
        search per RETRY_EVERY tokens, not one per token), and at most SEARCHES_PER_STEP a step. The
        goals are built only once the search runs: GOALS of them, GOALS bytes at most (it was every
        suffix of `base`, n^2/2 bytes, made before asking whether to search)."""
        s = self.s
        if budget > s.retry_below or s.shadow is None or self.searches >= SEARCHES_PER_STEP:
            return None
        self.searches += 1
        path = search(s.shadow, [base[-k:] for k in range(1, min(GOALS, len(base)) + 1)])
        s.retry_below = budget if path is not None else budget - RETRY_EVERY
        return path

    def _refresh(self, prev: bytes | None, prev_tokens: tuple[int, ...] | None, consumed: bytes,
                 budget: int) -> None:
        """After `consumed` joined the matcher: a completion from the new state, from the previous
        one when the model kept to it (or to a suffix of it), else by a search if the budget is near
        (far from it, the completion is left stale and searched for once it gets near)."""
        s = self.s
        if prev is not None and prev_tokens is not None and prev.startswith(consumed):
            self._keep(prev, prev_tokens, len(consumed))
            return
        if s.shadow is None:
            self._set(None)
            return
        # A stale completion (skipped while far) still lends its closing tail: `"}]}` outlives it.
        base, tokens = (prev, prev_tokens) if prev is not None and prev_tokens is not None \
            else (s.anchor, s.anchor_tokens)
        i, checked = suffix_at(s.shadow, base, max_bytes=SUFFIX_BYTES - self.checked)
        self.checked += checked
        if i is not None:
            self._keep(base, tokens, i)
        else:
            self._set(self._search(budget, base) if self._near(budget) else None)

    def _keep(self, base: bytes, tokens: tuple[int, ...], i: int) -> None:
        """The completion is base[i:], a suffix of one known before (with its tokens)."""
        s = self.s
        s.path = base[i:]
        s.tokens = self.p.rest(self.m, base, tokens, i)
        s.known_at = len(s.tokens)
        s.anchor, s.anchor_tokens = s.path, s.tokens

    def _set(self, path: bytes | None) -> None:
        """A completion found by a search (None: unknown), tokenized whole: at most MAX_COMPLETION
        bytes (search.search returns nothing longer), SEARCHES_PER_STEP times a step at most."""
        s = self.s
        s.path = path
        s.tokens = None if path is None else self.p.tokens_for(self.m, path)
        if path is not None and s.tokens is not None:
            s.known_at = len(s.tokens)
            s.anchor, s.anchor_tokens = path, s.tokens

    def _try(self, token: int, budget: int, fast_forward: bool, check: bool,
             guard: bool = True) -> tuple[str | None, list[int], bool]:
        """Consume `token` (+ the tokens the grammar then forces) when it fits: returns (None, forced
        tokens, the grammar ended). Else the matcher and the state are as before and the first item
        says why: "invalid" (the grammar refuses it), "budget", or a guard's name. `check`: the
        budget and (unless `guard` is False) the guards."""
        m, s, p = self.m, self.s, self.p
        if m.validate_tokens([token]) != 1:
            return "invalid", [], False
        data = p.token_bytes(token)
        if check and guard and (why := refusal(s.guards, s, token, data)) is not None:
            return why, [], False
        saved = s.copy()
        if not m.consume_token(token):  # validated above: the grammar has no way on from here
            raise matcher_error(m, f"token {token} its mask allowed")
        ff: list[int] = []
        if fast_forward and not m.is_stopped():
            for t in m.compute_ff_tokens():
                if not m.consume_token(t):
                    raise matcher_error(m, f"token {t} it forced")
                ff.append(t)
        stopped = bool(m.is_stopped())
        consumed = data + b"".join(p.token_bytes(t) for t in ff)
        if stopped:
            s.path, s.tokens = b"", ()  # the end token's bytes are no text: the byte matcher stays behind
        else:
            if s.shadow is not None and not s.shadow.consume_tokens(list(consumed)):  # pragma: no cover
                s.shadow = None  # out of step with the grammar (never seen): closing goes on without searches
            self._refresh(saved.path, saved.tokens, consumed, budget - 1 - len(ff))
        if check:
            rest = budget - 1 - len(ff)
            if s.tokens is None:
                fits = not self._near(rest)  # unknown: fine while far, refused when near
            else:
                fits = rest >= (len(s.tokens) + MARGIN if s.tokens else 0)
            if not fits:
                m.rollback(1 + len(ff))
                shadow = s.shadow
                if shadow is not None and not stopped:
                    shadow.rollback(len(consumed))
                retry_below = s.retry_below  # a failed search stays failed for the next candidates
                s.__dict__.update(saved.__dict__)
                s.shadow = shadow
                s.retry_below = min(s.retry_below, retry_below)
                return "budget", [], False
        keep = _string_window(s.guards)
        for t in [token, *ff]:
            d = p.token_bytes(t)
            lex(s, d)
            if keep and s.in_string and 0x22 not in d:
                s.string_tokens.append(t)
        if keep and len(s.string_tokens) > 2 * keep:
            del s.string_tokens[:-keep]  # bounded (each try copies it), in amortized O(1)
        return None, ff, stopped

    def step(self, sampled: int, budget: int, fast_forward: bool,
             alternatives: Callable[[], list[int]]) -> tuple[int, list[int], bool] | None:
        """Consume the token this sequence emits now; None when the grammar refuses `sampled` (the
        request then fails, as without budget closing). Returns (token, forced tokens, grammar
        ended). `budget`: the tokens this sequence may still emit, this one included."""
        s = self.s
        if s.path is None and self._near(budget):
            self._set(self._search(budget, s.anchor))
        why, ff, stopped = self._try(sampled, budget, fast_forward, check=True)
        if why is None:
            return sampled, ff, stopped
        if why == "invalid":
            return None
        if why == "repeat":
            for q in self.p.quote[:1]:  # end the string, where the grammar allows it
                r = self._try(q, budget, fast_forward, check=False)
                if r[0] is None:
                    return q, r[1], r[2]
            # The string may not end here (a pattern, minLength): the guard stands aside rather than
            # write the completion's bytes into the value; the budget still holds.
            why, ff, stopped = self._try(sampled, budget, fast_forward, check=True, guard=False)
            if why is None:
                return sampled, ff, stopped
        # The known completion's first token; where the value is already complete, the end token
        # (a top-level number past the digit limit ends there).
        fallback = list(s.tokens[:1]) if s.tokens else [self.p.eos] if s.tokens == () and self.p.eos >= 0 else []
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


def sequence_closer(plan: StartPlan | None, byte_template: Any, state: CloseState | None, planner: Planner,
                    raw: Any, guards: Callable[[], Guards | None]) -> tuple[Closer | None, CloseState | None]:
    """One sequence's closer and its (new or kept) state, for either backend's matcher: None where
    the grammar has no byte-level copy or start plan (budget closing unavailable for it). A new
    state starts at the grammar's start (every token of a budget-closing sequence goes through its
    closer, from the first); a kept one takes the start plan's anchor once the search has it."""
    if plan is None or byte_template is None or plan.too_long:
        return None, state
    if state is None:
        state = CloseState(shadow=byte_template.deep_copy(), guards=guards())
        state.start(plan)
    else:
        state.adopt_anchor(plan)
    return Closer(planner, raw, state), state

