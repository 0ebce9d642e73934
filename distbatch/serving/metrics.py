"""Request metrics of an HTTP app (a worker's or the controller's), as `prometheus_client`
collectors in a registry of the app's own.

One `Metrics` per app (servers in one process stay apart; no module-level registry). Request
counters and latency histograms are labelled by route rule (bounded: the app's routes and
`unmatched`), method (bounded: `KNOWN_METHODS`, anything else is `other`) and status; values
an app reads at scrape time (a store's sizes, a controller's queues) are passed to `render`.
`prometheus_client` writes the exposition (escaping included). `endpoint_totals()` answers
`/v1/stats` from plain per-endpoint counts kept beside the collectors.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping

from flask import Flask, Response, g, request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["CONTENT_TYPE", "KNOWN_METHODS", "LATENCY_BUCKETS", "Metrics", "record_requests"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Methods recorded by name; any other request-line token counts as "other", so a client
# inventing methods cannot grow the metrics (one series per distinct token) without bound.
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "CONNECT"})

Values = dict[str, tuple[str, float | int | None]]


# name -> (help, label name, {label value: count}): a counter per label value, read at scrape time.
LabelledCounters = Mapping[str, tuple[str, str, Mapping[str, float]]]


class _Snapshot:
    """A collector of values read at scrape time (the store's sizes): gauges and counters, and
    counters by one label (the controller's tasks served per staleness)."""

    def __init__(self, gauges: Values, counters: Values, labelled: LabelledCounters) -> None:
        self.gauges, self.counters, self.labelled = gauges, counters, labelled

    def collect(self) -> Iterator[Metric]:
        for name, (help_text, value) in self.gauges.items():
            if value is not None:
                yield GaugeMetricFamily(name, help_text, value=value)
        for name, (help_text, value) in self.counters.items():
            if value is not None:
                yield CounterMetricFamily(name.removesuffix("_total"), help_text, value=value)
        for name, (help_text, label, values) in self.labelled.items():
            family = CounterMetricFamily(name.removesuffix("_total"), help_text, labels=[label])
            for label_value, value in values.items():
                family.add_metric([label_value], value)
            yield family


class Metrics:
    """Per-server request metrics; one instance per app, so servers in one process stay apart."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._requests_total = Counter(
            "distbatch_requests",
            "Requests served, by endpoint, method and status.",
            ["endpoint", "method", "status"],
            registry=self.registry,
        )
        self._errors_total = Counter(
            "distbatch_request_errors",
            "Requests answered with status >= 400.",
            ["endpoint"],
            registry=self.registry,
        )
        self._latency = Histogram(
            "distbatch_request_seconds",
            "Request latency.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._received = Counter(
            "distbatch_received_bytes", "Request body bytes received.", registry=self.registry
        )
        self._sent = Counter("distbatch_sent_bytes", "Response body bytes sent.", registry=self.registry)
        self._lock = threading.Lock()
        # endpoint -> [requests, body bytes received, body bytes sent]
        self._by_endpoint: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])

    def observe(
        self, endpoint: str, method: str, status: int, seconds: float, bytes_in: int, bytes_out: int
    ) -> None:
        if method not in KNOWN_METHODS:
            method = "other"
        self._requests_total.labels(endpoint, method, str(status)).inc()
        if status >= 400:
            self._errors_total.labels(endpoint).inc()
        self._latency.labels(endpoint).observe(seconds)
        self._received.inc(bytes_in)
        self._sent.inc(bytes_out)
        with self._lock:
            totals = self._by_endpoint[endpoint]
            totals[0] += 1
            totals[1] += bytes_in
            totals[2] += bytes_out

    def endpoint_totals(self, endpoints: tuple[str, ...]) -> tuple[int, int, int]:
        """(requests, body bytes received, body bytes sent) on `endpoints` (route rules) together."""
        with self._lock:
            rows = [self._by_endpoint[ep] for ep in endpoints if ep in self._by_endpoint]
            return sum(r[0] for r in rows), sum(r[1] for r in rows), sum(r[2] for r in rows)

    def render(
        self, gauges: Values, counters: Values | None = None, labelled: LabelledCounters | None = None
    ) -> bytes:
        """The exposition: `gauges` and `counters` (name -> (help, value), read now by the app),
        `labelled` counters, and every request collector."""
        # generate_latest only calls collect(): the snapshot needs no registry of its own.
        snapshot = _Snapshot(gauges, counters or {}, labelled or {})
        return generate_latest(snapshot) + generate_latest(self.registry)


def record_requests(app: Flask, metrics: Metrics) -> None:
    """Time every request `app` serves into `metrics`, by route rule (`unmatched` for none),
    refused ones (a 401 from a later hook) included. Register it before other hooks."""

    @app.before_request
    def _start() -> None:
        g.started = time.perf_counter()

    @app.after_request
    def _record(response: Response) -> Response:
        started = g.get("started")
        if started is not None:
            rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
            metrics.observe(
                rule,
                request.method,
                response.status_code,
                time.perf_counter() - started,
                request.content_length or 0,
                response.content_length or 0,
            )
        return response
