"""HTTP-level tests of the worker server: real `python -m rpc_server` processes, real HTTP (requests)."""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import bundle_support
import numpy as np
import pytest
import requests
import safetensors.torch
import torch
from bundle_support import GOOD_VALUES, MALFORMED_BUNDLES, describe, forge

from distbatch.errors import WireFormatError
from distbatch.launch import WorkerProcess, read_first_line
from distbatch.wire import decode_bundle, encode_bundle_bytes

ROOT = Path(__file__).resolve().parents[2]
OCTET = {"Content-Type": "application/octet-stream"}
NO_TOKEN_ENV = {"DISTBATCH_TOKEN": ""}
TOKEN = "secret"
ADDRESS = re.compile(r"127\.0\.0\.1:([0-9]{1,5})")

# One session for the whole module; never pick up proxies from the environment.
HTTP = requests.Session()
HTTP.trust_env = False


# --------------------------------------------------------------------------- helpers


def url(worker: WorkerProcess, path: str) -> str:
    return f"http://{worker.node}{path}"


def put_raw(worker: WorkerProcess, body: bytes, headers: dict[str, str] | None = None) -> requests.Response:
    return HTTP.put(url(worker, "/v1/shards"), data=body, headers=headers or OCTET, timeout=10)


def put(
    worker: WorkerProcess, shards: dict[Any, Any], headers: dict[str, str] | None = None
) -> requests.Response:
    return put_raw(worker, encode_bundle_bytes(shards), {**OCTET, **(headers or {})})


def post_json(
    worker: WorkerProcess, path: str, body: Any, headers: dict[str, str] | None = None
) -> requests.Response:
    return HTTP.post(url(worker, path), json=body, headers=headers, timeout=10)


def fetch(
    worker: WorkerProcess, keys: list[list[str]], headers: dict[str, str] | None = None
) -> requests.Response:
    return post_json(worker, "/v1/shards/fetch", {"keys": keys}, headers)


def fetch_ok(worker: WorkerProcess, keys: list[list[str]], headers: dict[str, str] | None = None) -> dict:
    response = fetch(worker, keys, headers)
    assert response.status_code == 200, response.text
    assert response.headers["Content-Type"] == "application/octet-stream"
    return decode_bundle(response.content)


STORE_FIELDS = ("node", "shards", "tasks", "bytes", "capacity", "free")


def stats(worker: WorkerProcess, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """What /v1/stats says about the store (traffic counters left out)."""
    response = HTTP.get(url(worker, "/v1/stats"), headers=headers, timeout=10)
    assert response.status_code == 200, response.text
    body = response.json()
    return {k: body[k] for k in STORE_FIELDS}


def metrics(worker: WorkerProcess, headers: dict[str, str] | None = None) -> dict[str, float]:
    """The Prometheus samples as {'name{labels}': value}."""
    response = HTTP.get(url(worker, "/metrics"), headers=headers, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["Content-Type"].startswith("text/plain")
    samples = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def _labels(sample: str) -> tuple[str, dict[str, str]]:
    name, _, rest = sample.partition("{")
    return name, dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', rest))


def metric_sum(samples: dict[str, float], name: str, **want: str) -> float:
    """Sum of the samples of `name` whose labels include `want`."""
    total = 0.0
    for sample, value in samples.items():
        sample_name, labels = _labels(sample)
        if sample_name == name and all(labels.get(k) == v for k, v in want.items()):
            total += value
    return total


def assert_json_error(response: requests.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["Content-Type"].startswith("application/json")
    body = response.json()
    assert isinstance(body.get("error"), str) and body["error"]
    assert isinstance(body.get("message"), str) and body["message"]
    if code is not None:
        assert body["error"] == code, body
    return body


def container(header: dict[str, Any] | bytes, data: bytes = b"") -> bytes:
    """A hand-made safetensors container (to send what `encode_bundle_bytes` would refuse)."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


def same_tensor(a: torch.Tensor, b: Any) -> bool:
    return (
        isinstance(b, torch.Tensor)
        and a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
        )
    )


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def plain(module_worker_factory: Callable[..., WorkerProcess]) -> WorkerProcess:
    return module_worker_factory()


@pytest.fixture(scope="module")
def capped(module_worker_factory: Callable[..., WorkerProcess]) -> WorkerProcess:
    return module_worker_factory("--max-bytes", "1000")


@pytest.fixture(scope="module")
def limited(module_worker_factory: Callable[..., WorkerProcess]) -> WorkerProcess:
    return module_worker_factory("--max-request-bytes", "4096", "--max-json-bytes", "256")


@pytest.fixture(scope="module")
def secured(module_worker_factory: Callable[..., WorkerProcess]) -> WorkerProcess:
    return module_worker_factory(env={"DISTBATCH_TOKEN": TOKEN})


@pytest.fixture
def cli() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Factory: `python -m rpc_server ARGS` with stdout/stderr piped; killed at teardown if still running."""
    processes: list[subprocess.Popen[bytes]] = []

    def start(*args: str) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(
            [sys.executable, "-m", "rpc_server", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            cwd=ROOT,
            env={**os.environ, **NO_TOKEN_ENV},
        )
        processes.append(process)
        return process

    yield start
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=10)


# --------------------------------------------------------------------------- CLI


@pytest.mark.parametrize("host_args", [("--host", "127.0.0.1"), ()], ids=["explicit-host", "default-host"])
def test_cli_prints_address_writes_file_and_exits_on_sigterm(
    cli: Callable[..., subprocess.Popen[bytes]], tmp_path: Path, host_args: tuple[str, ...]
) -> None:
    address_file = tmp_path / "node.addr"
    process = cli(*host_args, "--port", "0", "--address-file", str(address_file))
    node = read_first_line(process, 30.0)
    assert node is not None, "the worker printed no complete address line"
    match = ADDRESS.fullmatch(node)
    assert match is not None, node  # binds loopback unless told otherwise
    assert 0 < int(match.group(1)) < 65536
    # the file is written (atomically) right after the line is printed
    deadline = time.monotonic() + 10
    while not address_file.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert address_file.read_text() == node + "\n"

    health = HTTP.get(f"http://{node}/health", timeout=10)
    assert health.status_code == 200
    assert health.json()["status"] == "ok" and health.json()["node"] == node
    assert put_raw(WorkerProcess(process, node), encode_bundle_bytes({("cli", "x"): 1})).status_code == 200

    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=10)
    assert process.returncode == 0, stderr.decode(errors="replace")
    assert time.monotonic() - started < 5
    assert stdout == b""  # the address was the only line
    assert b"Traceback" not in stderr
    with pytest.raises(requests.ConnectionError):
        HTTP.get(f"http://{node}/health", timeout=5)


def test_cli_on_a_taken_port_says_so_and_exits_1(cli: Callable[..., subprocess.Popen[bytes]]) -> None:
    first = cli("--port", "0")
    node = read_first_line(first, 30.0)
    assert node is not None
    second = cli("--port", node.rsplit(":", 1)[1])
    _, stderr = second.communicate(timeout=60)
    assert second.returncode == 1
    assert f"cannot listen on {node}: Address already in use".encode() in stderr, stderr
    assert b"Traceback" not in stderr


def test_cli_two_workers_get_distinct_ports(cli: Callable[..., subprocess.Popen[bytes]]) -> None:
    first, second = cli("--port", "0"), cli("--port", "0")
    nodes = {read_first_line(first, 30.0), read_first_line(second, 30.0)}
    assert len(nodes) == 2
    assert all(ADDRESS.fullmatch(n) for n in nodes)


# --------------------------------------------------------------------------- health, stats, metrics


def test_health(plain: WorkerProcess) -> None:
    response = HTTP.get(url(plain, "/health"), timeout=10)
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok" and body["node"] == plain.node


def test_stats_shape(plain: WorkerProcess, capped: WorkerProcess) -> None:
    response = HTTP.get(url(plain, "/v1/stats"), timeout=10)
    assert response.status_code == 200
    body = response.json()
    assert body["node"] == plain.node
    assert set(STORE_FIELDS) <= set(body)
    assert body["capacity"] is None and body["free"] is None
    capped_stats = stats(capped)
    assert capped_stats["capacity"] == 1000
    assert capped_stats["free"] == 1000 - capped_stats["bytes"]


def test_metrics_move_with_requests(plain: WorkerProcess) -> None:
    before = metrics(plain)
    value = torch.arange(10, dtype=torch.float32)
    assert put(plain, {("met-1", "x"): value, ("met-1", "n"): 7}).status_code == 200
    fetch_ok(plain, [["met-1", "x"]])
    assert fetch(plain, [["met-missing", "x"]]).status_code == 404
    after = metrics(plain)
    body = stats(plain)

    # gauges mirror the store
    assert after["distbatch_shards"] == body["shards"]
    assert after["distbatch_tasks"] == body["tasks"]
    assert after["distbatch_stored_bytes"] == body["bytes"]
    assert after["distbatch_stored_bytes"] - before["distbatch_stored_bytes"] == 40 + 1

    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    assert delta("distbatch_requests_total", endpoint="/v1/shards", method="PUT", status="200") == 1
    assert delta("distbatch_requests_total", endpoint="/v1/shards/fetch", status="200") == 1
    assert delta("distbatch_requests_total", endpoint="/v1/shards/fetch", status="404") == 1
    assert delta("distbatch_request_errors_total", endpoint="/v1/shards/fetch") == 1
    assert delta("distbatch_request_errors_total", endpoint="/v1/shards") == 0
    assert delta("distbatch_request_seconds_count", endpoint="/v1/shards/fetch") == 2
    assert delta("distbatch_request_seconds_count", endpoint="/v1/shards") == 1
    assert delta("distbatch_received_bytes_total") > 40
    assert delta("distbatch_sent_bytes_total") > 40
    # the previous /metrics request was counted too
    assert delta("distbatch_requests_total", endpoint="/metrics") == 1

    # the histogram is cumulative and ends at the count
    buckets = sorted(
        (float(labels["le"]), value)
        for sample, value in after.items()
        for name, labels in [_labels(sample)]
        if name == "distbatch_request_seconds_bucket" and labels["endpoint"] == "/v1/shards/fetch"
    )
    counts = [count for _, count in buckets]
    assert buckets[-1][0] == float("inf")
    assert counts == sorted(counts)
    assert counts[-1] == metric_sum(after, "distbatch_request_seconds_count", endpoint="/v1/shards/fetch")
    assert metric_sum(after, "distbatch_request_seconds_sum", endpoint="/v1/shards/fetch") > 0


def test_metrics_count_the_connections_being_served(start_worker: Callable[..., WorkerProcess]) -> None:
    """A connection in a request is active (the one asking for /metrics too), a kept-alive one
    between requests idle: what a test or an operator waits on, rather than counting threads."""
    worker = start_worker(env={"DISTBATCH_TOKEN": ""})
    host, port = worker.node.rsplit(":", 1)
    fresh = requests.Session()  # one kept-alive connection of its own
    fresh.trust_env = False
    try:
        assert fresh.get(f"http://{worker.node}/health", timeout=10).ok
        # The client has its answer a moment before the server's thread goes back to waiting.
        deadline = time.monotonic() + 30
        while (alone := metrics(worker))["distbatch_connections_idle"] < 1:
            assert time.monotonic() < deadline, "the kept-alive connection never counted as idle"
            time.sleep(0.05)
        assert alone["distbatch_connections_active"] >= 1  # the one asking for /metrics
        with socket.create_connection((host, int(port)), timeout=10) as stalled:
            head = "PUT /v1/shards HTTP/1.1\r\nHost: w\r\nContent-Length: 1000\r\n\r\n"
            stalled.sendall(head.encode() + b"\0" * 10)  # a body that never finishes
            deadline = time.monotonic() + 30
            while metrics(worker)["distbatch_connections_active"] < alone["distbatch_connections_active"] + 1:
                assert time.monotonic() < deadline, "the stalled upload never counted as active"
                time.sleep(0.05)
    finally:
        fresh.close()


def test_metrics_capacity_gauge(capped: WorkerProcess) -> None:
    assert metrics(capped)["distbatch_capacity_bytes"] == 1000


# --------------------------------------------------------------------------- put / fetch / delete


def test_put_fetch_roundtrip_and_stats(plain: WorkerProcess) -> None:
    before = stats(plain)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int64)
    half = torch.randn(5, dtype=torch.bfloat16)
    response = put(plain, {("rt-1", "ids"): ids, ("rt-1", "lp"): half, ("rt-1", "uid"): "abc"})
    assert response.status_code == 200
    answer = response.json()
    assert {k: answer[k] for k in ("stored", "bytes")} == {"stored": 3, "bytes": 48 + 10 + len('"abc"')}
    # The put's generation: what a batch handle names so that a later put of these keys shows.
    assert type(answer["generation"]) is int and 0 < answer["generation"] < 2**53
    after = stats(plain)
    assert after["shards"] - before["shards"] == 3
    assert after["tasks"] - before["tasks"] == 1
    assert after["bytes"] - before["bytes"] == 63

    got = fetch_ok(plain, [["rt-1", "uid"], ["rt-1", "ids"], ["rt-1", "lp"]])
    assert set(got) == {("rt-1", "ids"), ("rt-1", "lp"), ("rt-1", "uid")}
    assert same_tensor(ids, got[("rt-1", "ids")])
    assert same_tensor(half, got[("rt-1", "lp")])
    assert got[("rt-1", "uid")] == "abc"
    assert put(plain, {("rt-0", "x"): ids}).json()["generation"] == answer["generation"] + 1


def test_put_overwrite_is_idempotent(plain: WorkerProcess) -> None:
    first = {("ow-1", "x"): torch.ones(4), ("ow-1", "y"): [1, 2]}
    assert put(plain, first).status_code == 200
    before = stats(plain)
    assert put(plain, first).status_code == 200
    assert stats(plain) == before  # no double counting

    bigger = torch.arange(8, dtype=torch.float64)
    assert put(plain, {("ow-1", "x"): bigger}).status_code == 200
    after = stats(plain)
    assert after["shards"] == before["shards"] and after["tasks"] == before["tasks"]
    assert after["bytes"] - before["bytes"] == 64 - 16
    got = fetch_ok(plain, [["ow-1", "x"], ["ow-1", "y"]])
    assert same_tensor(bigger, got[("ow-1", "x")])
    assert got[("ow-1", "y")] == [1, 2]


def test_put_accepts_safetensors_package_containers(plain: WorkerProcess) -> None:
    """A bundle written by `safetensors.torch.save` (uniform, ragged, general and partial fields,
    bf16 among them, and a JSON field) is stored as sent and served back, by product or by keys;
    what the worker serves loads with the safetensors package, bf16 still bf16."""
    tasks = ["st-1", "st-2", "st-3"]
    a = torch.randn(3, 4)
    b = [torch.arange(n * 3, dtype=torch.int16).reshape(n, 3) for n in (2, 0, 1)]
    c = [torch.randn(shape).to(torch.bfloat16) for shape in [(2, 2), (), (5,)]]
    d = torch.tensor([[1.5, -0.0]], dtype=torch.float64)
    tensors = {
        "a": a,
        "b": torch.cat(b),
        "b/lengths": torch.tensor([2, 0, 1]),
        "c": torch.cat([v.reshape(-1) for v in c]),
        "c/ranks": torch.tensor([2, 0, 1]),
        "c/dims": torch.tensor([[2, 2], [0, 0], [5, 0]]),
        "d": d,
        "d/rows": torch.tensor([2]),
    }
    fields = {
        "a": {"dtype": "F32", "layout": "uniform"},
        "b": {"dtype": "I16", "layout": "ragged"},
        "c": {"dtype": "BF16", "layout": "general"},
        "d": {"dtype": "F64", "layout": "uniform", "rows": True},
        "uid": {"dtype": None},
    }
    metadata = {"format": "pt", "distbatch": describe(tasks, fields), "json/uid": '["u1", {"k": [1]}, null]'}
    body = safetensors.torch.save(tensors, metadata=metadata)
    before = stats(plain)
    response = put_raw(plain, body, {"Content-Type": "application/x-safetensors"})
    assert response.status_code == 200, response.text
    assert response.json()["stored"] == 3 + 3 + 3 + 1 + 3
    expected: dict[tuple[str, str], Any] = {("st-3", "d"): d[0]}
    for i, task in enumerate(tasks):
        expected[(task, "a")] = a[i]
        expected[(task, "b")] = b[i]
        expected[(task, "c")] = c[i]
    expected.update({("st-1", "uid"): "u1", ("st-2", "uid"): {"k": [1]}, ("st-3", "uid"): None})
    after = stats(plain)
    assert after["shards"] - before["shards"] == len(expected)
    assert after["tasks"] - before["tasks"] == 3

    def check(served: dict[Any, Any]) -> None:
        assert set(served) == set(expected)
        for key, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert same_tensor(value.contiguous(), served[key]), key
            else:
                assert served[key] == value, key

    check(fetch_ok(plain, [list(k) for k in expected]))
    by_product = post_json(plain, "/v1/shards/fetch", {"task_ids": tasks, "fields": ["a", "b", "c", "uid"]})
    assert by_product.status_code == 200, by_product.text
    assert set(decode_bundle(by_product.content)) == {k for k in expected if k[1] != "d"}
    # What we serve loads with the safetensors package: each field's values end to end.
    loaded = safetensors.torch.load(by_product.content)
    assert same_tensor(a, loaded["a"])
    assert same_tensor(torch.cat(b), loaded["b"]) and loaded["b/lengths"].tolist() == [2, 0, 1]
    assert loaded["c"].dtype == torch.bfloat16 and same_tensor(tensors["c"], loaded["c"])
    served_meta = json.loads(split_header(by_product.content)["__metadata__"]["json/uid"])
    assert served_meta == ["u1", {"k": [1]}, None]
    # The forged bundle with every part of the format (numpy-written) is accepted too.
    assert put_raw(plain, bundle_support.GOOD).status_code == 200
    served = fetch_ok(plain, [list(k) for k in GOOD_VALUES])
    for key, value in GOOD_VALUES.items():
        if isinstance(value, np.ndarray):
            assert same_tensor(torch.from_numpy(value), served[key]), key
        else:
            assert served[key] == value, key
    assert post_json(plain, "/v1/shards/delete", {"task_ids": [*tasks, "t0", "t1", "t2"]}).status_code == 200
    assert stats(plain) == before


def split_header(buf: bytes) -> dict[str, Any]:
    return json.loads(buf[8 : 8 + int.from_bytes(buf[:8], "little")])


def test_a_product_fetch_may_ask_for_the_count_of_its_task_ids_instead_of_them(plain: WorkerProcess) -> None:
    """`answer_ids: false`: the answer's description gives the number of task ids (the request
    named them), which only a reader that knows them accepts; by default, the ids; anything but
    a bool is a 400 that changes nothing."""
    from distbatch import wire

    shards = {(f"ai-{i}", "x"): torch.arange(i + 1, dtype=torch.int32) for i in range(3)}
    assert put(plain, shards).status_code == 200
    asked = [f"ai-{i}" for i in (2, 0, 1)]
    body = {"task_ids": asked, "fields": ["x"]}

    def description(answer: requests.Response) -> dict[str, Any]:
        assert answer.status_code == 200, answer.text
        header = json.loads(answer.content[8 : 8 + int.from_bytes(answer.content[:8], "little")])
        return json.loads(header["__metadata__"]["distbatch"])

    counted = post_json(plain, "/v1/shards/fetch", {**body, "answer_ids": False})
    assert description(counted)["task_ids"] == 3
    bundle = wire.parse_bundle(counted.content, asked=asked)
    assert bundle.task_ids == asked
    assert [
        t.tolist()
        for t in wire.split_rows(wire.column_tensor(bundle.columns["x"]), bundle.columns["x"].tensor_shapes)
    ] == [
        [0, 1, 2],
        [0],
        [0, 1],
    ]
    for wrong in (None, asked[:2]):
        with pytest.raises(WireFormatError, match="counts 3 task ids"):
            wire.parse_bundle(counted.content, asked=wrong)
    assert description(post_json(plain, "/v1/shards/fetch", body))["task_ids"] == asked
    refused = post_json(plain, "/v1/shards/fetch", {**body, "answer_ids": "no"})
    assert refused.status_code == 400 and "answer_ids" in refused.json()["message"]


def test_fetch_empty_and_duplicate_keys(plain: WorkerProcess) -> None:
    assert fetch_ok(plain, []) == {}
    assert put(plain, {("dup-1", "x"): torch.tensor([1.5])}).status_code == 200
    got = fetch_ok(plain, [["dup-1", "x"], ["dup-1", "x"]])
    assert list(got) == [("dup-1", "x")]
    assert same_tensor(torch.tensor([1.5]), got[("dup-1", "x")])


def test_fetch_missing_lists_keys_and_returns_nothing(plain: WorkerProcess) -> None:
    assert put(plain, {("miss-1", "x"): torch.zeros(2), ("miss-1", "y"): 1}).status_code == 200
    response = fetch(plain, [["miss-1", "x"], ["miss-2", "x"], ["miss-1", "y"], ["miss-1", "z"]])
    body = assert_json_error(response, 404, "shards_not_found")
    assert body["missing"] == [["miss-2", "x"], ["miss-1", "z"]]
    assert "x" not in body  # no partial data


def test_delete_by_task_ids_and_keys(plain: WorkerProcess) -> None:
    shards = {
        ("del-1", "a"): torch.zeros(4, dtype=torch.int32),
        ("del-1", "b"): torch.zeros(2, dtype=torch.int64),
        ("del-2", "a"): torch.zeros(3, dtype=torch.uint8),
        ("del-2", "b"): "hello",
    }
    assert put(plain, shards).status_code == 200
    before = stats(plain)

    response = post_json(plain, "/v1/shards/delete", {"task_ids": ["del-1", "del-nope"]})
    assert response.status_code == 200
    assert response.json() == {"deleted": 2, "bytes_freed": 16 + 16}
    again = post_json(plain, "/v1/shards/delete", {"task_ids": ["del-1"]})
    assert again.json() == {"deleted": 0, "bytes_freed": 0}

    response = post_json(plain, "/v1/shards/delete", {"keys": [["del-2", "b"], ["del-2", "nope"]]})
    assert response.json() == {"deleted": 1, "bytes_freed": len('"hello"')}
    again = post_json(plain, "/v1/shards/delete", {"keys": [["del-2", "b"]]})
    assert again.json() == {"deleted": 0, "bytes_freed": 0}

    after = stats(plain)
    assert before["shards"] - after["shards"] == 3
    assert before["tasks"] - after["tasks"] == 1
    assert before["bytes"] - after["bytes"] == 32 + 7
    assert fetch(plain, [["del-1", "a"]]).status_code == 404
    assert same_tensor(torch.zeros(3, dtype=torch.uint8), fetch_ok(plain, [["del-2", "a"]])[("del-2", "a")])


@pytest.mark.parametrize(
    "body", [{}, {"task_ids": ["x"], "keys": [["x", "y"]]}, {"other": 1}], ids=["neither", "both", "other"]
)
def test_delete_needs_exactly_one_selector(plain: WorkerProcess, body: dict[str, Any]) -> None:
    assert_json_error(post_json(plain, "/v1/shards/delete", body), 400, "bad_request")


def test_invalid_delete_deletes_nothing(plain: WorkerProcess) -> None:
    assert put(plain, {("idel-1", "x"): 1}).status_code == 200
    response = post_json(plain, "/v1/shards/delete", {"task_ids": ["idel-1", "bad id"]})
    assert_json_error(response, 400, "invalid_id")
    response = post_json(plain, "/v1/shards/delete", {"keys": [["idel-1", "x"], ["idel-1", "../x"]]})
    assert_json_error(response, 400, "invalid_id")
    assert fetch_ok(plain, [["idel-1", "x"]]) == {("idel-1", "x"): 1}


# --------------------------------------------------------------------------- capacity


def test_capacity_507_leaves_store_unchanged(capped: WorkerProcess) -> None:
    base = torch.arange(150, dtype=torch.int32)  # 600 bytes
    assert put(capped, {("cap-1", "x"): base}).status_code == 200
    before = stats(capped)
    assert before["bytes"] == 600

    over = put(capped, {("cap-2", "x"): torch.zeros(101, dtype=torch.int32)})  # 404 bytes: 1004 > 1000
    assert_json_error(over, 507, "insufficient_storage")
    # part of this bundle would fit, the whole would not: none of it is stored
    mixed = put(
        capped, {("cap-3", "small"): torch.zeros(10, dtype=torch.int32), ("cap-3", "big"): torch.zeros(100)}
    )
    assert_json_error(mixed, 507, "insufficient_storage")
    assert stats(capped) == before
    body = assert_json_error(fetch(capped, [["cap-3", "small"], ["cap-3", "big"], ["cap-2", "x"]]), 404)
    assert len(body["missing"]) == 3
    assert same_tensor(base, fetch_ok(capped, [["cap-1", "x"]])[("cap-1", "x")])

    # exactly full is allowed; replacing a shard at full capacity counts only the difference
    assert put(capped, {("cap-4", "x"): torch.zeros(100, dtype=torch.int32)}).status_code == 200
    assert stats(capped)["free"] == 0
    replacement = torch.full((150,), 7, dtype=torch.int32)
    assert put(capped, {("cap-1", "x"): replacement}).status_code == 200
    assert same_tensor(replacement, fetch_ok(capped, [["cap-1", "x"]])[("cap-1", "x")])
    assert_json_error(put(capped, {("cap-5", "x"): 1}), 507)

    # freeing space makes room again
    freed = post_json(capped, "/v1/shards/delete", {"task_ids": ["cap-1", "cap-4"]}).json()
    assert freed == {"deleted": 2, "bytes_freed": 1000}
    assert put(capped, {("cap-2", "x"): torch.zeros(101, dtype=torch.int32)}).status_code == 200
    post_json(capped, "/v1/shards/delete", {"task_ids": ["cap-2"]})
    assert stats(capped)["bytes"] == 0


# --------------------------------------------------------------------------- request size bounds


def test_request_body_bound(limited: WorkerProcess) -> None:
    small = torch.arange(16, dtype=torch.int64)
    assert put(limited, {("lim-1", "x"): small}).status_code == 200
    before = stats(limited)

    big = encode_bundle_bytes({("lim-2", "x"): torch.zeros(2048, dtype=torch.int32)})
    assert len(big) > 4096
    assert_json_error(put_raw(limited, big), 413)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the bound still holds
        for start in range(0, len(big), 1000):
            yield big[start : start + 1000]

    assert_json_error(put_raw(limited, chunks()), 413)  # type: ignore[arg-type]

    assert stats(limited) == before
    assert fetch(limited, [["lim-2", "x"]]).status_code == 404
    assert same_tensor(small, fetch_ok(limited, [["lim-1", "x"]])[("lim-1", "x")])


@pytest.mark.parametrize("path", ["/v1/shards/fetch", "/v1/shards/delete"])
def test_json_body_bound(limited: WorkerProcess, path: str) -> None:
    assert put(limited, {("limj-1", "x"): 5}).status_code == 200
    keys = [[f"limj-{i}", "field"] for i in range(40)]
    body = json.dumps({"keys": keys}).encode()
    assert 256 < len(body) < 4096
    assert_json_error(post_json(limited, path, {"keys": keys}), 413, "payload_too_large")

    def chunks() -> Iterator[bytes]:
        yield body[:100]
        yield body[100:]

    response = HTTP.post(
        url(limited, path), data=chunks(), headers={"Content-Type": "application/json"}, timeout=10
    )
    assert_json_error(response, 413)
    assert fetch_ok(limited, [["limj-1", "x"]]) == {("limj-1", "x"): 5}


# --------------------------------------------------------------------------- id validation

BAD_IDS: list[Any] = ["../etc", "a b", "x" * 201, "", "tab\t", "é", "a/b", "semi;colon", "new\nline"]
BAD_NON_STRINGS: list[Any] = [5, None, ["a"], {"a": 1}, True]


def test_longest_valid_id_is_accepted(plain: WorkerProcess) -> None:
    long_id = "L" * 200
    field = "f._:@=+-9"
    assert put(plain, {(long_id, field): 3}).status_code == 200
    assert fetch_ok(plain, [[long_id, field]]) == {(long_id, field): 3}
    assert post_json(plain, "/v1/shards/delete", {"task_ids": [long_id]}).json()["deleted"] == 1


@pytest.mark.parametrize("bad", BAD_IDS)
def test_put_rejects_invalid_ids_in_container_names(plain: WorkerProcess, bad: str) -> None:
    """Ids live in the bundle's description (task ids) and in its column names (fields: the data
    entry, its tables, `json/<field>`): an invalid one anywhere refuses the whole put."""
    before = stats(plain)
    u8 = {"dtype": "U8", "layout": "uniform"}
    bodies = [
        # an invalid task id, for a tensor field and for a JSON field
        container(
            {
                "__metadata__": {"distbatch": describe([bad], {"x": u8})},
                "x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
            },
            b"\x01",
        ),
        container({"__metadata__": {"distbatch": describe([bad], {"j": {"dtype": None}}), "json/j": "[1]"}}),
        # an invalid field name: a tensor field (its data entry), a ragged one (its table too), a JSON one
        container(
            {
                "__metadata__": {"distbatch": describe(["ok-task"], {bad: u8})},
                bad: {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
            },
            b"\x01",
        ),
        container(
            {
                "__metadata__": {
                    "distbatch": describe(["ok-task"], {bad: {"dtype": "U8", "layout": "ragged"}})
                },
                bad: {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                f"{bad}/lengths": {"dtype": "I64", "shape": [1], "data_offsets": [1, 9]},
            },
            b"\x01" + (1).to_bytes(8, "little"),
        ),
        container(
            {
                "__metadata__": {
                    "distbatch": describe(["ok-task"], {bad: {"dtype": None}}),
                    f"json/{bad}": "[1]",
                }
            }
        ),
    ]
    for body in bodies:
        assert_json_error(put_raw(plain, body), 400, "bad_container")
    # one bad id spoils the whole bundle: good tasks and fields in it are not stored either
    spoiled = forge(
        ["good-1", bad, "good-2"],
        {"x": u8, "j": {"dtype": None}},
        {"x": np.arange(3, dtype=np.uint8)},
        {"j": [1, 2, 3]},
    )
    assert_json_error(put_raw(plain, spoiled), 400, "bad_container")
    assert fetch(plain, [["good-1", "x"]]).status_code == 404
    assert stats(plain) == before


def test_put_rejects_name_without_separator(plain: WorkerProcess) -> None:
    header = {"noslash": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}
    assert_json_error(put_raw(plain, container(header, b"\x01")), 400, "bad_container")


@pytest.mark.parametrize("bad", BAD_IDS + BAD_NON_STRINGS)
def test_fetch_and_delete_reject_invalid_ids(plain: WorkerProcess, bad: Any) -> None:
    for key in ([bad, "field"], ["task", bad]):
        assert_json_error(fetch(plain, [key]), 400, "invalid_id")
        assert_json_error(post_json(plain, "/v1/shards/delete", {"keys": [key]}), 400, "invalid_id")
    assert_json_error(post_json(plain, "/v1/shards/delete", {"task_ids": [bad]}), 400, "invalid_id")


@pytest.mark.parametrize("key", [["only-one"], ["a", "b", "c"], "a/b", 7, None, {"task_id": "a"}])
def test_fetch_rejects_malformed_key_entries(plain: WorkerProcess, key: Any) -> None:
    assert_json_error(fetch(plain, [key]), 400, "invalid_id")


# --------------------------------------------------------------------------- malformed bodies

_GOOD_HEADER = {"m/x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
MALFORMED_CONTAINERS: dict[str, bytes] = {
    "empty": b"",
    "under-8-bytes": b"\x01\x02\x03",
    "header-past-end": (1000).to_bytes(8, "little") + b"{}",
    "huge-header-length": (2**62).to_bytes(8, "little") + b"{}",
    "header-not-json": container(b"{not json"),
    "header-not-utf8": container(b'{"\xff\xfe": 1}'),
    "header-is-array": container(b"[1, 2]"),
    "truncated-data": container(_GOOD_HEADER, b"\x00" * 7),
    "trailing-bytes": container(_GOOD_HEADER, b"\x00" * 9),
    "unknown-dtype": container(
        {"m/x": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, b"\x00" * 16
    ),
    "negative-shape": container({"m/x": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}),
    "shape-mismatch": container({"m/x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\x00" * 8),
    "bad-offsets": container({"m/x": {"dtype": "U8", "shape": [2], "data_offsets": [2, 0]}}, b"\x00" * 2),
    "offsets-not-ints": container(
        {"m/x": {"dtype": "U8", "shape": [1], "data_offsets": ["0", "1"]}}, b"\x00"
    ),
    "entry-not-object": container({"m/x": [1, 2, 3]}),
    "overlapping": container(
        {
            "m/x": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
            "m/y": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]},
        },
        b"\x00" * 6,
    ),
    "gap": container(
        {
            "m/x": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
            "m/y": {"dtype": "U8", "shape": [2], "data_offsets": [4, 6]},
        },
        b"\x00" * 6,
    ),
    "duplicate-names": container(
        b'{"m/x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
        b'"m/x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
        b"\x00",
    ),
    "metadata-not-strings": container({"__metadata__": {"m/x": 5}}),
    "metadata-not-object": container({"__metadata__": [1]}),
    "deep-json-header": container(b"[" * 100_000 + b"]" * 100_000),
    "shape-too-large-to-index": container(
        {"m/x": {"dtype": "U8", "shape": [2**62, 4, 0], "data_offsets": [0, 0]}}
    ),
    # valid containers that are no valid bundle: one broken rule of the bundle format each
    **{f"bundle-{label}": body for label, body in MALFORMED_BUNDLES.items()},
}


@pytest.fixture(scope="module")
def reference(plain: WorkerProcess) -> dict[tuple[str, str], Any]:
    """Data stored before the malformed requests; it must survive them unchanged."""
    shards = {
        ("ref-1", "x"): torch.randn(3, 5),
        ("ref-1", "ids"): torch.arange(7),
        ("ref-2", "meta"): {"a": [1, 2, {"b": None}]},
    }
    assert put(plain, shards).status_code == 200
    return shards


def assert_reference_intact(worker: WorkerProcess, shards: dict[tuple[str, str], Any]) -> None:
    assert HTTP.get(url(worker, "/health"), timeout=10).status_code == 200
    got = fetch_ok(worker, [list(k) for k in shards])
    assert set(got) == set(shards)
    for key, value in shards.items():
        if isinstance(value, torch.Tensor):
            assert same_tensor(value, got[key])
        else:
            assert got[key] == value


@pytest.mark.parametrize("name", list(MALFORMED_CONTAINERS))
def test_malformed_container_rejected(plain: WorkerProcess, reference: dict, name: str) -> None:
    before = stats(plain)
    assert_json_error(put_raw(plain, MALFORMED_CONTAINERS[name]), 400, "bad_container")
    assert stats(plain) == before
    assert_reference_intact(plain, reference)


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/json", "application/x-www-form-urlencoded", None]
)
def test_put_wrong_content_type_is_415(
    plain: WorkerProcess, reference: dict, content_type: str | None
) -> None:
    body = encode_bundle_bytes({("ct-1", "x"): torch.ones(2)})
    headers = {"Content-Type": content_type} if content_type else {}
    response = HTTP.put(url(plain, "/v1/shards"), data=body, headers=headers, timeout=10)
    assert_json_error(response, 415, "unsupported_media_type")
    assert fetch(plain, [["ct-1", "x"]]).status_code == 404
    assert_reference_intact(plain, reference)


@pytest.mark.parametrize("path", ["/v1/shards/fetch", "/v1/shards/delete"])
@pytest.mark.parametrize(
    ("body", "content_type", "status"),
    [
        (b'{"keys": [["ref-1", "x"]]}', "application/octet-stream", 415),
        (b'{"keys": [["ref-1", "x"]]}', "text/plain", 415),
        (b"not json", "application/json", 400),
        (b'{"keys": [["ref-1", "x"]]', "application/json", 400),
        (b"\xff\xfe\x00", "application/json", 400),
        (b"", "application/json", 400),
        (b'[["ref-1", "x"]]', "application/json", 400),
        (b'"keys"', "application/json", 400),
        (b"null", "application/json", 400),
        (b'{"keys": "ref-1/x"}', "application/json", 400),
        (b'{"keys": {"ref-1": "x"}}', "application/json", 400),
        (b'{"keys": null}', "application/json", 400),
        (b'{"keys": 3}', "application/json", 400),
        (b'{"task_ids": "ref-1"}', "application/json", 400),
        (b"[" * 100_000 + b"]" * 100_000, "application/json", 400),
    ],
)
def test_malformed_json_bodies(
    plain: WorkerProcess, reference: dict, path: str, body: bytes, content_type: str, status: int
) -> None:
    before = stats(plain)
    response = HTTP.post(url(plain, path), data=body, headers={"Content-Type": content_type}, timeout=10)
    assert_json_error(response, status)
    assert stats(plain) == before
    assert_reference_intact(plain, reference)


def test_fetch_without_keys_is_400(plain: WorkerProcess) -> None:
    assert_json_error(post_json(plain, "/v1/shards/fetch", {}), 400, "bad_request")


# --------------------------------------------------------------------------- auth

AUTH_CASES: dict[str, dict[str, str]] = {
    "no-header": {},
    "wrong-token": {"Authorization": "Bearer wrong"},
    "token-prefix": {"Authorization": "Bearer secre"},
    "token-suffix": {"Authorization": "Bearer secretx"},
    "wrong-scheme": {"Authorization": "Basic secret"},
    "no-scheme": {"Authorization": "secret"},
    "empty-bearer": {"Authorization": "Bearer "},
    "token-in-other-header": {"X-Token": "secret"},
}
GOOD = {"Authorization": f"Bearer {TOKEN}"}


def _secured_requests(worker: WorkerProcess, headers: dict[str, str]) -> dict[str, requests.Response]:
    bundle = encode_bundle_bytes({("auth-1", "x"): torch.ones(3)})
    return {
        "stats": HTTP.get(url(worker, "/v1/stats"), headers=headers, timeout=10),
        "metrics": HTTP.get(url(worker, "/metrics"), headers=headers, timeout=10),
        "put": HTTP.put(url(worker, "/v1/shards"), data=bundle, headers={**OCTET, **headers}, timeout=10),
        "fetch": fetch(worker, [["auth-1", "x"]], headers),
        "delete": post_json(worker, "/v1/shards/delete", {"task_ids": ["auth-1"]}, headers),
        "unknown": HTTP.get(url(worker, "/v1/nope"), headers=headers, timeout=10),
    }


@pytest.mark.parametrize("case", list(AUTH_CASES))
def test_token_required_everywhere_but_health(secured: WorkerProcess, case: str) -> None:
    before = stats(secured, GOOD)
    for endpoint, response in _secured_requests(secured, AUTH_CASES[case]).items():
        assert response.status_code == 401, endpoint
        assert_json_error(response, 401, "unauthorized")
    assert stats(secured, GOOD) == before  # the unauthorized put stored nothing
    assert HTTP.get(url(secured, "/health"), timeout=10).status_code == 200


def test_right_token_works(secured: WorkerProcess) -> None:
    health = HTTP.get(url(secured, "/health"), timeout=10)
    assert health.status_code == 200 and health.json()["node"] == secured.node
    value = torch.arange(5)
    assert put(secured, {("auth-2", "x"): value}, GOOD).status_code == 200
    assert same_tensor(value, fetch_ok(secured, [["auth-2", "x"]], GOOD)[("auth-2", "x")])
    lower_scheme = {"Authorization": f"bearer {TOKEN}"}  # the scheme is case-insensitive (RFC 7235)
    assert stats(secured, lower_scheme)["shards"] >= 1
    assert metrics(secured, GOOD)["distbatch_shards"] >= 1
    deleted = post_json(secured, "/v1/shards/delete", {"task_ids": ["auth-2"]}, GOOD)
    assert deleted.json() == {"deleted": 1, "bytes_freed": 40}


# --------------------------------------------------------------------------- never unpickle


class _CreatesMarker:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.path),))


def test_pickle_payload_is_rejected_and_never_run(
    plain: WorkerProcess, reference: dict, tmp_path: Path
) -> None:
    # prove the payload is live: unpickling it here does create its marker
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_CreatesMarker(probe)))  # noqa: S301 - our own payload, on purpose
    assert probe.exists()

    marker = tmp_path / "marker"
    payloads = [pickle.dumps(_CreatesMarker(marker), protocol=p) for p in range(pickle.HIGHEST_PROTOCOL + 1)]
    payloads.append(pickle.dumps({"m/x": _CreatesMarker(marker)}))
    payloads.append(torch_pickle(marker))
    for payload in payloads:
        assert_json_error(put_raw(plain, payload), 400, "bad_container")
        response = HTTP.put(
            url(plain, "/v1/shards"),
            data=payload,
            headers={"Content-Type": "application/python-pickle"},
            timeout=10,
        )
        assert_json_error(response, 415)
        response = HTTP.post(
            url(plain, "/v1/shards/fetch"),
            data=payload,
            headers={"Content-Type": "application/json"},
            timeout=10,
        )
        assert_json_error(response, 400)
    time.sleep(0.1)
    assert not marker.exists()
    assert_reference_intact(plain, reference)


def torch_pickle(marker: Path) -> bytes:
    """A `torch.save` file (zip + pickle) carrying the payload."""
    import io

    buffer = io.BytesIO()
    torch.save({"m/x": torch.ones(2), "evil": _CreatesMarker(marker)}, buffer)
    return buffer.getvalue()


# --------------------------------------------------------------------------- routing


@pytest.mark.parametrize("path", ["/nope", "/v1/shards/nope", "/v1/shards/fetch/extra", "/v2/stats"])
def test_unknown_route_is_json_404(plain: WorkerProcess, path: str) -> None:
    assert_json_error(HTTP.get(url(plain, path), timeout=10), 404, "not_found")
    assert_json_error(HTTP.post(url(plain, path), json={}, timeout=10), 404, "not_found")


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/shards"),
        ("POST", "/v1/shards"),
        ("DELETE", "/v1/shards"),
        ("GET", "/v1/shards/fetch"),
        ("PUT", "/v1/shards/delete"),
        ("POST", "/v1/stats"),
        ("DELETE", "/metrics"),
        ("POST", "/health"),
    ],
)
def test_wrong_method_is_json_405(plain: WorkerProcess, method: str, path: str) -> None:
    response = HTTP.request(method, url(plain, path), timeout=10)
    assert_json_error(response, 405, "method_not_allowed")


def test_delete_ids_repeated_or_not_strings(plain: WorkerProcess) -> None:
    """A task id or field named twice is deleted once; an id that is not a string (even an
    unhashable one) is a 400 naming it, and deletes nothing."""
    shards = {
        ("rep-1", "a"): torch.zeros(4, dtype=torch.int32),
        ("rep-1", "b"): torch.zeros(2, dtype=torch.int32),
    }
    assert put(plain, shards).status_code == 200
    before = stats(plain)
    for body in (
        {"task_ids": [{"a": 1}]},
        {"task_ids": ["rep-1", ["x"]]},
        {"task_ids": ["rep-1"], "fields": [{}]},
    ):
        response = post_json(plain, "/v1/shards/delete", body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"] == "invalid_id"
    assert stats(plain)["shards"] == before["shards"]
    response = post_json(plain, "/v1/shards/delete", {"task_ids": ["rep-1", "rep-1"], "fields": ["a", "a"]})
    assert response.json() == {"deleted": 1, "bytes_freed": 16}
    response = post_json(plain, "/v1/shards/delete", {"task_ids": ["rep-1", "rep-1"]})
    assert response.json() == {"deleted": 1, "bytes_freed": 8}
