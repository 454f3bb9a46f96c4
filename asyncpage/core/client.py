"""What the layers above the loop may ask of an engine, as protocols (vLLM's EngineClient):

Submitter     (core/stream.py, beside the RequestStream it serves) submit a request, abort it, wait
              until its blocks are back. AsyncEngine and asyncpage.disagg's DisaggEngine are both one.
EngineClient  an AsyncEngine's Submitter with the model's tokenizer and limits, streams and whole generations: what
              extraction (asyncpage.extract), chat (asyncpage.chat) and the OpenAI surface
              (asyncpage.openai) are typed against, so they never import the AsyncEngine facade, which
              sits above them and imports them.

Protocols only: no state, no behaviour.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from asyncpage.params import Prompt, SamplingParams

if TYPE_CHECKING:
    from asyncpage.core.config import EngineConfig
    from asyncpage.core.mailbox import Mailbox
    from asyncpage.core.request import Request
    from asyncpage.core.stream import RequestStream
    from asyncpage.decoding.beam import BeamParams, EarlyStopping
    from asyncpage.guided import GrammarManager
    from asyncpage.outputs import BeamSearchOutput, GenerateOutput


class EngineClient(Protocol):
    config: EngineConfig
    tokenizer: Any
    model_source: str
    guided: GrammarManager
    reading_offsets: dict[str, float | None]  # asyncpage.extract.booleans' per-engine cache

    async def submit(self, prompt: Prompt, params: SamplingParams, mailbox: Mailbox | None = None, *,
                     beam: BeamParams | None = None, priority: int = 0, cache_key: str | None = None) -> Request:
        """Tokenize, validate, compile the grammar and queue; raises a typed error before queueing."""
        ...

    def abort(self, request: Request) -> None: ...

    async def wait_released(self, request: Request) -> None: ...

    def check_usable(self) -> None:
        """Raise the typed error a call would get now (dead, not running, another loop)."""
        ...

    async def tokenize(self, prompt: Prompt) -> list[int]: ...

    def apply_chat_template(self, prompt: Prompt) -> list[int]: ...

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, *, priority: int = 0,
               cache_key: str | None = None) -> RequestStream[Request]: ...

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, *, priority: int = 0,
                       cache_key: str | None = None) -> GenerateOutput: ...

    async def beam_search(self, prompt: Prompt, beam_width: int = 4, max_tokens: int = 32,
                          length_penalty: float = 1.0, early_stopping: EarlyStopping = False,
                          params: SamplingParams | None = None, *, priority: int = 0,
                          cache_key: str | None = None, best_only: bool = False) -> BeamSearchOutput: ...
