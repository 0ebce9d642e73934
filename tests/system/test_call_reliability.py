"""Engine calls that stall, time out, fail part-way or are interrupted: bounded, and nothing left behind.

- a stalled (SIGSTOPped) worker fails a call by the liveness probe; a long call on a live worker does not;
- `call_timeout=` is the deadline, every other keyword (`timeout` too) goes to the engine;
- a failed group call hands back the completed calls' results (`partial_results`);
- an abandoned call (deadline, failed sibling, interrupted caller) stores nothing on its worker;
- `batch.clear()` with a worker down reports per node, and a retry finishes the job;
- a sync call's result is never lost at the wait boundary;
- a worker whose own call finished cannot fail its siblings' calls; a late abandon spares a later
  call's shards under the same keys; an abandoned queued call's request is answered at once;
  shutdown answers waiting calls 503; partial results are decoded whatever the error.

Every worker is a real `python -m rpc_server` process on loopback, stopped by its fixture (SIGCONTed
first if a test stopped it).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import requests
import torch
from thread_support import run_in_thread

from distbatch import DistributedBatchMemory, ShardClient, WorkerGroup
from distbatch.batch.calls import decode_value, encode_call
from distbatch.client.loop import LoopThread
from distbatch.errors import (
    CallTimeoutError,
    ClearError,
    EngineError,
    ShardNotFoundError,
    WorkerUnavailableError,
)
from distbatch.errors import ClearError as ControllerClearError
from distbatch.launch import WorkerProcess, spawn_worker, spawn_workers
from distbatch.protocol import CALL_ID_HEADER

pytestmark = pytest.mark.timeout(120)

TESTS_DIR = str(Path(__file__).resolve().parents[1])
ENV = {"PYTHONPATH": TESTS_DIR}
ENGINE = "engines_for_tests:ReliabilityEngine"
SLACK = 2.0  # seconds allowed for scheduling on a loaded machine


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def _start_group(n: int, **kwargs: Any) -> tuple[WorkerGroup, ShardClient]:
    client = ShardClient(timeout=10.0)
    try:
        group = WorkerGroup.local(n, ENGINE, env=ENV, client=client, **kwargs)
    except BaseException:
        client.close()
        raise
    return group, client


def _stop_group(group: WorkerGroup, client: ShardClient) -> None:
    for process in group.processes:
        if process.alive():
            _resume(process.pid)
    group.shutdown()
    client.close()


@pytest.fixture(scope="module")
def shared() -> Iterator[WorkerGroup]:
    """Three workers nobody stops or kills; each test uses its own task ids and cleans up."""
    group, client = _start_group(3, liveness_timeout=2.0)
    try:
        yield group
    finally:
        _stop_group(group, client)


@pytest.fixture
def own_group() -> Iterator[Callable[..., WorkerGroup]]:
    """Factory for groups a test may SIGSTOP or kill; teardown SIGCONTs and stops them."""
    started: list[tuple[WorkerGroup, ShardClient]] = []

    def start(n: int, **kwargs: Any) -> WorkerGroup:
        started.append(_start_group(n, **kwargs))
        return started[-1][0]

    yield start
    for group, client in started:
        _stop_group(group, client)


def _inputs(group: WorkerGroup, prefix: str, workers: int | None = None) -> list[DistributedBatchMemory]:
    """One single-task REMOTE batch per worker (the first `workers` of them), stored on that worker."""
    tag = f"{prefix}-{uuid.uuid4().hex[:8]}"
    return [
        DistributedBatchMemory.from_dict({"x": torch.ones(1, 2)}, task_ids=[f"{tag}-{i}"]).to_remote(
            node, group.client
        )
        for i, node in enumerate(group.nodes[:workers])
    ]


def _shards(group: WorkerGroup) -> list[int]:
    return [s["shards"] for s in group.stats()]


# ---------------------------------------------------------------------- stalled workers


def test_stalled_worker_fails_the_call_within_the_liveness_timeout(own_group) -> None:
    group = own_group(1, liveness_timeout=2.0)
    victim = group.processes[0]
    thread, outcome = run_in_thread(lambda: group.call_on(0, "sleep", 8.0))
    time.sleep(0.5)  # the call is running on the engine thread
    stopped_at = time.monotonic()
    os.kill(victim.pid, signal.SIGSTOP)
    try:
        thread.join(2.0 + 4 * SLACK)
        assert not thread.is_alive(), "the call hung on a stalled worker"
    finally:
        _resume(victim.pid)
    error = outcome.get("error")
    assert isinstance(error, WorkerUnavailableError), outcome
    assert error.node == victim.node and "stopped answering" in str(error)
    assert 1.5 <= outcome["at"] - stopped_at <= 2.0 + 1.0 + SLACK  # + probe interval, abandon wait
    assert group.client.health(victim.node)["status"] == "ok"  # resumed: usable again


def test_long_call_on_a_live_worker_is_not_cut_short(shared: WorkerGroup) -> None:
    started = time.monotonic()
    assert shared.call_on(0, "sleep", 6.0) == 6.0  # three times the liveness timeout
    assert time.monotonic() - started >= 6.0


def test_probes_need_no_connection_slot(shared: WorkerGroup) -> None:
    """With one waiting slot, a call queued for it (and its probes) outlasts the liveness timeout."""
    with ShardClient(max_connections=1, max_connections_per_node=1) as narrow:
        group = WorkerGroup.connect(shared.nodes, client=narrow, liveness_timeout=1.0)
        holder, held = run_in_thread(lambda: group.call_on(0, "sleep", 3.0))
        time.sleep(0.3)
        assert group.call_on(1, "sleep", 0.1) == 0.1  # waited ~3 s for the slot, not failed
        assert narrow.stats(shared.nodes[1])["node"] == shared.nodes[1]
        holder.join(10)
        assert held.get("value") == 3.0, held


def test_engine_keyword_named_timeout_reaches_the_engine(shared: WorkerGroup) -> None:
    assert shared.call_on(0, "takes_timeout", timeout=7.5, value="v") == {"timeout": 7.5, "value": "v"}
    assert shared.call_all("takes_timeout", timeout=3) == [{"timeout": 3, "value": ""}] * 3
    # `call_timeout` is the deadline; it is not passed on
    with pytest.raises(CallTimeoutError, match=r"'sleep' gave no answer within its deadline of 0.2 s"):
        shared.call_on(1, "sleep", 1.0, call_timeout=0.2)
    assert shared.call_on(1, "takes_timeout", 0.5, call_timeout=5.0) == {"timeout": 0.5, "value": ""}


def test_liveness_timeout_is_checked() -> None:
    for bad in (0, -1.0, "30", True):
        with pytest.raises(ValueError, match="liveness_timeout"):
            WorkerGroup(["127.0.0.1:1"], liveness_timeout=bad)
    assert WorkerGroup(["127.0.0.1:1"], liveness_timeout=None).liveness_timeout is None
    assert WorkerGroup(["127.0.0.1:1"]).liveness_timeout == 30.0


# ---------------------------------------------------------------------- partial failures


def test_partial_results_let_the_caller_clear_everything(shared: WorkerGroup) -> None:
    before = _shards(shared)
    chunks = _inputs(shared, "partial")
    ids = [c.task_ids[0] for c in chunks]
    # workers 0 and 1 complete at once; worker 2 fails a second later
    with pytest.raises(EngineError) as info:
        shared.call("mark", chunks, delays={ids[2]: 1.0}, fail_for=[ids[2]])
    partial = info.value.partial_results
    assert partial is not None and len(partial) == 3 and partial[2] is None
    assert [p["mark"] for p in partial[:2]] == [[f"m-{ids[0]}"], [f"m-{ids[1]}"]]
    assert _shards(shared) == [b + 2 for b in before[:2]] + [before[2] + 1]  # inputs and marks
    for batch in [*partial[:2], *chunks]:
        batch.clear()
    assert _shards(shared) == before


def test_call_abandoned_by_its_deadline_stores_nothing(shared: WorkerGroup) -> None:
    before = _shards(shared)
    (chunk,) = _inputs(shared, "deadline", 1)
    task = chunk.task_ids[0]
    started = time.monotonic()
    with pytest.raises(CallTimeoutError, match="call_timeout") as info:
        shared.call_on(0, "mark", chunk, delays={task: 1.5}, call_timeout=0.3)
    assert info.value.method == "mark" and info.value.timeout == 0.3
    assert time.monotonic() - started < 0.3 + SLACK
    assert info.value.partial_results == [None]
    # Engine calls run one at a time: this one answers once `mark` has finished.
    assert shared.call_on(0, "ran", task) == 1
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:  # nothing shows up later either
        assert shared.client.stats(shared.nodes[0])["shards"] == before[0] + 1  # the input only
        time.sleep(0.2)
    with pytest.raises(ShardNotFoundError):
        shared.client.fetch([(shared.nodes[0], task, "mark")])
    chunk.clear()
    assert _shards(shared) == before
    log = shared.processes[0].log_file
    assert log is not None and "the client abandoned 1 engine call(s)" in log.read_text()  # for operators


def test_queued_call_abandoned_by_its_deadline_never_runs(shared: WorkerGroup) -> None:
    (chunk,) = _inputs(shared, "queued", 1)
    task = chunk.task_ids[0]
    busy, busy_outcome = run_in_thread(lambda: shared.call_on(0, "sleep", 1.5))
    time.sleep(0.3)  # the engine thread is busy: the next call waits in its queue
    with pytest.raises(CallTimeoutError, match="call_timeout"):
        shared.call_on(0, "mark", chunk, call_timeout=0.3)
    busy.join(10)
    assert busy_outcome.get("value") == 1.5, busy_outcome
    assert shared.call_on(0, "ran", task) == 0
    with pytest.raises(ShardNotFoundError):
        shared.client.fetch([(shared.nodes[0], task, "mark")])
    chunk.clear()


def test_sibling_worker_dying_leaves_nothing_from_the_abandoned_calls(own_group) -> None:
    group = own_group(3, liveness_timeout=None)
    chunks = _inputs(group, "sibling")
    ids = [c.task_ids[0] for c in chunks]
    killer = threading.Timer(0.7, group.processes[2].process.kill)
    killer.start()
    started = time.monotonic()
    try:
        with pytest.raises(WorkerUnavailableError) as info:
            group.call("mark", chunks, delays={ids[0]: 2.5, ids[1]: 2.5, ids[2]: 30.0})
    finally:
        killer.cancel()
        killer.join()
    assert info.value.node == group.nodes[2]
    assert time.monotonic() - started < 0.7 + SLACK  # reported at once, not after the siblings
    assert info.value.partial_results == [None, None, None]
    for i in (0, 1):  # once their `mark` finished, only the inputs are on the live workers
        assert group.call_on(i, "ran", ids[i]) == 1
        assert group.client.stats(group.nodes[i])["shards"] == 1
        with pytest.raises(ShardNotFoundError):
            group.client.fetch([(group.nodes[i], ids[i], "mark")])


def test_abandon_after_a_lost_reply_deletes_what_the_call_stored(shared: WorkerGroup) -> None:
    """The reply never reached the client: its abandon notice deletes the stored result."""
    before = _shards(shared)
    (chunk,) = _inputs(shared, "lost", 1)
    node = shared.nodes[0]
    call_id = uuid.uuid4().hex
    url = f"http://{node}"
    headers = {"Content-Type": "application/json", CALL_ID_HEADER: call_id}
    reply = requests.post(f"{url}/v1/call/mark", data=encode_call([chunk], {}), headers=headers, timeout=30)
    assert reply.status_code == 200, reply.text
    assert shared.client.stats(node)["shards"] == before[0] + 2
    notice = requests.post(f"{url}/v1/calls/abandon", json={"call_ids": [call_id]}, timeout=30)
    assert notice.status_code == 200 and notice.json()["deleted"] == 1, notice.text
    assert shared.client.stats(node)["shards"] == before[0] + 1
    again = requests.post(f"{url}/v1/call/mark", data=encode_call([chunk], {}), headers=headers, timeout=30)
    assert again.status_code == 409 and again.json()["error"] == "call_abandoned"
    bad = requests.post(f"{url}/v1/calls/abandon", json={"call_ids": ["../x"]}, timeout=30)
    assert bad.status_code == 400
    chunk.clear()
    assert _shards(shared) == before


def test_abandon_is_token_guarded(start_worker) -> None:
    node = start_worker("--engine", ENGINE, env={"DISTBATCH_TOKEN": "s3cret", **ENV}).node
    reply = requests.post(f"http://{node}/v1/calls/abandon", json={"call_ids": ["a"]}, timeout=30)
    assert reply.status_code == 401
    with ShardClient(token="s3cret") as client:
        assert client.request_json(node, "POST", "/v1/calls/abandon", {"call_ids": ["a"]})["calls"] == 0


# ---------------------------------------------------------------------- clear with a worker down


@pytest.fixture
def data_workers() -> Iterator[list[WorkerProcess]]:
    workers = spawn_workers(3)
    try:
        yield workers
    finally:
        for w in workers:
            if w.alive():
                _resume(w.pid)
        for w in workers:
            w.stop()


def _spread(client: ShardClient, nodes: list[str], prefix: str) -> DistributedBatchMemory:
    local = DistributedBatchMemory.from_dict(
        {"x": torch.arange(12.0).reshape(6, 2), "uid": [f"u{i}" for i in range(6)]},
        task_ids=[f"{prefix}-{i}" for i in range(6)],
    )
    return DistributedBatchMemory.concat(
        [part.to_remote(node, client) for part, node in zip(local.chunk(3), nodes)]
    )


def test_clear_with_a_stalled_worker_reports_per_node_and_a_retry_finishes(data_workers) -> None:
    nodes = [w.node for w in data_workers]
    # The put before the stall with the default timeout (a busy machine may take over 1.5 s to
    # answer it); the clear, which meets the stalled worker, with a short one.
    with ShardClient() as patient, ShardClient(timeout=1.5, retries=0) as client:
        batch = DistributedBatchMemory.from_meta(_spread(patient, nodes, "stalled").meta, client)
        stalled = data_workers[1]
        os.kill(stalled.pid, signal.SIGSTOP)
        try:
            with pytest.raises(ClearError) as info:
                batch.clear()
        finally:
            _resume(stalled.pid)
        error = info.value
        assert isinstance(error, ControllerClearError)  # one error type, importable from both
        assert set(error.failed) == {stalled.node}
        assert error.undeleted == {stalled.node: 4}  # 2 tasks x 2 fields may remain
        assert error.deleted_by_node == {nodes[0]: 4, nodes[2]: 4} and error.deleted == 8
        assert stalled.node in str(error) and "may remain" in str(error)
        for node in (nodes[0], nodes[2]):
            assert client.stats(node)["shards"] == 0
        batch.clear()  # the worker is back: finishes the job (or finds it done)
        assert [client.stats(node)["shards"] for node in nodes] == [0, 0, 0]


def test_clear_with_a_killed_worker_reports_per_node_and_a_restarted_node_clears(data_workers) -> None:
    nodes = [w.node for w in data_workers]
    with ShardClient(timeout=5.0) as client:
        batch = _spread(client, nodes, "killed")
        dead = data_workers[1]
        dead.kill()
        with pytest.raises(ClearError) as info:
            batch.clear()
        assert set(info.value.failed) == {dead.node}
        assert isinstance(info.value.failed[dead.node], WorkerUnavailableError)
        assert info.value.deleted_by_node == {nodes[0]: 4, nodes[2]: 4}
        with pytest.raises(ClearError) as again:  # still down: says so again, deletes nothing new
            batch.clear()
        assert again.value.deleted == 0 and set(again.value.failed) == {dead.node}
        port = dead.node.rsplit(":", 1)[1]
        back = spawn_worker(args=("--port", port))
        try:
            assert back.node == dead.node
            assert batch.clear() == 0  # nothing left anywhere: the clear is complete
        finally:
            back.stop()


# ---------------------------------------------------------------------- sync waits


def test_result_completing_at_the_wait_boundary_is_not_lost(shared: WorkerGroup) -> None:
    """The waiting thread is held up right after its wait timed out (as a busy machine may do):
    the call completes meanwhile, and its own result must come back, not the wait's timeout."""
    submit_code = LoopThread.submit.__code__

    def local_trace(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "exception" and issubclass(arg[0], TimeoutError):
            time.sleep(1.0)  # the call (1.3 s) completes while this thread is held up
        return local_trace

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        return local_trace if frame.f_code is submit_code else None

    sys.settrace(trace)
    try:
        value = shared.call_on(2, "sleep", 1.3)  # longer than one wait interval (1 s)
    finally:
        sys.settrace(None)
    assert value == 1.3


def test_interrupted_sync_call_is_cancelled_and_abandoned(shared: WorkerGroup) -> None:
    before = _shards(shared)
    (chunk,) = _inputs(shared, "interrupt", 1)
    task = chunk.task_ids[0]
    with ShardClient(max_connections=1) as narrow:
        group = WorkerGroup.connect(shared.nodes, client=narrow)
        main = threading.main_thread().ident
        assert main is not None and threading.current_thread().ident == main
        interrupter = threading.Timer(0.5, signal.pthread_kill, (main, signal.SIGINT))
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        interrupter.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                group.call_on(0, "mark", chunk, delays={task: 2.5})
        finally:
            interrupter.cancel()
            interrupter.join()
            signal.signal(signal.SIGINT, previous)
        # The interrupted call no longer holds the only slot for engine calls: the next one
        # (on another worker) starts at once instead of after the 2.5 s `mark`.
        started = time.monotonic()
        assert group.call_on(1, "sleep", 0.0) == 0.0
        assert time.monotonic() - started < 1.0
        # The worker was told: `mark` ran, but its result was dropped.
        assert group.call_on(0, "ran", task) == 1
        with pytest.raises(ShardNotFoundError):
            narrow.fetch([(shared.nodes[0], task, "mark")])
    chunk.clear()
    assert _shards(shared) == before


# ---------------------------------------------------------------------- finished nodes, late abandons, queues


def _kill_once_it_answered_a_call(group: WorkerGroup, index: int, killed: list[float]) -> None:
    """Kill worker `index` as soon as its metrics count an answered engine call (not after a fixed
    delay, which a loaded machine can outlast)."""
    answered = 'endpoint="/v1/call/<method>",method="POST",status="200"'
    deadline = time.monotonic() + 120
    while answered not in requests.get(f"http://{group.nodes[index]}/metrics", timeout=10).text:
        assert time.monotonic() < deadline, "worker 0 never answered its call"
        time.sleep(0.02)
    # The worker counts the answer once it is written; the client reads it a moment later (longer
    # on a loaded machine): a kill in between would lose the answer itself. The other call runs 6 s.
    time.sleep(1.5)
    group.processes[index].process.kill()
    killed.append(time.monotonic())


def test_node_whose_call_finished_cannot_fail_the_group_call(own_group) -> None:
    """Worker 0 answers, then dies while worker 1's call still runs: the group call succeeds
    (worker 0's liveness probe no longer matters once its call is done)."""
    group = own_group(2, liveness_timeout=1.0)
    killed: list[float] = []
    killer = threading.Thread(target=_kill_once_it_answered_a_call, args=(group, 0, killed))
    killer.start()
    try:
        assert group.call("sleep", [0.1, 6.0]) == [0.1, 6.0]
        returned = time.monotonic()
    finally:
        killer.join()
    assert killed and killed[0] < returned  # worker 0 died while worker 1's call was running


def test_late_abandon_spares_what_a_later_call_stored_under_the_same_keys(shared: WorkerGroup) -> None:
    """Call X's abandon notice lands after call Y re-stored the same (task_id, field) keys
    (a retry right after a failed group call): Y's shards stay, only X's own would go."""
    before = _shards(shared)
    (chunk,) = _inputs(shared, "reused", 1)
    task = chunk.task_ids[0]
    url = f"http://{shared.nodes[0]}"

    def post_call(call_id: str) -> requests.Response:
        headers = {"Content-Type": "application/json", CALL_ID_HEADER: call_id}
        body = encode_call([chunk], {})
        return requests.post(f"{url}/v1/call/mark", data=body, headers=headers, timeout=30)

    def abandon(call_id: str) -> dict[str, int]:
        notice = requests.post(f"{url}/v1/calls/abandon", json={"call_ids": [call_id]}, timeout=30)
        assert notice.status_code == 200, notice.text
        return notice.json()

    first, second = uuid.uuid4().hex, uuid.uuid4().hex
    assert post_call(first).status_code == 200
    reply = post_call(second)
    assert reply.status_code == 200, reply.text
    result = decode_value(reply.json()["result"], shared.client)
    assert abandon(first)["deleted"] == 0  # the keys now hold the second call's shards
    assert result["mark"] == [f"m-{task}"]
    assert abandon(second)["deleted"] == 1  # the second call's own shards do go
    with pytest.raises(ShardNotFoundError):
        shared.client.fetch([(shared.nodes[0], task, "mark")])
    chunk.clear()
    assert _shards(shared) == before


def test_finished_calls_are_forgotten_after_their_ttl() -> None:
    """A finished call's record (kept for a late abandon) goes after `finished_ttl`, with no
    further call needed; an abandon after that deletes nothing."""
    from engines_for_tests import EchoEngine

    from rpc_server.app import ServerConfig
    from rpc_server.engine import EngineHost, WorkerContext
    from rpc_server.store import ShardStore

    store = ShardStore()
    context = WorkerContext(store, ServerConfig(node="127.0.0.1:9", token=None))
    host = EngineHost(EchoEngine(context), context, finished_ttl=0.3)
    try:
        reply = host.call("make_batch", json.loads(encode_call([2, "ttl"], {})), call_id="kept")
        assert "batch" in reply and len(store) == 4
        deadline = time.monotonic() + 5.0
        while host._finished and time.monotonic() < deadline:  # the sweeper, not a later call
            time.sleep(0.05)
        assert not host._finished
        assert host.abandon(["kept"]) == {"calls": 0, "deleted": 0, "bytes_freed": 0}
        assert len(store) == 4
    finally:
        host.shutdown()


def test_abandoning_a_queued_call_answers_its_request_at_once(shared: WorkerGroup) -> None:
    """A queued call's request thread is freed by the abandon notice (409), not by the engine
    reaching the call after the running one."""
    (chunk,) = _inputs(shared, "freed", 1)
    task = chunk.task_ids[0]
    url = f"http://{shared.nodes[0]}"
    call_id = uuid.uuid4().hex
    headers = {"Content-Type": "application/json", CALL_ID_HEADER: call_id}
    busy, busy_outcome = run_in_thread(lambda: shared.call_on(0, "sleep", 3.0))
    time.sleep(0.3)  # the engine thread is busy
    body = encode_call([chunk], {})
    queued, queued_outcome = run_in_thread(
        lambda: requests.post(f"{url}/v1/call/mark", data=body, headers=headers, timeout=30)
    )
    time.sleep(0.5)  # the call waits in the engine's queue
    abandoned_at = time.monotonic()
    notice = requests.post(f"{url}/v1/calls/abandon", json={"call_ids": [call_id]}, timeout=30)
    assert notice.status_code == 200 and notice.json()["calls"] == 1, notice.text
    queued.join(10)
    reply = queued_outcome["value"]
    assert reply.status_code == 409 and reply.json()["error"] == "call_abandoned", reply.text
    assert queued_outcome["at"] - abandoned_at < 1.5  # not after the 3 s call ahead of it
    busy.join(10)
    assert busy_outcome.get("value") == 3.0, busy_outcome
    assert shared.call_on(0, "ran", task) == 0
    chunk.clear()


def test_shutdown_answers_waiting_and_new_calls_503(caplog: pytest.LogCaptureFixture) -> None:
    """Calls queued when the worker shuts down, and calls arriving after, get 503 `shutting_down`
    (no 500 with an ERROR traceback); the running call still completes."""
    from rpc_server.app import ServerConfig, create_app

    # Served through the test client, never bound: the node is given, so the engine is built at once.
    app = create_app(ServerConfig(engine=ENGINE, token=None, node="127.0.0.1:9"))

    def post(seconds: float, call_id: str | None = None) -> Any:
        headers = {CALL_ID_HEADER: call_id} if call_id else {}
        body = encode_call([seconds], {})
        return app.test_client().post(
            "/v1/call/sleep", data=body, content_type="application/json", headers=headers
        )

    with caplog.at_level(logging.ERROR, logger="rpc_server"):
        busy, busy_outcome = run_in_thread(lambda: post(1.5))
        time.sleep(0.3)
        queued = [run_in_thread(lambda call_id=call_id: post(0.0, call_id)) for call_id in ("q1", None)]
        time.sleep(0.3)
        app.extensions["on_close"]()
        for thread, outcome in queued:
            thread.join(5)
            assert outcome["value"].status_code == 503, outcome
            assert outcome["value"].get_json()["error"] == "shutting_down"
        after = post(0.0)
        assert after.status_code == 503 and after.get_json()["error"] == "shutting_down"
        busy.join(5)
        assert busy_outcome["value"].status_code == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


class _BadStatusLineHandler(BaseHTTPRequestHandler):
    """A peer that is alive (`/health`) but answers calls, after a moment, with a malformed reply."""

    def do_GET(self) -> None:
        body = b'{"status":"ok"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        time.sleep(0.5)
        self.wfile.write(b"HTTP/1.1 abc\r\nContent-Length: 0\r\n\r\n")

    def log_message(self, *args: Any) -> None:
        pass


def test_partial_results_are_decoded_whatever_the_error(shared: WorkerGroup) -> None:
    """Whatever the error (here aiohttp's own, for a malformed reply), the completed calls'
    results come back decoded: REMOTE batches the caller can clear."""
    before = _shards(shared)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _BadStatusLineHandler)
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    try:
        fake = f"127.0.0.1:{server.server_port}"
        group = WorkerGroup([shared.nodes[0], fake], client=shared.client, liveness_timeout=None)
        (chunk,) = _inputs(shared, "decoded", 1)
        with pytest.raises(Exception) as info:  # noqa: B017 - the error's type is not the point
            group.call("mark", [chunk, chunk])
        partial = info.value.partial_results  # type: ignore[attr-defined]
        assert partial is not None and partial[1] is None
        assert isinstance(partial[0], DistributedBatchMemory), partial
        assert partial[0]["mark"] == [f"m-{chunk.task_ids[0]}"]
        partial[0].clear()
        chunk.clear()
    finally:
        server.shutdown()
        serving.join(timeout=10)
        server.server_close()
    assert _shards(shared) == before
