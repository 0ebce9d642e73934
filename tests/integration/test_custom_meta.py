"""Per-task custom metadata on the controller (TransferQueue's custom_meta): set, read, sampled on,
checkpointed, dropped with its task, and refused whole when anything in it is bad."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import pytest
import torch

from distbatch import DistributedBatchMemory
from distbatch.client import ShardClient
from distbatch.controller import Controller
from distbatch.controller.arguments import MAX_CUSTOM_META_BYTES
from distbatch.controller.remote import RemoteController
from distbatch.controller.server import ControllerServer
from distbatch.errors import InvalidArgumentError, UnknownPartitionError
from distbatch.launch import WorkerProcess
from distbatch.samplers import SeqlenBalancedSampler


def put_tasks(ctl: Controller, node: str, lengths: list[int], client: ShardClient | None = None) -> list[str]:
    ids = [f"cm-{uuid.uuid4().hex[:8]}-{i}" for i in range(len(lengths))]
    batch = DistributedBatchMemory.from_dict({"input_ids": [torch.arange(n) for n in lengths]}, task_ids=ids)
    ctl.put("p", batch.to_remote(node, client) if client else batch.to_remote(node))
    return ids


def test_set_get_checkpoint_and_clear(shared_workers: list[WorkerProcess], tmp_path) -> None:
    ctl = Controller()
    ids = put_tasks(ctl, shared_workers[0].node, [3, 3, 3])
    ctl.set_custom_meta("p", {ids[0]: {"total_lengths": 7, "source": "gsm8k"}, ids[1]: {"total_lengths": 2}})
    assert ctl.get_custom_meta("p", ids) == {
        ids[0]: {"total_lengths": 7, "source": "gsm8k"},
        ids[1]: {"total_lengths": 2},
    }
    got = ctl.get_custom_meta("p", ids[:1])
    got[ids[0]]["total_lengths"] = 0  # a copy: the controller's stays
    assert ctl.get_custom_meta("p", ids[:1])[ids[0]]["total_lengths"] == 7
    ctl.set_custom_meta("p", {ids[0]: {"total_lengths": 9}})  # replaces, as theirs
    assert ctl.get_custom_meta("p", ids[:1]) == {ids[0]: {"total_lengths": 9}}

    path = ctl.save_checkpoint(tmp_path / "ctl.json")
    restored = Controller()
    restored.load_checkpoint(path)
    assert restored.get_custom_meta("p", ids) == ctl.get_custom_meta("p", ids)

    ctl.clear_tasks("p", ids[:1])
    assert ctl.get_custom_meta("p", ids) == {ids[1]: {"total_lengths": 2}}
    ctl.clear_partition("p")
    assert ctl.get_custom_meta("p", ids) == {}


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"nope": {"a": 1}}, "has no tasks"),
        ({"FIRST": [1, 2]}, "must be an object"),
        ({"FIRST": {"a": float("nan")}}, "not JSON"),
        ({"FIRST": {"a": object()}}, "not JSON"),
        ({"FIRST": {"a": "x" * MAX_CUSTOM_META_BYTES}}, "over"),
        ({"FIRST": {1: 2}}, "string keys"),
        ({"bad id!": {"a": 1}}, "task_id"),
        ({"FIRST": {"total_lengths": 812.0}}, "non-negative int"),
        ({"FIRST": {"total_lengths": "812"}}, "non-negative int"),
        ({"FIRST": {"total_lengths": -1}}, "non-negative int"),
    ],
)
def test_bad_custom_meta_sets_nothing(shared_workers: list[WorkerProcess], bad: dict, match: str) -> None:
    ctl = Controller()
    ids = put_tasks(ctl, shared_workers[0].node, [2, 2])
    ctl.set_custom_meta("p", {ids[1]: {"keep": True}})
    bad = {(ids[0] if k == "FIRST" else k): v for k, v in bad.items()}
    with pytest.raises(ValueError, match=match):  # InvalidArgumentError, or InvalidIdError for the id
        ctl.set_custom_meta("p", {ids[1]: {"keep": False}, **bad})
    assert ctl.get_custom_meta("p", ids) == {ids[1]: {"keep": True}}
    with pytest.raises(UnknownPartitionError):
        ctl.set_custom_meta("nowhere", {ids[0]: {}})
    ctl.clear_partition("p")


def test_seqlen_sampler_balances_on_total_lengths_over_http(
    shared_workers: list[WorkerProcess], serve: Callable[..., ControllerServer], client: ShardClient
) -> None:
    # Stored lengths are all equal; custom_meta says two tasks are long: the split follows custom_meta.
    ctl = Controller(SeqlenBalancedSampler(1, 2))
    rc = RemoteController(serve(ctl).address, client=client, timeout=20)
    ids = put_tasks(ctl, shared_workers[0].node, [4, 4, 4, 4], client)
    rc.set_custom_meta("p", {ids[0]: {"total_lengths": 100}, ids[1]: {"total_lengths": 100}})
    assert rc.get_custom_meta("p", ids) == {ids[0]: {"total_lengths": 100}, ids[1]: {"total_lengths": 100}}
    r0 = rc.get_meta("p", "train", ["input_ids"], 2, dp_rank=0, batch_index=0)
    r1 = rc.get_meta("p", "train", ["input_ids"], 2, dp_rank=1, batch_index=0)
    for portion in (r0, r1):  # one long (100) and one short (counted as 1) per rank
        assert len(set(portion.task_ids) & set(ids[:2])) == 1
    with pytest.raises(InvalidArgumentError, match="has no tasks"):
        rc.set_custom_meta("p", {"missing-task": {"a": 1}})
    with pytest.raises(InvalidArgumentError, match="must be an object"):  # not turned into one on the way
        rc.set_custom_meta("p", {ids[2]: [("total_lengths", 5)]})  # type: ignore[dict-item]
    assert ids[2] not in rc.get_custom_meta("p", ids)
    ctl.clear_partition("p")
