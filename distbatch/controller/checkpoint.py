"""A controller checkpoint: its partitions as JSON-safe data, and back.

Reading one validates everything before the controller changes: every id, every index, every
node number, every dtype and every cross-reference (a column naming an unknown task, a consumer
that consumed an unknown index) is refused with `InvalidArgumentError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from distbatch.checks import check_int
from distbatch.controller.arguments import custom_meta_object
from distbatch.controller.partitions import Column, Partition
from distbatch.errors import InvalidArgumentError
from distbatch.ids import validate_id, validate_node
from distbatch.wire.container import ITEMSIZE

CHECKPOINT_VERSION = 1


def partitions_to_state(partitions: Mapping[str, Partition]) -> dict[str, Any]:
    """Every partition's tasks, fields, consumption and custom metadata, as JSON-safe data."""
    return {pid: _partition_to_state(p) for pid, p in partitions.items()}


def _partition_to_state(p: Partition) -> dict[str, Any]:
    return {
        "tasks": [[i, t] for i, t in sorted(p.task_of.items())],
        "next_index": p.next_index,
        "nodes": list(p.nodes),
        "columns": {
            name: {
                "dtype": c.dtype,
                "ragged": c.ragged,
                "rows": [_row(c, i) for i in sorted(c.node)],
                "partial": sorted(c.partial),
            }
            for name, c in p.columns.items()
        },
        "consumed": {name: sorted(s) for name, s in p.consumed.items()},
        "expected_fields": sorted(p.expected),
        "custom_meta": [[i, meta] for i, meta in sorted(p.custom_meta.items())],
        "versions": [[i, v] for i, v in sorted(p.versions.items())],
    }


def _row(c: Column, i: int) -> list[Any]:
    """Task `i`'s value of a column: [index, node, shape, generation(, share key)]."""
    row = [i, c.node[i], list(c.shape[i]), c.generation.get(i, 0)]
    return row + [c.shared[i]] if i in c.shared else row


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
    _load_tasks(p, raw["tasks"])
    for node in raw["nodes"]:
        p.intern_node(validate_node(node))
    for name, col in raw["columns"].items():
        _load_column(p, name, col)
    for name, indexes in raw["consumed"].items():
        consumed = {_count(i) for i in indexes}
        if not consumed <= p.task_of.keys():
            raise InvalidArgumentError(f"consumer {name!r} consumed unknown task indexes")
        p.consumed[validate_id(name, "task_name")] = consumed
    expected = raw.get("expected_fields", [])
    if not isinstance(expected, list):
        raise InvalidArgumentError("'expected_fields' must be a list")
    p.expected = {validate_id(f, "field") for f in expected}
    for i, meta in raw.get("custom_meta", []):
        if _count(i) not in p.task_of:
            raise InvalidArgumentError(f"custom_meta names unknown task index {i}")
        p.custom_meta[i] = custom_meta_object(meta, p.task_of[i])
    for i, version in raw.get("versions", []):
        if _count(i) not in p.task_of:
            raise InvalidArgumentError(f"versions names unknown task index {i}")
        p.versions[i] = check_int(version, "a task's policy version", 0)
    return p


def _load_tasks(p: Partition, tasks: Any) -> None:
    for i, t in tasks:
        i = _count(i)
        if i in p.task_of or validate_id(t, "task_id") in p.index_of:
            raise InvalidArgumentError(f"task index {i} or task id {t!r} is listed twice")
        p.task_of[i] = t
        p.index_of[t] = i
    if p.task_of and p.next_index <= max(p.task_of):
        raise InvalidArgumentError(f"next_index {p.next_index} is not past every task index")


def _load_column(p: Partition, name: str, col: Mapping[str, Any]) -> None:
    dtype = col["dtype"]
    if dtype is not None and dtype not in ITEMSIZE:
        raise InvalidArgumentError(f"field {name!r} has unknown dtype {dtype!r}")
    column = p.columns.setdefault(validate_id(name, "field"), Column(dtype))
    ragged = col.get("ragged", False)  # absent in checkpoints from before kinds were kept
    if not isinstance(ragged, bool):
        raise InvalidArgumentError(f"field {name!r}: 'ragged' must be true or false")
    column.ragged = ragged
    for row in col["rows"]:
        # [index, node, shape], since generations are kept [index, node, shape, generation], and
        # for a shared value [index, node, shape, generation, share key]
        if not isinstance(row, list) or len(row) not in (3, 4, 5):
            raise InvalidArgumentError(
                f"field {name!r}: a row must be [index, node, shape(, generation(, share key))]"
            )
        i, n, shape = row[:3]
        if _count(i) not in p.task_of or not _count(n) < len(p.nodes):
            raise InvalidArgumentError(f"field {name!r} names unknown task index {i} or node {n}")
        column.node[i] = n
        column.shape[i] = tuple(_count(d) for d in shape)
        if len(row) >= 4 and _count(row[3]):
            column.generation[i] = row[3]
        if len(row) == 5 and _count(row[4]):
            column.shared[i] = row[4]
    partial = col.get("partial", [])  # absent in checkpoints from before partial values
    if not isinstance(partial, list):
        raise InvalidArgumentError(f"field {name!r}: 'partial' must be a list of task indexes")
    column.partial = {_count(i) for i in partial}
    if not column.partial <= column.node.keys():
        raise InvalidArgumentError(f"field {name!r}: 'partial' names tasks without a value of it")
    shapes = set(column.shape.values())
    if dtype is not None and not ragged and shapes:  # a fixed field's shape, for later puts to match
        column.ragged = len(shapes) > 1
        column.fixed_shape = None if column.ragged else shapes.pop()
