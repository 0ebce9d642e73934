"""A controller checkpoint: its partitions as JSON-safe data, and back.

Reading one validates everything before the controller changes: every id, every index, every
node number, every dtype and every cross-reference (a column naming an unknown task, a consumer
that consumed an unknown index) is refused with `InvalidArgumentError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from distbatch.checks import check_int
from distbatch.controller.arguments import custom_meta_object
from distbatch.controller.partitions import NO_VERSION, Column, Partition
from distbatch.controller.task_index import MAX_SLOTS
from distbatch.errors import InvalidArgumentError
from distbatch.ids import validate_id, validate_node
from distbatch.wire.container import ITEMSIZE
from distbatch.wire.shapes import RowShapes

CHECKPOINT_VERSION = 1


def partitions_to_state(partitions: Mapping[str, Partition]) -> dict[str, Any]:
    """Every partition's tasks, fields, consumption and custom metadata, as JSON-safe data."""
    return {pid: _partition_to_state(p) for pid, p in partitions.items()}


def _partition_to_state(p: Partition) -> dict[str, Any]:
    tasks = np.flatnonzero(p.task_of != None)  # noqa: E711 (elementwise, on an object array)
    return {
        "tasks": [list(row) for row in zip(tasks.tolist(), p.task_of[tasks].tolist())],
        "next_index": p.next_index,
        "nodes": list(p.nodes),
        "columns": {
            name: {
                "dtype": c.dtype,
                "ragged": c.ragged,
                "rows": _rows(c),
                "partial": np.flatnonzero(c.partial).tolist(),
            }
            for name, c in p.columns.items()
        },
        "consumed": {name: np.flatnonzero(mask).tolist() for name, mask in p.consumed.items()},
        "expected_fields": sorted(p.expected),
        "custom_meta": [[i, meta] for i, meta in sorted(p.custom_meta.items())],
        "versions": _versions(p),
    }


def _rows(c: Column) -> list[list[Any]]:
    """Each value of a column: [index, node, shape, generation(, share key)]."""
    rows = np.flatnonzero(c.node >= 0)
    shared = [0] * len(rows) if c.shared is None else c.shared[rows].tolist()
    columns = zip(
        rows.tolist(), c.node[rows].tolist(), c.shapes_at(rows).tolist(), c.generation[rows].tolist(), shared
    )
    return [[i, n, list(shape), g, k] if k else [i, n, list(shape), g] for i, n, shape, g, k in columns]


def _versions(p: Partition) -> list[list[int]]:
    rows = np.flatnonzero(p.versions != NO_VERSION)
    return [list(row) for row in zip(rows.tolist(), p.versions[rows].tolist())]


def partitions_from_state(state: Mapping[str, Any]) -> dict[str, Partition]:
    """The partitions of a checkpoint written by `partitions_to_state`'s caller (`state_dict`)."""
    if not isinstance(state, Mapping) or state.get("version") != CHECKPOINT_VERSION:
        raise InvalidArgumentError(f"expected a controller checkpoint of version {CHECKPOINT_VERSION}")
    try:
        if not isinstance(state["partitions"], Mapping):
            raise InvalidArgumentError("'partitions' must be an object")
        return {pid: _partition_from_state(pid, raw) for pid, raw in state["partitions"].items()}
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"invalid controller checkpoint: {exc}") from None


def _count(value: Any) -> int:
    """A non-negative int of a checkpoint (an index, a node number, a dimension)."""
    return check_int(value, "a checkpoint's index, node number or dimension", 0)


def _partition_from_state(pid: str, raw: Mapping[str, Any]) -> Partition:
    p = Partition(validate_id(pid, "partition_id"), next_index=_count(raw["next_index"]))
    # Slots are arrays: a forged next_index must not make the next put allocate them.
    if p.next_index > MAX_SLOTS:
        raise InvalidArgumentError(f"next_index {p.next_index} is past {MAX_SLOTS} task indexes")
    _load_tasks(p, raw["tasks"])
    for node in raw["nodes"]:
        p.intern_node(validate_node(node))
    for name, col in raw["columns"].items():
        _load_column(p, name, col)
    for name, indexes in raw["consumed"].items():
        consumed = _task_rows(p, indexes, f"consumer {name!r} consumed")
        p.consume(validate_id(name, "task_name"), consumed)
    expected = raw.get("expected_fields", [])
    if not isinstance(expected, list):
        raise InvalidArgumentError("'expected_fields' must be a list")
    p.expected = {validate_id(f, "field") for f in expected}
    for i, meta in raw.get("custom_meta", []):
        if not p.has_task(_count(i)):
            raise InvalidArgumentError(f"custom_meta names unknown task index {i}")
        p.custom_meta[i] = custom_meta_object(meta, p.task_of[i])
    for i, version in raw.get("versions", []):
        if not p.has_task(_count(i)):
            raise InvalidArgumentError(f"versions names unknown task index {i}")
        p.versions[i] = check_int(version, "a task's policy version", 0)
        p.versioned = True
    return p


def _task_rows(p: Partition, indexes: Any, what: str) -> np.ndarray:
    """Checked indexes of tasks of `p` (a list of a checkpoint), as an array."""
    if not isinstance(indexes, list):
        raise InvalidArgumentError(f"{what}: expected a list of task indexes")
    rows = np.asarray([_count(i) for i in indexes], dtype=np.int64)
    if len(p.live(rows)) != len(rows):
        raise InvalidArgumentError(f"{what} unknown task indexes")
    return rows


def _load_tasks(p: Partition, tasks: Any) -> None:
    rows, ids = [], []
    for i, t in tasks:
        rows.append(_count(i))
        ids.append(validate_id(t, "task_id"))
    if len(set(rows)) != len(rows) or len(set(ids)) != len(ids):
        raise InvalidArgumentError("a task index or task id is listed twice")
    if rows and p.next_index <= max(rows):
        raise InvalidArgumentError(f"next_index {p.next_index} is not past every task index")
    p.reserve(p.next_index)
    p.index_of.add(ids, np.asarray(rows, dtype=np.int64))


def _load_column(p: Partition, name: str, col: Mapping[str, Any]) -> None:
    dtype = col["dtype"]
    if dtype is not None and dtype not in ITEMSIZE:
        raise InvalidArgumentError(f"field {name!r} has unknown dtype {dtype!r}")
    column = p.column(validate_id(name, "field"), dtype)
    ragged = col.get("ragged", False)  # absent in checkpoints from before kinds were kept
    if not isinstance(ragged, bool):
        raise InvalidArgumentError(f"field {name!r}: 'ragged' must be true or false")
    column.ragged = ragged
    rows, nodes, shapes, generations, shared = [], [], [], [], []
    for row in col["rows"]:
        # [index, node, shape], since generations are kept [index, node, shape, generation], and
        # for a shared value [index, node, shape, generation, share key]
        if not isinstance(row, list) or len(row) not in (3, 4, 5):
            raise InvalidArgumentError(
                f"field {name!r}: a row must be [index, node, shape(, generation(, share key))]"
            )
        i, n, shape = row[:3]
        if not p.has_task(_count(i)) or not _count(n) < len(p.nodes):
            raise InvalidArgumentError(f"field {name!r} names unknown task index {i} or node {n}")
        rows.append(i)
        nodes.append(n)
        shapes.append(tuple(_count(d) for d in shape))
        generations.append(_count(row[3]) if len(row) >= 4 else 0)
        shared.append(_count(row[4]) if len(row) == 5 else 0)
    if len(set(rows)) != len(rows):
        raise InvalidArgumentError(f"field {name!r} names a task index twice")
    index = np.asarray(rows, dtype=np.int64)
    column.node[index] = nodes
    column.set_shapes(index, RowShapes.from_list(shapes))
    column.generation[index] = generations
    column.set_shared(index, np.asarray(shared, dtype=np.int64))
    partial = col.get("partial", [])  # absent in checkpoints from before partial values
    if not isinstance(partial, list):
        raise InvalidArgumentError(f"field {name!r}: 'partial' must be a list of task indexes")
    partial_rows = _task_rows(p, partial, f"field {name!r}: 'partial' names")
    if (column.node[partial_rows] < 0).any():
        raise InvalidArgumentError(f"field {name!r}: 'partial' names tasks without a value of it")
    column.partial[partial_rows] = True
    if dtype is not None and not ragged and rows:  # a fixed field's shape, for later puts to match
        fixed = RowShapes.from_list(shapes).shape
        column.ragged = fixed is None
        column.fixed_shape = fixed
