"""A partition's task index (id <-> slot, an open-addressing table in numpy arrays) answers what a
dict says after any sequence of adds and removes, through its one-at-a-time path (a few ids) and
its batch path (many), with tombstones reused and the table rebuilt; and it stays small."""

from __future__ import annotations

import random

import numpy as np
import pytest

from distbatch.controller.task_index import FEW_ROWS, GONE, TaskIndex


def _check(index: TaskIndex, model: dict[str, int], asked: list[str]) -> None:
    want = [model.get(t, -1) for t in asked]
    assert index.rows_of(asked).tolist() == want
    assert len(index) == len(model)
    for t in asked[:20]:
        assert (t in index) == (t in model)
        assert index.get(t) == model.get(t)
        if t in model:
            assert index[t] == model[t]
        else:
            with pytest.raises(KeyError):  # NotFoundError is one
                index[t]


@pytest.mark.parametrize("seed", range(12))
def test_the_index_answers_as_a_dict_after_random_adds_and_removes(seed: int) -> None:
    rng = random.Random(seed)
    index, model = TaskIndex(), {}
    free: list[int] = []
    next_slot, made = 0, 0
    for _ in range(60):
        if model and rng.random() < 0.4:  # remove some, small or large batches
            size = rng.choice([1, 3, FEW_ROWS, FEW_ROWS + 1, len(model)])
            gone = rng.sample(sorted(model), min(size, len(model)))
            slots = np.asarray([model.pop(t) for t in gone], dtype=np.int64)
            index.remove(slots)
            free.extend(slots.tolist())
        else:  # add new ids at free slots (reused ones first), small or large batches
            count = rng.choice([1, 2, 17, FEW_ROWS, FEW_ROWS + 1, 700])
            ids = [f"s{seed}-{made + i}" for i in range(count)]
            made += count
            rng.shuffle(free)
            slots = free[:count]
            del free[:count]
            while len(slots) < count:
                slots.append(next_slot)
                next_slot += 1
            index.reserve(next_slot)
            index.add(ids, np.asarray(slots, dtype=np.int64))
            model.update(zip(ids, slots))
        held = sorted(model)
        absent = [f"s{seed}-{made + i}" for i in range(5)] + [f"s{seed}-{i}x" for i in range(5)]
        few = rng.sample(held, min(len(held), 10)) + absent
        many = rng.sample(held, min(len(held), 400)) + absent * 40
        rng.shuffle(many)
        _check(index, model, few)
        _check(index, model, many)
        assert index.ids[list(model.values())].tolist() == list(model)
        assert sorted(index) == held
        assert int(np.count_nonzero(index.ids != None)) == len(model)  # noqa: E711
        # The table's own books: tombstones counted right (they decide when it is rebuilt) and
        # an empty bucket left, without which a walk for an unknown id would never end.
        table = index._table
        assert int(np.count_nonzero(table == GONE)) == index._gone
        assert int(np.count_nonzero(table >= 0)) == len(model)
        assert 2 * (len(model) + index._gone) <= len(table)


def test_churn_reuses_the_table_instead_of_growing_it() -> None:
    """Tasks come and go (a partition's steady state): tombstones are reused or swept by a
    rebuild, so the table stays the size of what is held, not of everything ever put."""
    index = TaskIndex()
    index.reserve(2_000)
    sizes = set()
    for cycle in range(200):
        ids = [f"c{cycle}-{i}" for i in range(1_000)]
        slots = np.arange(1_000, dtype=np.int64) + (cycle % 2) * 1_000
        index.add(ids, slots)
        assert index.rows_of(ids).tolist() == slots.tolist()
        index.remove(slots)
        assert len(index) == 0
        sizes.add(index.nbytes())
    assert max(sizes) <= 2_000 * (8 + 4) + 4 * 4_096, sizes  # ids and hash bits, the table


def test_a_task_costs_at_most_34_bytes_beside_its_id() -> None:
    """What a dict would cost some 80 bytes for (an entry and an int object): a pointer to the id,
    4 bytes of its hash and 4-byte buckets of a table made at least 3/16 full."""
    index = TaskIndex()
    count = 100_000
    index.reserve(count)
    index.add([f"t{i}" for i in range(count)], np.arange(count, dtype=np.int64))
    assert index.nbytes() / count <= 8 + 4 + 4 * 16 / 3
    assert index.rows_of(["t0", f"t{count - 1}", "nope"]).tolist() == [0, count - 1, -1]


def test_past_the_slot_limit_a_partition_and_a_checkpoint_refuse_clearly() -> None:
    """A bucket holds a slot as an int32: asking for more slots than that (a forged checkpoint's
    next_index, say) is an `InvalidArgumentError` that changes nothing, not an overflow."""
    from distbatch.controller.checkpoint import partitions_from_state
    from distbatch.controller.partitions import Partition
    from distbatch.controller.task_index import MAX_SLOTS
    from distbatch.errors import InvalidArgumentError

    partition = Partition("p")
    partition.reserve(100)
    with pytest.raises(InvalidArgumentError, match="at most 2,147,483,647 task slots"):
        partition.reserve(MAX_SLOTS + 1)
    assert partition.capacity == 100
    forged = {"next_index": MAX_SLOTS + 1, "tasks": [], "nodes": [], "columns": {}, "consumed": {}}
    with pytest.raises(InvalidArgumentError, match="past 2147483647 task indexes"):
        partitions_from_state({"version": 1, "partitions": {"p": forged}})
