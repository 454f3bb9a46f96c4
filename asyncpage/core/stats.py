"""The engine's counters as one EngineStats snapshot, read off the scheduler, the KV pool and the
output processor (by the loop's own thread: EngineCore publishes the result for other readers)."""

from __future__ import annotations

from asyncpage.core.output import OutputProcessor
from asyncpage.core.scheduler import Scheduler
from asyncpage.errors import EngineDeadError
from asyncpage.kv.cache import KVCacheManager
from asyncpage.outputs import EngineStats


def engine_stats(sched: Scheduler, kv: KVCacheManager, output: OutputProcessor,
                 dead: EngineDeadError | None) -> EngineStats:
    pool, bs = kv.pool, kv.block_size
    # A block shared by forks or prefix hits holds its tokens once: count each block once, as
    # full as the furthest sequence that wrote into it.
    fill: dict[int, int] = {}
    for s in sched.running:
        for i, b in enumerate(s.table.blocks):
            n = min(bs, max(0, s.num_computed_tokens - i * bs))
            if n > fill.get(b.block_id, 0):
                fill[b.block_id] = n
    by_running, by_waiting = sched.counts_by_priority()
    kept = kv.retention.num_blocks
    # Blocks a live sequence holds: kept conversations' blocks are counted apart (kv_blocks_kept).
    used = len({b.block_id for s in (*sched.running, *sched.waiting) for b in s.table.blocks}) if kept \
        else pool.num_used
    return EngineStats(
        kv_blocks_total=pool.num_blocks, kv_blocks_used=used, kv_blocks_kept=kept,
        kv_blocks_cached=pool.num_cached_free, kv_blocks_free=pool.num_free, block_size=bs,
        num_running=sched.num_seats, num_waiting=len(sched.waiting),
        num_preemptions=sched.num_preemptions,
        prefix_cache_query_tokens=kv.query_tokens, prefix_cache_hit_tokens=kv.hit_tokens,
        kv_token_slots_allocated=used * bs, kv_token_slots_occupied=sum(fill.values()),
        num_requests_finished=output.num_finished, num_generated_tokens=output.num_generated,
        engine_error=repr(dead.__cause__) if dead is not None else None,
        prefix_cache_evictions=pool.num_evictions, spec_proposed_tokens=sched.spec.proposed,
        spec_accepted_tokens=sched.spec.accepted, num_running_by_priority=by_running,
        num_waiting_by_priority=by_waiting)
