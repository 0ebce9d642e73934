"""Policy versions and staleness, on a `Controller` and on one served over HTTP (the same calls,
the same answers): a put says which policy version generated its tasks, the controller knows the
trainer's version, and a consumer asks for tasks at most k versions old, leaving older ones for
later (`stale="wait"`) or deleting and counting them (`stale="drop"`), with every sampler."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch
from batch_support import remote, shards_on

from distbatch import InvalidArgumentError, ShardClient
from distbatch.batch import BatchStatus
from distbatch.controller import Controller
from distbatch.controller.remote import RemoteController
from distbatch.launch import WorkerProcess
from distbatch.samplers import BaseSampler, GRPOGroupNSampler, SeqlenBalancedSampler, SequentialSampler

N = 4  # responses per prompt


def groups(node: str, tag: str, count: int) -> Any:
    """`count` GRPO groups of N tasks, stored on `node`."""
    ids = [f"{tag}-g{g}-r{j}" for g in range(count) for j in range(N)]
    lengths = [3 + (i % 7) for i in range(len(ids))]
    return remote(
        node,
        ids,
        input_ids=[torch.arange(k) for k in lengths],
        uid=[f"{tag}-g{i // N}" for i in range(len(ids))],
    )


@pytest.fixture(params=["local", "http"])
def make(request: pytest.FixtureRequest, serve: Callable[..., Any]) -> Callable[[BaseSampler], Any]:
    """A controller with the given sampler: in this process, or served and reached over HTTP."""

    def build(sampler: BaseSampler) -> Any:
        controller = Controller(sampler)
        if request.param == "local":
            return controller
        return RemoteController(serve(controller).address, timeout=20)

    return build


def test_versions_are_kept_shown_and_the_older_wins(
    shared_workers: list[WorkerProcess], make: Callable[..., Any]
) -> None:
    node = shared_workers[0].node
    ctl = make(SequentialSampler())
    tag = uuid.uuid4().hex[:6]
    first, second = groups(node, f"{tag}a", 1), groups(node, f"{tag}b", 1)
    ctl.put("p", first, version=3)
    ctl.put("p", second, version=[5, 6, 7, 8])
    ctl.put("p", remote(node, first.task_ids[:2], score=torch.ones(2)), version=9)  # a later stage
    ctl.put("p", remote(node, second.task_ids[:1], extra=torch.ones(1)), version=2)  # an older part
    ctl.put("p", remote(node, second.task_ids[1:2], unversioned=torch.ones(1)))
    assert ctl.policy_versions("p", [*first.task_ids, *second.task_ids, "nope"]) == {
        **dict.fromkeys(first.task_ids, 3),
        **dict(zip(second.task_ids, [2, 6, 7, 8])),
    }
    assert ctl.policy_version() == 0
    ctl.set_policy_version(11)
    summary = ctl.summary()
    assert summary["policy_version"] == 11
    assert summary["partitions"]["p"]["policy_versions"] == {"2": 1, "3": 4, "6": 1, "7": 1, "8": 1}
    assert summary["staleness"] == {"served": {}, "dropped": 0}
    ctl.clear_partition("p")


def test_bad_versions_and_staleness_arguments_are_refused_and_register_nothing(
    shared_workers: list[WorkerProcess], make: Callable[..., Any]
) -> None:
    node = shared_workers[0].node
    ctl = make(SequentialSampler())
    batch = groups(node, uuid.uuid4().hex[:6], 1)
    for version, message in [([1, 2], "2 versions for 4 tasks"), (-1, "version"), ("new", "must be an int")]:
        with pytest.raises(InvalidArgumentError, match=message):
            ctl.put("p", batch, version=version)
    assert ctl.partitions() == []
    for bad in (-1, 1.5, "1"):
        with pytest.raises(InvalidArgumentError, match="max_staleness"):
            ctl.get_meta("p", "train", ["input_ids"], 4, max_staleness=bad)
    with pytest.raises(InvalidArgumentError, match=r"stale must be one of \['wait', 'drop'\]"):
        ctl.get_meta("p", "train", ["input_ids"], 4, max_staleness=1, stale="skip")
    with pytest.raises(InvalidArgumentError, match="version"):
        ctl.set_policy_version(-1)
    batch.clear()


@pytest.mark.parametrize(
    "sampler",
    [SequentialSampler(), GRPOGroupNSampler(n_samples_per_prompt=N)],
    ids=["sequential", "grpo"],
)
def test_stale_tasks_wait_for_a_looser_consumer(
    shared_workers: list[WorkerProcess], make: Callable[..., Any], sampler: BaseSampler
) -> None:
    """`stale="wait"`: tasks older than allowed are not handed out, and stay for a consumer that
    allows them; what was served is counted by staleness."""
    node = shared_workers[0].node
    ctl = make(sampler)
    tag = uuid.uuid4().hex[:6]
    old, new = groups(node, f"{tag}o", 2), groups(node, f"{tag}n", 1)
    ctl.put("p", old, version=0)
    ctl.put("p", new, version=2)
    ctl.set_policy_version(3)
    # None is 0 versions old; the new group is 1; the old ones 3.
    assert ctl.get_meta("p", "train", ["input_ids"], N, max_staleness=0).status is BatchStatus.EMPTY
    fresh = ctl.get_meta("p", "train", ["input_ids"], N, max_staleness=1)
    assert fresh.task_ids == new.task_ids
    assert ctl.get_meta("p", "train", ["input_ids"], N, max_staleness=1).status is BatchStatus.EMPTY
    assert ctl.production_status("p")["tasks"] == 3 * N  # the old ones wait, still there
    looser = ctl.get_meta("p", "train", ["input_ids"], 2 * N, max_staleness=3)
    assert sorted(looser.task_ids) == sorted(old.task_ids)
    assert ctl.summary()["staleness"] == {"served": {"1": N, "3": 2 * N}, "dropped": 0}
    ctl.clear_partition("p")


def test_stale_groups_are_dropped_whole_deleted_and_counted(
    shared_workers: list[WorkerProcess], make: Callable[..., Any]
) -> None:
    """`stale="drop"`: the stale ready tasks go from the partition and from the workers that held
    them, GRPO groups whole; the fresh ones are served."""
    node = shared_workers[1].node
    ctl = make(GRPOGroupNSampler(n_samples_per_prompt=N))
    tag = uuid.uuid4().hex[:6]
    with ShardClient(timeout=20) as client:
        before = shards_on(client, node)
        old, new = groups(node, f"{tag}o", 2), groups(node, f"{tag}n", 2)
        ctl.put("p", old, version=1)
        ctl.put("p", new, version=4)
        ctl.set_policy_version(5)
        got = ctl.get_meta("p", "train", ["input_ids", "uid"], N, max_staleness=2, stale="drop")
        assert got.task_ids == new.task_ids[:N]
        assert ctl.production_status("p")["tasks"] == 2 * N  # the old groups are gone
        assert shards_on(client, node) == before + 2 * N * 2  # ... and their shards (2 fields each)
        assert ctl.summary()["staleness"] == {"served": {"1": N}, "dropped": 2 * N}
        assert [len(set(got["uid"]))] == [1]  # a whole group
        ctl.clear_partition("p")
        assert shards_on(client, node) == before


@pytest.mark.parametrize("dp_rank", [0, 1])
def test_balanced_ranks_get_only_fresh_groups(
    shared_workers: list[WorkerProcess], make: Callable[..., Any], dp_rank: int
) -> None:
    """The sequence-length balanced sampler over 2 data-parallel ranks: both ranks' shares come
    from the fresh groups only, whole."""
    node = shared_workers[0].node
    ctl = make(SeqlenBalancedSampler(n_samples_per_prompt=N, dp_size=2))
    tag = uuid.uuid4().hex[:6]
    ctl.put("p", groups(node, f"{tag}o", 2), version=0)
    fresh = groups(node, f"{tag}n", 2)
    ctl.put("p", fresh, version=7)
    ctl.set_policy_version(8)
    shares = [
        ctl.get_meta("p", "train", ["input_ids"], N, max_staleness=1, dp_rank=rank, batch_index=0)
        for rank in (dp_rank, 1 - dp_rank)
    ]
    assert sorted(t for share in shares for t in share.task_ids) == sorted(fresh.task_ids)
    ctl.clear_partition("p")


def test_a_waiting_consumer_gets_the_fresh_tasks_when_they_come(
    shared_workers: list[WorkerProcess], make: Callable[..., Any]
) -> None:
    node = shared_workers[0].node
    ctl = make(SequentialSampler())
    tag = uuid.uuid4().hex[:6]
    ctl.put("p", groups(node, f"{tag}o", 1), version=0)
    ctl.set_policy_version(4)
    fresh = groups(node, f"{tag}n", 1)
    producer = threading.Timer(0.3, lambda: ctl.put("p", fresh, version=4))
    producer.start()
    started = time.monotonic()
    got = ctl.get_meta("p", "train", ["input_ids"], N, max_staleness=0, timeout=20)
    producer.join()
    assert got.task_ids == fresh.task_ids and time.monotonic() - started >= 0.25
    ctl.clear_partition("p")


def test_versions_and_counters_survive_a_checkpoint(
    shared_workers: list[WorkerProcess], tmp_path: Any
) -> None:
    node = shared_workers[0].node
    ctl = Controller(SequentialSampler())
    tag = uuid.uuid4().hex[:6]
    batch = groups(node, tag, 2)
    ctl.put("p", batch, version=[1] * N + [6] * N)
    ctl.set_policy_version(6)
    ctl.get_meta("p", "train", ["input_ids"], N, max_staleness=0)
    path = ctl.save_checkpoint(tmp_path / "controller.json")
    again = Controller(SequentialSampler())
    again.load_checkpoint(path)
    assert again.policy_version() == 6
    assert again.policy_versions("p", batch.task_ids) == ctl.policy_versions("p", batch.task_ids)
    assert again.summary()["staleness"] == {"served": {"0": N}, "dropped": 0}
    with pytest.raises(InvalidArgumentError, match="invalid controller checkpoint"):
        again.load_state_dict({**ctl.state_dict(), "policy_version": -2})
    assert again.policy_version() == 6  # a refused checkpoint changes nothing
    ctl.clear_partition("p")


def test_the_streaming_loader_takes_fresh_tasks_and_cuts_them_by_tokens(
    shared_workers: list[WorkerProcess],
) -> None:
    """`StreamingDataset(max_staleness=, stale="drop", max_tokens=, micro_batches=)`: only fresh
    groups come out, the stale ones are dropped, and each batch is cut into the given number of
    micro-batches under the token budget."""
    from distbatch.dataloader import StreamingDataset

    node = shared_workers[0].node
    ctl = Controller(GRPOGroupNSampler(n_samples_per_prompt=N))
    tag = uuid.uuid4().hex[:6]
    ctl.put("p", groups(node, f"{tag}o", 2), version=0)
    fresh = groups(node, f"{tag}n", 2)
    ctl.put("p", fresh, version=5)
    ctl.set_policy_version(5)
    data = StreamingDataset(
        ctl,
        "p",
        "train",
        ["input_ids"],
        batch_size=N,
        poll_interval=0.01,
        max_empty_polls=2,
        max_staleness=1,
        stale="drop",
        max_tokens=24,
        micro_batches=2,
    )
    parts = list(data)
    assert len(parts) == 4  # two batches (the fresh groups), two micro-batches each
    assert sorted(t for part in parts for t in part.task_ids) == sorted(fresh.task_ids)
    assert all(sum(part.lengths("input_ids")) <= 24 for part in parts)
    assert ctl.summary()["staleness"]["dropped"] == 2 * N
    with pytest.raises(InvalidArgumentError, match="without micro_batch_size"):
        StreamingDataset(ctl, "p", "train", ["input_ids"], 4, micro_batch_size=2, max_tokens=10)
    with pytest.raises(InvalidArgumentError, match="micro_batches= needs max_tokens="):
        StreamingDataset(ctl, "p", "train", ["input_ids"], 4, micro_batches=2)
    ctl.clear_partition("p")


@pytest.mark.parametrize(
    "sampler",
    [SequentialSampler(), GRPOGroupNSampler(n_samples_per_prompt=N), SeqlenBalancedSampler(N, dp_size=1)],
    ids=["sequential", "grpo", "balanced"],
)
def test_the_oldest_tasks_go_first(
    shared_workers: list[WorkerProcess], make: Callable[..., Any], sampler: BaseSampler
) -> None:
    """A cleared task's index is reused by a later put, so index order is not age: with versions,
    samplers take the oldest first (an asynchronous consumer then drops fewer as stale)."""
    node = shared_workers[0].node
    ctl = make(sampler)
    tag = uuid.uuid4().hex[:6]
    first, second = groups(node, f"{tag}a", 1), groups(node, f"{tag}b", 1)
    ctl.put("p", first, version=0)
    ctl.put("p", second, version=1)
    ranked = {"dp_rank": 0} if isinstance(sampler, SeqlenBalancedSampler) else {}

    def take(index: int) -> list[str]:
        config = {**ranked, "batch_index": index} if ranked else {}
        return sorted(ctl.get_meta("p", "train", ["input_ids"], N, **config).task_ids)

    taken = take(0)
    assert taken == sorted(first.task_ids)
    ctl.clear_tasks("p", taken)
    newest = groups(node, f"{tag}c", 1)
    ctl.put("p", newest, version=2)  # into the block the first group freed: the lowest indexes
    assert take(1) == sorted(second.task_ids)
    assert take(2) == sorted(newest.task_ids)
    ctl.clear_partition("p")


def test_the_served_controller_exports_versions_and_staleness(
    shared_workers: list[WorkerProcess], serve: Callable[..., Any]
) -> None:
    """Its `/metrics`: the policy version, tasks served by staleness, tasks dropped as stale."""
    import urllib.request

    node = shared_workers[0].node
    controller = Controller(SequentialSampler())
    address = serve(controller).address
    tag = uuid.uuid4().hex[:6]
    controller.put("p", groups(node, f"{tag}o", 1), version=0)
    controller.put("p", groups(node, f"{tag}n", 1), version=2)
    controller.set_policy_version(3)
    assert len(controller.get_meta("p", "train", ["input_ids"], N, max_staleness=1, stale="drop")) == N
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    assert "distbatch_controller_policy_version 3.0" in text
    assert 'distbatch_controller_served_tasks_total{staleness="1"} 4.0' in text
    assert "distbatch_controller_stale_dropped_total 4.0" in text
    assert controller.staleness() == {"served": {"1": N}, "dropped": N}
    controller.clear_partition("p")


def test_a_version_ahead_of_the_controller_counts_as_fresh_and_checkpoints(
    shared_workers: list[WorkerProcess], tmp_path: Any
) -> None:
    """A producer may put with the new version before the trainer says it: staleness 0, and the
    checkpoint with that counter loads (a negative age would not)."""
    node = shared_workers[0].node
    ctl = Controller(SequentialSampler())
    ctl.put("p", groups(node, uuid.uuid4().hex[:6], 1), version=5)
    ctl.set_policy_version(4)
    assert len(ctl.get_meta("p", "train", ["input_ids"], N, max_staleness=0)) == N
    assert ctl.staleness() == {"served": {"0": N}, "dropped": 0}
    again = Controller(SequentialSampler())
    again.load_checkpoint(ctl.save_checkpoint(tmp_path / "c.json"))
    assert again.staleness() == ctl.staleness()
    ctl.clear_partition("p")
