"""Engine calls (`POST /v1/call/<method>`) through real worker processes on loopback.

Two workers host `engines_for_tests:make_echo_engine` for the whole module (each test uses its
own task ids); tests that kill or break a worker start their own.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests
import torch
from batch_support import shards_on
from engines_for_tests import ECHO, ENGINES_ENV

from distbatch import (
    BatchStatusError,
    CallTimeoutError,
    DistributedBatchMemory,
    EngineError,
    RequestError,
    ShardClient,
    WorkerGroup,
    WorkerUnavailableError,
)
from distbatch.auth import token_from_env
from distbatch.batch import BatchStatus
from distbatch.batch.calls import encode_call
from distbatch.launch import WorkerProcess
from distbatch.launch.forkserver import ENV_SPAWN

ENV = ENGINES_ENV

HTTP = requests.Session()
HTTP.trust_env = False


def _auth() -> dict[str, str]:
    token = token_from_env()
    return {"Authorization": f"Bearer {token}"} if token else {}


def unique(prefix: str = "t") -> str:
    return f"{prefix}{uuid.uuid4().hex[:10]}"


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def pair(echo_pair: WorkerGroup) -> WorkerGroup:
    """Workers A and B, both hosting EchoEngine (built by a factory that takes `context=`)."""
    return echo_pair


@pytest.fixture
def a(pair: WorkerGroup) -> str:
    return pair.nodes[0]


@pytest.fixture
def b(pair: WorkerGroup) -> str:
    return pair.nodes[1]


def push(node: str, module_client: ShardClient, n: int = 4) -> DistributedBatchMemory:
    """A REMOTE batch of `n` tasks with a tensor field `x` and a JSON field `label`, stored on `node`."""
    local = DistributedBatchMemory.from_dict(
        {"x": torch.arange(n, dtype=torch.float32) + 1, "label": [f"l{i}" for i in range(n)]},
        task_ids=[unique(f"task{i}-") for i in range(n)],
    )
    return local.to_remote(node, module_client)



# --------------------------------------------------------------------------- results


def test_a_worker_whose_calls_carry_json_only_never_loads_torch(
    module_client: ShardClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker hosting an engine that answers JSON (a reward scorer, a coordinator) does not pay
    for torch (2 s of CPU and 200 MB at start): the engine host imports torch and the batch when
    a batch or a tensor first travels. The first batch call then loads them and works as ever.
    Started as a new interpreter (as a Ray actor starts its worker), where that matters: a
    forked worker has torch from its fork server for nothing."""
    monkeypatch.setenv(ENV_SPAWN, "exec")
    group = WorkerGroup.local(1, ECHO, env=ENGINES_ENV, client=module_client)
    try:
        node = group.nodes[0]
        assert group.call_on(node, "echo", {"k": [1, "x"]})["value"] == {"k": [1, "x"]}
        assert group.call_on(node, "json_value", "dict") is not None
        assert group.call_on(node, "loaded", ["torch", "distbatch.batch.memory"]) == {
            "torch": False,
            "distbatch.batch.memory": False,
        }
        batch = push(node, module_client, 3)
        result = group.call_on(node, "columns", batch, scale=2.0)
        torch.testing.assert_close(result["y"], torch.tensor([2.0, 4.0, 6.0]))
        assert group.call_on(node, "loaded", ["torch"]) == {"torch": True}
        assert result.clear() + batch.clear() == 3 * 3 + 3 * 2
    finally:
        group.shutdown()



def test_columns_result_is_stored_under_the_input_task_ids(
    pair: WorkerGroup, module_client: ShardClient, a: str
) -> None:
    batch = push(a, module_client, 4)
    before = shards_on(module_client, a)
    result = pair.call_on(a, "columns", batch, scale=2.0)
    try:
        assert isinstance(result, DistributedBatchMemory)
        assert result.status is BatchStatus.REMOTE
        assert result.task_ids == batch.task_ids
        assert result.meta is not None and result.meta.nodes == [a]
        assert set(result.fields) == {"y", "tag", "ragged"}
        assert shards_on(module_client, a) == before + 3 * 4
        torch.testing.assert_close(result["y"], torch.tensor([2.0, 4.0, 6.0, 8.0]))
        assert result["tag"] == [f"tag-{t}" for t in batch.task_ids]
        ragged = result["ragged"]
        assert [r.tolist() for r in ragged] == [list(range(i + 1)) for i in range(4)]
        assert [r.dtype for r in ragged] == [torch.int64] * 4
        # the shards are really there, keyed by (input task id, field)
        fetched = module_client.fetch([(a, batch.task_ids[2], "y"), (a, batch.task_ids[2], "tag")])
        assert float(fetched[0]) == 6.0 and fetched[1] == f"tag-{batch.task_ids[2]}"
    finally:
        assert result.clear() == 12
        assert batch.clear() == 8
    assert shards_on(module_client, a) == before - 8


def test_result_fields_sharing_ragged_shapes_survive_the_reply(
    pair: WorkerGroup, module_client: ShardClient, a: str
) -> None:
    """Metadata may say `{"like": other_field}`; the reply's JSON key order must not break that."""
    local = DistributedBatchMemory.from_dict(
        {
            "z_ids": [torch.arange(i + 1) for i in range(3)],
            "a_mask": [torch.ones(i + 1, dtype=torch.bool) for i in range(3)],
        }
    )
    batch = local.to_remote(a, module_client)
    try:
        result = pair.call_on(a, "passthrough", batch)
        assert result.task_ids == batch.task_ids
        assert sorted(result.fields) == ["a_mask", "z_ids"]
        assert [tuple(s) for s in result.meta.fields["a_mask"].shapes] == [(1,), (2,), (3,)]
        assert [m.tolist() for m in result["a_mask"]] == [[True] * (i + 1) for i in range(3)]
    finally:
        batch.clear()


def test_local_batch_result_is_stored_under_its_own_task_ids(
    pair: WorkerGroup, module_client: ShardClient, b: str
) -> None:
    prefix = unique("made")
    before = shards_on(module_client, b)
    result = pair.call_on(b, "make_batch", 3, prefix=prefix)
    try:
        assert result.status is BatchStatus.REMOTE
        assert result.task_ids == [f"{prefix}-{i}" for i in range(3)]
        assert result.meta.nodes == [b]
        assert shards_on(module_client, b) == before + 6
        torch.testing.assert_close(result["z"], torch.tensor([0.0, 10.0, 20.0]))
        assert result["name"] == [f"{prefix}/{i}" for i in range(3)]
        assert module_client.fetch([(b, f"{prefix}-1", "name")]) == [f"{prefix}/1"]
    finally:
        assert result.clear() == 6
    assert shards_on(module_client, b) == before


def test_remote_result_is_passed_through(
    pair: WorkerGroup, module_client: ShardClient, a: str, b: str
) -> None:
    batch = push(b, module_client, 3)
    before_a, before_b = shards_on(module_client, a), shards_on(module_client, b)
    try:
        result = pair.call_on(a, "passthrough", batch)
        assert result.status is BatchStatus.REMOTE
        assert result.meta.to_dict() == batch.meta.to_dict()
        assert (shards_on(module_client, a), shards_on(module_client, b)) == (
            before_a,
            before_b,
        )  # nothing copied
        torch.testing.assert_close(result["x"], torch.tensor([1.0, 2.0, 3.0]))
    finally:
        batch.clear()


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("dict", {"a": 1, "b": 2.5, "c": "text", "d": True, "e": None}),
        ("list", [1, "two", 3.0, None, [4]]),
        ("str", "hello"),
        ("none", None),
        ("lists", {"a": [1, 2], "b": [3, 4]}),  # column-shaped, but no batch argument: plain JSON
    ],
)
def test_plain_json_comes_back_as_is(
    pair: WorkerGroup, module_client: ShardClient, a: str, kind: str, expected: Any
) -> None:
    before = shards_on(module_client, a)
    assert pair.call_on(a, "json_value", kind) == expected
    assert shards_on(module_client, a) == before


def test_json_arguments_round_trip(pair: WorkerGroup, a: str) -> None:
    value = {"nested": [1, 2.5, "x", None, True, {"k": []}], "unicode": "héllo ✓"}
    reply = pair.call_on(a, "echo", value, flag=False, count=3)
    assert reply == {"node": a, "value": value, "kwargs": {"flag": False, "count": 3}}


def test_batch_passed_as_keyword_argument(pair: WorkerGroup, module_client: ShardClient, a: str) -> None:
    batch = push(a, module_client, 2)
    result = pair.call_on(a, "columns", scale=3.0, batch=batch)
    try:
        assert result.task_ids == batch.task_ids
        assert result.meta.nodes == [a]
        torch.testing.assert_close(result["y"], torch.tensor([3.0, 6.0]))
    finally:
        result.clear()
        batch.clear()


def test_empty_batch_argument_arrives_empty(pair: WorkerGroup, a: str) -> None:
    reply = pair.call_on(a, "describe", DistributedBatchMemory())
    assert reply == {"status": "EMPTY", "len": 0, "task_ids": [], "fields": [], "nodes": []}
    # and as a keyword argument
    assert pair.call_on(a, "describe", batch=DistributedBatchMemory())["status"] == "EMPTY"


def test_remote_batch_argument_arrives_as_metadata(
    pair: WorkerGroup, module_client: ShardClient, a: str, b: str
) -> None:
    batch = push(b, module_client, 3)
    try:
        reply = pair.call_on(a, "describe", batch)
        assert reply == {
            "status": "REMOTE",
            "len": 3,
            "task_ids": batch.task_ids,
            "fields": batch.fields,
            "nodes": [b],
        }
    finally:
        batch.clear()


def test_local_batch_argument_is_refused_before_sending(
    pair: WorkerGroup, module_client: ShardClient
) -> None:
    local = DistributedBatchMemory.from_dict({"x": torch.ones(2)})
    before = module_client.traffic()
    with pytest.raises(BatchStatusError, match="to_remote"):
        pair.call_on(0, "describe", local)
    with pytest.raises(BatchStatusError):
        pair.call_on(0, "describe", batch=local)
    with pytest.raises(BatchStatusError):
        pair.call("describe", [local, local])
    with pytest.raises(BatchStatusError):
        pair.call_all("describe", local)
    after = module_client.traffic()
    assert (after - before).requests == 0 and (after - before).total == 0


def test_engine_gathers_from_a_peer(pair: WorkerGroup, module_client: ShardClient, a: str, b: str) -> None:
    """Worker A's engine reads a batch whose shards are on worker B, straight from B."""
    batch = push(b, module_client, 5)
    served_before = module_client.stats(b)["fetch_bytes_served"]
    try:
        assert pair.call_on(a, "total", batch) == 15.0
        served = module_client.stats(b)["fetch_bytes_served"] - served_before
        assert served >= 5 * 4  # B served at least the five float32 values (to A, not to us)
        result = pair.call_on(a, "columns", batch)  # results land on A, inputs stay on B
        try:
            assert result.meta.nodes == [a]
            torch.testing.assert_close(result["y"], torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
        finally:
            result.clear()
    finally:
        batch.clear()


def test_engine_gathers_a_batch_spread_over_both_workers(
    pair: WorkerGroup, module_client: ShardClient, a: str, b: str
) -> None:
    on_a, on_b = push(a, module_client, 2), push(b, module_client, 3)
    both = DistributedBatchMemory.concat([on_a, on_b])
    try:
        assert sorted(both.meta.nodes) == sorted([a, b])
        assert pair.call_on(b, "total", both) == 1 + 2 + 1 + 2 + 3
    finally:
        both.clear()


def test_factory_receives_the_worker_context(pair: WorkerGroup, module_client: ShardClient) -> None:
    for node, who in zip(pair.nodes, pair.call_all("whoami")):
        assert who["node"] == node
        assert who["thread"].startswith("engine")
        assert module_client.health(node)["engine"] == "EchoEngine"
    for node, count in zip(pair.nodes, pair.call_all("store_shards")):
        assert count == shards_on(module_client, node)


# --------------------------------------------------------------------------- errors


def test_engine_exception_becomes_engine_error(pair: WorkerGroup, module_client: ShardClient, a: str) -> None:
    kept = pair.call_on(a, "make_batch", 2, prefix=unique("kept"))
    try:
        with pytest.raises(EngineError) as info:
            pair.call_on(a, "fail", "boom-123")
        err = info.value
        assert err.node == a
        assert err.exception_type == "ValueError"
        assert "boom-123" in str(err)
        assert "ValueError: boom-123" in err.remote_traceback
        assert "in fail" in err.remote_traceback
        # the worker is still serving, its engine still answers and its data is intact
        assert module_client.health(a)["status"] == "ok"
        assert pair.call_on(a, "echo", 1)["value"] == 1
        torch.testing.assert_close(kept["z"], torch.tensor([0.0, 10.0]))
    finally:
        kept.clear()


def test_the_worker_logs_an_engine_failure_with_its_traceback(pair: WorkerGroup, a: str) -> None:
    """At WARNING, the default level: the caller gets the traceback, and so does the worker's log."""
    marker = unique("logged-boom")
    with pytest.raises(EngineError):
        pair.call_on(a, "fail", marker)
    (process,) = [p for p in pair.processes if p.node == a]
    assert process.log_file is not None
    deadline = time.monotonic() + 30
    while marker not in process.log_file.read_text():
        assert time.monotonic() < deadline, "the engine's failure never reached the worker's log"
        time.sleep(0.05)
    log = process.log_file.read_text()
    assert f"engine call 'fail' raised ValueError: {marker}" in log
    assert f"ValueError: {marker}" in log.split("engine call 'fail' raised", 1)[1]  # the traceback
    assert "in fail" in log


def test_bad_arguments_are_400_and_bad_results_engine_errors(pair: WorkerGroup, a: str) -> None:
    with pytest.raises(RequestError) as bad_call:
        pair.call_on(a, "fail", "x", unexpected=True)  # fail() takes no such keyword
    assert (bad_call.value.status, bad_call.value.code) == (400, "bad_arguments")
    with pytest.raises(EngineError) as info:
        pair.call_on(a, "bad_result")
    assert info.value.exception_type == "TypeError"
    assert "could not be stored or sent" in str(info.value)
    assert pair.call_on(a, "echo", "still")["value"] == "still"


@pytest.mark.parametrize("method", ["nope", "_private", "__init__", "__class__", "__call__", "attribute"])
def test_unknown_private_and_dunder_methods_are_404(pair: WorkerGroup, a: str, method: str) -> None:
    with pytest.raises(RequestError) as info:
        pair.call_on(a, method)
    assert info.value.status == 404
    assert info.value.code == "unknown_method"
    assert info.value.node == a


def test_worker_without_engine_answers_no_engine(
    start_worker: Callable[..., WorkerProcess], module_client: ShardClient
) -> None:
    worker = start_worker()
    with pytest.raises(RequestError) as info:
        module_client.call_raw(worker.node, "whoami", encode_call([], {}))
    assert info.value.status == 404
    assert info.value.code == "no_engine"
    assert module_client.health(worker.node)["engine"] is None


def test_bad_engine_spec_fails_the_spawn() -> None:
    started = time.monotonic()
    with pytest.raises(WorkerUnavailableError, match=r"exited with code [1-9]"):
        WorkerGroup.local(1, "nope:Nope", env=ENV, startup_timeout=60)
    assert time.monotonic() - started < 30


def _post_call(node: str, method: str, data: bytes, content_type: str = "application/json") -> Any:
    return HTTP.post(
        f"http://{node}/v1/call/{method}",
        data=data,
        headers={"Content-Type": content_type, **_auth()},
        timeout=10,
    )


GOOD_META = {"version": 1, "task_ids": ["a"], "nodes": ["127.0.0.1:1"], "fields": {}}

MALFORMED = {
    "not json": b"this is not json",
    "truncated json": b'{"args": [',
    "json list": b"[1, 2]",
    "json string": b'"args"',
    "args not a list": {"args": {"json": 1}},
    "kwargs not an object": {"args": [], "kwargs": [["k", {"json": 1}]]},
    "extra top-level key": {"args": [], "kwargs": {}, "method": "bump"},
    "untagged arg": {"args": [1]},
    "untagged kwarg": {"kwargs": {"key": "x"}},
    "two tags": {"args": [{"json": 1, "batch": None}]},
    "unknown tag": {"args": [{"tensor": [1, 2]}]},
    "empty tag object": {"args": [{}]},
    "batch is a string": {"args": [{"batch": "abc"}]},
    "batch wrong version": {"args": [{"batch": {**GOOD_META, "version": 99}}]},
    "batch missing task_ids": {"args": [{"batch": {k: v for k, v in GOOD_META.items() if k != "task_ids"}}]},
    "batch bad task id": {"args": [{"batch": {**GOOD_META, "task_ids": ["../etc/passwd"]}}]},
    "batch duplicate task ids": {"args": [{"batch": {**GOOD_META, "task_ids": ["a", "a"]}}]},
    "batch bad node": {"args": [{"batch": {**GOOD_META, "nodes": ["not a node"]}}]},
    "batch unknown dtype": {
        "args": [{"batch": {**GOOD_META, "fields": {"x": {"dtype": "F99", "nodes": [0, 1], "shapes": [0]}}}}]
    },
    "batch node runs too long": {
        "args": [{"batch": {**GOOD_META, "fields": {"x": {"dtype": "F32", "nodes": [0, 5], "shapes": [0]}}}}]
    },
    "batch node index out of range": {
        "args": [{"batch": {**GOOD_META, "fields": {"x": {"dtype": "F32", "nodes": [3, 1], "shapes": [0]}}}}]
    },
    "private kwarg name": {"kwargs": {"_key": {"json": "x"}}},
    "dunder kwarg name": {"kwargs": {"__class__": {"json": "x"}}},
    "kwarg name not an identifier": {"kwargs": {"not-a-name": {"json": "x"}}},
    "empty kwarg name": {"kwargs": {"": {"json": "x"}}},
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_call_bodies_are_400(
    pair: WorkerGroup, module_client: ShardClient, a: str, case: str
) -> None:
    body = MALFORMED[case]
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    before = pair.call_on(a, "count_all")
    response = _post_call(a, "bump", data)
    assert response.status_code == 400, response.text
    payload = response.json()
    assert set(payload) >= {"error", "message"} and payload["message"]
    # nothing ran, and the worker keeps serving engine calls and data
    assert pair.call_on(a, "count_all") == before
    assert module_client.health(a)["status"] == "ok"


def test_call_body_with_wrong_content_type_is_refused(pair: WorkerGroup, a: str) -> None:
    key = unique("ctype")
    response = _post_call(a, "bump", encode_call([key], {}), content_type="text/plain")
    assert response.status_code == 415
    assert response.json()["error"] == "unsupported_media_type"
    assert pair.call_on(a, "count", key) == 0


def test_well_formed_raw_call(a: str) -> None:
    response = _post_call(a, "echo", b'{"args": [{"json": [1, 2]}], "kwargs": {"k": {"json": "v"}}}')
    assert response.status_code == 200
    assert response.json() == {"result": {"json": {"node": a, "value": [1, 2], "kwargs": {"k": "v"}}}}
    response = _post_call(a, "whoami", b"{}")  # args and kwargs may be left out
    assert response.status_code == 200 and response.json()["result"]["json"]["node"] == a


# --------------------------------------------------------------------------- engine thread


def test_engine_calls_run_one_at_a_time(module_client: ShardClient, a: str) -> None:
    calls = [(a, "slow", encode_call([0.8], {"label": label})) for label in ("one", "two")]
    started = time.monotonic()
    replies = module_client.call_many(calls)
    elapsed = time.monotonic() - started
    runs = sorted((r["result"]["json"] for r in replies), key=lambda r: r["start"])
    assert {r["label"] for r in runs} == {"one", "two"}
    assert runs[1]["start"] >= runs[0]["end"] - 0.01, runs  # no overlap
    assert elapsed >= 1.5
    assert runs[0]["thread"] == runs[1]["thread"] and runs[0]["thread"].startswith("engine")


def test_data_endpoints_stay_concurrent_with_a_slow_call(
    pair: WorkerGroup, module_client: ShardClient, a: str
) -> None:
    reply: dict[str, Any] = {}

    def run_slow() -> None:
        reply.update(pair.call_on(a, "slow", 2.5, label=unique("bg")))

    thread = threading.Thread(target=run_slow)
    thread.start()
    try:
        time.sleep(0.4)  # let the slow call reach the engine thread
        task = unique("during")
        started = time.monotonic()
        module_client.put(a, {(task, "x"): torch.arange(1000), (task, "meta"): {"k": 1}})
        fetched = module_client.fetch([(a, task, "x"), (a, task, "meta")])
        stats = module_client.stats(a)
        health = module_client.health(a)
        deleted = module_client.delete(a, task_ids=[task])
        finished = time.time()
        elapsed = time.monotonic() - started
        still_running = thread.is_alive()
    finally:
        thread.join(timeout=30)
    assert torch.equal(fetched[0], torch.arange(1000)) and fetched[1] == {"k": 1}
    assert stats["shards"] >= 2 and health["status"] == "ok" and deleted.deleted == 2
    assert elapsed < 1.5, f"data endpoints took {elapsed:.2f}s while the engine was busy"
    assert still_running
    assert reply["end"] > finished  # all of it happened before the engine call ended


# --------------------------------------------------------------------------- failures and retries


def test_engine_error_is_not_retried(pair: WorkerGroup, a: str) -> None:
    key = unique("err")
    with pytest.raises(EngineError):
        pair.call_on(a, "bump", key, fail=True)
    assert pair.call_on(a, "count", key) == 1


def test_dropped_connection_after_sending_is_not_retried(
    pair: WorkerGroup, module_client: ShardClient, a: str
) -> None:
    """The method escapes error reporting (SystemExit): the worker drops the connection mid-call."""
    key = unique("drop")
    with pytest.raises((WorkerUnavailableError, EngineError)):
        pair.call_on(a, "bump_and_drop", key)
    assert pair.call_on(a, "count", key) == 1
    assert module_client.health(a)["status"] == "ok"


def test_timed_out_call_is_not_retried(pair: WorkerGroup, a: str) -> None:
    label = unique("timeout")
    started = time.monotonic()
    with pytest.raises(CallTimeoutError, match="'slow' gave no answer within its deadline of 0.3 s") as info:
        pair.call_on(a, "slow", 1.5, label=label, call_timeout=0.3)
    assert time.monotonic() - started < 1.4
    assert info.value.node == a
    # queued behind the slow call, so it answers once that one finished: it ran exactly once
    assert pair.call_on(a, "count", f"slow:{label}") == 1


@pytest.fixture
def victim() -> Iterator[WorkerGroup]:
    """One worker of its own (PlainEngine: a factory without `context=`), to be killed."""
    group = WorkerGroup.local(1, "engines_for_tests:PlainEngine", env=ENV)
    try:
        yield group
    finally:
        group.shutdown()


def test_worker_killed_mid_call_raises_promptly(victim: WorkerGroup) -> None:
    process = victim.processes[0]
    node = victim.nodes[0]
    assert victim.call_on(0, "pid") == process.pid

    killer = threading.Timer(1.0, process.process.kill)
    killer.start()
    started = time.monotonic()
    try:
        with pytest.raises(WorkerUnavailableError) as info:
            victim.call_on(0, "slow", 60.0)
    finally:
        killer.cancel()
        killer.join()
    elapsed = time.monotonic() - started
    assert info.value.node == node
    assert 0.9 <= elapsed < 10, elapsed
    process.process.wait(timeout=10)
    # later calls fail at once, naming the node
    started = time.monotonic()
    with pytest.raises(WorkerUnavailableError) as info:
        victim.call_on(0, "pid")
    assert info.value.node == node and time.monotonic() - started < 5
