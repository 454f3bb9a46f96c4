"""Prometheus exposition (optional; needs `prometheus-client`), under vLLM-like names.

    from prometheus_client import start_http_server
    from asyncpage.metrics import PrometheusMetrics
    PrometheusMetrics(engine)        # registers on prometheus_client's default registry
    start_http_server(9400)

Gauges are read from `engine.stats()` at scrape time; per-request figures (TTFT, inter-token
latency, queue / prefill / decode time, finish reason) are observed as each request finishes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from asyncpage.engine import AsyncEngine
from asyncpage.outputs import FinishedRequest

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)


class PrometheusMetrics:
    def __init__(self, engine: AsyncEngine, registry: Any = None, prefix: str = "asyncpage") -> None:
        from prometheus_client import REGISTRY, Counter, Histogram
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        self.registry = registry if registry is not None else REGISTRY
        self.engine = engine
        p = prefix

        def hist(name: str, doc: str) -> Any:
            return Histogram(f"{p}:{name}", doc, buckets=_LATENCY_BUCKETS, registry=self.registry)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive tokens of a request")
        self.e2e = hist("e2e_request_latency_seconds", "Submission to last token")
        self.queue = hist("request_queue_time_seconds", "Submission to first scheduled")
        self.prefill = hist("request_prefill_time_seconds", "First scheduled to first token")
        self.decode = hist("request_decode_time_seconds", "First to last token")
        self.success = Counter(f"{p}:request_success", "Finished requests by finish reason", ["finished_reason"],
                               registry=self.registry)
        self.prompt_tokens = Counter(f"{p}:prompt_tokens", "Prompt tokens of finished requests",
                                     registry=self.registry)
        self.generation_tokens = Counter(f"{p}:generation_tokens", "Generated tokens of finished requests",
                                         registry=self.registry)

        class _Gauges:
            def collect(_self) -> Iterator[Any]:
                s = engine.stats()

                def g(name: str, doc: str, value: float) -> Any:
                    return GaugeMetricFamily(f"{p}:{name}", doc, value=value)

                yield g("num_requests_running", "Sequences running", s.num_running)
                yield g("num_requests_waiting", "Sequences waiting", s.num_waiting)
                yield g("kv_cache_usage_perc", "Fraction of KV blocks in use", s.kv_blocks_used / s.kv_blocks_total)
                yield g("kv_cache_blocks_cached", "Free KV blocks holding a reusable prefix", s.kv_blocks_cached)
                yield g("kv_cache_token_slots_allocated", "Token slots in used blocks", s.kv_token_slots_allocated)
                yield g("kv_cache_token_slots_occupied", "Token slots holding KV", s.kv_token_slots_occupied)
                yield CounterMetricFamily(f"{p}:num_preemptions", "Preemptions", value=s.num_preemptions)
                yield CounterMetricFamily(f"{p}:prefix_cache_queries", "Prompt tokens looked up",
                                          value=s.prefix_cache_query_tokens)
                yield CounterMetricFamily(f"{p}:prefix_cache_hits", "Prompt tokens found in the cache",
                                          value=s.prefix_cache_hit_tokens)
                yield CounterMetricFamily(f"{p}:prefix_cache_evictions", "Cached KV blocks evicted to make room",
                                          value=s.prefix_cache_evictions)
                yield CounterMetricFamily(f"{p}:spec_decode_num_draft_tokens", "Speculated tokens verified",
                                          value=s.spec_proposed_tokens)
                yield CounterMetricFamily(f"{p}:spec_decode_num_accepted_tokens", "Speculated tokens kept",
                                          value=s.spec_accepted_tokens)

        self.registry.register(_Gauges())
        engine.on_request_finished(self.observe)

    def observe(self, done: FinishedRequest) -> None:
        m = done.metrics
        self.ttft.observe(m.ttft)
        self.e2e.observe(m.e2e)
        self.queue.observe(m.queue_time)
        self.prefill.observe(m.prefill_time)
        self.decode.observe(m.decode_time)
        for x in m.inter_token_latencies:
            self.itl.observe(x)
        for reason in done.finish_reasons:
            self.success.labels(finished_reason=reason).inc()
        self.prompt_tokens.inc(done.num_prompt_tokens)
        self.generation_tokens.inc(done.num_generated_tokens)
