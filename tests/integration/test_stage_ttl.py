"""Abandoned staged puts: a client killed mid-put must not hold capacity forever.

A stage untouched for `stage_ttl` seconds (on the store's clock) is released by the store's
sweeper thread, and before any put or stage would be refused for capacity. Unit tests drive a
fake clock; the server test runs a real worker with `--max-bytes` and `--stage-ttl 1`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import requests
import torch
from store_support import FakeClock, shard

from distbatch.ids import ShardKey
from distbatch.launch import WorkerProcess
from distbatch.wire import encode_bundle_bytes
from rpc_server.store import ShardStore, StoreCapacityError, UnknownStageError

HTTP = requests.Session()
HTTP.trust_env = False
OCTET = {"Content-Type": "application/octet-stream"}


def sweeper_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "stage-sweeper"]


# --------------------------------------------------------------------------- store (fake clock)


def test_stage_ttl_runs_on_the_store_clock() -> None:
    clock = FakeClock()
    store = ShardStore(stage_ttl=10, clock=clock)
    try:
        store.stage("s1", {ShardKey("a", "x"): shard(5)})
        clock.now += 9
        store.stage("s1", {ShardKey("a", "y"): shard(3)})  # touching a stage restarts its TTL
        clock.now += 9
        assert store.expire_stages() == (0, 0)
        assert store.stats().staged_bytes == 8
        clock.now += 2  # 11 s since it was last touched
        assert store.expire_stages() == (1, 8)
        assert store.stats().staged_bytes == 0
        with pytest.raises(UnknownStageError):
            store.commit("s1")
        assert len(store) == 0
    finally:
        store.close()


def test_put_that_would_not_fit_first_drops_expired_stages() -> None:
    clock = FakeClock()
    store = ShardStore(max_bytes=100, stage_ttl=10, clock=clock)
    try:
        store.stage("abandoned", {ShardKey("a", "x"): shard(80)})
        with pytest.raises(StoreCapacityError, match="80 reserved by staged puts"):
            store.put({ShardKey("b", "x"): shard(50)})  # the live stage holds the capacity
        clock.now += 11
        assert store.put({ShardKey("b", "x"): shard(50)})[:2] == (1, 50)  # no sweep ran: the put dropped it
        stats = store.stats()
        assert (stats.bytes, stats.staged_bytes) == (50, 0)
        # the same for a stage that would not fit
        store.stage("abandoned-2", {ShardKey("c", "x"): shard(40)})
        with pytest.raises(StoreCapacityError):
            store.stage("next", {ShardKey("d", "x"): shard(40)})
        clock.now += 11
        assert store.stage("next", {ShardKey("d", "x"): shard(40)}) == (1, 40)
        assert store.commit("next")[:2] == (1, 40)
        assert (store.stats().bytes, store.stats().staged_bytes) == (90, 0)
    finally:
        store.close()


def test_stage_ttl_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stage_ttl"):
        ShardStore(stage_ttl=0)


def test_sweeper_thread_runs_only_while_the_store_holds_stages() -> None:
    store = ShardStore(max_bytes=100, stage_ttl=0.2)  # real clock: the sweeper wakes every 0.05 s
    try:
        before = len(sweeper_threads())
        store.put({ShardKey("a", "x"): shard(10)})
        assert len(sweeper_threads()) == before  # plain puts start nothing
        store.stage("s1", {ShardKey("b", "x"): shard(60)})
        assert len(sweeper_threads()) == before + 1
        deadline = time.monotonic() + 10
        while (store.stats().staged_bytes or len(sweeper_threads()) > before) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert store.stats().staged_bytes == 0  # released with no further put or stage
        assert len(sweeper_threads()) == before  # and the thread is gone with the stages
        assert store.stats().bytes == 10  # stored shards are not touched
        store.stage("s2", {ShardKey("c", "x"): shard(1)})  # a new stage starts a new sweeper
        assert len(sweeper_threads()) == before + 1
    finally:
        store.close()
    assert len(sweeper_threads()) == before  # close() stops it


# --------------------------------------------------------------------------- a real worker


def put(worker: WorkerProcess, shards: dict[Any, Any], stage: str | None = None) -> requests.Response:
    url = f"http://{worker.node}/v1/shards" + (f"?stage={stage}" if stage else "")
    return HTTP.put(url, data=encode_bundle_bytes(shards), headers=OCTET, timeout=10)


def staged_bytes(worker: WorkerProcess) -> int:
    response = HTTP.get(f"http://{worker.node}/v1/stats", timeout=10)
    assert response.status_code == 200, response.text
    return response.json()["staged_bytes"]


def test_worker_releases_an_abandoned_stage_after_its_ttl(start_worker: Callable[..., WorkerProcess]) -> None:
    # Before the fix: --stage-ttl was ignored (600 s), a put never dropped expired stages and
    # nothing swept them, so every put that needed the reserved capacity got 507 forever.
    worker = start_worker("--max-bytes", "1000", "--stage-ttl", "1", env={"DISTBATCH_TOKEN": ""})
    part = {("abandoned", "x"): torch.zeros(150)}  # 600 bytes: part of a put whose client died
    staged_at = time.monotonic()  # the worker stamps the stage after this
    assert put(worker, part, stage="dead-client").status_code == 200
    assert staged_bytes(worker) == 600
    needs_room = {("next", "x"): torch.zeros(150)}  # fits only once the stage is gone
    refused = put(worker, needs_room)
    assert refused.status_code == 507, refused.text

    while (response := put(worker, needs_room)).status_code == 507 and time.monotonic() - staged_at < 10:
        time.sleep(0.1)
    assert response.status_code == 200, response.text
    assert 1.0 < time.monotonic() - staged_at < 10  # not before the TTL, and soon after it

    # Another abandoned stage goes away with no put at all: the sweeper releases it.
    assert put(worker, {("abandoned-2", "x"): torch.zeros(50)}, stage="dead-client-2").status_code == 200
    assert staged_bytes(worker) == 200
    deadline = time.monotonic() + 10
    while staged_bytes(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert staged_bytes(worker) == 0
    commit = HTTP.post(f"http://{worker.node}/v1/shards/commit", json={"stage": "dead-client-2"}, timeout=10)
    assert commit.status_code == 404 and commit.json()["error"] == "unknown_stage"
    assert worker.log_file is not None  # each drop is logged, for whoever wonders where bytes went
    assert "dropped 1 staged put(s), 200 bytes, not committed within 1s" in worker.log_file.read_text()


class SteppingClock(FakeClock):
    """Moves on by `step` seconds at every reading (time passing inside one store call)."""

    def __init__(self, step: float) -> None:
        super().__init__()
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_a_stage_extended_as_it_expires_is_accounted_whole() -> None:
    """Review finding: stage() read the clock twice, so its capacity check could expire the very
    stage being extended; the detached stage was then re-inserted with its old bytes uncounted,
    and the store admitted that much over capacity for good."""
    clock = SteppingClock(step=0.0)
    store = ShardStore(max_bytes=100, stage_ttl=10, clock=clock)
    try:
        store.stage("s", {ShardKey("a", "x"): shard(60)})  # touched at 1000.0
        clock.now += 9.5
        clock.step = 0.5  # stage() now reads 1010.0 (just alive), any later reading 1010.5+
        with pytest.raises(StoreCapacityError):  # 60 staged + 60 more > 100, the stage still alive
            store.stage("s", {ShardKey("a", "y"): shard(60)})
        clock.step = 0.0
        assert store.stats().staged_bytes == 60  # what is really staged: the first part only
        assert store.abort("s") == 1
        assert store.stats().staged_bytes == 0
    finally:
        store.close()
