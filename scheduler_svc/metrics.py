"""Prometheus metrics of the scheduler, named as vLLM users expect (`splitserve:` prefix).

Each process of the tree keeps its own: a front-end the request metrics (FrontendMetrics: updated in its
Generate), an engine the step histograms and the queue and KV gauges of its worker groups (EngineMetrics). The supervisor serves them all on one --metrics-port: at every scrape it asks each
process for its exposition and adds the samples up by name and labels (merge()), so counters and histograms are
totals over the processes and per-worker gauges come from the engine that drives the worker.

Histograms written on hot paths (every step of an engine thread, every message of a stream) are FastHistograms:
one writer thread each, summed up at scrape time."""
from __future__ import annotations

import collections
import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from common.histograms import LATENCY_BUCKETS, FastHistogram, FastHistogramFamily

SIZE_BUCKETS = tuple(2 ** i for i in range(6, 24, 2))
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)  # vLLM's
# Plan and result sizes cost a ByteSize() each, a walk of the message: measured on one step in
# SIZE_SAMPLE_EVERY, so the histograms are a sample of the steps.
SIZE_SAMPLE_EVERY = 16


class StepObserver:
    """Called by one engine thread around each step (engine_core.py): worker step time from every result, the
    tokens of every plan, plan and result sizes from a sample of them."""
    __slots__ = ("_step", "_tokens", "_plan", "_result", "_plans", "_results")

    def __init__(self, step: FastHistogram, tokens: FastHistogram, plan: FastHistogram, result: FastHistogram):
        self._step, self._tokens, self._plan, self._result = step, tokens, plan, result
        self._plans = self._results = 0

    def plan(self, plan) -> None:
        self._tokens.observe(sum(plan.num_scheduled_tokens) + sum(s.num_scheduled_tokens for s in plan.new_seqs))
        self._plans += 1
        if self._plans % SIZE_SAMPLE_EVERY == 0:
            self._plan.observe(plan.ByteSize())

    def result(self, result) -> None:
        self._step.observe(result.forward_ms * 1e-3)
        self._results += 1
        if self._results % SIZE_SAMPLE_EVERY == 0:
            self._result.observe(result.ByteSize())


class FrontendMetrics:
    """A front-end's request metrics. Per completion: a request with n > 1 counts n times in `request_success`
    and the token counters."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests_finished = Counter("splitserve:request_success", "Finished requests by finish reason",
                                         ["finished_reason"], registry=r)
        self.requests_rejected = Counter("splitserve:request_rejected", "Requests refused, by gRPC status",
                                         ["status"], registry=r)
        self.requests_requeued = Counter("splitserve:num_requests_requeued",
                                         "Requests moved to another worker after a worker failed or drained",
                                         registry=r)
        self.prompt_tokens = Counter("splitserve:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("splitserve:generation_tokens", "Generated tokens", registry=r)
        self.cached_prompt_tokens = Counter("splitserve:prefix_cache_hits",
                                            "Prompt tokens served from the prefix cache", registry=r)
        self.prefix_queries = Counter("splitserve:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache", registry=r)
        self.request_prompt_tokens = Histogram("splitserve:request_prompt_tokens", "Prompt tokens per completion",
                                               buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("splitserve:request_generation_tokens",
                                                   "Generated tokens per completion", buckets=TOKEN_BUCKETS,
                                                   registry=r)
        self.queue_time = Histogram("splitserve:request_queue_time_seconds",
                                    "Time from a completion's arrival to its engine's first admission",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_time = Histogram("splitserve:request_prefill_time_seconds",
                                      "Time from a completion's first admission to its first token",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.inference_time = Histogram("splitserve:request_inference_time_seconds",
                                        "Time from a completion's first admission to its end", buckets=LATENCY_BUCKETS,
                                        registry=r)
        self.decode_time = Histogram("splitserve:request_decode_time_seconds",
                                     "Time from a completion's first token to its last", buckets=LATENCY_BUCKETS,
                                     registry=r)
        self.ttft = Histogram("splitserve:time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        # Written by the event loop thread only, once per stream message (per completion).
        self.itl = FastHistogramFamily("splitserve:inter_token_latency_seconds",
                                       "Time between streamed messages of a completion (tokens coalesce when "
                                       "a client falls behind)", (), LATENCY_BUCKETS, r).labels()
        self.e2e = Histogram("splitserve:e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=LATENCY_BUCKETS, registry=r)

    def text(self) -> str:
        return generate_latest(self.registry).decode()

    def observe_end(self, usage, arrived: float, first_at: float, scheduled: float | None) -> None:
        """A completion's end (its api.Usage): its tokens, and vLLM's request phases (queued, then prefill, the
        whole run) from the times on the one monotonic clock every process shares."""
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.prefix_queries.inc(usage.prompt_tokens)
        self.cached_prompt_tokens.inc(usage.cached_prompt_tokens)
        self.request_prompt_tokens.observe(usage.prompt_tokens)
        self.request_generation_tokens.observe(usage.completion_tokens)
        now = time.monotonic()
        if usage.completion_tokens:  # first to last token: 0 where both came in this message
            self.decode_time.observe(now - first_at if first_at else 0.0)
        if scheduled is not None:
            self.queue_time.observe(max(0.0, scheduled - arrived))
            self.prefill_time.observe(max(0.0, (first_at or now) - scheduled))
            self.inference_time.observe(max(0.0, now - scheduled))


class EngineMetrics:
    """An engine process's metrics: step histograms per worker and the groups' queue and KV state (gauges,
    read at scrape time). The supervisor adds them up with the other processes'."""

    def __init__(self, groups):
        self.registry = r = CollectorRegistry()
        self.step = FastHistogramFamily("splitserve:step_duration_seconds",
                                        "Worker step time, as the worker reports it", ("worker",), LATENCY_BUCKETS, r)
        self.iteration_tokens = FastHistogramFamily("splitserve:iteration_tokens_total", "Tokens per step",
                                                    ("worker",), TOKEN_BUCKETS, r)
        self.plan_bytes = FastHistogramFamily("splitserve:plan_size_bytes",
                                              f"Serialized StepPlan size (one step in {SIZE_SAMPLE_EVERY})",
                                              ("worker",), SIZE_BUCKETS, r)
        self.result_bytes = FastHistogramFamily("splitserve:result_size_bytes",
                                                f"Serialized StepResult size (one step in {SIZE_SAMPLE_EVERY})",
                                                ("worker",), SIZE_BUCKETS, r)
        r.register(_GroupCollector(groups))

    def step_observer(self, worker: str) -> StepObserver:
        """For the engine thread of one worker group (its only writer)."""
        return StepObserver(self.step.labels(worker), self.iteration_tokens.labels(worker),
                            self.plan_bytes.labels(worker), self.result_bytes.labels(worker))

    def text(self) -> str:
        return generate_latest(self.registry).decode()


DEPARTED_SERIES_S = 600.0  # how long a group that left keeps reporting itself down (alive 0, gauges 0)


class _GroupCollector:
    """Queue, KV and cache state of every live group of this engine, read at scrape time (unlocked,
    approximate reads). A group that died or left reports alive 0 and empty gauges for DEPARTED_SERIES_S, so
    that dashboards and alerts see it go down rather than vanish; its counters keep their totals."""

    def __init__(self, groups):
        self._groups = groups
        self._departed: dict[str, tuple[float, tuple[int, ...]]] = {}  # address -> (last seen live, its counters)

    @staticmethod
    def _counters(s) -> tuple[int, ...]:
        """Preemptions, blocks swapped out and in, blocks released behind a sliding window, LoRA adapters placed
        into slots and read again, prefix-hit tokens from the GPU and from the host."""
        bm = s.block_manager
        return (s.num_preemptions, bm.num_swapped_out, bm.num_swapped_in, s.num_released_blocks,
                s.adapters.num_placements, s.adapters.num_reloads, s.num_prefix_hit_tokens - s.num_host_hit_tokens,
                s.num_host_hit_tokens)

    def collect(self):
        running = GaugeMetricFamily("splitserve:num_requests_running", "Sequences running", labels=["worker"])
        waiting = GaugeMetricFamily("splitserve:num_requests_waiting", "Sequences waiting", labels=["worker"])
        used = GaugeMetricFamily("splitserve:kv_blocks_used", "KV blocks in use", labels=["worker"])
        free = GaugeMetricFamily("splitserve:kv_blocks_free", "KV blocks free (cached ones included)",
                                 labels=["worker"])
        usage = GaugeMetricFamily("splitserve:kv_cache_usage_perc", "Share of KV blocks in use", labels=["worker"])
        host_used = GaugeMetricFamily("splitserve:kv_host_blocks_used",
                                      "Host-tier KV blocks holding a cached block", labels=["worker"])
        host_usage = GaugeMetricFamily("splitserve:kv_host_cache_usage_perc",
                                       "Share of the host tier's KV blocks holding a cached block", labels=["worker"])
        hit = GaugeMetricFamily("splitserve:prefix_cache_hit_rate",
                                "Admitted tokens served from the prefix cache, as a share", labels=["worker"])
        alive = GaugeMetricFamily("splitserve:worker_alive", "1 while the worker group serves", labels=["worker"])
        preempt = CounterMetricFamily("splitserve:num_preemptions", "Preemptions so far", labels=["worker"])
        swapped_out = CounterMetricFamily("splitserve:kv_blocks_swapped_out",
                                          "KV blocks copied from the GPU to the host tier", labels=["worker"])
        swapped_in = CounterMetricFamily("splitserve:kv_blocks_swapped_in",
                                         "KV blocks copied from the host tier back to the GPU", labels=["worker"])
        released = CounterMetricFamily("splitserve:kv_blocks_released",
                                       "KV blocks given back wholly behind the sliding window of every layer",
                                       labels=["worker"])
        tier_hits = CounterMetricFamily("splitserve:prefix_cache_hit_tokens",
                                        "Admitted tokens served from the prefix cache, by the tier that held them",
                                        labels=["worker", "tier"])
        loras = GaugeMetricFamily("splitserve:lora_adapters_loaded", "LoRA adapters requests may run under",
                                  labels=["worker"])
        lora_requests = GaugeMetricFamily("splitserve:lora_requests", "Sequences under each LoRA adapter, running or "
                                          "waiting", labels=["worker", "lora", "state"])
        placed = CounterMetricFamily("splitserve:lora_slot_loads", "LoRA adapters copied into a device slot for "
                                     "a request (from the worker's host memory)", labels=["worker"])
        reloaded = CounterMetricFamily("splitserve:lora_reloads", "LoRA adapters read again from their folders for a "
                                       "request, after they made room in host memory for others", labels=["worker"])
        gauges = (running, waiting, used, free, usage, host_used, host_usage, hit, alive, loras)
        counters = (preempt, swapped_out, swapped_in, released, placed, reloaded)

        def add_counters(address: str, values: tuple[int, ...]) -> None:
            for family, value in zip(counters, values):
                family.add_metric([address], value)
            tier_hits.add_metric([address, "gpu"], values[-2])
            tier_hits.add_metric([address, "host"], values[-1])

        now = time.monotonic()
        live = list(self._groups())
        for g in live:
            self._departed[g.address] = (now, self._counters(g.scheduler))
        live_addresses = {g.address for g in live}
        for address, (seen, values) in list(self._departed.items()):
            if address in live_addresses:
                continue
            if now - seen > DEPARTED_SERIES_S:
                del self._departed[address]
                continue
            for family in gauges:
                family.add_metric([address], 0.0)
            add_counters(address, values)
        for g in live:
            s = g.scheduler
            bm = s.block_manager
            w = [g.address]
            running.add_metric(w, s.num_running)
            waiting.add_metric(w, s.num_waiting)
            used.add_metric(w, bm.num_blocks - bm.num_free_blocks)
            free.add_metric(w, bm.num_free_blocks)
            usage.add_metric(w, bm.usage)
            host = bm.host
            host_used.add_metric(w, host.num_cached_blocks if host is not None else 0)
            host_usage.add_metric(w, host.num_cached_blocks / host.num_blocks if host is not None else 0.0)
            hit.add_metric(w, s.num_prefix_hit_tokens / max(1, s.num_admitted_tokens))
            alive.add_metric(w, 1.0 if g.alive else 0.0)
            loras.add_metric(w, len(s.adapters.served))
            for state, seqs in (("running", s.running), ("waiting", s.waiting)):
                for lora, n in collections.Counter(seq.params.lora for seq in seqs if seq.params.lora).items():
                    lora_requests.add_metric([g.address, lora, state], n)
            add_counters(g.address, self._counters(s))
        yield from (*gauges, *counters, tier_hits, lora_requests)


def merge(texts: Iterable[str]) -> list[Metric]:
    """The metric families of several processes' expositions, samples of equal name and labels added up
    (`_created` timestamps: the earliest)."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple, float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type)
                values[family.name] = {}
            acc = values[family.name]
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                if s.name.endswith("_created"):
                    acc[key] = min(acc.get(key, s.value), s.value)
                else:
                    acc[key] = acc.get(key, 0.0) + s.value
    for name, merged in families.items():
        for (sample, labels), value in values[name].items():
            merged.add_sample(sample, dict(labels), value)
    return list(families.values())
