"""Turn grammars built once per tool set: an agent's turns repeat the same tools, tool_choice, family
format and answer schema, so the grammar text (its schema rewrites, grammar.build) is kept, per
tokenizer, under a digest of exactly what it depends on, and the engine's GrammarManager finds the
compiled grammar under the same text (its own cache, keyed by the text's digest). A turn whose
grammar is cached pays neither the rewrites nor the compile: its first token waits only for the
template, the tokenizer and the prefill.

Bounded: at most MAX_ENTRIES grammars and MAX_BYTES of their text per tokenizer, least recently used
first out; a grammar larger than MAX_ONE is built every time instead. Only built grammars are kept
(a refusal or a timeout is built, and refused, again). Preparation runs in worker threads: the
table is locked.
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from collections import OrderedDict
from typing import Any

from asyncpage.chat import grammar
from asyncpage.chat.grammar import TurnSpec
from asyncpage.guided.backend import NO_DEADLINE, Deadline

MAX_ENTRIES = 128
MAX_BYTES = 32 << 20
MAX_ONE = 8 << 20


def spec_key(spec: TurnSpec) -> bytes | None:
    """A digest of everything build() reads from `spec` (key order kept: properties are generated in
    the order a schema lists them); None when the spec is not JSON (build refuses it anyway)."""
    m = spec.markers
    parts = [spec.fmt.name, [[t.name, t.parameters] for t in spec.tools], spec.mode, spec.parallel,
             spec.answer_schema, spec.reasoning, spec.in_reasoning, list(spec.json_separators), spec.closed_objects,
             [m.open, m.close], spec.bare_calls]
    try:
        text = json.dumps(parts, separators=(",", ":"), allow_nan=True)
    except (TypeError, ValueError, RecursionError):
        return None
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


class _Table:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: OrderedDict[bytes, str | None] = OrderedDict()
        self.nbytes = 0
        self.hits = self.misses = 0


_TABLES: weakref.WeakKeyDictionary[Any, _Table] = weakref.WeakKeyDictionary()
_TABLES_LOCK = threading.Lock()


def _table(tokenizer: Any) -> _Table | None:
    try:
        with _TABLES_LOCK:
            table = _TABLES.get(tokenizer)
            if table is None:
                table = _TABLES[tokenizer] = _Table()
            return table
    except TypeError:  # not weakly referable: nothing to keep it by
        return None


def cached_build(spec: TurnSpec, tokenizer: Any, deadline: Deadline = NO_DEADLINE) -> str | None:
    """grammar.build(spec, tokenizer), from the table when this tool set was built before."""
    table, key = _table(tokenizer), spec_key(spec)
    if table is None or key is None:
        return grammar.build(spec, tokenizer, deadline)
    with table.lock:
        if key in table.items:
            table.items.move_to_end(key)
            table.hits += 1
            return table.items[key]
        table.misses += 1
    lark = grammar.build(spec, tokenizer, deadline)  # looked up at the call: tests watch it
    size = len(lark) if lark is not None else 0
    if size > MAX_ONE:
        return lark
    with table.lock:
        if key not in table.items:
            table.items[key] = lark
            table.nbytes += size
        while len(table.items) > MAX_ENTRIES or table.nbytes > MAX_BYTES:
            _, gone = table.items.popitem(last=False)
            table.nbytes -= len(gone) if gone is not None else 0
    return lark


def stats(tokenizer: Any) -> dict[str, int]:
    """{"entries", "bytes", "hits", "misses"} of `tokenizer`'s table (benchmarks and tests)."""
    table = _table(tokenizer)
    if table is None:
        return {"entries": 0, "bytes": 0, "hits": 0, "misses": 0}
    with table.lock:
        return {"entries": len(table.items), "bytes": table.nbytes, "hits": table.hits, "misses": table.misses}
