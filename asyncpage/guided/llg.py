"""llguidance behind the backend protocol (the default backend)."""

from __future__ import annotations

import ctypes
import json
from collections.abc import Callable
from typing import Any

import torch

from asyncpage.errors import GrammarError
from asyncpage.guided.backend import NO_DEADLINE, Deadline, GuidedSpec, Matcher, choice_regex, grammar_error
from asyncpage.guided.budget import Closer, CloseState, Planner, StartPlan, sequence_closer
from asyncpage.guided.guards import Guards
from asyncpage.guided.lltokenizer import lean_tokenizer
from asyncpage.guided.schema import drop_custom_formats, enum_of_valid_candidates, exclusive_one_of
from asyncpage.guided.search import byte_tokenizer
from asyncpage.guided.style import STYLE_KEY
from asyncpage.guided.untrusted import refuse_outside_refs

# No free whitespace: runaway whitespace until max_tokens is the most reported failure of constrained
# decoding; fixed separators make it impossible. Applied over the schema's own x-guidance, which names
# the separators (json.dumps' for a request: guided/style.py; compact where a spec names none).
JSON_OPTIONS = {"whitespace_flexible": False, "lenient": False}


class LLGuidanceMatcher:
    def __init__(self, m: Any, grammar: LLGuidanceGrammar | None = None, close: CloseState | None = None,
                 fresh: bool = False) -> None:
        self._m = m
        self._grammar = grammar  # for the start state's completion, searched once per grammar
        self._close = close  # budget closing (asyncpage.guided.budget); made on first use
        self._fresh = fresh  # at the grammar's start state: its mask is the grammar's (start_mask)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]
        if self._fresh and self._grammar is not None:
            self._grammar.start_mask(v.data_ptr(), v.numel() * v.element_size())
            return
        # For token-terminal grammars, on a copy (0.6 us; the mask costs the same, measured): computing a
        # mask or forced tokens leaves llguidance 1.9's matcher refusing the token a single-token terminal
        # of an ordinary token (`<[236840]>`) allows ("forced bytes: got 'ÿ'"). A matcher that only
        # consumes takes them all. Elsewhere on the matcher itself (its stop token is taken after its mask).
        m = self._m.deep_copy() if self._grammar is not None and self._grammar.token_terminals else self._m
        m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def accept(self, token: int) -> bool:
        self._fresh = False
        return bool(self._m.consume_token(token))

    def rollback(self, num_tokens: int) -> None:
        self._fresh = False
        self._m.rollback(num_tokens)

    def valid_prefix(self, tokens: list[int]) -> int:
        # Not accept() + rollback(): a refused token leaves llguidance's matcher in its error state.
        return int(self._m.validate_tokens(tokens))

    def is_accepting(self) -> bool:
        return bool(self._m.is_accepting())

    def is_terminated(self) -> bool:
        return bool(self._m.is_stopped())

    def error(self) -> str:
        """Why the matcher is in its error state ("" when it is not)."""
        return str(self._m.get_error()) if self._m.is_error() else ""

    def forced_tokens(self) -> list[int]:
        # On a copy, as fill_bitmask: compute_ff_tokens() leaves the matcher refusing a forced run of
        # single-token terminals (`<[236840]> <[107]> <[138]> <[236782]>`: the 3rd is refused after).
        m = self._m.deep_copy() if self._grammar is not None and self._grammar.token_terminals else self._m
        return list(m.compute_ff_tokens())

    def fork(self) -> Matcher:
        return LLGuidanceMatcher(self._m.deep_copy(), self._grammar,
                                 self._close.copy(fork=True) if self._close is not None else None, self._fresh)

    def closer(self, guards: Callable[[], Guards | None] = lambda: None) -> Closer | None:
        """The budget-closing stepper of this sequence; None when the tokenizer lacks byte tokens, or
        when the grammar does not compile over bytes (it names special tokens, `<[id]>`: a chat
        template's markers), where no completion could be spelled in bytes anyway. `guards` is asked
        once, when the sequence first needs it. Never searches the grammar's start completion: it
        takes it when the compile thread has it ready (see budget.StartPlan)."""
        g = self._grammar
        if g is None:
            return None
        self._fresh = False  # the closer consumes on the matcher itself from now on
        closer, self._close = sequence_closer(g.start_plan, g.byte_template, self._close, g.planner, self._m, guards)
        return closer

    @property
    def budget_forced(self) -> bool:
        return self._close is not None and self._close.forced

    def replays(self, tokens: list[int]) -> bool:
        """Do `tokens` take a fresh matcher of this grammar to an accepting state? This one may be
        ahead of a sequence's output: tokens the grammar forced past max_tokens are consumed, never
        emitted."""
        if self._grammar is None:
            return self.is_accepting()
        m = self._grammar.new_matcher()
        return all(m.accept(t) for t in tokens) and m.is_accepting()


class LLGuidanceGrammar:
    def __init__(self, template: Any, planner: Planner, byte_template: Any | None = None,
                 token_terminals: bool = False) -> None:
        self._template = template  # compiled once; each sequence gets a cheap deep copy
        self.token_terminals = token_terminals  # the grammar names token ids (`<[236840]>`): see fill_bitmask
        self.planner = planner
        self.byte_template = byte_template  # the same grammar over bytes (search.byte_tokenizer)
        # Budget closing needs both; its start completion is searched by the GrammarManager's
        # compile thread after the compile (or by start_completion).
        self.start_plan = StartPlan(planner, template, byte_template) \
            if byte_template is not None and planner.usable else None
        self._start_mask: bytes | None = None

    def new_matcher(self) -> Matcher:
        return LLGuidanceMatcher(self._template.deep_copy(), self, fresh=True)

    def start_mask(self, ptr: int, nbytes: int) -> None:
        """Write the start state's mask at `ptr`: computed once per grammar (a chat turn's lazy grammar
        spends 5 ms of a 262k vocabulary on it, every turn alike; later states are incremental), on a
        copy of the template, then copied as bytes (no tensor op: masks are filled outside torch's
        inference mode, into tensors made inside it). Two threads racing here compute the same bytes."""
        mask = self._start_mask
        if mask is None or len(mask) != nbytes:
            buf = ctypes.create_string_buffer(nbytes)
            self._template.deep_copy().unsafe_compute_mask_ptr(ctypes.addressof(buf), nbytes)
            mask = self._start_mask = buf.raw
        ctypes.memmove(ptr, mask, nbytes)

    def start_completion(self) -> bytes | None:
        """A short completion from the start state, searched now in the calling thread unless it was
        already (tools and tests; the engine searches it on the compile thread)."""
        plan = self.start_plan
        if plan is None:
            return None
        return plan.path if plan.done else plan.run()


def refuse_unproductive(spec: GuidedSpec, template: Any) -> None:
    """A grammar with no finite instance (`start: "a" start`, a required self-reference) compiles,
    and its mask allows tokens its matcher then refuses: refused here when a matcher cannot take the
    tokens it forces (llguidance bounds that run), instead of failing each request that uses it. So is
    one that matches no text at all (the regex `[^\\s\\S]` or `a[^\\s\\S]`)."""
    first = template.deep_copy()
    allowed = any(first.compute_bitmask())  # an empty language shows as the error state once a mask is asked for
    if first.is_error() or not (allowed or first.is_accepting()):
        why = (str(first.get_error()).splitlines() or [""])[0] or "no token can start it"
        raise GrammarError(spec.kind, f"the {spec.kind} matches no text, or cannot start (llguidance: {why})")
    whole = template.deep_copy()
    forced = list(whole.compute_ff_tokens())
    if not forced or whole.consume_tokens(forced):
        return
    # consume_tokens() refused the run. It also refuses a forced run of single-token terminals
    # (`<[236840]> <[107]>`: "forced bytes: got 'ÿ'") that a fresh matcher takes one token at a time,
    # as the engine feeds it (see LLGuidanceMatcher.forced_tokens); such a grammar is fine when that
    # run ends. A required self-reference forces `{"next":{"next":...` up to llguidance's bound ("Too
    # many items"), and after it forces as much again: no finite instance.
    m = template.deep_copy()
    if all(m.consume_token(t) for t in forced) and not m.deep_copy().compute_ff_tokens():
        return
    why = (str(whole.get_error()).splitlines() or ["a dead end"])[0]  # its first line; a state dump follows
    raise GrammarError(spec.kind, f"the {spec.kind} has no finite instance: {why}")


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        # Stop tokens are allowed by the mask only where the grammar accepts.
        self._tok = lean_tokenizer(tokenizer, vocab_size, stop_token_ids)
        self.planner = Planner(self._tok)
        self._byte_tok = byte_tokenizer()

    def compile(self, spec: GuidedSpec, deadline: Deadline = NO_DEADLINE) -> LLGuidanceGrammar:
        try:
            return self._compile(spec, deadline)
        except RecursionError:
            raise GrammarError(spec.kind, "nested too deeply to compile") from None

    def _compile(self, spec: GuidedSpec, deadline: Deadline) -> LLGuidanceGrammar:
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import any_to_lark

        if spec.kind == "json_schema":
            original = json.loads(spec.value)
            # llguidance fetches nothing itself, but the fallback's jsonschema would: a reference out of
            # the schema is refused first, by name, whichever of them would have met it.
            refuse_outside_refs(original)
            try:
                schema = exclusive_one_of(drop_custom_formats(original, deadline), deadline)
                grammar = LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
            except ValueError as exc:
                raise grammar_error(spec, str(exc)) from exc
        elif spec.kind == "regex":
            grammar = LLMatcher.grammar_from_regex(spec.value)
        elif spec.kind == "choice":
            grammar = LLMatcher.grammar_from_regex(choice_regex(json.loads(spec.value)))
        else:
            try:
                grammar = LLMatcher.grammar_from_lark(any_to_lark(spec.value))  # GBNF/EBNF or Lark
            except Exception as exc:
                raise grammar_error(spec, f"cannot parse the grammar: {exc}") from exc
        error = LLMatcher.validate_grammar(grammar, self._tok)
        if error and not error.startswith("WARNING") and spec.kind == "json_schema":
            # A schema that only ever matches a few listed values compiles as exactly those values.
            deadline.check()
            finite = enum_of_valid_candidates(original, deadline)
            if finite is not None and finite["enum"]:
                if isinstance(original, dict) and isinstance(original.get(STYLE_KEY), dict):
                    finite[STYLE_KEY] = original[STYLE_KEY]  # the values spelled as the rest would be
                grammar = LLMatcher.grammar_from_json_schema(finite, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
                error = LLMatcher.validate_grammar(grammar, self._tok)
        if error and not error.startswith("WARNING"):
            raise grammar_error(spec, error)
        deadline.check()
        matcher = LLMatcher(self._tok, grammar, log_level=0)
        if matcher.is_error():
            raise grammar_error(spec, matcher.get_error())
        refuse_unproductive(spec, matcher)
        byte_matcher = LLMatcher(self._byte_tok, grammar, log_level=0)  # a fraction of the compile above
        return LLGuidanceGrammar(matcher, self.planner, None if byte_matcher.is_error() else byte_matcher,
                                 token_terminals=spec.kind == "grammar" and "<[" in spec.value)
