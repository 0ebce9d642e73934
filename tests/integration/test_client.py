"""ShardClient against real `python -m rpc_server` processes on loopback."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import requests
import torch
from flask import Flask, jsonify
from flask import request as flask_request
from werkzeug.serving import make_server

from distbatch import (
    AuthError,
    CapacityError,
    DeleteResult,
    InvalidIdError,
    RequestError,
    ServerError,
    ShardClient,
    ShardNotFoundError,
    ShardRef,
    WireFormatError,
    WorkerUnavailableError,
)
from distbatch.launch import WorkerProcess

HTTP = requests.Session()
HTTP.trust_env = False
NO_TOKEN_ENV = {"DISTBATCH_TOKEN": ""}

DTYPE_NAMES = [
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
]
DTYPES = [getattr(torch, name) for name in DTYPE_NAMES if isinstance(getattr(torch, name, None), torch.dtype)]


# --------------------------------------------------------------------------- helpers


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def assert_same(expected: Any, got: Any) -> None:
    """Bit-exact equality for tensors (NaNs included); equality and types for JSON values."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), type(got)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert torch.equal(as_bytes(expected), as_bytes(got))
    else:
        assert got == expected
        assert type(got) is type(expected)
        if isinstance(expected, (list, dict)):
            items = zip(expected, got) if isinstance(expected, list) else zip(expected.values(), got.values())
            for a, b in items:
                assert_same(a, b)


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype)
    if dtype.is_floating_point:
        values = torch.randn(shape, generator=gen) * 4
        flat = values.view(-1)
        if flat.numel() >= 3:
            flat[0], flat[1], flat[2] = float("nan"), float("inf"), -0.0
        return values.to(dtype)
    return torch.randint(0, 100, shape, generator=gen).to(dtype)


def digest(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return (
            f"{value.dtype}{tuple(value.shape)}"
            + hashlib.sha256(as_bytes(value).numpy().tobytes()).hexdigest()
        )
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def wire_nbytes(value: Any) -> int:
    """Bytes a shard occupies on a worker: tensor data, or its compact JSON text."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def stats(node: str, token: str | None = None) -> dict[str, Any]:
    """What /v1/stats says about the store (traffic counters left out)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = HTTP.get(f"http://{node}/v1/stats", headers=headers, timeout=10)
    assert response.status_code == 200, response.text
    body = response.json()
    return {k: body[k] for k in ("shards", "tasks", "bytes", "capacity", "free")}


def request_count(node: str, endpoint: str, token: str | None = None) -> int:
    """Requests the node has served on `endpoint` (from /metrics)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    text = HTTP.get(f"http://{node}/metrics", headers=headers, timeout=10).text
    total = 0
    for line in text.splitlines():
        if line.startswith("distbatch_requests_total{") and f'endpoint="{endpoint}"' in line:
            total += int(float(line.rpartition(" ")[2]))
    return total


def free_port() -> int:
    """A loopback port with nothing listening on it (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def capped(module_worker_factory: Callable[..., WorkerProcess]) -> WorkerProcess:
    return module_worker_factory("--max-bytes", "4096")


@pytest.fixture(scope="module")
def secured(module_worker_factory: Callable[..., WorkerProcess]) -> WorkerProcess:
    return module_worker_factory(env={"DISTBATCH_TOKEN": "secret"})


@pytest.fixture
def serve_app() -> Iterator[Callable[[Flask], str]]:
    """Factory: serve a Flask app of the test's own on 127.0.0.1:0 in a thread; shut down at teardown."""
    servers = []

    def serve(app: Flask) -> str:
        server = make_server("127.0.0.1", 0, app, threaded=True)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        servers.append((server, thread))
        return f"127.0.0.1:{server.server_port}"

    yield serve
    for server, thread in servers:
        server.shutdown()
        thread.join(timeout=10)
        server.server_close()


@pytest.fixture
def dropping_server() -> Iterator[tuple[str, list[int]]]:
    """A loopback socket that accepts each connection and closes it at once; counts connections."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    accepted = [0]
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            accepted[0] += 1
            connection.close()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    yield f"127.0.0.1:{listener.getsockname()[1]}", accepted
    stop.set()
    thread.join(timeout=5)
    listener.close()


# --------------------------------------------------------------------------- round trips


def test_every_dtype_round_trips(client: ShardClient, nodes: list[str]) -> None:
    node = nodes[0]
    shards: dict[tuple[str, str], Any] = {}
    for i, dtype in enumerate(DTYPES):
        name = str(dtype).removeprefix("torch.")
        shards[(f"dt-{name}", "matrix")] = sample(dtype, (3, 5), seed=i)
        shards[(f"dt-{name}", "scalar")] = sample(dtype, (), seed=i)
        shards[(f"dt-{name}", "empty")] = sample(dtype, (0, 4), seed=i)
        shards[(f"dt-{name}", "strided")] = sample(dtype, (4, 6), seed=i).t()[1:, ::2]
    assert {torch.bfloat16, torch.bool, torch.float8_e4m3fn} <= set(DTYPES)
    result = client.put(node, shards)
    assert result.stored == len(shards)
    assert result.bytes == sum(wire_nbytes(v) for v in shards.values())

    keys = list(shards)
    got = client.fetch([(node, t, f) for t, f in keys])
    assert len(got) == len(keys)
    for key, value in zip(keys, got):
        assert_same(shards[key], value)
    # fetched tensors are usable, writable tensors (not views of immutable memory)
    matrix = got[keys.index(("dt-float32", "matrix"))]
    matrix.add_(1)
    client.delete(node, task_ids=sorted({t for t, _ in keys}))


def test_numpy_arrays_come_back_as_tensors(client: ShardClient, nodes: list[str]) -> None:
    array = np.arange(12, dtype=np.int16).reshape(3, 4)
    client.put(nodes[0], {("np-1", "x"): array})
    (got,) = client.fetch([(nodes[0], "np-1", "x")])
    assert_same(torch.from_numpy(array), got)
    client.delete(nodes[0], task_ids=["np-1"])


JSON_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -7,
    2**62,
    1.5,
    -0.25,
    1e300,
    "",
    "plain",
    'héllo ✓ \u0000 "quoted" \\',
    [],
    {},
    [1, [2, [3, None]], "x", 2.5, False],
    {"a": {"b": [1, 2, {"c": None}]}, "uid": "g-1", "n": 3},
]


def test_json_values_round_trip(client: ShardClient, nodes: list[str]) -> None:
    node = nodes[1]
    shards = {(f"js-{i}", "value"): v for i, v in enumerate(JSON_VALUES)}
    shards[("js-tuple", "value")] = (1, "a", None)
    client.put(node, shards)
    got = client.fetch([(node, t, f) for t, f in shards])
    for expected, value in zip(shards.values(), got):
        assert_same(list(expected) if isinstance(expected, tuple) else expected, value)
    client.delete(node, task_ids=[t for t, _ in shards])


def test_unsendable_values_are_rejected_before_sending(client: ShardClient, nodes: list[str]) -> None:
    node = nodes[1]
    before = request_count(node, "/v1/shards")
    with pytest.raises(WireFormatError):
        client.put(node, {("bad-1", "x"): object()})
    with pytest.raises(WireFormatError):
        client.put(node, {("bad-1", "x"): {1: "non-string key"}})
    with pytest.raises(ValueError):
        client.put(node, {("bad id", "x"): 1})
    with pytest.raises(ValueError):
        client.put(node, {("ok", "x"): 1, ("x" * 201, "x"): 1})
    with pytest.raises(ValueError):
        client.fetch([(node, "../etc", "x")])
    with pytest.raises(ValueError):
        client.fetch([("not a node", "t", "x")])
    assert request_count(node, "/v1/shards") == before


def test_ragged_shapes(client: ShardClient, nodes: list[str]) -> None:
    node = nodes[2]
    shards: dict[tuple[str, str], Any] = {}
    for i, length in enumerate([0, 1, 7, 64, 3, 513]):
        shards[(f"rag-{i}", "input_ids")] = torch.randint(0, 32000, (length,))
        shards[(f"rag-{i}", "logprobs")] = torch.randn(length, dtype=torch.bfloat16)
        shards[(f"rag-{i}", "image")] = torch.rand(i + 1, 3, 2)
    client.put(node, shards)
    got = client.fetch([ShardRef(node, t, f) for t, f in shards])
    for expected, value in zip(shards.values(), got):
        assert_same(expected, value)
    assert client.delete(node, task_ids=[f"rag-{i}" for i in range(6)]).deleted == len(shards)


def test_ten_thousand_shards(client: ShardClient, nodes: list[str]) -> None:
    node = nodes[0]
    before = stats(node)
    values = torch.arange(10_000 * 3, dtype=torch.int32).reshape(10_000, 3)
    shards = {(f"big-{i}", "x"): values[i] for i in range(10_000)}
    result = client.put(node, shards)
    assert (result.stored, result.bytes) == (10_000, 10_000 * 12)
    after = stats(node)
    assert after["shards"] - before["shards"] == 10_000
    assert after["bytes"] - before["bytes"] == 120_000

    got = client.fetch([(node, f"big-{i}", "x") for i in range(10_000)])
    assert torch.equal(torch.stack(got), values)
    deleted = client.delete(node, task_ids=[f"big-{i}" for i in range(10_000)])
    assert deleted == DeleteResult(10_000, 120_000)
    assert stats(node)["bytes"] == before["bytes"]


def test_fetch_order_across_nodes_with_duplicates(client: ShardClient, nodes: list[str]) -> None:
    expected: dict[tuple[str, str, str], Any] = {}
    for n, node in enumerate(nodes):
        shards = {(f"ord-{n}-{i}", "x"): torch.full((i + 1,), n * 100 + i) for i in range(5)}
        # the same key on every node, with a different value on each
        shards[("ord-same", "x")] = torch.tensor([n])
        client.put(node, shards)
        expected.update({(node, t, f): v for (t, f), v in shards.items()})

    refs = []
    for i in range(5):
        for n, node in enumerate(nodes):
            refs.append((node, f"ord-{n}-{4 - i}", "x"))
    refs += [(nodes[2], "ord-same", "x"), (nodes[0], "ord-same", "x"), (nodes[1], "ord-same", "x")]
    refs += [refs[3], refs[0], refs[3], (nodes[0], "ord-same", "x")]
    got = client.fetch(refs)
    assert len(got) == len(refs)
    for ref, value in zip(refs, got):
        assert_same(expected[ref], value)
    assert client.fetch([]) == []
    client.delete_many({node: [(t, f) for (nd, t, f) in expected if nd == node] for node in nodes})


def test_requests_are_split(nodes: list[str]) -> None:
    node = nodes[1]
    shards = {(f"split-{i}", "x"): torch.zeros(8, dtype=torch.int32) for i in range(10)}  # 32 bytes each
    with ShardClient(max_keys_per_request=3, max_bytes_per_request=64, timeout=20) as client:
        puts, fetches, deletes = (
            request_count(node, "/v1/shards"),
            request_count(node, "/v1/shards/fetch"),
            request_count(node, "/v1/shards/delete"),
        )
        result = client.put(node, shards)
        assert (result.stored, result.bytes) == (10, 320)
        assert request_count(node, "/v1/shards") - puts == 5  # 64 bytes = two shards a request

        refs = [(node, t, f) for t, f in shards]
        got = client.fetch(refs)
        assert all(torch.equal(v, torch.zeros(8, dtype=torch.int32)) for v in got)
        assert request_count(node, "/v1/shards/fetch") - fetches == 4  # 3 keys a request

        sized = [(node, t, f, 32) for t, f in shards]
        assert len(client.fetch(sized)) == 10
        assert request_count(node, "/v1/shards/fetch") - fetches == 4 + 5  # sizes known: 64 bytes a request

        # one shard larger than a whole request still goes, alone
        client.put(node, {("split-big", "x"): torch.zeros(100)})
        assert_same(torch.zeros(100), client.fetch([(node, "split-big", "x", 400)])[0])

        assert client.delete(node, keys=list(shards)) == DeleteResult(10, 320)
        assert request_count(node, "/v1/shards/delete") - deletes == 4
        client.delete(node, task_ids=["split-big"])


# --------------------------------------------------------------------------- missing keys


def test_missing_keys_name_node_and_keys(client: ShardClient, nodes: list[str]) -> None:
    node = nodes[0]
    client.put(node, {("mk-1", "x"): torch.ones(2), ("mk-1", "y"): 1})
    with pytest.raises(ShardNotFoundError) as info:
        client.fetch([(node, "mk-1", "x"), (node, "mk-2", "x"), (node, "mk-1", "z")])
    error = info.value
    assert error.node == node
    assert sorted(error.keys) == [("mk-1", "z"), ("mk-2", "x")]
    assert node in str(error) and "mk-2/x" in str(error) and "mk-1/z" in str(error)
    assert isinstance(error, KeyError)
    client.delete(node, task_ids=["mk-1"])


def test_missing_keys_across_nodes_are_all_reported(client: ShardClient, nodes: list[str]) -> None:
    a, b = nodes[0], nodes[1]
    client.put(a, {("mk2-a", "x"): 1})
    client.put(b, {("mk2-b", "x"): 2})
    refs = [
        (a, "mk2-a", "x"),
        (a, "mk2-gone", "x"),
        (b, "mk2-b", "x"),
        (b, "mk2-gone", "y"),
        (b, "mk2-b", "z"),
    ]
    with pytest.raises(ShardNotFoundError) as info:
        client.fetch(refs)
    error = info.value
    assert sorted(error.keys) == [("mk2-b", "z"), ("mk2-gone", "x"), ("mk2-gone", "y")]
    assert a in str(error) and b in str(error)
    missing_by_node = {n: sorted(k) for n, k in error.missing_by_node.items()}
    assert missing_by_node == {a: [("mk2-gone", "x")], b: [("mk2-b", "z"), ("mk2-gone", "y")]}

    # also when the client split the request per node
    with ShardClient(max_keys_per_request=1, timeout=20) as small:
        with pytest.raises(ShardNotFoundError) as info:
            small.fetch(refs)
    assert sorted(info.value.keys) == sorted(error.keys)
    client.delete_many({a: [("mk2-a", "x")], b: [("mk2-b", "x")]})


# --------------------------------------------------------------------------- delete


def test_delete_by_task_ids_and_keys_is_idempotent(client: ShardClient, nodes: list[str]) -> None:
    node = nodes[2]
    client.put(node, {("dl-1", "a"): torch.zeros(4), ("dl-1", "b"): "xy", ("dl-2", "a"): torch.zeros(2)})
    assert client.delete(node, task_ids=["dl-1"]) == DeleteResult(2, 16 + 4)
    assert client.delete(node, task_ids=["dl-1"]) == DeleteResult(0, 0)
    assert client.delete(node, keys=[("dl-2", "a"), ("dl-2", "b")]) == DeleteResult(1, 8)
    assert client.delete(node, keys=[("dl-2", "a")]) == DeleteResult(0, 0)
    assert client.delete(node, task_ids=[]) == DeleteResult(0, 0)
    with pytest.raises(ShardNotFoundError):
        client.fetch([(node, "dl-2", "a")])


def test_delete_argument_checks(client: ShardClient, nodes: list[str]) -> None:
    node = nodes[2]
    before = request_count(node, "/v1/shards/delete")
    with pytest.raises(ValueError):
        client.delete(node)
    with pytest.raises(ValueError):
        client.delete(node, task_ids=["a"], keys=[("a", "b")])
    with pytest.raises(InvalidIdError):
        client.delete(node, task_ids="dl-1")
    with pytest.raises(InvalidIdError):
        client.delete(node, task_ids=["ok", "not ok"])
    with pytest.raises(InvalidIdError):
        client.delete(node, keys=[("ok", "../f")])
    assert request_count(node, "/v1/shards/delete") == before


def test_delete_many_across_nodes(client: ShardClient, nodes: list[str]) -> None:
    plan = {}
    for n, node in enumerate(nodes):
        client.put(node, {(f"dm-{n}", "x"): torch.zeros(n + 1, dtype=torch.int64), (f"dm-{n}", "y"): n})
        plan[node] = [(f"dm-{n}", "x"), (f"dm-{n}", "y"), ("dm-never", "x")]
    assert client.delete_many(plan) == DeleteResult(6, 8 + 16 + 24 + 3)
    assert client.delete_many(plan) == DeleteResult(0, 0)


# --------------------------------------------------------------------------- capacity


def test_capacity_error_stores_nothing(client: ShardClient, capped: WorkerProcess) -> None:
    node = capped.node
    keep = torch.arange(256, dtype=torch.int32)  # 1024 bytes
    client.put(node, {("cap-keep", "x"): keep})
    before = stats(node)
    puts = request_count(node, "/v1/shards")

    with pytest.raises(CapacityError) as info:
        client.put(node, {("cap-a", "x"): torch.zeros(100), ("cap-a", "y"): torch.zeros(1000)})
    assert info.value.node == node
    assert request_count(node, "/v1/shards") - puts == 1  # 507 is not retried
    assert stats(node) == before

    # split by the client into several requests: those that landed are rolled back
    with ShardClient(max_bytes_per_request=1000, timeout=20) as split:
        shards = {(f"cap-s{i}", "x"): torch.full((250,), i, dtype=torch.int32) for i in range(4)}
        with pytest.raises(CapacityError):
            split.put(node, shards)  # 4 x 1000 bytes; only 3072 free
        assert request_count(node, "/v1/shards") - puts == 1 + 4
    after = stats(node)
    assert after["bytes"] == before["bytes"] and after["shards"] == before["shards"]
    for t, f in shards:
        with pytest.raises(ShardNotFoundError):
            client.fetch([(node, t, f)])
    assert_same(keep, client.fetch([(node, "cap-keep", "x")])[0])

    # what fits still fits
    client.put(node, {("cap-fits", "x"): torch.zeros(768, dtype=torch.int32)})
    assert stats(node)["free"] == 0
    client.delete(node, task_ids=["cap-keep", "cap-fits"])


# --------------------------------------------------------------------------- auth


def test_wrong_or_missing_token_is_auth_error(
    secured: WorkerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = secured.node
    monkeypatch.delenv("DISTBATCH_TOKEN", raising=False)
    for token in ["wrong", None]:
        with ShardClient(token=token, timeout=10) as client:
            with pytest.raises(AuthError) as info:
                client.put(node, {("au-1", "x"): 1})
            assert info.value.node == node
            with pytest.raises(AuthError):
                client.fetch([(node, "au-1", "x")])
            with pytest.raises(AuthError):
                client.stats(node)
            with pytest.raises(AuthError):
                client.delete(node, task_ids=["au-1"])
            assert client.health(node)["status"] == "ok"  # health needs no token
    assert stats(node, token="secret")["shards"] == 0


def test_the_process_wide_client_takes_a_token_set_after_a_refusal(
    secured: WorkerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Set DISTBATCH_TOKEN after a first AuthError: the next call of the process-wide client
    sends it (no `set_default_client(None)` needed); the error says where tokens come from."""
    from distbatch import DistributedBatchMemory
    from distbatch.client import default_client, set_default_client

    batch = DistributedBatchMemory.from_dict({"x": torch.arange(3)}, task_ids=["au-d0", "au-d1", "au-d2"])
    monkeypatch.delenv("DISTBATCH_TOKEN", raising=False)
    set_default_client(None)
    try:
        with pytest.raises(AuthError, match=r"DISTBATCH_TOKEN.*reads DISTBATCH_TOKEN again"):
            batch.to_remote(secured.node)
        monkeypatch.setenv("DISTBATCH_TOKEN", "secret")
        remote = batch.to_remote(secured.node)
        assert remote["x"].tolist() == [0, 1, 2] and remote.clear() == 3
        assert default_client().token == "secret"
        given = ShardClient(token="mine", timeout=10)
        set_default_client(given)  # one given is used as it is, whatever the variable says
        assert default_client() is given
        given.close()
    finally:
        set_default_client(None)


def test_right_token_from_constructor_and_env(
    secured: WorkerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = secured.node
    monkeypatch.delenv("DISTBATCH_TOKEN", raising=False)
    with ShardClient(token="secret", timeout=10) as client:
        client.put(node, {("au-2", "x"): torch.arange(3)})
        assert_same(torch.arange(3), client.fetch([(node, "au-2", "x")])[0])
        assert client.stats(node)["shards"] == 1

    monkeypatch.setenv("DISTBATCH_TOKEN", "secret")
    with ShardClient(timeout=10) as client:
        assert_same(torch.arange(3), client.fetch([(node, "au-2", "x")])[0])
        assert client.delete(node, task_ids=["au-2"]) == DeleteResult(1, 24)
    # an explicit token wins over the environment
    with ShardClient(token="wrong", timeout=10) as client:
        with pytest.raises(AuthError):
            client.stats(node)


def test_auth_error_is_not_retried(secured: WorkerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    node = secured.node
    before = request_count(node, "/v1/stats", token="secret")
    with ShardClient(token="wrong", retries=3, timeout=10) as client:
        with pytest.raises(AuthError):
            client.stats(node)
    assert request_count(node, "/v1/stats", token="secret") - before == 1


# --------------------------------------------------------------------------- dead, stopped, unreachable


def test_killed_worker_is_unavailable_quickly(start_worker: Callable[..., WorkerProcess]) -> None:
    worker = start_worker(env=NO_TOKEN_ENV)
    with ShardClient(timeout=3.0, connect_timeout=1.0) as client:
        client.put(worker.node, {("kill-1", "x"): torch.ones(3)})
        worker.kill()
        for call in (
            lambda: client.fetch([(worker.node, "kill-1", "x")]),
            lambda: client.put(worker.node, {("kill-1", "y"): 1}),
            lambda: client.delete(worker.node, task_ids=["kill-1"]),
            lambda: client.stats(worker.node),
        ):
            started = time.monotonic()
            with pytest.raises(WorkerUnavailableError) as info:
                call()
            assert time.monotonic() - started < 10
            assert info.value.node == worker.node
            assert worker.node in str(info.value)


def test_stopped_worker_times_out(start_worker: Callable[..., WorkerProcess]) -> None:
    worker = start_worker(env=NO_TOKEN_ENV)
    with ShardClient(timeout=2.0, connect_timeout=1.0) as client:
        client.put(worker.node, {("stop-1", "x"): torch.ones(3)})
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(WorkerUnavailableError) as info:
                client.fetch([(worker.node, "stop-1", "x")])
            elapsed = time.monotonic() - started
            assert info.value.node == worker.node
            assert 1.5 < elapsed < 6.0
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        # once resumed it serves again, data intact
        assert_same(torch.ones(3), client.fetch([(worker.node, "stop-1", "x")])[0])


def test_unreachable_port_is_unavailable() -> None:
    node = f"127.0.0.1:{free_port()}"
    with ShardClient(timeout=3.0, connect_timeout=1.0, retries=2) as client:
        started = time.monotonic()
        with pytest.raises(WorkerUnavailableError) as info:
            client.fetch([(node, "t", "x")])
        assert time.monotonic() - started < 10
        assert info.value.node == node
        with pytest.raises(WorkerUnavailableError):
            client.health(node)


def test_one_dead_node_fails_the_whole_fetch(
    client: ShardClient, nodes: list[str], start_worker: Callable[..., WorkerProcess]
) -> None:
    worker = start_worker(env=NO_TOKEN_ENV)
    client.put(nodes[0], {("dead-1", "x"): 1})
    client.put(worker.node, {("dead-2", "x"): 2})
    worker.kill()
    with ShardClient(timeout=3.0, connect_timeout=1.0) as short:
        with pytest.raises(WorkerUnavailableError) as info:
            short.fetch([(nodes[0], "dead-1", "x"), (worker.node, "dead-2", "x")])
    assert info.value.node == worker.node
    client.delete(nodes[0], task_ids=["dead-1"])


# --------------------------------------------------------------------------- retries


def test_retries_connection_errors_then_gives_up(dropping_server: tuple[str, list[int]]) -> None:
    node, accepted = dropping_server
    with ShardClient(retries=2, backoff=0.01, timeout=10) as client:
        with pytest.raises(WorkerUnavailableError) as info:
            client.fetch([(node, "t", "x")])
        assert info.value.node == node
    assert accepted[0] == 3  # one attempt and two retries

    # aiohttp itself resends an idempotent request (GET) once on a dropped connection;
    # our retries multiply that, no more
    accepted[0] = 0
    with ShardClient(retries=0, timeout=10) as client:
        with pytest.raises(WorkerUnavailableError):
            client.stats(node)
    per_attempt = accepted[0]
    assert per_attempt in (1, 2)
    accepted[0] = 0
    with ShardClient(retries=2, backoff=0.01, timeout=10) as client:
        with pytest.raises(WorkerUnavailableError):
            client.stats(node)
    assert accepted[0] == 3 * per_attempt


def test_retries_5xx_but_not_4xx(serve_app: Callable[[Flask], str]) -> None:
    hits = {"flaky": 0, "down": 0, "bad": 0}
    app = Flask("peer")

    @app.get("/v1/stats")
    def peer_stats() -> Any:
        mode = flask_request.headers.get("X-Mode") or app.config["MODE"]
        hits[mode] += 1
        if mode == "flaky" and hits["flaky"] < 3:
            return jsonify({"error": "busy", "message": "try later"}), 503
        if mode == "down":
            return jsonify({"error": "internal_error", "message": "boom"}), 500
        if mode == "bad":
            return jsonify({"error": "bad_request", "message": "no"}), 400
        return jsonify({"shards": 0})

    node = serve_app(app)
    with ShardClient(retries=3, backoff=0.01, timeout=10) as client:
        app.config["MODE"] = "flaky"
        assert client.stats(node) == {"shards": 0}
        assert hits["flaky"] == 3

        app.config["MODE"] = "down"
        with pytest.raises(ServerError) as server_error:
            client.stats(node)
        assert hits["down"] == 4 and server_error.value.status == 500

        app.config["MODE"] = "bad"
        with pytest.raises(RequestError) as request_error:
            client.stats(node)
        assert hits["bad"] == 1 and request_error.value.status == 400


def test_bad_request_to_real_worker_is_not_retried(nodes: list[str]) -> None:
    node = nodes[0]
    before = request_count(node, "/v1/shards/fetch")
    with ShardClient(retries=5, backoff=0.01, timeout=10) as client:
        with pytest.raises(ShardNotFoundError):
            client.fetch([(node, "nr-none", "x")])
    assert request_count(node, "/v1/shards/fetch") - before == 1


def test_request_over_server_limit_is_request_error(start_worker: Callable[..., WorkerProcess]) -> None:
    worker = start_worker("--max-request-bytes", "2048", env=NO_TOKEN_ENV)
    with ShardClient(retries=3, timeout=10) as client:
        with pytest.raises(RequestError) as info:
            client.put(worker.node, {("lim-1", "x"): torch.zeros(1024)})
        assert info.value.status == 413
        assert request_count(worker.node, "/v1/shards") == 1
        # split small enough, the same data goes through
    with ShardClient(max_bytes_per_request=1024, timeout=10) as client:
        shards = {(f"lim-{i}", "x"): torch.zeros(128) for i in range(8)}
        assert client.put(worker.node, shards).stored == 8
        assert stats(worker.node)["bytes"] == 8 * 512


# --------------------------------------------------------------------------- concurrency


def test_sixteen_threads_share_one_client(client: ShardClient, nodes: list[str]) -> None:
    before = {node: stats(node) for node in nodes}
    barrier = threading.Barrier(16)

    def work(i: int) -> list[tuple[str, str, str, str, int]]:
        gen = torch.Generator().manual_seed(i)
        node = nodes[i % len(nodes)]
        kept = []
        barrier.wait()
        for r in range(6):
            tid = f"cc-{i}-{r}"
            length = int(torch.randint(1, 300, (1,), generator=gen))
            shards = {
                (tid, "x"): torch.randn(length, generator=gen),
                (tid, "ids"): torch.randint(0, 1000, (length, 2), generator=gen),
                (tid, "meta"): {"thread": i, "round": r},
            }
            client.put(node, shards)
            got = client.fetch([(node, t, f) for t, f in shards])
            assert [digest(v) for v in got] == [digest(v) for v in shards.values()]
            nbytes = sum(wire_nbytes(v) for v in shards.values())
            if r % 3 == 2:
                assert client.delete(node, task_ids=[tid]) == DeleteResult(3, nbytes)
            else:
                kept += [(node, t, f, digest(v), wire_nbytes(v)) for (t, f), v in shards.items()]
        return kept

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(work, range(16)))
    kept = [item for items in results for item in items]

    # everything kept is there and intact, fetched in one interleaved call
    got = client.fetch([(node, t, f) for node, t, f, _, _ in kept])
    assert [digest(v) for v in got] == [d for *_, d, _ in kept]
    for node in nodes:
        after = stats(node)
        mine = [item for item in kept if item[0] == node]
        assert after["bytes"] - before[node]["bytes"] == sum(item[4] for item in mine)
        assert after["shards"] - before[node]["shards"] == len(mine)
    deleted = client.delete_many({node: [(t, f) for n, t, f, _, _ in kept if n == node] for node in nodes})
    assert deleted == DeleteResult(len(kept), sum(item[4] for item in kept))
    assert {node: stats(node)["bytes"] for node in nodes} == {node: before[node]["bytes"] for node in nodes}


# --------------------------------------------------------------------------- sync API everywhere, async API


def test_sync_api_inside_a_running_event_loop(client: ShardClient, nodes: list[str]) -> None:
    node = nodes[1]

    async def main() -> list[Any]:
        assert asyncio.get_running_loop().is_running()
        client.put(node, {("loop-1", "x"): torch.arange(4)})
        got = client.fetch([(node, "loop-1", "x")])
        assert client.stats(node)["shards"] >= 1
        client.delete(node, task_ids=["loop-1"])
        return got

    (value,) = asyncio.run(main())
    assert_same(torch.arange(4), value)


def test_sync_api_inside_a_flask_handler(
    client: ShardClient, nodes: list[str], serve_app: Callable[[Flask], str]
) -> None:
    app = Flask("gateway")

    @app.post("/sum")
    def total() -> Any:
        body = flask_request.get_json()
        values = client.fetch([(node, task, "x") for node, task in body["refs"]])
        client.put(body["refs"][0][0], {(body["out"], "x"): torch.stack(values).sum(0)})
        return jsonify({"sum": torch.stack(values).sum(0).tolist()})

    for n, node in enumerate(nodes):
        client.put(node, {(f"fl-{n}", "x"): torch.tensor([n, 10 * n])})
    gateway = serve_app(app)
    refs = [[node, f"fl-{n}"] for n, node in enumerate(nodes)]

    with ThreadPoolExecutor(4) as pool:
        responses = list(
            pool.map(
                lambda i: HTTP.post(
                    f"http://{gateway}/sum", json={"refs": refs, "out": f"fl-out-{i}"}, timeout=20
                ),
                range(4),
            )
        )
    for response in responses:
        assert response.status_code == 200, response.text
        assert response.json() == {"sum": [3, 30]}
    outs = client.fetch([(nodes[0], f"fl-out-{i}", "x") for i in range(4)])
    assert all(out.tolist() == [3, 30] for out in outs)
    client.delete(nodes[0], task_ids=[f"fl-out-{i}" for i in range(4)] + ["fl-0"])
    client.delete_many({nodes[1]: [("fl-1", "x")], nodes[2]: [("fl-2", "x")]})


def test_async_api_from_the_callers_loop(nodes: list[str]) -> None:
    client = ShardClient(timeout=20)

    async def main() -> None:
        puts = await asyncio.gather(
            *(client.aput(nodes[i % 3], {(f"as-{i}", "x"): torch.full((i + 1,), i)}) for i in range(30))
        )
        assert all(p.stored == 1 for p in puts)
        fetched = await asyncio.gather(
            *(client.afetch([(nodes[i % 3], f"as-{i}", "x")] * 2) for i in range(30))
        )
        for i, pair in enumerate(fetched):
            assert len(pair) == 2
            assert_same(torch.full((i + 1,), i), pair[0])
        stats_replies = await asyncio.gather(*(client.astats(node) for node in nodes))
        assert [s["node"] for s in stats_replies] == nodes
        assert (await client.ahealth(nodes[0]))["status"] == "ok"
        deleted = await asyncio.gather(
            *(client.adelete(nodes[i % 3], task_ids=[f"as-{i}"]) for i in range(15)),
            client.adelete_many({nodes[i % 3]: [] for i in range(3)}),
        )
        assert sum(d.deleted for d in deleted) == 15
        with pytest.raises(ShardNotFoundError):
            await client.afetch([(nodes[0], "as-0", "x")])

    try:
        asyncio.run(main())
        # a second, different event loop with the same client
        rest = asyncio.run(client.adelete_many({nodes[i % 3]: [(f"as-{i}", "x")] for i in range(15, 18)}))
        assert rest.deleted == 3
        left = [client.delete(nodes[i % 3], task_ids=[f"as-{i}"]).deleted for i in range(18, 30)]
        assert sum(left) == 12
    finally:
        client.close()


def test_close_restarts_and_context_manager(nodes: list[str]) -> None:
    node = nodes[2]

    def loop_threads() -> int:
        return sum(1 for t in threading.enumerate() if t.name == "distbatch-client")

    base = loop_threads()
    client = ShardClient(timeout=10)
    client.put(node, {("cl-1", "x"): torch.arange(3)})
    assert loop_threads() == base + 1
    client.close()
    assert loop_threads() == base
    client.close()  # closing twice is fine
    assert_same(torch.arange(3), client.fetch([(node, "cl-1", "x")])[0])  # restarts
    client.close()

    with ShardClient(timeout=10) as managed:
        assert_same(torch.arange(3), managed.fetch([(node, "cl-1", "x")])[0])
        assert loop_threads() == base + 1
    assert loop_threads() == base
    assert managed.delete(node, task_ids=["cl-1"]) == DeleteResult(1, 24)  # usable after the with block
    managed.close()
    assert loop_threads() == base


def test_a_client_nobody_holds_stops_its_loop_thread(nodes: list[str]) -> None:
    """No reference cycle keeps a dropped client (and so its thread and sessions) alive: its
    parts hold the runtime, never the client, so it goes as soon as the last name does."""

    def loop_threads() -> int:
        return sum(1 for t in threading.enumerate() if t.name == "distbatch-client")

    base = loop_threads()
    client = ShardClient(timeout=10)
    client.put(nodes[0], {("drop-1", "x"): torch.arange(3)})
    assert client.delete(nodes[0], task_ids=["drop-1"]).deleted == 1
    assert loop_threads() == base + 1
    gc.disable()  # freed by reference counting alone, not by a collection of cycles
    try:
        del client
        assert loop_threads() == base
    finally:
        gc.enable()


@pytest.mark.parametrize("child_closes", [False, True])
def test_a_forked_child_never_disturbs_the_parents_client(nodes: list[str], child_closes: bool) -> None:
    """The child gets a loop and sessions of its own; the parent's, which it inherits, are kept
    and never touched there: freed in the child, their finalizers would unregister the parent's
    sockets from the epoll instance both processes share, and the parent's next request on a
    kept-alive connection would wait for an answer it never sees."""
    node = nodes[0]
    with ShardClient(timeout=5, retries=0) as client:
        client.put(node, {("fork-1", "x"): torch.arange(4)})
        assert_same(torch.arange(4), client.fetch([(node, "fork-1", "x")])[0])  # connections kept alive
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                ok = torch.equal(client.fetch([(node, "fork-1", "x")])[0], torch.arange(4))
                if child_closes:
                    client.close()
                gc.collect()
                code = 0 if ok else 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        gc.collect()
        started = time.monotonic()
        for _ in range(3):  # on every kept-alive connection the parent had
            assert_same(torch.arange(4), client.fetch([(node, "fork-1", "x")])[0])
        assert client.stats(node)["shards"] >= 1 and time.monotonic() - started < 4
        assert client.delete(node, task_ids=["fork-1"]).deleted == 1


def test_close_releases_calls_in_flight(start_worker: Callable[..., WorkerProcess]) -> None:
    """close() from another thread while calls wait on a frozen worker: they end, never hang."""
    worker = start_worker(env=NO_TOKEN_ENV)
    client = ShardClient(timeout=60, retries=0)
    client.put(worker.node, {("fl-1", "x"): 1})
    outcomes: dict[str, BaseException | None] = {}

    def sync_call() -> None:
        try:
            client.fetch([(worker.node, "fl-1", "x")])
            outcomes["sync"] = None
        except BaseException as exc:  # noqa: B036 - we record whatever ends the call
            outcomes["sync"] = exc

    def async_call() -> None:
        try:
            asyncio.run(client.afetch([(worker.node, "fl-1", "x")]))
            outcomes["async"] = None
        except BaseException as exc:  # noqa: B036
            outcomes["async"] = exc

    os.kill(worker.pid, signal.SIGSTOP)
    try:
        threads = [threading.Thread(target=f, daemon=True) for f in (sync_call, async_call)]
        for thread in threads:
            thread.start()
        time.sleep(0.5)
        started = time.monotonic()
        client.close()
        for thread in threads:
            thread.join(timeout=10)
        assert not any(thread.is_alive() for thread in threads)
        assert time.monotonic() - started < 10
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    for name in ("sync", "async"):
        assert isinstance(outcomes[name], RuntimeError), outcomes
        assert "closed" in str(outcomes[name])
    # and the client still works afterwards
    assert client.fetch([(worker.node, "fl-1", "x")]) == [1]
    client.close()


def test_failed_split_put_keeps_overwritten_shards(start_worker: Callable[..., WorkerProcess]) -> None:
    worker = start_worker("--max-bytes", "4096", env=NO_TOKEN_ENV)
    old = torch.zeros(250, dtype=torch.int32)
    with ShardClient(max_bytes_per_request=1000, timeout=10) as client:
        client.put(worker.node, {("ow-a", "x"): old})
        new = {(t, "x"): torch.ones(250, dtype=torch.int32) for t in ["ow-a", "ow-b", "ow-c", "ow-d", "ow-e"]}
        with pytest.raises(CapacityError):
            client.put(worker.node, new)
        assert_same(old, client.fetch([(worker.node, "ow-a", "x")])[0])


class ConcurrencyProbe:
    """Counts requests a peer app is serving at once (and the most at once)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.peak = 0
        self.finished: list[tuple[str, float]] = []

    def hold(self, kind: str, seconds: float) -> None:
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        time.sleep(seconds)
        with self.lock:
            self.now -= 1
            self.finished.append((kind, time.monotonic()))


def test_connection_slots_per_node_and_for_waiting_requests(serve_app: Callable[[Flask], str]) -> None:
    probe = ConcurrencyProbe()
    app = Flask("peer")

    @app.get("/v1/stats")
    def peer_stats() -> Any:
        probe.hold("data", float(flask_request.args.get("hold", "0.3")))
        return jsonify({"shards": 0})

    @app.post("/wait")
    def peer_wait() -> Any:
        probe.hold("wait", 2.0)
        return jsonify({"waited": True})

    node = serve_app(app)
    with ShardClient(max_connections=3, max_connections_per_node=2, timeout=30) as client:
        with ThreadPoolExecutor(max_workers=8) as pool:
            for answer in pool.map(lambda _: client.stats(node), range(8)):
                assert answer == {"shards": 0}
            assert probe.peak == 2  # data requests: at most 2 at once to one node

            probe.peak = 0
            waiters = [
                pool.submit(client.request_json, node, "POST", "/wait", {}, waits=True) for _ in range(5)
            ]
            deadline = time.monotonic() + 10
            while probe.now < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            # Three waiters hold the node (more than its 2 data slots), yet data still goes through.
            assert client.stats(node) == {"shards": 0}
            assert [w.result(timeout=30) for w in waiters] == [{"waited": True}] * 5
        assert probe.peak == 3 + 1  # the waiting budget (max_connections) plus the stats call
        first_wait_done = min(t for kind, t in probe.finished if kind == "wait")
        last_data_done = max(t for kind, t in probe.finished if kind == "data")
        assert last_data_done < first_wait_done  # it did not queue behind the waiters


def test_waiting_for_a_connection_slot_counts_against_the_timeout(serve_app: Callable[[Flask], str]) -> None:
    probe = ConcurrencyProbe()
    app = Flask("peer")

    @app.get("/v1/stats")
    def peer_stats() -> Any:
        probe.hold("data", 3.0)
        return jsonify({"shards": 0})

    node = serve_app(app)
    with (
        ShardClient(max_connections_per_node=1, timeout=30) as patient,
        ShardClient(max_connections_per_node=1, timeout=30, retries=0) as hurried,
        ThreadPoolExecutor(max_workers=2) as pool,
    ):
        holding = pool.submit(patient.stats, node)
        while probe.now < 1:
            time.sleep(0.01)
        queued = pool.submit(patient.request_json, node, "GET", "/v1/stats", timeout=0.5)
        with pytest.raises(WorkerUnavailableError, match="timed out"):
            queued.result(timeout=10)  # its only slot is taken for 3 s: it gives up at 0.5 s
        assert not holding.done()
        assert hurried.stats(node) == {"shards": 0}  # another client has slots of its own
        assert holding.result(timeout=10) == {"shards": 0}
