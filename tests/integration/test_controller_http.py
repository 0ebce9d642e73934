"""The controller over HTTP: `serve_controller` + `RemoteController` against real workers.

Same answers as the local API, errors of the right types, a server that survives every bad
request, bearer tokens, and a RemoteController used from a forked child.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from batch_support import remote

from distbatch import AuthError, BatchStatusError, RequestError, ShardClient, WorkerUnavailableError
from distbatch.batch import BatchStatus, DistributedBatchMemory
from distbatch.controller import ClearInProgressError, Controller, SchemaConflictError
from distbatch.controller.remote import RemoteController
from distbatch.controller.server import ControllerServer, serve_controller
from distbatch.errors import ClearError, ServerBindError, ShardElsewhereError
from distbatch.launch import WorkerProcess
from distbatch.samplers import RankAwareSampler, SeqlenBalancedSampler

HTTP = requests.Session()
HTTP.trust_env = False


def prefix() -> str:
    return uuid.uuid4().hex[:8]


def groups(node: str, ids: Sequence[str], lengths: Sequence[int], n: int = 2) -> DistributedBatchMemory:
    return remote(
        node,
        ids,
        input_ids=[torch.arange(k) for k in lengths],
        uid=[f"u{i // n}" for i in range(len(ids))],
    )


def without_generations(value: Any) -> Any:
    """Metadata or controller state without put generations: each worker numbers its own puts,
    so two controllers whose data went to different workers differ only there."""
    if isinstance(value, dict):
        out = {k: without_generations(v) for k, v in value.items() if k != "generations"}
        if isinstance(value.get("rows"), list):  # a checkpoint's column: [index, node, shape, generation]
            out["rows"] = [row[:3] for row in value["rows"]]
        return out
    if isinstance(value, list):
        return [without_generations(v) for v in value]
    return value


def assert_serving(rc: RemoteController) -> None:
    assert HTTP.get(f"http://{rc.address}/health", timeout=5).json()["role"] == "controller"
    assert isinstance(rc.partitions(), list)


# --------------------------------------------------------------------------- same results as local


def test_remote_controller_matches_the_local_one(
    shared_workers: list[WorkerProcess], serve: Callable[..., ControllerServer]
) -> None:
    """Every call, mirrored on a local Controller (data on w0) and a served one (same ids, data on w1)."""
    w0, w1 = shared_workers[0].node, shared_workers[1].node
    local = Controller(RankAwareSampler())
    server = serve(Controller(RankAwareSampler()))
    rc = RemoteController(server.address, timeout=20)
    ids = [f"{prefix()}-{i}" for i in range(8)]
    prompts = [torch.arange(k) for k in range(1, 9)]

    def norm(value: Any) -> str:
        return json.dumps(without_generations(value), sort_keys=True).replace(w0, "NODE").replace(w1, "NODE")

    def both(name: str, *args: Any, **kwargs: Any) -> Any:
        a, b = getattr(local, name)(*args, **kwargs), getattr(rc, name)(*args, **kwargs)
        if isinstance(a, DistributedBatchMemory):
            assert a.status is b.status
            assert norm(a.meta.to_dict() if a.meta else None) == norm(b.meta.to_dict() if b.meta else None)
            if a.status is BatchStatus.REMOTE:
                for field in a.fields:
                    assert [torch.equal(x, y) for x, y in zip(a[field], b[field])] == [True] * len(a)
            return a.task_ids
        assert norm(a) == norm(b), (name, a, b)
        return a

    assert (
        local.put("p", remote(w0, ids, prompt=prompts)) == rc.put("p", remote(w1, ids, prompt=prompts)) == 8
    )
    answers = [torch.ones(k) for k in range(4)]
    assert local.put("p", remote(w0, ids[:4], answer=answers)) == rc.put(
        "p", remote(w1, ids[:4], answer=answers)
    )
    assert rc.put("p", DistributedBatchMemory()) == 0
    both("partitions")
    both("production_status", "p")
    both("production_status", "p", ["prompt", "answer"])
    both("production_status", "nothing")
    assert both("get_meta", "p", "train", ["prompt", "answer"], 2, dp_rank=0, batch_index=0) == ids[:2]
    assert both("get_meta", "p", "train", ["prompt", "answer"], 2, dp_rank=1, batch_index=0) == ids[2:4]
    assert both("get_meta", "p", "train", ["prompt", "answer"], 2, dp_rank=0, batch_index=0) == ids[:2]
    assert both("get_meta", "p", "train", ["prompt", "answer"], 2, dp_rank=0, batch_index=1) == []
    assert both("get_meta", "p", "train", ["prompt"], 4, dp_rank=0, batch_index=2) == ids[4:]
    both("consumption_status", "p", "train")
    assert both("all_consumed", "p", "train") is True
    assert both("all_consumed", "p", "critic") is False
    both("state_dict")
    assert rc.state_dict() == server.controller.state_dict()
    both("reset_consumption", "p", "train")
    both("consumption_status", "p", "train")
    assert both("get_meta", "p", "train", ["prompt"], 3, dp_rank=0, batch_index=0) == ids[:3]
    both("reset_consumption", "p")
    both("reset_consumption", "nothing")
    both("state_dict")
    assert both("clear_tasks", "p", ids[:2]) == 4
    assert both("clear_tasks", "p", ids[:2]) == 0
    both("production_status", "p")
    assert both("clear_partition", "p") == 8
    assert both("clear_partition", "p") == 0
    assert both("partitions") == []
    both("state_dict")


def test_remote_get_meta_waits_for_producers(
    shared_workers: list[WorkerProcess], serve: Callable[..., ControllerServer]
) -> None:
    node = shared_workers[0].node
    server = serve(Controller())
    rc = RemoteController(server.address, timeout=20)
    pool = ThreadPoolExecutor(max_workers=2)
    try:
        start = time.monotonic()
        assert rc.get_meta("p", "train", ["x"], 1, timeout=0.3).status is BatchStatus.EMPTY
        assert 0.25 <= time.monotonic() - start < 5

        # The server caps a huge (or infinite) wait, so these are valid and simply wait for data.
        for timeout in (30, 1e300, float("inf")):
            ids = [f"{prefix()}-{i}" for i in range(2)]
            batch = remote(node, ids, x=torch.zeros(2, 3))

            def produce(batch: DistributedBatchMemory = batch) -> int:
                time.sleep(0.3)
                return RemoteController(server.address).put("p", batch)

            producer = pool.submit(produce)
            start = time.monotonic()
            got = rc.get_meta("p", "train", ["x"], 2, timeout=timeout)
            assert got.task_ids == ids and got["x"].shape == (2, 3)
            assert 0.25 <= time.monotonic() - start < 5, timeout
            assert producer.result(timeout=5) == 2
            assert_serving(rc)
    finally:
        pool.shutdown()


def test_waiting_consumers_never_starve_a_producer_sharing_their_client(
    shared_workers: list[WorkerProcess], serve: Callable[..., ControllerServer]
) -> None:
    # More long-polling consumers than the client has connections per node: the producer's put
    # (and a data fetch) still go through at once, so the consumers get the data, not a timeout.
    node = shared_workers[0].node
    server = serve(Controller(RankAwareSampler()))
    with ShardClient(max_connections_per_node=2, timeout=30) as shared:
        rc = RemoteController(server.address, client=shared, timeout=30)
        pre = prefix()
        ids = [f"{pre}-{i}" for i in range(4)]
        with ThreadPoolExecutor(max_workers=4) as pool:
            consumers = [
                pool.submit(rc.get_meta, "p", "train", ["x"], 1, timeout=20, dp_rank=rank, batch_index=0)
                for rank in range(4)
            ]
            deadline = time.monotonic() + 10
            while rc.waiting_consumers() < 4 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert rc.waiting_consumers() == 4  # all four hold a connection to the controller
            batch = DistributedBatchMemory.from_dict({"x": torch.arange(4.0)[:, None]}, task_ids=ids)
            stored = batch.to_remote(node, shared)
            assert rc.put("p", stored) == 4
            got = [c.result(timeout=30) for c in consumers]
        assert rc.waiting_consumers() == 0 == server.controller.waiting_consumers()
        assert sorted(t for b in got for t in b.task_ids) == ids  # each rank got one, none timed out
        stored.clear()


def test_long_polls_hold_no_turn_and_quick_polls_reuse_their_connection(
    serve: Callable[..., ControllerServer],
) -> None:
    """More ranks long-polling than the controller serves get_meta calls at once (POLLS_AT_ONCE):
    they wait without a turn, so a quick poll is still answered at once; and a rank's quick
    polls go out on one kept-alive connection, which waits parked between them."""
    from distbatch.controller.server import POLLS_AT_ONCE
    from distbatch.serving.handler import PARK_AFTER_SECONDS

    server = serve(Controller())
    with ShardClient(timeout=30) as waiting_client, ShardClient(timeout=30) as polling_client:
        waiting = RemoteController(server.address, client=waiting_client, timeout=30)
        waiting.create_partition("p", ["x"])
        with ThreadPoolExecutor(max_workers=POLLS_AT_ONCE + 2) as pool:
            long_polls = [
                pool.submit(waiting.get_meta, "p", "train", ["x"], 1, timeout=3)
                for _ in range(POLLS_AT_ONCE + 2)
            ]
            deadline = time.monotonic() + 10
            while waiting.waiting_consumers() < POLLS_AT_ONCE + 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert waiting.waiting_consumers() == POLLS_AT_ONCE + 2
            poller = RemoteController(server.address, client=polling_client)
            for _ in range(20):
                assert poller.get_meta("p", "train", ["x"], 1).status is BatchStatus.EMPTY
            assert not any(f.done() for f in long_polls)  # answered while they all still wait
            assert all(f.result(timeout=10).status is BatchStatus.EMPTY for f in long_polls)
        # 20 polls, one connection: once idle (parked), the server holds exactly two, the
        # poller's and the waiting client's (its other calls); the long polls had their own
        # connections, closed after their answers, and a fresh one per quick poll would be too
        time.sleep(PARK_AFTER_SECONDS + 0.2)
        text = HTTP.get(f"http://{server.address}/metrics", timeout=5).text
        idle = [line for line in text.splitlines() if line.startswith("distbatch_connections_idle ")]
        assert float(idle[0].split()[1]) == 2


def test_serving_a_controller_lifts_a_low_open_file_limit() -> None:
    """Hundreds of ranks each keep a connection: a process that serves a controller with the
    common soft limit of 256 or 1024 descriptors gets it raised (towards the hard limit)."""
    import resource
    import subprocess
    import sys

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"the hard limit ({hard}) leaves nothing to raise")
    code = (
        "import resource\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        "from distbatch.controller import Controller\n"
        "from distbatch.controller.server import serve_controller\n"
        "with serve_controller(Controller()):\n"
        "    print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert int(out.stdout.strip()) > 256


def test_summary_shows_partitions_consumers_and_who_waits_where(
    shared_workers: list[WorkerProcess], serve: Callable[..., ControllerServer]
) -> None:
    node = shared_workers[0].node
    server = serve(Controller())
    rc = RemoteController(server.address, timeout=30)
    nothing_served = {"served": {}, "dropped": 0}
    assert rc.summary() == {
        "waiting_consumers": 0,
        "partitions": {},
        "policy_version": 0,
        "staleness": nothing_served,
        "reissued": 0,
    }
    ids = [f"{prefix()}-{i}" for i in range(4)]
    rc.create_partition("p", expected_fields=["reward"])
    rc.put("p", remote(node, ids, x=[torch.arange(k) for k in range(1, 5)]))
    rc.put("p", remote(node, ids[:2], y=torch.zeros(2, 3)))
    assert len(rc.get_meta("p", "train", ["x"], 3)) == 3
    with ThreadPoolExecutor(max_workers=3) as pool:
        waiting = [
            pool.submit(rc.get_meta, "p", "critic", ["y"], 4, timeout=20),
            pool.submit(rc.get_meta, "p", "judge", ["x", "y"], 3, timeout=20),
            pool.submit(rc.get_meta, "later", "gen", ["x"], 1, timeout=20),
        ]
        deadline = time.monotonic() + 10
        while rc.waiting_consumers() < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        summary = rc.summary()
        assert summary == server.controller.summary()
        assert summary["waiting_consumers"] == 3
        assert summary["partitions"]["p"] == {
            "exists": True,
            "tasks": 4,
            "ready": 0,  # nobody has `reward` yet
            "clearing": 0,
            "fields": {
                "x": {"produced": 4, "partial": 0, "dtype": "I64", "ragged": True},
                "y": {"produced": 2, "partial": 0, "dtype": "F32", "ragged": False},
                "reward": {"produced": 0, "partial": 0, "dtype": None, "ragged": False},
            },
            "consumed": {"train": 3},
            "policy_versions": {},
            "waiting": {"critic": 1, "judge": 1},
        }
        assert summary["partitions"]["later"] == {
            "exists": False,
            "tasks": 0,
            "ready": 0,
            "clearing": 0,
            "fields": {},
            "consumed": {},
            "policy_versions": {},
            "waiting": {"gen": 1},
        }
        rc.put("p", remote(node, ids[2:], y=torch.zeros(2, 3)))
        rc.put("later", remote(node, [f"{prefix()}-later"], x=torch.zeros(1, 1)))
        assert sorted(len(w.result(timeout=30)) for w in waiting) == [1, 3, 4]
    after = rc.summary()
    assert after["waiting_consumers"] == 0 and list(after["partitions"]) == ["p", "later"]
    assert after["partitions"]["p"]["consumed"] == {"train": 3, "critic": 4, "judge": 3}
    assert after["partitions"]["p"]["waiting"] == {} and after["partitions"]["later"]["exists"] is True
    assert rc.clear_partition("p") == 8 and rc.clear_partition("later") == 1


# --------------------------------------------------------------------------- errors


def test_errors_come_back_with_local_types_and_the_server_keeps_serving(
    shared_workers: list[WorkerProcess], serve: Callable[..., ControllerServer]
) -> None:
    node = shared_workers[0].node
    server = serve(Controller(RankAwareSampler()))
    rc = RemoteController(server.address, timeout=20)
    ids = [f"{prefix()}-{i}" for i in range(4)]
    rc.put("p", remote(node, ids, x=torch.zeros(4, 2, dtype=torch.int64), uid=["a"] * 4))
    before = rc.state_dict()

    failing: list[tuple[type[BaseException], Callable[[], Any]]] = [
        (SchemaConflictError, lambda: rc.put("p", remote(node, ids, x=torch.zeros(4, 2)))),
        (SchemaConflictError, lambda: rc.put("p", remote(node, ids, uid=torch.zeros(4, 1)))),
        (BatchStatusError, lambda: rc.put("p", DistributedBatchMemory.from_dict({"x": [1]}))),
        (ValueError, lambda: rc.put("bad id", remote(node, [f"{prefix()}-z"], x=torch.zeros(1, 2)))),
        (ValueError, lambda: rc.get_meta("bad/id", "train", ["x"], 1, dp_rank=0, batch_index=0)),
        (ValueError, lambda: rc.get_meta("p", "train", ["bad field"], 1, dp_rank=0, batch_index=0)),
        (ValueError, lambda: rc.get_meta("p", "train", ["x"], 0, dp_rank=0, batch_index=0)),
        (ValueError, lambda: rc.get_meta("p", "train", ["x"], 1.5, dp_rank=0, batch_index=0)),
        (ValueError, lambda: rc.get_meta("p", "train", "x", 1, dp_rank=0, batch_index=0)),
        (ValueError, lambda: rc.get_meta("p", "train", ["x"], 1)),  # no dp_rank for RankAwareSampler
        (ValueError, lambda: rc.get_meta("p", "train", ["x"], 1, dp_rank="a", batch_index=0)),
        (ValueError, lambda: rc.get_meta("p", "train", ["x"], 1, dp_rank=0, batch_index=-1)),
        (ValueError, lambda: rc.get_meta("p", "train", ["x"], 1, timeout=-1, dp_rank=0, batch_index=0)),
        (
            ValueError,
            lambda: rc.get_meta("p", "train", ["x"], 1, timeout=float("nan"), dp_rank=0, batch_index=0),
        ),
        (ValueError, lambda: rc.get_meta("p", "train", ["x"], 1, partition="p", dp_rank=0, batch_index=0)),
        (ValueError, lambda: rc.clear_tasks("p", ["bad id"])),
        (ValueError, lambda: rc.load_state_dict({"version": 99})),
        (ValueError, lambda: rc.load_state_dict({**before, "partitions": []})),
    ]
    for expected, call in failing:
        start = time.monotonic()
        with pytest.raises(expected):
            call()
        assert time.monotonic() - start < 10
        assert rc.state_dict() == before
        assert_serving(rc)
    elsewhere = remote(shared_workers[1].node, ids[:1], x=torch.zeros(1, 2, dtype=torch.int64))
    try:
        with pytest.raises(ShardElsewhereError, match="already has field 'x'"):
            rc.put("p", elsewhere)
        assert rc.state_dict() == before
    finally:
        elsewhere.clear()
    # The local controller's words, not the engine-call encoder's.
    with pytest.raises(BatchStatusError, match="the controller holds metadata only: put a REMOTE batch"):
        rc.put("p", DistributedBatchMemory.from_dict({"x": [1]}))
    assert rc.get_meta("p", "train", ["x", "uid"], 4, dp_rank=0, batch_index=0).task_ids == ids


def test_bad_raw_requests_get_json_errors(
    shared_workers: list[WorkerProcess], serve: Callable[..., ControllerServer]
) -> None:
    server = serve(Controller())
    rc = RemoteController(server.address, timeout=20)
    base = f"http://{server.address}/v1/controller"
    ok_get_meta = {"partition_id": "p", "task_name": "t", "fields": ["x"], "batch_size": 1}

    def post(path: str, body: Any = None, *, data: bytes | None = None, **headers: str) -> requests.Response:
        if data is None:
            return HTTP.post(f"{base}/{path}", json=body, timeout=10)
        return HTTP.post(f"{base}/{path}", data=data, headers=headers, timeout=10)

    responses = [
        post("put", data=b"{not json", **{"Content-Type": "application/json"}),
        post("put", data=b'{"partition_id": "p"}'),  # no JSON content type
        post("put", data=b"\xff\xfe", **{"Content-Type": "application/json"}),
        post("put", []),
        post("put", {}),
        post("put", {"partition_id": "p", "batch": "x"}),
        post("put", {"partition_id": "p", "batch": {"json": 1}}),
        post("put", {"partition_id": "p", "batch": {"batch": {"version": 1}}}),
        post("put", {"partition_id": 5, "batch": {"batch": None}}),
        post("put", {"batch": {"batch": None}}),
        post("get_meta", {}),
        post("get_meta", {**ok_get_meta, "batch_size": "1"}),
        post("get_meta", {**ok_get_meta, "batch_size": None}),
        post("get_meta", {**ok_get_meta, "fields": 5}),
        post("get_meta", {**ok_get_meta, "fields": "x"}),
        post("get_meta", {**ok_get_meta, "fields": [["x"]]}),
        post("get_meta", {**ok_get_meta, "task_name": None}),
        post("get_meta", {**ok_get_meta, "timeout": "1"}),
        post("get_meta", {**ok_get_meta, "timeout": -3}),
        post("get_meta", {**ok_get_meta, "sampling_config": [1]}),
        post("get_meta", {**ok_get_meta, "sampling_config": {"not-an-identifier": 1}}),
        post("get_meta", {**ok_get_meta, "sampling_config": {"partition_id": "q"}}),
        post("get_meta", {**ok_get_meta, "sampling_config": {"batch_size": 3}}),
        post("production_status", {}),
        post("production_status", {"partition_id": ["p"]}),
        post("consumption_status", {"partition_id": "p"}),
        post("consumption_status", {"partition_id": {}, "task_name": "t"}),
        post("reset_consumption", {}),
        post("clear_tasks", {"partition_id": "p", "task_ids": "t"}),
        post("clear_tasks", {"partition_id": "p"}),
        post("clear_tasks", {"partition_id": "p", "task_ids": [1, 2]}),
        post("clear_partition", {}),
        post("state", {"version": 1}),
        post("state", {"version": 1, "partitions": {"p": []}}),
        post("state", 3),
    ]
    # Each validated error type has its own code (RemoteController raises that type again).
    codes = {"bad_request", "invalid_id", "bad_container", "bad_metadata"}
    for i, response in enumerate(responses):
        assert response.status_code == 400, (i, response.status_code, response.text)
        body = response.json()
        assert body["error"] in codes and body["message"], (i, body)
    assert "missing" in post("get_meta", {}).json()["message"]

    # A NaN timeout (valid JSON for Python's parser) is refused instead of spinning a thread.
    nan = HTTP.post(
        f"{base}/get_meta",
        data=json.dumps({**ok_get_meta, "timeout": float("nan")}),
        headers={"Content-Type": "application/json"},
        timeout=10,
    )
    assert nan.status_code == 400, nan.text

    unknown = HTTP.post(f"{base}/nope", json={}, timeout=10)
    assert unknown.status_code == 404 and unknown.json()["error"] == "not_found"
    assert HTTP.get(f"{base}/put", timeout=10).status_code == 405
    wrong_method = HTTP.post(f"{base}/partitions", json={}, timeout=10)
    assert wrong_method.status_code == 405 and wrong_method.json()["error"] == "method_not_allowed"
    with pytest.raises(RequestError) as info:
        rc.client.request_json(rc.address, "DELETE", "/v1/controller/state")
    assert info.value.status == 405
    with pytest.raises(ValueError):
        rc._post("/v1/controller/nope", {})

    assert_serving(rc)
    ids = [f"{prefix()}-{i}" for i in range(2)]
    assert rc.put("p", remote(shared_workers[0].node, ids, x=torch.zeros(2, 1))) == 2
    assert rc.get_meta("p", "t", ["x"], 2).task_ids == ids
    assert server.controller.state_dict() == rc.state_dict()


def test_clear_error_over_http_names_the_dead_worker(
    fresh_workers: list[WorkerProcess], serve: Callable[..., ControllerServer]
) -> None:
    live, dead = fresh_workers
    quick = ShardClient(timeout=3.0, connect_timeout=1.0, retries=1)
    try:
        server = serve(Controller(client=quick))
        rc = RemoteController(server.address, timeout=20)
        pre = prefix()
        on_live = [f"{pre}-a{i}" for i in range(3)]
        on_dead = [f"{pre}-b{i}" for i in range(2)]
        rc.put("p", remote(live.node, on_live, x=torch.zeros(3, 1)))
        rc.put("p", remote(dead.node, on_dead, x=torch.zeros(2, 1)))
        dead.kill()

        clears = [(lambda: rc.clear_partition("p"), 3), (lambda: rc.clear_tasks("p", on_live + on_dead), 0)]
        for clear, deleted in clears:
            start = time.monotonic()
            with pytest.raises(ClearError) as info:
                clear()
            assert time.monotonic() - start < 15
            err = info.value
            assert list(err.failed) == [dead.node]
            assert isinstance(err.failed[dead.node], WorkerUnavailableError)
            assert err.undeleted == {dead.node: 2}
            assert err.deleted == deleted  # the live worker's shards went on the first try
            # the retry only asks the dead worker: the live one's tasks were forgotten
            assert err.deleted_by_node == ({live.node: deleted} if deleted else {})
            assert dead.node in str(err)
            assert quick.stats(live.node)["shards"] == 0
            assert rc.production_status("p")["tasks"] == 2
            assert sorted(t for _, t in rc.state_dict()["partitions"]["p"]["tasks"]) == on_dead
            assert_serving(rc)
    finally:
        quick.close()


def test_put_during_a_clear_is_a_clear_in_progress_error_over_http(
    fresh_workers: list[WorkerProcess], serve: Callable[..., ControllerServer]
) -> None:
    stalled, live = fresh_workers
    rc = RemoteController(serve(Controller()).address, timeout=30)
    going = [f"{prefix()}-go{i}" for i in range(2)]
    rc.put("p", remote(stalled.node, going, x=torch.zeros(2, 1)))
    os.kill(stalled.pid, signal.SIGSTOP)  # the clear hangs on its deletes until SIGCONT
    try:
        with ThreadPoolExecutor(1) as pool:
            clearing = pool.submit(rc.clear_tasks, "p", going)
            deadline = time.monotonic() + 10
            while rc.production_status("p", ["x"])["ready"] != 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            late = remote(live.node, going[:1], y=torch.ones(1, 1))
            with pytest.raises(ClearInProgressError, match="being cleared"):
                rc.put("p", late)
            os.kill(stalled.pid, signal.SIGCONT)
            assert clearing.result(timeout=30) == 2
    finally:
        os.kill(stalled.pid, signal.SIGCONT)
    assert rc.production_status("p")["tasks"] == 0
    assert late.clear() == 1
    assert_serving(rc)


# --------------------------------------------------------------------------- tokens and fork


def test_token_guards_everything_but_health(
    shared_workers: list[WorkerProcess], serve: Callable[..., ControllerServer]
) -> None:
    server = serve(Controller(), token="s")
    ids = [f"{prefix()}-{i}" for i in range(2)]
    batch = remote(shared_workers[0].node, ids, x=torch.zeros(2, 1))
    assert HTTP.get(f"http://{server.address}/health", timeout=5).status_code == 200
    assert HTTP.get(f"http://{server.address}/v1/controller/partitions", timeout=5).status_code == 401

    with ShardClient(token="wrong") as wrong, ShardClient(token="") as none, ShardClient(token="s") as right:
        for client in (wrong, none):
            rc = RemoteController(server.address, client=client, timeout=10)
            calls: list[Callable[[RemoteController], Any]] = [
                lambda rc: rc.put("p", batch),
                lambda rc: rc.get_meta("p", "t", ["x"], 1, timeout=5),
                lambda rc: rc.production_status("p"),
                lambda rc: rc.partitions(),
                lambda rc: rc.waiting_consumers(),
                lambda rc: rc.summary(),
                lambda rc: rc.forget_node(shared_workers[0].node),
                lambda rc: rc.state_dict(),
                lambda rc: rc.load_state_dict(server.controller.state_dict()),
                lambda rc: rc.clear_partition("p"),
            ]
            for call in calls:
                with pytest.raises(AuthError):
                    call(rc)
        assert server.controller.partitions() == []
        good = RemoteController(server.address, client=right, timeout=10)
        assert good.put("p", batch) == 2
        got = good.get_meta("p", "t", ["x"], 2)
        assert got.task_ids == ids and got["x"].shape == (2, 1)
        assert good.partitions() == ["p"]


def _wait_child(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError(f"forked child {pid} hung")


@pytest.mark.parametrize("own_client", [False, True])
def test_forked_child_uses_the_parents_remote_controller(
    shared_workers: list[WorkerProcess], serve: Callable[..., ControllerServer], own_client: bool
) -> None:
    server = serve(Controller(RankAwareSampler()))
    client = ShardClient(timeout=20) if own_client else None
    try:
        rc = RemoteController(server.address, client=client, timeout=20)
        ids = [f"{prefix()}-{i}" for i in range(6)]
        rc.put("p", remote(shared_workers[0].node, ids, x=torch.arange(6).reshape(6, 1)))
        parent_first = rc.get_meta("p", "train", ["x"], 2, dp_rank=0, batch_index=0)
        assert parent_first["x"].flatten().tolist() == [0, 1]  # the client's pool is warm now

        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: use the very same object, report, and leave without cleanup
            code = 1
            try:
                os.close(read_end)
                got = rc.get_meta("p", "train", ["x"], 2, dp_rank=1, batch_index=0)
                report = {
                    "ids": got.task_ids,
                    "x": got["x"].flatten().tolist(),
                    "status": rc.consumption_status("p", "train"),
                }
                os.write(write_end, json.dumps(report).encode())
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            code = _wait_child(pid, 30)
            raw = pipe.read()
        assert code == 0
        report = json.loads(raw)
        assert report == {"ids": ids[2:4], "x": [2, 3], "status": {"tasks": 6, "consumed": 4}}
        # The parent's client still works, and sees what the child took.
        assert rc.get_meta("p", "train", ["x"], 2, dp_rank=1, batch_index=0).task_ids == ids[2:4]
        assert rc.get_meta("p", "train", ["x"], 2, dp_rank=0, batch_index=1)["x"].flatten().tolist() == [4, 5]
        assert rc.all_consumed("p", "train")
    finally:
        if client is not None:
            client.close()


# --------------------------------------------------------------------------- state and checkpoints


def test_checkpoint_over_http(
    shared_workers: list[WorkerProcess], serve: Callable[..., ControllerServer], tmp_path: Path
) -> None:
    node = shared_workers[0].node
    server = serve(Controller(SeqlenBalancedSampler(2, 2)))
    rc = RemoteController(server.address, timeout=20)
    ids = [f"{prefix()}-{i}" for i in range(16)]
    rc.put("p", groups(node, ids, [9, 1, 3, 4, 5, 2, 2, 2, 6, 6, 1, 2, 3, 3, 4, 5]))
    first = rc.get_meta("p", "train", ["input_ids"], 4, dp_rank=1, batch_index=0)
    assert len(first) == 4

    path = rc.save_checkpoint(tmp_path / "ckpt.json")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.json"]
    assert json.loads(path.read_text()) == server.controller.state_dict()

    restored = Controller(SeqlenBalancedSampler(2, 2))
    restored.load_checkpoint(path)
    for dp, bi in [(0, 0), (1, 1), (0, 1), (1, 0), (0, 2)]:
        a = rc.get_meta("p", "train", ["input_ids"], 4, dp_rank=dp, batch_index=bi)
        b = restored.get_meta("p", "train", ["input_ids"], 4, dp_rank=dp, batch_index=bi)
        assert a.task_ids == b.task_ids, (dp, bi)
        assert (a.meta.to_dict() if a.meta else None) == (b.meta.to_dict() if b.meta else None)
    assert rc.state_dict() == restored.state_dict()

    # Load into another served controller, over HTTP; invalid states change nothing.
    other = serve(Controller(SeqlenBalancedSampler(2, 2)))
    rc2 = RemoteController(other.address, timeout=20)
    rc2.load_checkpoint(path)
    assert rc2.state_dict() == json.loads(path.read_text())
    loaded = rc2.state_dict()
    bad = tmp_path / "bad.json"
    bad.write_text(path.read_text()[:-10])
    with pytest.raises(ValueError):
        rc2.load_checkpoint(bad)
    with pytest.raises(ValueError):
        rc2.load_state_dict(
            {**loaded, "sampler": {**loaded["sampler"], "config": {"n_samples_per_prompt": 3}}}
        )
    assert rc2.state_dict() == loaded
    rc2.load_state_dict(rc.state_dict())
    assert rc2.state_dict() == rc.state_dict()


def test_many_threads_pull_over_http(
    shared_workers: list[WorkerProcess], serve: Callable[..., ControllerServer]
) -> None:
    """16 threads (8 dp ranks x 2 TP peers) pull through one RemoteController while another produces.

    The producer has its own client: the consumers' waiting long-polls hold the shared client's
    connections to the controller (8 per node by default), which would queue its puts behind them.
    """
    node = shared_workers[1].node
    server = serve(Controller(RankAwareSampler()))
    rc = RemoteController(server.address, timeout=20)
    pre = prefix()
    batches = [remote(node, [f"{pre}-{k}-{i}" for i in range(4)], x=torch.zeros(4, 1)) for k in range(8)]

    def produce() -> None:
        with ShardClient(timeout=20) as own:
            producer = RemoteController(server.address, client=own)
            for b in batches:
                time.sleep(0.01)
                producer.put("p", b)

    def consume(dp: int) -> list[list[str]]:
        return [
            rc.get_meta("p", "train", ["x"], 2, timeout=20, dp_rank=dp, batch_index=bi).task_ids
            for bi in range(2)
        ]

    with ThreadPoolExecutor(max_workers=17) as pool:
        consumers = [(dp, pool.submit(consume, dp)) for dp in range(8) for _ in range(2)]
        producer = pool.submit(produce)
        producer.result(timeout=30)
        results: dict[int, list[list[list[str]]]] = {}
        for dp, f in consumers:
            results.setdefault(dp, []).append(f.result(timeout=30))
    handed = []
    for peers in results.values():
        assert peers[0] == peers[1]
        handed += [t for batch in peers[0] for t in batch]
    assert sorted(handed) == sorted(t for b in batches for t in b.task_ids)


def test_server_repr_and_idempotent_shutdown(serve: Callable[..., ControllerServer], worker) -> None:
    controller = Controller()
    server = serve(controller, token="s3cret")
    controller.put("p", groups(worker.node, ["a", "b"], [3, 4]))
    text = repr(server)
    assert server.address in text and "running" in text and "1 partition(s)" in text
    assert "token required" in text and "s3cret" not in text
    server.shutdown()
    server.shutdown()  # a second shutdown (e.g. the fixture's) is a no-op
    assert not server.running and "shut down" in repr(server)
    with pytest.raises(requests.ConnectionError):
        HTTP.get(f"http://{server.address}/health", timeout=5)


@pytest.mark.parametrize("port", [70000, 65536, -1])
def test_serving_on_a_port_out_of_range_is_a_value_error_naming_it(port: int) -> None:
    """70000 used to serve on :4464 (the socket layer takes a port modulo 65536); -1 was an
    OverflowError from the socket layer."""
    with pytest.raises(ValueError, match=f"port {port} is not a port to listen on: use 0 to 65535"):
        serve_controller(Controller(), port=port)
    with serve_controller(Controller(), port=0) as server:  # 0: a free port
        assert 1 <= int(server.address.rsplit(":", 1)[1]) <= 65535


def test_serving_on_a_taken_port_raises_an_os_error_naming_it() -> None:
    """Not werkzeug's SystemExit, which `except Exception` cannot catch and which ends the trainer."""
    with serve_controller(Controller()) as first:
        with pytest.raises(ServerBindError) as info:
            serve_controller(Controller(), port=int(first.address.rsplit(":", 1)[1]))
        assert isinstance(info.value, OSError) and info.value.errno == errno.EADDRINUSE
        assert f"cannot listen on {first.address}" in str(info.value) and "port 0" in str(info.value)
        assert requests.get(f"http://{first.address}/health", timeout=10).ok  # the first one serves on
