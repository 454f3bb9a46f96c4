"""AsyncEngine: the public entry point. Embeds a model in the caller's process and serves
`stream()`/`generate()` from one engine-loop task.

    engine = AsyncEngine.from_pretrained()          # gemma-3-270m, no network
    async with engine:
        async for chunk in engine.stream("Hello", SamplingParams(max_tokens=32)):
            print(chunk.text, end="")

The loop (one task per engine): apply aborts -> Scheduler.schedule() -> ModelRunner.prepare() on
the loop -> ModelRunner.execute() in a worker thread (the event loop never waits on a forward) ->
apply aborts that arrived meanwhile -> Scheduler.update() -> detokenize, stop strings -> mailboxes.
Nothing binds to an event loop before `async with`, so an engine can be reopened under a new loop
or under trio (anyio throughout).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import random
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import anyio
import msgspec
import sniffio
import torch

from asyncpage.compute import ComputeThread
from asyncpage.detokenizer import IncrementalDetokenizer
from asyncpage.errors import (
    EngineDeadError,
    EngineNotRunningError,
    ExtractionError,
    InvalidRequestError,
    PromptTooLongError,
)
from asyncpage.extract import DEFAULT_PROMPT, ExtractResult, decode_value, extract_many, json_params
from asyncpage.guided import GrammarManager, GuidedSpec
from asyncpage.kv_cache import KVCacheManager
from asyncpage.outputs import (
    Choice,
    EngineStats,
    FinishedRequest,
    FinishReason,
    GenerateOutput,
    RequestMetrics,
    StreamChunk,
    TokenLogprob,
)
from asyncpage.params import SamplingParams
from asyncpage.request import Request, SeqStatus, Sequence
from asyncpage.runner import ModelRunner, StepResult, kv_bytes_per_block
from asyncpage.scheduler import Scheduler, SchedulerOutput
from asyncpage.weights import LoadedModel, load

log = logging.getLogger("asyncpage")

Prompt = str | list[int]


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    dtype: str
    device: str
    block_size: int
    num_kv_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_prefix_caching: bool
    attention_backend: str
    num_threads: int


# ---- per-request output channel -------------------------------------------------------------
@dataclass
class _Pending:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None


class Mailbox:
    """Single-slot mailbox per request: output that arrives before the consumer reads is merged into
    one pending chunk per sample. Memory stays bounded by the request's own output and the engine
    never waits for a slow reader."""

    def __init__(self, notify: Callable[[], None] | None = None) -> None:
        self._pending: dict[int, _Pending] = {}
        self._event: anyio.Event | None = None
        self.error: BaseException | None = None
        self._notify = notify  # extract_many: one wake-up shared by many requests

    def put(self, index: int, text: str, token_ids: list[int], logprob: TokenLogprob | None,
            finish_reason: FinishReason | None) -> None:
        p = self._pending.setdefault(index, _Pending())
        p.text += text
        p.token_ids += token_ids
        if logprob is not None:
            p.logprobs = [*(p.logprobs or []), logprob]
        if finish_reason is not None:
            p.finish_reason = finish_reason
        self._wake()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._wake()

    def _wake(self) -> None:
        if self._event is not None:
            self._event.set()
        if self._notify is not None:
            self._notify()

    def drain(self) -> dict[int, _Pending]:
        """Everything pending, without waiting (for a reader that only looks once the request is done)."""
        out, self._pending = self._pending, {}
        return out

    async def get(self) -> list[StreamChunk]:
        while not self._pending and self.error is None:
            self._event = anyio.Event()
            await self._event.wait()
            self._event = None
        if self._pending:
            chunks = [StreamChunk(i, p.text, p.token_ids, p.finish_reason, p.logprobs)
                      for i, p in sorted(self._pending.items())]
            self._pending.clear()
            return chunks
        assert self.error is not None
        raise self.error


class RequestStream:
    """What `engine.stream()` returns: an async iterator of StreamChunk, and an async context
    manager. Leaving `async for` early, `aclose()`, cancelling the consuming task or dropping the
    object all abort the request and free its blocks."""

    def __init__(self, engine: AsyncEngine, prompt: Prompt, params: SamplingParams) -> None:
        self._engine = engine
        self._prompt = prompt
        self._params = params
        self._request: Request | None = None
        self._buffer: deque[StreamChunk] = deque()
        self._open = 0  # samples not finished yet
        self._closed = False

    @property
    def request(self) -> Request | None:
        return self._request

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> StreamChunk:
        if self._closed:
            raise StopAsyncIteration
        try:
            if self._request is None:
                self._request = await self._engine._submit(self._prompt, self._params)
                self._open = self._params.n
            while not self._buffer:
                if self._open == 0:
                    self._closed = True
                    raise StopAsyncIteration
                for chunk in await self._request.mailbox.get():
                    self._buffer.append(chunk)
                    if chunk.finish_reason is not None:
                        self._open -= 1
            return self._buffer.popleft()
        except BaseException as exc:
            # CancelledError (asyncio) / trio.Cancelled / an engine error: abort and pass it on.
            if not isinstance(exc, StopAsyncIteration):
                self._abort()
            raise

    async def aclose(self) -> None:
        self._abort()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._abort()

    def __del__(self) -> None:
        # `break` out of `async for` drops the last reference at once: free the blocks now rather
        # than whenever an async-generator finalizer would run.
        self._abort()

    def _abort(self) -> None:
        if not self._closed:
            self._closed = True
            if self._request is not None and not self._request.finished:
                self._engine._abort(self._request)


# ---- the engine -------------------------------------------------------------------------------
class AsyncEngine:
    """An in-process inference engine. Construct with `from_pretrained`, run with `async with`."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, compute: ComputeThread,
                 guided: GrammarManager) -> None:
        """Prefer `from_pretrained` (which calls this on the compute thread, where the KV pool is
        allocated). Binds to no event loop: that happens in `async with`."""
        self.config = config
        self.compute = compute
        self.guided = guided
        self._loaded = loaded
        self._options: dict[str, Any] = {}
        self.model_source = loaded.source
        self.load_seconds = loaded.load_seconds
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        self.eos_token_ids = loaded.eos_token_ids
        self.vocab_size = int(loaded.config.vocab_size)
        dtype = getattr(torch, config.dtype)
        self.kv = KVCacheManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.runner = ModelRunner(loaded.model, config.num_kv_blocks, config.block_size, dtype,
                                  torch.device(config.device))
        self.scheduler = Scheduler(self.kv, config.max_num_batched_tokens, config.max_num_seqs,
                                   config.max_model_len, self._make_generator)
        self._ids = itertools.count(1)
        self._requests: dict[int, Request] = {}
        self._aborts: deque[Request] = deque()
        self._wake_event: anyio.Event | None = None
        self._task_group: Any = None
        self._loop_task: Any = None
        self._running = False
        self._in_step = False
        self._dead: EngineDeadError | None = None
        self._seed_rng = random.SystemRandom()
        self._finished = 0
        self._generated = 0
        self._finish_hooks: list[Callable[[FinishedRequest], None]] = []

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
    ) -> AsyncEngine:
        """Load a model. `model=None` is gemma-3-270m from its PyPI package; else a local HF
        directory, an HF hub id already in the local cache, or a .gguf file.
        `num_kv_blocks=None` sizes the pool from `kv_cache_memory` bytes (default: 1 GiB on the CPU,
        80% of free GPU memory on CUDA). `num_threads` sets torch's (process-wide) CPU thread pool;
        default: the cores this process may use. Guided decoding uses `guided_backend` ("llguidance" or
        "xgrammar"); a grammar that takes longer than `grammar_compile_timeout` s is refused."""
        dev = _resolve_device(device)
        dt = _resolve_dtype(dtype, dev)
        options = dict(block_size=block_size, num_kv_blocks=num_kv_blocks,
                       max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                       enable_prefix_caching=enable_prefix_caching, attention_backend=attention_backend,
                       max_model_len=max_model_len, kv_cache_memory=kv_cache_memory,
                       guided_backend=guided_backend, grammar_compile_timeout=grammar_compile_timeout)
        _check_options(options)
        threads = num_threads or len(os.sched_getaffinity(0))
        # All torch work on one thread with one deliberately sized pool (see compute.py).
        compute = ComputeThread(threads)
        loaded = compute.run(load, model, getattr(torch, dt), torch.device(dev))
        return compute.run(cls._build, loaded, dt, dev, compute, options)

    def clone(self, **overrides: Any) -> AsyncEngine:
        """A second engine on the same weights and tokenizer, with its own KV pool and scheduler
        (any of from_pretrained's pool and scheduling options may differ)."""
        bad = set(overrides) - set(self._options)
        if bad:
            raise InvalidRequestError(sorted(bad)[0], "cannot differ between engines sharing weights")
        options = {**self._options, **overrides}
        _check_options(options)
        return self.compute.run(self._build, self._loaded, self.config.dtype, self.config.device, self.compute,
                                options)

    @classmethod
    def _build(cls, loaded: LoadedModel, dt: str, dev: str, compute: ComputeThread,
               options: dict[str, Any]) -> AsyncEngine:
        mc = loaded.config
        block_size = options["block_size"]
        ctx = int(getattr(mc, "max_position_embeddings", 8192))
        max_len = min(ctx, options["max_model_len"]) if options["max_model_len"] else ctx
        num_kv_blocks = options["num_kv_blocks"]
        if num_kv_blocks is None:
            per_block = kv_bytes_per_block(loaded.model, block_size, getattr(torch, dt))
            budget = options["kv_cache_memory"]
            if budget is None:
                budget = int(torch.cuda.mem_get_info()[0] * 0.8) if dev == "cuda" else 1 << 30
            num_kv_blocks = max(1, budget // per_block)
            # A pool larger than max_num_seqs full contexts is memory nobody can use.
            num_kv_blocks = min(num_kv_blocks, options["max_num_seqs"] * math.ceil(max_len / block_size))
        config = EngineConfig(
            dtype=dt, device=dev, block_size=block_size, num_kv_blocks=num_kv_blocks,
            max_num_batched_tokens=options["max_num_batched_tokens"], max_num_seqs=options["max_num_seqs"],
            max_model_len=max_len, enable_prefix_caching=options["enable_prefix_caching"],
            attention_backend=_resolve_backend(options["attention_backend"], dev), num_threads=compute.num_threads)
        engine = cls(loaded, config, compute, GrammarManager(
            loaded.tokenizer, int(mc.vocab_size), sorted(loaded.eos_token_ids), options["guided_backend"],
            options["grammar_compile_timeout"]))
        engine._options = options
        if config.attention_backend == "triton":
            from asyncpage.kernels import use_triton_attention

            use_triton_attention(engine.runner)
        return engine

    # ---- lifecycle ---------------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        if self._running:
            raise RuntimeError("this engine is already running")
        self._dead = None
        self._running = True
        if sniffio.current_async_library() == "asyncio":
            # A plain task on asyncio, so `async with` may be entered and exited from different tasks
            # (pytest-asyncio fixtures, app lifespans); structured (a task group) everywhere else.
            import asyncio

            self._loop_task = asyncio.get_running_loop().create_task(self._loop())
        else:
            self._task_group = anyio.create_task_group()
            await self._task_group.__aenter__()
            self._task_group.start_soon(self._loop)
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        self._running = False
        closed = EngineNotRunningError("the engine was closed")
        for req in list(self._requests.values()):
            self._abort(req)
            req.mailbox.fail(closed)
        self._apply_aborts()
        self._wake()
        try:
            if self._loop_task is not None:
                self._loop_task.cancel()
                # Shielded: a step in flight finishes before we return, so no worker thread
                # outlives the engine's `async with`.
                with anyio.CancelScope(shield=True):
                    try:
                        await self._loop_task
                    except BaseException:
                        pass
                return None
            self._task_group.cancel_scope.cancel()
            return await self._task_group.__aexit__(et, ev, tb)
        finally:
            self._task_group = None
            self._loop_task = None
            self._wake_event = None

    # ---- public API -------------------------------------------------------------------------
    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> RequestStream:
        """Stream a completion: `async for chunk in engine.stream(prompt, params)`. A prompt is a
        str (tokenized as the tokenizer's own call does, BOS included) or a list of token ids."""
        return RequestStream(self, prompt, params or SamplingParams())

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None) -> GenerateOutput:
        """Run a request to the end and return all its samples."""
        params = params or SamplingParams()
        texts: dict[int, list[str]] = {}
        ids: dict[int, list[int]] = {}
        lps: dict[int, list[TokenLogprob]] = {}
        reasons: dict[int, FinishReason] = {}
        async with self.stream(prompt, params) as s:
            async for c in s:
                texts.setdefault(c.index, []).append(c.text)
                ids.setdefault(c.index, []).extend(c.token_ids)
                if c.logprobs:
                    lps.setdefault(c.index, []).extend(c.logprobs)
                if c.finish_reason is not None:
                    reasons[c.index] = c.finish_reason
            req = s.request
        assert req is not None
        choices = [Choice(i, "".join(texts.get(i, [])), ids.get(i, []), reasons[i],
                          lps.get(i) if params.logprobs is not None else None) for i in range(params.n)]
        return GenerateOutput(list(req.prompt_token_ids), choices, _metrics(req))

    async def extract(self, prompt: Prompt, schema: Any, params: SamplingParams | None = None, *,
                      chat: bool = False) -> Any:
        """Generate one JSON value constrained to `schema` and return it typed.

        `schema` is a msgspec.Struct type (or any type msgspec can describe: its JSON Schema is used and
        the result is decoded into it) or a JSON Schema dict (the result is the decoded JSON). `params`
        defaults to greedy with max_tokens=1024; its json_schema is replaced by `schema`. With
        `chat=True` the prompt is wrapped in the model's chat template. Raises GrammarError for an
        unsupported schema, ExtractionError when the output is cut at max_tokens or does not decode.

            class Invoice(msgspec.Struct):
                number: str
                total: float
            inv = await engine.extract("Invoice INV-7, total 12.50 EUR. JSON:", Invoice)
        """
        params, target = json_params(schema, params)
        if chat:
            prompt = self.apply_chat_template(prompt)
        out = await self.generate(prompt, params)
        if out.finish_reason == "length":
            raise ExtractionError("truncated", f"output reached max_tokens={params.max_tokens} before the "
                                  "value was complete", out.text)
        try:
            return decode_value(out.text, target)
        except msgspec.DecodeError as exc:
            raise ExtractionError("invalid", str(exc), out.text) from exc

    def extract_many(self, items: Iterable[Any] | AsyncIterable[Any], schema: Any, *,
                     prompt: str | Callable[[Mapping[str, Any]], str] = DEFAULT_PROMPT, concurrency: int = 32,
                     params: SamplingParams | None = None, id_field: str = "id",
                     max_prompt_tokens: int | None = None) -> AsyncIterator[ExtractResult]:
        """Extract a typed value from each record, at most `concurrency` in flight.

        `items`: records (dicts, or plain strings as {"text": ...}), sync or async iterable, read
        lazily. `prompt`: a template over the record's fields (default "{text}\n\nThe information
        above as JSON: ") or a function of the record. Yields ExtractResult in completion order, each
        with the record's `id_field` (or its 1-based position), its value or its own error.

            async for r in engine.extract_many(docs, Invoice, concurrency=16):
                print(r.id, r.value if r.ok else r.error)
        """
        return extract_many(self, items, schema, prompt=prompt, concurrency=concurrency, params=params,
                            id_field=id_field, max_prompt_tokens=max_prompt_tokens)

    async def chat(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                   tool_choice: Any = "auto", parallel_tool_calls: bool = True,
                   response_format: dict[str, Any] | None = None, params: SamplingParams | None = None) -> Any:
        """OpenAI-shaped chat: messages (and tools) in, a typed ChatResult out. See asyncpage.chat."""
        from asyncpage.chat import chat

        return await chat(self, messages, tools=tools, tool_choice=tool_choice,
                          parallel_tool_calls=parallel_tool_calls, response_format=response_format, params=params)

    def chat_stream(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                    tool_choice: Any = "auto", parallel_tool_calls: bool = True,
                    response_format: dict[str, Any] | None = None,
                    params: SamplingParams | None = None) -> AsyncIterator[Any]:
        """chat() as typed deltas: content, reasoning or tool-call fragments, then finish_reason and usage."""
        from asyncpage.chat import chat_stream

        return chat_stream(self, messages, tools=tools, tool_choice=tool_choice,
                           parallel_tool_calls=parallel_tool_calls, response_format=response_format, params=params)

    def openai_client(self, **kwargs: Any) -> Any:
        """An `openai.AsyncOpenAI` talking to this engine in-process (no socket). Needs asyncpage[openai]."""
        from asyncpage.openai import client

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
        """Call `callback` on the event loop as each request ends (metrics exporters, logging).
        It must be quick; an exception in it is logged and otherwise ignored."""
        self._finish_hooks.append(callback)

    def stats(self) -> EngineStats:
        pool = self.kv.pool
        used_slots = sum(min(s.num_computed_tokens, len(s.table.blocks) * self.kv.block_size)
                         for s in self.scheduler.running)
        return EngineStats(
            kv_blocks_total=pool.num_blocks, kv_blocks_used=pool.num_used,
            kv_blocks_cached=pool.num_cached_free, kv_blocks_free=pool.num_free,
            block_size=self.kv.block_size,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_query_tokens=self.kv.query_tokens, prefix_cache_hit_tokens=self.kv.hit_tokens,
            kv_token_slots_allocated=pool.num_used * self.kv.block_size, kv_token_slots_occupied=used_slots,
            num_requests_finished=self._finished, num_generated_tokens=self._generated,
            engine_error=repr(self._dead.__cause__) if self._dead is not None else None)

    # ---- submission -------------------------------------------------------------------------
    async def _submit(self, prompt: Prompt, params: SamplingParams, mailbox: Mailbox | None = None) -> Request:
        if self._dead is not None:
            raise EngineDeadError(f"the engine died earlier: {self._dead.__cause__!r}") from self._dead
        if not self._running:
            raise EngineNotRunningError("use the engine inside `async with engine:`")
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params", f"must be SamplingParams, got {type(params).__name__}")
        ids = await self._tokenize(prompt)
        self._validate(ids, params)
        spec = GuidedSpec.from_params(params)
        compiled = await self.guided.compile(spec) if spec is not None else None
        if self._dead is not None or not self._running:  # it may have changed while tokenizing
            raise EngineNotRunningError("the engine stopped while the request was being prepared")
        rid = next(self._ids)
        stop_ids = frozenset() if params.ignore_eos else self.eos_token_ids
        req = Request(rid, ids, params, mailbox or Mailbox(), stop_ids)
        seq = Sequence(
            seq_id=self.scheduler.new_seq_id(), index=0, request=req, token_ids=list(ids),
            generator=self._make_generator(req, 0), detokenizer=self._detokenizer(ids, params),
            num_prompt_tokens=len(ids), matcher=compiled.new_matcher() if compiled is not None else None)
        req.seqs.append(seq)
        self._requests[rid] = req
        self.scheduler.add(seq)
        self._wake()
        return req

    async def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            # Long prompts are tokenized in a worker thread: the event loop is never held for long.
            if len(prompt) > 2000:
                enc = await anyio.to_thread.run_sync(self.tokenizer, prompt)
            else:
                enc = self.tokenizer(prompt)
            return list(enc["input_ids"])
        if isinstance(prompt, list | tuple):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise InvalidRequestError("prompt", "token ids must be integers")
            return list(prompt)
        raise InvalidRequestError("prompt", f"must be a str or a list of token ids, got {type(prompt).__name__}")

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError("prompt", f"token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise InvalidRequestError("stop_token_ids", f"token id {bad[0]} outside the vocabulary")
        max_len = self.config.max_model_len
        if len(ids) >= max_len:
            raise PromptTooLongError("prompt", f"{len(ids)} tokens; the context holds {max_len} (prompt + output)")
        pool_tokens = self.kv.num_blocks * self.kv.block_size
        if len(ids) >= pool_tokens:
            raise PromptTooLongError("prompt", f"{len(ids)} tokens can never fit the KV pool ({pool_tokens} tokens)")
        need = min(len(ids) + params.max_tokens, max_len)
        if need > pool_tokens:
            raise PromptTooLongError(
                "max_tokens", f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) exceeds the KV pool "
                f"({pool_tokens} tokens); lower max_tokens or raise num_kv_blocks")

    def _detokenizer(self, ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.skip_special_tokens)

    def _make_generator(self, req: Request, index: int) -> torch.Generator | None:
        p = req.params
        if p.greedy:
            return None
        if p.seed is None:
            seed = self._seed_rng.getrandbits(63)
        else:
            # Sample i of a seeded request gets its own stream, reproducible on its own.
            seed = p.seed if index == 0 else hash((p.seed, index)) & ((1 << 63) - 1)
        g = torch.Generator()
        g.manual_seed(seed)
        return g

    # ---- aborts ------------------------------------------------------------------------------
    def _abort(self, req: Request) -> None:
        """Safe from any code path on the loop thread (a finalizer included): the request is queued
        and freed before the next step, or after the step in flight, before that step commits."""
        if req.request_id in self._requests:
            self._aborts.append(req)
            if not self._in_step:
                self._apply_aborts()
            self._wake()

    def _apply_aborts(self) -> None:
        while self._aborts:
            req = self._aborts.popleft()
            for seq in req.seqs:
                self.scheduler.finish(seq, "abort")
            if self._requests.pop(req.request_id, None) is not None:
                req.times.finished = time.monotonic()
                self._report(req)

    def _report(self, req: Request) -> None:
        if not self._finish_hooks:
            return
        done = FinishedRequest(
            request_id=req.request_id, num_prompt_tokens=len(req.prompt_token_ids),
            num_generated_tokens=sum(s.num_output_tokens for s in req.seqs),
            finish_reasons=[s.finish_reason or "abort" for s in req.seqs], metrics=_metrics(req))
        for hook in self._finish_hooks:
            try:
                hook(done)
            except Exception:
                log.exception("on_request_finished callback failed")

    def _wake(self) -> None:
        if self._wake_event is not None:
            self._wake_event.set()

    # ---- the loop ----------------------------------------------------------------------------
    async def _loop(self) -> None:
        try:
            while self._running:
                self._apply_aborts()
                if not self.scheduler.has_work:
                    self._wake_event = anyio.Event()
                    await self._wake_event.wait()
                    continue
                out = self.scheduler.schedule()
                if not out:
                    await anyio.sleep(0.001)  # nothing fits yet; should not happen, but never spin
                    continue
                batch = self.runner.prepare(out)
                self._in_step = True
                try:
                    result = await self.compute.arun(self.runner.execute, batch)
                finally:
                    self._in_step = False
                self._apply_aborts()
                self._commit(out, result)
        except Exception as exc:
            self._die(exc)

    def _commit(self, out: SchedulerOutput, result: StepResult) -> None:
        now = time.monotonic()
        for sched in out.scheduled:
            times = sched.seq.request.times
            if times.first_scheduled is None:
                times.first_scheduled = now
        sampled = dict(zip(result.seq_ids, result.sampled.tokens, strict=True))
        logprobs = dict(zip(result.seq_ids, result.sampled.logprobs, strict=True))
        for seq, tokens in self.scheduler.update(out, sampled, result.grammar_done, result.forced):
            self._generated += len(tokens)
            req = seq.request
            t = req.times
            if t.first_token is None:
                t.first_token = now
            elif seq.index == 0 and t.last_token is not None:
                t.inter_token.append(now - t.last_token)
            if seq.index == 0:
                t.last_token = now
            assert seq.detokenizer is not None
            text = ""
            for token in tokens:
                is_stop = token in seq.params.stop_token_ids or token in req.stop_token_ids
                text += seq.detokenizer.add(token, is_stop_token=is_stop)
            if seq.detokenizer.stopped and seq.status is SeqStatus.RUNNING:
                self.scheduler.finish(seq, "stop")
            if seq.status is SeqStatus.FINISHED:
                text += seq.detokenizer.finish()
            # Logprobs exist only for sampled tokens; fast-forward is off for requests that ask for them.
            req.mailbox.put(seq.index, text, tokens, logprobs.get(seq.seq_id), seq.finish_reason)
            if req.finished:
                t.finished = now
                self._finished += 1
                self._requests.pop(req.request_id, None)
                self._report(req)

    def _die(self, exc: BaseException) -> None:
        log.error("asyncpage engine loop failed; failing every request", exc_info=exc)
        dead = EngineDeadError(f"the engine loop failed: {exc!r}")
        dead.__cause__ = exc
        self._dead = dead
        for req in list(self._requests.values()):
            for seq in req.seqs:
                self.scheduler.finish(seq, "abort")
            req.mailbox.fail(dead)
        self._requests.clear()


def _metrics(req: Request) -> RequestMetrics:
    t = req.times
    first_sched = t.first_scheduled or t.arrival
    first = t.first_token or first_sched
    end = t.finished or t.last_token or first
    return RequestMetrics(
        queue_time=first_sched - t.arrival, ttft=first - t.arrival, prefill_time=first - first_sched,
        decode_time=(t.last_token or first) - first, e2e=end - t.arrival,
        inter_token_latencies=list(t.inter_token), num_preemptions=req.num_preemptions,
        num_cached_prompt_tokens=req.num_cached_prompt_tokens)


def _check_options(o: dict[str, Any]) -> None:
    bs = o["block_size"]
    if not isinstance(bs, int) or bs < 1 or bs & (bs - 1):
        raise InvalidRequestError("block_size", f"must be a power of two, got {bs!r}")
    for name in ("max_num_batched_tokens", "max_num_seqs"):
        if not isinstance(o[name], int) or o[name] < 1:
            raise InvalidRequestError(name, f"must be an integer >= 1, got {o[name]!r}")
    for name in ("num_kv_blocks", "max_model_len", "kv_cache_memory"):
        if o[name] is not None and (not isinstance(o[name], int) or o[name] < 1):
            raise InvalidRequestError(name, f"must be None or an integer >= 1, got {o[name]!r}")
    if o["guided_backend"] not in ("llguidance", "xgrammar"):
        raise InvalidRequestError("guided_backend", f"must be llguidance or xgrammar, got {o['guided_backend']!r}")
    t = o["grammar_compile_timeout"]
    if not isinstance(t, int | float) or t <= 0:
        raise InvalidRequestError("grammar_compile_timeout", f"must be > 0 seconds, got {t!r}")
    if o["attention_backend"] not in ("auto", "torch", "triton"):
        raise InvalidRequestError("attention_backend", f"must be torch, triton or auto, got {o['attention_backend']!r}")


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise InvalidRequestError("device", f"must be 'cpu', 'cuda' or 'auto', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError("device", "CUDA is not available in this torch build / machine")
    return device


def _resolve_dtype(dtype: str, device: str) -> str:
    if dtype == "auto":
        if device == "cuda":
            return "bfloat16"
        # bf16 on CPUs with native bf16 dot products (AVX512-BF16/AMX): half the weight traffic.
        bf16 = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")()
        native = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
        return "bfloat16" if native or "AMX" in str(bf16) else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise InvalidRequestError("dtype", f"must be float32, bfloat16, float16 or auto, got {dtype!r}")
    return dtype


def _resolve_backend(backend: str, device: str) -> str:
    if backend == "auto":
        return "triton" if device == "cuda" else "torch"
    if backend not in ("torch", "triton"):
        raise InvalidRequestError("attention_backend", f"must be torch, triton or auto, got {backend!r}")
    if backend == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise InvalidRequestError("attention_backend", "the Triton kernels run on the CPU only under Triton's "
                                  "interpreter: set TRITON_INTERPRET=1 before importing asyncpage (slow; for tests)")
    return backend
