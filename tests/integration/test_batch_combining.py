"""Rearranging batches: chunk, chunk_balanced, union, concat and clear; on REMOTE batches they move
metadata only.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from batch_support import (
    DBM,
    LENS,
    _stats,
    assert_batches_equal,
    assert_same,
    data_requests,
    delta,
    fetch_requests,
    lognormal_lengths,
    rows,
    sample_local,
)

from distbatch import (
    BatchMeta,
    BatchStatus,
    BatchStatusError,
    DistributedBatchMemory,
    FieldMeta,
    ShardNotFoundError,
)
from distbatch.launch import WorkerProcess

# --------------------------------------------------------------------------- chunk


@pytest.mark.parametrize("n", [1, 2, 4, 6, 7])
def test_chunk_contiguous_ordered_and_concat_restores(convert: Callable[..., Any], n: int) -> None:
    local = sample_local()
    b = convert(local)
    parts = b.chunk(n)
    assert len(parts) == n
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 6
    assert sizes == sorted(sizes, reverse=True)
    assert [t for p in parts for t in p.task_ids] == local.task_ids
    for p in parts:
        if len(p):
            assert p.status is b.status
    joined = DBM.concat(parts)
    assert joined.status is b.status
    assert_batches_equal(joined, local)


@pytest.mark.parametrize("n", [0, -1, 1.5, "2", None, True])
def test_chunk_rejects_bad_count(n: Any) -> None:
    with pytest.raises(ValueError):
        sample_local().chunk(n)


# --------------------------------------------------------------------------- chunk_balanced


def _group_batch(lengths: list[int], group_size: int) -> DistributedBatchMemory:
    return DBM.from_dict(
        {
            "input_ids": [torch.full((length,), i, dtype=torch.int32) for i, length in enumerate(lengths)],
            "uid": [f"g{i // group_size}" for i in range(len(lengths))],
        }
    )


def test_chunk_balanced_remote_moves_nothing_and_keeps_groups(
    remote: Callable[..., DistributedBatchMemory], nodes: list[str]
) -> None:
    group_size, k = 4, 4
    lengths = lognormal_lengths(64, seed=1, sigma=0.8, mu=4.0)
    local = _group_batch(lengths, group_size)
    b = remote(local)
    assert len(b.meta.nodes) == 3
    before = data_requests(nodes)
    parts = b.chunk_balanced(k, group_size=group_size, length_field="input_ids")
    default_field = b.chunk_balanced(k, group_size=group_size)  # input_ids is the default
    assert data_requests(nodes) == before, "balancing a REMOTE batch fetched data"
    assert [p.task_ids for p in default_field] == [p.task_ids for p in parts]
    assert all(p.status is BatchStatus.REMOTE for p in parts)
    assert [len(p) for p in parts] == [16] * k
    # same split as the LOCAL batch, from the same lengths
    assert [p.task_ids for p in local.chunk_balanced(k, group_size=group_size)] == [p.task_ids for p in parts]
    # every task exactly once, order kept inside a chunk
    position = {t: i for i, t in enumerate(local.task_ids)}
    assert sorted(t for p in parts for t in p.task_ids) == sorted(local.task_ids)
    for p in parts:
        idx = [position[t] for t in p.task_ids]
        assert idx == sorted(idx)
    # groups intact: gather uid and check each chunk holds whole consecutive groups
    owner: dict[str, int] = {}
    for c, p in enumerate(parts):
        uids = p["uid"]
        for start in range(0, len(uids), group_size):
            group = uids[start : start + group_size]
            assert len(set(group)) == 1, group
            assert group[0] not in owner
            owner[group[0]] = c
        ids = p["input_ids"]
        assert [int(t[0]) for t in ids] == [position[t] for t in p.task_ids]  # data follows the task
    assert len(owner) == 64 // group_size
    totals = [sum(b.lengths()[position[t]] for t in p.task_ids) for p in parts]
    assert max(totals) - min(totals) <= max(
        sum(lengths[i : i + group_size]) for i in range(0, 64, group_size)
    )


def test_chunk_balanced_quality_onlognormal_lengths(capsys: pytest.CaptureFixture[str]) -> None:
    # REMOTE from metadata alone (its nodes do not even exist) and LOCAL agree exactly
    n, k = 256, 4
    results = {}
    for sigma in (0.5, 1.0):
        lengths = lognormal_lengths(n, seed=7, sigma=sigma)
        meta = BatchMeta(
            [f"q{sigma}-{i}" for i in range(n)],
            ["127.0.0.1:9", "127.0.0.1:10", "127.0.0.1:11"],
            {"input_ids": FieldMeta("I32", [i % 3 for i in range(n)], [(length,) for length in lengths])},
        )
        r_parts = DBM.from_meta(meta).chunk_balanced(k)
        local = DBM.from_dict(
            {"input_ids": [torch.zeros(length, dtype=torch.int32) for length in lengths]},
            task_ids=meta.task_ids,
        )
        l_parts = local.chunk_balanced(k)
        assert [p.task_ids for p in r_parts] == [p.task_ids for p in l_parts]
        assert [len(p) for p in r_parts] == [n // k] * k
        totals = [sum(p.lengths()) for p in r_parts]
        ratio = max(totals) / min(totals)
        results[sigma] = ratio
        with capsys.disabled():
            print(
                f"\nchunk_balanced {n} tasks -> {k}, lognormal(6, {sigma}): "
                f"totals {totals}, max/min {ratio:.4f}"
            )
        assert max(totals) - min(totals) <= max(lengths)  # guaranteed by largest differencing
    assert results[0.5] < 1.05


def test_chunk_balanced_non_divisible_group_counts(convert: Callable[..., Any]) -> None:
    # 10 groups of 2 into 4 chunks: group counts 3, 3, 2, 2
    lengths = [5, 9, 1, 1, 7, 2, 3, 3, 8, 8, 4, 6, 2, 2, 9, 1, 5, 5, 3, 7]
    b = convert(_group_batch(lengths, 2))
    parts = b.chunk_balanced(4, group_size=2)
    assert sorted(len(p) for p in parts) == [4, 4, 6, 6]
    assert sorted(t for p in parts for t in p.task_ids) == sorted(b.task_ids)
    # zero-length tasks (empty responses) must not unbalance the counts either
    zeros = [0] * 9 + [1] * 6 + [3]
    parts = convert(_group_batch(zeros, 1)).chunk_balanced(5)
    assert sorted(len(p) for p in parts) == [3, 3, 3, 3, 4]
    # fewer groups than chunks: the extra chunks are EMPTY
    parts = convert(_group_batch([4, 4, 2, 2], 2)).chunk_balanced(3, group_size=2)
    assert sorted(len(p) for p in parts) == [0, 2, 2]


def test_chunk_balanced_rejects_bad_arguments(convert: Callable[..., Any]) -> None:
    b = convert(_group_batch([3, 4, 5, 6, 7, 8, 9, 10], 2))
    for group_size in (0, -2, 3, 16, 1.5, "2"):
        with pytest.raises(ValueError):
            b.chunk_balanced(2, group_size=group_size)
    for n in (0, -1, 2.0):
        with pytest.raises(ValueError):
            b.chunk_balanced(n)
    with pytest.raises(ValueError):
        b.chunk_balanced(2, length_field="uid")  # a JSON field has no length
    with pytest.raises(KeyError, match="'nope'"):
        b.chunk_balanced(2, length_field="nope")
    with pytest.raises(ValueError):
        convert(DBM.from_dict({"uid": ["a", "b"]})).chunk_balanced(2)  # no tensor field at all


# --------------------------------------------------------------------------- union / concat


def _pair(convert: Callable[..., Any]) -> tuple[DistributedBatchMemory, DistributedBatchMemory, list[str]]:
    """Two batches over the same tasks; the second lists them in another order."""
    ids = [f"u-{random.getrandbits(40):x}-{i}" for i in range(6)]
    a = DBM.from_dict({"input_ids": [torch.arange(n) for n in LENS], "uid": [f"g{i}" for i in range(6)]}, ids)
    order = [3, 0, 5, 1, 4, 2]
    b = DBM.from_dict(
        {"values": [torch.full((LENS[i],), float(i)) for i in order], "score": [i * 10 for i in order]},
        [ids[i] for i in order],
    )
    return convert(a), convert(b), ids


def test_union_aligns_by_task_id_out_of_place(convert: Callable[..., Any], status: BatchStatus) -> None:
    a, b, ids = _pair(convert)
    u = a.union(b)
    assert u.status is status
    assert u.task_ids == ids and u.fields == ["input_ids", "uid", "values", "score"]
    assert u["score"] == [i * 10 for i in range(6)]
    for i, v in enumerate(u["values"]):
        assert_same(v, torch.full((LENS[i],), float(i)))
    assert_same(u["input_ids"], a["input_ids"])
    assert a.fields == ["input_ids", "uid"] and b.fields == ["values", "score"]  # inputs untouched
    # the other direction keeps the other's order
    v = b.union(a)
    assert v.task_ids == b.task_ids and v["uid"] == [f"g{i}" for i in [3, 0, 5, 1, 4, 2]]


def test_union_field_clash_needs_overwrite(convert: Callable[..., Any]) -> None:
    a, b, ids = _pair(convert)
    # (rotated order: when REMOTE, no task's new "uid" lands on the node holding its old one,
    # so the two batches do not name the same stored shard)
    rotated = ids[2:] + ids[:2]
    clash = convert(DBM.from_dict({"uid": [f"new-{t}" for t in rotated]}, rotated))
    with pytest.raises(ValueError, match="uid"):
        a.union(clash)
    u = a.union(clash, overwrite=True)
    assert u.fields == ["input_ids", "uid"] and u.task_ids == ids
    assert u["uid"] == [f"new-{t}" for t in ids]
    assert a["uid"] == [f"g{i}" for i in range(6)]


def test_union_in_place_and_failure_leaves_batch_unchanged(convert: Callable[..., Any]) -> None:
    a, b, ids = _pair(convert)

    def snapshot(batch: DistributedBatchMemory) -> tuple[Any, ...]:
        return batch.status, batch.task_ids, batch.fields, batch.get_data()

    before = snapshot(a)
    clash = convert(DBM.from_dict({"uid": ["x"] * 6}, ids[2:] + ids[:2]))  # see test above
    other_tasks = convert(DBM.from_dict({"more": [1] * 6}))
    with pytest.raises(ValueError, match=r"same task ids.*same task_ids=.*concat\(\)"):
        a.union(other_tasks)  # made without task_ids=: ids of its own, and the error says so
    for bad, exc in (
        (clash, ValueError),
        (other_tasks, ValueError),
        (DBM.from_dict({"m": [1] * 6}, ids), None),
    ):
        if exc is None:  # status mismatch, when a is REMOTE
            if a.status is BatchStatus.LOCAL:
                continue
            exc = BatchStatusError
        with pytest.raises(exc):
            a.union_(bad)
        after = snapshot(a)
        assert after[:3] == before[:3]
        for name in before[3]:
            assert_same(before[3][name], after[3][name])
    assert a.union_(b) is a
    assert a.fields == ["input_ids", "uid", "values", "score"] and a.task_ids == ids
    assert a["score"] == [i * 10 for i in range(6)]


def test_union_of_fields_from_different_nodes(nodes: list[str]) -> None:
    ids = [f"xn-{random.getrandbits(40):x}-{i}" for i in range(5)]
    x = DBM.from_dict({"x": torch.arange(5)}, ids).to_remote(nodes[0])
    y = DBM.from_dict({"y": [torch.ones(i + 1) for i in range(5)]}, list(reversed(ids))).to_remote(nodes[1])
    try:
        u = x.union(y)
        assert u.status is BatchStatus.REMOTE and sorted(u.meta.nodes) == sorted(nodes[:2])
        f0 = fetch_requests(nodes)
        assert_same(u["x"], torch.arange(5))
        f1 = fetch_requests(nodes)
        assert delta(f1, f0) == [1, 0, 0]
        assert [t.shape[0] for t in u["y"]] == [5, 4, 3, 2, 1]
        assert delta(fetch_requests(nodes), f1) == [0, 1, 0]
        assert_batches_equal(u.to_local(), DBM.from_dict({"x": torch.arange(5), "y": u["y"]}, ids))
    finally:
        assert x.clear() + y.clear() == 10


def test_union_mixed_status_and_empty(remote: Callable[..., DistributedBatchMemory]) -> None:
    local = sample_local()
    r = remote(DBM.from_dict({"extra": torch.arange(6)}, local.task_ids))
    with pytest.raises(BatchStatusError, match=r"to_local\(\)"):
        local.union(r)
    with pytest.raises(BatchStatusError):
        r.union(local)
    for batch in (local, r):
        for u in (batch.union(DBM()), DBM().union(batch)):
            assert u is not batch
            assert u.status is batch.status
            assert_batches_equal(u, batch)
    assert DBM().union(DBM()).status is BatchStatus.EMPTY


def test_concat_rules(convert: Callable[..., Any], status: BatchStatus) -> None:
    a = convert(sample_local(n=4, seed=1))
    b = convert(sample_local(n=3, seed=2))
    c = DBM.concat([a, DBM(), b])
    assert c.status is status and c.task_ids == a.task_ids + b.task_ids
    for name in a.fields:
        assert_same(rows(c[name]), rows(a[name]) + rows(b[name]))
    with pytest.raises(ValueError, match="duplicate"):
        DBM.concat([a, b, a[1:2]])
    with pytest.raises(ValueError, match="fields"):
        DBM.concat([a, b.select_fields(["hidden", "text"])])
    assert DBM.concat([DBM(), a]).task_ids == a.task_ids


def test_concat_mixed_status(remote: Callable[..., DistributedBatchMemory]) -> None:
    local = sample_local(n=2)
    r = remote(sample_local(n=3))
    with pytest.raises(BatchStatusError):
        DBM.concat([local, r])
    with pytest.raises(BatchStatusError):
        DBM.concat([r, DBM(), local])


# --------------------------------------------------------------------------- clear


@pytest.fixture
def fresh_nodes(start_worker: Callable[..., WorkerProcess]) -> list[str]:
    """Three workers of this test's own (started concurrently), so their stores start empty."""
    with ThreadPoolExecutor(3) as pool:
        workers = list(pool.map(lambda _: start_worker(), range(3)))
    return [w.node for w in workers]


def test_clear_deletes_on_every_node(fresh_nodes: list[str]) -> None:
    local = sample_local(n=9)
    b = DBM.concat([p.to_remote(node) for p, node in zip(local.chunk(3), fresh_nodes)])
    assert sorted(b.meta.nodes) == sorted(fresh_nodes)
    assert [_stats(n)["shards"] for n in fresh_nodes] == [3 * 7] * 3
    # a sub-batch clears only its own shards
    assert b[0:2].clear() == 2 * 7
    assert [_stats(n)["shards"] for n in fresh_nodes] == [1 * 7, 3 * 7, 3 * 7]
    before = b[2:4]  # another batch over shards the clear below deletes
    assert b.clear() == 7 * 7
    for node in fresh_nodes:
        stats = _stats(node)
        assert stats["shards"] == 0 and stats["bytes"] == 0 and stats["tasks"] == 0, stats
    # the cleared batch is EMPTY, its fields kept; one cut from it before says why it cannot read
    assert (b.status, len(b), b.fields) == (BatchStatus.EMPTY, 0, local.fields)
    with pytest.raises(ShardNotFoundError, match="deleted by a clear"):
        before.to_local()
    assert b.clear() == 0  # idempotent
    fields = local.fields
    assert local.clear() == 0  # LOCAL data lives on no worker: dropped, the batch empty
    assert (local.status, len(local), local.fields) == (BatchStatus.EMPTY, 0, fields)


