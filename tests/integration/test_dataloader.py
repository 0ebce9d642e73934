"""StreamingDataset / StreamingDataLoader against real workers and a real (local or served) Controller.

Every task carries its number twice: in its task id (``<prefix>-<n>``) and in
the data (``num`` tensor, ``tag`` JSON string = the task id), so a micro-batch
whose data and task ids drifted apart is caught.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from types import MappingProxyType, SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import distbatch
from distbatch import BatchStatus, DistributedBatchMemory
from distbatch.controller import Controller
from distbatch.controller.remote import RemoteController
from distbatch.controller.server import ControllerServer, serve_controller
from distbatch.dataloader import (
    ReplayUnavailableError,
    StreamingDataLoader,
    StreamingDataset,
    fetch_batch,
    split_micro_batches,
)
from distbatch.errors import UnknownFieldError
from distbatch.launch import WorkerProcess
from distbatch.samplers import RankAwareSampler, SeqlenBalancedSampler

pytestmark = pytest.mark.timeout(60)

FIELDS = ["num", "tag"]
FAST = 0.01  # poll interval for tests, seconds


# ----------------------------------------------------------------------------- helpers


def _prefix() -> str:
    return "t" + uuid.uuid4().hex[:8]


def put_tasks(
    controller: Any,
    partition_id: str,
    workers: list[WorkerProcess],
    prefix: str,
    numbers: range,
    *,
    per_put: int = 1,
    lengths: list[int] | None = None,
) -> list[str]:
    """Store tasks `prefix-n` on the workers (round robin, `per_put` tasks per put) and register them."""
    ids = [f"{prefix}-{n}" for n in numbers]
    for k, start in enumerate(range(0, len(ids), per_put)):
        chunk = ids[start : start + per_put]
        nums = [int(t.rsplit("-", 1)[1]) for t in chunk]
        data: dict[str, Any] = {"num": torch.tensor(nums), "tag": list(chunk)}
        if lengths is not None:
            data["input_ids"] = [torch.ones(lengths[ids.index(t)], dtype=torch.int32) for t in chunk]
        node = workers[k % len(workers)].node
        remote = DistributedBatchMemory.from_dict(data, task_ids=chunk).to_remote(node)
        controller.put(partition_id, remote)
    return ids


def check_batch(batch: DistributedBatchMemory) -> list[str]:
    """Assert a yielded batch is LOCAL and its data belongs to its task ids; return the ids."""
    assert batch.status is BatchStatus.LOCAL
    ids = batch.task_ids
    assert batch["tag"] == ids
    assert batch["num"].tolist() == [int(t.rsplit("-", 1)[1]) for t in ids]
    return ids


def dataset(controller: Any, partition_id: str, **kwargs: Any) -> StreamingDataset:
    kwargs.setdefault("task_name", "train")
    kwargs.setdefault("fields", FIELDS)
    kwargs.setdefault("batch_size", 2)
    kwargs.setdefault("poll_interval", FAST)
    return StreamingDataset(controller, partition_id, **kwargs)


def put_later(delay: float, action: Callable[[], object]) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        action()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def served() -> Iterator[tuple[ControllerServer, RemoteController]]:
    """A Controller with a RankAwareSampler, served over HTTP, and a RemoteController for it."""
    server = serve_controller(Controller(RankAwareSampler()))
    try:
        yield server, RemoteController(server.address, timeout=20.0)
    finally:
        server.shutdown()


# ----------------------------------------------------------------------------- micro-batches


def test_seven_tasks_in_micro_batches_of_three(shared_workers: list[WorkerProcess]) -> None:
    controller = Controller()
    ids = put_tasks(controller, "p", shared_workers, _prefix(), range(7), per_put=3)
    ds = dataset(controller, "p", batch_size=7, micro_batch_size=3, should_check_consumption_status=True)
    micro = list(ds)
    assert [len(mb) for mb in micro] == [3, 3, 1]
    seen = [t for mb in micro for t in check_batch(mb)]
    assert seen == ids
    assert len(ds.get_buffer()) == 1 and ds.get_buffer()[0].task_ids == ids


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), micro=st.integers(1, 45))
def test_split_micro_batches_keeps_order_and_tail(n: int, micro: int) -> None:
    ids = [f"x-{i}" for i in range(n)]
    batch = DistributedBatchMemory.from_dict({"num": torch.arange(n), "tag": ids}, task_ids=ids)
    parts = split_micro_batches(batch, micro)
    assert [len(p) for p in parts] == [min(micro, n - s) for s in range(0, n, micro)]
    assert [t for p in parts for t in check_batch(p)] == ids
    assert split_micro_batches(batch, None) == [batch]
    assert split_micro_batches(DistributedBatchMemory(), micro) == []


# ----------------------------------------------------------------------------- modes


def test_finite_mode_ends_once_everything_is_consumed(shared_workers: list[WorkerProcess]) -> None:
    controller = Controller()
    ids = put_tasks(controller, "p", shared_workers, _prefix(), range(6), per_put=2)
    ds = dataset(controller, "p", should_check_consumption_status=True)
    batches = list(ds)
    assert [t for b in batches for t in check_batch(b)] == ids
    assert controller.all_consumed("p", "train")
    assert list(ds) == []  # a second pass over a consumed partition ends at once


def test_finite_mode_waits_for_fields_produced_later(shared_workers: list[WorkerProcess]) -> None:
    """Known but unfinished tasks keep a finite pass going until they are produced and consumed.

    A field a later stage puts must be declared (`create_partition`): an undeclared one that no
    put has brought is a typo as far as the controller can tell, an `UnknownFieldError` at once.
    """
    controller = Controller()
    prefix = _prefix()
    ids = [f"{prefix}-{n}" for n in range(4)]
    prompts = DistributedBatchMemory.from_dict({"num": torch.arange(4)}, task_ids=ids)
    controller.put("p", prompts.to_remote(shared_workers[0].node))
    with pytest.raises(UnknownFieldError, match="'tag'"):
        list(dataset(controller, "p", should_check_consumption_status=True, max_empty_polls=500))
    controller.create_partition("p", expected_fields=["tag"])
    answers = DistributedBatchMemory.from_dict({"tag": ids}, task_ids=ids)
    thread = put_later(0.3, lambda: controller.put("p", answers.to_remote(shared_workers[1].node)))
    ds = dataset(controller, "p", should_check_consumption_status=True, max_empty_polls=500)
    started = time.monotonic()
    batches = list(ds)
    thread.join()
    assert time.monotonic() - started >= 0.25
    assert [t for b in batches for t in check_batch(b)] == ids


def test_finite_mode_tail_is_bounded_by_max_empty_polls(shared_workers: list[WorkerProcess]) -> None:
    controller = Controller()
    ids = put_tasks(controller, "p", shared_workers, _prefix(), range(5), per_put=5)
    ds = dataset(controller, "p", should_check_consumption_status=True, max_empty_polls=5)
    started = time.monotonic()
    batches = list(ds)  # the fifth task never fills a batch of 2
    assert time.monotonic() - started < 5
    assert [t for b in batches for t in check_batch(b)] == ids[:4]
    assert not controller.all_consumed("p", "train")


def test_streaming_mode_picks_up_tasks_put_later(shared_workers: list[WorkerProcess]) -> None:
    controller = Controller()
    prefix = _prefix()
    first = put_later(0.2, lambda: put_tasks(controller, "p", shared_workers, prefix, range(0, 2), per_put=2))
    second = put_later(
        0.5, lambda: put_tasks(controller, "p", shared_workers, prefix, range(2, 4), per_put=2)
    )
    ds = dataset(controller, "p", max_empty_polls=1000)  # streaming; the bound only guards the test
    started = time.monotonic()
    batches = list(itertools.islice(iter(ds), 2))
    first.join()
    second.join()
    assert time.monotonic() - started >= 0.45
    assert [t for b in batches for t in check_batch(b)] == [f"{prefix}-{n}" for n in range(4)]


def test_streaming_mode_without_data_polls_until_the_bound() -> None:
    controller = Controller()
    calls: list[int] = []

    def counting_fetch(*args: Any, **kwargs: Any) -> DistributedBatchMemory:
        calls.append(kwargs["batch_index"])
        return fetch_batch(*args, **kwargs)

    ds = dataset(controller, "nothing", fetch_batch_fn=counting_fetch, poll_interval=0.02, max_empty_polls=5)
    started = time.monotonic()
    assert list(ds) == []
    elapsed = time.monotonic() - started
    assert calls == [0] * 5  # an empty poll does not use up a batch index
    assert 0.06 <= elapsed < 2


# ----------------------------------------------------------------------------- replay and steps


def test_reset_replays_identical_batches_without_fetching(shared_workers: list[WorkerProcess]) -> None:
    controller = Controller()
    ids = put_tasks(controller, "p", shared_workers, _prefix(), range(6), per_put=3)
    fetched: list[int] = []

    def counting_fetch(*args: Any, **kwargs: Any) -> DistributedBatchMemory:
        batch = fetch_batch(*args, **kwargs)
        if len(batch):
            fetched.append(kwargs["batch_index"])
        return batch

    ds = dataset(
        controller,
        "p",
        micro_batch_size=1,
        fetch_batch_fn=counting_fetch,
        should_check_consumption_status=True,
    )
    loader = StreamingDataLoader(ds)
    first = [(mb.task_ids, mb["num"].tolist()) for mb in loader]
    assert [t for tids, _ in first for t in tids] == ids
    assert fetched == [0, 1, 2] and len(loader.get_buffer()) == 3
    loader.reset()
    second = [(mb.task_ids, mb["num"].tolist()) for mb in loader]
    assert second == first
    assert fetched == [0, 1, 2]  # replayed from the buffer, nothing new fetched

    # reset() in the middle of a pass starts over at the first micro-batch
    loader.reset()
    it = iter(loader)
    head = [next(it).task_ids for _ in range(4)]
    loader.reset()
    assert [mb.task_ids for mb in it] == [tids for tids, _ in first]
    assert head == [tids for tids, _ in first[:4]]


def test_breaking_out_resumes_at_the_next_micro_batch(shared_workers: list[WorkerProcess]) -> None:
    controller = Controller()
    ids = put_tasks(controller, "p", shared_workers, _prefix(), range(6), per_put=6)
    ds = dataset(controller, "p", batch_size=3, micro_batch_size=2, should_check_consumption_status=True)
    seen: list[str] = []
    for mb in ds:
        seen += check_batch(mb)
        break
    for mb in ds:
        seen += check_batch(mb)
    assert seen == ids  # nothing skipped, nothing repeated


def test_step_moves_to_a_new_partition(shared_workers: list[WorkerProcess]) -> None:
    controller = Controller(RankAwareSampler())
    prefix = _prefix()
    ids1 = put_tasks(controller, "step-1", shared_workers, prefix, range(0, 4), per_put=2)
    ids2 = put_tasks(controller, "step-2", shared_workers, prefix, range(4, 8), per_put=2)
    indexes: list[tuple[str, int]] = []

    def recording_fetch(
        controller: Any, partition_id: str, *args: Any, **kwargs: Any
    ) -> DistributedBatchMemory:
        batch = fetch_batch(controller, partition_id, *args, **kwargs)
        if len(batch):
            indexes.append((partition_id, kwargs["batch_index"]))
        return batch

    loader = StreamingDataLoader(
        dataset(controller, "step-1", fetch_batch_fn=recording_fetch, should_check_consumption_status=True)
    )
    assert [t for b in loader for t in check_batch(b)] == ids1
    loader.step("step-2")
    assert loader.dataset.partition_id == "step-2"
    assert loader.get_buffer() == [] and loader.dataset.batch_index == 0
    assert [t for b in loader for t in check_batch(b)] == ids2
    assert indexes == [("step-1", 0), ("step-1", 1), ("step-2", 0), ("step-2", 1)]


def test_step_while_streaming_switches_the_live_iterator(shared_workers: list[WorkerProcess]) -> None:
    controller = Controller()
    prefix = _prefix()
    put_tasks(controller, "s1", shared_workers, prefix, range(0, 4), per_put=4)
    ids2 = put_tasks(controller, "s2", shared_workers, prefix, range(4, 8), per_put=4)
    ds = dataset(controller, "s1", batch_size=4, micro_batch_size=1, max_empty_polls=50)
    it = iter(ds)
    assert next(it).task_ids == [f"{prefix}-0"]
    ds.step("s2")  # the rest of s1's batch is dropped with the buffer
    assert [mb.task_ids[0] for mb in itertools.islice(it, 4)] == ids2


# ----------------------------------------------------------------------------- custom functions


def test_custom_fetch_and_process_functions_are_used(shared_workers: list[WorkerProcess]) -> None:
    controller = Controller()
    ids = put_tasks(controller, "p", shared_workers, _prefix(), range(4), per_put=2)
    config = MappingProxyType({"note": "kept"})  # read-only: any attempt to mutate it raises
    calls: list[dict[str, Any]] = []

    def my_fetch(ctrl: Any, partition_id: str, task_name: str, fields: list[str], batch_size: int, **kw: Any):
        calls.append({"partition_id": partition_id, "task_name": task_name, "fields": fields, **kw})
        kw.pop("note")  # our own kwargs dict: the dataset's config is unaffected
        return ctrl.get_meta(partition_id, task_name, fields, batch_size, **kw)  # REMOTE: gathered for us

    def my_process(batch: DistributedBatchMemory, micro_batch_size: int | None = None) -> Iterator[dict]:
        assert batch.status is BatchStatus.LOCAL and micro_batch_size == 5
        for i in reversed(range(len(batch))):
            yield {"id": batch.task_ids[i], "num": int(batch["num"][i])}

    ds = dataset(
        controller,
        "p",
        dp_rank=3,
        micro_batch_size=5,
        fetch_batch_fn=my_fetch,
        process_batch_fn=my_process,
        sampling_config=config,
        should_check_consumption_status=True,
    )
    items = list(StreamingDataLoader(ds))
    assert [d["id"] for d in items] == [ids[1], ids[0], ids[3], ids[2]]
    assert all(d["num"] == int(d["id"].rsplit("-", 1)[1]) for d in items)
    hits = [c for c in calls if c["batch_index"] in (0, 1)]
    request_id = hits[0].pop("request_id")  # one per batch: a re-ask after a failure reuses it
    assert isinstance(request_id, str) and request_id != hits[-1]["request_id"]
    assert hits[0] == {
        "partition_id": "p",
        "task_name": "train",
        "fields": FIELDS,
        "dp_rank": 3,
        "batch_index": 0,
        "note": "kept",
    }
    assert all(c["note"] == "kept" for c in calls)
    assert dict(config) == {"note": "kept"} and ds.sampling_config == {"note": "kept"}


def test_fetch_function_must_return_a_batch() -> None:
    ds = dataset(Controller(), "p", fetch_batch_fn=lambda *a, **k: {"not": "a batch"})
    with pytest.raises(TypeError, match="DistributedBatchMemory"):
        next(iter(ds))


# ----------------------------------------------------------------------------- ranks


def test_tp_peers_get_identical_data_and_dp_ranks_disjoint(shared_workers: list[WorkerProcess]) -> None:
    controller = Controller(RankAwareSampler())
    ids = put_tasks(controller, "p", shared_workers, _prefix(), range(12), per_put=3)

    def rank(dp: int) -> StreamingDataset:
        return dataset(controller, "p", dp_rank=dp, should_check_consumption_status=True, max_empty_polls=50)

    # TP rank 0 of both dp ranks in lock-step; TP rank 1 of each lags a whole pass behind.
    tp0 = {0: rank(0), 1: rank(1)}
    rounds = list(itertools.zip_longest(tp0[0], tp0[1]))
    assert len(rounds) == 3 and all(a is not None and b is not None for a, b in rounds)
    tp1 = {dp: [(b.task_ids, b["num"].tolist()) for b in rank(dp)] for dp in (0, 1)}
    for dp in (0, 1):
        leader = [(b.task_ids, b["num"].tolist()) for b in tp0[dp].get_buffer()]
        assert tp1[dp] == leader  # identical batches, in the same order
    dp0 = {t for b in tp0[0].get_buffer() for t in check_batch(b)}
    dp1 = {t for b in tp0[1].get_buffer() for t in check_batch(b)}
    assert dp0.isdisjoint(dp1) and dp0 | dp1 == set(ids)


def test_finite_mode_does_not_end_before_a_peer_took_its_batch(shared_workers: list[WorkerProcess]) -> None:
    """Race: our fetch of index 1 is empty, then tasks arrive and the TP peer takes index 1 (so all
    is consumed) before we check the status. We must still get index 1 from the sampler's cache."""
    controller = Controller(RankAwareSampler())
    prefix = _prefix()
    ids = put_tasks(controller, "p", shared_workers, prefix, range(2), per_put=2)
    peer: list[DistributedBatchMemory] = []

    def racing_fetch(*args: Any, **kwargs: Any) -> DistributedBatchMemory:
        batch = fetch_batch(*args, **kwargs)
        if kwargs["batch_index"] == 1 and not peer:
            assert len(batch) == 0
            ids.extend(put_tasks(controller, "p", shared_workers, prefix, range(2, 4), per_put=2))
            peer.append(fetch_batch(*args, **kwargs))
        return batch

    ds = dataset(controller, "p", fetch_batch_fn=racing_fetch, should_check_consumption_status=True)
    mine = [check_batch(b) for b in ds]
    assert mine == [ids[:2], ids[2:]]
    assert peer[0].task_ids == ids[2:]


def test_seqlen_balanced_ranks_through_the_dataset(shared_workers: list[WorkerProcess]) -> None:
    n, dp_size = 2, 2
    controller = Controller(SeqlenBalancedSampler(n_samples_per_prompt=n, dp_size=dp_size))
    lengths = [90, 10, 50, 50, 40, 40, 5, 5]  # group totals 100, 100, 80, 10: best split 180 | 110
    ids = put_tasks(controller, "p", shared_workers, _prefix(), range(8), per_put=2, lengths=lengths)
    fields = [*FIELDS, "input_ids"]

    def peer(dp: int) -> StreamingDataset:
        return dataset(
            controller, "p", fields=fields, batch_size=4, dp_rank=dp, should_check_consumption_status=True
        )

    got = {(dp, tp): [t for b in peer(dp) for t in check_batch(b)] for dp in (1, 0) for tp in (0, 1)}
    assert got[(0, 0)] == got[(0, 1)] and got[(1, 0)] == got[(1, 1)]
    assert set(got[(0, 0)]).isdisjoint(got[(1, 0)]) and set(got[(0, 0)]) | set(got[(1, 0)]) == set(ids)
    tokens = [sum(lengths[ids.index(t)] for t in got[(dp, 0)]) for dp in (0, 1)]
    assert sorted(tokens) == [110, 180]
    for dp in (0, 1):  # groups stay whole
        nums = sorted(int(t.rsplit("-", 1)[1]) for t in got[(dp, 0)])
        assert all(nums[i] // n == nums[i + 1] // n for i in range(0, len(nums), 2))


# ----------------------------------------------------------------------------- loader workers


def test_two_loader_workers_never_repeat_a_batch(
    shared_workers: list[WorkerProcess], served: tuple[ControllerServer, RemoteController]
) -> None:
    """Worker w fetches indexes w, w+2, ...: with a RankAwareSampler a shared index would repeat a batch."""
    server, remote = served
    ids = put_tasks(remote, "p", shared_workers, _prefix(), range(16), per_put=4)
    ds = dataset(remote, "p", should_check_consumption_status=True, max_empty_polls=500)
    loader = StreamingDataLoader(ds, num_workers=2)
    batches = list(loader)
    seen = [t for b in batches for t in check_batch(b)]
    assert len(batches) == 8 and all(len(b) == 2 for b in batches)
    assert len(seen) == len(set(seen)) and set(seen) == set(ids)
    assert server.controller.all_consumed("p", "train")
    with pytest.raises(ReplayUnavailableError):
        loader.reset()
    with pytest.raises(ReplayUnavailableError):
        loader.get_buffer()


def test_step_restarts_persistent_workers(
    shared_workers: list[WorkerProcess], served: tuple[ControllerServer, RemoteController]
) -> None:
    _, remote = served
    prefix = _prefix()
    ids1 = put_tasks(remote, "w1", shared_workers, prefix, range(0, 8), per_put=4)
    ids2 = put_tasks(remote, "w2", shared_workers, prefix, range(8, 16), per_put=4)
    ds = dataset(remote, "w1", micro_batch_size=1, should_check_consumption_status=True, max_empty_polls=500)
    loader = StreamingDataLoader(ds, num_workers=2, persistent_workers=True)
    first = [t for mb in loader for t in check_batch(mb)]
    loader.step("w2")
    second = [t for mb in loader for t in check_batch(mb)]
    assert sorted(first) == sorted(ids1) and sorted(second) == sorted(ids2)


def test_local_controller_with_loader_workers_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    ds = dataset(Controller(), "p")
    for workers in (1, 2):
        with pytest.raises(ValueError, match="RemoteController"):
            StreamingDataLoader(ds, num_workers=workers)
    # A plain DataLoader gets no say beforehand: the dataset refuses inside the worker. (Simulated:
    # torch takes 5 s per worker to shut down a real worker whose iterator raised.)
    worker = SimpleNamespace(id=1, num_workers=2, seed=0, dataset=ds)
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: worker)
    with pytest.raises(ValueError, match="RemoteController"):
        next(iter(ds))


# ----------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "override",
    [
        {"partition_id": "bad/id"},
        {"task_name": ""},
        {"fields": "num"},
        {"fields": []},
        {"fields": ["num", "num"]},
        {"batch_size": 0},
        {"batch_size": True},
        {"batch_size": 2.0},
        {"micro_batch_size": 0},
        {"dp_rank": -1},
        {"poll_interval": -1},
        {"poll_interval": float("nan")},
        {"max_empty_polls": 0},
        {"should_check_consumption_status": "yes"},
        {"fetch_batch_fn": "not callable"},
        {"process_batch_fn": 3},
        {"sampling_config": ["dp_rank", 1]},
        {"sampling_config": {"dp_rank": 1}},
        {"sampling_config": {"batch_index": 0}},
        {"sampling_config": {"timeout": 5}},
        {"sampling_config": {1: "x"}},
        {"controller": None},
        {"controller": object()},
    ],
)
def test_invalid_arguments_raise_value_error(override: dict[str, Any]) -> None:
    kwargs: dict[str, Any] = {
        "controller": Controller(),
        "partition_id": "p",
        "task_name": "train",
        "fields": FIELDS,
        "batch_size": 2,
        **override,
    }
    with pytest.raises(ValueError):
        StreamingDataset(**kwargs)


def test_invalid_loader_arguments_and_step_id() -> None:
    ds = dataset(Controller(), "p")
    for bad in ({"batch_size": 4}, {"shuffle": True}, {"drop_last": True}):
        with pytest.raises(ValueError):
            StreamingDataLoader(ds, **bad)
    with pytest.raises(ValueError):
        StreamingDataLoader(torch.utils.data.TensorDataset(torch.zeros(2)))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ds.step("no spaces allowed")


def test_lazy_exports() -> None:
    assert distbatch.StreamingDataset is StreamingDataset
    assert distbatch.StreamingDataLoader is StreamingDataLoader
    assert {"StreamingDataset", "StreamingDataLoader"} <= set(distbatch.__all__)
