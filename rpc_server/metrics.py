"""Request counters and latency histograms, rendered as Prometheus text."""

from __future__ import annotations

import threading
from collections import defaultdict

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Methods recorded by name; any other request-line token counts as "other", so a client
# inventing methods cannot grow the metrics (one series per distinct token) without bound.
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "CONNECT"})


class _Histogram:
    __slots__ = ("counts", "total", "count")

    def __init__(self) -> None:
        self.counts = [0] * len(LATENCY_BUCKETS)
        self.total = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.counts[i] += 1
                break
        self.total += seconds
        self.count += 1


def _escape(value: object) -> str:
    """A label value as Prometheus text wants it: backslash, double quote and newline escaped.

    Every label value goes through here (the method comes from the request line,
    so a client can put a quote or backslash in it and break the exposition).
    """
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    """Per-server metrics; one instance per app, so servers in one process stay apart."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, str, int], int] = defaultdict(int)
        self._latency: dict[str, _Histogram] = defaultdict(_Histogram)
        self._bytes_in = 0
        self._bytes_out = 0
        self._bytes_out_by_endpoint: dict[str, int] = defaultdict(int)
        self._bytes_in_by_endpoint: dict[str, int] = defaultdict(int)

    def observe(
        self, endpoint: str, method: str, status: int, seconds: float, bytes_in: int, bytes_out: int
    ) -> None:
        if method not in KNOWN_METHODS:
            method = "other"
        with self._lock:
            self._requests[(endpoint, method, status)] += 1
            self._latency[endpoint].observe(seconds)
            self._bytes_in += bytes_in
            self._bytes_out += bytes_out
            self._bytes_in_by_endpoint[endpoint] += bytes_in
            self._bytes_out_by_endpoint[endpoint] += bytes_out

    def request_count(self, endpoint: str) -> int:
        """Requests served on `endpoint` (a route rule such as '/v1/shards/fetch')."""
        with self._lock:
            return sum(n for (ep, _, _), n in self._requests.items() if ep == endpoint)

    def traffic(self) -> dict[str, int]:
        """Shard bytes this worker served (fetch responses) and took in (put bodies), over HTTP and
        the same-host socket (`unix:` endpoints: bytes handed over in shared memory count too)."""
        fetches, puts = ("/v1/shards/fetch", "unix:fetch"), ("/v1/shards", "unix:put")
        with self._lock:
            return {
                "fetch_bytes_served": sum(self._bytes_out_by_endpoint.get(ep, 0) for ep in fetches),
                "put_bytes_received": sum(self._bytes_in_by_endpoint.get(ep, 0) for ep in puts),
                "fetch_requests": sum(n for (ep, _, _), n in self._requests.items() if ep in fetches),
            }

    def render(
        self,
        gauges: dict[str, tuple[str, float | int | None]],
        counters: dict[str, tuple[str, float | int]] | None = None,
    ) -> str:
        """Prometheus exposition text; `gauges` / `counters` map name -> (help, value)."""
        lines: list[str] = []
        for name, (help_text, value) in gauges.items():
            if value is None:
                continue
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {value}"]
        for name, (help_text, value) in (counters or {}).items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]
        with self._lock:
            lines += [
                "# HELP distbatch_requests_total Requests served, by endpoint, method and status.",
                "# TYPE distbatch_requests_total counter",
            ]
            for (endpoint, method, status), n in sorted(self._requests.items()):
                lines.append(
                    f'distbatch_requests_total{{endpoint="{_escape(endpoint)}",method="{_escape(method)}",'
                    f'status="{_escape(status)}"}} {n}'
                )
            lines += [
                "# HELP distbatch_request_errors_total Requests answered with status >= 400.",
                "# TYPE distbatch_request_errors_total counter",
            ]
            errors: dict[str, int] = defaultdict(int)
            for (endpoint, _, status), n in self._requests.items():
                if status >= 400:
                    errors[endpoint] += n
            for endpoint, n in sorted(errors.items()):
                lines.append(f'distbatch_request_errors_total{{endpoint="{_escape(endpoint)}"}} {n}')
            lines += [
                "# HELP distbatch_request_seconds Request latency.",
                "# TYPE distbatch_request_seconds histogram",
            ]
            for endpoint, hist in sorted(self._latency.items()):
                label = f'endpoint="{_escape(endpoint)}"'
                cumulative = 0
                for bound, n in zip(LATENCY_BUCKETS, hist.counts):
                    cumulative += n
                    lines.append(f'distbatch_request_seconds_bucket{{{label},le="{bound}"}} {cumulative}')
                lines.append(f'distbatch_request_seconds_bucket{{{label},le="+Inf"}} {hist.count}')
                lines.append(f"distbatch_request_seconds_sum{{{label}}} {hist.total:.6f}")
                lines.append(f"distbatch_request_seconds_count{{{label}}} {hist.count}")
            lines += [
                "# HELP distbatch_received_bytes_total Request body bytes received.",
                "# TYPE distbatch_received_bytes_total counter",
                f"distbatch_received_bytes_total {self._bytes_in}",
                "# HELP distbatch_sent_bytes_total Response body bytes sent.",
                "# TYPE distbatch_sent_bytes_total counter",
                f"distbatch_sent_bytes_total {self._bytes_out}",
            ]
        return "\n".join(lines) + "\n"
