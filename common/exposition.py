"""How the services expose their Prometheus metrics: with labels every sample carries (model_name, as vLLM's
series do), served as text a Prometheus server stores under the names written."""
from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
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


def serve(registry: CollectorRegistry, port: int, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """GET /metrics of `registry` in Prometheus' text format 0.0.4, on a daemon thread.

    Not prometheus_client's start_http_server: it answers a Prometheus server (which asks for OpenMetrics) in
    OpenMetrics with names escaped to underscores, so `splitserve:x` would be stored as `splitserve_x` and no
    query or dashboard written for the real names would find it. Text 0.0.4 keeps them as they are."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # scrapes are not worth a log line each
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name=f"metrics:{port}", daemon=True).start()
    return server
