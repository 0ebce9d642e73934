"""Batch metadata: where each shard of a REMOTE batch lives, and its dtype and shape.

Columnar and compact: per field one dtype, and per task a node index and a
shape. Its size grows with the number of shards, never with sequence length.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from distbatch.client import ShardRef, validate_node
from distbatch.errors import DistBatchError, InvalidIdError
from distbatch.ids import ShardKey, validate_id
from distbatch.wire import ITEMSIZE

META_VERSION = 1


class MetaFormatError(DistBatchError, ValueError):
    """Serialized metadata is malformed (bad JSON, ids, nodes, dtypes or shapes)."""


@dataclass
class FieldMeta:
    """One column: `dtype` is a wire dtype name, or None for a JSON field.

    `nodes[i]` indexes `BatchMeta.nodes` for task i; `shapes[i]` is its shape
    (`()` for JSON values).
    """

    dtype: str | None
    nodes: list[int]
    shapes: list[tuple[int, ...]]

    @property
    def is_tensor(self) -> bool:
        return self.dtype is not None

    def nbytes(self, i: int) -> int | None:
        if self.dtype is None:
            return None
        return math.prod(self.shapes[i]) * ITEMSIZE[self.dtype]

    def take(self, indices: Sequence[int]) -> FieldMeta:
        return FieldMeta(self.dtype, [self.nodes[i] for i in indices], [self.shapes[i] for i in indices])


@dataclass
class BatchMeta:
    """Per task and field: the node holding the shard, its dtype and its shape."""

    task_ids: list[str]
    nodes: list[str]
    fields: dict[str, FieldMeta] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.task_ids)

    # --------------------------------------------------------------- queries

    def node_of(self, field_name: str, i: int) -> str:
        return self.nodes[self.fields[field_name].nodes[i]]

    def refs(self, fields: Iterable[str], indices: Sequence[int] | None = None) -> list[ShardRef]:
        """ShardRefs for `fields` of the tasks at `indices` (all tasks by default), task-major."""
        rows = range(len(self.task_ids)) if indices is None else indices
        nodes, task_ids = self.nodes, self.task_ids
        row_task_ids = [task_ids[i] for i in rows]
        columns = []  # per field, column-wise (cheaper than a size and a node lookup per shard)
        for name in fields:
            fm = self.fields[name]
            if fm.dtype is None:
                sizes: list[int | None] = [None] * len(row_task_ids)
            else:
                itemsize, shapes = ITEMSIZE[fm.dtype], fm.shapes
                sizes = [math.prod(shapes[i]) * itemsize for i in rows]
            columns.append((name, [nodes[fm.nodes[i]] for i in rows], sizes))
        return [
            ShardRef(column_nodes[r], task_id, name, sizes[r])
            for r, task_id in enumerate(row_task_ids)
            for name, column_nodes, sizes in columns
        ]

    def keys_by_node(self) -> dict[str, list[ShardKey]]:
        """Every shard this batch names, grouped by the node that holds it."""
        out: dict[str, list[ShardKey]] = {}
        for name, fm in self.fields.items():
            for task_id, node_index in zip(self.task_ids, fm.nodes):
                out.setdefault(self.nodes[node_index], []).append(ShardKey(task_id, name))
        return out

    def lengths(self, field_name: str) -> list[int]:
        """Per-task length of a tensor field: its first dimension (1 for a 0-d shard)."""
        fm = self.fields[field_name]
        if not fm.is_tensor:
            raise ValueError(f"field {field_name!r} holds JSON values; lengths need a tensor field")
        return [shape[0] if shape else 1 for shape in fm.shapes]

    def total_bytes(self) -> int:
        """Bytes of tensor data the batch names (JSON shards are not counted)."""
        return sum(
            math.prod(s) * ITEMSIZE[fm.dtype] for fm in self.fields.values() if fm.dtype for s in fm.shapes
        )

    # --------------------------------------------------------------- derivation

    def take(self, indices: Sequence[int]) -> BatchMeta:
        """The sub-batch of the tasks at `indices`, nodes compacted to those still named."""
        sub = {name: fm.take(indices) for name, fm in self.fields.items()}
        return BatchMeta._compact([self.task_ids[i] for i in indices], self.nodes, sub)

    def select_fields(self, names: Iterable[str]) -> BatchMeta:
        return BatchMeta._compact(list(self.task_ids), self.nodes, {n: self.fields[n] for n in names})

    @staticmethod
    def _compact(task_ids: list[str], nodes: list[str], fields: dict[str, FieldMeta]) -> BatchMeta:
        used = sorted({i for fm in fields.values() for i in fm.nodes})
        remap = {old: new for new, old in enumerate(used)}
        return BatchMeta(
            task_ids,
            [nodes[i] for i in used],
            {
                n: FieldMeta(fm.dtype, [remap[i] for i in fm.nodes], list(fm.shapes))
                for n, fm in fields.items()
            },
        )

    @staticmethod
    def merge(
        task_ids: list[str],
        parts: Sequence[tuple[BatchMeta, Sequence[int] | None]],
        field_order: Sequence[str],
    ) -> BatchMeta:
        """Build one meta whose fields come from `parts`.

        Each part is (meta, rows) where rows[i] is the row of that meta for
        task i of the result (None: rows already match). A field is taken from
        the last part that has it.
        """
        nodes: list[str] = []
        node_index: dict[str, int] = {}
        fields: dict[str, FieldMeta] = {}
        for meta, rows in parts:
            for name, fm in meta.fields.items():
                picked = fm if rows is None else fm.take(rows)
                mapped = []
                for i in picked.nodes:
                    node = meta.nodes[i]
                    if node not in node_index:
                        node_index[node] = len(nodes)
                        nodes.append(node)
                    mapped.append(node_index[node])
                fields[name] = FieldMeta(fm.dtype, mapped, list(picked.shapes))
        ordered = {name: fields[name] for name in field_order}
        return BatchMeta._compact(task_ids, nodes, ordered)

    @staticmethod
    def concat(metas: Sequence[BatchMeta]) -> BatchMeta:
        """Tasks of `metas` one after another (same fields and dtypes assumed checked)."""
        nodes: list[str] = []
        node_index: dict[str, int] = {}
        names = list(metas[0].fields)
        cols: dict[str, FieldMeta] = {n: FieldMeta(metas[0].fields[n].dtype, [], []) for n in names}
        task_ids: list[str] = []
        for meta in metas:
            task_ids += meta.task_ids
            local = []
            for node in meta.nodes:
                if node not in node_index:
                    node_index[node] = len(nodes)
                    nodes.append(node)
                local.append(node_index[node])
            for n in names:
                fm = meta.fields[n]
                cols[n].nodes += [local[i] for i in fm.nodes]
                cols[n].shapes += fm.shapes
        return BatchMeta(task_ids, nodes, cols)

    # --------------------------------------------------------------- serialization

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-safe, compact form.

        Node indexes are run-length encoded (`[index, run, index, run, ...]`);
        shapes are `{"uniform": dims}` when every task has the same shape,
        `{"like": other_field}` when they equal an earlier field's, else a flat
        list of `ndim, dims...` per task.
        """
        fields: dict[str, Any] = {}
        seen_shapes: list[tuple[str, list[tuple[int, ...]]]] = []
        for name, fm in self.fields.items():
            shapes: Any
            if fm.shapes and all(s == fm.shapes[0] for s in fm.shapes):
                shapes = {"uniform": list(fm.shapes[0])}
            else:
                like = next((other for other, prev in seen_shapes if prev == fm.shapes), None)
                shapes = {"like": like} if like is not None else _flatten_shapes(fm.shapes)
                seen_shapes.append((name, fm.shapes))
            fields[name] = {"dtype": fm.dtype, "nodes": _run_length(fm.nodes), "shapes": shapes}
        return {"version": META_VERSION, "task_ids": self.task_ids, "nodes": self.nodes, "fields": fields}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @staticmethod
    def from_dict(data: Any) -> BatchMeta:
        """Validate and load `to_dict` output; every problem is a `MetaFormatError`."""
        try:
            return _load_meta(data)
        except MetaFormatError:
            raise
        except (InvalidIdError, ValueError, TypeError, KeyError, IndexError) as exc:
            raise MetaFormatError(f"invalid batch metadata: {exc}") from None

    @staticmethod
    def from_json(text: str | bytes) -> BatchMeta:
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise MetaFormatError(f"batch metadata is not valid JSON: {exc}") from None
        return BatchMeta.from_dict(data)


def _run_length(values: Sequence[int]) -> list[int]:
    out: list[int] = []
    for value in values:
        if out and out[-2] == value:
            out[-1] += 1
        else:
            out += [value, 1]
    return out


def _expand_runs(runs: Any, count: int, limit: int) -> list[int]:
    if not isinstance(runs, list) or len(runs) % 2:
        raise MetaFormatError("node runs must be a flat list of [index, count] pairs")
    out: list[int] = []
    for index, run in zip(runs[::2], runs[1::2]):
        if not (_is_count(index) and index < limit and _is_count(run) and run > 0):
            raise MetaFormatError(f"bad node run ({index!r}, {run!r})")
        if len(out) + run > count:
            raise MetaFormatError("node runs cover more tasks than the batch has")
        out += [index] * run
    if len(out) != count:
        raise MetaFormatError(f"node runs cover {len(out)} tasks, the batch has {count}")
    return out


def _flatten_shapes(shapes: Sequence[tuple[int, ...]]) -> list[int]:
    flat: list[int] = []
    for shape in shapes:
        flat.append(len(shape))
        flat.extend(shape)
    return flat


def _unflatten_shapes(flat: Sequence[Any], count: int) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []
    pos = 0
    for _ in range(count):
        ndim = flat[pos]
        if not _is_count(ndim) or ndim > 64:
            raise MetaFormatError(f"bad ndim {ndim!r} in shapes")
        dims = flat[pos + 1 : pos + 1 + ndim]
        if len(dims) != ndim or not all(_is_count(d) for d in dims):
            raise MetaFormatError("shapes are truncated or hold non-integer dims")
        shapes.append(tuple(dims))
        pos += 1 + ndim
    if pos != len(flat):
        raise MetaFormatError("shapes hold more entries than there are tasks")
    return shapes


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _load_meta(data: Any) -> BatchMeta:
    if not isinstance(data, dict) or data.get("version") != META_VERSION:
        raise MetaFormatError(f"expected batch metadata version {META_VERSION}")
    if not isinstance(data["task_ids"], list) or not isinstance(data["nodes"], list):
        raise MetaFormatError("'task_ids' and 'nodes' must be lists")
    task_ids = [validate_id(t, "task_id") for t in data["task_ids"]]
    if len(set(task_ids)) != len(task_ids):
        raise MetaFormatError("duplicate task ids in metadata")
    nodes = [validate_node(n) for n in data["nodes"]]
    raw_fields = data["fields"]
    if not isinstance(raw_fields, dict):
        raise MetaFormatError("'fields' must be an object")
    fields: dict[str, FieldMeta] = {}
    # JSON objects are unordered (Flask's jsonify sorts keys, for one), so a `{"like": other}`
    # field may come before `other`: resolve those once every other field is loaded.
    like_fields: dict[str, tuple[str | None, list[int], Any]] = {}
    for name, raw in raw_fields.items():
        validate_id(name, "field")
        dtype = raw["dtype"]
        if dtype is not None and dtype not in ITEMSIZE:
            raise MetaFormatError(f"field {name!r}: unknown dtype {dtype!r}")
        node_list = _expand_runs(raw["nodes"], len(task_ids), len(nodes))
        raw_shapes = raw["shapes"]
        if isinstance(raw_shapes, dict) and set(raw_shapes) == {"uniform"}:
            dims = raw_shapes["uniform"]
            if not isinstance(dims, list) or len(dims) > 64 or not all(_is_count(d) for d in dims):
                raise MetaFormatError(f"field {name!r}: bad uniform shape {dims!r}")
            shapes = [tuple(dims)] * len(task_ids)
        elif isinstance(raw_shapes, dict) and set(raw_shapes) == {"like"}:
            like_fields[name] = (dtype, node_list, raw_shapes["like"])
            continue
        elif isinstance(raw_shapes, list):
            shapes = _unflatten_shapes(raw_shapes, len(task_ids))
        else:
            raise MetaFormatError(f"field {name!r}: shapes must be a list or a uniform/like object")
        fields[name] = FieldMeta(dtype, node_list, shapes)
    for name, (dtype, node_list, like) in like_fields.items():
        other = fields.get(like) if isinstance(like, str) else None
        if other is None:
            raise MetaFormatError(f"field {name!r}: shapes refer to unknown field {like!r}")
        fields[name] = FieldMeta(dtype, node_list, list(other.shapes))
    return BatchMeta(task_ids, nodes, {name: fields[name] for name in raw_fields})
