"""Prometheus metrics of the scheduler, named as vLLM users expect (`splitserve:` prefix).

Counters and histograms are updated where things happen; gauges of queue and KV state are read from
the worker groups when Prometheus scrapes (unlocked, approximate reads)."""
from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
            80.0)
_SIZES = tuple(2 ** i for i in range(6, 24, 2))


class SchedulerMetrics:
    def __init__(self, groups: Callable[[], Iterable]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests_finished = Counter("splitserve:request_success", "Finished requests by finish reason",
                                         ["finished_reason"], registry=r)
        self.requests_rejected = Counter("splitserve:request_rejected", "Requests refused, by gRPC status",
                                         ["status"], registry=r)
        self.requests_requeued = Counter("splitserve:num_requests_requeued",
                                         "Requests moved to another worker after a worker failed", registry=r)
        self.prompt_tokens = Counter("splitserve:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("splitserve:generation_tokens", "Generated tokens", registry=r)
        self.cached_prompt_tokens = Counter("splitserve:prefix_cache_hits",
                                            "Prompt tokens served from the prefix cache", registry=r)
        self.ttft = Histogram("splitserve:time_to_first_token_seconds", "Time to first token", buckets=_LATENCY,
                              registry=r)
        self.itl = Histogram("splitserve:inter_token_latency_seconds", "Time between streamed tokens",
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram("splitserve:e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=_LATENCY, registry=r)
        self.step = Histogram("splitserve:step_duration_seconds", "Worker step time, as the worker reports it",
                              ["worker"], buckets=_LATENCY, registry=r)
        self.plan_bytes = Histogram("splitserve:plan_size_bytes", "Serialized StepPlan size", buckets=_SIZES,
                                    registry=r)
        self.result_bytes = Histogram("splitserve:result_size_bytes", "Serialized StepResult size",
                                      buckets=_SIZES, registry=r)
        r.register(_GroupCollector(groups))

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        start_http_server(port, addr=host, registry=self.registry)


class _GroupCollector:
    """Queue, KV and cache state of every worker group, read at scrape time."""

    def __init__(self, groups: Callable[[], Iterable]):
        self._groups = groups

    def collect(self):
        running = GaugeMetricFamily("splitserve:num_requests_running", "Sequences running", labels=["worker"])
        waiting = GaugeMetricFamily("splitserve:num_requests_waiting", "Sequences waiting", labels=["worker"])
        used = GaugeMetricFamily("splitserve:kv_blocks_used", "KV blocks in use", labels=["worker"])
        free = GaugeMetricFamily("splitserve:kv_blocks_free", "KV blocks free (cached ones included)",
                                 labels=["worker"])
        usage = GaugeMetricFamily("splitserve:kv_cache_usage_perc", "Share of KV blocks in use", labels=["worker"])
        preempt = GaugeMetricFamily("splitserve:num_preemptions", "Preemptions so far", labels=["worker"])
        hit = GaugeMetricFamily("splitserve:prefix_cache_hit_rate",
                                "Admitted tokens served from the prefix cache, as a share", labels=["worker"])
        alive = GaugeMetricFamily("splitserve:worker_alive", "1 while the worker group serves", labels=["worker"])
        for g in self._groups():
            s = g.engine.scheduler
            bm = s.block_manager
            w = [g.address]
            running.add_metric(w, s.num_running)
            waiting.add_metric(w, s.num_waiting)
            used.add_metric(w, bm.num_blocks - bm.num_free_blocks)
            free.add_metric(w, bm.num_free_blocks)
            usage.add_metric(w, bm.usage)
            preempt.add_metric(w, s.num_preemptions)
            hit.add_metric(w, s.num_prefix_hit_tokens / max(1, s.num_admitted_tokens))
            alive.add_metric(w, 1.0 if g.alive else 0.0)
        yield from (running, waiting, used, free, usage, preempt, hit, alive)
