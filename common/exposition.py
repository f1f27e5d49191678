"""Prometheus families with labels every sample of a service carries (its model_name, as vLLM's series do)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric


def with_labels(families: Iterable[Metric], labels: dict[str, str]) -> Iterator[Metric]:
    """The families with `labels` added to each sample."""
    for family in families:
        out = Metric(family.name, family.documentation, family.type, family.unit)
        for s in family.samples:
            out.add_sample(s.name, {**labels, **s.labels}, s.value, s.timestamp, s.exemplar)
        yield out


class Labelled:
    """A collector of every metric of `registry` with constant `labels`."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]):
        self.registry, self.labels = registry, labels

    def collect(self) -> Iterator[Metric]:
        yield from with_labels(self.registry.collect(), self.labels)
