"""The two engine loops of a disaggregated pair: EngineCore with a KV export (prefill) or import
(decode) path. Everything here runs on the worker's engine loop, as EngineCore itself does; the
transfer threads (worker.py) reach it only through `call_soon_threadsafe` and `add()`.

Each worker is an AsyncEngine subclass whose `core_class` is one of these (PrefillEngine,
DecodeEngine): the pair needs nothing from the loop (`run()`) itself, only its commit and admission
points.

Prefill: a request runs with max_tokens=1. The step that computes its prompt's last token also
samples the first token; before that step commits (which frees the finished request's blocks),
the prompt's blocks get one more reference ("pinned"), so they can be read by the sender thread
while the loop goes on, then `release_pin()` gives them back.

Decode: `import_request()` queues a request whose prompt KV is on its way. Admission is in two
phases, both in `_apply_adds()` (a safe point of the loop): first its blocks are allocated, after a
prefix-cache lookup (the blocks already held are not sent again); then, once the receiver thread has
written the rest into the pool, the sequence joins the running set with its prompt computed and the
first token already appended (emitted as any sampled token would be), and decodes from there.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from asyncpage.core.loop import EngineCore
from asyncpage.core.request import Request, SeqStatus
from asyncpage.engine import AsyncEngine
from asyncpage.errors import EngineNotRunningError, PromptTooLongError
from asyncpage.kv.cache import BlockTable
from asyncpage.outputs import TokenLogprob

from .wire import Header

# on_prefilled(request, first token, its logprob, pinned table): called on the loop, once per request
# whose prompt was computed and first token sampled; the callee owns the pin (release_pin it).
OnPrefilled = Callable[[Request, int, TokenLogprob | None, BlockTable], None]


class PrefillCore(EngineCore):
    BURSTS = False  # the worker's transfers release pins on the event loop at any time (not within a burst)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_prefilled: OnPrefilled | None = None  # set by the worker before the loop starts
        self._pins: dict[int, tuple[BlockTable, int]] = {}  # id(pin) -> (pin, request id): tables no sequence owns

    def _commit(self, out: Any, result: Any, *rest: Any) -> None:
        # Pin before the commit: it finishes the request (max_tokens=1) and frees its table.
        pins: list[tuple[Any, BlockTable]] = []
        for sched in out.scheduled:
            seq = sched.seq
            if seq in sched.samples and seq.num_output_tokens == 0 and seq.status is SeqStatus.RUNNING:
                pin = self.kv.fork(seq.table)
                self._pins[id(pin)] = (pin, seq.request.request_id)
                pins.append((seq, pin))
        super()._commit(out, result, *rest)
        logprobs = dict(zip(result.seq_ids, result.sampled.logprobs, strict=True))
        for seq, pin in pins:
            if seq.num_output_tokens >= 1 and seq.finish_reason != "abort" and self.on_prefilled is not None:
                self.on_prefilled(seq.request, seq.token_ids[seq.num_prompt_tokens], logprobs.get(seq.seq_id), pin)
            else:  # aborted while the step ran, or its token was invalid (the request failed)
                self.release_pin(pin)

    def release_pin(self, pin: BlockTable) -> None:
        """On the loop, at any point between its awaits: pinned blocks belong to no step, so freeing
        them cannot change a step in flight; the next schedule() may reuse them."""
        self._pins.pop(id(pin), None)
        self.kv.free(pin)

    def _live_tables(self) -> list[tuple[BlockTable, int]]:
        """As EngineCore's, with the pinned tables."""
        return super()._live_tables() + list(self._pins.values())


@dataclass(eq=False)
class Import:
    header: Header
    req: Request
    # Set on the loop for the receiver thread: (skip, block ids to receive into), or None: drop it.
    reply: concurrent.futures.Future[tuple[int, list[int]] | None]
    allocated: bool = False


class DecodeCore(EngineCore):
    BURSTS = False  # imports are allocated on the event loop as they arrive (not within a burst)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._imports: dict[int, Import] = {}  # request_id -> its import, until admitted or dropped
        self._blocked: list[Request] = []  # allocation waits for free blocks or a seat

    # ---- from the worker (on the loop) ----------------------------------------------------------
    def import_request(self, header: Header, stop_token_ids: frozenset[int],
                       reply: concurrent.futures.Future[tuple[int, list[int]] | None]) -> Request:
        """A request whose prompt KV (and first token) comes from the prefill worker. `reply` is
        answered once its blocks are allocated; call `imported(req)` once they are written."""
        req = self.new_request(list(header.prompt_token_ids), header.params, None, stop_token_ids, None)
        gen = req.seqs[0].generator
        if gen is not None:
            # The prefill worker drew the first token's one uniform from an identically seeded
            # generator (sampling.py): draw it here too, so a seeded request samples as one engine would.
            torch.rand(1, generator=gen, dtype=torch.float64)
        self._imports[req.request_id] = Import(header, req, reply)
        self.add(req)
        return req

    def imported(self, req: Request) -> None:
        """The receiver thread wrote the payload: admit it at the next safe point (thread-safe)."""
        self.add(req)

    # ---- admission (safe points) ----------------------------------------------------------------
    def _apply_adds(self) -> None:
        plain = []
        while self._adds:
            req = self._adds.popleft()
            imp = self._imports.get(req.request_id)
            if imp is None:
                plain.append(req)
            elif not imp.allocated:
                self._blocked.append(req)
            else:
                self._admit(req, imp)
        blocked, self._blocked = self._blocked, []
        for req in blocked:
            self._allocate(req)
        self._adds.extend(plain)
        super()._apply_adds()

    def _allocate(self, req: Request) -> None:
        imp = self._imports[req.request_id]
        if req.abort_requested or self.stopping:
            self._drop(req, imp)
            self._drop_queued(req)
            return
        seq, kv, sched = req.seqs[0], self.kv, self.scheduler
        n = len(seq.token_ids)  # the prompt: its KV is what arrives
        cached = kv.find_cached_prefix(seq.token_ids, req.params.cache_salt, seq.prefix_digests)
        start = len(cached) * kv.block_size
        busy = bool(sched.running) or any(i.allocated for i in self._imports.values())
        seats = sched.num_seats + sum(1 for i in self._imports.values() if i.allocated)
        if seats >= sched.max_num_seqs or not kv.can_allocate(seq.table, start, n, cached,
                                                              reserve=kv.watermark if busy else 0):
            if not busy and not sched.waiting:
                # Nothing will ever free a block for it (validation should have refused it first).
                self._drop(req, imp)
                req.mailbox.fail(PromptTooLongError("prompt", f"{n} tokens do not fit the decode pool"))
                self._release(req)
            else:
                self._blocked.append(req)
            return
        kv.allocate(seq.table, start, n, cached)  # no copy-on-write: `start` is on a block boundary
        kv.record_query(n, start)
        req.num_cached_prompt_tokens = start
        imp.allocated = True
        if len(seq.table.blocks) != imp.header.num_blocks:
            self._drop(req, imp)
            req.mailbox.fail(ValueError(f"block count mismatch: {len(seq.table.blocks)} here, "
                                        f"{imp.header.num_blocks} sent"))
            self._release(req)
            return
        imp.reply.set_result((len(cached), seq.table.ids[len(cached):]))

    def _admit(self, req: Request, imp: Import) -> None:
        del self._imports[req.request_id]
        if req.abort_requested or self.stopping:
            self._drop(req, imp)
            self._drop_queued(req)
            return
        seq, h, sched = req.seqs[0], imp.header, self.scheduler
        now = time.monotonic()
        req.times.first_scheduled = now
        seq.num_computed_tokens = len(seq.token_ids)
        self.kv.cache_full_blocks(seq.table, seq.token_ids, seq.num_computed_tokens, req.params.cache_salt)
        seq.token_ids.append(h.first_token)
        seq.status = SeqStatus.RUNNING
        sched.running.append(seq)
        self._requests[req.request_id] = req
        # The scheduler's own stop checks (Scheduler._stop_reason), for the token it did not sample.
        if h.first_token in req.stop_ids:
            sched.finish(seq, "stop")
        elif seq.num_output_tokens >= req.params.max_tokens or seq.num_tokens >= sched.max_model_len:
            sched.finish(seq, "length")
        if self.output.process(seq, [h.first_token], h.first_logprob, now) is not None:  # a stop string
            sched.stop(seq, 0)
        if req.finished:
            self._release(req)

    def _drop(self, req: Request, imp: Import) -> None:
        """Give back whatever the import holds; the receiver thread hears "drop" if still asking."""
        self._imports.pop(req.request_id, None)
        seq = req.seqs[0]
        self.kv.free(seq.table)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = "abort"
        if not imp.reply.done():
            imp.reply.set_result(None)

    def _close_all(self) -> None:
        """The loop is ending: imports not admitted yet hold blocks and a caller; free and fail them."""
        for imp in list(self._imports.values()):
            if imp.req in self._adds:
                self._adds.remove(imp.req)
        self._blocked.clear()
        for imp in list(self._imports.values()):
            self._drop(imp.req, imp)
            imp.req.mailbox.fail(self.dead or EngineNotRunningError("the engine was closed"))
            self._release(imp.req)
        super()._close_all()

    def _live_tables(self) -> list[tuple[BlockTable, int]]:
        """As EngineCore's, with the tables of imports that hold blocks but do not run yet."""
        return super()._live_tables() + [(imp.req.seqs[0].table, rid) for rid, imp in self._imports.items()]


class PrefillEngine(AsyncEngine):
    core_class = PrefillCore


class DecodeEngine(AsyncEngine):
    core_class = DecodeCore
