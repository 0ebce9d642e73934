"""The worker's metrics: the request metrics every distbatch HTTP app keeps
(`distbatch.serving.metrics`), plus the shard traffic `/v1/stats` reports."""

from __future__ import annotations

from distbatch.serving.metrics import CONTENT_TYPE
from distbatch.serving.metrics import Metrics as RequestMetrics

__all__ = ["CONTENT_TYPE", "Metrics"]

# The endpoints whose bytes `/v1/stats` reports as shard traffic (HTTP and same-host).
FETCHES = ("/v1/shards/fetch", "unix:fetch")
PUTS = ("/v1/shards", "unix:put")


class Metrics(RequestMetrics):
    """A worker's request metrics, and its shard traffic."""

    def traffic(self) -> dict[str, int]:
        """Shard bytes this worker served (fetch responses) and took in (put bodies), over HTTP and
        the same-host socket (`unix:` endpoints: bytes handed over in shared memory count too)."""
        fetches, _, served = self.endpoint_totals(FETCHES)
        _, received, _ = self.endpoint_totals(PUTS)
        return {"fetch_bytes_served": served, "put_bytes_received": received, "fetch_requests": fetches}
