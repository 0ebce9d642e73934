"""Idle eviction (`--max-idle-seconds`): shards nobody put or fetched for S seconds are deleted.

For controllers that crash and never clear. The store unit tests use explicit
clocks; the server tests run real workers with S=1 and read their stderr.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from store_support import FakeClock, shard

from distbatch.ids import ShardKey
from distbatch.launch import WorkerProcess, read_first_line
from distbatch.wire import encode_bundle_bytes
from rpc_server.app import ServerConfig, create_app
from rpc_server.serve import WorkerServer
from rpc_server.store import IdleSweeper, MissingShardsError, ShardStore

ROOT = Path(__file__).resolve().parents[2]
HTTP = requests.Session()
HTTP.trust_env = False
OCTET = {"Content-Type": "application/octet-stream"}


# --------------------------------------------------------------------------- store (explicit clock)


def test_store_evicts_only_idle_tasks() -> None:
    clock = FakeClock()
    store = ShardStore(max_idle_seconds=10, clock=clock)
    store.put({ShardKey("a", "x"): shard(3), ShardKey("a", "y"): shard(4), ShardKey("b", "x"): shard(5)})
    clock.now += 5
    assert store.evict_idle() == (0, 0)
    store.get([ShardKey("b", "x")])  # a fetch keeps task b alive
    clock.now += 5.5
    assert store.evict_idle() == (2, 7)  # both fields of a
    stats = store.stats()
    assert (stats.shards, stats.tasks, stats.bytes) == (1, 1, 5)
    assert (stats.evicted_shards, stats.evicted_bytes) == (2, 7)
    clock.now += 5
    assert store.evict_idle() == (1, 5)
    assert len(store) == 0 and store.stats().bytes == 0
    assert store.stats().evicted_shards == 3


def test_store_put_refreshes_and_delete_forgets() -> None:
    clock = FakeClock()
    store = ShardStore(max_idle_seconds=10, clock=clock)
    store.put({ShardKey("a", "x"): shard(1), ShardKey("r", "x"): shard(1)})
    store.put({ShardKey("b", "x"): shard(1)})
    store.delete_tasks(["b"])  # deleted by the controller: nothing left to evict, nothing double-counted
    store.put({ShardKey("c", "x"): shard(1)})
    store.delete_keys([ShardKey("c", "x")])
    clock.now += 8
    store.put({ShardKey("r", "y"): shard(2)})  # a put to another field refreshes the whole task
    clock.now += 3
    assert store.evict_idle() == (1, 1)  # only a
    assert len(store) == 2
    clock.now += 10
    assert store.evict_idle() == (2, 3)
    assert store.stats().evicted_shards == 3 and len(store) == 0


def test_store_failed_fetch_does_not_refresh() -> None:
    clock = FakeClock()
    store = ShardStore(max_idle_seconds=10, clock=clock)
    store.put({ShardKey("a", "x"): shard(1)})
    clock.now += 9
    with pytest.raises(MissingShardsError):
        store.get([ShardKey("a", "x"), ShardKey("nope", "x")])
    clock.now += 1.5
    assert store.evict_idle() == (1, 1)


def test_store_does_not_evict_staged_puts() -> None:
    clock = FakeClock()
    store = ShardStore(max_idle_seconds=1, clock=clock)
    store.stage("s1", {ShardKey("a", "x"): shard(2)})
    clock.now += 100
    assert store.evict_idle() == (0, 0)
    assert store.stats().staged_bytes == 2
    assert store.commit("s1")[:2] == (1, 2)  # committing is a put: the task is fresh now
    clock.now += 0.5
    assert store.evict_idle() == (0, 0)
    clock.now += 1
    assert store.evict_idle() == (1, 2)


def test_store_without_limit_tracks_and_evicts_nothing() -> None:
    clock = FakeClock()
    store = ShardStore(clock=clock)
    store.put({ShardKey("a", "x"): shard(1)})
    clock.now += 1e9
    assert store.evict_idle() == (0, 0)
    with pytest.raises(ValueError, match="max_idle_seconds"):
        ShardStore(max_idle_seconds=0)


def test_sweeper_thread_is_owned_and_stopped_with_the_server() -> None:
    app = create_app(ServerConfig(max_idle_seconds=0.2, token=None))
    sweeper = app.extensions["distbatch"].sweeper
    assert isinstance(sweeper, IdleSweeper) and sweeper._thread.is_alive()
    server = WorkerServer(app).start_background()
    node = server.node
    assert HTTP.put(f"http://{node}/v1/shards", data=encode_bundle_bytes({("t", "x"): 1}), headers=OCTET).ok
    deadline = time.monotonic() + 5
    while app.extensions["distbatch"].store.stats().shards and time.monotonic() < deadline:
        time.sleep(0.05)
    assert app.extensions["distbatch"].store.stats().evicted_shards == 1
    server.shutdown()
    assert not sweeper._thread.is_alive()
    # no sweeper (and no thread) when the limit is off
    assert create_app(ServerConfig(token=None)).extensions["distbatch"].sweeper is None


# --------------------------------------------------------------------------- real workers


class LoggedWorker(WorkerProcess):
    """A worker whose stderr goes to a file the test can read."""

    def __init__(self, process: subprocess.Popen[bytes], node: str, stderr: Path) -> None:
        super().__init__(process, node)
        self.stderr_path = stderr

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def url(self, path: str) -> str:
        return f"http://{self.node}{path}"


@pytest.fixture
def logged_worker(tmp_path: Path) -> Iterator[Callable[..., LoggedWorker]]:
    started: list[LoggedWorker] = []

    def start(*args: str) -> LoggedWorker:
        stderr_path = tmp_path / f"worker-{len(started)}.stderr"
        with stderr_path.open("wb") as stderr:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "rpc_server",
                    "--port",
                    "0",
                    "--exit-with-parent",
                    str(os.getpid()),
                    *args,
                ],
                stdout=subprocess.PIPE,
                stderr=stderr,
                stdin=subprocess.DEVNULL,
                cwd=ROOT,
                env={**os.environ, "DISTBATCH_TOKEN": ""},
            )
        node = read_first_line(process, 60.0) or ""
        worker = LoggedWorker(process, node, stderr_path)
        started.append(worker)
        assert node, f"worker did not start: {worker.stderr()}"
        return worker

    yield start
    for worker in started:
        worker.stop()


def put(worker: LoggedWorker, shards: dict[Any, Any]) -> None:
    response = HTTP.put(worker.url("/v1/shards"), data=encode_bundle_bytes(shards), headers=OCTET, timeout=10)
    assert response.status_code == 200, response.text


def present(worker: LoggedWorker, key: tuple[str, str]) -> bool:
    response = HTTP.post(worker.url("/v1/shards/fetch"), json={"keys": [list(key)]}, timeout=10)
    assert response.status_code in (200, 404), response.text
    return response.status_code == 200


def stats(worker: LoggedWorker) -> dict[str, Any]:
    return HTTP.get(worker.url("/v1/stats"), timeout=10).json()


def metric(worker: LoggedWorker, name: str) -> float:
    for line in HTTP.get(worker.url("/metrics"), timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_idle_shards_are_evicted_fetched_ones_stay(logged_worker: Callable[..., LoggedWorker]) -> None:
    worker = logged_worker("--max-idle-seconds", "1")
    idle, busy = ("idle-1", "x"), ("busy-1", "x")
    put(
        worker,
        {idle: torch.zeros(25, dtype=torch.float32), ("idle-1", "meta"): {"k": 1}, busy: torch.ones(3)},
    )
    # a staged put is not idle-evicted (it has its own TTL)
    staged = HTTP.put(
        worker.url("/v1/shards?stage=st-1"),
        data=encode_bundle_bytes({("staged-1", "x"): torch.ones(2)}),
        headers=OCTET,
        timeout=10,
    )
    assert staged.status_code == 200, staged.text
    started = time.monotonic()
    gone_after = None
    while time.monotonic() - started < 4.0:
        # fetching `busy` (never `idle`: a fetch is an access) every 0.2 s keeps it alive
        assert present(worker, busy), f"busy shard evicted after {time.monotonic() - started:.2f}s"
        if gone_after is None and stats(worker)["tasks"] == 1:
            gone_after = time.monotonic() - started
        if gone_after is not None and time.monotonic() - started > 2.5:
            break
        time.sleep(0.2)
    assert gone_after is not None, "idle shard still stored after 4 s"
    assert 0.9 <= gone_after <= 3.0, gone_after
    assert not present(worker, idle)
    body = stats(worker)
    assert body["shards"] == 1 and body["evicted_shards"] == 2
    assert body["evicted_bytes"] == 100 + len(b'{"k":1}')
    assert metric(worker, "distbatch_evicted_shards_total") == 2
    assert metric(worker, "distbatch_evicted_bytes_total") == body["evicted_bytes"]
    commit = HTTP.post(worker.url("/v1/shards/commit"), json={"stage": "st-1"}, timeout=10)
    assert commit.status_code == 200 and commit.json()["stored"] == 1, commit.text
    assert present(worker, ("staged-1", "x"))
    log = worker.stderr()
    assert "WARNING" in log and "evicted 2 shard(s), 107 bytes" in log, log
    assert "crashed controllers that never clear" in log
    assert "Traceback" not in log


def test_without_the_flag_nothing_is_evicted(logged_worker: Callable[..., LoggedWorker]) -> None:
    worker = logged_worker()
    put(worker, {("keep-1", "x"): torch.arange(4)})
    time.sleep(2.5)
    assert present(worker, ("keep-1", "x"))
    assert stats(worker)["evicted_shards"] == 0
    assert metric(worker, "distbatch_evicted_shards_total") == 0
    assert "evicted" not in worker.stderr()


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_bad_flag_value_is_refused(value: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rpc_server", "--port", "0", "--max-idle-seconds", value],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 2, result
    assert "--max-idle-seconds must be > 0" in result.stderr
