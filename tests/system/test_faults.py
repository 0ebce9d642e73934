"""Faults: workers SIGKILLed or SIGSTOPped mid-gather, mid-put and mid-engine-call; retried puts.

Every worker here is a real process on loopback, started by a fixture that
SIGCONTs and stops it at teardown, whatever the test did to it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from thread_support import run_in_thread

from distbatch import DistributedBatchMemory, ShardClient, WorkerGroup, wire
from distbatch.errors import CallTimeoutError, ClearError, ShardNotFoundError, WorkerUnavailableError
from distbatch.launch import WorkerProcess, spawn_worker, spawn_workers

TESTS_DIR = str(Path(__file__).resolve().parents[1])
SLACK = 1.5  # seconds allowed past a client's timeout (scheduling on a loaded machine)

pytestmark = pytest.mark.timeout(120)


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


@pytest.fixture
def spawn() -> Iterator[Callable[..., list[WorkerProcess]]]:
    """Factory: start n workers at once; teardown SIGCONTs (SIGSTOP tests) and stops every one."""
    started: list[WorkerProcess] = []

    def start(n: int = 3) -> list[WorkerProcess]:
        workers = spawn_workers(n)
        started.extend(workers)
        return workers

    yield start
    for w in started:
        if w.alive():
            _resume(w.pid)
    for w in started:
        w.terminate()
    for w in started:
        w.stop()


@pytest.fixture
def echo_group() -> Iterator[WorkerGroup]:
    """Three workers hosting the test EchoEngine; the client times data requests out after 5 s."""
    client = ShardClient(timeout=5.0)
    group = WorkerGroup.local(
        3, engine="engines_for_tests:EchoEngine", env={"PYTHONPATH": TESTS_DIR}, client=client
    )
    try:
        yield group
    finally:
        for p in group.processes:
            if p.alive():
                _resume(p.pid)
        group.shutdown()
        client.close()


def _small_bundle(prefix: str, n: int = 4) -> dict[tuple[str, str], Any]:
    out: dict[tuple[str, str], Any] = {}
    for i in range(n):
        out[(f"{prefix}-{i}", "ids")] = torch.arange(i + 3, dtype=torch.int64) * (i + 1)
        out[(f"{prefix}-{i}", "lp")] = torch.randn(i + 2).to(torch.bfloat16)
        out[(f"{prefix}-{i}", "uid")] = {"prompt": prefix, "i": i}
    return out


def _assert_same(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor) and g.dtype == w.dtype and torch.equal(g, w)
        else:
            assert g == w


def _fetch_bundle(client: ShardClient, node: str, bundle: dict[tuple[str, str], Any]) -> list[Any]:
    return client.fetch([(node, t, f) for t, f in bundle])


# ---------------------------------------------------------------------- SIGKILL mid-gather


def test_worker_killed_mid_gather_fails_fast_naming_it_and_spares_the_others(spawn) -> None:
    a, b, c = spawn(3)
    timeout = 5.0
    # 2 MiB per request: the 64 MiB gather from `a` is 32 requests over at most 8 connections.
    with ShardClient(timeout=timeout, max_bytes_per_request=2 << 20) as client:
        big = {(f"big-{i}", "x"): torch.full((1 << 19,), float(i)) for i in range(32)}  # 32 x 2 MiB
        client.put(a.node, big)
        small = {w.node: _small_bundle(f"keep-{j}") for j, w in enumerate((b, c))}
        for node, bundle in small.items():
            client.put(node, bundle)
        before = {node: client.stats(node) for node in small}

        first_response = threading.Event()
        refs = [(a.node, t, f, 2 << 20) for t, f in big]
        thread, outcome = run_in_thread(lambda: client.fetch(refs, progress=lambda n: first_response.set()))
        assert first_response.wait(30), "the gather never got its first response"
        killed_at = time.monotonic()
        a.process.send_signal(signal.SIGKILL)  # while the other 31 responses are outstanding
        thread.join(timeout + SLACK + 5)
        assert not thread.is_alive(), "the gather hung on a dead worker"

        assert "value" not in outcome, "the gather finished before the kill: nothing was tested"
        error = outcome["error"]
        assert isinstance(error, WorkerUnavailableError), repr(error)
        assert error.node == a.node and a.node in str(error)
        assert outcome["at"] - killed_at <= timeout + SLACK

        # The other workers' data is untouched, byte for byte.
        for node, bundle in small.items():
            _assert_same(_fetch_bundle(client, node, bundle), list(bundle.values()))
            after = client.stats(node)
            assert (after["shards"], after["bytes"]) == (before[node]["shards"], before[node]["bytes"])
        # And the dead one keeps failing fast, never hanging.
        started = time.monotonic()
        with pytest.raises(WorkerUnavailableError) as again:
            client.fetch(refs[:1])
        assert again.value.node == a.node and time.monotonic() - started <= timeout + SLACK


# ---------------------------------------------------------------------- SIGKILL mid-put


def test_worker_killed_mid_staged_put_fails_and_a_restarted_worker_is_empty_and_usable(spawn) -> None:
    a, b = spawn(2)
    timeout = 5.0
    # 1 MiB per request, one connection: the 48 MiB put is 48 staged requests, one after another.
    put_client = ShardClient(timeout=timeout, max_bytes_per_request=1 << 20, max_connections_per_node=1)
    with put_client, ShardClient(timeout=timeout) as observer:
        keep = _small_bundle("other-worker")
        observer.put(b.node, keep)
        b_before = observer.stats(b.node)

        big = {(f"staged-{i}", "x"): torch.full((1 << 18,), float(i)) for i in range(48)}  # 48 x 1 MiB
        thread, outcome = run_in_thread(lambda: put_client.put(a.node, big))
        deadline = time.monotonic() + 30
        stats = observer.stats(a.node)
        while stats["staged_bytes"] == 0 and "at" not in outcome and time.monotonic() < deadline:
            stats = observer.stats(a.node)
        assert stats["staged_bytes"] > 0 and stats["bytes"] == 0, stats  # staged, not yet visible
        killed_at = time.monotonic()
        a.process.send_signal(signal.SIGKILL)
        thread.join(timeout + SLACK + 5)
        assert not thread.is_alive(), "the put hung on a dead worker"

        assert "value" not in outcome, "the put finished before the kill: nothing was tested"
        error = outcome["error"]
        assert isinstance(error, WorkerUnavailableError), repr(error)
        assert error.node == a.node
        assert outcome["at"] - killed_at <= timeout + SLACK

        # A restarted worker is a fresh process on a new port: it starts empty (nothing half-put
        # survives) and serves at once, with no warm-up.
        fresh = spawn(1)[0]
        assert fresh.node != a.node
        stats = observer.stats(fresh.node)
        assert (stats["shards"], stats["tasks"], stats["bytes"], stats["staged_bytes"]) == (0, 0, 0, 0)
        with pytest.raises(ShardNotFoundError):
            observer.fetch([(fresh.node, "staged-0", "x")])
        result = put_client.put(fresh.node, big)  # the same staged put, now on the fresh worker
        assert result.stored == len(big) and result.bytes == 48 << 20
        got = observer.fetch([(fresh.node, t, f, 1 << 20) for t, f in big])
        _assert_same(got, list(big.values()))

        # The surviving worker never saw any of it, and its own data is intact.
        with pytest.raises(ShardNotFoundError):
            observer.fetch([(b.node, "staged-0", "x")])
        _assert_same(_fetch_bundle(observer, b.node, keep), list(keep.values()))
        b_after = observer.stats(b.node)
        assert (b_after["shards"], b_after["bytes"], b_after["staged_bytes"]) == (
            b_before["shards"],
            b_before["bytes"],
            0,
        )


# ---------------------------------------------------------------------- SIGKILL mid-engine-call


def test_worker_killed_mid_engine_call_fails_promptly_and_the_others_keep_serving(echo_group) -> None:
    group = echo_group
    victim = group.processes[0]
    # A 30 s call on worker 0, and a short one on worker 1 that must complete despite the kill.
    doomed, doomed_outcome = run_in_thread(lambda: group.call_on(0, "slow", 30.0, label="doomed"))
    survivor, survivor_outcome = run_in_thread(lambda: group.call_on(1, "slow", 2.0, label="survivor"))
    time.sleep(1.0)  # both calls are running on their engine threads
    assert "at" not in doomed_outcome and "at" not in survivor_outcome
    killed_at = time.monotonic()
    victim.process.send_signal(signal.SIGKILL)
    doomed.join(10)
    assert not doomed.is_alive(), "the engine call hung on a dead worker"
    error = doomed_outcome["error"]
    assert isinstance(error, WorkerUnavailableError), repr(error)
    assert error.node == victim.node
    assert doomed_outcome["at"] - killed_at < 3.0  # the socket closed: no waiting for any timeout

    survivor.join(10)
    assert survivor_outcome.get("value", {}).get("label") == "survivor", survivor_outcome

    # Workers 1 and 2 keep serving engine calls and data; calls to worker 0 keep failing fast.
    assert group.call_on(1, "echo", "ping")["value"] == "ping"
    assert group.call_on(2, "echo", "ping")["value"] == "ping"
    bundle = _small_bundle("after-kill")
    group.client.put(group.nodes[2], bundle)
    _assert_same(_fetch_bundle(group.client, group.nodes[2], bundle), list(bundle.values()))
    started = time.monotonic()
    with pytest.raises(WorkerUnavailableError) as again:
        group.call_on(0, "echo", "ping")
    assert again.value.node == victim.node and time.monotonic() - started < 3.0

    # A stalled (SIGSTOPped) worker, unlike a dead one, keeps its socket open: an engine call
    # with a call_timeout fails within it. (With none, the liveness probe fails it: see
    # tests/system/test_call_reliability.py.)
    stalled = group.processes[2]
    os.kill(stalled.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(CallTimeoutError) as stall:  # stalled, not dead: its process still runs
            group.call_on(2, "echo", "ping", call_timeout=2.0)
        elapsed = time.monotonic() - started
        assert stall.value.node == stalled.node
        assert 1.5 <= elapsed <= 2.0 + SLACK
    finally:
        os.kill(stalled.pid, signal.SIGCONT)
    assert group.call_on(2, "echo", "back")["value"] == "back"


# ---------------------------------------------------------------------- idempotent puts


def test_puts_are_idempotent_per_key(start_worker) -> None:
    node = start_worker().node
    with ShardClient(timeout=20.0) as client:
        bundle = _small_bundle("idem", 6)
        first = client.put(node, bundle)
        once = client.stats(node)
        assert (once["shards"], once["tasks"], once["bytes"]) == (len(bundle), 6, first.bytes)

        again = client.put(node, bundle)  # what a client retry after a lost reply does
        assert (again.stored, again.bytes) == (first.stored, first.bytes)
        assert again.generation == first.generation + 1  # a put of its own, replacing the first's values
        twice = client.stats(node)
        assert (twice["shards"], twice["tasks"], twice["bytes"]) == (
            once["shards"],
            once["tasks"],
            once["bytes"],
        )
        _assert_same(_fetch_bundle(client, node, bundle), list(bundle.values()))

        # Re-putting one key with a value of another size replaces it: one copy, bytes follow.
        key = ("idem-0", "ids")
        client.put(node, {key: torch.zeros(100, dtype=torch.int64)})
        replaced = client.stats(node)
        assert replaced["shards"] == once["shards"]
        assert replaced["bytes"] == once["bytes"] - bundle[key].numel() * 8 + 800


def test_retried_staged_put_never_duplicates(start_worker) -> None:
    node = start_worker().node
    big = {(f"stg-{i}", "x"): torch.full((16 << 10,), float(i)) for i in range(16)}  # 16 x 64 KiB
    nbytes = 16 * (64 << 10)
    # A client whose requests hold 128 KiB: each put is 8 staged requests plus a commit.
    with ShardClient(timeout=20.0, max_bytes_per_request=128 << 10) as client:
        assert client.put(node, big).bytes == nbytes
        assert client.put(node, big).bytes == nbytes  # the whole staged put retried
        stats = client.stats(node)
        assert (stats["shards"], stats["bytes"], stats["staged_bytes"]) == (16, nbytes, 0)
        _assert_same(client.fetch([(node, t, f) for t, f in big]), list(big.values()))

        # The same at the request level: a stage request re-sent (its reply lost), then the
        # commit re-sent. Nothing is reserved twice, nothing is visible before the commit,
        # and the retried commit answers the same without storing again.
        items = {
            (f"wire-{i}", "x"): torch.arange(i * 1000, (i + 1) * 1000, dtype=torch.int32) for i in range(4)
        }
        parts = [dict(list(items.items())[:2]), dict(list(items.items())[2:])]
        bodies = [wire.join_parts(wire.encode_bundle(p)) for p in parts]
        base = f"http://{node}"
        with requests.Session() as http:
            http.trust_env = False  # loopback only, never through a proxy
            headers = {"Content-Type": wire.CONTENT_TYPE}
            for body in (bodies[0], bodies[0], bodies[1], bodies[1], bodies[0]):
                reply = http.put(
                    f"{base}/v1/shards?stage=retry1", data=bytes(body), headers=headers, timeout=10
                )
                assert reply.status_code == 200, reply.text
            staged = client.stats(node)
            assert staged["staged_bytes"] == 4 * 4000  # each key reserved once, however often sent
            assert (staged["shards"], staged["bytes"]) == (16, nbytes)  # not visible yet
            with pytest.raises(ShardNotFoundError):
                client.fetch([(node, "wire-0", "x")])

            commits = [
                http.post(f"{base}/v1/shards/commit", json={"stage": "retry1"}, timeout=10) for _ in range(2)
            ]
            assert [r.status_code for r in commits] == [200, 200]
            # A retried commit answers as the first did, its generation included: one put, stored once.
            assert commits[0].json() == commits[1].json()
            assert {k: commits[0].json()[k] for k in ("stored", "bytes")} == {"stored": 4, "bytes": 16000}
        done = client.stats(node)
        assert (done["shards"], done["bytes"], done["staged_bytes"]) == (20, nbytes + 16000, 0)
        _assert_same(client.fetch([(node, t, f) for t, f in items]), list(items.values()))


# ---------------------------------------------------------------------- a batch across workers


def test_batch_over_three_workers_with_one_killed(spawn) -> None:
    workers = spawn(3)
    nodes = [w.node for w in workers]
    timeout = 5.0
    with ShardClient(timeout=timeout) as client:
        local = DistributedBatchMemory.from_dict(
            {
                "x": torch.arange(24, dtype=torch.float32).reshape(12, 2),
                "uid": [f"u{i}" for i in range(12)],
            },
            task_ids=[f"span-{i}" for i in range(12)],
        )
        remote = DistributedBatchMemory.concat(
            [part.to_remote(node, client) for part, node in zip(local.chunk(3), nodes)]
        )
        assert sorted(remote.meta.nodes) == sorted(nodes)
        dead = workers[1]
        dead.kill()

        started = time.monotonic()
        with pytest.raises(WorkerUnavailableError) as gather:
            remote["x"]
        assert gather.value.node == dead.node
        # It says the worker died or cannot be reached, and which tasks the gather lost.
        said = str(gather.value)
        assert "it died, was stopped, or the network to it is down" in said, said
        assert "gather of 12 task(s) lost the 4 it holds (fields x): span-4, span-5, span-6, span-7" in said
        assert time.monotonic() - started <= timeout + SLACK
        # The tasks on the live workers are still there (a sub-batch moves no data).
        alive = remote[[0, 1, 2, 3, 8, 9, 10, 11]]
        assert torch.equal(alive["x"], local["x"][[0, 1, 2, 3, 8, 9, 10, 11]])

        # clear() with a dead worker raises naming it (it does not report success), but it has
        # cleared the live workers; a second clear() is idempotent there and raises again.
        with pytest.raises(ClearError) as cleared:
            remote.clear()
        assert list(cleared.value.failed) == [dead.node]
        assert isinstance(cleared.value.failed[dead.node], WorkerUnavailableError)
        for node in (nodes[0], nodes[2]):
            assert client.stats(node)["shards"] == 0
        with pytest.raises(ClearError):
            remote.clear()
        assert alive.clear() == 0  # only live nodes: succeeds, nothing left to delete


# ---------------------------------------------------------------------- SIGSTOP


def test_stalled_worker_times_out_then_recovers_intact(spawn) -> None:
    a, b = spawn(2)
    timeout = 2.0
    with ShardClient(timeout=timeout) as client:
        bundles = {a.node: _small_bundle("stall-a"), b.node: _small_bundle("stall-b")}
        for node, bundle in bundles.items():
            client.put(node, bundle)
        os.kill(a.pid, signal.SIGSTOP)
        try:
            for action in (
                lambda: _fetch_bundle(client, a.node, bundles[a.node]),
                lambda: client.put(a.node, _small_bundle("stall-new")),
                lambda: client.stats(a.node),
            ):
                started = time.monotonic()
                with pytest.raises(WorkerUnavailableError) as stall:
                    action()
                elapsed = time.monotonic() - started
                assert stall.value.node == a.node
                assert timeout * 0.75 <= elapsed <= timeout + SLACK, elapsed
            # A gather that needs both workers fails within the timeout too, naming the stalled one.
            refs = [(n, t, f) for n, bundle in bundles.items() for t, f in bundle]
            started = time.monotonic()
            with pytest.raises(WorkerUnavailableError) as both:
                client.fetch(refs)
            assert both.value.node == a.node and time.monotonic() - started <= timeout + SLACK
            # Meanwhile the other worker serves at full speed.
            started = time.monotonic()
            _assert_same(_fetch_bundle(client, b.node, bundles[b.node]), list(bundles[b.node].values()))
            assert time.monotonic() - started < 1.0
        finally:
            os.kill(a.pid, signal.SIGCONT)
        # Resumed, it serves again with its data intact.
        _assert_same(_fetch_bundle(client, a.node, bundles[a.node]), list(bundles[a.node].values()))


def test_a_stalled_gather_fails_by_its_stall_timeout_not_the_total_deadline(spawn) -> None:
    """A worker that stops sending (SIGSTOP: its socket stays open, no reset ever comes, as when
    a host's link goes down) fails a gather once no byte arrived for `stall_timeout`, with an
    error that says it stalled, long before the client's total `timeout`; not retried. Resumed,
    the same gather succeeds with the data intact."""
    (a,) = spawn(1)
    stall = 1.0
    with ShardClient(timeout=30.0, stall_timeout=stall) as client:
        bundle = _small_bundle("stalled-gather")
        client.put(a.node, bundle)
        os.kill(a.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(WorkerUnavailableError, match=r"stalled.*link is down") as caught:
                _fetch_bundle(client, a.node, bundle)
            elapsed = time.monotonic() - started
            assert caught.value.node == a.node and caught.value.reason.startswith("stalled")
            assert stall <= elapsed <= stall * 1.25 + SLACK, elapsed
        finally:
            os.kill(a.pid, signal.SIGCONT)
        _assert_same(_fetch_bundle(client, a.node, bundle), list(bundle.values()))


def test_a_put_the_worker_took_whole_but_never_answered_says_it_may_be_stored(spawn) -> None:
    """A SIGSTOPped worker's kernel still acknowledges a small put's bytes; no answer comes. The
    put fails by its stall timeout, and its error says the worker had all of it (it may have
    stored it), not that nothing went out. Resumed, the worker serves the put it got."""
    (a,) = spawn(1)
    stall = 1.0
    with ShardClient(timeout=30.0, stall_timeout=stall) as client:
        bundle = _small_bundle("delivered-put")
        os.kill(a.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(WorkerUnavailableError, match=r"acknowledged all \d+ bytes.*may have stored"):
                client.put(a.node, bundle)
            assert time.monotonic() - started <= stall * 1.25 + SLACK
        finally:
            os.kill(a.pid, signal.SIGCONT)
        # Resumed, the worker serves the put's connection and the fetch's in either order: wait
        # for the put to land (under load the fetch could otherwise be answered first).
        deadline = time.monotonic() + 30
        while client.stats(a.node)["shards"] < len(bundle) and time.monotonic() < deadline:
            time.sleep(0.02)
        _assert_same(_fetch_bundle(client, a.node, bundle), list(bundle.values()))


def test_spawned_worker_is_usable_at_once_after_a_kill(start_worker) -> None:
    """Killing a worker frees nothing another needs: a new one (new port) serves on its first request."""
    first = start_worker()
    first.kill()
    assert not first.alive()
    second = spawn_worker()
    try:
        with ShardClient(timeout=5.0) as client:
            bundle = _small_bundle("fresh")
            client.put(second.node, bundle)
            _assert_same(_fetch_bundle(client, second.node, bundle), list(bundle.values()))
    finally:
        second.stop()


def test_call_all_reports_a_dead_worker_before_the_others_finish(echo_group) -> None:
    """A worker killed during call_all surfaces at once, not after the healthy workers' long calls."""
    group = echo_group
    killer = threading.Timer(1.0, group.processes[0].kill)
    killer.start()
    started = time.monotonic()
    try:
        with pytest.raises(WorkerUnavailableError) as info:
            group.call_all("slow", 8.0)
    finally:
        killer.cancel()
    elapsed = time.monotonic() - started
    assert info.value.node == group.nodes[0]
    assert elapsed < 5.0, f"the dead worker was reported after {elapsed:.1f}s (others run 8s)"
