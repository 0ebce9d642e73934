"""What an engine call answers when something is wrong: its arguments, its result, the store, the peer.

Real `python -m rpc_server` workers on loopback host `engines_for_tests:ResultShapesEngine`; the
non-distbatch peer is a `http.server` thread of the test's own.
"""

from __future__ import annotations

import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch
from batch_support import shards_on
from engines_for_tests import ENGINES_ENV

from distbatch import (
    CapacityError,
    DistBatchError,
    DistributedBatchMemory,
    EngineError,
    NodeError,
    ProtocolError,
    RequestError,
    ShardClient,
    WireFormatError,
    WorkerGroup,
)
from distbatch.batch import BatchStatus
from distbatch.ids import validate_node
from distbatch.wire import encode_bundle

ENV = ENGINES_ENV
ENGINE = "engines_for_tests:ResultShapesEngine"
CAPACITY = 10_000


def unique(prefix: str = "t") -> str:
    return f"{prefix}{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def no_retry_client() -> Iterator[ShardClient]:
    """A client that never retries: each failure is seen as the worker answered it."""
    with ShardClient(timeout=30.0, retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def group(no_retry_client: ShardClient) -> Iterator[WorkerGroup]:
    """One worker hosting ResultShapesEngine, its store capped at CAPACITY bytes."""
    workers = WorkerGroup.local(
        1, ENGINE, env=ENV, args=["--max-bytes", str(CAPACITY)], client=no_retry_client
    )
    try:
        yield workers
    finally:
        workers.shutdown()


@pytest.fixture
def node(group: WorkerGroup) -> str:
    return group.nodes[0]


@pytest.fixture
def batch(node: str, no_retry_client: ShardClient) -> Iterator[DistributedBatchMemory]:
    """Two tasks with a float field `x`, stored on the worker; cleared afterwards."""
    local = DistributedBatchMemory.from_dict(
        {"x": torch.tensor([1.0, 2.0])}, task_ids=[unique("a-"), unique("b-")]
    )
    remote = local.to_remote(node, no_retry_client)
    yield remote
    remote.clear()



# --------------------------------------------------------------------------- results that cannot be stored


def test_column_of_the_wrong_length_names_fields_and_task_count(
    group: WorkerGroup, no_retry_client: ShardClient, node: str, batch: DistributedBatchMemory
) -> None:
    before = shards_on(no_retry_client, node)
    with pytest.raises(EngineError) as info:
        group.call_on(node, "too_long", batch)
    message = str(info.value)
    assert "field 'y' has 3 entries" in message, message
    assert "the input batch has 2 tasks" in message, message
    assert "'tag'" not in message  # only the fields that are wrong
    assert "use a torch.Tensor" not in message
    assert info.value.exception_type == "ValueError"
    assert shards_on(no_retry_client, node) == before  # nothing of the result was stored


def test_bare_tensor_result_says_what_to_return_instead(
    group: WorkerGroup, node: str, batch: DistributedBatchMemory
) -> None:
    for args in ([batch], []):
        with pytest.raises(EngineError) as info:
            group.call_on(node, "bare_tensor", *args)
        message = str(info.value)
        assert "bare Tensor" in message, message
        assert "dict of per-task columns" in message and "LOCAL batch" in message and "JSON" in message
        assert "use a torch.Tensor" not in message
        assert info.value.exception_type == "TypeError"


def test_columns_from_a_method_without_batch_argument_say_why(group: WorkerGroup, node: str) -> None:
    with pytest.raises(EngineError) as info:
        group.call_on(node, "columns_without_batch")
    message = str(info.value)
    assert "result['y'] is a Tensor" in message, message
    assert "no batch argument" in message
    assert "LOCAL batch" in message and "task_ids" in message
    assert "use a torch.Tensor" not in message


def test_tensor_inside_a_json_result_is_named_by_its_path(group: WorkerGroup, node: str) -> None:
    with pytest.raises(EngineError) as info:
        group.call_on(node, "tensor_in_json")
    message = str(info.value)
    assert "result['metrics']['loss'] is a Tensor" in message, message
    assert ".item()" in message and ".tolist()" in message
    assert "use a torch.Tensor" not in message


def test_json_lists_of_another_length_still_come_back_as_json(
    group: WorkerGroup, node: str, batch: DistributedBatchMemory
) -> None:
    assert group.call_on(node, "metrics_lists", batch) == {"losses": [0.5, 0.5, 0.5]}


def test_zero_task_chunk_flows_through_as_an_empty_batch(
    no_retry_client: ShardClient, node: str, batch: DistributedBatchMemory
) -> None:
    """More ranks than tasks: the empty chunk's call returns empty columns, i.e. an EMPTY batch."""
    chunks = batch.chunk_balanced(3)
    assert [len(c) for c in chunks] == [1, 1, 0] and chunks[2].status is BatchStatus.EMPTY
    ranks = WorkerGroup.connect([node] * 3, client=no_retry_client)  # three ranks, one worker process
    results = ranks.call("columns", chunks)
    try:
        assert [r.status for r in results] == [BatchStatus.REMOTE, BatchStatus.REMOTE, BatchStatus.EMPTY]
        merged = DistributedBatchMemory.concat(results)
        assert merged.task_ids == [t for c in chunks for t in c.task_ids]
        torch.testing.assert_close(merged["y"], torch.tensor([2.0, 4.0]))
        assert merged["tag"] == [f"tag-{t}" for t in merged.task_ids]
    finally:
        for r in results:
            r.clear()


UNSTORABLE = {
    "sparse_coo": "sparse_coo",
    "sparse_csr": "sparse_csr",
    "nested_complex32": "complex32",
    "meta": "meta device",
    "quantized": "qint8",
    "ragged_sparse": "sparse_coo",
}


@pytest.mark.parametrize("as_batch", [False, True], ids=["columns", "local_batch"])
@pytest.mark.parametrize("kind", sorted(UNSTORABLE))
def test_unstorable_tensor_is_refused_naming_its_field(
    group: WorkerGroup,
    no_retry_client: ShardClient,
    node: str,
    batch: DistributedBatchMemory,
    kind: str,
    as_batch: bool,
) -> None:
    before = shards_on(no_retry_client, node)
    with pytest.raises(EngineError) as info:
        group.call_on(node, "unstorable", batch, kind, as_batch=as_batch)
    message = str(info.value)
    assert "'bad'" in message, message
    assert UNSTORABLE[kind] in message, message
    assert shards_on(no_retry_client, node) == before
    assert group.call_on(node, "two", 1) == 2  # the worker and its engine carry on


@pytest.mark.parametrize("kind", ["sparse", "meta", "quantized"])
def test_unstorable_tensor_is_refused_client_side_naming_its_field(kind: str, node: str) -> None:
    dense = torch.ones(2, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated
        bad = {
            "sparse": dense.to_sparse(),
            "meta": torch.empty(2, 3, device="meta"),
            "quantized": torch.quantize_per_tensor(dense, 0.1, 0, torch.qint8),
        }[kind]
    local = DistributedBatchMemory.from_dict({"bad": bad}, task_ids=["t0", "t1"])
    with pytest.raises(WireFormatError, match="field 'bad'"):
        local.to_remote(node)
    with pytest.raises(WireFormatError, match="task 't0', field 'bad'"):
        encode_bundle({("t0", "bad"): bad[0] if kind != "sparse" else bad})


def test_tensor_inside_a_json_shard_is_named(node: str) -> None:
    with pytest.raises(WireFormatError) as info:
        encode_bundle({("t0", "info"): {"scores": [1, torch.tensor(2.0)]}})
    message = str(info.value)
    assert "task 't0', field 'info', at ['scores'][1]" in message, message
    assert ".tolist()" in message and "use a torch.Tensor" not in message


# --------------------------------------------------------------------------- statuses


def test_wrong_arguments_are_400_naming_the_signature(
    group: WorkerGroup, no_retry_client: ShardClient, node: str
) -> None:
    before = group.call_on(node, "count")
    for args, kwargs in [((), {}), ((1, 2, 3), {}), ((1,), {"c": 3}), ((1,), {"a": 2})]:
        with pytest.raises(RequestError) as info:
            group.call_on(node, "two", *args, **kwargs)
        err = info.value
        assert (err.status, err.code, err.node) == (400, "bad_arguments", node)
        assert "two(a, b=1)" in str(err), str(err)
    assert group.call_on(node, "count") == before  # the method never ran


def test_bad_call_is_answered_without_waiting_for_a_running_one(group: WorkerGroup, node: str) -> None:
    slow = threading.Thread(target=group.call_on, args=(node, "slow", 3.0))
    slow.start()
    try:
        time.sleep(0.5)  # the slow call holds the engine thread
        started = time.monotonic()
        with pytest.raises(RequestError):
            group.call_on(node, "two")
        assert time.monotonic() - started < 2.0
    finally:
        slow.join(timeout=30)


def test_type_error_inside_the_engine_stays_an_engine_error(group: WorkerGroup, node: str) -> None:
    with pytest.raises(EngineError) as info:
        group.call_on(node, "type_error_inside", 1)
    assert info.value.exception_type == "TypeError"
    assert "in type_error_inside" in info.value.remote_traceback


def test_result_over_capacity_is_507_naming_the_bytes(
    group: WorkerGroup, no_retry_client: ShardClient, node: str, batch: DistributedBatchMemory
) -> None:
    before = shards_on(no_retry_client, node)
    with pytest.raises(CapacityError) as info:
        group.call_on(node, "big", batch, 2000)  # 2 x 2000 float32: 16000 bytes
    message = str(info.value)
    assert info.value.node == node
    assert "16000 bytes" in message and f"of {CAPACITY} bytes" in message, message
    assert "'big'" in message
    assert shards_on(no_retry_client, node) == before
    result = group.call_on(node, "big", batch, 10)  # a result that fits is still stored
    try:
        assert result.status is BatchStatus.REMOTE and result["y"].shape == (2, 10)
    finally:
        result.clear()


@pytest.mark.parametrize("address", ["127.0.0.1:0", "127.0.0.1:65536", "127.0.0.1:99999", "[::1]:70000"])
def test_node_with_a_port_out_of_range_is_refused(address: str, no_retry_client: ShardClient) -> None:
    with pytest.raises(ValueError, match="port") as info:
        validate_node(address)
    assert address in str(info.value)
    with pytest.raises(ValueError, match="port"):
        no_retry_client.health(address)  # never reaches aiohttp (whose InvalidURL would say less)


@pytest.mark.parametrize("address", ["127.0.0.1:1", "localhost:65535", "http://[::1]:8088"])
def test_node_with_a_port_in_range_is_accepted(address: str) -> None:
    assert validate_node(address) == address.removeprefix("http://")


class _HtmlHandler(BaseHTTPRequestHandler):
    """Answers every request 200 with an HTML page, as a server that is not a distbatch worker might."""

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.server.hits += 1  # type: ignore[attr-defined]
        body = b"<html><body>hello</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, format: str, *args: Any) -> None:  # keep pytest output clean
        pass


@pytest.fixture
def html_server() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _HtmlHandler)
    server.hits = 0  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    thread.join(timeout=10)
    server.server_close()


def test_non_json_success_reply_is_a_protocol_error(html_server: ThreadingHTTPServer) -> None:
    address = f"127.0.0.1:{html_server.server_port}"
    with ShardClient(timeout=10.0, retries=3, backoff=0.01) as c:
        with pytest.raises(ProtocolError) as info:
            c.health(address)
        err = info.value
        assert isinstance(err, NodeError) and isinstance(err, DistBatchError)
        assert err.node == address
        assert "not JSON" in str(err) and "text/html" in str(err), str(err)
        assert html_server.hits == 1  # a wrong peer is not retried
        with pytest.raises(ProtocolError):
            c.stats(address)
