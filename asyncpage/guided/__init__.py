"""Guided decoding: JSON Schema, regex, choice and grammars through token masks.

backend.py    the small protocol (compile -> grammar; per-sequence matcher: mask row, accept, rollback,
              accepting, terminated, fork) and the request-side spec
llg.py        llguidance behind it (the default: ~10 ms compiles on a 262k vocabulary)
xgr.py        xgrammar behind it
schema.py     JSON Schema rewrites that make a schema compile to what it means (closed objects, formats,
              exclusive oneOf, enums of valid candidates)
style.py      how JSON is spelled under a schema (separators, closed objects) for both backends
untrusted.py  what an untrusted schema may not do (outside $refs, backtracking patterns) and a
              validator on RE2
manager.py    tokenizer adaptation once, compiled-grammar cache, compile off the loop with a time bound
budget.py     budget closing: the closer between sampling and the grammar (a valid completion kept
              within max_tokens) and each grammar's start completion (searched on the compile thread)
search.py     the searches for completions, through a byte-vocabulary matcher of the grammar
guards.py     the JSON runaway guards (digit runs, repeated n-grams in strings)
"""

from asyncpage.guided.backend import CompiledGrammar, GuidedSpec, Matcher, apply_bitmask
from asyncpage.guided.manager import GrammarManager

__all__ = ["CompiledGrammar", "GrammarManager", "GuidedSpec", "Matcher", "apply_bitmask"]
