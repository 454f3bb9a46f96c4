"""Guided JSON decoding against the JSON Schema test suite and JSONSchemaBench (no model needed,
only the default tokenizer). Every valid instance must be accepted token by token, every invalid one
rejected, unsupported schemas refused with a GrammarError. tests/data/guided_ratchet.json records the
outcomes: a case that passed may never regress, and an invalid instance may never be accepted.
Refresh it after an improvement with: ASYNCPAGE_UPDATE_RATCHET=1 pytest tests/test_guided_conformance.py
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from asyncpage.bench.guided_conformance import load_cases, outcome_map, run_all, summarize
from asyncpage.guided import GrammarManager, GuidedSpec
from asyncpage.model.weights import load_tokenizer
from tests.conftest import DATA, SHARED

RATCHET = DATA / "guided_ratchet.json"


@pytest.fixture(scope="module")
def gemma_tokenizer() -> tuple[Any, Any, frozenset[int]]:
    return load_tokenizer(None)


@pytest.mark.skipif(not SHARED.exists(), reason="../shared/data is not next to this checkout")
def test_json_schema_suites_never_accept_what_the_schema_forbids(gemma_tokenizer: tuple[Any, Any, Any]) -> None:
    tok, config, eos = gemma_tokenizer
    manager = GrammarManager(tok, config.vocab_size, sorted(eos), "llguidance")
    results = list(run_all(manager, tok, load_cases(SHARED), config.vocab_size))
    invalid_accepted = [(r.case_id, i) for r in results for i, (v, a) in enumerate(r.outcomes) if not v and a]
    assert invalid_accepted == []
    now = outcome_map(results)
    if os.environ.get("ASYNCPAGE_UPDATE_RATCHET"):
        RATCHET.write_text(json.dumps(dict(sorted(now.items())), indent=0))
    before = json.loads(RATCHET.read_text())
    regressed = [k for k, v in before.items() if v == "accepted" and now.get(k) != "accepted"]
    newly_refused = [k for k, v in before.items() if v != "refused" and now.get(k.split("#")[0]) == "refused"]
    assert regressed == [] and newly_refused == []
    bench = summarize([r for r in results if r.case_id.startswith("bench/")])
    print({k: round(v, 4) for k, v in bench.items()})
    assert bench["valid_accepted"] >= 0.99


def test_unsupported_keyword_is_refused_naming_it(gemma_tokenizer: tuple[Any, Any, Any]) -> None:
    from asyncpage import GrammarError
    from asyncpage.guided import GuidedSpec

    tok, config, eos = gemma_tokenizer
    manager = GrammarManager(tok, config.vocab_size, sorted(eos), "llguidance")
    with pytest.raises(GrammarError) as e:
        manager.compile_sync(GuidedSpec("json_schema", json.dumps({"type": "array", "uniqueItems": True})))
    assert e.value.field == "json_schema" and "uniqueItems" in str(e.value)


def test_xgrammar_backend_refuses_keywords_it_would_ignore(gemma_tokenizer: tuple[Any, Any, Any]) -> None:
    from asyncpage import GrammarError
    from asyncpage.guided import GuidedSpec

    tok, config, eos = gemma_tokenizer
    manager = GrammarManager(tok, config.vocab_size, sorted(eos), "xgrammar")
    with pytest.raises(GrammarError, match="not"):
        manager.compile_sync(GuidedSpec("json_schema", json.dumps({"type": "object", "not": {"required": ["a"]}})))
    ok = manager.compile_sync(GuidedSpec("json_schema", json.dumps(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})))
    m = ok.new_matcher()
    assert all(m.accept(t) for t in tok('{"a":12}', add_special_tokens=False)["input_ids"]) and m.is_accepting()


def test_xgrammar_never_lets_raw_control_characters_into_a_length_bounded_string(tiny_llama: Any) -> None:
    """JSON forbids them unescaped; xgrammar's own rule for minLength/maxLength strings allowed them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    vocab = json.loads((tiny_llama / "config.json").read_text())["vocab_size"]
    manager = GrammarManager(tok, vocab, [tok.eos_token_id], "xgrammar")
    for schema in ({"type": "string", "maxLength": 6}, {"type": "object", "properties": {"k": {
            "type": "string", "minLength": 2}}, "required": ["k"], "additionalProperties": False}):
        g = manager.compile_sync(GuidedSpec("json_schema", json.dumps(schema)))
        wrap = (lambda s: s) if schema["type"] == "string" else (lambda s: '{"k":' + s + "}")
        for text, valid in [('"a\x05b"', False), ('"a\x00b"', False), ('"a\x1fb"', False), ('"a\tb"', False),
                            ('"abc"', True)]:
            m = g.new_matcher()
            ids = tok(wrap(text), add_special_tokens=False)["input_ids"]
            assert (all(m.accept(t) for t in ids) and m.is_accepting()) == valid, (schema, text)
