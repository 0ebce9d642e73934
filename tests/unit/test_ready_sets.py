"""A partition's kept ready sets answer what a plain model of its tasks says, after any sequence of
puts (new tasks, later stages, partial values and their completion), consumptions, resets, clears
in flight, forgotten tasks (their indexes reused) and deleted shards; a checkpoint answers the
same; and only so many sets are kept."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

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


@dataclass
class Model:
    """The partition as sets of task ids, changed the plain way."""

    # per field: task id -> whether its value is partial
    values: dict[str, dict[str, bool]] = field(default_factory=lambda: {f: {} for f in FIELDS})
    consumed: dict[str, set[str]] = field(default_factory=dict)
    clearing: dict[str, int] = field(default_factory=dict)

    def ready(self, task_name: str, fields: tuple[str, ...]) -> set[str]:
        produced = ({t for t, partial in self.values[f].items() if not partial} for f in fields)
        have = set.intersection(*produced)
        return have - self.consumed.get(task_name, set()) - {t for t, n in self.clearing.items() if n > 0}

    def forget(self, ids: list[str]) -> None:
        for t in ids:
            for values in self.values.values():
                values.pop(t, None)
            for consumed in self.consumed.values():
                consumed.discard(t)
            self.clearing.pop(t, None)


def _put(
    p: Partition, m: Model, task_ids: list[str], fields: list[str], partial: frozenset[str] = frozenset()
) -> None:
    n = len(task_ids)
    meta = BatchMeta(
        task_ids,
        [NODES[0]],
        {f: FieldMeta("I32", np.zeros(n, dtype=np.int32), RowShapes.uniform(n, ())) for f in fields},
    )
    p.register(meta, p.check_put(meta, 1), partial)
    for f in fields:
        m.values[f].update(dict.fromkeys(task_ids, f in partial))


def _step(p: Partition, m: Model, rng: random.Random, fresh: list[int]) -> None:
    """One random change, as the controller makes them; now and then a big one."""
    op = rng.choice(["put", "put", "stage", "consume", "consume", "reset", "forget", "drop", "clear"])
    big = rng.random() < 0.1
    known = list(p.index_of)
    if op == "put" or not known:
        ids = [f"t{fresh[0] + k}" for k in range(rng.randint(70, 130) if big else rng.randint(1, 6))]
        fresh[0] += len(ids)
        fields = rng.sample(FIELDS, rng.randint(1, 3))
        _put(p, m, ids, fields, frozenset(f for f in fields if rng.random() < 0.2))
    elif op == "stage":  # a later stage adds (or puts again, or completes) a field of known tasks
        ids = [t for t in rng.sample(known, min(len(known), 100 if big else 4)) if not m.clearing.get(t)]
        if ids:
            name = rng.choice(FIELDS)
            _put(p, m, ids, [name], frozenset([name]) if rng.random() < 0.3 else frozenset())
    elif op == "consume":
        task_name, fields = rng.choice(ASKED)
        taken = p.ready(task_name, list(fields))[: rng.randint(0, 100 if big else 4)]
        p.consume(task_name, taken)
        m.consumed.setdefault(task_name, set()).update(p.task_ids_at(taken))
    elif op == "reset":
        task_name = rng.choice([None, *TASK_NAMES])
        p.reset_consumption(task_name)
        if task_name is None:
            m.consumed.clear()
        else:
            m.consumed.pop(task_name, None)
    elif op == "forget":
        ids = rng.sample(known, min(len(known), 80 if big else 2))
        p.forget([p.index_of[t] for t in ids])
        m.forget(ids)
    elif op == "drop":
        keys = [ShardKey(t, rng.choice(FIELDS)) for t in rng.sample(known, min(len(known), 80 if big else 1))]
        p.drop_rows(NODES[0], keys)
        for key in keys:
            m.values[key.field].pop(key.task_id, None)
    else:
        ids = rng.sample(known, min(len(known), 3))
        delta = rng.choice([+1, -1])
        p.mark_clearing([p.index_of[t] for t in ids], delta)
        for t in ids:
            m.clearing[t] = max(m.clearing.get(t, 0) + delta, 0)


@pytest.mark.parametrize("seed", range(40))
def test_ready_tasks_match_a_plain_model(seed: int) -> None:
    rng = random.Random(seed)
    p, m = Partition("p"), Model()
    fresh = [0]

    def check(part: Partition) -> None:
        for task_name, fields in ASKED:
            ready = part.ready(task_name, list(fields))
            assert ready == sorted(ready) and len(set(ready)) == len(ready)
            assert set(part.task_ids_at(ready)) == m.ready(task_name, fields), (task_name, fields)
            assert part.ready(task_name, list(reversed(fields))) == ready
        assert part.count_ready(["a"]) == len(m.ready("\0", ("a",)))
        for task_name in TASK_NAMES:
            assert part.consumed_count(task_name) == len(m.consumed.get(task_name, ()))

    for _ in range(150):
        _step(p, m, rng, fresh)
        check(p)
    # A checkpoint's partition answers the same.
    state = {"version": CHECKPOINT_VERSION, "partitions": partitions_to_state({"p": p})}
    loaded = partitions_from_state(state)["p"]
    loaded.clearing = dict(p.clearing)  # clears in flight are not checkpointed
    check(loaded)
    assert partitions_to_state({"p": loaded}) == state["partitions"]


def test_a_field_nobody_put_is_never_ready_and_keeps_no_set() -> None:
    p, m = Partition("p"), Model()
    _put(p, m, ["x", "y"], ["a"])
    assert p.ready("train", ["a", "b"]) == [] and p.ready("train", []) == []
    _put(p, m, ["y"], ["b"])
    assert p.ready("train", ["a", "b"]) == [p.index_of["y"]]
    assert len(p._ready) == 1


def test_only_so_many_sets_are_kept_and_a_dropped_one_is_rebuilt() -> None:
    p, m = Partition("p"), Model()
    _put(p, m, [f"t{i}" for i in range(8)], ["a"])
    for k in range(MAX_READY_SETS + 5):
        assert len(p.ready(f"task{k}", ["a"])) == 8
    assert len(p._ready) == MAX_READY_SETS
    p.consume("task0", [0, 1])  # task0's set was dropped: consumption still counts when rebuilt
    assert p.ready("task0", ["a"]) == list(range(2, 8))
    assert p.count_ready(["a"]) == 8


def test_a_moved_node_keeps_its_tasks_and_merges_with_a_known_one() -> None:
    p, m = Partition("p"), Model()
    _put(p, m, ["x", "y"], ["a"])  # on NODES[0]
    meta = BatchMeta(
        ["z"], [NODES[1]], {"a": FieldMeta("I32", np.zeros(1, np.int32), RowShapes.uniform(1, ()))}
    )
    p.register(meta, p.check_put(meta, 1))
    assert p.move_node("127.0.0.1:9", NODES[0]) == 0  # unknown: nothing
    assert p.move_node(NODES[0], "127.0.0.1:7") == 2  # a new name
    assert p.meta_for([p.index_of["x"]], ["a"]).nodes == ["127.0.0.1:7"]
    assert p.move_node("127.0.0.1:7", NODES[1]) == 2  # onto a node it knows: merged
    handed = p.meta_for(p.ready("train", ["a"]), ["a"])
    assert handed.nodes == [NODES[1]] and handed.fields["a"].nodes.tolist() == [0, 0, 0]
    assert p.rows_on("127.0.0.1:7") == [] and len(p.rows_on(NODES[1])) == 3


def test_a_handle_moves_with_its_worker() -> None:
    fields = {"a": FieldMeta("I32", np.asarray([0, 1, 0], np.int32), RowShapes.uniform(3, ()))}
    meta = BatchMeta(["x", "y", "z"], NODES, fields)
    assert meta.moved("127.0.0.1:9", NODES[0]) is meta
    renamed = meta.moved(NODES[0], "127.0.0.1:7")
    assert renamed.nodes == ["127.0.0.1:7", NODES[1]] and renamed.fields["a"].nodes.tolist() == [0, 1, 0]
    merged = meta.moved(NODES[0], NODES[1])
    assert merged.nodes == [NODES[1]] and merged.fields["a"].nodes.tolist() == [0, 0, 0]
