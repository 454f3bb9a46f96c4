"""Chat on top of the engine: OpenAI-shaped messages and tools, chat templates, tool calls made
valid by grammar in each model family's own format (and held to it in their other spellings),
reasoning sections split from the answer and bounded by a budget, typed results and deltas.

Imported lazily by AsyncEngine.chat()/chat_stream(); nothing here is needed to run the engine.
"""

from asyncpage.chat.api import Turn, prepare
from asyncpage.chat.formats import FORMATS, GENERIC, HERMES, LLAMA3, MISTRAL, ToolFormat
from asyncpage.chat.reasoning import EFFORT_BUDGETS, ReasoningMarkers
from asyncpage.chat.run import chat, chat_stream
from asyncpage.chat.types import ChatDelta, ChatFinishReason, ChatResult, ToolCall, ToolCallDelta, Usage

__all__ = [
    "EFFORT_BUDGETS",
    "FORMATS",
    "GENERIC",
    "HERMES",
    "LLAMA3",
    "MISTRAL",
    "ChatDelta",
    "ChatFinishReason",
    "ChatResult",
    "ReasoningMarkers",
    "ToolCall",
    "ToolCallDelta",
    "ToolFormat",
    "Turn",
    "Usage",
    "chat",
    "chat_stream",
    "prepare",
]
