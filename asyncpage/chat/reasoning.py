"""Reasoning sections ("thinking"): the markers a model writes around them, whether a turn's prompt
opened one already, and the budget a request gives it.

    markers = detect(template_text, tokenizer)   # <think>/</think> for Qwen3, DeepSeek-R1, QwQ, ...
    plan = Plan.of(rendered_prompt, markers, budget(max_reasoning_tokens=24, reasoning_effort=None))

Markers come from the chat template (the text it writes, or strips from history, such as Qwen3's
`<think>`), else from the tokenizer (both markers among its tokens), else the caller names them
(`reasoning_markers=`). A turn with a budget always reasons inside an open section (this layer opens
it when the template did not), so the budget has something to bound; budget 0 closes it at once (what
Qwen3's `enable_thinking=False` renders). How a budget is enforced is api.py's and phases.py's: the
section is generated freely up to the budget, then the engine writes the closing marker itself and
the answer's grammar (tools, response_format) applies from there on.

Owns only markers, detection and budgets: no engine calls, no grammar text.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

from asyncpage.errors import InvalidRequestError


@dataclass(frozen=True)
class ReasoningMarkers:
    """`open` and `close` around the section; `gap` is what follows `close` when the engine closes
    the section itself (the spacing the families' own models write after it)."""

    open: str
    close: str
    gap: str = "\n\n"

    @staticmethod
    def of(value: Any) -> ReasoningMarkers | None:
        """A caller's `reasoning_markers`: a ReasoningMarkers, an (open, close) pair, or None."""
        if value is None or isinstance(value, ReasoningMarkers):
            return value
        if (isinstance(value, tuple | list) and len(value) == 2 and all(isinstance(v, str) and v.strip()
                                                                       for v in value) and value[0] != value[1]):
            return ReasoningMarkers(value[0], value[1])
        raise InvalidRequestError("reasoning_markers", "must be two different non-empty strings (open, close), "
                                                       f"got {value!r:.80}")


THINK = ReasoningMarkers("<think>", "</think>")  # Qwen3, QwQ, DeepSeek-R1 and its distills, GLM, SmolLM3, Phi-4
KNOWN = (
    THINK,
    ReasoningMarkers("<seed:think>", "</seed:think>"),  # ByteDance Seed-OSS
    ReasoningMarkers("<|START_THINKING|>", "<|END_THINKING|>"),  # Cohere Command A Reasoning
    ReasoningMarkers("[THINK]", "[/THINK]"),  # Mistral's Magistral
    ReasoningMarkers("\u25c1think\u25b7", "\u25c1/think\u25b7"),  # Kimi
)

# What each reasoning_effort means here, in tokens of reasoning at most (OpenAI names the levels, not
# their sizes). "max" is no budget of its own: only max_tokens bounds the turn.
EFFORT_BUDGETS: dict[str, int | None] = {"none": 0, "minimal": 128, "low": 512, "medium": 2048, "high": 8192,
                                         "xhigh": 16384, "max": None}


def budget(max_reasoning_tokens: Any = None, reasoning_effort: Any = None) -> int | None:
    """The request's reasoning budget in tokens, None for none: `max_reasoning_tokens` when given
    (it is the more precise of the two), else `reasoning_effort`'s (EFFORT_BUDGETS)."""
    if max_reasoning_tokens is not None:
        if not isinstance(max_reasoning_tokens, int) or isinstance(max_reasoning_tokens, bool) \
                or max_reasoning_tokens < 0:
            raise InvalidRequestError("max_reasoning_tokens",
                                      f"must be an integer >= 0, got {max_reasoning_tokens!r:.40}")
        return max_reasoning_tokens
    if reasoning_effort is None:
        return None
    if not isinstance(reasoning_effort, str) or reasoning_effort not in EFFORT_BUDGETS:
        raise InvalidRequestError("reasoning_effort", f"must be one of {', '.join(EFFORT_BUDGETS)}, "
                                                      f"got {reasoning_effort!r:.40}")
    return EFFORT_BUDGETS[reasoning_effort]


def detect(template_text: str, tokenizer: Any) -> ReasoningMarkers | None:
    """The markers a checkpoint reasons within: the first known pair its template writes, else one
    whose two markers are both tokens of its vocabulary; None for a model that does not reason."""
    for m in KNOWN:
        if m.open in template_text or m.close in template_text:
            return m
    vocab = _vocab_of(tokenizer)
    return next((m for m in KNOWN if m.open in vocab and m.close in vocab), None)


# get_vocab() copies the whole vocabulary (0.18 s for Gemma 3's 262k tokens): read once per tokenizer.
_MARKER_TOKENS: weakref.WeakKeyDictionary[Any, frozenset[str]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()  # preparation runs in worker threads


def _vocab_of(tokenizer: Any) -> frozenset[str]:
    try:
        with _LOCK:
            known = _MARKER_TOKENS.get(tokenizer)
    except TypeError:  # not weakly referable: nothing to remember it by
        known = None
    if known is not None:
        return known
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    found = frozenset(s for m in KNOWN for s in (m.open, m.close) if s in vocab)
    try:
        with _LOCK:
            _MARKER_TOKENS[tokenizer] = found
    except TypeError:
        pass
    return found


@dataclass(frozen=True)
class Plan:
    """How one turn reasons. `markers` None: it has no section to read (the model does not reason,
    or the prompt closed the section already). `opened`: the turn starts inside the section.
    `budget`: tokens the section may take (None: unbounded but for max_tokens). `suffix`: text this
    layer appends to the rendered prompt (the opening marker a budget needs, or the whole empty section
    for a budget of 0)."""

    markers: ReasoningMarkers | None
    opened: bool = False
    budget: int | None = None
    suffix: str = ""

    @staticmethod
    def of(prompt: str, markers: ReasoningMarkers | None, limit: int | None) -> Plan:
        if markers is None:
            return Plan(None)
        end = prompt.rstrip()
        if end.endswith(markers.close):  # the template closed it (a "no thinking" rendering)
            return Plan(None)
        opened = end.endswith(markers.open)
        if limit is None:
            return Plan(markers, opened)
        if limit == 0:  # no reasoning at all: the section opens and closes in the prompt
            empty = ("" if opened else markers.open + "\n\n") + markers.close + markers.gap
            return Plan(None, suffix=empty)
        return Plan(markers, True, limit, "" if opened else markers.open + "\n")
