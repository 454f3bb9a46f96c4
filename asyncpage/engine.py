"""AsyncEngine: the public entry point. Embeds a model in the caller's process and serves
`stream()`/`generate()` from one engine-loop task.

    engine = AsyncEngine.from_pretrained()          # gemma-3-270m, no network
    async with engine:
        async for chunk in engine.stream("Hello", SamplingParams(max_tokens=32)):
            print(chunk.text, end="")

The facade (vLLM V1's AsyncLLM), the top of the house: lifecycle, submission checks and the public
calls (core/loading.py builds an engine). It never touches the scheduler, the pool or a request's
state: `submit()` and `abort()` hand requests to the EngineCore (core/loop.py), applied at its safe
points. Nothing binds to an event loop before `async with` (asyncio or trio, anyio throughout).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, Self

import anyio
import msgspec
import sniffio

from asyncpage.chat import chat, chat_stream
from asyncpage.core import loading
from asyncpage.core.config import EngineConfig, EngineOptions
from asyncpage.core.loop import EngineCore
from asyncpage.core.mailbox import Mailbox
from asyncpage.core.output import request_metrics
from asyncpage.core.request import Request
from asyncpage.core.stream import RequestStream
from asyncpage.core.validation import check_beam_search, check_cache_key, check_priority, check_request, check_token_ids
from asyncpage.decoding.beam import BeamParams, EarlyStopping
from asyncpage.errors import (
    EngineDeadError,
    EngineLoopError,
    EngineNotRunningError,
    GrammarError,
    InvalidRequestError,
    QueueFullError,
)
from asyncpage.extract.many import extract_many
from asyncpage.extract.run import ExtractResult, extract_one
from asyncpage.guided import GrammarManager, GuidedSpec
from asyncpage.model.weights import LoadedModel
from asyncpage.outputs import (
    Beam,
    BeamSearchOutput,
    Choice,
    EngineStats,
    FinishedRequest,
    FinishReason,
    GenerateOutput,
    TokenLogprob,
)
from asyncpage.params import Prompt, SamplingParams
from asyncpage.runtime.compute import ComputeThread

# Prompts longer than this are tokenized in a worker thread: the event loop is never held for long.
_INLINE_TOKENIZE_CHARS = 2000
DEFAULT_MAX_QUEUED_REQUESTS = 2048


class AsyncEngine:
    """An in-process inference engine. Construct with `from_pretrained`, run with `async with`."""

    # The loop's class: a subclass may run another (asyncpage.disagg's prefill and decode workers).
    core_class: type[EngineCore] = EngineCore

    def __init__(self, loaded: LoadedModel, config: EngineConfig, compute: ComputeThread,
                 guided: GrammarManager, draft: LoadedModel | None,
                 options: EngineOptions) -> None:
        """Prefer `from_pretrained` (which calls this on the compute thread, where the KV pool is
        allocated; asyncpage.core.loading). `options`: the pool and scheduling options it was built with,
        what `clone` may override. Binds to no event loop: that happens in `async with`."""
        self.config = config
        self.compute = compute
        self.guided = guided
        self._loaded = loaded
        self._draft = draft  # the speculative "draft" method's model (shared with clones, as the target is)
        self._options = options
        self.model_source = loaded.source
        self.load_seconds = loaded.load_seconds
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        self.eos_token_ids = loaded.eos_token_ids
        self.vocab_size = int(loaded.config.vocab_size)  # the logits width
        # A scored reading's mean score (a null-or-present field's, its margin) on the reference records
        # (asyncpage.extract.decisions), by reading (None: they do not fit): measured once per engine.
        self.reading_offsets: dict[str, float | None] = {}
        self._core = self.core_class(config, loaded.model, loaded.tokenizer, compute, guided.vocab_size,
                                draft.model if draft is not None else None)
        self._open = False
        self._loop_task: Any = None
        self._task_group: Any = None
        self._limiter: anyio.CapacityLimiter | None = None
        self._preparing = 0  # submit() calls tokenizing or compiling: they count against max_queued_requests

    @property
    def model(self) -> Any:
        """The model (its weights are shared with clones; read-only)."""
        return self._loaded.model

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        model: str | os.PathLike[str] | None = None,
        *,
        dtype: str = "auto",
        device: str = "auto",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 64,
        enable_prefix_caching: bool = True,
        attention_backend: str = "auto",
        max_model_len: int | None = None,
        kv_cache_memory: int | None = None,
        num_threads: int | None = None,
        guided_backend: str = "llguidance",
        grammar_compile_timeout: float = 5.0,
        debug_checks: bool | None = None,
        eviction_policy: str | None = None,
        quantization: str | None = "auto",
        kv_cache_dtype: str = "auto",
        speculative_config: dict[str, Any] | None = None,
        compile: bool | None = None,
        max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
        chat_template: str | None = None,
    ) -> AsyncEngine:
        """Load a model: `model=None` is gemma-3-270m from its PyPI package; else a local HF directory, an HF
        hub id already in the local cache, or a .gguf file. The options (README's table, docs/ pages):
        `num_kv_blocks` (None: from `kv_cache_memory` bytes, default 1 GiB on the CPU, 80% of free GPU
        memory on CUDA); `num_threads` (torch's CPU pool; default the cores this process may use);
        `guided_backend` "llguidance" | "xgrammar", a grammar slower than `grammar_compile_timeout` s
        refused; `debug_checks` (or ASYNCPAGE_DEBUG_CHECKS=1) checks the pool's invariants every step;
        `eviction_policy` None (prefix-aware: shared prefixes kept, chain ends first) | "lru";
        `quantization` "auto" (a GGUF's quantized tensors kept in their block formats, the only copy; float
        weights stay float), "int8" / "int4" (the same, and float weights written as GGUF blocks at load: Q8_0,
        or Q4_K for int4's projections; LM head and embeddings included), None (dequantize to `dtype`);
        `kv_cache_dtype`
        "int8" / "fp8": one byte a value (a scale per token and head); `speculative_config`
        {"method": "ngram", "num_speculative_tokens": 4} or {"method": "draft", "model": PATH}
        (asyncpage.decoding.speculative, asyncpage.core.draft); `compile=True` (or ASYNCPAGE_COMPILE=1):
        decode steps of up to 8 rows through torch.compile'd layers (asyncpage.model.compiled);
        `max_queued_requests` (2048): requests not yet started past which a new one raises
        QueueFullError at once (HTTP 429 with Retry-After); `chat_template`: a Jinja template in place of
        the checkpoint's (chat, apply_chat_template; shared with clones)."""
        options = {k: v for k, v in locals().items() if k not in ("cls", "model")}  # every keyword, as given
        return loading.from_pretrained(cls, model, **options)

    def clone(self, **overrides: Any) -> AsyncEngine:
        """A second engine on the same weights and tokenizer, with its own KV pool and scheduler
        (any of from_pretrained's pool and scheduling options may differ)."""
        return loading.clone(type(self), self._loaded, self.config, self.compute, self.guided, self._options,
                             self._draft, overrides)

    # ---- lifecycle ---------------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        if self._open:
            raise RuntimeError("this engine is already running")
        core = self._core
        core.dead = None
        core.stopping = False
        from asyncpage.runtime.eventloop import LoopHandle

        core.loop = LoopHandle.current()
        self._limiter = anyio.CapacityLimiter(2)
        self._open = True
        if sniffio.current_async_library() == "asyncio":
            # A plain task on asyncio, so `async with` may be entered and exited from different tasks
            # (pytest-asyncio fixtures, app lifespans); structured (a task group) everywhere else.
            self._loop_task = asyncio.get_running_loop().create_task(core.run())
        else:
            self._task_group = anyio.create_task_group()
            await self._task_group.__aenter__()
            self._task_group.start_soon(core.run)
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: TracebackType | None) -> None:
        """Stops the loop at its next safe point (a step in flight finishes first), fails what is
        still running with EngineNotRunningError, and lets an exception from the body pass unwrapped."""
        self._open = False
        self._core.stopping = True
        self._core.wake()
        self.guided.interrupt()  # submissions waiting for a grammar compile end now, not at its timeout
        task, group = self._loop_task, self._task_group
        self._loop_task = self._task_group = None
        if task is not None:
            with anyio.CancelScope(shield=True):
                await asyncio.wait([task])  # however it ended: a loop task cancelled from outside raises nothing here
        elif group is not None:
            # Not given the body's exception: trio would wrap it in an ExceptionGroup. Not shielded
            # either (a scope around a task group's exit corrupts trio's scope stack); the loop shields
            # its step in flight itself, so a cancellation here still lets that step finish.
            await group.__aexit__(None, None, None)

    # ---- public API -------------------------------------------------------------------------
    def stream(self, prompt: Prompt, params: SamplingParams | None = None, *,
               priority: int = 0, cache_key: str | None = None) -> RequestStream[Request]:
        """Stream a completion: `async for chunk in engine.stream(prompt, params)`. A prompt is a
        str (tokenized as the tokenizer's own call does, BOS included) or a list of token ids.
        `priority`: lower runs first (vLLM's convention; default 0), ties by arrival; a waiting request
        preempts running ones of a lower priority when seats or blocks are short, and a request's
        priority rises one level for every 10 s it waits, so none starves. `cache_key`: a conversation's
        name; when the request ends its blocks (prompt and output) are kept for the key's next turn
        through eviction pressure (within half the pool, least recently used key first, let go after
        5 idle minutes; asyncpage.kv.retention), and `metrics.num_cached_prompt_tokens` says what the
        next turn found."""
        return RequestStream(self, prompt, params or SamplingParams(), priority=priority, cache_key=cache_key)

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, *,
                       priority: int = 0, cache_key: str | None = None) -> GenerateOutput:
        """Run a request to the end and return all its samples (`priority`, `cache_key` as stream's)."""
        params = params or SamplingParams()
        texts: dict[int, list[str]] = {}
        ids: dict[int, list[int]] = {}
        lps: dict[int, list[TokenLogprob]] = {}
        reasons: dict[int, FinishReason] = {}
        async with self.stream(prompt, params, priority=priority, cache_key=cache_key) as s:
            async for c in s:
                texts.setdefault(c.index, []).append(c.text)
                ids.setdefault(c.index, []).extend(c.token_ids)
                if c.logprobs:
                    lps.setdefault(c.index, []).extend(c.logprobs)
                if c.finish_reason is not None:
                    reasons[c.index] = c.finish_reason
            req = s.request
            scored = s.prompt_logprobs
        assert req is not None
        choices = [Choice(i, "".join(texts.get(i, [])), ids.get(i, []), reasons[i],
                          lps.get(i) if params.logprobs is not None else None) for i in range(params.n)]
        return GenerateOutput(list(req.prompt_token_ids), choices, request_metrics(req), scored)

    async def beam_search(self, prompt: Prompt, beam_width: int = 4, max_tokens: int = 32,
                          length_penalty: float = 1.0, early_stopping: EarlyStopping = False,
                          params: SamplingParams | None = None, *, priority: int = 0,
                          cache_key: str | None = None, best_only: bool = False) -> BeamSearchOutput:
        """The `beam_width` best continuations, best first, as transformers' `generate(num_beams=...,
        do_sample=False)` finds and ranks them. `params` carries guided decoding (each beam keeps its
        own grammar state), stop strings and ids, penalties, ignore_eos; its max_tokens is replaced by
        `max_tokens` and its sampling fields (temperature, top-p/k, seed) play no part. Beams share
        their prompt's KV blocks and each other's common prefix (copy-on-write). `priority`, `cache_key`:
        as stream's. `best_only` (length_penalty=0, early_stopping not True): only `beams[0]` is wanted, the likeliest
        continuation; beams that can no longer beat the best one found leave the search, so it ends sooner
        with the same `beams[0]` (the others are the ones found before it ended).
            out = await engine.beam_search("The capital of France is", beam_width=4, max_tokens=8)
            print(out.beams[0].text, out.beams[0].cumulative_logprob)
        """
        beam = BeamParams(beam_width=beam_width, length_penalty=length_penalty, early_stopping=early_stopping,
                          best_only=best_only)
        params = msgspec.structs.replace(params or SamplingParams(temperature=0), max_tokens=max_tokens)
        req = await self.submit(prompt, params, beam=beam, priority=priority, cache_key=cache_key)
        try:
            chunks = await req.mailbox.get()  # the loop posts every beam at once, when the search is done
        except BaseException:
            self.abort(req)  # cancelled: the beams' blocks are freed at the loop's next safe point
            raise
        assert req.beam is not None
        beams = [Beam(c.token_ids, c.text, h.cumulative_logprob, h.score, h.finish_reason)
                 for c, h in zip(chunks, req.beam.finished, strict=False)]
        return BeamSearchOutput(list(req.prompt_token_ids), beams, request_metrics(req))

    async def extract(self, prompt: Prompt, schema: Any, params: SamplingParams | None = None, *,
                      chat: bool = False, copy_from: str | Sequence[str] | None = None,
                      copy_fields: Sequence[str] | str | None = None, beam_width: int | None = None,
                      score_booleans: bool | None = None, max_retries: int = 0, confidence: bool = False,
                      score_choices: bool | None = None, priority: int = 0, cache_key: str | None = None) -> Any:
        """Generate one JSON value constrained to `schema` and return it typed: a msgspec type, a pydantic v2
        model (or a TypeAdapter-able type) or a JSON Schema dict. asyncpage.extract.run.extract_one says
        what each option does (chat, copy_from/copy_fields, beam_width, score_booleans, score_choices,
        max_retries, confidence, priority and cache_key as stream's).

            person = await engine.extract("Alice is 31. As JSON: ", Person)
        """
        return await extract_one(self, prompt, schema, params, chat=chat, copy_from=copy_from,
                                 copy_fields=copy_fields, beam_width=beam_width, score_booleans=score_booleans,
                                 max_retries=max_retries, confidence=confidence, score_choices=score_choices,
                                 priority=priority, cache_key=cache_key)

    def extract_many(self, items: Iterable[Any] | AsyncIterable[Any], schema: Any, *,
                     prompt: str | Callable[[Mapping[str, Any]], str] | None = None, concurrency: int = 32,
                     params: SamplingParams | None = None, id_field: str = "id",
                     max_prompt_tokens: int | None = None, copy_fields: Sequence[str] | str | None = None,
                     examples: Sequence[Mapping[str, Any]] = (), beam_width: int | None = None,
                     score_booleans: bool | None = None, max_retries: int = 0, confidence: bool = False,
                     score_choices: bool | None = None, priority: int = 0,
                     cache_key: str | None = None) -> AsyncIterator[ExtractResult]:
        """Extract a typed value from each record, at most `concurrency` in flight; yields ExtractResult
        in completion order (asyncpage.extract.many.extract_many says what each option does).

            async for r in engine.extract_many(docs, Invoice, concurrency=16):
                print(r.id, r.value if r.ok else r.error)
        """
        return extract_many(self, items, schema, prompt=prompt, concurrency=concurrency, params=params,
                            id_field=id_field, max_prompt_tokens=max_prompt_tokens, copy_fields=copy_fields,
                            examples=examples, beam_width=beam_width, score_booleans=score_booleans,
                            max_retries=max_retries, confidence=confidence, score_choices=score_choices,
                            priority=priority, cache_key=cache_key)

    async def chat(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                   tool_choice: Any = "auto", parallel_tool_calls: bool = True, priority: int = 0,
                   response_format: dict[str, Any] | None = None, params: SamplingParams | None = None,
                   cache_key: str | None = None, max_reasoning_tokens: int | None = None,
                   reasoning_effort: str | None = None, chat_template: str | None = None,
                   reasoning_markers: Any = None) -> Any:
        """OpenAI-shaped chat: messages (and tools) in, a typed ChatResult out. See asyncpage.chat.chat
        for the options (reasoning budgets and markers, a per-turn chat template, priority and cache_key)."""
        return await chat(self, messages, **{k: v for k, v in locals().items() if k not in ("self", "messages")})

    def chat_stream(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                    tool_choice: Any = "auto", parallel_tool_calls: bool = True, priority: int = 0,
                    response_format: dict[str, Any] | None = None, params: SamplingParams | None = None,
                    cache_key: str | None = None, max_reasoning_tokens: int | None = None,
                    reasoning_effort: str | None = None, chat_template: str | None = None,
                    reasoning_markers: Any = None) -> AsyncIterator[Any]:
        """chat() as typed deltas: content, reasoning or tool-call fragments, then finish_reason and usage."""
        return chat_stream(self, messages, **{k: v for k, v in locals().items() if k not in ("self", "messages")})

    def openai_client(self, **kwargs: Any) -> Any:
        """An `openai.AsyncOpenAI` talking to this engine in-process (no socket). Needs asyncpage[openai]."""
        from asyncpage.openai import client  # the 'openai' extra: imported when asked for

        return client(self, **kwargs)

    def apply_chat_template(self, prompt: Prompt) -> list[int]:
        """Wrap a user message in the model's chat template (with the generation prompt); token ids,
        so the template's own BOS is not doubled by the tokenizer."""
        if not isinstance(prompt, str):
            raise InvalidRequestError("chat", "the chat template applies to str prompts")
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("chat", f"{self.model_source} has no chat template")
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                  add_generation_prompt=True)
        return list(self.tokenizer(str(text), add_special_tokens=False)["input_ids"])

    def on_request_finished(self, callback: Callable[[FinishedRequest], None]) -> None:
        """Call `callback` on the event loop as each request ends (finished, aborted or failed;
        metrics exporters, logging). It must be quick; an exception in it is logged and ignored."""
        self._core.output.hooks.append(callback)

    def stats(self) -> EngineStats:
        """Pool and queue figures. Exact on the engine's loop; from another thread (a metrics scrape)
        a snapshot the loop published at most 50 ms ago."""
        return self._core.stats()

    @property
    def healthy(self) -> bool:
        """False once the engine loop has died (every caller then gets EngineDeadError)."""
        return self._core.dead is None

    # ---- submission: what extraction, chat and streams build on ------------------------------
    async def submit(self, prompt: Prompt, params: SamplingParams, mailbox: Mailbox | None = None, *,
                     beam: BeamParams | None = None, priority: int = 0, cache_key: str | None = None) -> Request:
        """Tokenize, validate, compile the grammar, and queue a request (a beam search with `beam`);
        its output arrives in `request.mailbox`. Raises a typed error naming the field, before
        anything is queued."""
        self.check_usable()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params", f"must be SamplingParams, got {type(params).__name__}")
        check_priority(priority)
        check_cache_key(cache_key)
        self._admit()
        self._preparing += 1
        try:
            return await self._submit(prompt, params, mailbox, beam, priority, cache_key)
        finally:
            self._preparing -= 1

    def _admit(self) -> None:
        """Refuse at once, before tokenizing or compiling anything, when max_queued_requests requests
        are already being prepared or waiting to start."""
        queued = self._preparing + self._core.num_queued()
        limit = self.config.max_queued_requests
        if queued >= limit:
            raise QueueFullError(f"{queued} requests are already waiting to start (max_queued_requests={limit}); "
                                 "retry later", retry_after=1.0)

    async def _submit(self, prompt: Prompt, params: SamplingParams, mailbox: Mailbox | None,
                      beam: BeamParams | None, priority: int, cache_key: str | None) -> Request:
        ids = await self.tokenize(prompt)
        check_request(ids, params, vocab_size=self.vocab_size, max_model_len=self.config.max_model_len,
                      pool_tokens=self.config.num_kv_blocks * self.config.block_size,
                      max_num_seqs=self.config.max_num_seqs)
        if beam is not None:
            check_beam_search(ids, params, beam.beam_width, max_num_seqs=self.config.max_num_seqs,
                              pool_tokens=self.config.num_kv_blocks * self.config.block_size,
                              block_size=self.config.block_size,
                              max_num_batched_tokens=self.config.max_num_batched_tokens,
                              max_model_len=self.config.max_model_len)
        spec = GuidedSpec.from_params(params)
        try:
            compiled = await self.guided.compile(spec) if spec is not None else None
        except GrammarError:
            self.check_usable()  # the engine stopped meanwhile (GrammarManager.interrupt): that is the error
            raise
        self.check_usable()  # it may have stopped while the request was being prepared
        req = self._core.new_request(ids, params, mailbox, self.eos_token_ids, compiled, beam, priority, cache_key)
        self._core.add(req)
        return req

    def abort(self, request: Request) -> None:
        """Abort a submitted request. Safe from anywhere (any thread, a finalizer): it only queues,
        and the loop frees the request's blocks at its next safe point."""
        self._core.abort(request)

    async def wait_released(self, request: Request) -> None:
        """Wait until the loop is done with `request` (its blocks are back in the pool)."""
        core = self._core
        if request.released or core.loop is None or not core.loop.is_current():
            return
        if request.released_event is None:
            request.released_event = anyio.Event()
        with anyio.CancelScope(shield=True):
            await request.released_event.wait()

    async def tokenize(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids, as submission computes them (a str gets the tokenizer's BOS)."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            try:
                if len(prompt) > _INLINE_TOKENIZE_CHARS:
                    enc = await anyio.to_thread.run_sync(self.tokenizer, prompt, limiter=self._limiter)
                else:
                    enc = self.tokenizer(prompt)
            except Exception as exc:  # unpaired surrogates and the like: the tokenizer's own refusal
                raise InvalidRequestError("prompt", f"the tokenizer refused it: {exc}") from exc
            return check_token_ids(list(enc["input_ids"]))
        if isinstance(prompt, list | tuple):
            return check_token_ids(prompt)
        raise InvalidRequestError("prompt", f"must be a str or a list of token ids, got {type(prompt).__name__}")

    def check_usable(self) -> None:
        """Raises the typed error a call would get now (dead, not running, another loop); returns
        when the engine can serve."""
        core = self._core
        if core.dead is not None:
            raise EngineDeadError(f"the engine died earlier: {core.dead.__cause__!r}") from core.dead
        if not self._open or core.loop is None:
            raise EngineNotRunningError("use the engine inside `async with engine:`")
        if not core.loop.is_current():
            raise EngineLoopError("this engine runs on another thread or event loop; call it from the loop "
                                  "that entered `async with engine:`")
