"""The controller's delivery and its errors, against real workers and the real served controller.

- A lost `get_meta` reply (a TCP proxy on loopback closes the client's side instead of passing the
  reply on) or a failed fetch never loses tasks: the retry, with the same request id, gets the
  same tasks; a finite run delivers every task.
- Mistakes fail at once and clearly: unknown partitions and fields, batch sizes that do not split
  into whole groups, a batch index asked again with another size, a partial GRPO group.
- Over HTTP, exactly the validated errors are 4xx and come back as the local type; a bug is a 500.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import requests
import torch

from distbatch import ShardClient
from distbatch.batch import BatchStatus, DistributedBatchMemory
from distbatch.controller import Controller, SchemaConflictError
from distbatch.controller.remote import RemoteController
from distbatch.controller.server import ControllerServer
from distbatch.dataloader import StreamingDataset, fetch_batch
from distbatch.errors import (
    BatchStatusError,
    InvalidArgumentError,
    InvalidIdError,
    ServerError,
    UnknownFieldError,
    UnknownPartitionError,
)
from distbatch.launch import WorkerProcess
from distbatch.samplers import (
    GRPOGroupNSampler,
    RankAwareSampler,
    SeqlenBalancedSampler,
    SequentialSampler,
)

HTTP = requests.Session()
HTTP.trust_env = False


def prefix() -> str:
    return uuid.uuid4().hex[:8]


def remote(
    node: str, task_ids: Sequence[str], client: ShardClient | None = None, **columns: Any
) -> DistributedBatchMemory:
    return DistributedBatchMemory.from_dict(columns, task_ids=list(task_ids)).to_remote(node, client)


# --------------------------------------------------------------------------- a reply-dropping proxy


class DropReplyProxy:
    """A TCP proxy on loopback in front of one server.

    It passes bytes both ways, except: once armed for a request path, it forwards the next such
    request but, when the reply starts to come back, closes the client's connection (and the
    server's) instead of passing the reply on. The server has done the work; the client never
    hears of it.
    """

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._path = b""
        self._drops_left = 0
        self._every = 0
        self._seen = 0
        self.dropped = 0
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._spawn(self._accept)

    def drop(self, path: str, *, times: int = 1, every: int = 1) -> None:
        """Drop the reply to every `every`-th request for `path`, `times` times in all."""
        with self._lock:
            self._path = f"POST {path} ".encode()
            self._drops_left = times
            self._every = every
            self._seen = 0

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(self._upstream, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._closed:
                    client.close()
                    upstream.close()
                    return
                self._sockets += [client, upstream]
            doomed = threading.Event()  # set: the reply to the request in flight is to be dropped
            self._spawn(self._requests, client, upstream, doomed)
            self._spawn(self._replies, upstream, client, doomed)

    def _requests(self, client: socket.socket, upstream: socket.socket, doomed: threading.Event) -> None:
        try:
            while chunk := client.recv(1 << 16):
                with self._lock:
                    if self._drops_left and chunk.startswith(self._path):
                        self._seen += 1
                        if self._seen % self._every == 0:
                            self._drops_left -= 1
                            doomed.set()
                upstream.sendall(chunk)
        except OSError:
            pass
        _close(client, upstream)

    def _replies(self, upstream: socket.socket, client: socket.socket, doomed: threading.Event) -> None:
        try:
            while chunk := upstream.recv(1 << 16):
                if doomed.is_set():
                    with self._lock:
                        self.dropped += 1
                    break  # the work is done upstream; the client never gets the answer
                client.sendall(chunk)
        except OSError:
            pass
        _close(client, upstream)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets = list(self._sockets)
        self._listener.close()
        for s in sockets:
            _close(s)
        for thread in self._threads:
            thread.join(timeout=5)


def _close(*sockets: socket.socket) -> None:
    for s in sockets:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()


@pytest.fixture
def proxy_to() -> Iterator[Callable[[str], DropReplyProxy]]:
    """Factory: a reply-dropping proxy in front of an address; all closed at teardown."""
    proxies: list[DropReplyProxy] = []

    def start(upstream: str) -> DropReplyProxy:
        proxy = DropReplyProxy(upstream)
        proxies.append(proxy)
        return proxy

    yield start
    for proxy in proxies:
        proxy.close()


def put_numbered(
    ctl: Any, partition_id: str, node: str, count: int, client: ShardClient | None = None, per_put: int = 4
) -> list[str]:
    """Put `count` tasks (x = their number) in puts of `per_put`; returns their ids in order."""
    pre = prefix()
    ids = [f"{pre}-{i}" for i in range(count)]
    for start in range(0, count, per_put):
        chunk = ids[start : start + per_put]
        ctl.put(partition_id, remote(node, chunk, client, x=torch.arange(start, start + len(chunk))[:, None]))
    return ids


def check_data(batch: DistributedBatchMemory, ids: list[str]) -> list[str]:
    """The batch's task ids, after checking each row's x is its task's number."""
    for task_id, x in zip(batch.task_ids, batch["x"]):
        assert int(x[0]) == ids.index(task_id)
    return batch.task_ids


# --------------------------------------------------------------------------- 4: lost replies


def test_retried_get_meta_after_a_lost_reply_gets_the_same_tasks(
    shared_workers: list[WorkerProcess],
    serve: Callable[..., ControllerServer],
    proxy_to: Callable[[str], DropReplyProxy],
    client: ShardClient,
) -> None:
    node = shared_workers[0].node
    server = serve(Controller(SequentialSampler()))  # no per-rank cache: only the request id helps
    proxy = proxy_to(server.address)
    rc = RemoteController(proxy.address, client=client, timeout=20)
    direct = RemoteController(server.address, client=client, timeout=20)
    ids = put_numbered(direct, "p", node, 6, client)

    proxy.drop("/v1/controller/get_meta")
    got = rc.get_meta("p", "train", ["x"], 2)
    assert proxy.dropped == 1  # the first answer really was lost after the controller gave it
    assert check_data(got, ids) == ids[:2]  # the retry got the very tasks the lost answer held
    assert direct.consumption_status("p", "train") == {"tasks": 6, "consumed": 2}  # not 4
    assert rc.get_meta("p", "train", ["x"], 2).task_ids == ids[2:4]

    # A long poll whose reply is lost: the retry is answered from memory, at once.
    proxy.drop("/v1/controller/get_meta")
    start = time.monotonic()
    assert rc.get_meta("p", "train", ["x"], 2, timeout=30).task_ids == ids[4:]
    assert proxy.dropped == 2 and time.monotonic() - start < 10
    assert direct.all_consumed("p", "train")


def test_request_ids_are_answered_from_memory_and_bounded(shared_workers: list[WorkerProcess]) -> None:
    node = shared_workers[0].node
    ctl = Controller(request_memory=2)
    ids = put_numbered(ctl, "p", node, 8)
    first = ctl.get_meta("p", "train", ["x"], 2, request_id="r1")
    assert ctl.get_meta("p", "train", ["x"], 2, request_id="r1").task_ids == first.task_ids == ids[:2]
    assert ctl.consumption_status("p", "train")["consumed"] == 2
    with pytest.raises(InvalidArgumentError, match="already used"):  # same id, another request
        ctl.get_meta("p", "train", ["x"], 3, request_id="r1")
    with pytest.raises(InvalidIdError):
        ctl.get_meta("p", "train", ["x"], 2, request_id="bad id")
    ctl.get_meta("p", "train", ["x"], 2, request_id="r2")
    ctl.get_meta("p", "train", ["x"], 2, request_id="r3")  # r1 is the oldest of three: forgotten
    assert ctl.get_meta("p", "train", ["x"], 2, request_id="r1").task_ids == ids[6:]
    assert ctl.all_consumed("p", "train")

    # Cleared tasks are not answered from memory (their shards are gone).
    ctl.reset_consumption("p")
    again = ctl.get_meta("p", "train", ["x"], 2, request_id="r9")
    ctl.clear_tasks("p", again.task_ids)
    assert ctl.get_meta("p", "train", ["x"], 2, request_id="r9").task_ids == ids[2:4]

    # And remembered answers age out.
    quick = Controller(request_ttl=0.2)
    more = put_numbered(quick, "p", node, 4)
    assert quick.get_meta("p", "train", ["x"], 2, request_id="a").task_ids == more[:2]
    time.sleep(0.3)
    assert quick.get_meta("p", "train", ["x"], 2, request_id="a").task_ids == more[2:]
    for bad in ({"request_memory": -1}, {"request_ttl": float("nan")}, {"request_ttl": "1"}):
        with pytest.raises(InvalidArgumentError):
            Controller(**bad)


def test_finite_run_through_lossy_replies_delivers_every_task(
    shared_workers: list[WorkerProcess],
    serve: Callable[..., ControllerServer],
    proxy_to: Callable[[str], DropReplyProxy],
    client: ShardClient,
) -> None:
    """Every third get_meta reply is lost on the way; a finite pass still gets all 24 tasks, once."""
    nodes = [w.node for w in shared_workers]
    server = serve(Controller(SequentialSampler()))
    proxy = proxy_to(server.address)
    direct = RemoteController(server.address, client=client, timeout=20)
    pre = prefix()
    ids = [f"{pre}-{i}" for i in range(24)]
    for k in range(6):
        chunk = ids[4 * k : 4 * k + 4]
        direct.put("p", remote(nodes[k % 3], chunk, client, x=torch.arange(4 * k, 4 * k + 4)[:, None]))

    proxy.drop("/v1/controller/get_meta", times=1000, every=3)
    ds = StreamingDataset(
        RemoteController(proxy.address, client=client, timeout=20),
        "p",
        "train",
        ["x"],
        batch_size=2,
        should_check_consumption_status=True,
        poll_interval=0.01,
        max_empty_polls=20,
    )
    delivered = [t for batch in ds for t in check_data(batch, ids)]
    assert proxy.dropped >= 4
    assert Counter(delivered) == Counter(ids)  # none lost, none twice
    assert direct.all_consumed("p", "train")


def test_a_lost_data_reply_is_fetched_again_with_the_same_tasks(
    shared_workers: list[WorkerProcess], proxy_to: Callable[[str], DropReplyProxy]
) -> None:
    """The default fetch: get_meta succeeds, gathering the data fails (the worker's reply is lost
    and the client does not retry); the dataset asks again with the same request id."""
    worker = proxy_to(shared_workers[0].node)  # the data's node is the proxy
    with ShardClient(timeout=20, retries=0) as no_retries:
        ctl = Controller(SequentialSampler(), client=no_retries)
        ids = put_numbered(ctl, "p", worker.address, 8, no_retries)
        worker.drop("/v1/shards/fetch", times=2)
        ds = StreamingDataset(
            ctl, "p", "train", ["x"], batch_size=4, should_check_consumption_status=True, poll_interval=0.01
        )
        delivered = [check_data(batch, ids) for batch in ds]
        assert worker.dropped == 2
        assert delivered == [ids[:4], ids[4:]]  # the first batch's tasks, not the next ones
        ctl.clear_partition("p")


def test_a_failing_fetch_function_still_yields_its_tasks(shared_workers: list[WorkerProcess]) -> None:
    node = shared_workers[0].node
    ctl = Controller(SequentialSampler())
    ids = put_numbered(ctl, "p", node, 6)
    calls: list[tuple[int, str, list[str]]] = []
    failures = {"left": 1}

    def flaky(controller: Any, *args: Any, request_id: str, batch_index: int, **kwargs: Any) -> Any:
        batch = controller.get_meta(*args, request_id=request_id, batch_index=batch_index, **kwargs)
        calls.append((batch_index, request_id, batch.task_ids))
        if failures["left"] and batch.status is not BatchStatus.EMPTY:
            failures["left"] -= 1
            raise ConnectionError("the data could not be gathered")  # after the tasks were handed out
        return batch

    ds = StreamingDataset(
        ctl, "p", "train", ["x"], batch_size=2, fetch_batch_fn=flaky,
        should_check_consumption_status=True, poll_interval=0.01,
    )  # fmt: skip
    delivered = [t for batch in ds for t in check_data(batch, ids)]
    assert delivered == ids  # the first batch's tasks were not skipped
    assert calls[0] == (0, calls[1][1], ids[:2]) == calls[1]  # same index, same id, same tasks

    # A fetch that keeps failing past fetch_retries raises; iterating again gets the same tasks.
    more = put_numbered(ctl, "q", node, 4)
    failures["left"] = 3
    calls.clear()
    ds = StreamingDataset(
        ctl, "q", "train", ["x"], batch_size=2, fetch_batch_fn=flaky, fetch_retries=1,
        should_check_consumption_status=True, poll_interval=0.01,
    )  # fmt: skip
    with pytest.raises(ConnectionError):
        list(ds)
    assert len(calls) == 2 and ctl.consumption_status("q", "train")["consumed"] == 2
    assert not ctl.all_consumed("q", "train")
    assert [t for batch in ds for t in check_data(batch, more)] == more
    assert {c[1] for c in calls[:3]} == {calls[0][1]}  # the failed batch kept its request id
    with pytest.raises(ValueError):
        StreamingDataset(ctl, "q", "train", ["x"], 2, fetch_retries=-1)
    with pytest.raises(ValueError):
        StreamingDataset(ctl, "q", "train", ["x"], 2, sampling_config={"request_id": "x"})


# --------------------------------------------------------------------------- 6: mistakes


def test_unknown_partitions_and_fields_fail_at_once(
    shared_workers: list[WorkerProcess], serve: Callable[..., ControllerServer], client: ShardClient
) -> None:
    node = shared_workers[0].node
    ctl = Controller()
    rc = RemoteController(serve(ctl).address, client=client, timeout=20)
    put_numbered(ctl, "p", node, 4)
    for api in (ctl, rc):
        with pytest.raises(UnknownPartitionError, match="'p'") as info:
            api.get_meta("q", "train", ["x"], 1)
        assert info.value.partition_id == "q" and info.value.known == ["p"]
        start = time.monotonic()
        with pytest.raises(UnknownFieldError, match="'input_id'") as field_info:
            api.get_meta("p", "train", ["input_id"], 1, timeout=30)  # waiting cannot help: at once
        assert time.monotonic() - start < 5
        assert field_info.value.fields == ["input_id"] and field_info.value.known == ["x"]
        # Waiting for a partition is allowed (a consumer may start first); EMPTY at the timeout.
        assert api.get_meta("later", "train", ["x"], 1, timeout=0.2).status is BatchStatus.EMPTY
        # Status queries report zero for an unknown partition rather than raising.
        assert api.consumption_status("q", "train") == {"tasks": 0, "consumed": 0}
        assert not api.all_consumed("q", "train")


def test_declared_fields_can_be_waited_for(
    shared_workers: list[WorkerProcess], serve: Callable[..., ControllerServer], client: ShardClient
) -> None:
    node = shared_workers[0].node
    ctl = Controller()
    rc = RemoteController(serve(ctl).address, client=client, timeout=20)
    rc.create_partition("p", expected_fields=["prompt", "response"])
    assert ctl.partitions() == ["p"]
    assert rc.get_meta("p", "train", ["prompt", "response"], 2).status is BatchStatus.EMPTY
    with pytest.raises(UnknownFieldError, match="'reward'"):
        rc.get_meta("p", "train", ["reward"], 2)
    assert ctl.production_status("p") == {"tasks": 0, "produced": {"prompt": 0, "response": 0}, "ready": 0}

    ids = [f"{prefix()}-{i}" for i in range(2)]
    ctl.put("p", remote(node, ids, client, prompt=torch.zeros(2, 1)))
    producer = threading.Timer(
        0.3, lambda: ctl.put("p", remote(node, ids, client, response=torch.ones(2, 1)))
    )
    producer.start()
    try:
        got = rc.get_meta("p", "train", ["prompt", "response"], 2, timeout=20)
    finally:
        producer.join()
    assert got.task_ids == ids and got["response"].sum().item() == 2

    # Declared fields are part of a checkpoint; create_partition is idempotent and adds up.
    ctl.create_partition("p", ["reward"])
    restored = Controller()
    restored.load_state_dict(ctl.state_dict())
    assert restored.state_dict() == ctl.state_dict()
    assert restored.get_meta("p", "critic", ["reward"], 1).status is BatchStatus.EMPTY
    for bad in ("prompt", 5, ["bad id"], {"a": 1}):
        with pytest.raises(ValueError):
            ctl.create_partition("p", bad)
        with pytest.raises(ValueError):
            rc.create_partition("p", bad)
    assert ctl.state_dict() == restored.state_dict()
    ctl.clear_partition("p")


def test_finite_dataset_with_a_typo_raises_instead_of_iterating_forever(
    shared_workers: list[WorkerProcess],
) -> None:
    ctl = Controller()
    ids = put_numbered(ctl, "p", shared_workers[0].node, 4)

    def finite(partition_id: str, field: str, *, streaming: bool = False) -> StreamingDataset:
        return StreamingDataset(
            ctl, partition_id, "train", [field], batch_size=2, poll_interval=0.01, max_empty_polls=50,
            should_check_consumption_status=not streaming,
        )  # fmt: skip

    with pytest.raises(UnknownFieldError):
        list(finite("p", "input_id"))
    with pytest.raises(UnknownFieldError):
        list(finite("p", "input_id", streaming=True))
    with pytest.raises(UnknownPartitionError):
        list(finite("P", "x"))
    # Streaming: an unknown partition is a producer that has not started yet.
    producer = threading.Timer(0.2, lambda: put_numbered(ctl, "late", shared_workers[1].node, 2))
    producer.start()
    try:
        batches = list(finite("late", "x", streaming=True))
    finally:
        producer.join()
    assert sum(len(b) for b in batches) == 2
    assert [t for b in finite("p", "x") for t in b.task_ids] == ids


def test_batch_sizes_that_do_not_split_into_whole_groups_are_refused(
    shared_workers: list[WorkerProcess], serve: Callable[..., ControllerServer], client: ShardClient
) -> None:
    node = shared_workers[0].node
    n, dp = 4, 2
    ctl = Controller(SeqlenBalancedSampler(n, dp))
    rc = RemoteController(serve(ctl).address, client=client, timeout=20)
    pre = prefix()
    ids = [f"{pre}-{i}" for i in range(16)]
    ctl.put("p", remote(node, ids, client, input_ids=[torch.arange(1 + i % 5) for i in range(16)]))
    for api in (ctl, rc):
        # 6 per rank would serve 8 and 4 tasks
        with pytest.raises(InvalidArgumentError, match=r"must be a multiple of n_samples_per_prompt \(4\)"):
            api.get_meta("p", "train", ["input_ids"], 6, dp_rank=0, batch_index=0)
    assert ctl.consumption_status("p", "train")["consumed"] == 0
    first = rc.get_meta("p", "train", ["input_ids"], 4, dp_rank=0, batch_index=0)
    assert len(first) == 4
    # The same (dp_rank, batch_index) again with another batch size: refused, not the first answer.
    for api in (ctl, rc):
        with pytest.raises(InvalidArgumentError, match="batch_size 4"):
            api.get_meta("p", "train", ["input_ids"], 8, dp_rank=0, batch_index=0)
        with pytest.raises(InvalidArgumentError, match="batch_size 4"):
            api.get_meta("p", "train", ["input_ids"], 8, dp_rank=1, batch_index=0)
    assert rc.get_meta("p", "train", ["input_ids"], 4, dp_rank=0, batch_index=0).task_ids == first.task_ids

    rank_aware = Controller(RankAwareSampler())
    put_numbered(rank_aware, "p", node, 8)
    rank_aware.get_meta("p", "train", ["x"], 2, dp_rank=0, batch_index=0)
    with pytest.raises(InvalidArgumentError, match="asked again with 3"):
        rank_aware.get_meta("p", "train", ["x"], 3, dp_rank=0, batch_index=0)
    assert rank_aware.consumption_status("p", "train")["consumed"] == 2
    ctl.clear_partition("p")


@pytest.mark.parametrize(
    "sampler",
    [GRPOGroupNSampler(4), RankAwareSampler(GRPOGroupNSampler(4)), SeqlenBalancedSampler(4, 2)],
    ids=["grpo", "rank-aware-grpo", "seqlen"],
)
def test_a_partial_grpo_group_put_is_refused(shared_workers: list[WorkerProcess], sampler: Any) -> None:
    node = shared_workers[0].node
    ctl = Controller(sampler)
    pre = prefix()
    whole = [f"{pre}-a{i}" for i in range(8)]
    assert ctl.put("p", remote(node, whole, input_ids=torch.zeros(8, 2, dtype=torch.int64))) == 8
    before = ctl.state_dict()
    for count in (1, 3, 6):
        partial = [f"{pre}-b{i}" for i in range(count)]
        with pytest.raises(InvalidArgumentError, match="whole groups"):
            ctl.put("p", remote(node, partial, input_ids=torch.zeros(count, 2, dtype=torch.int64)))
        assert ctl.state_dict() == before  # nothing registered, no index taken
    # A later field for tasks already there adds no task: fine.
    assert ctl.put("p", remote(node, whole[:3], extra=torch.ones(3, 1))) == 0
    # Without a group sampler any count is fine.
    assert Controller().put("p", remote(node, [f"{pre}-c0"], input_ids=torch.zeros(1, 2))) == 1


# --------------------------------------------------------------------------- 13: 4xx vs 500


class BuggySampler(SequentialSampler):
    """A custom sampler with a bug inside its logic: a plain exception, not a validated one."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__()
        self.exc = exc

    def sample(self, ready_indexes: Sequence[int], batch_size: int, *a: Any, **k: Any) -> Any:
        raise self.exc


@pytest.mark.parametrize(
    "bug", [ValueError("math domain error"), KeyError("oops"), TypeError("unsupported operand")]
)
def test_a_bug_is_a_500_not_a_bad_request(
    shared_workers: list[WorkerProcess],
    serve: Callable[..., ControllerServer],
    client: ShardClient,
    caplog: pytest.LogCaptureFixture,
    bug: BaseException,
) -> None:
    ctl = Controller(BuggySampler(bug))
    server = serve(ctl)
    put_numbered(ctl, "p", shared_workers[0].node, 2)
    body = {"partition_id": "p", "task_name": "train", "fields": ["x"], "batch_size": 1}
    with caplog.at_level(logging.ERROR, logger="distbatch.controller"):
        raw = HTTP.post(f"http://{server.address}/v1/controller/get_meta", json=body, timeout=10)
    assert raw.status_code == 500, raw.text
    assert raw.json()["error"] == "internal_error" and type(bug).__name__ in raw.json()["message"]
    assert any("unhandled error" in r.getMessage() for r in caplog.records)  # logged

    rc = RemoteController(server.address, client=client, timeout=20)
    start = time.monotonic()
    with pytest.raises(ServerError) as info:
        rc.get_meta("p", "train", ["x"], 1)
    assert info.value.status == 500 and info.value.code == "internal_error"
    assert not isinstance(info.value, (ValueError, KeyError, TypeError))  # not "your input was bad"
    assert time.monotonic() - start < 10
    assert ctl.consumption_status("p", "train")["consumed"] == 0


def test_validated_errors_are_4xx_and_the_same_type_remotely(
    shared_workers: list[WorkerProcess], serve: Callable[..., ControllerServer], client: ShardClient
) -> None:
    node = shared_workers[0].node
    local = Controller(RankAwareSampler(GRPOGroupNSampler(2)))
    served = Controller(RankAwareSampler(GRPOGroupNSampler(2)))
    rc = RemoteController(serve(served).address, client=client, timeout=20)
    pre = prefix()
    ids = [f"{pre}-{i}" for i in range(4)]
    for api in (local, rc):
        api.put("p", remote(node, ids, client, x=torch.zeros(4, 1, dtype=torch.int64)))
        api.get_meta("p", "train", ["x"], 2, dp_rank=0, batch_index=0, request_id="once")

    calls: list[tuple[type[BaseException], Callable[[Any], Any]]] = [
        (UnknownPartitionError, lambda api: api.get_meta("q", "train", ["x"], 2, dp_rank=0, batch_index=1)),
        (UnknownFieldError, lambda api: api.get_meta("p", "train", ["y"], 2, dp_rank=0, batch_index=1)),
        (InvalidIdError, lambda api: api.get_meta("p", "bad name", ["x"], 2, dp_rank=0, batch_index=1)),
        (InvalidArgumentError, lambda api: api.get_meta("p", "train", ["x"], 0, dp_rank=0, batch_index=1)),
        (InvalidArgumentError, lambda api: api.get_meta("p", "train", ["x"], 3, dp_rank=0, batch_index=1)),
        (InvalidArgumentError, lambda api: api.get_meta("p", "train", ["x"], 2)),  # no dp_rank
        (InvalidArgumentError, lambda api: api.get_meta("p", "train", ["x"], 4, dp_rank=0, batch_index=0)),
        (
            InvalidArgumentError,
            lambda api: api.get_meta("p", "train", ["x"], 4, dp_rank=0, batch_index=2, request_id="once"),
        ),
        (SchemaConflictError, lambda api: api.put("p", remote(node, ids, client, x=torch.zeros(4, 1)))),
        (
            InvalidArgumentError,
            lambda api: api.put(
                "p", remote(node, [f"{pre}-odd"], client, x=torch.ones(1, 1, dtype=torch.int64))
            ),
        ),
        (BatchStatusError, lambda api: api.put("p", DistributedBatchMemory.from_dict({"x": [1]}))),
        (InvalidArgumentError, lambda api: api.load_state_dict({"version": 1, "partitions": []})),
        (InvalidArgumentError, lambda api: api.load_state_dict({**api.state_dict(), "sampler": 5})),
        (InvalidIdError, lambda api: api.clear_tasks("p", ["bad id"])),
        (InvalidIdError, lambda api: api.production_status("p", ["bad field"])),
    ]
    before = served.state_dict()
    for i, (expected, call) in enumerate(calls):
        with pytest.raises(expected) as local_info:
            call(local)
        with pytest.raises(expected) as remote_info:
            call(rc)
        assert type(remote_info.value) is type(local_info.value), (i, remote_info.value)
        assert served.state_dict() == before, i
    # The raw answers: 4xx with a code per type (none is a 500).
    base = f"http://{rc.address}/v1/controller"
    for body, status, code in [
        ({"partition_id": "q", "task_name": "t", "fields": ["x"], "batch_size": 2}, 404, "unknown_partition"),
        ({"partition_id": "p", "task_name": "t", "fields": ["y"], "batch_size": 2}, 404, "unknown_field"),
        ({"partition_id": "p", "task_name": "t", "fields": ["x"], "batch_size": 2}, 400, "bad_request"),
        ({"partition_id": "p", "task_name": "t", "fields": ["x"], "batch_size": 2, "request_id": "a b"}, 400,
         "invalid_id"),
        ({"partition_id": "p", "task_name": "t", "fields": ["x"], "batch_size": 2,
          "sampling_config": {"request_id": "x"}}, 400, "bad_request"),
    ]:  # fmt: skip
        raw = HTTP.post(f"{base}/get_meta", json=body, timeout=10)
        assert (raw.status_code, raw.json()["error"]) == (status, code), raw.text


def test_fetch_batch_passes_the_request_id_on(shared_workers: list[WorkerProcess]) -> None:
    ctl = Controller()
    ids = put_numbered(ctl, "p", shared_workers[0].node, 4)
    a = fetch_batch(ctl, "p", "train", ["x"], 2, dp_rank=0, batch_index=0, request_id="same")
    b = fetch_batch(ctl, "p", "train", ["x"], 2, dp_rank=0, batch_index=0, request_id="same")
    assert a.task_ids == b.task_ids == ids[:2] and a.status is BatchStatus.LOCAL
