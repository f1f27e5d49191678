"""Histograms for hot paths, read by Prometheus at scrape time (the scheduler's and the workers' metrics)."""
from __future__ import annotations

from bisect import bisect_left

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
                   40.0, 80.0)


class FastHistogram:
    """A histogram for ONE writer thread on a hot path: observe() is a bisect and two adds, with none of
    prometheus_client's locking. Read (approximately) by its family's collector at scrape time."""
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


class FastHistogramFamily:
    """FastHistograms of one name, one per label tuple (e.g. per worker: each written by its engine thread)."""

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...], buckets: tuple[float, ...],
                 registry: CollectorRegistry):
        self.name, self.documentation, self.labelnames, self.buckets = name, documentation, labelnames, buckets
        self._children: dict[tuple[str, ...], FastHistogram] = {}
        registry.register(self)

    def labels(self, *values: str) -> FastHistogram:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = FastHistogram(self.buckets)
        return child

    def describe(self):
        return [HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)]

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, h in list(self._children.items()):
            counts, total, buckets = list(h.counts), 0, []
            for bound, count in zip((*h.bounds, float("inf")), counts):
                total += count
                buckets.append((floatToGoString(bound), total))
            family.add_metric(list(values), buckets, h.sum)
        yield family
