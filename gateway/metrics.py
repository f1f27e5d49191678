"""The gateway's Prometheus metrics: HTTP requests by route, method and status, their latency (to the response's
last byte, streams included) and the requests in flight, on GET /metrics.

The gateway runs several HTTP worker processes behind one port, and a scrape reaches any one of them, so each
writes its samples into $PROMETHEUS_MULTIPROC_DIR (prometheus_client's multiprocess mode; the CLI makes a fresh
folder per start) and /metrics adds up every process's. Routes are the app's path templates (a model id in the
path does not make a series), "other" for paths that match none.
"""
from __future__ import annotations

import os
import time

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest, multiprocess
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from common.histograms import LATENCY_BUCKETS

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

REQUESTS = Counter("splitserve:gateway_http_requests", "HTTP requests answered, by route, method and status",
                   ["route", "method", "status"])
LATENCY = Histogram("splitserve:gateway_http_request_duration_seconds",
                    "Time from a request's arrival to its response's last byte (a stream's end), by route",
                    ["route"], buckets=LATENCY_BUCKETS)
IN_FLIGHT = Gauge("splitserve:gateway_http_requests_in_flight", "HTTP requests being answered, by route",
                  ["route"], multiprocess_mode="livesum")


def exposition() -> tuple[bytes, str]:
    """The metrics of every HTTP worker process (or of this one, outside multiprocess mode)."""
    if os.environ.get(MULTIPROC_ENV):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


class HTTPMetrics:
    """ASGI middleware that counts and times every HTTP request."""

    def __init__(self, app: ASGIApp, routes: list):
        self.app, self.routes = app, routes

    def _route(self, scope: Scope) -> str:
        for route in self.routes:
            match, _ = route.matches(scope)
            if match is Match.FULL:
                return route.path
        return "other"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route, start, status, done = self._route(scope), time.perf_counter(), 500, False
        gauge = IN_FLIGHT.labels(route)

        def finish() -> None:
            nonlocal done
            if not done:
                done = True
                gauge.dec()
                REQUESTS.labels(route, scope["method"], str(status)).inc()
                LATENCY.labels(route).observe(time.perf_counter() - start)

        async def sending(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finish()  # before the last byte leaves: a client that saw its response sees it counted
            await send(message)

        gauge.inc()
        try:
            await self.app(scope, receive, sending)
        finally:
            finish()
