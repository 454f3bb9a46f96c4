"""Tool-call arguments validate by construction: every JSONSchemaBench (dev) schema that compiles,
used as a tool's `parameters`, drives llguidance's matcher with random allowed tokens (no model);
every call that completes parses back to arguments that jsonschema accepts."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest

from asyncpage.chat import GENERIC
from asyncpage.chat.grammar import TurnSpec, build
from asyncpage.chat.parse import parse
from asyncpage.chat.types import Tool
from tests.conftest import SHARED


def _walk(matcher: Any, n_vocab: int, closers: np.ndarray, eos: int, rng: random.Random,
          steps: int) -> list[int] | None:
    out: list[int] = []
    for _ in range(steps):
        if matcher.is_stopped():
            return out
        mask = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")[:n_vocab]
        allowed = np.flatnonzero(mask)
        if len(allowed) == 0:
            return None
        if mask[eos] and matcher.is_accepting():
            return out
        # Prefer tokens that close strings, arrays and objects, so random walks end.
        close = allowed[closers[allowed]]
        pool = close if len(close) and rng.random() < 0.6 else allowed
        t = int(pool[rng.randrange(len(pool))])
        assert matcher.consume_token(t), matcher.get_error()
        out.append(t)
    return None


def test_tool_arguments_validate_for_every_compiling_jsonschemabench_schema(tiny_llama: Path) -> None:
    import llguidance.hf
    from llguidance import LLMatcher
    from transformers import AutoTokenizer

    files = sorted((SHARED / "jsonschemabench-dev").glob("*.json"))
    if not files:
        pytest.skip("no ../shared/data/jsonschemabench-dev")
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    n_vocab = len(tok)
    lt = llguidance.hf.from_tokenizer(tok, n_vocab=n_vocab, eos_token=tok.eos_token_id)
    pieces = [tok.decode([i]) for i in range(n_vocab)]
    closers = np.array([any(c in p for c in '"]}') or p.isdigit() for p in pieces])
    rng = random.Random(0)
    compiled = finished = 0
    for f in files:
        schema = json.loads(f.read_text())["schema"]
        spec = TurnSpec(GENERIC, [Tool("f", "", schema)], "required", False, None, False, False)
        try:
            g = LLMatcher.grammar_from_lark(build(spec, tok) or "")
        except Exception:
            continue
        error = LLMatcher.validate_grammar(g, lt)
        if error and not error.startswith("WARNING"):
            continue  # refused schemas fail at submission with a GrammarError naming "tools"
        m = LLMatcher(lt, g, log_level=0)
        if m.is_error():
            continue
        compiled += 1
        ids = _walk(m, n_vocab, closers, tok.eos_token_id, rng, 600)
        if ids is None:
            continue
        finished += 1
        p = parse(tok.decode(ids), GENERIC, calls_allowed=True, reasoning=False, in_reasoning=False, final=True)
        assert len(p.calls) == 1 and p.calls[0].complete and p.calls[0].name == "f", f.name
        value = json.loads(p.calls[0].arguments)
        cls: Any = jsonschema.validators.validator_for(schema)
        assert not list(cls(schema).iter_errors(value)), f"{f.name}: {p.calls[0].arguments}"
    print(f"{compiled} of {len(files)} schemas compiled, {finished} random calls completed, all valid")
    assert compiled >= 300 and finished >= 0.8 * compiled, (compiled, finished)
