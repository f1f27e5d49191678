"""Prometheus metrics of the scheduler, named as vLLM users expect (`splitserve:` prefix).

Counters and histograms are updated where things happen; gauges of queue and KV state are read from
the worker groups when Prometheus scrapes (unlocked, approximate reads). Histograms written on hot paths
(every step of an engine thread, every message of a stream) are FastHistograms: one writer thread each,
a bisect and two adds per observation, summed up at scrape time.

Where they are updated: the request metrics in server.py's Generate (per completion: a request with
n > 1 counts n times in `request_success` and the token counters), the step metrics on each engine
thread through `step_observer()` (engine.py), `requests_requeued` where a failed worker's requests are
moved (worker failure handling)."""
from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from common.histograms import LATENCY_BUCKETS, FastHistogram, FastHistogramFamily

_SIZES = tuple(2 ** i for i in range(6, 24, 2))
# Plan and result sizes cost a ByteSize() each, a walk of the message: measured on one step in
# SIZE_SAMPLE_EVERY, so the histograms are a sample of the steps.
SIZE_SAMPLE_EVERY = 16


class StepObserver:
    """Called by one engine thread around each step (engine.py): worker step time from every result, plan
    and result sizes from a sample of them."""
    __slots__ = ("_step", "_plan", "_result", "_plans", "_results")

    def __init__(self, step: FastHistogram, plan: FastHistogram, result: FastHistogram):
        self._step, self._plan, self._result = step, plan, result
        self._plans = self._results = 0

    def plan(self, plan) -> None:
        self._plans += 1
        if self._plans % SIZE_SAMPLE_EVERY == 0:
            self._plan.observe(plan.ByteSize())

    def result(self, result) -> None:
        self._step.observe(result.forward_ms * 1e-3)
        self._results += 1
        if self._results % SIZE_SAMPLE_EVERY == 0:
            self._result.observe(result.ByteSize())


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
        self.ttft = Histogram("splitserve:time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        # Written by the event loop thread only, once per stream message (per completion).
        self.itl = FastHistogramFamily("splitserve:inter_token_latency_seconds",
                                       "Time between streamed messages of a completion (tokens coalesce when "
                                       "a client falls behind)", (), LATENCY_BUCKETS, r).labels()
        self.e2e = Histogram("splitserve:e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.step = FastHistogramFamily("splitserve:step_duration_seconds",
                                        "Worker step time, as the worker reports it", ("worker",), LATENCY_BUCKETS, r)
        self.plan_bytes = FastHistogramFamily("splitserve:plan_size_bytes",
                                              f"Serialized StepPlan size (one step in {SIZE_SAMPLE_EVERY})",
                                              ("worker",), _SIZES, r)
        self.result_bytes = FastHistogramFamily("splitserve:result_size_bytes",
                                                f"Serialized StepResult size (one step in {SIZE_SAMPLE_EVERY})",
                                                ("worker",), _SIZES, r)
        r.register(_GroupCollector(groups))

    def step_observer(self, worker: str) -> StepObserver:
        """For the engine thread of one worker group (its only writer)."""
        return StepObserver(self.step.labels(worker), self.plan_bytes.labels(worker),
                            self.result_bytes.labels(worker))

    def serve(self, port: int, host: str = "0.0.0.0"):
        """Serves /metrics (Prometheus text) on a daemon thread; returns (server, thread)."""
        return start_http_server(port, addr=host, registry=self.registry)


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
