"""xgrammar behind the backend protocol."""

from __future__ import annotations

import json
from typing import Any

import torch

from asyncpage.errors import GrammarError
from asyncpage.guided.backend import (
    NO_DEADLINE,
    Deadline,
    GuidedSpec,
    Matcher,
    choice_regex,
    grammar_error,
    schema_keywords,
)

# Keywords xgrammar enforces. It silently ignores the others (not, uniqueItems, if/then/else, ...),
# which would accept instances the schema forbids: such schemas are refused instead.
ENFORCED = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "enum", "const", "anyOf",
    "$ref", "$defs", "definitions", "minItems", "maxItems", "minLength", "maxLength", "pattern", "minimum",
    "maximum", "exclusiveMinimum", "exclusiveMaximum", "title", "description", "default", "examples",
    "$schema", "$id", "$comment", "deprecated", "readOnly", "writeOnly"})


class XGrammarMatcher:
    def __init__(self, m: Any) -> None:
        self._m = m

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return bool(self._m.accept_token(token))

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def is_accepting(self) -> bool:
        return bool(self._m.is_completed())

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def forced_tokens(self) -> list[int]:
        return []  # xgrammar's jump-forward is a string, not tokens; sampling one token at a time is exact

    def fork(self) -> Matcher:
        return XGrammarMatcher(self._m.fork())


class XGrammarGrammar:
    def __init__(self, compiled: Any, stop_token_ids: list[int]) -> None:
        self._compiled = compiled
        self._stop = stop_token_ids

    def new_matcher(self) -> Matcher:
        import xgrammar as xgr

        # terminate_without_stop_token: a finished grammar ends the sequence, as with llguidance.
        return XGrammarMatcher(xgr.GrammarMatcher(self._compiled, override_stop_tokens=self._stop,
                                                  terminate_without_stop_token=True))


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._stop = stop_token_ids

    def compile(self, spec: GuidedSpec, deadline: Deadline = NO_DEADLINE) -> XGrammarGrammar:
        # xgrammar's native compile cannot be interrupted: the deadline is only checked before it starts
        # (queued behind a hostile compile, a spec gives up instead of adding to it).
        deadline.check()
        try:
            if spec.kind == "json_schema":
                schema = json.loads(spec.value)
                ignored = sorted(schema_keywords(schema) - ENFORCED)
                if ignored:
                    raise GrammarError(spec.kind, f"unsupported JSON Schema keyword(s) {', '.join(ignored)} "
                                                  "(xgrammar backend)")
                # Compact JSON, as with llguidance; strict_mode: nothing beyond what the schema allows.
                g = self._compiler.compile_json_schema(spec.value, any_whitespace=False, separators=(",", ":"),
                                                       strict_mode=True)
            elif spec.kind == "regex":
                g = self._compiler.compile_regex(spec.value)
            elif spec.kind == "choice":
                g = self._compiler.compile_regex(choice_regex(json.loads(spec.value)))
            else:
                if "::=" not in spec.value:
                    raise ValueError("xgrammar takes EBNF (GBNF) grammars; Lark grammars need the llguidance backend")
                g = self._compiler.compile_grammar(spec.value)
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses with its message
            raise grammar_error(spec, str(exc)) from exc
        return XGrammarGrammar(g, self._stop)
