"""Reused task ids: a batch handle reads and deletes only the shards it was made for.

A put of task ids and fields a worker already holds replaces those values. Each put has a
generation on its worker, carried in the batch's metadata (also through JSON and pickle); a
read or clear of an older handle is refused with `ShardsReplacedError` naming the replaced
shards, and changes nothing, while puts that add other fields to the same tasks leave older
handles valid. Real workers on loopback, over HTTP and over the same-host path.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from distbatch import (
    ClearError,
    Controller,
    DistributedBatchMemory,
    ShardClient,
    ShardsReplacedError,
    WorkerGroup,
)
from distbatch.launch import WorkerProcess
from distbatch.transport.shm import ENV_HOST_ID, ENV_SWITCH

DBM = DistributedBatchMemory


def batch(ids: list[str], fill: float, **more: torch.Tensor) -> DBM:
    return DBM.from_dict({"x": torch.full((len(ids), 3), fill), **more}, task_ids=ids)


@pytest.fixture(params=["http", "same_host"])
def node_and_client(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    start_worker: Callable[..., WorkerProcess],
) -> Iterator[tuple[str, ShardClient]]:
    """One worker of the test's own, reached over HTTP or over shared memory."""
    if request.param == "same_host":
        monkeypatch.delenv(ENV_SWITCH, raising=False)
        monkeypatch.delenv(ENV_HOST_ID, raising=False)
    worker = start_worker()
    with ShardClient(timeout=20.0) as client:
        yield worker.node, client
        if request.param == "same_host":
            assert client.traffic().same_host_received > 0, "the same-host path was not taken"


def test_a_replaced_batch_refuses_reads_and_clear_and_the_new_one_is_untouched(
    node_and_client: tuple[str, ShardClient],
) -> None:
    node, client = node_and_client
    ids = ["r0", "r1", "r2"]
    first = batch(ids, 1.0).to_remote(node, client)
    assert torch.equal(first.to_local()["x"], torch.ones(3, 3))
    second = batch(ids, 2.0).to_remote(node, client)  # the same ids and field: replaces them

    stale = DBM.from_meta(first.meta, client)  # no cached columns: every read goes to the worker
    with pytest.raises(ShardsReplacedError, match=r"3 shard\(s\) were replaced .*r0/x") as caught:
        stale.to_local()
    assert caught.value.status == 409 and caught.value.node == node
    with pytest.raises(ClearError, match="replaced by a later put") as cleared:
        stale.clear()
    assert isinstance(cleared.value.failed[node], ShardsReplacedError)

    # The refused clear deleted nothing: the second batch reads its own data, then clears it.
    assert torch.equal(DBM.from_meta(second.meta, client).to_local()["x"], torch.full((3, 3), 2.0))
    assert second.clear() == 3
    assert client.stats(node)["shards"] == 0


def test_a_partly_replaced_batch_names_only_the_replaced_shards(
    start_worker: Callable[..., WorkerProcess],
) -> None:
    node = start_worker().node
    with ShardClient(timeout=20.0) as client:
        first = batch(["p0", "p1", "p2", "p3"], 1.0).to_remote(node, client)
        later = batch(["p2"], 9.0).to_remote(node, client)
        fresh = DBM.from_meta(first.meta, client)
        # The tasks nobody replaced still read and clear through the old handle.
        assert torch.equal(fresh[:2].to_local()["x"], torch.ones(2, 3))
        with pytest.raises(ShardsReplacedError, match=r"1 shard\(s\) were replaced by a later put.*p2/x"):
            fresh.to_local()
        assert fresh[[0, 1, 3]].clear() == 3
        assert torch.equal(DBM.from_meta(later.meta, client).to_local()["x"], torch.full((1, 3), 9.0))
        later.clear()


def test_a_later_put_of_other_fields_leaves_the_first_batch_valid(
    start_worker: Callable[..., WorkerProcess],
) -> None:
    node = start_worker().node
    with ShardClient(timeout=20.0) as client:
        ids = ["f0", "f1"]
        inputs = batch(ids, 1.0).to_remote(node, client)
        rewards = DBM.from_dict({"reward": torch.tensor([0.5, 0.25])}, task_ids=ids).to_remote(node, client)
        both = inputs.union(rewards)
        local = DBM.from_meta(both.meta, client).to_local()
        assert torch.equal(local["x"], torch.ones(2, 3))
        assert torch.equal(local["reward"], torch.tensor([0.5, 0.25]))
        assert inputs.clear() == 2 and rewards.clear() == 2


@pytest.mark.parametrize("carry", ["json", "pickle"])
def test_the_generation_travels_with_the_metadata(
    start_worker: Callable[..., WorkerProcess], carry: str
) -> None:
    node = start_worker().node
    with ShardClient(timeout=20.0) as client:
        first = batch(["j0", "j1"], 1.0).to_remote(node, client)
        text = first.to_json()
        assert '"generations"' in text
        moved = DBM.from_json(text, client) if carry == "json" else pickle.loads(pickle.dumps(first))
        assert moved.meta == first.meta
        second = batch(["j0", "j1"], 2.0).to_remote(node, client)
        moved = DBM.from_meta(moved.meta, client)
        with pytest.raises(ShardsReplacedError):
            moved.to_local()
        second.clear()


def test_a_put_in_several_requests_is_one_generation(start_worker: Callable[..., WorkerProcess]) -> None:
    """A put staged over many requests (the request bound splits it) then committed is one put:
    its tasks share one generation, and a repeat of it makes the first handle stale."""
    node = start_worker().node
    with ShardClient(timeout=20.0, max_bytes_per_request=64) as client:
        ids = [f"s{i}" for i in range(12)]
        first = batch(ids, 1.0).to_remote(node, client)
        generations = first.meta.fields["x"].generations
        assert generations is not None and len(set(generations.tolist())) == 1 and generations[0] > 0
        assert torch.equal(first.to_local()["x"], torch.ones(12, 3))
        second = batch(ids, 2.0).to_remote(node, client)
        assert second.meta.fields["x"].generations[0] != generations[0]
        with pytest.raises(ShardsReplacedError, match=r"shard\(s\) were replaced"):
            DBM.from_meta(first.meta, client).to_local()
        second.clear()


def test_an_engine_result_names_its_generation(echo_pair: WorkerGroup, module_client: ShardClient) -> None:
    node = echo_pair.nodes[0]
    inputs = batch(["e0", "e1"], 3.0).to_remote(node, module_client)
    result = echo_pair.call_on(node, "columns", inputs, scale=2.0)
    gens = result.meta.fields["y"].generations
    assert gens is not None and gens.all()
    assert torch.equal(result.to_local()["y"], torch.full((2, 3), 6.0))
    # A second call storing the same ids and fields makes the first result stale; its inputs
    # (other fields of the same tasks) stay valid.
    again = echo_pair.call_on(node, "columns", inputs, scale=3.0)
    with pytest.raises(ShardsReplacedError):
        DBM.from_meta(result.meta, module_client).to_local()
    assert torch.equal(DBM.from_meta(inputs.meta, module_client).to_local()["x"], torch.full((2, 3), 3.0))
    again.clear()
    inputs.clear()


@pytest.mark.parametrize(
    "generations",
    [[1], [1, 2, 3], ["1", 2], [-1, 2], [1 << 53, 1], [1.5, 2], None, -1, 1 << 53, True],
    ids=[
        "short",
        "long",
        "string",
        "negative",
        "too-big",
        "float",
        "null-list",
        "one-negative",
        "one-too-big",
        "bool",
    ],
)
def test_bad_generations_are_a_400_that_changes_nothing(
    worker: WorkerProcess, client: ShardClient, generations: object
) -> None:
    stored = batch(["g0", "g1"], 1.0).to_remote(worker.node, client)
    body = {"task_ids": ["g0", "g1"], "fields": ["x"], "generations": generations}
    if generations is None:
        body = {"task_ids": ["g0", "g1"], "generations": [1, 2]}  # generations without fields
    for path in ("/v1/shards/fetch", "/v1/shards/delete"):
        if path.endswith("fetch") and generations is None:
            continue
        with pytest.raises(Exception, match="400") as caught:
            client.request_json(worker.node, "POST", path, body)
        assert "generations" in str(caught.value)
    assert client.stats(worker.node)["shards"] == 2
    assert torch.equal(stored.to_local()["x"], torch.ones(2, 3))
    stored.clear()


def test_one_generation_stands_for_every_task_of_a_request(
    worker: WorkerProcess, client: ShardClient
) -> None:
    """A product of one put's values names its generation once (what the client sends): read and
    deleted as with one per task, and refused once a later put replaced one of them."""
    first = batch(["o0", "o1"], 1.0).to_remote(worker.node, client)
    generation = int(first.meta.fields["x"].generations[0])
    body = {"task_ids": ["o0", "o1"], "fields": ["x"], "generations": generation}
    batch(["o1"], 2.0).to_remote(worker.node, client)  # replaces o1's value
    for path in ("/v1/shards/fetch", "/v1/shards/delete"):
        with pytest.raises(ShardsReplacedError, match="o1/x"):
            client.request_json(worker.node, "POST", path, body)
    assert client.stats(worker.node)["shards"] == 2
    client.delete(worker.node, task_ids=["o0", "o1"])


def test_batches_the_controller_hands_out_name_their_generations(
    start_worker: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    """`get_meta` answers carry the generations the puts reported, also after a checkpoint; a
    task whose field is put again (same worker) is refused through an earlier answer."""
    node = start_worker().node
    with ShardClient(timeout=20.0) as client:
        ids = ["c0", "c1", "c2"]
        controller = Controller()
        controller.put("p", batch(ids, 1.0).to_remote(node, client))
        handed = controller.get_meta("p", "train", ["x"], 3)
        assert handed.meta.fields["x"].generations is not None
        assert torch.equal(DBM.from_meta(handed.meta, client).to_local()["x"], torch.ones(3, 3))

        restored = Controller()
        restored.load_checkpoint(controller.save_checkpoint(tmp_path / "ctl.json"))
        again = restored.get_meta("p", "critic", ["x"], 3)
        assert again.meta == handed.meta

        replaced = batch(ids, 2.0).to_remote(node, client)
        controller.put("p", replaced)
        controller.reset_consumption("p", "train")
        fresh = controller.get_meta("p", "train", ["x"], 3)
        assert torch.equal(DBM.from_meta(fresh.meta, client).to_local()["x"], torch.full((3, 3), 2.0))
        with pytest.raises(ShardsReplacedError):
            DBM.from_meta(handed.meta, client).to_local()
        replaced.clear()
