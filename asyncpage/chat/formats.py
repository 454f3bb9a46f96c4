"""Tool-call formats, one per model family, and which one a checkpoint speaks.

A format is the exact text of a turn's calls: `begin`, then calls joined by `sep`, then `end`;
each call is `{"name": "<tool>", "<key>": <arguments JSON>}`. grammar.py emits exactly this text
under a grammar and parse.py reads it back from the same fields, so the two can never disagree.
Models are asked for their own family's format (what they were trained on); a model without one
gets the generic JSON format, explained in its prompt.
"""

from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from asyncpage.chat.types import Tool


@dataclass(frozen=True)
class ToolFormat:
    name: str
    begin: str  # before the first call; its start is the trigger that hands over to the grammar
    sep: str  # between two calls
    end: str  # after the last call
    key: str  # "arguments" or "parameters"
    at_start: bool  # calls only open the message (JSON formats); else they may follow some text
    trigger: str  # the part of `begin` that starts a call in free text ("" for JSON formats)

    def call_head(self, name: str) -> str:
        return '{"name": ' + json.dumps(name) + ', "' + self.key + '": '

    @property
    def head(self) -> str:
        """The text that opens every turn of calls, up to the first tool's name."""
        return self.begin + '{"name": "'

    def render(self, calls: list[tuple[str, str]]) -> str:
        """(name, arguments JSON) pairs as this format's text: what the grammar makes the model write."""
        return self.begin + self.sep.join(self.call_head(n) + a + "}" for n, a in calls) + self.end

    def instructions(self, tools: list[Tool]) -> str:
        """Tool schemas and the call syntax, for templates that do not render tools themselves."""
        specs = "\n".join(f"- {t.name}: {t.description + ' ' if t.description else ''}"
                          f"arguments {json.dumps(t.parameters, separators=(',', ':'))}" for t in tools)
        example = self.render([(tools[0].name, "{...}")])
        return (f"Tools you can call (arguments follow each JSON Schema):\n{specs}\n"
                f"To call tools, answer with only {example}")


HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>", "arguments",
                    at_start=False, trigger="<tool_call>")
LLAMA3 = ToolFormat("llama3", "", "; ", "", "parameters", at_start=True, trigger="")
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS][", ", ", "]", "arguments", at_start=False, trigger="[TOOL_CALLS]")
GENERIC = ToolFormat("generic", '{"tool_calls": [', ", ", "]}", "arguments", at_start=True, trigger="")

FORMATS = {f.name: f for f in (HERMES, LLAMA3, MISTRAL, GENERIC)}


def detect(template_text: str, tokenizer: Any) -> ToolFormat:
    """The family format a checkpoint was trained on: its chat template says it (the markers it
    writes for assistant calls), else its vocabulary; else the generic JSON format."""
    if "<tool_call>" in template_text:
        return HERMES
    if "[TOOL_CALLS]" in template_text:
        return MISTRAL
    if "<|python_tag|>" in template_text or ("ipython" in template_text and '"parameters"' in template_text):
        return LLAMA3
    markers = _vocab_markers(tokenizer)
    if "<tool_call>" in markers:
        return HERMES
    if "[TOOL_CALLS]" in markers:
        return MISTRAL
    return GENERIC


_MARKERS = ("<tool_call>", "[TOOL_CALLS]")
# get_vocab() builds a fresh dict of the whole vocabulary (262k entries, 0.18 s for Gemma 3's):
# what it says about the markers is read once per tokenizer, and forgotten with it.
_MARKERS_OF: weakref.WeakKeyDictionary[Any, frozenset[str]] = weakref.WeakKeyDictionary()
_MARKERS_LOCK = threading.Lock()  # preparation runs in worker threads


def _vocab_markers(tokenizer: Any) -> frozenset[str]:
    """The call markers that are tokens of `tokenizer`'s vocabulary (computed once per tokenizer;
    tokens added to it later are not seen)."""
    try:
        with _MARKERS_LOCK:
            known = _MARKERS_OF.get(tokenizer)
    except TypeError:  # not weakly referable (or not hashable): nothing to remember it by
        known = None
    if known is not None:
        return known
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    found = frozenset(m for m in _MARKERS if m in vocab)
    try:
        with _MARKERS_LOCK:
            _MARKERS_OF[tokenizer] = found
    except TypeError:
        pass
    return found
