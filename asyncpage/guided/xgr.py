"""xgrammar behind the backend protocol.

Budget closing works here as with llguidance: `XgrRaw` puts an xgrammar matcher behind the llguidance
matcher methods the closer and its searches use (asyncpage.guided.budget, asyncpage.guided.search),
and each grammar is also compiled for a 256-byte vocabulary, the byte matcher the searches run on.
Differences: no fast-forward inside the closer (xgrammar forces a string, not tokens), and budget
closing needs llguidance's view of the tokenizer (token bytes, tokenizations); a tokenizer it cannot
read leaves xgrammar's guided decoding as it is, without budget closing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import torch

from asyncpage.errors import GrammarError
from asyncpage.guided.backend import NO_DEADLINE, Deadline, GuidedSpec, Matcher, choice_regex, grammar_error
from asyncpage.guided.budget import Closer, CloseState, Planner, StartPlan, sequence_closer
from asyncpage.guided.guards import Guards
from asyncpage.guided.schema import schema_keywords
from asyncpage.guided.search import FORCED_LIMIT
from asyncpage.guided.style import style_of

log = logging.getLogger("asyncpage")

# Keywords xgrammar enforces. It silently ignores the others (not, uniqueItems, if/then/else, ...),
# which would accept instances the schema forbids: such schemas are refused instead.
ENFORCED = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "enum", "const", "anyOf",
    "$ref", "$defs", "definitions", "minItems", "maxItems", "minLength", "maxLength", "pattern", "minimum",
    "maximum", "exclusiveMinimum", "exclusiveMaximum", "title", "description", "default", "examples",
    "$schema", "$id", "$comment", "deprecated", "readOnly", "writeOnly"})
BYTE_VOCAB = 257  # the 256 bytes and an end token, for the byte matchers
RUNAWAY_BYTES = 1 << 14  # forced bytes from the start that make a grammar refused (refuse_runaway)
# xgrammar's JSON rule for a string with minLength/maxLength takes any byte but `"`, `\`, CR and LF:
# raw control characters, which JSON forbids. The rule text is rewritten to refuse them (escapes stay
# out, as in xgrammar's own rule: fewer strings, all of them valid JSON).
_LENGTH_CHAR = r'[^\"\\\r\n]'
_JSON_CHAR = r'[^\0-\x1f\"\\]'


def only_stops(m: Any, words: int, stops: frozenset[int]) -> bool:
    """Is the grammar complete with nothing but a stop token allowed next? The mask is filled only
    where it is complete (a model-vocabulary mask costs 25 us and more); `words`: its int32 width."""
    if not words or not m.is_completed():
        return False
    mask = torch.zeros((1, words), dtype=torch.int32)
    m.fill_next_token_bitmask(mask, 0)
    bits = int.from_bytes(mask.numpy().tobytes(), "little")
    for t in stops:
        bits &= ~(1 << t)
    return bits == 0


class XgrRaw:
    """An xgrammar GrammarMatcher with the llguidance matcher methods budget closing uses. Each
    accepted token is one rollback step, as in llguidance."""

    __slots__ = ("_stops", "_vocab", "_words", "m")

    def __init__(self, m: Any, vocab_size: int) -> None:
        self.m = m
        self._vocab = vocab_size
        self._words = (vocab_size + 31) // 32
        self._stops = frozenset(m.stop_token_ids)

    def try_consume_tokens(self, tokens: list[int]) -> int:
        n = 0
        for t in tokens:
            if not self.m.accept_token(t):
                break
            n += 1
        return n

    def validate_tokens(self, tokens: list[int]) -> int:
        n = self.try_consume_tokens(tokens)
        self.rollback(n)
        return n

    def consume_token(self, token: int) -> bool:
        return bool(self.m.accept_token(token))

    def consume_tokens(self, tokens: list[int]) -> bool:
        n = self.try_consume_tokens(tokens)
        if n < len(tokens):
            self.rollback(n)
            return False
        return True

    def rollback(self, n: int) -> None:
        if n:
            self.m.rollback(n)

    def is_accepting(self) -> bool:
        return bool(self.m.is_completed())

    def is_stopped(self) -> bool:
        return bool(self.m.is_terminated()) or only_stops(self.m, self._words, self._stops)

    def compute_ff_bytes(self, limit: int = FORCED_LIMIT) -> bytes:
        """The bytes the grammar forces next, at most search.FORCED_LIMIT of them. Walked one byte
        mask at a time, never with xgrammar's find_jump_forward_string: that one has no bound, and
        runs out of memory in a grammar that forces bytes forever (a required self-reference). Only
        a byte matcher (BYTE_VOCAB) has forced bytes to tell: a model-vocabulary one says none."""
        if self._vocab != BYTE_VOCAB:
            return b""
        out = bytearray()
        while len(out) < limit:
            bits = int.from_bytes(self.compute_bitmask(), "little") & ((1 << BYTE_VOCAB) - 1)
            if not bits or bits & (bits - 1) or bits >> 256:
                break  # a choice, an end, or nothing: no more forced bytes
            b = bits.bit_length() - 1
            if not self.m.accept_token(b):  # pragma: no cover - the mask allowed it
                break
            out.append(b)
        self.rollback(len(out))
        return bytes(out)

    def compute_ff_tokens(self) -> list[int]:
        return []  # see XGrammarMatcher.forced_tokens

    def compute_bitmask(self) -> bytes:
        mask = torch.zeros((1, self._words), dtype=torch.int32)
        self.m.fill_next_token_bitmask(mask, 0)
        return mask.numpy().tobytes()

    def deep_copy(self) -> XgrRaw:
        return XgrRaw(self.m.fork(), self._vocab)


class XGrammarMatcher:
    def __init__(self, m: Any, grammar: XGrammarGrammar | None = None, close: CloseState | None = None) -> None:
        self._m = m
        self._grammar = grammar
        self._close = close  # budget closing (asyncpage.guided.budget); made on first use
        self._words = (grammar.vocab_size + 31) // 32 if grammar is not None and grammar.vocab_size else 0
        self._stops = frozenset(m.stop_token_ids)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return bool(self._m.accept_token(token))

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def valid_prefix(self, tokens: list[int]) -> int:
        taken = 0  # xgrammar refuses a token without changing its state
        while taken < len(tokens) and not self._m.is_terminated() and self._m.accept_token(tokens[taken]):
            taken += 1
        self._m.rollback(taken)
        return taken

    def is_accepting(self) -> bool:
        return bool(self._m.is_completed())

    def is_terminated(self) -> bool:
        """Ended: a stop token was taken, or nothing but one can follow (as llguidance's is_stopped).
        A grammar that could end but may go on ("a" of ["a", "ab"], "1" of an integer) is not ended:
        its mask offers the stop tokens next to what may follow, and the model chooses."""
        m = self._m
        return bool(m.is_terminated()) or only_stops(m, self._words, self._stops)

    def forced_tokens(self) -> list[int]:
        return []  # xgrammar's jump-forward is a string, not tokens; sampling one token at a time is exact

    def fork(self) -> Matcher:
        return XGrammarMatcher(self._m.fork(), self._grammar,
                               self._close.copy(fork=True) if self._close is not None else None)

    def closer(self, guards: Callable[[], Guards | None] = lambda: None) -> Closer | None:
        """The budget-closing stepper of this sequence, as llguidance's (LLGuidanceMatcher.closer);
        None where budget closing is unavailable for this grammar."""
        g = self._grammar
        if g is None or g.start_plan is None:
            return None
        closer, self._close = sequence_closer(g.start_plan, g.byte_template, self._close, g.start_plan.planner,
                                              XgrRaw(self._m, g.vocab_size), guards)
        return closer

    @property
    def budget_forced(self) -> bool:
        return self._close is not None and self._close.forced

    def replays(self, tokens: list[int]) -> bool:
        """As LLGuidanceMatcher.replays."""
        if self._grammar is None:
            return self.is_accepting()
        m = self._grammar.new_matcher()
        return all(m.accept(t) for t in tokens) and m.is_accepting()


class XGrammarGrammar:
    def __init__(self, compiled: Any, stop_token_ids: list[int], vocab_size: int = 0,
                 planner: Planner | None = None, byte_compiled: Any | None = None) -> None:
        self._compiled = compiled
        self._stop = stop_token_ids
        self.vocab_size = vocab_size
        self.byte_template: XgrRaw | None = None
        self.start_plan: StartPlan | None = None
        if planner is not None and planner.usable and byte_compiled is not None:
            import xgrammar as xgr

            self.byte_template = XgrRaw(xgr.GrammarMatcher(byte_compiled), BYTE_VOCAB)
            self.start_plan = StartPlan(planner, XgrRaw(self._new(), vocab_size), self.byte_template)

    def _new(self) -> Any:
        import xgrammar as xgr

        # Not terminate_without_stop_token: that ends at the first point the grammar could end
        # ("a" of ["a", "ab"]). Stop tokens are offered where it may end; it ends where nothing
        # else may follow (XGrammarMatcher.is_terminated), or when one is taken.
        return xgr.GrammarMatcher(self._compiled, override_stop_tokens=self._stop)

    def new_matcher(self) -> Matcher:
        return XGrammarMatcher(self._new(), self)

    def start_completion(self) -> bytes | None:
        """As LLGuidanceGrammar.start_completion."""
        plan = self.start_plan
        if plan is None:
            return None
        return plan.path if plan.done else plan.run()


def refuse_runaway(spec: GuidedSpec, byte_compiled: Any) -> None:
    """A grammar that forces bytes from its start without end has no finite instance (a required
    self-reference: `{"next":{"next":...`): refused here, at submission, rather than generating into
    max_tokens. Walked on the byte grammar, up to RUNAWAY_BYTES (no real grammar forces that much)."""
    import xgrammar as xgr

    raw = XgrRaw(xgr.GrammarMatcher(byte_compiled), BYTE_VOCAB)
    if len(raw.compute_ff_bytes(RUNAWAY_BYTES)) >= RUNAWAY_BYTES:
        raise GrammarError(spec.kind, f"the {spec.kind} has no finite instance: it forces more than "
                                      f"{RUNAWAY_BYTES} bytes without an end (a required self-reference?)")


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._stop = stop_token_ids
        self._vocab_size = vocab_size
        byte_info = xgr.TokenizerInfo([bytes([b]) for b in range(256)] + [b"<|end|>"], vocab_size=BYTE_VOCAB,
                                      stop_token_ids=[256])
        self._byte_compiler = xgr.GrammarCompiler(byte_info, max_threads=1)
        self.planner: Planner | None = None
        try:
            from asyncpage.guided.lltokenizer import lean_tokenizer

            self.planner = Planner(lean_tokenizer(tokenizer, vocab_size, stop_token_ids))
        except Exception as exc:  # budget closing is optional; guided decoding itself does not need it
            log.warning("budget closing is off with xgrammar for this tokenizer: %s", exc)

    def compile(self, spec: GuidedSpec, deadline: Deadline = NO_DEADLINE) -> XGrammarGrammar:
        # xgrammar's native compile cannot be interrupted: the deadline is only checked before it starts
        # (queued behind a hostile compile, a spec gives up instead of adding to it).
        deadline.check()
        try:
            g = self._compile(self._compiler, spec)
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses with its message
            raise grammar_error(spec, str(exc)) from exc
        try:
            byte_g = self._compile(self._byte_compiler, spec)  # a 257-token vocabulary: a fraction of g's
        except Exception:  # pragma: no cover - compiled above for the model's vocabulary
            byte_g = None
        if byte_g is not None:
            deadline.check()
            refuse_runaway(spec, byte_g)
        return XGrammarGrammar(g, self._stop, self._vocab_size, self.planner, byte_g)

    @staticmethod
    def _compile(compiler: Any, spec: GuidedSpec) -> Any:
        import xgrammar as xgr

        if spec.kind == "json_schema":
            schema, separators = style_of(json.loads(spec.value))
            ignored = sorted(schema_keywords(schema) - ENFORCED)
            if ignored:
                raise GrammarError(spec.kind, f"unsupported JSON Schema keyword(s) {', '.join(ignored)} "
                                              "(xgrammar backend)")
            # No free whitespace, as with llguidance. A request's schema names its separators in x-guidance
            # and has its objects closed already where it asked (GuidedSpec.from_params, guided/style.py):
            # then JSON Schema's own meaning. A spec that names none: compact, and xgrammar's strict mode
            # (nothing beyond what the schema lists).
            options: dict[str, Any] = {"any_whitespace": False, "separators": separators or (",", ":"),
                                       "strict_mode": separators is None}
            value = spec.value if separators is None else json.dumps(schema)
            text = str(xgr.Grammar.from_json_schema(value, **options))
            if _LENGTH_CHAR in text:
                return compiler.compile_grammar(text.replace(_LENGTH_CHAR, _JSON_CHAR))
            return compiler.compile_json_schema(value, **options)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.value)
        if spec.kind == "choice":
            return compiler.compile_regex(choice_regex(json.loads(spec.value)))
        if "::=" not in spec.value:
            raise ValueError("xgrammar takes EBNF (GBNF) grammars; Lark grammars need the llguidance backend")
        return compiler.compile_grammar(spec.value)
