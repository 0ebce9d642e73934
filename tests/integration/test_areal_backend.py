"""distbatch as AReaL's RTensor backend, driven through AReaL's own `RTensor` code.

AReaL (installed without its dependencies: `scripts/test` does; imported only while this module
runs, see areal_support) calls the backend as its engines and controller do: `RTensor.remotize`
stores every tensor of a result, `RTensor.localize` fetches them, `RTensor.clear_node` deletes
them at the end of a step. Across processes (an engine process remotizes, the controller
localizes what AReaL's `serialize_value` carried): the bench's AReaL rows, checked tensor by
tensor (`tests/integration/test_bench.py::test_areal_rows_fetch_the_batch_both_ways_and_check_it`).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from areal_support import areal_imported

from distbatch import ShardClient
from distbatch.areal import FIELD, DistbatchRTensorBackend, install, parse_shard_id
from distbatch.errors import (
    CapacityError,
    InvalidArgumentError,
    ShardNotFoundError,
    StateError,
    WorkerUnavailableError,
)
from distbatch.launch import WorkerProcess

# AReaL's modules, set by `areal_for_this_module` (AReaL is imported only while this module's
# tests run: importing it reconfigures the whole process; see areal_support).
rtensor: Any = None
serialization: Any = None
RTensor: Any = None
TensorShardInfo: Any = None


@pytest.fixture(autouse=True, scope="module")
def areal_for_this_module() -> Iterator[None]:
    """AReaL imported, and loops made here are uvloop's, as in a process that imported AReaL
    (it installs uvloop's policy): so is our client's. All put back after the module."""
    global rtensor, serialization, RTensor, TensorShardInfo
    with areal_imported() as areal:
        rtensor, serialization = areal.rtensor, areal.serialization
        RTensor, TensorShardInfo = areal.RTensor, areal.TensorShardInfo
        asyncio.set_event_loop_policy(importlib.import_module("uvloop").EventLoopPolicy())
        yield


@pytest.fixture
def backend(shared_workers: list[WorkerProcess]) -> Iterator[DistbatchRTensorBackend]:
    """distbatch installed as this process's RTensor backend, storing on a shared worker; AReaL's
    default backend and its fetch buffer come back afterwards."""
    chosen = install(shared_workers[0].node, timeout=30.0)
    yield chosen
    rtensor.set_backend(None)
    rtensor.clear_fetch_buffer()
    chosen.close()


def result_of_an_engine() -> dict[str, Any]:
    """What an engine's call returns: tensors of several dtypes and shapes beside plain values."""
    generator = torch.Generator().manual_seed(7)
    return {
        "logprobs": torch.randn(3, 5, generator=generator, dtype=torch.float32),
        "values": torch.randn(3, 5, generator=generator).to(torch.bfloat16),
        "input_ids": torch.randint(0, 50_000, (3, 5), generator=generator),
        "loss_mask": torch.rand(3, 5, generator=generator) > 0.5,
        "seqlens": [torch.tensor(4), torch.arange(0)],  # a 0-d and an empty tensor
        "transposed": torch.arange(12, dtype=torch.int16).reshape(3, 4).t(),  # not contiguous
        "meta": {"step": 3, "tags": ("a", "b")},
    }


def assert_same(got: Any, want: Any) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for key in want:
            assert_same(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
    else:
        assert got == want


def test_remotize_then_localize_gives_back_every_tensor_as_it_was(backend: DistbatchRTensorBackend) -> None:
    result = result_of_an_engine()
    remote = RTensor.remotize(result, node_addr="engine-0")
    assert isinstance(remote["values"], RTensor) and remote["values"].data.is_meta
    assert remote["values"].dtype == torch.bfloat16  # AReaL's own HTTP backend sends it as float32
    assert parse_shard_id(remote["logprobs"].shard.shard_id)[0] == backend.worker
    rtensor.clear_fetch_buffer()  # no shortcut through AReaL's cache: every tensor is fetched
    assert_same(RTensor.localize(remote), result)


def test_one_remotize_is_one_put_however_many_tensors_it_holds(
    backend: DistbatchRTensorBackend, module_client: ShardClient
) -> None:
    trajectories = [{"input_ids": torch.arange(n), "logprobs": torch.zeros(n)} for n in range(1, 41)]
    before = backend.client.traffic()
    remote = RTensor.remotize(trajectories, node_addr="engine-0")
    moved = backend.client.traffic() - before
    assert moved.requests + moved.same_host_requests == 1
    rtensor.clear_fetch_buffer()
    assert_same(RTensor.localize(remote), trajectories)
    # Outside remotize, a store is sent at once (AReaL may call the backend directly).
    alone = backend.store(torch.ones(2))
    assert_same(backend.fetch([TensorShardInfo(shard_id=alone, node_addr="")]), [torch.ones(2)])


def test_a_remotize_that_fails_midway_stores_nothing(
    backend: DistbatchRTensorBackend, module_client: ShardClient
) -> None:
    held_before = module_client.list_tasks(backend.worker)["total"]

    class Unstorable(list):  # AReaL's remotize recurses into lists: this one fails it midway
        def __iter__(self) -> Iterator[Any]:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        RTensor.remotize([torch.ones(3), {"x": torch.zeros(2)}, [torch.ones(1), Unstorable()]], "engine-0")
    assert module_client.list_tasks(backend.worker)["total"] == held_before


def test_clear_node_deletes_the_shards_on_their_workers(
    backend: DistbatchRTensorBackend, module_client: ShardClient
) -> None:
    remote = RTensor.remotize({"a": torch.ones(4), "b": torch.zeros(2, 2)}, node_addr="engine-0")
    tasks = sorted(parse_shard_id(r.shard.shard_id)[1] for r in remote.values())
    held = {task for task, *_ in module_client.list_tasks(backend.worker)["tasks"]}
    assert set(tasks) <= held
    for node, shard_ids in RTensor.collect_shards(remote).items():
        asyncio.run(RTensor.clear_node(node, shard_ids))
    held = {task for task, *_ in module_client.list_tasks(backend.worker)["tasks"]}
    assert not set(tasks) & held
    asyncio.run(RTensor.clear_node("engine-0", [r.shard.shard_id for r in remote.values()]))  # again: nothing
    with pytest.raises(ShardNotFoundError) as info:
        RTensor.localize(remote)
    assert tasks[0] in str(info.value) and FIELD in str(info.value)


def test_a_shard_id_another_backend_made_is_refused_naming_the_fix(backend: DistbatchRTensorBackend) -> None:
    foreign = RTensor(shard=TensorShardInfo(shard_id="9b2c3f0e-uuid-of-the-http-backend", node_addr="n:1"),
                      data=torch.empty(2, device="meta"))  # fmt: skip
    with pytest.raises(InvalidArgumentError, match=r"distbatch.areal.install\(\)"):
        RTensor.localize(foreign)
    with pytest.raises(InvalidArgumentError, match="was not made by distbatch"):
        asyncio.run(backend.delete("n:1", ["distbatch://not an address/x"]))


def test_stores_from_many_threads_each_get_their_own_shard(backend: DistbatchRTensorBackend) -> None:
    tensors = [torch.full((3,), float(i)) for i in range(16)]
    ids: list[str | None] = [None] * len(tensors)

    def store(i: int) -> None:
        ids[i] = backend.store(tensors[i])

    threads = [threading.Thread(target=store, args=(i,)) for i in range(len(tensors))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(ids)) == len(tensors)
    shards = [TensorShardInfo(shard_id=i, node_addr="x") for i in ids]
    assert_same(backend.fetch(shards), tensors)


def test_without_a_worker_it_starts_its_own_and_close_stops_it() -> None:
    backend = DistbatchRTensorBackend(capacity="64K", timeout=30.0)
    try:
        small = backend.store(torch.arange(100))
        assert backend.worker in small
        started = backend._started
        assert started is not None and started.alive()
        with pytest.raises(CapacityError, match="--max-bytes"):
            backend.store(torch.zeros(1 << 16))  # 256 KiB past its 64 KiB
        assert_same(backend.fetch([TensorShardInfo(shard_id=small, node_addr="")]), [torch.arange(100)])
    finally:
        backend.close()
    assert not started.alive()
    with pytest.raises(StateError, match="closed"):
        backend.store(torch.ones(1))  # not a new worker behind a closed client


def test_a_dead_worker_is_named_with_the_tasks_the_fetch_lost(fresh_workers: list[WorkerProcess]) -> None:
    backend = DistbatchRTensorBackend(fresh_workers[0].node, timeout=10.0)
    try:
        lost = backend.store(torch.ones(3))
        kept = DistbatchRTensorBackend(fresh_workers[1].node, client=backend.client).store(torch.zeros(2))
        fresh_workers[0].kill()
        with pytest.raises(WorkerUnavailableError) as info:
            backend.fetch([TensorShardInfo(shard_id=i, node_addr="") for i in (kept, lost)])
        assert fresh_workers[0].node in str(info.value) and parse_shard_id(lost)[1] in str(info.value)
        assert_same(backend.fetch([TensorShardInfo(shard_id=kept, node_addr="")]), [torch.zeros(2)])
    finally:
        backend.close()


# --------------------------------------------------------------------------- against AReaL's own


@pytest.fixture(scope="module")
def areal_data_server() -> Iterator[str]:
    """AReaL's own storage server: its data blueprint on werkzeug's threaded server, as its RPC
    server runs it, serving this process's RTensor store (where `HttpRTensorBackend.store` puts)."""
    from flask import Flask
    from werkzeug.serving import make_server

    data_bp = importlib.import_module("areal.infra.rpc.guard.data_blueprint").data_bp
    app = Flask("areal-engine")
    app.register_blueprint(data_bp)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_port}"
    server.shutdown()
    thread.join(timeout=10)


def trajectories_of_a_step(seed: int) -> list[dict[str, Any]]:
    """What AReaL's rollout hands its trainer: padded [1, L] trajectories with an attention mask
    (remotize trims the padding), ragged lengths, bf16 values, nested metadata."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i in range(12):
        length = int(torch.randint(1, 40, (), generator=generator))
        width = length + int(torch.randint(0, 6, (), generator=generator))  # padding to trim
        mask = torch.zeros(1, width, dtype=torch.bool)
        mask[:, :length] = True
        out.append({
            "input_ids": torch.randint(0, 151_000, (1, width), generator=generator) * mask,
            "attention_mask": mask,
            "loss_mask": mask & (torch.rand(1, width, generator=generator) > 0.3),
            "logprobs": -torch.rand(1, width, generator=generator) * mask,
            "values": torch.randn(1, width, generator=generator).to(torch.bfloat16),
            "rewards": torch.rand(1, generator=generator),
            "versions": torch.full((1, width), i // 4, dtype=torch.int32),
            "info": {"group": f"prompt-{i // 4}", "scores": [torch.tensor(0.5), {"len": length}]},
        })  # fmt: skip
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_step_round_trips_as_on_areals_http_backend(
    seed: int, areal_data_server: str, shared_workers: list[WorkerProcess], module_client: ShardClient
) -> None:
    """The differential check: remotize, localize in a fresh view (AReaL's fetch buffer cleared)
    and clear_node give the same tensors, dtypes and structure on AReaL's HTTP backend and ours."""
    results, leftovers = {}, {}
    ours = DistbatchRTensorBackend(shared_workers[1].node, timeout=30.0)
    sides = (("areal", rtensor.HttpRTensorBackend(), areal_data_server), ("distbatch", ours, "e"))
    try:
        for name, backend, node in sides:
            rtensor.set_backend(backend)
            try:
                remote = RTensor.remotize(trajectories_of_a_step(seed), node_addr=node)
                carried = json.loads(json.dumps(serialization.serialize_value(remote)))
                rtensor.clear_fetch_buffer()
                results[name] = RTensor.localize(serialization.deserialize_value(carried))
                stored = RTensor.collect_shards(remote)
                for where, shard_ids in stored.items():
                    asyncio.run(RTensor.clear_node(where, shard_ids))
                if name == "areal":
                    leftovers[name] = rtensor.storage_stats()["num_tensors"]
                else:  # this test's own tasks, still held on the shared worker
                    mine = [parse_shard_id(i)[1] for ids in stored.values() for i in ids]
                    leftovers[name] = len(module_client.task_fields(ours.worker, mine)[0])
            finally:
                rtensor.set_backend(None)
                rtensor.clear_fetch_buffer()
    finally:
        ours.close()
    assert_same(results["distbatch"], results["areal"])
    assert leftovers == {"areal": 0, "distbatch": 0}
