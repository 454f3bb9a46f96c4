"""GrammarManager: one per engine. Adapts the tokenizer to the backend once, compiles off the event
loop under a time bound, and caches compiled grammars by spec (the tokenizer is fixed per manager)."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

import anyio

from asyncpage.errors import GrammarError, InvalidRequestError
from asyncpage.guided.backend import CompiledGrammar, GrammarBackend, GuidedSpec

log = logging.getLogger("asyncpage")

BACKENDS = ("llguidance", "xgrammar")


class GrammarManager:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], backend: str = "llguidance",
                 compile_timeout: float = 5.0, cache_size: int = 256) -> None:
        if backend not in BACKENDS:
            raise InvalidRequestError("guided_backend", f"must be one of {BACKENDS}, got {backend!r}")
        self.backend_name = backend
        self.compile_timeout = compile_timeout
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size  # the logits width: masks are sized to it
        self._stop = sorted(stop_token_ids)
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._cache: OrderedDict[GuidedSpec, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size

    def backend(self) -> GrammarBackend:
        """Built on first use (a second or two for a 262k vocabulary), in whatever thread asks."""
        with self._backend_lock:
            if self._backend is None:
                if self.backend_name == "llguidance":
                    from asyncpage.guided.llg import LLGuidanceBackend

                    self._backend = LLGuidanceBackend(self._tokenizer, self._vocab_size, self._stop)
                else:
                    from asyncpage.guided.xgr import XGrammarBackend

                    self._backend = XGrammarBackend(self._tokenizer, self._vocab_size, self._stop)
            return self._backend

    def compile_sync(self, spec: GuidedSpec) -> CompiledGrammar:
        hit = self._cache.get(spec)
        if hit is not None:
            self._cache.move_to_end(spec)
            return hit
        compiled = self.backend().compile(spec)
        self._cache[spec] = compiled
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return compiled

    async def compile(self, spec: GuidedSpec) -> CompiledGrammar:
        """Compile in a worker thread; past `compile_timeout` seconds the caller gets a GrammarError
        and the engine is unaffected (the abandoned thread finishes on its own)."""
        hit = self._cache.get(spec)
        if hit is not None:
            self._cache.move_to_end(spec)
            return hit
        await anyio.to_thread.run_sync(self.backend)  # not counted against the grammar's time bound
        try:
            with anyio.fail_after(self.compile_timeout):
                return await anyio.to_thread.run_sync(self.compile_sync, spec, abandon_on_cancel=True)
        except TimeoutError:
            log.warning("grammar compilation gave up after %.1f s (%s)", self.compile_timeout, spec.kind)
            raise GrammarError(spec.kind, f"compiling the {spec.kind} took longer than "
                                          f"{self.compile_timeout:g} s") from None
