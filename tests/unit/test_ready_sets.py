"""A partition's kept ready sets answer what computing from the columns would, after any sequence of
puts (new tasks, later stages, partial values and their completion), consumptions, resets, clears
in flight, forgotten tasks (their indexes reused) and deleted shards; and only so many are kept."""

from __future__ import annotations

import random

import numpy as np
import pytest

from distbatch.batch.meta import BatchMeta, FieldMeta
from distbatch.controller.checkpoint import CHECKPOINT_VERSION, partitions_from_state, partitions_to_state
from distbatch.controller.partitions import MAX_READY_SETS, Partition
from distbatch.ids import ShardKey
from distbatch.wire.shapes import RowShapes

NODES = ["127.0.0.1:1", "127.0.0.1:2"]
FIELDS = ("a", "b", "c")
TASK_NAMES = ("train", "critic", "ref")
ASKED = [(t, f) for t in TASK_NAMES for f in (("a",), ("a", "b"), ("b", "c", "a"))]


def _put(
    p: Partition, task_ids: list[str], fields: list[str], node: int, partial: frozenset[str] = frozenset()
) -> None:
    n = len(task_ids)
    meta = BatchMeta(
        task_ids,
        [NODES[node]],
        {f: FieldMeta("I32", np.zeros(n, dtype=np.int32), RowShapes.uniform(n, ())) for f in fields},
    )
    p.register(meta, p.check_put(meta, 1), partial)


def _truth(p: Partition, task_name: str, fields: tuple[str, ...]) -> list[int]:
    """What `ready` answered before sets were kept: from the columns, every time."""
    if any(f not in p.columns for f in fields):
        return []
    have = set(p.columns[fields[0]].node)
    for f in fields[1:]:
        have &= set(p.columns[f].node)
    partial = set().union(*(p.columns[f].partial for f in fields))
    return sorted(have - p.consumed.get(task_name, set()) - set(p.clearing) - partial)


def _step(p: Partition, rng: random.Random, fresh: list[int]) -> None:
    """One random change, as the controller makes them; now and then a big one (a kept set is
    rebuilt, not edited, past a few dozen indexes at once)."""
    op = rng.choice(["put", "put", "stage", "consume", "consume", "reset", "forget", "drop", "clear"])
    big = rng.random() < 0.1
    known = list(p.index_of)
    if op == "put" or not known:
        ids = [f"t{fresh[0] + k}" for k in range(rng.randint(70, 130) if big else rng.randint(1, 6))]
        fresh[0] += len(ids)
        fields = rng.sample(FIELDS, rng.randint(1, 3))
        _put(p, ids, fields, 0, frozenset(f for f in fields if rng.random() < 0.2))
    elif op == "stage":  # a later stage adds (or puts again, or completes) a field of known tasks
        count = min(len(known), 100 if big else 4)
        ids = [t for t in rng.sample(known, count) if p.index_of[t] not in p.clearing]
        if ids:
            field = rng.choice(FIELDS)
            _put(p, ids, [field], 0, frozenset([field]) if rng.random() < 0.3 else frozenset())
    elif op == "consume":
        task_name, fields = rng.choice(ASKED)
        ready = p.ready(task_name, list(fields))
        p.consume(task_name, ready[: rng.randint(0, 100 if big else 4)])
    elif op == "reset":
        p.reset_consumption(rng.choice([None, *TASK_NAMES]))
    elif op == "forget":
        p.forget([p.index_of[t] for t in rng.sample(known, min(len(known), 80 if big else 2))])
    elif op == "drop":
        dropped = rng.sample(known, min(len(known), 80 if big else 1))
        p.drop_rows(NODES[0], [ShardKey(t, rng.choice(FIELDS)) for t in dropped])
    else:
        indexes = [p.index_of[t] for t in rng.sample(known, min(len(known), 3))]
        p.mark_clearing(indexes, rng.choice([+1, -1]))


@pytest.mark.parametrize("seed", range(40))
def test_kept_ready_sets_match_the_columns(seed: int) -> None:
    rng = random.Random(seed)
    p = Partition("p")
    fresh = [0]
    for _ in range(150):
        _step(p, rng, fresh)
        for task_name, fields in rng.sample(ASKED, 3):  # asked: kept from now on
            assert p.ready(task_name, list(fields)) == _truth(p, task_name, fields), (task_name, fields)
    for task_name, fields in ASKED:
        assert p.ready(task_name, list(fields)) == _truth(p, task_name, fields)
        assert p.ready(task_name, list(reversed(fields))) == _truth(p, task_name, fields)
    # A checkpoint's partition (no kept sets yet) answers the same.
    state = {"version": CHECKPOINT_VERSION, "partitions": partitions_to_state({"p": p})}
    loaded = partitions_from_state(state)["p"]
    loaded.clearing = dict(p.clearing)  # clears in flight are not checkpointed
    for task_name, fields in ASKED:
        assert loaded.ready(task_name, list(fields)) == p.ready(task_name, list(fields))


def test_a_field_nobody_put_is_never_ready_and_keeps_no_set() -> None:
    p = Partition("p")
    _put(p, ["x", "y"], ["a"], 0)
    assert p.ready("train", ["a", "b"]) == [] and p.ready("train", []) == []
    _put(p, ["y"], ["b"], 0)
    assert p.ready("train", ["a", "b"]) == [p.index_of["y"]]


def test_only_so_many_sets_are_kept_and_a_dropped_one_is_rebuilt() -> None:
    p = Partition("p")
    _put(p, [f"t{i}" for i in range(8)], ["a"], 0)
    for k in range(MAX_READY_SETS + 5):
        assert len(p.ready(f"task{k}", ["a"])) == 8
    assert len(p._ready) == MAX_READY_SETS
    p.consume("task0", [0, 1])  # task0's set was dropped: consumption still counts when rebuilt
    assert p.ready("task0", ["a"]) == list(range(2, 8))
    assert p.count_ready(["a"]) == 8
