"""distbatch as a TransferQueue storage backend, what only Distbatch has: its options checked
before any worker starts, the workers `tq.init` starts and `close` stops, a worker that dies
mid-run, the fast schema, and registration in another Ray worker through the job's setup hook.
The differential tests against SimpleStorage are in test_transferqueue_backend.py.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from tensordict import NonTensorStack, TensorDict
from tq_backend_support import config, ray, rollout, same, tq, tq_ray_cluster

import distbatch.transferqueue as dtq


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Iterator[None]:
    yield from tq_ray_cluster()


BAD_OPTIONS = [
    ({"workrs": 2}, r"unknown option\(s\) \['workrs'\]"),
    ({"workers": 0}, "at least 1"),
    ({"workers": "2"}, "must be int"),
    ({"same_host": "yes"}, "must be bool"),
    ({"capacity": "lots"}, "not a size"),
    ({"endpoints": "127.0.0.1:1"}, "must be a list"),
    ({"endpoints": ["not an address"]}, "node"),
    ({"timeout": 0}, "seconds > 0"),
    ({"fast_schema": 1}, "must be bool"),
    ({"freeze_gc": "yes"}, "must be bool"),
    ({"data_dir": 3}, "must be str"),
    ({"sync_writes": "yes"}, "must be bool"),
]


@pytest.mark.parametrize(("options", "message"), BAD_OPTIONS)
def test_bad_options_fail_the_backends_bootstrap_before_any_worker_starts(
    options: dict[str, Any], message: str
) -> None:
    """The storage bootstrap `tq.init` runs for "Distbatch", called as TransferQueue calls it
    (its config merged over TransferQueue's defaults); each `tq.init` would first start
    TransferQueue's controller actor, 3-4 s apiece, which the next test shows once."""
    from importlib import resources

    from omegaconf import OmegaConf
    from transfer_queue.storage.bootstrap.provider import StorageBootstrapProvider

    defaults = OmegaConf.load(resources.files("transfer_queue") / "config.yaml")
    conf = OmegaConf.merge(defaults, config("Distbatch", **options))
    provider = StorageBootstrapProvider.get_provider("Distbatch")
    assert provider is dtq.bootstrap
    before = _distbatch_actors()
    with pytest.raises(ValueError, match=message):
        provider(conf)
    assert _distbatch_actors() == before


def test_bad_options_fail_tq_init_before_any_worker_starts() -> None:
    options, message = BAD_OPTIONS[0]
    before = _distbatch_actors()
    try:
        with pytest.raises(ValueError, match=message):
            tq.init(config("Distbatch", **options))
    finally:
        dtq.close()
    assert _distbatch_actors() == before


def _distbatch_actors() -> int:
    """Live distbatch worker actors in this Ray cluster (read from Ray's control store)."""
    from ray._private import state

    return sum(
        1
        for actor in state.actors().values()
        if actor.get("ActorClassName") == "_WorkerActor" and actor.get("State") == "ALIVE"
    )


@pytest.fixture
def distbatch_backend() -> Iterator[Callable[..., Any]]:
    """`tq.init` with Distbatch (options as given), closed after the test."""

    def init(**options: Any) -> Any:
        return tq.init(config("Distbatch", **options))

    try:
        yield init
    finally:
        dtq.close()


@pytest.mark.parametrize("fast", [True, False])
def test_the_fast_schema_is_in_place_while_the_backend_is(
    fast: bool, distbatch_backend: Callable[..., Any]
) -> None:
    import transfer_queue.metadata as tq_metadata

    from distbatch.transferqueue import fast_schema

    distbatch_backend(workers=1, fast_schema=fast)
    ragged = torch.nested.nested_tensor([torch.arange(3), torch.arange(2)], layout=torch.jagged)
    tq.kv_batch_put(keys=["x", "y"], partition_id="p", fields=TensorDict({"v": ragged}, batch_size=2))
    in_use = tq_metadata.extract_field_schema
    assert (in_use is fast_schema.extract_field_schema) is fast
    got = tq.kv_batch_get(keys=["x", "y"], partition_id="p")["v"]
    assert [t.tolist() for t in got.unbind()] == [[0, 1, 2], [0, 1]]
    dtq.close()
    assert tq_metadata.extract_field_schema is fast_schema.TQ_EXTRACT_FIELD_SCHEMA


def test_close_stops_the_workers_tq_init_started(distbatch_backend: Callable[..., Any]) -> None:
    conf = distbatch_backend(workers=2, capacity="64M")
    endpoints = list(conf.backend.Distbatch.endpoints)
    assert len(endpoints) == 2
    tq.kv_put(key="x", partition_id="p", fields={"v": torch.arange(3)})
    from distbatch import ShardClient, WorkerUnavailableError

    with ShardClient(timeout=5, retries=0) as client:
        assert sum(client.stats(node)["shards"] for node in endpoints) == 1
        assert {client.stats(node)["capacity"] for node in endpoints} == {64 << 20}
        assert dtq.close() == 2
        for node in endpoints:
            with pytest.raises(WorkerUnavailableError):
                client.health(node)
    assert dtq.close() == 0  # twice is fine


def _live_actors() -> dict[str, int]:
    """Live actors in this Ray cluster by class (read from Ray's control store)."""
    from ray._private import state

    counts: dict[str, int] = {}
    for actor in state.actors().values():
        if actor.get("State") == "ALIVE":
            name = str(actor.get("ActorClassName"))
            counts[name] = counts.get(name, 0) + 1
    return counts


@pytest.mark.parametrize("cycles", [2, pytest.param(20, marks=pytest.mark.slow)])
def test_init_work_close_cycles_leave_nothing_behind(cycles: int, caplog: pytest.LogCaptureFixture) -> None:
    """`tq.init` / a put and a get / TransferQueue's own `tq.close()`, over and over in one
    process: no distbatch worker, Ray actor, shared-memory region or open file is left, and
    `tq.close()` says nothing of an unsupported backend. Long (15-65 s): every cycle starts
    TransferQueue's controller and our worker as new Ray actor processes, so the suite runs 2
    (what the first leaves, the second would meet) and `--runslow` 20."""
    from distbatch import ShardClient, WorkerUnavailableError

    actors, regions = _live_actors(), set(os.listdir("/dev/shm"))
    files = len(os.listdir("/proc/self/fd"))
    keys = ["a", "b", "c"]
    with ShardClient(timeout=5, retries=0) as client:
        for cycle in range(cycles):
            conf = tq.init(config("Distbatch", workers=1, same_host=True))
            (node,) = conf.backend.Distbatch.endpoints
            tq.kv_batch_put(keys=keys, partition_id="p", fields=rollout(3, cycle))
            assert tq.kv_batch_get(keys=keys, partition_id="p").batch_size[0] == 3
            caplog.clear()
            tq.close()
            assert "not supported" not in caplog.text
            with pytest.raises(WorkerUnavailableError):
                client.health(node)
    deadline = time.monotonic() + 30  # ray.kill is asynchronous: wait for the actors to go
    while _live_actors() != actors and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _live_actors() == actors
    assert set(os.listdir("/dev/shm")) <= regions
    assert len(os.listdir("/proc/self/fd")) <= files + 8  # sockets Ray's client may keep pooled


def test_a_worker_gone_mid_run_is_a_clear_error_and_nothing_half_stored(
    distbatch_backend: Callable[..., Any],
) -> None:
    from distbatch import NodeError

    conf = distbatch_backend(workers=1, timeout=5.0)
    tq.kv_batch_put(keys=["a", "b"], partition_id="p", fields=rollout(2, 3))
    dtq.STARTED.stop_all()  # the worker holding them is gone
    with pytest.raises(NodeError):
        tq.kv_batch_get(keys=["a", "b"], partition_id="p")
    with pytest.raises(NodeError):
        tq.kv_batch_put(keys=["c"], partition_id="p", fields=rollout(1, 4))
    # TransferQueue registered the key before the put failed (as with its own storage), but no
    # field of it was stored or announced: nothing half-stored to read.
    try:
        got = tq.kv_batch_get(keys=["c"], partition_id="p")
    except ValueError:
        got = None
    assert got is None or not list(got.keys())
    assert conf.backend.Distbatch.endpoints


def test_a_refused_put_leaves_transferqueue_as_it_found_it(distbatch_backend: Callable[..., Any]) -> None:
    """A put the backend refuses (a value it cannot carry) names the field and why, stores none
    of its fields, and leaves TransferQueue as it found it (one session, three ways to put):

    - kv puts: their new keys are not listed (they once stayed, as `{}`, and every read of them
      said "Some fields are not ready"); a key that held a field or a tag keeps them; putting
      the keys again then works;
    - `put` without metadata releases the samples it allocated, so the partition's production
      status is not held back by samples nobody will produce;
    - samples the caller allocated (`get_meta(mode="insert")`) stay allocated for another try,
      and the partition can be cleared and used (TransferQueue's controller once failed to clear
      it with an IndexError: it had never been told of those samples)."""
    from distbatch import ShardClient, WireFormatError

    conf = distbatch_backend(workers=1)
    (node,) = conf.backend.Distbatch.endpoints
    client = tq.get_client()
    refused = re.compile(r"field '[vw]'.*set")

    # kv puts
    tq.kv_batch_put(
        keys=["old"],
        partition_id="kv",
        fields=TensorDict({"a": torch.arange(2)[None]}, batch_size=1),
        tags=[{"s": 1}],
    )
    tq.kv_batch_put(keys=["tagged"], partition_id="kv", tags=[{"only": "a tag"}])
    sets = TensorDict({"w": NonTensorStack({1}, {2}, {3}, {4})}, batch_size=4)
    with pytest.raises(WireFormatError, match=refused):
        tq.kv_batch_put(
            keys=["new0", "old", "tagged", "new1"],
            partition_id="kv",
            fields=sets,
            tags=[{"t": i} for i in range(4)],
        )
    with pytest.raises(WireFormatError, match=refused):
        tq.kv_put(key="new2", partition_id="kv", fields=TensorDict({"w": NonTensorStack({1})}, batch_size=1))
    assert tq.kv_list(partition_id="kv")["kv"] == {"old": {"s": 1}, "tagged": {"only": "a tag"}}
    assert tq.kv_batch_get(keys=["old"], partition_id="kv")["a"][0].tolist() == [0, 1]
    fine = TensorDict({"v": torch.arange(4)[:, None]}, batch_size=4)
    tq.kv_batch_put(keys=["new0", "old", "tagged", "new1"], partition_id="kv", fields=fine)
    got = tq.kv_batch_get(keys=["new0", "new1"], partition_id="kv")["v"]  # nested, as TransferQueue gives
    assert [t.tolist() for t in got.unbind()] == [[0], [3]]
    assert sorted(tq.kv_list(partition_id="kv")["kv"]) == ["new0", "new1", "old", "tagged"]

    # put without metadata
    with pytest.raises(WireFormatError, match=refused):
        client.put(TensorDict({"v": NonTensorStack({1}, {2})}, batch_size=2), partition_id="q")
    stored = client.put(TensorDict({"v": torch.arange(3)}, batch_size=3), partition_id="q")
    assert client.check_production_status(["v"], "q")  # only the three stored samples
    assert client.get_data(stored)["v"].tolist() == [0, 1, 2]

    # put to samples the caller allocated
    with ShardClient(timeout=5) as shards:
        before = shards.stats(node)["shards"]
        meta = client.get_meta(data_fields=["v", "w"], batch_size=2, partition_id="q", mode="insert")
        with pytest.raises(WireFormatError, match=refused):
            client.put(
                TensorDict({"v": torch.arange(2), "w": NonTensorStack({1, 2}, {3})}, batch_size=2), meta
            )
        assert shards.stats(node)["shards"] == before  # "v" was not stored either
    assert not client.check_production_status(["v"], "q")  # the two samples wait for another try
    client.put(TensorDict({"v": torch.arange(2), "w": torch.zeros(2)}, batch_size=2), meta)
    assert client.check_production_status(["v"], "q")
    client.clear_partition("q")
    stored = client.put(TensorDict({"v": torch.arange(3)}, batch_size=3), partition_id="q")
    assert client.get_data(stored)["v"].tolist() == [0, 1, 2]
    client.clear_partition("q")


def test_a_checkpoint_keeps_the_workers_data_and_restores_onto_another_number_of_workers(
    distbatch_backend: Callable[..., Any],
    start_worker: Callable[..., Any],
    tmp_path: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`save_checkpoint(include_storage=False)` saves the data anyway, as TransferQueue does for
    its own in-memory storage (it says so): the workers hold it in memory. SimpleStorage refuses
    to restore onto another number of storage units ("Storage unit count mismatch"); Distbatch
    puts each saved worker's samples back on the worker in its slot modulo the workers there are
    now, which is where the restored metadata looks: a run saved on several workers restarts on
    one, samples, tags and all."""
    import json

    from distbatch import ShardClient

    count = next(n for n in range(2, 8) if os.getpid() % n)  # the put's home, slot pid % count, is not 0
    before = [start_worker() for _ in range(count)]
    distbatch_backend(endpoints=[w.node for w in before])
    keys = [f"k{i}" for i in range(4)]
    tq.kv_batch_put(keys=keys, partition_id="p", fields=rollout(4, seed=5), tags=[{"i": i} for i in range(4)])
    saved = tq.kv_batch_get(keys=keys, partition_id="p")
    tq.save_checkpoint(tmp_path / "ckpt", include_storage=False)
    assert json.loads((tmp_path / "ckpt" / "metadata.json").read_text())["storage_saved"] is True
    assert "Forcing include_storage=True" in caplog.text
    dtq.close()
    with ShardClient(timeout=5) as shards:
        held = [shards.stats(w.node)["tasks"] for w in before]
    assert held[os.getpid() % count] == 4 and sum(held) == 4, held

    after = start_worker()
    distbatch_backend(endpoints=[after.node])
    tq.load_checkpoint(tmp_path / "ckpt")
    assert same(tq.kv_batch_get(keys=keys, partition_id="p"), saved)
    assert tq.kv_list(partition_id="p")["p"] == {k: {"i": i} for i, k in enumerate(keys)}


def test_a_ray_worker_registers_with_the_setup_hook(distbatch_backend: Callable[..., Any]) -> None:
    """A Ray task in another process reaches the backend with no import of its own: the job's
    `worker_process_setup_hook` imported distbatch.transferqueue there, as verl's workers would.

    Long (10-45 s): a `tq.init` and a Ray task in a new worker process, which imports torch and
    TransferQueue first."""
    distbatch_backend(workers=1)
    tq.kv_batch_put(keys=["r0", "r1"], partition_id="p", fields=rollout(2, 5))

    @ray.remote
    def read() -> tuple[int, list[int]]:
        import transfer_queue as remote_tq

        got = remote_tq.kv_batch_get(keys=["r0", "r1"], partition_id="p", select_fields=["input_ids"])
        return os.getpid(), got.get("input_ids").offsets().tolist()

    expected = tq.kv_batch_get(keys=["r0", "r1"], partition_id="p").get("input_ids").offsets().tolist()
    pid, offsets = ray.get(read.remote(), timeout=120)
    assert pid != os.getpid() and offsets == expected


def test_a_session_begun_before_the_backend_was_registered_is_discarded(
    distbatch_backend: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`tq.init` for Distbatch before `import distbatch.transferqueue` (TransferQueue's two
    registries as they are before that import) fails as TransferQueue fails it, yet leaves its
    controller behind: another `tq.init` used to attach to it and the first put said `Storage
    manager not initialized`. Registering (what the import does) discards that session, and the
    next `tq.init` works."""
    import transfer_queue.interface as interface
    from transfer_queue.storage.bootstrap.provider import StorageBootstrapProvider
    from transfer_queue.storage.managers.base import StorageManagerFactory

    from distbatch.transferqueue import provider

    monkeypatch.delitem(StorageBootstrapProvider._providers, "distbatch")
    monkeypatch.delitem(StorageManagerFactory._registry, "Distbatch")
    with pytest.raises(AssertionError, match="Unknown manager_type: Distbatch"):
        tq.init(config("Distbatch", workers=1))
    assert interface._TQ_CONTROLLER is not None  # the half session TransferQueue leaves
    monkeypatch.undo()
    with caplog.at_level("WARNING", logger="distbatch.transferqueue"):
        provider.hook_interface(interface)  # what registering runs
    assert "call tq.init again" in caplog.text and interface._TQ_CONTROLLER is None
    assert not provider.discard_a_session_begun_without_us(interface)  # nothing left to discard
    distbatch_backend(workers=1)
    tq.kv_batch_put(keys=["a", "b"], partition_id="p", fields=rollout(2, 4))
    got = tq.kv_batch_get(keys=["a", "b"], partition_id="p")
    assert got["input_ids"].offsets().tolist() == rollout(2, 4)["input_ids"].offsets().tolist()
