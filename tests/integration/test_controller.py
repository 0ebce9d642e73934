"""Controller against real `python -m rpc_server` workers: bookkeeping, index allocation, samplers
through the controller, concurrency, clears (a worker down included) and checkpoints."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from batch_support import remote, shards_on

from distbatch import BatchMeta, BatchStatusError, DistBatchError, FieldMeta, ShardClient
from distbatch.batch import BatchStatus, DistributedBatchMemory
from distbatch.controller import ClearInProgressError, Controller, SchemaConflictError
from distbatch.controller.partitions import Partition
from distbatch.errors import ClearError, ShardElsewhereError, UnknownFieldError, UnknownPartitionError
from distbatch.launch import WorkerProcess, spawn_workers
from distbatch.samplers import GRPOGroupNSampler, RankAwareSampler, SeqlenBalancedSampler, SequentialSampler

# --------------------------------------------------------------------------- helpers


def prefix() -> str:
    return uuid.uuid4().hex[:8]


def tokens(lengths: Sequence[int]) -> list[torch.Tensor]:
    return [torch.arange(n, dtype=torch.int64) for n in lengths]


def group_batch(
    node: str, pre: str, groups: Sequence[int], n: int, lengths: Sequence[int] | None = None
) -> DistributedBatchMemory:
    """Whole groups of n tasks (adjacent), each task with `input_ids` and its group's `uid`."""
    ids = [f"{pre}-g{g}-{j}" for g in groups for j in range(n)]
    lengths = list(lengths) if lengths is not None else [2 + j for _ in groups for j in range(n)]
    uids = [f"{pre}-g{g}" for g in groups for _ in range(n)]
    return remote(node, ids, input_ids=tokens(lengths), uid=uids)


def indexes(ctl: Controller, pid: str) -> dict[str, int]:
    """task id -> partition index, from the controller's own snapshot."""
    return {t: i for i, t in ctl.state_dict()["partitions"][pid]["tasks"]}


def assert_whole_groups(batch: DistributedBatchMemory, n: int) -> list[str]:
    """Gather `uid` for real and check the batch is whole groups of n; return the group uids."""
    uids = batch["uid"]
    counts = Counter(uids)
    assert all(c == n for c in counts.values()), counts
    return sorted(counts)


@pytest.fixture(scope="module")
def mclient() -> Iterator[ShardClient]:
    with ShardClient(timeout=20.0) as c:
        yield c


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=32) as executor:
        yield executor


def later(pool: ThreadPoolExecutor, delay: float, fn: Callable[[], Any]) -> Future:
    def run() -> Any:
        time.sleep(delay)
        return fn()

    return pool.submit(run)


# --------------------------------------------------------------------------- put


def test_put_registers_tasks_and_later_fields_join_the_same_rows(
    shared_workers: list[WorkerProcess], mclient: ShardClient
) -> None:
    w0, w1 = shared_workers[0].node, shared_workers[1].node
    ctl = Controller(client=mclient)
    ids = [f"{prefix()}-{i}" for i in range(6)]
    prompts = tokens([3, 4, 5, 6, 7, 8])
    assert ctl.put("p", remote(w0, ids, prompt=prompts, uid=[f"u{i}" for i in range(6)])) == 6
    assert ctl.partitions() == ["p"]
    assert ctl.production_status("p") == {"tasks": 6, "produced": {"prompt": 6, "uid": 6}, "ready": 6}
    assert ctl.production_status("p", ["prompt", "response"]) == {
        "tasks": 6,
        "produced": {"prompt": 6, "response": 0},
        "ready": 0,
    }
    rows = indexes(ctl, "p")

    # A later stage's output for the first four tasks, produced on another node.
    responses = [torch.full((i + 1,), float(i)) for i in range(4)]
    assert ctl.put("p", remote(w1, ids[:4], response=responses)) == 0
    assert indexes(ctl, "p") == rows
    assert ctl.production_status("p", ["prompt", "response"]) == {
        "tasks": 6,
        "produced": {"prompt": 4 + 2, "response": 4},
        "ready": 4,
    }

    # Tasks 4 and 5 have no response yet: not ready for a consumer that wants both.
    assert ctl.get_meta("p", "train", ["prompt", "response"], 5).status is BatchStatus.EMPTY
    batch = ctl.get_meta("p", "train", ["prompt", "response"], 4)
    assert batch.status is BatchStatus.REMOTE
    assert batch.task_ids == ids[:4]
    assert sorted(batch.meta.nodes) == sorted([w0, w1])
    assert {batch.meta.node_of("prompt", i) for i in range(4)} == {w0}
    assert {batch.meta.node_of("response", i) for i in range(4)} == {w1}
    local = batch.to_local()  # really gathered from both workers
    for i in range(4):
        assert torch.equal(local["prompt"][i], prompts[i])
        assert torch.equal(local["response"][i], responses[i])
    assert ctl.get_meta("p", "train", ["prompt", "response"], 1).status is BatchStatus.EMPTY

    assert ctl.put("p", remote(w1, ids[4:], response=[torch.zeros(2), torch.zeros(3)])) == 0
    rest = ctl.get_meta("p", "train", ["prompt", "response"], 2)
    assert rest.task_ids == ids[4:]
    assert [t.shape[0] for t in rest["response"]] == [2, 3]
    assert ctl.all_consumed("p", "train")


def test_put_local_and_empty_batches(shared_workers: list[WorkerProcess]) -> None:
    ctl = Controller()
    local = DistributedBatchMemory.from_dict({"x": torch.zeros(2, 3)})
    with pytest.raises(BatchStatusError, match="the controller holds metadata only: put a REMOTE batch"):
        ctl.put("p", local)
    assert ctl.put("p", DistributedBatchMemory()) == 0
    assert ctl.partitions() == []
    assert ctl.production_status("p") == {"tasks": 0, "produced": {}, "ready": 0}


@pytest.mark.parametrize("bad", ["", "a b", "a/b", "x" * 201, 5, None])
def test_put_and_get_meta_refuse_invalid_ids(shared_workers: list[WorkerProcess], bad: Any) -> None:
    ctl = Controller()
    batch = remote(shared_workers[0].node, [f"{prefix()}-0"], x=torch.zeros(1, 2))
    with pytest.raises(ValueError):
        ctl.put(bad, batch)
    with pytest.raises(ValueError):
        ctl.get_meta(bad, "train", ["x"], 1)
    with pytest.raises(ValueError):
        ctl.get_meta("p", bad, ["x"], 1)
    with pytest.raises(ValueError):
        ctl.get_meta("p", "train", [bad], 1)
    assert ctl.partitions() == []


def test_put_refuses_invalid_ids_inside_hand_built_metadata(shared_workers: list[WorkerProcess]) -> None:
    """`BatchMeta` is a public dataclass: a hand-built one must not smuggle bad ids into the
    controller (its checkpoint would then refuse to load)."""
    node = shared_workers[0].node
    ctl = Controller()
    bad_field = BatchMeta(["t-1"], [node], {"bad/field": FieldMeta("float32", [0], [(2,)])})
    bad_task = BatchMeta(["bad task"], [node], {"x": FieldMeta("float32", [0], [(2,)])})
    twice = BatchMeta(["t-1", "t-1"], [node], {"x": FieldMeta("float32", [0, 0], [(2,), (2,)])})
    for meta in (bad_field, bad_task, twice):
        with pytest.raises(ValueError):
            ctl.put("p", DistributedBatchMemory.from_meta(meta))
    assert ctl.partitions() == []
    assert ctl.production_status("p")["tasks"] == 0


def test_schema_conflicts_register_nothing(shared_workers: list[WorkerProcess]) -> None:
    node = shared_workers[0].node
    ctl = Controller()
    pre = prefix()
    first = [f"{pre}-{i}" for i in range(4)]
    ctl.put("p", remote(node, first, x=torch.zeros(4, 2, dtype=torch.int64), uid=["a"] * 4))
    before = ctl.state_dict()

    new = [f"{pre}-{i}" for i in range(4, 8)]
    conflicts = [
        # new tasks, a new field, and one field of another dtype
        remote(node, new, y=torch.ones(4, 1), x=torch.zeros(4, 2, dtype=torch.float32)),
        # JSON where the partition has a tensor
        remote(node, new, y=torch.ones(4, 1), x=[[0, 0]] * 4),
        # a tensor where the partition has JSON
        remote(node, new, uid=torch.zeros(4, 1)),
        # joining existing tasks with a conflicting field
        remote(node, first, z=torch.ones(4, 1), x=torch.zeros(4, 2, dtype=torch.int32)),
    ]
    for batch in conflicts:
        with pytest.raises(SchemaConflictError) as info:
            ctl.put("p", batch)
        assert isinstance(info.value, ValueError)
        assert ctl.state_dict() == before  # no task, no field, no index consumed

    assert ctl.put("p", remote(node, new, x=torch.zeros(4, 2, dtype=torch.int64), uid=["b"] * 4)) == 4
    assert sorted(indexes(ctl, "p").values()) == list(range(8))
    # Schemas are per partition: another partition may use the name for JSON.
    assert ctl.put("q", remote(node, new, x=[[1]] * 4)) == 4


# --------------------------------------------------------------------------- index allocation


def test_allocate_aligned_blocks_and_reuse() -> None:
    p = Partition("p")

    made = iter(range(10**6))

    def take(count: int) -> int:
        ids = [f"t{next(made)}" for _ in range(count)]
        start = p.add_tasks(ids)
        assert [p.index_of[t] for t in ids] == list(range(start, start + count))
        assert p.task_ids_at(range(start, start + count)) == ids
        return start

    assert [take(4), take(4), take(8), take(4)] == [0, 4, 8, 16]
    assert take(2) == 20 and take(8) == 24
    p.forget(range(4, 8))
    assert take(4) == 4  # the freed block, aligned
    p.forget(range(8, 16))
    assert take(8) == 8
    p.forget([0, 1, 2, 3, 20, 21])
    assert take(2) == 0 and take(2) == 2 and take(2) == 20
    p.forget(range(24, 32))
    assert take(3) == 24 and take(3) == 27  # blocks of 3 start at multiples of 3
    p.forget(range(24, 30))
    p.mark_clearing([25], +1)  # a clear still holds index 25: its block is not free yet
    assert take(3) == 27
    p.mark_clearing([25], -1)
    assert take(3) == 24


def test_grpo_groups_stay_whole_across_clears_and_index_reuse(
    shared_workers: list[WorkerProcess], mclient: ShardClient
) -> None:
    n = 4
    node = shared_workers[0].node
    ctl = Controller(GRPOGroupNSampler(n), client=mclient)
    pre = prefix()
    b1 = group_batch(node, pre, [0, 1], n)
    b2 = group_batch(node, pre, [2], n)
    b3 = group_batch(node, pre, [3], n)
    b4 = group_batch(node, pre, [4, 5], n)
    for b in (b1, b2, b3, b4):
        ctl.put("p", b)
    rows = indexes(ctl, "p")
    assert [rows[t] for t in b1.task_ids] == list(range(0, 8))
    assert [rows[t] for t in b2.task_ids] == list(range(8, 12))
    assert [rows[t] for t in b4.task_ids] == list(range(16, 24))

    first = ctl.get_meta("p", "train", ["uid", "input_ids"], 8)
    assert assert_whole_groups(first, n) == [f"{pre}-g0", f"{pre}-g1"]
    assert ctl.clear_tasks("p", b2.task_ids) == 2 * n  # two fields per task

    b5 = group_batch(node, pre, [6], n)
    ctl.put("p", b5)
    assert [indexes(ctl, "p")[t] for t in b5.task_ids] == list(range(8, 12))
    ctl.clear_tasks("p", b1.task_ids)  # consumed already
    b6, b7, b8 = (group_batch(node, pre, g, n) for g in ([7], [8], [9, 10]))
    for b in (b6, b7, b8):
        ctl.put("p", b)
    rows = indexes(ctl, "p")
    assert [rows[t] for t in b6.task_ids] == list(range(0, 4))
    assert [rows[t] for t in b7.task_ids] == list(range(4, 8))
    assert [rows[t] for t in b8.task_ids] == list(range(24, 32))  # no aligned free block of 8 left

    seen: list[str] = []
    while True:
        batch = ctl.get_meta("p", "train", ["uid"], 8)
        if batch.status is BatchStatus.EMPTY:
            break
        seen += assert_whole_groups(batch, n)
    expected = {f"{pre}-g{g}" for g in (3, 4, 5, 6, 7, 8, 9, 10)}
    assert sorted(seen) == sorted(expected)  # every group once, none split
    assert ctl.all_consumed("p", "train")


# --------------------------------------------------------------------------- get_meta


def test_get_meta_polls_and_validates(shared_workers: list[WorkerProcess]) -> None:
    node = shared_workers[0].node
    ctl = Controller()
    with pytest.raises(UnknownPartitionError):  # polling an unknown partition: at once, not EMPTY
        ctl.get_meta("nothing", "train", ["x"], 1)
    ids = [f"{prefix()}-{i}" for i in range(3)]
    ctl.put("p", remote(node, ids, x=torch.zeros(3, 2)))
    assert ctl.get_meta("p", "train", ["x"], 4).status is BatchStatus.EMPTY
    for fields in (["unknown"], ["x", "unknown"]):  # never put nor declared: can never be ready
        with pytest.raises(UnknownFieldError):
            ctl.get_meta("p", "train", fields, 1)
    assert ctl.consumption_status("p", "train") == {"tasks": 3, "consumed": 0}
    for bad_size in (0, -1, 2.0, True, "2", None):
        with pytest.raises(ValueError):
            ctl.get_meta("p", "train", ["x"], bad_size)
    with pytest.raises(ValueError):
        ctl.get_meta("p", "train", [], 1)
    with pytest.raises(ValueError):  # a field name, not a list of them: never silently 'x'
        ctl.get_meta("p", "train", "x", 1)
    for bad_timeout in (float("nan"), -1, "1"):
        with pytest.raises(ValueError):
            ctl.get_meta("p", "train", ["x"], 1, timeout=bad_timeout)
    assert ctl.consumption_status("p", "train") == {"tasks": 3, "consumed": 0}
    assert ctl.get_meta("p", "train", ["x"], 3, timeout=0).task_ids == ids


def test_get_meta_waits_for_a_producer_and_times_out(
    shared_workers: list[WorkerProcess], pool: ThreadPoolExecutor
) -> None:
    node = shared_workers[0].node
    ctl = Controller()
    ids = [f"{prefix()}-{i}" for i in range(4)]
    batch = remote(node, ids, x=torch.zeros(4, 2))

    start = time.monotonic()
    assert ctl.get_meta("p", "train", ["x"], 1, timeout=0.3).status is BatchStatus.EMPTY
    assert 0.25 <= time.monotonic() - start < 5

    producer = later(pool, 0.3, lambda: ctl.put("p", batch))
    start = time.monotonic()
    got = ctl.get_meta("p", "train", ["x"], 4, timeout=30)
    elapsed = time.monotonic() - start
    assert got.task_ids == ids
    assert 0.25 <= elapsed < 5, elapsed  # woke on the put, not at the timeout
    assert producer.result(timeout=5) == 4

    # An infinite timeout is a valid "wait until there is data".
    more = [f"{prefix()}-{i}" for i in range(2)]
    producer = later(pool, 0.2, lambda: ctl.put("p", remote(node, more, x=torch.zeros(2, 2))))
    assert ctl.get_meta("p", "train", ["x"], 2, timeout=float("inf")).task_ids == more
    producer.result(timeout=5)


def test_a_waiting_get_meta_blocks_nobody(
    shared_workers: list[WorkerProcess], pool: ThreadPoolExecutor
) -> None:
    node = shared_workers[0].node
    ctl = Controller(RankAwareSampler())
    ids = [f"{prefix()}-{i}" for i in range(4)]
    waiting = pool.submit(ctl.get_meta, "p", "train", ["x"], 4, timeout=30, dp_rank=0, batch_index=0)
    time.sleep(0.2)
    assert not waiting.done()

    start = time.monotonic()
    other = [f"{prefix()}-{i}" for i in range(2)]
    ctl.put("other", remote(node, other, x=torch.zeros(2, 1)))
    assert ctl.production_status("other")["tasks"] == 2
    assert ctl.get_meta("other", "train", ["x"], 2, dp_rank=0, batch_index=0).task_ids == other
    assert ctl.consumption_status("other", "train") == {"tasks": 2, "consumed": 2}
    ctl.state_dict()
    assert sorted(ctl.partitions()) == ["other"]
    ctl.put("p", remote(node, ids[:2], x=torch.zeros(2, 1)))  # not enough yet
    assert time.monotonic() - start < 3
    time.sleep(0.1)
    assert not waiting.done()

    ctl.put("p", remote(node, ids[2:], x=torch.zeros(2, 1)))
    assert waiting.result(timeout=5).task_ids == ids


def test_consumers_are_independent_and_reset_replays(shared_workers: list[WorkerProcess]) -> None:
    node = shared_workers[0].node
    ctl = Controller(RankAwareSampler())
    ids = [f"{prefix()}-{i}" for i in range(6)]
    ctl.put("p", remote(node, ids, x=torch.zeros(6, 1)))
    assert not ctl.all_consumed("p", "actor")
    assert not ctl.all_consumed("empty", "actor")

    def drain(task_name: str, dp_rank: int = 0) -> list[str]:
        got: list[str] = []
        for bi in range(10):
            b = ctl.get_meta("p", task_name, ["x"], 2, dp_rank=dp_rank, batch_index=bi)
            if b.status is BatchStatus.EMPTY:
                break
            got += b.task_ids
        return got

    assert drain("actor") == ids
    assert ctl.all_consumed("p", "actor")
    assert ctl.consumption_status("p", "critic") == {"tasks": 6, "consumed": 0}
    assert drain("critic") == ids  # the other consumer still sees everything
    assert ctl.all_consumed("p", "critic")

    cached = {"dp_rank": 0, "batch_index": 0}
    assert ctl.sampler.has_cached_result("p", "actor", cached)
    ctl.reset_consumption("p", "actor")
    assert not ctl.sampler.has_cached_result("p", "actor", cached)  # indexes may change meaning
    assert ctl.consumption_status("p", "actor") == {"tasks": 6, "consumed": 0}
    assert ctl.consumption_status("p", "critic") == {"tasks": 6, "consumed": 6}
    assert drain("actor", dp_rank=1) == ids  # replayed, fresh sampling
    ctl.reset_consumption("p")
    assert ctl.consumption_status("p", "critic") == {"tasks": 6, "consumed": 0}
    ctl.reset_consumption("unknown")  # no partition: nothing to do


# --------------------------------------------------------------------------- samplers


def test_rank_aware_tp_peers_in_any_order_and_disjoint_dp_ranks(shared_workers: list[WorkerProcess]) -> None:
    node = shared_workers[0].node
    ctl = Controller(RankAwareSampler())
    ids = [f"{prefix()}-{i}" for i in range(14)]
    ctl.put("p", remote(node, ids[:8], x=torch.zeros(8, 1)))

    def get(dp: int, bi: int) -> list[str]:
        return ctl.get_meta("p", "train", ["x"], 2, dp_rank=dp, batch_index=bi).task_ids

    got: dict[tuple[int, int], list[list[str]]] = {}
    order = [(0, 0), (0, 1), (0, 2), (1, 0), (0, 2), (0, 0), (1, 0), (0, 1)]  # tp0 prefetches 0..2
    for dp, bi in order:
        got.setdefault((dp, bi), []).append(get(dp, bi))
    assert get(1, 1) == []  # nothing left: not cached either
    ctl.put("p", remote(node, ids[8:], x=torch.zeros(6, 1)))
    for dp, bi in [(1, 1), (1, 2), (1, 1), (1, 2), (2, 0), (2, 0)]:
        got.setdefault((dp, bi), []).append(get(dp, bi))

    for key, answers in got.items():
        assert len(answers) == 2 and answers[0] == answers[1] and len(answers[0]) == 2, (key, answers)
    handed = [t for answers in got.values() for t in answers[0]]
    assert sorted(handed) == sorted(ids)  # dp ranks / batches disjoint, nothing lost
    assert ctl.all_consumed("p", "train")
    with pytest.raises(ValueError):
        ctl.get_meta("p", "train", ["x"], 2)  # RankAwareSampler needs dp_rank and batch_index


def test_seqlen_balanced_portions(shared_workers: list[WorkerProcess]) -> None:
    node = shared_workers[0].node
    n, dp = 2, 2
    ctl = Controller(SeqlenBalancedSampler(n, dp))
    pre = prefix()
    # Group totals 10, 7, 7, 4 then 12, 3, 6, 9: splitting in order would give 17/11 and 15/15.
    lengths = [9, 1, 3, 4, 5, 2, 2, 2, 6, 6, 1, 2, 3, 3, 4, 5]
    batch = group_batch(node, pre, range(8), n, lengths)
    ctl.put("p", batch)
    length_of = dict(zip(batch.task_ids, lengths))

    def get(rank: int, bi: int, task_name: str = "train") -> DistributedBatchMemory:
        return ctl.get_meta("p", task_name, ["input_ids", "uid"], 4, dp_rank=rank, batch_index=bi)

    r1 = get(1, 0)
    assert ctl.consumption_status("p", "train") == {"tasks": 16, "consumed": 8}  # the whole batch at once
    r0_next = get(0, 1)  # another call gets none of batch 0's samples
    r0 = get(0, 0)
    assert set(r0.task_ids).isdisjoint(r1.task_ids)
    assert set(r0.task_ids) | set(r1.task_ids) == set(batch.task_ids[:8])
    assert set(r0_next.task_ids) <= set(batch.task_ids[8:])
    r1_next = get(1, 1)
    assert set(r0_next.task_ids) | set(r1_next.task_ids) == set(batch.task_ids[8:])
    assert get(0, 0).task_ids == r0.task_ids and get(1, 1).task_ids == r1_next.task_ids  # TP peers

    for a, b in ((r0, r1), (r0_next, r1_next)):
        totals = []
        for portion in (a, b):
            assert len(portion) == 4
            assert_whole_groups(portion, n)
            assert portion.lengths("input_ids") == [length_of[t] for t in portion.task_ids]
            assert [t.shape[0] for t in portion["input_ids"]] == portion.lengths("input_ids")
            totals.append(sum(portion.lengths("input_ids")))
        assert totals[0] == totals[1], totals
    assert ctl.all_consumed("p", "train")
    assert get(0, 2).status is BatchStatus.EMPTY
    with pytest.raises(ValueError):
        get(2, 3)  # dp_rank outside dp_size


# --------------------------------------------------------------------------- concurrency


def test_concurrent_rank_aware_consumers_and_producers(
    shared_workers: list[WorkerProcess], pool: ThreadPoolExecutor
) -> None:
    """8 dp ranks x 2 TP peers, 4 batches each, against 4 producer threads: 64 samples exactly once."""
    nodes = [w.node for w in shared_workers]
    ctl = Controller(RankAwareSampler())
    pre = prefix()
    batches = [
        remote(nodes[k % 3], [f"{pre}-{k}-{i}" for i in range(4)], x=torch.full((4, 1), k)) for k in range(16)
    ]
    all_ids = [t for b in batches for t in b.task_ids]

    def consume(dp: int) -> list[list[str]]:
        out = []
        for bi in range(4):
            got = ctl.get_meta("p", "train", ["x"], 2, timeout=20, dp_rank=dp, batch_index=bi)
            out.append(got.task_ids)
        return out

    def produce(k: int) -> None:
        for b in batches[k::4]:
            time.sleep(0.01)
            ctl.put("p", b)

    consumers = [(dp, pool.submit(consume, dp)) for dp in range(8) for _ in range(2)]
    producers = [pool.submit(produce, k) for k in range(4)]
    for f in producers:
        f.result(timeout=30)
    results: dict[int, list[list[list[str]]]] = {}
    for dp, f in consumers:
        results.setdefault(dp, []).append(f.result(timeout=30))
    handed: list[str] = []
    for dp, (peer_a, peer_b) in results.items():
        assert peer_a == peer_b, dp
        assert all(len(batch) == 2 for batch in peer_a)
        handed += [t for batch in peer_a for t in batch]
    assert sorted(handed) == sorted(all_ids)  # never twice, none lost
    assert ctl.all_consumed("p", "train")


def test_concurrent_sequential_consumers_and_producers(
    shared_workers: list[WorkerProcess], pool: ThreadPoolExecutor
) -> None:
    nodes = [w.node for w in shared_workers]
    ctl = Controller(SequentialSampler())
    pre = prefix()
    batches = [
        remote(nodes[k % 3], [f"{pre}-{k}-{i}" for i in range(4)], x=torch.full((4, 1), k)) for k in range(32)
    ]
    all_ids = [t for b in batches for t in b.task_ids]

    def consume() -> list[str]:
        out: list[str] = []
        for _ in range(4):
            got = ctl.get_meta("p", "train", ["x"], 2, timeout=20)
            assert len(got) == 2
            out += got.task_ids
        return out

    def produce(k: int) -> None:
        for b in batches[k::4]:
            time.sleep(0.005)
            ctl.put("p", b)

    consumers = [pool.submit(consume) for _ in range(16)]
    producers = [pool.submit(produce, k) for k in range(4)]
    for f in producers:
        f.result(timeout=30)
    handed = [t for f in consumers for t in f.result(timeout=30)]
    assert len(handed) == len(all_ids) == 128
    assert sorted(handed) == sorted(all_ids)
    assert ctl.get_meta("p", "train", ["x"], 1).status is BatchStatus.EMPTY


# --------------------------------------------------------------------------- clearing


def test_clear_tasks_and_partition_delete_shards_then_forget(
    fresh_workers: list[WorkerProcess], mclient: ShardClient
) -> None:
    a, b = (w.node for w in fresh_workers)
    ctl = Controller(RankAwareSampler(), client=mclient)
    ids = [f"{prefix()}-{i}" for i in range(6)]
    ctl.put("p", remote(a, ids, prompt=tokens([1, 2, 3, 4, 5, 6])))
    ctl.put("p", remote(b, ids[:4], response=torch.ones(4, 2)))
    ctl.put("q", remote(b, [f"{prefix()}-q"], x=torch.ones(1, 1)))
    assert ctl.get_meta("p", "train", ["prompt"], 2, dp_rank=0, batch_index=0).task_ids == ids[:2]
    assert shards_on(mclient, a) == 6 and shards_on(mclient, b) == 5

    assert ctl.clear_tasks("p", ids[:3]) == 6  # prompt + response of three tasks
    assert shards_on(mclient, a) == 3 and shards_on(mclient, b) == 2
    assert ctl.production_status("p") == {"tasks": 3, "produced": {"prompt": 3, "response": 1}, "ready": 1}
    assert ctl.consumption_status("p", "train") == {"tasks": 3, "consumed": 0}
    assert not ctl.sampler.has_cached_result("p", "train", {"dp_rank": 0, "batch_index": 0})
    assert ctl.clear_tasks("p", ids[:3]) == 0  # idempotent
    assert ctl.clear_tasks("p", ["never-put"]) == 0
    assert ctl.clear_tasks("unknown", ids) == 0
    # The rest is still served, with its data.
    rest = ctl.get_meta("p", "train", ["prompt"], 3, dp_rank=0, batch_index=1)
    assert rest.task_ids == ids[3:]
    assert [t.shape[0] for t in rest["prompt"]] == [4, 5, 6]

    assert ctl.clear_partition("p") == 4
    assert shards_on(mclient, a) == 0 and shards_on(mclient, b) == 1
    assert ctl.partitions() == ["q"]
    assert ctl.production_status("p") == {"tasks": 0, "produced": {}, "ready": 0}
    assert ctl.clear_partition("p") == 0
    assert ctl.clear_partition("q") == 1
    assert shards_on(mclient, b) == 0 and ctl.partitions() == []


def test_a_field_put_again_from_another_worker_is_refused_not_orphaned(
    fresh_workers: list[WorkerProcess], mclient: ShardClient
) -> None:
    a, b = (w.node for w in fresh_workers)
    ctl = Controller(client=mclient)
    ids = [f"{prefix()}-{i}" for i in range(3)]
    ctl.put("p", remote(a, ids, x=torch.zeros(3, 2)))
    before = ctl.state_dict()
    elsewhere = remote(b, ids[1:], x=torch.ones(2, 2), y=torch.ones(2, 1))
    with pytest.raises(ShardElsewhereError, match=rf"task '{ids[1]}' .* already has field 'x' on {a}"):
        ctl.put("p", elsewhere)
    assert ctl.state_dict() == before  # nothing of the refused put was registered
    assert elsewhere.clear() == 4
    assert ctl.put("p", remote(a, ids[1:], x=torch.ones(2, 2))) == 0  # the same worker: replaced
    assert ctl.put("p", remote(b, ids, y=torch.ones(3, 1))) == 0  # a new field may live elsewhere
    # Every shard the controller knows is where it says, so a clear leaves nothing behind.
    assert ctl.clear_partition("p") == 6
    assert shards_on(mclient, a) == 0 and shards_on(mclient, b) == 0


def test_clear_with_a_worker_down(fresh_workers: list[WorkerProcess], mclient: ShardClient) -> None:
    live, dead = fresh_workers
    quick = ShardClient(timeout=3.0, connect_timeout=1.0, retries=1)
    try:
        ctl = Controller(client=quick)
        pre = prefix()
        on_live = [f"{pre}-a{i}" for i in range(3)]
        on_dead = [f"{pre}-b{i}" for i in range(2)]
        on_both = [f"{pre}-c{i}" for i in range(2)]
        ctl.put("p", remote(live.node, on_live + on_both, x=torch.zeros(5, 1)))
        ctl.put("p", remote(dead.node, on_dead, x=torch.zeros(2, 1), y=torch.zeros(2, 1)))
        ctl.put("p", remote(dead.node, on_both, y=torch.zeros(2, 1)))
        dead.kill()

        start = time.monotonic()
        with pytest.raises(ClearError) as info:
            ctl.clear_partition("p")
        assert time.monotonic() - start < 10
        err = info.value
        assert list(err.failed) == [dead.node]
        assert err.undeleted == {dead.node: 2 * 2 + 2}
        assert err.deleted == 5 and err.deleted_by_node == {live.node: 5}
        assert dead.node in str(err) and "6 shard(s)" in str(err)
        assert shards_on(mclient, live.node) == 0  # the live worker's shards did go
        # Tasks with a shard on the dead worker are kept for a retry; the others are forgotten.
        assert ctl.partitions() == ["p"]
        assert ctl.production_status("p")["tasks"] == 4
        kept = {t for _, t in ctl.state_dict()["partitions"]["p"]["tasks"]}
        assert kept == set(on_dead + on_both)
        # A kept task keeps only the shards still there: `x` of on_both went with the live
        # worker's deletes, so it is never handed out again (every fetch of it would fail).
        status = ctl.production_status("p", ["x", "y"])
        assert status["produced"] == {"x": 2, "y": 4} and status["ready"] == 2  # on_dead only
        assert ctl.get_meta("p", "probe", ["x"], 3).status is BatchStatus.EMPTY
        assert set(ctl.get_meta("p", "probe", ["x"], 2).task_ids) == set(on_dead)

        with pytest.raises(ClearError):
            ctl.clear_tasks("p", on_dead)
        assert ctl.production_status("p")["tasks"] == 4

        # The worker comes back (empty, on the same address): the retry goes through.
        port = dead.node.rsplit(":", 1)[1]
        back = spawn_workers(1, args=["--port", port])[0]
        try:
            assert back.node == dead.node
            assert ctl.clear_partition("p") == 0  # nothing was left to delete, but the tasks go
            assert ctl.partitions() == []
        finally:
            back.stop()
    finally:
        quick.close()


def test_tasks_being_cleared_are_neither_handed_out_nor_extended(
    fresh_workers: list[WorkerProcess], mclient: ShardClient, pool: ThreadPoolExecutor
) -> None:
    stalled, live = fresh_workers
    ctl = Controller(client=mclient)
    pre = prefix()
    going = [f"{pre}-go{i}" for i in range(3)]
    staying = [f"{pre}-stay{i}" for i in range(2)]
    ctl.put("p", remote(stalled.node, going, x=torch.zeros(3, 1)))
    ctl.put("p", remote(live.node, staying, x=torch.ones(2, 1)))
    os.kill(stalled.pid, signal.SIGSTOP)  # the clear's deletes hang until SIGCONT
    try:
        clearing = pool.submit(ctl.clear_tasks, "p", going)
        deadline = time.monotonic() + 10
        while ctl.production_status("p", ["x"])["ready"] != len(staying) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not clearing.done()
        # Not ready while their shards are being deleted: a consumer gets only the others ...
        assert ctl.production_status("p", ["x"]) == {"tasks": 5, "produced": {"x": 5}, "ready": 2}
        assert ctl.get_meta("p", "train", ["x"], 3).status is BatchStatus.EMPTY
        assert ctl.get_meta("p", "train", ["x"], 2).task_ids == staying
        # ... and a producer cannot add a field to them (its shard would outlive the task).
        late = remote(live.node, going[:1], y=torch.ones(1, 1))
        with pytest.raises(ClearInProgressError, match="being cleared"):
            ctl.put("p", late)
        assert "y" not in ctl.production_status("p")["produced"]
    finally:
        os.kill(stalled.pid, signal.SIGCONT)
    assert clearing.result(timeout=30) == 3
    assert ctl.production_status("p") == {"tasks": 2, "produced": {"x": 2}, "ready": 2}
    assert ctl.put("p", late) == 1  # once the clear is done, the same id is a new task
    assert late.clear() == 1 and ctl.clear_tasks("p", going[:1]) == 0


# --------------------------------------------------------------------------- checkpoints


def _sampler(kind: str) -> Any:
    return RankAwareSampler() if kind == "rank_aware" else SeqlenBalancedSampler(2, 2)


@pytest.mark.parametrize("kind", ["rank_aware", "seqlen"])
def test_checkpoint_mid_stream_resumes_identically(
    shared_workers: list[WorkerProcess], tmp_path: Path, kind: str
) -> None:
    nodes = [w.node for w in shared_workers]
    pre = prefix()
    gen = torch.Generator().manual_seed(7)
    batches = [
        group_batch(
            nodes[k % 3], pre, range(4 * k, 4 * k + 4), 2, torch.randint(1, 30, (8,), generator=gen).tolist()
        )
        for k in range(5)
    ]
    original = Controller(_sampler(kind))
    for b in batches[:3]:
        original.put("p", b)

    def call(ctl: Controller, dp: int, bi: int, task_name: str = "train") -> dict[str, Any]:
        got = ctl.get_meta("p", task_name, ["input_ids", "uid"], 4, dp_rank=dp, batch_index=bi)
        return {"ids": got.task_ids, "meta": None if got.meta is None else got.meta.to_dict()}

    # Consumed so far: batch 0 by both ranks, batch 1 by rank 0 only (rank 1's peer is behind),
    # rank 1 prefetched batch 2.
    for dp, bi in [(0, 0), (1, 0), (0, 1), (1, 2)]:
        assert call(original, dp, bi)["ids"]
    call(original, 0, 0, task_name="critic")

    path = original.save_checkpoint(tmp_path / "controller.json")
    assert [p.name for p in tmp_path.iterdir()] == ["controller.json"]  # no temp file left behind
    saved = json.loads(path.read_text())
    assert saved == original.state_dict()

    restored = Controller(_sampler(kind))
    restored.load_checkpoint(path)
    assert restored.state_dict() == original.state_dict()

    script: list[Any] = [(1, 1), (0, 2), (1, 2), (0, 1), ("put", 3), (0, 3), (1, 3), ("put", 4)]
    script += [(1, 4), (0, 4), (0, 5), (1, 5), (0, 4), ("critic", 1, 0), ("critic", 0, 1)]
    for step in script:
        if step[0] == "put":
            assert original.put("p", batches[step[1]]) == restored.put("p", batches[step[1]])
            continue
        if step[0] == "critic":
            a, b = (
                call(original, *step[1:], task_name="critic"),
                call(restored, *step[1:], task_name="critic"),
            )
        else:
            a, b = call(original, *step), call(restored, *step)
        assert a == b, step
    assert restored.state_dict() == original.state_dict()
    assert original.all_consumed("p", "train") and restored.all_consumed("p", "train")
    # The restored controller's batches gather real data.
    restored.reset_consumption("p")
    replay = restored.get_meta("p", "train", ["input_ids"], 4, dp_rank=0, batch_index=0)
    assert [t.shape[0] for t in replay["input_ids"]] == replay.lengths("input_ids")


def test_invalid_checkpoints_change_nothing(shared_workers: list[WorkerProcess], tmp_path: Path) -> None:
    node = shared_workers[0].node
    source = Controller(SeqlenBalancedSampler(2, 2))
    source.put("p", group_batch(node, prefix(), range(4), 2))
    source.get_meta("p", "train", ["input_ids"], 4, dp_rank=0, batch_index=0)
    good = source.state_dict()

    target = Controller(SeqlenBalancedSampler(2, 2))
    target.put("mine", remote(node, [f"{prefix()}-0", f"{prefix()}-1"], x=torch.zeros(2, 1)))
    before = target.state_dict()

    truncated = tmp_path / "truncated.json"
    source.save_checkpoint(truncated)
    truncated.write_text(truncated.read_text()[:-20])
    with pytest.raises(ValueError):
        target.load_checkpoint(truncated)
    assert target.state_dict() == before

    def variant(change: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
        state = json.loads(json.dumps(good))
        change(state)
        return state

    part = "partitions"
    column = "input_ids"
    bad_states = [
        [],
        {},
        variant(lambda s: s.update(version=2)),
        variant(lambda s: s.update(partitions=[])),
        variant(lambda s: s[part]["p"].update(columns=[])),
        variant(lambda s: s[part]["p"].update(tasks=[[0, "bad id"]])),
        variant(lambda s: s[part]["p"]["tasks"].append([0, "dup-index"])),
        variant(lambda s: s[part]["p"]["tasks"].append([99, s[part]["p"]["tasks"][0][1]])),
        variant(lambda s: s[part]["p"]["tasks"].append([-1, "negative"])),
        variant(lambda s: s[part]["p"].update(next_index=2)),
        variant(lambda s: s[part]["p"]["columns"][column].update(dtype="float99")),
        variant(lambda s: s[part]["p"]["columns"][column]["rows"].append([57, 0, [3]])),
        variant(lambda s: s[part]["p"]["columns"][column]["rows"].append([0, 5, [3]])),
        variant(lambda s: s[part]["p"]["columns"][column]["rows"][0].__setitem__(2, [-3])),
        variant(lambda s: s[part]["p"]["consumed"].update(train=[123])),
        variant(lambda s: s[part]["p"].update(nodes=["not a node"])),
        variant(lambda s: s["sampler"]["config"].update(dp_size=4)),
        variant(lambda s: s["sampler"].update(cache="nope")),
    ]
    for i, state in enumerate(bad_states):
        with pytest.raises(ValueError):
            target.load_state_dict(state)
        assert target.state_dict() == before, i
        path = tmp_path / f"bad{i}.json"
        path.write_text(json.dumps(state))
        with pytest.raises(ValueError):
            target.load_checkpoint(path)
        assert target.state_dict() == before, i

    target.load_state_dict(good)
    assert target.state_dict() == good
    # A sampler of another kind, or another configuration, refuses the sampler state.
    with pytest.raises(ValueError):
        Controller(SeqlenBalancedSampler(2, 4)).load_state_dict(good)


def test_save_checkpoint_replaces_atomically(shared_workers: list[WorkerProcess], tmp_path: Path) -> None:
    ctl = Controller()
    path = tmp_path / "ckpt.json"
    ctl.save_checkpoint(path)
    empty = json.loads(path.read_text())
    assert empty["partitions"] == {}
    ctl.put("p", remote(shared_workers[0].node, [f"{prefix()}-0"], x=torch.zeros(1, 1)))
    assert ctl.save_checkpoint(path) == path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.json"]
    fresh = Controller()
    fresh.load_checkpoint(path)
    assert fresh.state_dict() == ctl.state_dict() != empty


def test_sampler_returning_unknown_indexes_is_an_error(shared_workers: list[WorkerProcess]) -> None:
    """A custom sampler that invents an index gets a clear error, and nothing is consumed."""

    class Liar(SequentialSampler):
        def sample(self, ready_indexes: Sequence[int], batch_size: int, *a: Any, **k: Any) -> Any:
            return [999], [999]

    ctl = Controller(Liar())
    ctl.put("p", remote(shared_workers[0].node, [f"{prefix()}-0"], x=torch.zeros(1, 1)))
    with pytest.raises(DistBatchError):
        ctl.get_meta("p", "train", ["x"], 1)
    assert ctl.consumption_status("p", "train") == {"tasks": 1, "consumed": 0}


def test_a_pickled_index_is_rebuilt_with_the_loading_processs_hashes() -> None:
    """A partition's task index (tests/unit/test_task_index.py): `hash` of a str is per process
    (PYTHONHASHSEED), so an index pickled in one process and loaded in another still finds every
    id only because it keeps its ids alone and rebuilds (here, not in the unit tier: the other
    process imports the package, 1.5 s)."""
    import pickle
    import subprocess
    import sys

    import numpy as np

    from distbatch.controller.task_index import TaskIndex

    index = TaskIndex()
    index.reserve(1_000)
    index.add([f"p{i}" for i in range(900)], np.arange(900, dtype=np.int64))
    index.remove(np.arange(0, 900, 3, dtype=np.int64))
    probe = (
        "import pickle, sys; index = pickle.loads(sys.stdin.buffer.read()); "
        "print(len(index), index.rows_of(['p1', 'p3', 'p898']).tolist(), "
        "index.rows_of([f'p{i}' for i in range(900)]).tolist().count(-1))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        input=pickle.dumps(index),
        capture_output=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
    )
    assert out.stdout.decode().split() == ["600", "[1,", "-1,", "898]", "300"]
