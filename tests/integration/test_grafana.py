"""The worker's /metrics is prometheus_client's exposition, and the Grafana dashboard in docs/
plots only metrics a worker really exports."""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from collections.abc import Callable
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families

from distbatch import ShardClient
from distbatch.controller import Controller
from distbatch.controller.remote import RemoteController
from distbatch.controller.server import ControllerServer
from distbatch.errors import ShardNotFoundError
from distbatch.launch import WorkerProcess

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "distbatch.json"


def scrape(node: str) -> str:
    with urllib.request.urlopen(f"http://{node}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        return response.read().decode()


def sample_names(text: str) -> set[str]:
    """Every sample name in the exposition, parsed by prometheus_client's own parser (so the
    text must be valid, escaping included)."""
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def test_every_metric_the_dashboard_plots_is_exported(
    start_worker: Callable[..., WorkerProcess], serve: Callable[..., ControllerServer], tmp_path: Path
) -> None:
    worker = start_worker(
        "--max-bytes", "100000000", "--max-idle-seconds", "3600", "--data-dir", str(tmp_path)
    )
    controller = serve(Controller())
    RemoteController(controller.address).create_partition("train")
    with ShardClient() as client:
        client.put(worker.node, {("t0", "x"): torch.arange(10)})
        try:
            client.fetch([(worker.node, "missing", "x")])
        except ShardNotFoundError:
            pass  # an error, so the error counter has a series
    exported = sample_names(scrape(worker.node)) | sample_names(scrape(controller.address))
    dashboard = json.loads(DASHBOARD.read_text())
    plotted = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\bdistbatch_[a-z_]+", target["expr"])
    }
    assert len(plotted) >= 12
    assert plotted <= exported, f"plotted but not exported: {sorted(plotted - exported)}"
    assert all(panel["targets"] for panel in dashboard["panels"])


def test_label_values_from_the_request_line_are_bounded_and_escaped(worker: WorkerProcess) -> None:
    host, port = worker.node.rsplit(":", 1)
    for method in ("FOO", 'B"A\\R', "BAZ"):
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(f'{method} /no/such"path HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n'.encode())
            while sock.recv(65536):
                pass
    families = {f.name: f for f in text_string_to_metric_families(scrape(worker.node))}
    labels = [
        s.labels for s in families["distbatch_requests"].samples if s.name == "distbatch_requests_total"
    ]
    methods = {lab["method"] for lab in labels}
    endpoints = {lab["endpoint"] for lab in labels}
    assert "other" in methods and not methods & {"FOO", "BAZ", 'B"A\\R'}
    assert endpoints <= {"unmatched", "/metrics", "/health", "/v1/stats"} | {"other"}


def test_each_metrics_object_has_its_own_registry() -> None:
    """Two workers in one process (tests, embedded hosts) never see each other's requests."""
    from rpc_server.metrics import Metrics

    first, second = Metrics(), Metrics()
    first.observe("/v1/stats", "GET", 200, 0.01, 0, 10)
    assert b'distbatch_requests_total{endpoint="/v1/stats",method="GET",status="200"} 1.0' in first.render({})
    assert b'endpoint="/v1/stats"' not in second.render({})
    gauges = {"distbatch_shards": ("Shards stored.", 7), "distbatch_capacity_bytes": ("Capacity.", None)}
    text = second.render(gauges, {"distbatch_evicted_shards_total": ("Evicted.", 3)}).decode()
    names = sample_names(text)
    assert {"distbatch_shards", "distbatch_evicted_shards_total"} <= names
    assert "distbatch_capacity_bytes" not in names  # no capacity: no series


def test_a_served_controller_reports_its_queues_and_requests(serve: Callable[..., ControllerServer]) -> None:
    controller = Controller()
    server = serve(controller)
    remote = RemoteController(server.address)
    remote.create_partition("train")
    remote.create_partition("eval")
    families = {f.name: f for f in text_string_to_metric_families(scrape(server.address))}
    assert families["distbatch_controller_partitions"].samples[0].value == 2
    assert families["distbatch_controller_waiting_consumers"].samples[0].value == 0
    requests = {
        (s.labels["endpoint"], s.labels["status"]): s.value
        for s in families["distbatch_requests"].samples
        if s.name == "distbatch_requests_total"
    }
    assert requests[("/v1/controller/create_partition", "200")] == 2
