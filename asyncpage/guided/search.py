"""Valid completions worked out through a grammar matcher: the searches behind budget closing.

Everything here asks the matcher, never JSON rules: forced bytes, the bytes the mask allows, copies of
the matcher state (`deep_copy`), and `is_accepting`. So it holds for every grammar that compiles
(JSON schemas, Lark, regex), and whatever it finds is a path the matcher took to an accepting state.

The matchers here are byte matchers: the grammar compiled for `byte_tokenizer()`, whose token ids
are the bytes themselves (asyncpage.guided.budget keeps one next to each budget-closing sequence's
own matcher). A mask of that vocabulary is 257 bits and costs ~1 us, where the model's 262k-token
mask takes 25 us, and 0.7 ms inside an email address; a search probes thousands of states.

- `search`: a bounded best-first search (path length, plus a penalty for coming back to a state
  already met) to an accepting state, or to a state from which one of a few goal byte strings
  completes (suffixes of a completion known before). The closer runs it on the compute thread to
  repair a completion the model moved away from, with a small node bound.
- `suffix_at`: where a sequence that left its completion comes back to one of its suffixes, tried
  at the positions the state allows, with a bounded number of checks.
- `start_search`: the completion from a grammar's start state, searched once per compiled grammar on
  the grammar compile thread (GrammarManager), never on the compute thread: a greedy walk that
  prefers closing bytes (`walk_steps`) gets through what a bounded search cannot (long required
  objects, fixed-length patterns, minLength), then the search with a larger bound, bounded by the
  walk's length and aiming at the rest of the walk, finds the shortest where it can.

No search returns, or grows, a completion longer than MAX_COMPLETION bytes: budget closing's cost per
step is bounded by it (asyncpage.guided.budget states the bound). The searches are generators that
yield every few nodes, so the compile thread interleaves them with compiles; `run` drives one to the end.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Generator, Iterable
from typing import Any

import numpy as np

MAX_NODES = 80  # expanded states per repair search (compute thread)
WALK_STEPS = 256  # bytes a repair's fallback walk may take
START_NODES = 1500  # expanded states of the start search (compile thread)
START_WALK_STEPS = 4096  # steps of the start walk
HOP_PROBES = 400  # states a walk step probes looking for a new one
WALK_PROBES = 4000  # states a walk probes in all before it gives up
GOALS = 24  # suffixes of the previous completion tried as goals by a repair search (its last GOALS bytes)
# The longest completion any search returns (issue 31: a schema whose shortest value was ~22k tokens
# made every step of every request take seconds). Budget closing keeps no completion longer than this,
# so what a step costs is bounded by it (asyncpage.guided.budget). Dev-set start completions are 554
# bytes at most; a ten-field extraction schema's ~120.
MAX_COMPLETION = 8192
# suffix_at's bounds: the positions it tries, and the bytes the byte matcher checks in all (most tries
# fail within a few bytes: a key's name that is not the one expected). The closer gives SUFFIX_BYTES
# to a whole step, not to each token it tries.
SUFFIX_TRIES = 256
SUFFIX_BYTES = 4 * MAX_COMPLETION
PREFIX_CHECK = 64
END = 256  # the byte matchers' end token (byte_tokenizer, and xgr.BYTE_VOCAB's last)
REPEAT_PENALTY = 1  # search priority cost of coming back to a fingerprint already met
NOVELTY_TRIES = 16  # candidate bytes a walk step tries before it settles for the first allowed
REVISITS = 4  # places a walk step moves back to, in its order of preference, before it looks elsewhere
YIELD_EVERY = 16  # expanded nodes (or walk steps) between two yields
# A run of forced bytes this long is taken for one without end (a grammar that forces
# `{"next":{"next":...` forever): the searches drop the state. A matcher may stop its forced bytes
# here (asyncpage.guided.xgr.XgrRaw walks them one by one).
FORCED_LIMIT = 1024

Steps = Generator[None, None, bytes | None]


def run(steps: Steps) -> bytes | None:
    """Drive a search generator to its end, in the calling thread."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            result: bytes | None = stop.value
            return result


def _classify(b: int) -> int:
    """Bytes in one class lead to grammar states alike often enough that a search explores one
    representative (a heuristic only: what it finds is still checked by the matcher). Punctuation
    other than quotes, brackets and separators is one class (in a string it is all one)."""
    if b in _PLAIN_PUNCTUATION:
        return 6
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


_PLAIN_PUNCTUATION = frozenset(set(range(0x20, 0x7F)) - set(range(48, 58)) - set(range(65, 91)) - set(range(97, 123))
                               - set(b'"\'\\{}[](),:<>'))
_CLASS = [_classify(b) for b in range(256)]
# The walk tries bytes one by one (`@` in an email, `9` where a fraction may not end in `0`); its
# look-ahead (_hop) merges letters, and digits, that lead to the same place.
_HOP_CLASS = [_CLASS[b] if _CLASS[b] < 6 else b for b in range(256)]

_BYTE = [bytes([b]) for b in range(256)]

# Bytes a walk takes only when nothing else is allowed: an escape or a non-ASCII byte opens something
# (`\\u0000`, a multi-byte character) that looks new at every step and closes nothing.
_NO_PROGRESS = frozenset({0x5C, *range(0x80, 0x100)})

# Punctuation first, from the top of ASCII down: closing brackets sort above their openers (`}` over
# `{`, `]` over `[`, `)` over `(`, `>` over `<`), so among equally short paths the closing one is tried
# first (a tie-break, not a rule: every path is still checked by the matcher).
_ORDER = np.array(sorted(range(256), key=lambda b: (b >= 0x80 or chr(b).isalnum(), -b)), dtype=np.intp)
# The walk's preference: bytes that usually end something, then a digit and letters (short literals),
# then the search order. A byte that leads nowhere new is passed over by the walk anyway.
_WALK_FIRST = b'}])>"\'0atfn'
_WALK_ORDER = np.array([*_WALK_FIRST, *(int(b) for b in _ORDER if int(b) not in _WALK_FIRST)], dtype=np.intp)


def byte_tokenizer() -> Any:
    """An llguidance tokenizer whose tokens are the 256 bytes (and an end token): the searches run on
    a matcher of the grammar compiled for it, where a mask is 257 bits (~1 us, where a 262k-token
    mask takes 25 us to 0.7 ms) and every byte string has exactly one tokenization."""
    from llguidance import LLTokenizer

    return LLTokenizer.from_tiktoken(  # type: ignore[attr-defined]  # not in the stubs
        encoder={_BYTE[b]: b for b in range(256)}, special_tokens={"<|end|>": 256}, pattern=r"[\s\S]",
        eos_token=256, n_vocab=257, slices=[])


class Mask:
    """What one byte mask says, worked out once per distinct mask (states repeat a lot): which bytes
    it allows, one per class in search order (`reps`), and all in the walk's order (`walk`)."""

    __slots__ = ("allowed", "reps", "walk")

    def __init__(self, mask: bytes) -> None:
        a = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:256].astype(bool)
        self.allowed = a.tobytes()  # one byte per byte value: indexing it is a plain bytes lookup
        self.walk: list[int] = _WALK_ORDER[a[_WALK_ORDER]].tolist()
        self.reps: list[int] = []
        taken: set[int] = set()
        for b in _ORDER[a[_ORDER]].tolist():
            c = _CLASS[b]
            if c < 100 and c in taken:
                continue
            taken.add(c)
            self.reps.append(b)


_MASKS: dict[bytes, Mask] = {}


def probe(m: Any) -> tuple[Mask, tuple[Any, ...]]:
    """From one mask: what it allows (Mask), and a fingerprint of m's state (accepting, forced
    bytes, the mask). States that allow the same next bytes but differ further on (`[a-z]+` and
    `[a-z]+-` before `-v[0-9]`) share it, so the searches key states by more than this
    (search_steps, _hop); a wrong merge costs optimality, and at worst the path."""
    mask = bytes(m.compute_bitmask())
    info = _MASKS.get(mask)
    if info is None:
        if len(_MASKS) > 1 << 14:
            _MASKS.clear()  # a bound, not an LRU: the masks of one grammar are few
        info = _MASKS[mask] = Mask(mask)
    return info, (bool(m.is_accepting()), bytes(m.compute_ff_bytes()), mask)


def completes(m: Any, data: bytes | memoryview) -> bool:
    """Does `data` take m to an accepting state? (m is unchanged.)"""
    return _checks(m, data)[0]


def _checks(m: Any, data: bytes | memoryview) -> tuple[bool, int]:
    """completes, and the bytes the matcher checked. Validated, never consumed (consuming costs ~5x
    as much a byte): `data` then the end token, which a byte matcher allows only where it accepts.
    Its first PREFIX_CHECK bytes first, so that a long `data` refused early costs no more than that."""
    n = len(data)
    if n > PREFIX_CHECK:
        k = m.validate_tokens(list(data[:PREFIX_CHECK]))
        if k < PREFIX_CHECK:
            return False, k + 1
    toks = list(data)
    toks.append(END)
    k = m.validate_tokens(toks)
    return k == n + 1, min(k + 1, n)


def suffix_at(m: Any, data: bytes, max_tries: int = SUFFIX_TRIES, max_bytes: int = SUFFIX_BYTES
              ) -> tuple[int | None, int]:
    """Where the longest suffix of `data` that takes m to an accepting state starts (len(data): m
    accepts as it is; None: none found), and the bytes checked (m is unchanged). Only positions
    whose byte m allows next (where m forces bytes: where they follow) are tried, first to last, at
    most `max_tries` of them and about `max_bytes` checked bytes in all (the last check may go one
    `data` over): bounded whatever the length of `data` (it was a check at every position, each
    copying its suffix: O(n^2))."""
    a, (accepting, forced, _) = probe(m)
    tries = checked = 0
    if forced:
        i = data.find(forced)
        again: Callable[[int], int] = lambda j: data.find(forced, j + 1)  # noqa: E731
    else:
        allowed = data.translate(a.allowed)  # 1 where m allows the byte next
        i = allowed.find(1)
        again = lambda j: allowed.find(1, j + 1)  # noqa: E731
    view = memoryview(data)
    while i >= 0 and tries < max_tries and checked < max_bytes:
        ok, n = _checks(m, view[i:])
        if ok:
            return i, checked + n
        tries += 1
        checked += n
        i = again(i)
    return (len(data) if accepting else None), checked


def search(m: Any, goals: Iterable[bytes] = (), max_nodes: int = MAX_NODES) -> bytes | None:
    """A short completion from m's state (m is unchanged), or None; see `search_steps`."""
    return run(search_steps(m, goals, max_nodes))


def search_steps(m: Any, goals: Iterable[bytes] = (), max_nodes: int = MAX_NODES, best: bytes | None = None,
                 goals_at: dict[tuple[Any, ...], list[memoryview]] | None = None,
                 walk_limit: int = WALK_STEPS, max_bytes: int = MAX_COMPLETION) -> Steps:
    """The shortest byte path found (best first) from m's state to an accepting state, or to a
    state from which a goal completes: one of `goals` (tried where its first byte is allowed),
    or one of `goals_at[fingerprint]` (tried where the state has that fingerprint). `best`, a
    completion known already, bounds the search. A node is dropped when one with the same
    fingerprint, after the same number of forced runs, the same last two of them, and met as
    often since them, was seen: a free string's letters are one node, `0,` and `-0,` merge once
    the next key is forced, while counted repeats (minLength, minItems) still advance, last in
    line. One byte per class is tried (a letter, a digit, ...). Out of nodes without a
    completion: the walk. Nothing longer than `max_bytes` is returned (or grown: a path past it is
    dropped). m is unchanged (nodes are copies)."""
    goal_list = [g for g in sorted(set(goals), key=len)[:GOALS] if g]
    # A node: (priority, tie, path, penalty, forced runs on the path, the last two of them,
    # fingerprints met since the last of them, the matcher of its parent, bytes from there).
    # Priority is the path length plus a penalty for each revisit of a fingerprint, so counted
    # repeats are explored only after everything that makes progress.
    Node = tuple[int, int, bytes, int, int, tuple[bytes, bytes], tuple[Any, ...], Any, bytes]
    heap: list[Node] = [(0, 0, b"", 0, 0, (b"", b""), (), None, b"")]
    seen: set[tuple[Any, ...]] = set()
    ids: dict[tuple[Any, ...], int] = {}
    nodes = tie = 0
    while heap and nodes < max_nodes:
        prio, _, path, pen, runs, last_forced, since, parent, step = heapq.heappop(heap)
        if best is not None and prio >= len(best):
            break
        if len(path) > max_bytes:
            continue
        if parent is None:
            cur = m
        else:
            cur = parent.deep_copy()
            if not cur.consume_tokens(list(step)):  # pragma: no cover - every step was allowed
                continue
        if cur.is_accepting():
            return path
        forced = bytes(cur.compute_ff_bytes())
        if len(forced) >= FORCED_LIMIT:
            continue  # forced without end: no completion this way
        if forced:
            # The only way on: no mask needed (most bytes of a JSON schema's shortest value are these).
            for g in goal_list:
                if g[: len(forced)] == forced[: len(g)] and len(path) + len(g) < _limit(best, max_bytes) \
                        and completes(cur, g):
                    best = path + g
                    break
            tie += 1
            heapq.heappush(heap, (prio + len(forced), tie, path + forced, pen, runs + 1,
                                  (last_forced[-1], forced), (), cur, forced))
            continue
        a, fp = probe(cur)
        state = ids.setdefault(fp, len(ids))  # small ints: cheap to keep in every path's history
        count = since.count(state)
        key = (state, runs, last_forced, count)
        if key in seen:
            continue  # checked before the goals: most nodes end here, cheaply
        seen.add(key)
        for g in [*(goals_at or {}).get(fp, ()), *goal_list]:
            if a.allowed[g[0]] and len(path) + len(g) < _limit(best, max_bytes) and completes(cur, g):
                best = path + g
                break
        nodes += 1
        if nodes % YIELD_EVERY == 0:
            yield
        pen += REPEAT_PENALTY if count else 0
        since = (*since, state)
        for b in a.reps:
            tie += 1
            step = _BYTE[b]
            heapq.heappush(heap, (len(path) + 1 + pen, tie, path + step, pen, runs, last_forced, since, cur, step))
    if best is None and walk_limit:
        best = yield from walk_steps(m, walk_limit, max_bytes=max_bytes)
    return best


def _limit(best: bytes | None, max_bytes: int) -> int:
    """A completion a search may still take must be shorter than this."""
    return len(best) if best is not None else max_bytes + 1


def walk_steps(m: Any, max_steps: int = WALK_STEPS, trail: list[tuple[tuple[Any, ...], int]] | None = None,
               reached: list[bytes] | None = None, max_bytes: int = MAX_COMPLETION) -> Steps:
    """A greedy walk to an accepting state (m is unchanged). A place is a state's fingerprint with
    the forced bytes that led to it (`,"name":"` is progress even where the state after it looks
    like one met before). Forced bytes as they come; else a byte that ends the grammar; else, in
    the walk's order (closing bytes first: a free string ends at once, an open array or object
    closes), the first byte that moves to another place met fewer than REVISITS times; else the
    byte leading to the place met least often, or, once every byte leads back to places met twice,
    the nearest new place a few bytes away (`_hop`, tried once per place). Escapes and non-ASCII
    bytes are never tried (a place they open looks new at every step and closes nothing). Not
    shortest, but it gets through what a bounded search cannot (long required objects, fixed-length
    patterns, minLength) in a few probes per byte. `trail` receives (fingerprint, offset in the
    path) of the states passed through, and `reached` the path where the walk gave up (it gives up
    once its path is longer than `max_bytes`)."""
    w = m.deep_copy()
    path = b""
    visits: dict[tuple[Any, ...], int] = {}
    hopped: set[tuple[Any, ...]] = set()
    probes = 0
    for i in range(max_steps):
        if i % YIELD_EVERY == YIELD_EVERY - 1:
            yield
        forced = bytes(w.compute_ff_bytes())
        if len(forced) >= FORCED_LIMIT:
            break  # forced without end: the walk gives up
        if forced:
            if not w.consume_tokens(list(forced)):  # pragma: no cover - forced bytes are allowed
                return None
            path += forced
        if len(path) > max_bytes:
            break  # longer than any completion budget closing keeps
        if w.is_accepting():
            return path
        a, fp = probe(w)
        candidates = a.walk
        if not candidates:
            break
        here = (forced, fp)
        visits[here] = visits.get(here, 0) + 1
        if trail is not None:
            trail.append((fp, len(path)))
        pick = next((_BYTE[b] for b in candidates if _ends(w, b)), None)
        if pick is None:
            least: int | None = None
            taken = 0
            for b in candidates:
                if b in _NO_PROGRESS:
                    continue
                taken += 1
                if taken > NOVELTY_TRIES:
                    break
                probes += 1
                landed = _lands(w, _BYTE[b])
                n = visits.get(landed, 0)
                if landed != here and n < REVISITS:
                    pick, least = _BYTE[b], None
                    break
                if least is None or n < least:
                    pick, least = _BYTE[b], n
            if least is not None and least >= 2 and here not in hopped:
                if probes > WALK_PROBES:
                    break  # stuck where fingerprints cannot tell states apart (`.*[0-9]{4}` in a string)
                hopped.add(here)
                hop, n = _hop(w, here, visits)
                probes += n
                pick = hop or pick
        pick = pick or bytes(candidates[:1])
        w.consume_tokens(list(pick))
        path += pick
    if reached is not None:
        reached.append(path)
    return None


def _ends(m: Any, b: int) -> bool:
    m.consume_token(b)
    ok = bool(m.is_accepting())
    m.rollback(1)
    return ok


def _lands(m: Any, data: bytes) -> tuple[Any, ...]:
    """Where `data` leads: (the bytes it then forces, the fingerprint after them); m unchanged."""
    n = len(data)
    m.consume_tokens(list(data))
    forced = bytes(m.compute_ff_bytes())
    if forced:
        m.consume_tokens(list(forced))
        n += len(forced)
    fp = probe(m)[1]
    m.rollback(n)
    return forced, fp


def _hop(m: Any, key: tuple[Any, ...], met: dict[tuple[Any, ...], int], max_probes: int = HOP_PROBES
         ) -> tuple[bytes | None, int]:
    """Breadth first from m (at place `key`), the nearest place not in `met` (see walk_steps) or
    an accepting state, and the probes it took; m is unchanged. Every allowed byte is tried, not
    one per class (`-v` differs from `-a` in `[a-z]+(-[a-z]+)*-v[0-9]+`), and places merge by key and
    the byte's class (letters, digits): the fingerprint cannot tell `a` from `a-` there, the byte
    can. At each depth, places that moved on are expanded before those that came back to the place
    they left (a string's next letter), so a string's closing quote is followed first."""
    frontier: list[tuple[int, int, int, bytes, Any, tuple[Any, ...]]] = [(0, 0, 0, b"", m, key)]
    here: set[tuple[Any, ...]] = set()
    probes = tie = 0
    while frontier and probes < max_probes:
        depth, _, _, path, cur, at = heapq.heappop(frontier)
        for b in probe(cur)[0].walk:
            if b in _NO_PROGRESS:
                continue
            probes += 1
            nxt = cur.deep_copy()
            nxt.consume_token(b)
            forced = bytes(nxt.compute_ff_bytes())
            if len(forced) >= FORCED_LIMIT:
                continue  # forced without end: no place to go
            nxt.consume_tokens(list(forced))
            step = path + _BYTE[b] + forced
            if nxt.is_accepting():
                return step, probes
            landed = (forced, probe(nxt)[1])
            if landed not in met:
                return step, probes
            if (landed, _HOP_CLASS[b]) not in here:
                here.add((landed, _HOP_CLASS[b]))
                tie += 1
                heapq.heappush(frontier, (depth + 1, landed == at, tie, step, nxt, landed))
    return None, probes


def start_search(m: Any, cost: Callable[[bytes], int] = len, reached: list[bytes] | None = None,
                 max_bytes: int = MAX_COMPLETION) -> Steps:
    """The completion from a grammar's start state (m is unchanged): the walk's, and a search within
    START_NODES that finds the shortest where it can, bounded by the walk's length and aiming at the
    rest of the walk from every state of it that it meets (kept when `cost`, the completion's token
    count, is lower: fewer bytes are not always fewer tokens). None past `max_bytes`; `reached`
    receives the walk's path where it gave up (longer than `max_bytes`: the walk ran past it)."""
    trail: list[tuple[tuple[Any, ...], int]] = []
    walked = yield from walk_steps(m, START_WALK_STEPS, trail, reached, max_bytes)
    goals_at: dict[tuple[Any, ...], list[memoryview]] = {}
    if walked is not None:
        view = memoryview(walked)  # the rest of the walk from each state: views, not copies (n^2/2 bytes)
        for fp, at in trail:
            goals_at.setdefault(fp, []).append(view[at:])
    found = yield from search_steps(m, (), START_NODES, best=walked, goals_at=goals_at, walk_limit=0,
                                    max_bytes=max_bytes)
    if found is None or walked is None or found == walked:
        return found
    return found if cost(found) < cost(walked) else walked
