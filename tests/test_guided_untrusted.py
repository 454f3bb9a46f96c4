"""A schema or grammar is untrusted input (security review f3ae331, H6 and M3): the json_schema
fallback fetches nothing and checks patterns in linear time; the grammar cache and the compile
queue are bounded by bytes, and one spec's text by size."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from referencing.exceptions import Unresolvable

from asyncpage import AsyncEngine, GrammarError
from asyncpage.guided.backend import Deadline, GuidedSpec, bounded_validator, enum_of_valid_candidates

# The repo's refused shape (llguidance has no `not`): its listed values go through the fallback.
REFUSED = {"not": {"const": 5}, "uniqueItems": True}


def tiny_engine(path: Path, **kw: Any) -> AsyncEngine:
    opts: dict[str, Any] = dict(dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=32)
    opts.update(kw)
    return AsyncEngine.from_pretrained(str(path), **opts)


class Silent:
    """A local socket that listens and never answers: a fetch of it would hang the compile thread."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/schema.json"

    def connected(self) -> bool:
        self.sock.setblocking(False)
        try:
            conn, _ = self.sock.accept()
        except BlockingIOError:
            return False
        conn.close()
        return True

    def close(self) -> None:
        self.sock.close()  # resets any connection in its backlog: a fetch stuck on it returns


def fifo_unread(path: Path) -> bool:
    """True when no process holds the FIFO open for reading (a file:// fetch would block in it)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return True
    os.close(fd)  # a reader was there: it now reads EOF, and a stuck fetch returns
    return False


async def test_remote_and_file_refs_are_refused_at_once_and_nothing_is_fetched(tiny_llama: Path,
                                                                               tmp_path: Path) -> None:
    engine = tiny_engine(tiny_llama, grammar_compile_timeout=3.0)
    server = Silent()
    fifo = tmp_path / "schema.json"
    os.mkfifo(fifo)
    cases = {
        "http": {"enum": ["x", "y"], **REFUSED, "allOf": [{"$ref": server.url}]},
        "file": {"enum": ["x", "y"], **REFUSED, "anyOf": [{"$ref": fifo.as_uri()}]},
        "nested": {"enum": ["x"], **REFUSED, "$defs": {"a": {"not": {"$ref": server.url + "#/a"}}},
                   "allOf": [{"$ref": "#/$defs/a"}]},
        "plain": {"type": "object", "properties": {"a": {"$ref": server.url}}},
    }
    try:
        for name, schema in cases.items():
            t = time.perf_counter()
            with pytest.raises(GrammarError) as err:
                await engine.guided.compile(GuidedSpec("json_schema", json.dumps(schema)))
            took = time.perf_counter() - t
            print(f"{name}: refused in {took * 1000:.1f} ms: {err.value}")
            assert type(err.value) is GrammarError  # refused, not a timeout behind a hung fetch
            assert err.value.field == "json_schema"
            assert ("127.0.0.1" in err.value.message or "file://" in err.value.message), err.value.message
        # the fallback itself, called directly, refuses before validating anything
        with pytest.raises(GrammarError, match=r"127\.0\.0\.1"):
            enum_of_valid_candidates(cases["http"], Deadline(1.0))
        # and its validator, had a reference got past that check, retrieves nothing either
        with pytest.raises(Unresolvable):
            bounded_validator({"not": {"$ref": server.url}}).is_valid(1)
        assert not server.connected()
        assert fifo_unread(fifo)
    finally:
        server.close()
        fifo_unread(fifo)


async def test_local_refs_still_resolve_in_the_fallback(tiny_llama: Path) -> None:
    engine = tiny_engine(tiny_llama)
    schema = {"$id": "http://example.invalid/root.json", "enum": ["ab", "x", 3], **REFUSED,
              "$defs": {"short": {"$id": "short.json", "maxLength": 1}, "str": {"type": "string"}},
              "allOf": [{"$ref": "#/$defs/str"}, {"not": {"$ref": "short.json"}}]}
    assert enum_of_valid_candidates(schema, Deadline(5.0)) == {"enum": ["ab"]}
    compiled = await engine.guided.compile(GuidedSpec("json_schema", json.dumps(schema)))
    assert compiled.new_matcher() is not None


def test_patterns_are_checked_in_linear_time_in_the_fallback() -> None:
    evil = "a" * 5000 + "!"
    schema = {"enum": [evil, "aaa", "b"], **REFUSED, "pattern": "^(a+)+$"}
    t = time.perf_counter()
    assert enum_of_valid_candidates(schema, Deadline(5.0)) == {"enum": ["aaa"]}
    print(f"a {len(evil)}-character ReDoS candidate checked in {(time.perf_counter() - t) * 1000:.1f} ms")
    # property names too: patternProperties, and additionalProperties next to it
    keyed = {"enum": [{evil: 1}, {"aa": 1}, {"aa": "s"}], **REFUSED,
             "patternProperties": {"^(a+)+$": {"type": "integer"}}, "additionalProperties": False}
    assert enum_of_valid_candidates(keyed, Deadline(5.0)) == {"enum": [{"aa": 1}]}
    named = {"enum": [{evil: 1}, {"aa": 1}], **REFUSED, "propertyNames": {"pattern": "^(a+)+$"}}
    assert enum_of_valid_candidates(named, Deadline(5.0)) == {"enum": [{"aa": 1}]}


def test_a_pattern_no_linear_engine_can_check_is_refused_by_name() -> None:
    schema = {"enum": ["aa", "ab"], **REFUSED, "pattern": "^(a)\\1$"}  # a backreference
    with pytest.raises(GrammarError, match=r"\^\(a\)\\\\1\$"):
        enum_of_valid_candidates(schema, Deadline(5.0))
    mixed = {"enum": [{"a": 1}], **REFUSED, "patternProperties": {"^a": {}}, "unevaluatedProperties": False}
    with pytest.raises(GrammarError, match="unevaluatedProperties"):
        enum_of_valid_candidates(mixed, Deadline(5.0))


async def test_a_redos_pattern_compiles_within_the_bound_and_the_loop_keeps_ticking(tiny_llama: Path) -> None:
    engine = tiny_engine(tiny_llama, grammar_compile_timeout=2.0)
    engine.guided.backend()  # adapting the tokenizer is not the schema's time
    # About x4 per 2 characters with Python's re: 27 a's held the GIL for seconds.
    schema = {"enum": ["a" * 27 + "!", "a" * 40 + "!", "aaa"], **REFUSED, "pattern": "^(a+)+$"}
    gaps: list[float] = []
    stop = asyncio.Event()

    async def tick() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    t = time.perf_counter()
    compiled = await engine.guided.compile(GuidedSpec("json_schema", json.dumps(schema)))
    took = time.perf_counter() - t
    await asyncio.sleep(0.02)
    stop.set()
    await ticker
    print(f"compiled in {took * 1000:.1f} ms; the loop's longest gap {max(gaps) * 1000:.1f} ms over {len(gaps)} ticks")
    assert gaps  # the ticking task answered
    tok = engine.tokenizer
    m = compiled.new_matcher()
    assert all(m.accept(t) for t in tok.encode('"aaa"', add_special_tokens=False)) and m.is_accepting()
    m = compiled.new_matcher()
    assert not all(m.accept(t) for t in tok.encode('"' + "a" * 27 + '!"', add_special_tokens=False))
