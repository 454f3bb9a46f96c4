"""Chat on top of the engine: OpenAI-shaped messages and tools, chat templates, tool calls made
valid by grammar in each model family's own format, typed results and deltas.

Imported lazily by AsyncEngine.chat()/chat_stream(); nothing here is needed to run the engine.
"""

from asyncpage.chat.api import Turn, chat, chat_stream, prepare
from asyncpage.chat.formats import FORMATS, GENERIC, HERMES, LLAMA3, MISTRAL, ToolFormat
from asyncpage.chat.types import ChatDelta, ChatFinishReason, ChatResult, ToolCall, ToolCallDelta, Usage

__all__ = [
    "FORMATS",
    "GENERIC",
    "HERMES",
    "LLAMA3",
    "MISTRAL",
    "ChatDelta",
    "ChatFinishReason",
    "ChatResult",
    "ToolCall",
    "ToolCallDelta",
    "ToolFormat",
    "Turn",
    "Usage",
    "chat",
    "chat_stream",
    "prepare",
]
