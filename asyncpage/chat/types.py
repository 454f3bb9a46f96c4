"""What chat() returns and chat_stream() yields (msgspec Structs, OpenAI's field names).

Owns only data shapes; no engine, template or grammar logic lives here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec

ChatFinishReason = Literal["stop", "length", "tool_calls"]


class ToolCall(msgspec.Struct, frozen=True):
    """One call the model made. `arguments` is JSON text that validates against the tool's
    `parameters` schema (the grammar guarantees it)."""

    id: str
    name: str
    arguments: str
    type: Literal["function"] = "function"


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of prompt_tokens, found in the prefix cache (OpenAI's prompt_tokens_details)
    reasoning_tokens: int = 0  # of completion_tokens, the reasoning section's (OpenAI's completion_tokens_details)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class ChatResult(msgspec.Struct, frozen=True):
    """A finished chat turn. `content` is None when the turn is only tool calls; `reasoning` is the
    reasoning section's text (None when the model wrote none), never part of `content`."""

    content: str | None
    reasoning: str | None
    tool_calls: list[ToolCall]
    finish_reason: ChatFinishReason
    usage: Usage


class ToolCallDelta(msgspec.Struct, frozen=True):
    """A fragment of tool call number `index`: `id` and `name` on its first fragment only, then
    pieces of `arguments` text that concatenate to the full JSON. chat_stream() sends each call as
    one fragment, once its arguments are whole (a call cut by max_tokens is never sent)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class ChatDelta(msgspec.Struct, frozen=True):
    """One piece of a streamed turn: content, reasoning or a tool-call fragment; the last delta
    carries `finish_reason` and `usage` (and nothing else)."""

    content: str | None = None
    reasoning: str | None = None
    tool_call: ToolCallDelta | None = None
    finish_reason: ChatFinishReason | None = None
    usage: Usage | None = None


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}
