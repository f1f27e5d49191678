"""Prometheus metrics of a worker (`--metrics-port`): step duration, sequences held, KV blocks, epoch.

No torch here: the runner (ModelRunner, TensorParallelRunner or SimulatedRunner) is read at scrape time
(unlocked, approximate), and the step time is observed where each step's result is collected, by
wrapping the runner's `execute` (the handler thread of the one Execute stream is the only writer).
"""
from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily

from scheduler_svc.metrics import LATENCY_BUCKETS, FastHistogram, FastHistogramFamily

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
        return start_http_server(port, addr=host, registry=self.registry)


def serve_metrics(runner, port: int, host: str = "0.0.0.0") -> WorkerMetrics:
    """Instruments the runner and serves /metrics on a daemon thread."""
    metrics = WorkerMetrics(runner)
    metrics.instrument()
    metrics.serve(port, host)
    log.info("metrics on %s:%d/metrics", host, port, extra={"metrics_port": port})
    return metrics


def _blocks_in_use(inner) -> int:
    """Distinct KV blocks in the block tables of the sequences held (the simulated worker keeps only counts
    per sequence: shared prefix blocks count once per sequence there)."""
    seqs = list(inner.seqs.values())
    if hasattr(inner, "block_table"):  # ModelRunner: one table row per sequence
        used: set[int] = set()
        for state in seqs:
            used.update(inner.block_table[state.row, :int(inner.num_table_blocks[state.row])].tolist())
        return len(used)
    return sum(s.blocks for s in seqs)


class _RunnerCollector:
    def __init__(self, runner):
        self.runner = runner

    def collect(self):
        inner = getattr(self.runner, "runner", self.runner)  # TensorParallelRunner wraps rank 0's runner
        running = GaugeMetricFamily("splitserve:worker_num_requests_running",
                                    "Sequences the worker holds (finished ones go with the next plan)")
        total = GaugeMetricFamily("splitserve:worker_kv_blocks_total", "KV blocks of the worker's cache")
        used = GaugeMetricFamily("splitserve:worker_kv_blocks_used", "KV blocks in the tables of held sequences")
        epoch = GaugeMetricFamily("splitserve:worker_epoch_info", "The worker's current epoch (changes on reset)",
                                  labels=["epoch", "worker_id"])
        for _ in range(3):  # the launcher thread may change the sequences while we read them
            try:
                n_running, n_used = len(inner.seqs), _blocks_in_use(inner)
                break
            except RuntimeError:
                continue
        else:
            n_running = n_used = float("nan")
        running.add_metric([], n_running)
        total.add_metric([], inner.num_blocks)
        used.add_metric([], n_used)
        epoch.add_metric([str(self.runner.epoch), str(getattr(inner, "worker_id", ""))], 1.0)
        yield from (running, total, used, epoch)
