"""A schema or grammar is untrusted input (security review f3ae331, H6 and M3): the json_schema
fallback fetches nothing and checks patterns in linear time; the grammar cache and the compile
queue are bounded by bytes, and one spec's text by size."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from referencing.exceptions import Unresolvable

from asyncpage import AsyncEngine, GrammarError
from asyncpage.guided import GrammarManager
from asyncpage.guided.backend import Deadline, GuidedSpec
from asyncpage.guided.schema import enum_of_valid_candidates
from asyncpage.guided.untrusted import bounded_validator

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


def big_schema(i: int, size: int, refused: bool = False) -> str:
    """A JSON Schema of about `size` bytes (a long description), distinct per `i`."""
    schema: dict[str, Any] = {"type": "string", "maxLength": 3, "description": f"{i} " + "x" * size}
    if refused:
        schema["not"] = {"const": "a"}  # llguidance refuses `not`: the refusal is cached
    return json.dumps(schema)


def reachable_text_bytes(root: object) -> int:
    """The bytes of every str/bytes reachable from `root`, walking references but not into modules,
    classes or code (shared by everything); a frame or traceback reached fails the walk outright, since
    it would keep a compile's locals (the spec's text) alive."""
    import gc
    import types

    seen: set[int] = set()
    todo = [root]
    total = 0
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (types.ModuleType, type, types.FunctionType, types.CodeType)):
            continue
        seen.add(id(obj))
        assert not isinstance(obj, (types.FrameType, types.TracebackType)), f"the cache keeps a {type(obj)}"
        if isinstance(obj, (str, bytes, bytearray)):
            total += len(obj)
        todo.extend(gc.get_referents(obj))
    return total


async def test_cached_refusals_keep_no_copy_of_their_spec_text(tiny_llama: Path) -> None:
    # What the cache keeps is walked from the cache itself (process-wide allocation counts also see
    # other threads and lazy imports: flaky under xdist). The keys are 32-byte digests.
    manager = tiny_engine(tiny_llama).guided
    manager.backend()
    for i in range(12):
        with pytest.raises(GrammarError, match="not"):
            await manager.compile(GuidedSpec("json_schema", big_schema(i, 200_000, refused=True)))
    kept = reachable_text_bytes(manager._cache)
    print(f"12 refused 200 KB schemas: the cache keeps {kept / 1e3:.1f} KB of text ({len(manager._cache)} entries)")
    assert len(manager._cache) == 12  # all remembered (a refusal is refused again at once) ...
    assert kept < 12 * 2_000  # ... without their text (each keeps its short message and digest)
    with pytest.raises(GrammarError, match="not"):
        await manager.compile(GuidedSpec("json_schema", big_schema(3, 200_000, refused=True)))


async def test_the_grammar_cache_is_bounded_by_bytes(tiny_llama: Path) -> None:
    manager = GrammarManager(*_tiny_tokenizer(tiny_llama), cache_bytes=1 << 20)
    compiled = []
    for i in range(10):
        spec = GuidedSpec("json_schema", big_schema(i, 60_000))
        compiled.append(await manager.compile(spec))
        assert manager.cached_bytes <= 1 << 20
    print(f"10 compiled 60 KB schemas: {len(manager._cache)} cached, {manager.cached_bytes / 1e3:.0f} KB estimated")
    assert 1 <= len(manager._cache) < 10
    assert await manager.compile(GuidedSpec("json_schema", big_schema(9, 60_000))) is compiled[9]  # still a hit
    manager.forget(GuidedSpec("json_schema", big_schema(9, 60_000)))
    assert await manager.compile(GuidedSpec("json_schema", big_schema(9, 60_000))) is not compiled[9]


def _tiny_tokenizer(path: Path) -> tuple[Any, int, list[int]]:
    engine = tiny_engine(path)
    return engine.tokenizer, engine.guided.vocab_size, sorted(engine.eos_token_ids)


async def test_a_spec_past_its_size_cap_is_refused_naming_its_kind(tiny_llama: Path) -> None:
    from asyncpage import SamplingParams

    engine = tiny_engine(tiny_llama)
    big = "x" * (300 << 10)
    cases = {"json_schema": SamplingParams(json_schema={"type": "string", "description": big}),
             "regex": SamplingParams(regex="a|" + big),
             "choice": SamplingParams(choice=["a", big]),
             "grammar": SamplingParams(grammar='start: "a" | "' + "x" * (3 << 20) + '"')}
    for kind, params in cases.items():
        spec = GuidedSpec.from_params(params)
        assert spec is not None
        t = time.perf_counter()
        with pytest.raises(GrammarError) as err:
            await engine.guided.compile(spec)
        print(f"{kind}: {len(spec.value)} bytes refused in {(time.perf_counter() - t) * 1000:.1f} ms: {err.value}")
        assert err.value.field == kind and "bytes" in err.value.message
    # under the caps: a 200 KB schema and a grounded-size grammar of 1 MiB still compile
    await engine.guided.compile(GuidedSpec("json_schema", big_schema(0, 200_000)))
    await engine.guided.compile(GuidedSpec("grammar", 'start: "a" | "' + "x" * (1 << 20) + '"'))
    # A choice option has its own cap (a long one ran llguidance's lexer out of room mid-output): one past 16 KiB is
    # refused at once; four of 16 KiB and 20,000 short ones compile.
    with pytest.raises(GrammarError, match="option"):
        await engine.guided.compile(GuidedSpec.from_params(SamplingParams(choice=["a", "x" * (20 << 10)])))
    await engine.guided.compile(GuidedSpec.from_params(SamplingParams(choice=[c * (16 << 10) for c in "xyzw"])))
    await engine.guided.compile(GuidedSpec.from_params(SamplingParams(choice=[f"o{i:06d}" for i in range(20000)])))


async def test_a_regex_that_matches_no_text_is_refused_at_compile(tiny_llama: Path) -> None:

    engine = tiny_engine(tiny_llama)
    for rx in (r"[^\s\S]", r"a[^\s\S]"):
        with pytest.raises(GrammarError, match="matches no text"):
            await engine.guided.compile(GuidedSpec("regex", rx))
    for rx in ("", r"a|[^\s\S]", "[0-9]+"):  # the empty text, one live branch: fine
        await engine.guided.compile(GuidedSpec("regex", rx))


async def test_specs_waiting_to_compile_are_bounded_by_bytes(tiny_llama: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncpage.guided import manager as manager_module

    monkeypatch.setattr(manager_module, "MAX_FLIGHT_BYTES", 1 << 20)
    manager = GrammarManager(*_tiny_tokenizer(tiny_llama), compile_timeout=30.0)
    backend = manager.backend()
    release = threading.Event()
    real = backend.compile

    def held(spec: GuidedSpec, deadline: Any = None) -> Any:
        release.wait(30)
        return real(spec, deadline)

    backend.compile = held  # type: ignore[method-assign]
    tasks = [asyncio.create_task(manager.compile(GuidedSpec("json_schema", big_schema(i, 200_000))))
             for i in range(8)]
    await asyncio.sleep(0.2)
    refused = [t for t in tasks if t.done()]
    print(f"{len(tasks) - len(refused)} of 8 200 KB schemas wait to compile ({manager.flight_bytes / 1e3:.0f} KB)")
    assert manager.flight_bytes <= 1 << 20
    assert len(refused) == 3  # five fit in 1 MiB
    for t in refused:
        with pytest.raises(GrammarError, match="already compiling"):
            t.result()
    release.set()
    assert len([await t for t in tasks if t not in refused]) == 5
    assert manager.flight_bytes == 0


def test_an_extraction_examples_check_fetches_no_remote_ref_and_runs_patterns_in_linear_time() -> None:
    """The solved examples of an extraction job are checked against its schema before anything
    compiles: that check fetches nothing for a remote $ref (a local server counts the requests) and
    a backtracking pattern is matched in linear time (RE2), each a typed error or a plain mismatch."""
    import http.server
    import threading

    from asyncpage import InvalidRequestError
    from asyncpage.extract.prompt import _check_example

    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"type": "string"}')

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        remote = {"type": "object", "properties": {"a": {"$ref": f"http://127.0.0.1:{server.server_port}/a.json"}}}
        with pytest.raises(InvalidRequestError, match="points outside") as info:
            _check_example(remote, {"a": "v"}, 1)
        assert info.value.field == "schema" and hits == []
    finally:
        server.shutdown()
    evil = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a+)+$"}}}
    with pytest.raises(InvalidRequestError, match="example 1: a") as info:
        _check_example(evil, {"a": "a" * 5000 + "!"}, 1)  # Python's re would run for ages
    assert info.value.field == "examples"
