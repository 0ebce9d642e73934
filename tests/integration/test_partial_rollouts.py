"""Partial rollouts: a task's tensor field grows by later appends, on the worker that holds it.

`DistributedBatchMemory.extend` sends only the new rows, each to the worker holding the task's
value; the worker appends there, under a new generation, so the old handle reads nothing and an
extend through it again is refused (never applied twice). Real workers on loopback, over HTTP
(the module's shared workers) and over the same-host path (a worker of the test's own).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch
from batch_support import remote

from distbatch import (
    BatchStatus,
    DistributedBatchMemory,
    InvalidArgumentError,
    RequestError,
    ShardClient,
    ShardNotFoundError,
    ShardsReplacedError,
)
from distbatch.controller import Controller
from distbatch.controller.remote import RemoteController
from distbatch.samplers import GRPOGroupNSampler

DBM = DistributedBatchMemory


def prompts(n: int, width: int = 1) -> DBM:
    """`n` tasks whose `ids` are ragged (task i has i + 2 tokens, each `width` wide) and a reward."""
    ids = [
        torch.arange(i, i + 2 * (i + 2) * width, 2, dtype=torch.int32).reshape(i + 2, width) for i in range(n)
    ]
    return DBM.from_dict(
        {"ids": ids, "reward": torch.arange(n, dtype=torch.float32)}, task_ids=[f"p{i}" for i in range(n)]
    )


def tails(n: int, width: int = 1, start: int = 1000) -> list[torch.Tensor]:
    return [torch.full((i % 3, width), start + i, dtype=torch.int32) for i in range(n)]


def test_extend_appends_on_the_holding_workers_and_a_gather_returns_the_whole(
    status: BatchStatus, convert: Callable[[DBM], DBM]
) -> None:
    local = prompts(7, width=2)
    batch = convert(local)
    grown = batch.extend({"ids": tails(7, width=2)})
    assert grown.status is status
    expected = [torch.cat([a, b]) for a, b in zip(local["ids"], tails(7, width=2))]
    assert grown.lengths("ids") == [len(e) for e in expected]  # from metadata when REMOTE
    assert all(torch.equal(a, b) for a, b in zip(grown["ids"], expected))
    assert torch.equal(grown["reward"], local["reward"])  # other fields as they were
    again = grown.extend({"ids": tails(7, width=2, start=2000)})
    assert all(
        torch.equal(a, torch.cat([e, t]))
        for a, e, t in zip(again["ids"], expected, tails(7, width=2, start=2000))
    )
    packed, cu_seqlens = again.packed("ids")
    assert cu_seqlens.tolist()[-1] == packed.shape[0] == sum(again.lengths("ids"))
    again.clear()  # the latest handle deletes; the older ones find nothing left (no error)


def test_only_the_new_rows_travel(remote: Callable[..., DBM], module_client: ShardClient) -> None:
    big = DBM.from_dict({"ids": [torch.arange(50_000, dtype=torch.int32) for _ in range(4)]})
    batch = remote(big).select_fields(["ids"])
    before = module_client.traffic()
    grown = batch.extend({"ids": [torch.arange(10, dtype=torch.int32)] * 4})
    sent = (module_client.traffic() - before).bytes_sent
    assert sent < 4 * 50_000 * 4 / 10, f"{sent} bytes sent: the prefix travelled again"
    assert grown.lengths("ids") == [50_010] * 4
    grown.clear()


def test_the_old_handle_is_stale_and_an_extend_through_it_is_refused(remote: Callable[..., DBM]) -> None:
    batch = remote(prompts(6))
    grown = batch.extend({"ids": tails(6)})
    with pytest.raises(ShardsReplacedError):
        batch["ids"]
    with pytest.raises(ShardsReplacedError):  # a retry of the same extend: refused, not applied twice
        batch.extend({"ids": tails(6)})
    assert grown.lengths("ids") == [len(v) for v in grown["ids"]]  # nothing was appended twice
    assert torch.equal(batch["reward"], torch.arange(6, dtype=torch.float32))  # untouched fields still read
    grown.clear()


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ({"ids": [torch.zeros(1, 1, dtype=torch.int64)] * 3}, "is I32"),
        ({"ids": [torch.zeros(1, 2, dtype=torch.int32)] * 3}, "same trailing dims"),
        ({"reward": [torch.zeros(1)] * 3}, "at least one dimension"),
        ({"nope": [torch.zeros(1)] * 3}, "not in the batch"),
        ({"ids": [torch.zeros(1, 1, dtype=torch.int32)] * 2}, "one row per task"),
    ],
)
def test_rows_that_cannot_extend_are_refused_before_anything_is_sent(
    remote: Callable[..., DBM], module_client: ShardClient, rows: dict[str, list[torch.Tensor]], message: str
) -> None:
    batch = remote(prompts(3))
    before = module_client.traffic()
    data = rows if len(next(iter(rows.values()))) == 3 else DBM.from_dict(rows, task_ids=["p0", "p1"])
    with pytest.raises(InvalidArgumentError, match=message):
        batch.extend(data)
    assert (module_client.traffic() - before).bytes_sent == 0
    assert batch.lengths("ids") == [len(v) for v in batch["ids"]] == [2, 3, 4]


def test_the_worker_refuses_an_append_it_cannot_make_and_keeps_what_it_held(
    nodes: list[str], module_client: ShardClient, pushed: list[DBM]
) -> None:
    """The worker checks too (a client of its own may skip ours): another dtype is 400
    `bad_append`, a value the append expects but that is gone is 404; nothing changes."""
    batch = prompts(2).to_remote(nodes[0], module_client)
    pushed.append(batch)
    generation = int(batch.meta.fields["ids"].generations[0])
    bundle, _ = DBM.from_dict(
        {"ids": [torch.zeros(1, 1, dtype=torch.int64)] * 2}, task_ids=["p0", "p1"]
    ).export_bundle(nodes[0])
    bundle.columns["ids"].append = torch.tensor([generation, 0]).numpy()
    with pytest.raises(RequestError) as refused:
        module_client.put_bundle(nodes[0], bundle)
    assert (refused.value.status, refused.value.code) == (400, "bad_append")
    bundle, _ = DBM.from_dict(
        {"ids": [torch.zeros(1, 1, dtype=torch.int32)] * 2}, task_ids=["p0", "gone"]
    ).export_bundle(nodes[0])
    bundle.columns["ids"].append = torch.tensor([generation, 12345]).numpy()
    with pytest.raises(ShardNotFoundError, match="gone/ids"):
        module_client.put_bundle(nodes[0], bundle)
    assert [len(v) for v in batch["ids"]] == [2, 3]


def test_an_extend_split_over_staged_requests_lands_at_once(nodes: list[str]) -> None:
    with ShardClient(max_keys_per_request=3) as client:  # 8 tasks: three staged parts, one commit
        batch = prompts(8).to_remote(nodes[1], client)
        try:
            grown = batch.extend({"ids": tails(8)})
            assert len(set(grown.meta.fields["ids"].generations.tolist())) == 1
            expected = [torch.cat([b, c]) for b, c in zip(prompts(8)["ids"], tails(8))]
            assert all(torch.equal(a, b) for a, b in zip(grown["ids"], expected))
        finally:
            client.delete(nodes[1], task_ids=batch.task_ids)


def test_extend_over_the_same_host_path(same_host: tuple[str, ShardClient]) -> None:
    node, client = same_host
    batch = prompts(5).to_remote(node, client)
    grown = batch.extend({"ids": tails(5)})
    assert all(
        torch.equal(a, torch.cat([b, c])) for a, b, c in zip(grown["ids"], prompts(5)["ids"], tails(5))
    )
    grown.clear()


# --------------------------------------------------------------------------- the controller's side


@pytest.fixture(params=["local", "http"])
def controller(request: pytest.FixtureRequest, serve: Callable[..., Any]) -> Any:
    """A controller in this process, or one served and reached over HTTP."""
    ctl = Controller(GRPOGroupNSampler(n_samples_per_prompt=2))
    return ctl if request.param == "local" else RemoteController(serve(ctl).address, timeout=20)


def generating(node: str, tag: str, groups: int) -> DBM:
    """`groups` GRPO groups of 2 responses whose `tokens` are a first chunk, on `node`."""
    ids = [f"{tag}-g{g}-r{j}" for g in range(groups) for j in range(2)]
    chunks = [torch.full((1 + i % 2,), i, dtype=torch.int32) for i in range(len(ids))]
    return remote(node, ids, tokens=chunks, prompt=torch.arange(len(ids)))


def test_a_partial_put_is_located_but_not_produced_until_its_producer_completes_it(
    nodes: list[str], controller: Any
) -> None:
    tag = uuid.uuid4().hex[:6]
    first = generating(nodes[0], tag, 2)
    assert controller.put("rollout", first, version=3, partial=["tokens"]) == 4
    assert len(controller.get_meta("rollout", "train", ["tokens"], 2)) == 0  # never served partial
    assert len(controller.get_meta("rollout", "look", ["prompt"], 2)) == 2  # the complete field is
    assert controller.production_status("rollout", ["tokens"])["produced"] == {"tokens": 0}
    assert controller.summary()["partitions"]["rollout"]["fields"]["tokens"]["partial"] == 4
    inflight = controller.inflight("rollout")
    assert inflight.task_ids == first.task_ids and set(inflight.fields) == {"tokens", "prompt"}
    grown = inflight.extend({"tokens": [torch.tensor([7], dtype=torch.int32)] * 4})  # resumed, from metadata
    controller.put("rollout", grown.select_fields(["tokens"]), partial=True, version=4)  # still going
    done = grown.extend({"tokens": [torch.tensor([8], dtype=torch.int32)] * 4})
    controller.put("rollout", done.select_fields(["tokens"]), version=5)  # the producer says: complete
    assert len(controller.inflight("rollout")) == 0
    served = controller.get_meta("rollout", "train", ["tokens"], 4)
    assert [len(t) for t in served["tokens"]] == [n + 2 for n in first.lengths("tokens")]
    assert set(controller.policy_versions("rollout", served.task_ids).values()) == {3}  # the oldest part
    assert controller.clear_partition("rollout") == 8


def test_clear_deletes_in_flight_values_on_their_workers(
    nodes: list[str], controller: Any, module_client: ShardClient
) -> None:
    batch = generating(nodes[1], uuid.uuid4().hex[:6], 1)
    controller.put("rollout", batch, partial=True)
    assert controller.clear_tasks("rollout", batch.task_ids) == 4
    assert module_client.task_fields(nodes[1], batch.task_ids) == ({}, batch.task_ids)


def test_after_a_restore_in_flight_tasks_are_reissued_once(nodes: list[str], controller: Any) -> None:
    tag = uuid.uuid4().hex[:6]
    finished, stopped, resumed = (generating(nodes[2], f"{tag}{k}", 1) for k in "abc")
    controller.put("rollout", finished)
    controller.put("rollout", stopped, partial=True)
    controller.put("rollout", resumed, partial=["tokens"])
    state = controller.state_dict()
    assert len(controller.reissue("rollout")) == 0  # nothing was restored yet
    controller.load_state_dict(state)  # the trainer restarted from its checkpoint
    done = resumed.extend({"tokens": [torch.ones(1, dtype=torch.int32)] * 2})
    controller.put("rollout", done.select_fields(["tokens"]))  # finished meanwhile: not reissued
    again = controller.reissue("rollout")
    assert again.task_ids == stopped.task_ids
    assert all(torch.equal(a, b) for a, b in zip(again["tokens"], stopped["tokens"]))  # its prefix, to resume
    assert len(controller.reissue("rollout")) == 0  # once
    assert controller.summary()["reissued"] == 2
    assert controller.inflight("rollout").task_ids == stopped.task_ids  # still in flight until completed
    controller.clear_partition("rollout")


def test_rows_that_are_one_tensor_for_several_tasks_extend_each(remote: Callable[..., DBM]) -> None:
    """Finished responses get the same end-of-sequence tensor, others a longer chunk: each task
    appends its own rows (the same object for several tasks is not a value to share here)."""
    batch = remote(prompts(4))
    eos = torch.tensor([[-1]], dtype=torch.int32)
    rows = [eos, torch.zeros(3, 1, dtype=torch.int32), eos, eos]
    grown = batch.extend({"ids": rows})
    assert grown.lengths("ids") == [3, 6, 5, 6]
    assert all(torch.equal(g[-len(r) :], r) for g, r in zip(grown["ids"], rows))
    grown.clear()


def test_a_refused_staged_extend_leaves_no_reservation(nodes: list[str], module_client: ShardClient) -> None:
    """An extend split into staged parts through a stale handle: the commit is refused (409) and
    the client aborts the stage, so nothing stays reserved against the worker's capacity."""
    with ShardClient(max_keys_per_request=2) as client:
        batch = prompts(6).to_remote(nodes[2], client)
        grown = batch.extend({"ids": tails(6)})
        with pytest.raises(ShardsReplacedError):
            batch.extend({"ids": tails(6)})
        assert client.stats(nodes[2])["staged_bytes"] == 0
        grown.clear()


def test_a_task_resumed_after_a_restore_is_not_reissued(nodes: list[str], controller: Any) -> None:
    tag = uuid.uuid4().hex[:6]
    first, second = generating(nodes[0], f"{tag}a", 1), generating(nodes[0], f"{tag}b", 1)
    controller.put("rollout", first, partial=True)
    controller.put("rollout", second, partial=True)
    controller.load_state_dict(controller.state_dict())
    resumed = controller.inflight("rollout").select_fields(["tokens"])[:2]  # a producer took `first`
    assert resumed.task_ids == first.task_ids
    more = resumed.extend({"tokens": [torch.ones(1, dtype=torch.int32)] * 2})
    controller.put("rollout", more, partial=True)  # still in flight, but its producer has it
    assert controller.reissue("rollout").task_ids == second.task_ids
    controller.clear_partition("rollout")
