"""Batch metadata: where each shard of a REMOTE batch lives, and its dtype and shape.

Columnar on numpy: per field one dtype, one node index per task (an int32 array) and
the tasks' shapes (`RowShapes`: one shape for a fixed-shape field, one length per task
for a ragged one). Slicing, chunking, unions, concatenation and (de)serialisation are
array operations; nothing here makes an object per shard. Its size grows with the
number of tasks, never with sequence length.
"""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distbatch.errors import InvalidArgumentError, InvalidIdError, MetaFormatError, ShapeError
from distbatch.ids import ShardKey, ShardRef, validate_id, validate_node
from distbatch.wire.bundle import validate_id_list
from distbatch.wire.container import ITEMSIZE
from distbatch.wire.shapes import RowShapes

META_VERSION = 1
NODE_INDEX = np.int32
GENERATION = np.int64
# Generations are JSON integers, exact below this.
MAX_GENERATION = 1 << 53
# A shared value's key is its put's generation times this, plus its ordinal in the put (from 1).
SHARE_ORDINALS = 1 << 20


def pick(values: Sequence[Any], rows: np.ndarray) -> list[Any]:
    """`[values[i] for i in rows]`, in C (one `itemgetter` call, not a Python loop)."""
    if len(rows) == 0:
        return []
    if len(rows) == 1:
        return [values[int(rows[0])]]
    return list(operator.itemgetter(*rows.tolist())(values))


def _rows(indices: Sequence[int] | np.ndarray | slice, n: int) -> np.ndarray:
    if isinstance(indices, slice):
        return np.arange(n, dtype=np.int64)[indices]
    return np.asarray(indices, dtype=np.int64).reshape(-1)


@dataclass
class FieldMeta:
    """One column: `dtype` is a wire dtype name, or None for a JSON field.

    `nodes[i]` indexes `BatchMeta.nodes` for task i; `shapes` holds each task's shape
    (`()` for JSON values). Lists are accepted and converted.

    `ragged` is the field's kind, part of its schema: a ragged field is a list of per-task
    tensors in every slice, chunk and gather, even one whose tasks happen to share a shape; a
    fixed-shape one (False) is one stacked tensor. Tasks of different shapes make it ragged.

    `generations[i]` is the generation of the put that stored task i's value on its node (0 or
    None: not known). Reads and deletes name it, so a later put of the same task ids and field
    (which replaces the value) makes this handle's reads and deletes fail instead of reaching
    the new values.

    `shared[i]` (None: all 0) says which tasks share one stored value on their node (a GRPO
    group's prompt or image): tasks of one node with the same nonzero key do, so a gather moves
    the value once. Before the put that stores them, the keys are ordinals in the put.
    """

    dtype: str | None
    nodes: np.ndarray
    shapes: RowShapes
    ragged: bool = False
    generations: np.ndarray | None = None
    shared: np.ndarray | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, np.ndarray) or self.nodes.dtype != NODE_INDEX:
            self.nodes = np.asarray(self.nodes, dtype=NODE_INDEX).reshape(-1)
        gens = self.generations
        if gens is not None and (not isinstance(gens, np.ndarray) or gens.dtype != GENERATION):
            self.generations = np.asarray(gens, dtype=GENERATION).reshape(-1)
        keys = self.shared
        if keys is not None and (not isinstance(keys, np.ndarray) or keys.dtype != GENERATION):
            self.shared = np.asarray(keys, dtype=GENERATION).reshape(-1)
        if not isinstance(self.shapes, RowShapes):
            self.shapes = RowShapes.from_list(list(self.shapes))
        self.ragged = self.dtype is not None and (bool(self.ragged) or self.shapes.shape is None)

    def like(self, nodes: np.ndarray, shapes: RowShapes | None = None) -> FieldMeta:
        """This field's schema (dtype, kind) over other `nodes` (and `shapes`), same tasks."""
        shapes = self.shapes if shapes is None else shapes
        return FieldMeta(self.dtype, nodes, shapes, self.ragged, self.generations, self.shared)

    def __getstate__(self) -> dict[str, Any]:
        # Without `shared` when no task shares a value (the usual case): a batch pickles as before.
        state = dict(self.__dict__)
        if state.get("shared") is None:
            state.pop("shared", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({"shared": None, **state})

    def without_shared(self) -> FieldMeta:
        """This field with no task sharing another's value."""
        return FieldMeta(self.dtype, self.nodes, self.shapes, self.ragged, self.generations)

    @property
    def has_shared(self) -> bool:
        """Whether some tasks share a stored value."""
        return self.shared is not None and bool(self.shared.any())

    @property
    def is_tensor(self) -> bool:
        return self.dtype is not None

    def nbytes(self, i: int) -> int | None:
        if self.dtype is None:
            return None
        return math.prod(self.shapes.row(i)) * ITEMSIZE[self.dtype]

    def row_nbytes(self) -> np.ndarray:
        """Bytes per task (zeros for a JSON field, whose size metadata does not know)."""
        if self.dtype is None:
            return np.zeros(self.shapes.n, dtype=np.int64)
        return self.shapes.counts() * ITEMSIZE[self.dtype]

    def take(self, indices: Sequence[int] | np.ndarray) -> FieldMeta:
        rows = _rows(indices, len(self.nodes))
        gens = None if self.generations is None else self.generations[rows]
        shared = None if self.shared is None else self.shared[rows]
        return FieldMeta(self.dtype, self.nodes[rows], self.shapes.take(rows), self.ragged, gens, shared)

    def generations_at(self, rows: np.ndarray) -> list[int] | None:
        """The generations of the tasks at `rows`, for a request (None when none is known)."""
        if self.generations is None:
            return None
        picked = self.generations[rows]
        return picked.tolist() if picked.any() else None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FieldMeta):
            return NotImplemented
        return (
            self.dtype == other.dtype
            and self.ragged == other.ragged
            and bool(np.array_equal(self.nodes, other.nodes))
            and self.shapes == other.shapes
            and _same_generations(self.generations, other.generations)
            and _same_generations(self.shared, other.shared)
        )


def _same_generations(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    """Equal generations, unknown (None) being all zeros."""
    if a is None or b is None:
        other = b if a is None else a
        return other is None or not other.any()
    return bool(np.array_equal(a, b))


@dataclass
class BatchMeta:
    """Per task and field: the node holding the shard, its dtype and its shape."""

    task_ids: list[str]
    nodes: list[str]
    fields: dict[str, FieldMeta] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.task_ids)

    def __getstate__(self) -> dict[str, Any]:
        # Task ids as one string (ids cannot hold a newline): one object to pickle, not one per task.
        return {"task_ids": "\n".join(self.task_ids), "nodes": self.nodes, "fields": self.fields}

    def __setstate__(self, state: dict[str, Any]) -> None:
        ids = state["task_ids"]
        self.task_ids = ids.split("\n") if isinstance(ids, str) and ids else list(ids or [])
        self.nodes, self.fields = state["nodes"], state["fields"]

    # --------------------------------------------------------------- queries

    def node_of(self, field_name: str, i: int) -> str:
        return self.nodes[int(self.fields[field_name].nodes[i])]

    def refs(self, fields: Iterable[str], indices: Sequence[int] | None = None) -> list[ShardRef]:
        """ShardRefs for `fields` of the tasks at `indices` (all tasks by default), task-major.

        One object per shard: for callers of the per-shard client API; the batch's own
        gathers use `plan` instead.
        """
        rows = np.arange(len(self.task_ids)) if indices is None else _rows(indices, len(self.task_ids))
        row_ids = pick(self.task_ids, rows)
        columns = []
        for name in fields:
            fm = self.fields[name]
            sizes: list[int | None] = (
                [None] * len(rows) if fm.dtype is None else fm.row_nbytes()[rows].tolist()
            )
            columns.append((name, pick(self.nodes, fm.nodes[rows].astype(np.int64)), sizes))
        return [
            ShardRef(column_nodes[r], task_id, name, sizes[r])
            for r, task_id in enumerate(row_ids)
            for name, column_nodes, sizes in columns
        ]

    def plan(self, fields: Sequence[str]) -> dict[str, list[tuple[np.ndarray, list[str]]]]:
        """Per node, the (task rows, fields) products it holds of `fields`.

        Fields whose tasks sit on the same nodes (the usual case: a put stores all of a
        task's fields together) and came from the same puts share one product per node, so a
        product's tasks have one generation each, whatever the field.
        """
        out: dict[str, list[tuple[np.ndarray, list[str]]]] = {}
        groups: dict[tuple[bytes, bytes], list[str]] = {}
        for name in fields:
            fm = self.fields[name]
            gens = b"" if fm.generations is None or not fm.generations.any() else fm.generations.tobytes()
            groups.setdefault((fm.nodes.tobytes(), gens), []).append(name)
        for names in groups.values():
            nodes = self.fields[names[0]].nodes
            if len(self.nodes) == 1:
                out.setdefault(self.nodes[0], []).append((np.arange(len(nodes)), names))
                continue
            order = np.argsort(nodes, kind="stable")
            bounds = np.flatnonzero(np.diff(nodes[order])) + 1
            for rows in np.split(order, bounds):
                if len(rows):
                    out.setdefault(self.nodes[int(nodes[rows[0]])], []).append((rows, names))
        return out

    def keys_by_node(self) -> dict[str, list[ShardKey]]:
        """Every shard this batch names, grouped by the node that holds it (one object per shard)."""
        out: dict[str, list[ShardKey]] = {}
        for node, products in self.plan(list(self.fields)).items():
            keys = out.setdefault(node, [])
            for rows, names in products:
                for task_id in pick(self.task_ids, rows):
                    keys += [ShardKey(task_id, name) for name in names]
        return out

    def lengths(self, field_name: str) -> list[int]:
        """Per-task length of a tensor field: its first dimension (1 for a 0-d shard)."""
        return self.length_array(field_name).tolist()

    def length_array(self, field_name: str) -> np.ndarray:
        fm = self.fields[field_name]
        if not fm.is_tensor:
            raise InvalidArgumentError(f"field {field_name!r} holds JSON values; lengths need a tensor field")
        return fm.shapes.first_dims()

    def total_bytes(self) -> int:
        """Bytes of tensor data the batch names (JSON shards are not counted)."""
        return sum(int(fm.row_nbytes().sum()) for fm in self.fields.values())

    # --------------------------------------------------------------- derivation

    def stored_by(self, generation: int) -> BatchMeta:
        """This meta with every field's values stored by one put of `generation` (0: not known:
        its share ordinals are dropped, no key can name them)."""
        if not generation:
            alone = {name: fm.without_shared() for name, fm in self.fields.items()}
            return BatchMeta(self.task_ids, self.nodes, alone)
        gens = np.full(len(self.task_ids), generation, dtype=GENERATION)
        fields = {
            name: FieldMeta(fm.dtype, fm.nodes, fm.shapes, fm.ragged, gens, share_keys(fm.shared, generation))
            for name, fm in self.fields.items()
        }
        return BatchMeta(self.task_ids, self.nodes, fields)

    def take(self, indices: Sequence[int] | np.ndarray) -> BatchMeta:
        """The sub-batch of the tasks at `indices`, nodes compacted to those still named."""
        rows = _rows(indices, len(self.task_ids))
        sub = {name: fm.take(rows) for name, fm in self.fields.items()}
        return BatchMeta._compact(pick(self.task_ids, rows), self.nodes, sub)

    def select_fields(self, names: Iterable[str]) -> BatchMeta:
        return BatchMeta._compact(list(self.task_ids), self.nodes, {n: self.fields[n] for n in names})

    def moved(self, old: str, new: str) -> BatchMeta:
        """This metadata with `old`'s shards on `new` (a durable worker restarted elsewhere)."""
        if old not in self.nodes:
            return self
        renamed = [new if n == old else n for n in self.nodes]
        return BatchMeta(list(self.task_ids), renamed, dict(self.fields))._merged_nodes()

    def _merged_nodes(self) -> BatchMeta:
        """The same metadata, a node named twice in `nodes` named once."""
        if len(set(self.nodes)) == len(self.nodes):
            return self
        first = {n: i for i, n in reversed(list(enumerate(self.nodes)))}
        remap = np.asarray([first[n] for n in self.nodes], dtype=NODE_INDEX)
        fields = {name: fm.like(remap[fm.nodes.astype(np.intp)]) for name, fm in self.fields.items()}
        return BatchMeta._compact(self.task_ids, list(self.nodes), fields)

    @staticmethod
    def _compact(task_ids: list[str], nodes: list[str], fields: dict[str, FieldMeta]) -> BatchMeta:
        if not fields:
            return BatchMeta(task_ids, [], {})
        if len(nodes) <= 1:
            return BatchMeta(task_ids, list(nodes), dict(fields))
        seen = np.zeros(len(nodes), dtype=bool)
        for fm in fields.values():
            seen |= np.bincount(fm.nodes, minlength=len(nodes)) > 0
        used = np.flatnonzero(seen)
        if len(used) == len(nodes):
            return BatchMeta(task_ids, list(nodes), dict(fields))
        remap = np.zeros(max(len(nodes), 1), dtype=NODE_INDEX)
        remap[used] = np.arange(len(used), dtype=NODE_INDEX)
        return BatchMeta(
            task_ids,
            pick(nodes, used),
            {n: fm.like(remap[fm.nodes]) for n, fm in fields.items()},
        )

    @staticmethod
    def _node_table(metas: Sequence[BatchMeta]) -> tuple[list[str], list[np.ndarray]]:
        """All metas' nodes in one list, and per meta the map from its indexes to that list's."""
        nodes: list[str] = []
        index: dict[str, int] = {}
        maps = []
        for meta in metas:
            maps.append(
                np.asarray([index.setdefault(n, len(index)) for n in meta.nodes], dtype=NODE_INDEX).reshape(
                    -1
                )
            )
        nodes = list(index)
        return nodes, maps

    @staticmethod
    def merge(
        task_ids: list[str],
        parts: Sequence[tuple[BatchMeta, Sequence[int] | np.ndarray | None]],
        field_order: Sequence[str],
    ) -> BatchMeta:
        """Build one meta whose fields come from `parts`.

        Each part is (meta, rows) where rows[i] is the row of that meta for
        task i of the result (None: rows already match). A field is taken from
        the last part that has it.
        """
        nodes, maps = BatchMeta._node_table([meta for meta, _ in parts])
        fields: dict[str, FieldMeta] = {}
        for (meta, rows), mapping in zip(parts, maps):
            for name, fm in meta.fields.items():
                picked = fm if rows is None else fm.take(rows)
                fields[name] = picked.like(mapping[picked.nodes])
        ordered = {name: fields[name] for name in field_order}
        return BatchMeta._compact(task_ids, nodes, ordered)

    @staticmethod
    def concat(metas: Sequence[BatchMeta]) -> BatchMeta:
        """Tasks of `metas` one after another (same fields and dtypes assumed checked)."""
        nodes, maps = BatchMeta._node_table(metas)
        names = list(metas[0].fields)
        task_ids = [t for meta in metas for t in meta.task_ids]
        cols = {
            n: FieldMeta(
                metas[0].fields[n].dtype,
                np.concatenate([m[meta.fields[n].nodes] for meta, m in zip(metas, maps)]),
                RowShapes.concat([meta.fields[n].shapes for meta in metas]),
                any(meta.fields[n].ragged for meta in metas),
                _concat_per_task([(meta.fields[n].generations, len(meta)) for meta in metas]),
                _concat_per_task([(meta.fields[n].shared, len(meta)) for meta in metas]),
            )
            for n in names
        }
        return BatchMeta(task_ids, nodes, cols)

    # --------------------------------------------------------------- serialization

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-safe, compact form.

        Node indexes are run-length encoded (`[index, run, index, run, ...]`); generations
        (where known) are a list of one per node when each node's tasks share one (the usual
        case: one put per node), else `{"runs": [generation, run, ...]}`; the most common
        field's form is said once for the batch (`"generations"` next to `"fields"`), and a
        field says its own only when it differs (null: not known); shapes are
        `{"uniform": dims}` when every task has the same shape, `{"tail": dims, "lengths":
        [...]}` for a ragged field, `{"like": other_field}` when they equal an earlier
        field's, else a flat list of `rank, dims...` per task. A ragged field says so
        (`"ragged": true`), also when its tasks happen to share a shape.
        """
        fields: dict[str, Any] = {}
        seen: list[tuple[str, RowShapes]] = []
        generations = {name: self._generations_json(fm) for name, fm in self.fields.items()}
        default = _most_common(generations.values())
        for name, fm in self.fields.items():
            shapes: Any
            if fm.shapes.shape is not None:
                shapes = fm.shapes.to_json()
            else:
                like = next((other for other, prev in seen if prev == fm.shapes), None)
                shapes = {"like": like} if like is not None else fm.shapes.to_json()
                seen.append((name, fm.shapes))
            fields[name] = {"dtype": fm.dtype, "nodes": _run_length(fm.nodes), "shapes": shapes}
            if fm.ragged:
                fields[name]["ragged"] = True
            if fm.has_shared:
                fields[name]["shared"] = {"runs": _run_length(fm.shared)}  # type: ignore[arg-type]
            if generations[name] != default:
                fields[name]["generations"] = generations[name]
        out = {"version": META_VERSION, "task_ids": self.task_ids, "nodes": self.nodes, "fields": fields}
        if default is not None:
            out["generations"] = default
        return out

    def _generations_json(self, fm: FieldMeta) -> list[int] | dict[str, list[int]] | None:
        if fm.generations is None or not fm.generations.any():
            return None
        return _encode_generations(fm.generations, fm.nodes, len(self.nodes))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @staticmethod
    def from_dict(data: Any) -> BatchMeta:
        """Validate and load `to_dict` output; every problem is a `MetaFormatError`."""
        try:
            return _load_meta(data)
        except MetaFormatError:
            raise
        except (InvalidIdError, ShapeError, ValueError, TypeError, KeyError, IndexError) as exc:
            raise MetaFormatError(f"invalid batch metadata: {exc}") from None

    @staticmethod
    def from_json(text: str | bytes) -> BatchMeta:
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise MetaFormatError(f"batch metadata is not valid JSON: {exc}") from None
        return BatchMeta.from_dict(data)


def _concat_per_task(parts: Sequence[tuple[np.ndarray | None, int]]) -> np.ndarray | None:
    """Per-task arrays (generations, share keys) of `(array, task count)` parts one after
    another (zeros for a part that has none); None if none has one."""
    if all(part is None for part, _ in parts):
        return None
    return np.concatenate([np.zeros(n, GENERATION) if part is None else part for part, n in parts])


def share_keys(ordinals: np.ndarray | None, generation: int) -> np.ndarray | None:
    """A put's share ordinals (0: own value) as keys that name the shared values on the node."""
    if ordinals is None or not ordinals.any():
        return None
    return np.where(ordinals > 0, generation * SHARE_ORDINALS + ordinals, 0)


def _most_common(values: Iterable[Any]) -> Any:
    """The value most entries have (the first of equals; None for no entries)."""
    counts: dict[str, tuple[int, Any]] = {}
    for value in values:
        key = json.dumps(value)
        counts[key] = (counts.get(key, (0, value))[0] + 1, value)
    return max(counts.values(), key=lambda c: c[0])[1] if counts else None


def _encode_generations(
    gens: np.ndarray, nodes: np.ndarray, node_count: int
) -> list[int] | dict[str, list[int]]:
    """A field's generations in JSON: one per node when each node's tasks share one, else runs."""
    table = np.zeros(node_count, dtype=GENERATION)
    table[nodes] = gens
    if np.array_equal(table[nodes], gens):
        return table.tolist()
    return {"runs": _run_length(gens)}


def _expand_generations(raw: Any, nodes: np.ndarray, node_count: int) -> np.ndarray:
    """A field's generations from `_encode_generations`' form, checked: whole numbers from 0 to
    2**53, one per node or runs covering every task."""
    if isinstance(raw, list):
        form, values = "per_node", raw
    elif isinstance(raw, dict) and set(raw) == {"runs"}:
        form, values = "runs", raw["runs"]
    else:
        raise MetaFormatError('generations must be a list (one per node) or {"runs": [...]}')
    if not isinstance(values, list) or set(map(type, values)) - {int}:
        raise MetaFormatError("generations must be a list of integers")
    array = np.asarray(values, dtype=np.int64) if values else np.zeros(0, np.int64)
    if form == "per_node":
        if len(array) != node_count:
            raise MetaFormatError(f"{len(array)} per-node generations for {node_count} nodes")
        checked, out = array, array[nodes]
    else:
        if len(array) % 2:
            raise MetaFormatError("generation runs must be [generation, count] pairs")
        checked, runs = array[0::2], array[1::2]
        if (len(runs) and runs.min() <= 0) or int(runs.sum()) != len(nodes):
            raise MetaFormatError(f"generation runs must cover the batch's {len(nodes)} tasks")
        out = np.repeat(checked, runs)
    if len(checked) and (checked.min() < 0 or checked.max() >= MAX_GENERATION):
        raise MetaFormatError("generations must be 0 to 2**53")
    return out.astype(GENERATION)


def _run_length(values: np.ndarray) -> list[int]:
    if not len(values):
        return []
    starts = np.concatenate([[0], np.flatnonzero(np.diff(values)) + 1])
    runs = np.diff(np.concatenate([starts, [len(values)]]))
    out = np.empty(2 * len(starts), dtype=np.int64)
    out[0::2] = values[starts]
    out[1::2] = runs
    return out.tolist()


def _expand_runs(runs: Any, count: int, limit: int) -> np.ndarray:
    if not isinstance(runs, list) or len(runs) % 2:
        raise MetaFormatError("node runs must be a flat list of [index, count] pairs")
    if not runs:
        if count:
            raise MetaFormatError(f"node runs cover 0 tasks, the batch has {count}")
        return np.zeros(0, dtype=NODE_INDEX)
    if set(map(type, runs)) != {int}:
        raise MetaFormatError("node runs must be integers")
    array = np.asarray(runs, dtype=np.int64)
    indexes, lengths = array[0::2], array[1::2]
    if indexes.min() < 0 or indexes.max() >= limit or lengths.min() <= 0:
        bad = int(np.flatnonzero((indexes < 0) | (indexes >= limit) | (lengths <= 0))[0])
        raise MetaFormatError(f"bad node run ({int(indexes[bad])!r}, {int(lengths[bad])!r})")
    if int(lengths.sum()) != count:
        raise MetaFormatError(f"node runs cover {int(lengths.sum())} tasks, the batch has {count}")
    return np.repeat(indexes, lengths).astype(NODE_INDEX)


def _field_schema(name: str, raw: Any) -> tuple[str | None, bool]:
    """A field's dtype and kind (ragged or not) from its metadata, checked."""
    validate_id(name, "field")
    if not isinstance(raw, dict):
        raise MetaFormatError(f"field {name!r} must be an object")
    dtype, ragged = raw["dtype"], raw.get("ragged", False)
    if dtype is not None and dtype not in ITEMSIZE:
        raise MetaFormatError(f"field {name!r}: unknown dtype {dtype!r}")
    if not isinstance(ragged, bool):
        raise MetaFormatError(f"field {name!r}: 'ragged' must be true or false")
    return dtype, ragged


def _load_meta(data: Any) -> BatchMeta:
    if not isinstance(data, dict) or data.get("version") != META_VERSION:
        raise MetaFormatError(f"expected batch metadata version {META_VERSION}")
    if not isinstance(data["task_ids"], list) or not isinstance(data["nodes"], list):
        raise MetaFormatError("'task_ids' and 'nodes' must be lists")
    try:
        task_ids = validate_id_list(data["task_ids"])
    except InvalidIdError as exc:
        raise MetaFormatError(f"invalid batch metadata: {exc}") from None
    nodes = [validate_node(n) for n in data["nodes"]]
    raw_fields = data["fields"]
    if not isinstance(raw_fields, dict):
        raise MetaFormatError("'fields' must be an object")
    n = len(task_ids)
    fields: dict[str, FieldMeta] = {}
    # JSON objects are unordered (Flask's jsonify sorts keys, for one), so a `{"like": other}`
    # field may come before `other`: resolve those once every other field is loaded.
    like_fields: dict[str, tuple[str | None, np.ndarray, Any, bool, Any, Any]] = {}
    default_generations = data.get("generations")  # a field's unless it says its own
    for name, raw in raw_fields.items():
        dtype, ragged = _field_schema(name, raw)
        node_list = _expand_runs(raw["nodes"], n, len(nodes))
        raw_gens = raw.get("generations", default_generations)
        gens = None if raw_gens is None else _expand_generations(raw_gens, node_list, len(nodes))
        shared = None if "shared" not in raw else _expand_generations(raw["shared"], node_list, len(nodes))
        raw_shapes = raw["shapes"]
        if isinstance(raw_shapes, dict) and set(raw_shapes) == {"like"}:
            like_fields[name] = (dtype, node_list, raw_shapes["like"], ragged, gens, shared)
            continue
        try:
            shapes = RowShapes.from_json(raw_shapes, n)
        except ShapeError as exc:
            raise MetaFormatError(f"field {name!r}: {exc}") from None
        fields[name] = FieldMeta(dtype, node_list, shapes, ragged, gens, shared)
    for name, (dtype, node_list, like, ragged, gens, shared) in like_fields.items():
        other = fields.get(like) if isinstance(like, str) else None
        if other is None:
            raise MetaFormatError(f"field {name!r}: shapes refer to unknown field {like!r}")
        fields[name] = FieldMeta(dtype, node_list, other.shapes, ragged, gens, shared)
    return BatchMeta(task_ids, nodes, {name: fields[name] for name in raw_fields})
