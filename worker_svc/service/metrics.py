"""Prometheus metrics of a worker (`--metrics-port`): step duration, sequences held, KV blocks, epoch, kernels
built (runtime/kernel_builds.py).

No torch here: the runner (ModelRunner, TensorParallelRunner or SimulatedRunner) is read at scrape time
(unlocked, approximate), and the step time is observed where each step's result is collected, by
wrapping the runner's `execute` (the handler thread of the one Execute stream is the only writer).
"""
from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from common.exposition import Labelled, serve
from common.histograms import LATENCY_BUCKETS, FastHistogram, FastHistogramFamily
from worker_svc.runtime.kernel_builds import BUILDS

log = logging.getLogger("splitserve.worker")


class _TimedStep:
    """A pending step whose result() also records the step time the worker reports."""
    __slots__ = ("_pending", "_hist")

    def __init__(self, pending, hist: FastHistogram):
        self._pending, self._hist = pending, hist

    def result(self):
        result = self._pending.result()
        self._hist.observe(result.forward_ms * 1e-3)
        return result


class WorkerMetrics:
    def __init__(self, runner):
        self.runner = runner
        self.registry = CollectorRegistry()
        self.step = FastHistogramFamily("splitserve:worker_step_duration_seconds",
                                        "Step time from plan launch to sampled ids on the host", (), LATENCY_BUCKETS,
                                        self.registry).labels()
        self.registry.register(_RunnerCollector(runner))

    def instrument(self) -> None:
        """Wraps runner.execute so that every step's result is timed."""
        execute, hist = self.runner.execute, self.step

        def timed_execute(plan):
            return _TimedStep(execute(plan), hist)

        self.runner.execute = timed_execute

    def serve(self, port: int, host: str = "0.0.0.0"):
        served = CollectorRegistry()
        served.register(Labelled(self.registry, {"model_name": self.runner.describe().model}))
        return serve(served, port, host)


def serve_metrics(runner, port: int, host: str = "0.0.0.0") -> WorkerMetrics:
    """Instruments the runner and serves /metrics on a daemon thread."""
    metrics = WorkerMetrics(runner)
    metrics.instrument()
    metrics.serve(port, host)
    log.info("metrics on %s:%d/metrics", host, port, extra={"metrics_port": port})
    return metrics


class _RunnerCollector:
    def __init__(self, runner):
        self.runner = runner

    def collect(self):
        running = GaugeMetricFamily("splitserve:worker_num_requests_running",
                                    "Sequences the worker holds (finished ones go with the next plan)")
        total = GaugeMetricFamily("splitserve:worker_kv_blocks_total", "KV blocks of the worker's cache")
        used = GaugeMetricFamily("splitserve:worker_kv_blocks_used", "KV blocks in the tables of held sequences")
        epoch = GaugeMetricFamily("splitserve:worker_epoch_info", "The worker's current epoch (changes on reset)",
                                  labels=["epoch", "worker_id"])
        runner = self.runner
        batch = runner.batch  # read while the launcher thread applies plans: approximate
        running.add_metric([], len(batch.seqs))
        total.add_metric([], batch.num_blocks)
        used.add_metric([], batch.num_blocks_in_use())
        epoch.add_metric([str(runner.epoch), runner.worker_id], 1.0)
        builds = CounterMetricFamily("splitserve:worker_kernel_builds", "GPU kernel variants built in this "
                                     "process (Triton, flash-attn-4), by phase: serving should stay 0",
                                     labels=["phase"])
        builds.add_metric(["warm_up"], BUILDS.warm_up)
        builds.add_metric(["serving"], BUILDS.serving)
        yield from (running, total, used, epoch, builds)
