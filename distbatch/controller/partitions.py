"""A partition's bookkeeping: its tasks (id <-> per-partition index), per field which node holds
each task's shard and its shape, who consumed what, what is being cleared, custom metadata.

Plain data plus the queries the controller and samplers make of it (ready tasks, lengths, the
metadata of a batch); the `Controller` holds the lock around every use.

**Ready tasks are kept, not recomputed.** `ready(task_name, fields)` is what every `get_meta`
asks; computing it from the columns costs time in proportion to every task the partition holds
(tens of thousands in a streaming run, under the controller's lock). So the answer for each
(task name, fields) asked is kept, in ascending order (`_ready`), and updated where it can
change: a put (`register`), a consumption (`consume`), a forgotten task (`forget`), a deleted
shard (`drop_rows`), a reset (`reset_consumption`). It is built on first use, and at most
`MAX_READY_SETS` are kept per partition (least recently asked dropped, rebuilt when asked
again). Consumption goes through `consume` / `reset_consumption`, never `consumed` directly,
once the partition is in use (a checkpoint fills `consumed` before any `ready`).
"""

from __future__ import annotations

import json
from bisect import bisect_left
from collections.abc import Collection, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from distbatch.batch.meta import NODE_INDEX, BatchMeta, FieldMeta
from distbatch.errors import (
    ClearInProgressError,
    InvalidArgumentError,
    SchemaConflictError,
    ShardElsewhereError,
)
from distbatch.ids import ShardKey
from distbatch.wire.shapes import RowShapes

# (task name, fields) pairs whose ready set a partition keeps; past that, the least recently asked
# is dropped (and rebuilt, once, if asked again).
MAX_READY_SETS = 64
# Past this many indexes added or removed at once, a kept ready set is rebuilt, not edited in place.
_BULK = 64


class _Ascending:
    """Distinct indexes in ascending order: a kept ready set.

    New tasks mostly get the highest indexes and consumers mostly take the lowest, so an
    addition is mostly an append and a removal a bisection and a move of pointers in C; many at
    once (a clear) rebuild the list in one pass.
    """

    __slots__ = ("items",)

    def __init__(self, indexes: Iterable[int]) -> None:
        self.items = sorted(set(indexes))

    def add_many(self, indexes: Iterable[int]) -> None:
        new = sorted(set(indexes))
        items = self.items
        if not new:
            return
        if not items or new[0] > items[-1]:
            items.extend(new)
        elif len(new) > _BULK:
            self.items = sorted(set(items).union(new))
        else:
            for i in new:
                at = bisect_left(items, i)
                if at == len(items) or items[at] != i:
                    items.insert(at, i)

    def discard_many(self, indexes: Collection[int]) -> None:
        items = self.items
        if len(indexes) > _BULK:
            gone = set(indexes)
            self.items = [i for i in items if i not in gone]
            return
        for i in indexes:
            at = bisect_left(items, i)
            if at < len(items) and items[at] == i:
                del items[at]


@dataclass
class Column:
    """One field of a partition: dtype, kind, and per task index its node and shape.

    `ragged` (the field's kind) sticks once set: a put of ragged values, or of fixed-shape
    values of another shape than earlier puts', makes every later `get_meta` say ragged, so a
    consumer's column type never depends on which tasks it was given.
    """

    dtype: str | None
    node: dict[int, int] = field(default_factory=dict)
    shape: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # The generation of the put that stored each task's value (absent: not known), so batches
    # handed out by `get_meta` refuse values a later put of the same ids replaced.
    generation: dict[int, int] = field(default_factory=dict)
    # Per task whose value it shares with others on its node, the key naming that value.
    shared: dict[int, int] = field(default_factory=dict)
    # Tasks whose value is partial (`put(..., partial=True)`: a generation still growing): held
    # and located, never produced, so never ready, until a put without `partial` completes it.
    partial: set[int] = field(default_factory=set)
    ragged: bool = False
    fixed_shape: tuple[int, ...] | None = None

    def learn_kind(self, fm: FieldMeta) -> None:
        """Fold a put's kind for this field into the partition's."""
        if fm.dtype is None or not len(fm.nodes):
            return
        if fm.ragged or (self.fixed_shape is not None and fm.shapes.shape != self.fixed_shape):
            self.ragged = True
        elif self.fixed_shape is None:
            self.fixed_shape = fm.shapes.shape


@dataclass
class Partition:
    """One partition: its tasks, where each field of each task lives, and who consumed what."""

    partition_id: str
    index_of: dict[str, int] = field(default_factory=dict)
    task_of: dict[int, str] = field(default_factory=dict)
    nodes: list[str] = field(default_factory=list)
    node_index: dict[str, int] = field(default_factory=dict)
    columns: dict[str, Column] = field(default_factory=dict)
    consumed: dict[str, set[int]] = field(default_factory=dict)
    next_index: int = 0
    # Indexes whose shards a clear is deleting (count of clears in flight): never handed out.
    clearing: dict[int, int] = field(default_factory=dict)
    # Fields declared with create_partition: a consumer may wait for them before any put.
    expected: set[str] = field(default_factory=set)
    # Per-task JSON objects set with Controller.set_custom_meta (TransferQueue's custom_meta).
    custom_meta: dict[int, dict[str, Any]] = field(default_factory=dict)
    # The policy version each task was generated with (`put(..., version=)`); a task without one
    # is never stale. A task is as old as its oldest part: a later put keeps the older version.
    versions: dict[int, int] = field(default_factory=dict)
    # (task name, fields) -> indexes with every one of those fields, not consumed by that task
    # name (tasks being cleared included: `ready` leaves them out); see the module docstring.
    _ready: dict[tuple[str, tuple[str, ...]], _Ascending] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def knows(self, name: str) -> bool:
        """Whether `name` was ever put into this partition or declared for it."""
        return name in self.columns or name in self.expected

    def known_fields(self) -> list[str]:
        return list(self.columns) + sorted(self.expected.difference(self.columns))

    def intern_node(self, node: str) -> int:
        if node not in self.node_index:
            self.node_index[node] = len(self.nodes)
            self.nodes.append(node)
        return self.node_index[node]

    def allocate(self, count: int) -> int:
        """First index of a free block of `count` indexes, aligned to `count`.

        Freed indexes are reused, and a put of whole GRPO groups always lands
        on group-aligned indexes (a block of k*n starts at a multiple of n).
        """
        if len(self.task_of) < self.next_index:  # there are holes to reuse
            for start in range(0, self.next_index, count):
                # An index a clear still holds (its task forgotten by `forget_node` meanwhile)
                # is not free yet: that clear settles by index.
                block = range(start, start + count)
                if all(i not in self.task_of and i not in self.clearing for i in block):
                    self.next_index = max(self.next_index, start + count)
                    return start
        start = -(-self.next_index // count) * count
        self.next_index = start + count
        return start

    def check_put(self, meta: BatchMeta, group_size: int) -> list[str]:
        """The tasks a put of `meta` would add; raises, changing nothing, if it may not happen:
        a field's dtype differs from this partition's (`SchemaConflictError`), a task is being
        cleared (`ClearInProgressError`), or the new tasks are not whole groups of `group_size`
        (`InvalidArgumentError`)."""
        for name, fm in meta.fields.items():
            column = self.columns.get(name)
            if column is not None and column.dtype != fm.dtype:
                have, given = column.dtype or "JSON", fm.dtype or "JSON"
                raise SchemaConflictError(
                    f"field {name!r} is {have} in partition {self.partition_id!r}, the put gives {given}"
                )
        self._check_same_nodes(meta)
        clearing = [t for t in meta.task_ids if self.index_of.get(t) in self.clearing]
        if clearing:
            raise ClearInProgressError(
                f"{len(clearing)} task(s) of partition {self.partition_id!r} are being cleared "
                f"(e.g. {clearing[0]!r}): put them again once clear_tasks returns"
            )
        new = [t for t in meta.task_ids if t not in self.index_of]
        if len(new) % group_size:
            raise InvalidArgumentError(
                f"the put adds {len(new)} new task(s) to partition {self.partition_id!r}, not whole "
                f"groups of n_samples_per_prompt={group_size}: put each prompt's {group_size} responses "
                "together (groups are aligned blocks of indexes, so a partial group could never be completed)"
            )
        return new

    def _check_same_nodes(self, meta: BatchMeta) -> None:
        """`ShardElsewhereError` if a field this partition has for a task comes from another node."""
        fields = [name for name in meta.fields if name in self.columns]
        if not fields:  # the usual later-stage put: new fields only
            return
        rows = np.asarray([self.index_of.get(t, -1) for t in meta.task_ids], dtype=np.int64)
        known = np.flatnonzero(rows >= 0)
        if not len(known):
            return
        # The batch's nodes as this partition numbers them (-1: one it has never seen).
        local = np.asarray([self.node_index.get(node, -1) for node in meta.nodes], dtype=np.int64)
        for name in fields:
            node_of = self.columns[name].node
            held = np.fromiter((node_of.get(r, -1) for r in rows[known].tolist()), np.int64, len(known))
            given = local[np.asarray(meta.fields[name].nodes, dtype=np.int64)[known]]
            moved = np.flatnonzero((held >= 0) & (held != given))
            if len(moved):
                i, first = int(known[moved[0]]), int(moved[0])
                there = self.nodes[int(held[first])]
                raise ShardElsewhereError(
                    f"task {meta.task_ids[i]!r} of partition {self.partition_id!r} already has field "
                    f"{name!r} on {there}; this put has it on {meta.nodes[int(meta.fields[name].nodes[i])]}."
                    " A task's field lives on one worker: put it there, or clear_tasks it first"
                )

    def register(self, meta: BatchMeta, new: Sequence[str], partial: AbstractSet[str] = frozenset()) -> None:
        """Give the `new` tasks one block of indexes, in batch order, and record where each of
        `meta`'s fields lives and its shape (checked first with `check_put`); the fields in
        `partial` are still growing: not produced until a later put that does not name them."""
        if new:
            start = self.allocate(len(new))
            for offset, task_id in enumerate(new):
                self.index_of[task_id] = start + offset
                self.task_of[start + offset] = task_id
        rows = [self.index_of[t] for t in meta.task_ids]
        local_nodes = [self.intern_node(n) for n in meta.nodes]
        for name, fm in meta.fields.items():
            column = self.columns.setdefault(name, Column(fm.dtype))
            column.learn_kind(fm)
            for row, node, shape in zip(rows, fm.nodes.tolist(), fm.shapes.tolist()):
                column.node[row] = local_nodes[node]
                column.shape[row] = shape
            if fm.generations is not None:
                column.generation.update(zip(rows, fm.generations.tolist()))
            else:
                for row in rows:
                    column.generation.pop(row, None)
            _set_or_drop(column.shared, rows, fm.shared)
            if name in partial:
                column.partial.update(rows)
            else:
                column.partial.difference_update(rows)
        if partial:
            self._drop_ready(rows, partial)
        complete = meta.fields.keys() - partial
        if complete:
            self._add_ready(rows, complete)

    def inflight(self) -> list[int]:
        """Indexes of the tasks with a partial value (their generation still growing), ascending."""
        rows: set[int] = set()
        for column in self.columns.values():
            rows |= column.partial
        return sorted(rows)

    def fields_of_all(self, indexes: Sequence[int]) -> list[str]:
        """The fields every one of `indexes` has a value of (partial or not)."""
        return [name for name, c in self.columns.items() if all(i in c.node for i in indexes)]

    def _drop_ready(self, rows: Sequence[int], put_fields: AbstractSet[str]) -> None:
        """Rows whose `put_fields` just became partial: out of every kept ready set asking for them."""
        for (_, names), ready in self._ready.items():
            if not put_fields.isdisjoint(names):
                ready.discard_many(rows)

    def set_versions(self, task_ids: Sequence[str], versions: Sequence[int]) -> None:
        """Record each task's policy version (registered tasks; the older of two wins)."""
        for task_id, version in zip(task_ids, versions):
            row = self.index_of[task_id]
            known = self.versions.get(row)
            self.versions[row] = version if known is None else min(known, version)

    def split_stale(self, indexes: Sequence[int], oldest: int) -> tuple[list[int], list[int]]:
        """`indexes` as (fresh, stale): stale ones have a policy version below `oldest`."""
        versions = self.versions
        if not versions:
            return list(indexes), []
        fresh: list[int] = []
        stale: list[int] = []
        for i in indexes:
            (stale if versions.get(i, oldest) < oldest else fresh).append(i)
        return fresh, stale

    def versions_of(self, task_ids: Iterable[str]) -> dict[str, int]:
        """The policy versions of those `task_ids` that have one."""
        out = {}
        for task_id in task_ids:
            i = self.index_of.get(task_id)
            if i is not None and i in self.versions:
                out[task_id] = self.versions[i]
        return out

    def _add_ready(self, rows: Sequence[int], put_fields: AbstractSet[str]) -> None:
        """Rows that just got `put_fields`: into each kept ready set they now belong to."""
        for (task_name, names), ready in self._ready.items():
            if put_fields.isdisjoint(names):
                continue
            columns = [self.columns[f] for f in names]
            consumed = self.consumed.get(task_name, ())
            ready.add_many(
                r
                for r in rows
                if r not in consumed and all(r in c.node and r not in c.partial for c in columns)
            )

    def ready(self, task_name: str, fields: Sequence[str]) -> list[int]:
        """Indexes that have every field produced and are not consumed by `task_name`, ascending
        (from the kept set: time in proportion to the ready tasks, not to all of them)."""
        if not fields or any(f not in self.columns for f in fields):
            return []
        key = (task_name, tuple(sorted(set(fields))))
        have = self._ready.pop(key, None)  # re-inserted last: the most recently asked
        if have is None:
            have = _Ascending(self._compute_ready(task_name, key[1]))
            while len(self._ready) >= MAX_READY_SETS:
                del self._ready[next(iter(self._ready))]
        self._ready[key] = have
        if self.clearing:
            return [i for i in have.items if i not in self.clearing]
        return list(have.items)

    def _compute_ready(self, task_name: str, fields: Sequence[str]) -> set[int]:
        """`ready` from the columns (tasks being cleared included): time in proportion to the
        partition's tasks. For status queries, and to build a kept set."""
        columns = sorted((self.columns[f] for f in fields), key=lambda c: len(c.node))
        have = set(columns[0].node)
        for column in columns[1:]:
            have.intersection_update(column.node)
        have.difference_update(self.consumed.get(task_name, ()))
        for column in columns:
            have.difference_update(column.partial)
        return have

    def count_ready(self, fields: Sequence[str]) -> int:
        """Tasks that have every one of `fields` (consumed or not, being cleared excluded)."""
        if not fields or any(f not in self.columns for f in fields):
            return 0
        return len(self._compute_ready("\0", fields).difference(self.clearing))

    def consume(self, task_name: str, indexes: Iterable[int]) -> None:
        """Mark `indexes` consumed by `task_name`: never ready for it again (until a reset)."""
        taken = set(indexes)
        self.consumed.setdefault(task_name, set()).update(taken)
        for (name, _), ready in self._ready.items():
            if name == task_name:
                ready.discard_many(taken)

    def reset_consumption(self, task_name: str | None = None) -> None:
        """Forget what `task_name` (or every consumer) consumed."""
        if task_name is None:
            self.consumed.clear()
            self._ready.clear()
            return
        self.consumed.pop(task_name, None)
        for key in [k for k in self._ready if k[0] == task_name]:
            del self._ready[key]

    def sample_lengths(self, indexes: Sequence[int], field: str) -> list[int]:
        """Per-sample lengths (first dimension of `field`), for length-aware samplers."""
        column = self.columns.get(field)
        if column is None or column.dtype is None:
            raise InvalidArgumentError(
                f"partition {self.partition_id!r} has no tensor field {field!r} for lengths"
            )
        out = []
        for i in indexes:
            shape = column.shape.get(i)
            if shape is None:
                raise InvalidArgumentError(
                    f"task {self.task_of.get(i, i)!r} has no field {field!r} for lengths"
                )
            out.append(shape[0] if shape else 1)
        return out

    def get_custom_meta(self, indexes: Sequence[int]) -> dict[int, dict[str, Any]]:
        """Custom metadata of those `indexes` that have some, by index (TransferQueue's
        ``DataPartitionStatus.get_custom_meta``, which samplers such as
        `SeqlenBalancedSampler` read ``total_lengths`` from)."""
        return {i: self.custom_meta[i] for i in indexes if i in self.custom_meta}

    def meta_for(self, indexes: Sequence[int], fields: Sequence[str]) -> BatchMeta:
        node_map: dict[int, int] = {}
        nodes: list[str] = []
        cols: dict[str, FieldMeta] = {}
        for name in fields:
            column = self.columns[name]
            node_list = []
            for i in indexes:
                n = column.node[i]
                if n not in node_map:
                    node_map[n] = len(nodes)
                    nodes.append(self.nodes[n])
                node_list.append(node_map[n])
            shapes = RowShapes.from_list([column.shape[i] for i in indexes])
            node_array = np.asarray(node_list, dtype=NODE_INDEX)
            known = column.generation
            gens = np.fromiter((known.get(i, 0) for i in indexes), np.int64, len(indexes)) if known else None
            keys = column.shared
            shared = np.fromiter((keys.get(i, 0) for i in indexes), np.int64, len(indexes)) if keys else None
            cols[name] = FieldMeta(column.dtype, node_array, shapes, column.ragged, gens, shared)
        return BatchMeta([self.task_of[i] for i in indexes], nodes, cols)

    def keys_by_node(self, indexes: Iterable[int]) -> dict[str, list[ShardKey]]:
        out: dict[str, list[ShardKey]] = {}
        index_set = set(indexes)
        for name, column in self.columns.items():
            for i in index_set:
                n = column.node.get(i)
                if n is not None:
                    out.setdefault(self.nodes[n], []).append(ShardKey(self.task_of[i], name))
        return out

    def rows_on(self, node: str) -> list[int]:
        """Indexes of the tasks that have a shard on `node`, in order."""
        n = self.node_index.get(node)
        if n is None:
            return []
        return sorted({i for column in self.columns.values() for i, m in column.node.items() if m == n})

    def drop_rows(self, node: str, keys: Iterable[ShardKey]) -> None:
        """Forget that `node` holds these shards (they were deleted) while their tasks stay."""
        n = self.node_index.get(node)
        dropped: dict[str, list[int]] = {}
        for key in keys:
            i = self.index_of.get(key.task_id)
            column = self.columns.get(key.field)
            if i is not None and column is not None and column.node.get(i) == n:
                del column.node[i]
                column.shape.pop(i, None)
                column.generation.pop(i, None)
                column.shared.pop(i, None)
                column.partial.discard(i)
                dropped.setdefault(key.field, []).append(i)
        for (_, names), ready in self._ready.items():
            rows = [i for name in names for i in dropped.get(name, ())]
            if rows:
                ready.discard_many(rows)

    def mark_clearing(self, indexes: Iterable[int], delta: int) -> None:
        for i in indexes:
            count = self.clearing.get(i, 0) + delta
            if count > 0:
                self.clearing[i] = count
            else:
                self.clearing.pop(i, None)

    def forget(self, indexes: Iterable[int]) -> None:
        gone = []
        for i in list(indexes):
            task_id = self.task_of.pop(i, None)
            if task_id is None:
                continue
            gone.append(i)
            del self.index_of[task_id]
            self.custom_meta.pop(i, None)
            self.versions.pop(i, None)
            for column in self.columns.values():
                column.node.pop(i, None)
                column.shape.pop(i, None)
                column.generation.pop(i, None)
                column.shared.pop(i, None)
                column.partial.discard(i)
            for consumed in self.consumed.values():
                consumed.discard(i)
        for ready in self._ready.values():
            ready.discard_many(gone)

    def production(self, names: list[str]) -> dict[str, Any]:
        """Tasks, how many have each of `names`, and how many have all of them."""
        produced = {n: self._produced(n) for n in names}
        return {"tasks": len(self.task_of), "produced": produced, "ready": self.count_ready(names)}

    def _produced(self, name: str) -> int:
        """Tasks with a complete (not partial) value of field `name`."""
        column = self.columns.get(name)
        return 0 if column is None else len(column.node) - len(column.partial)

    def summary(self) -> dict[str, Any]:
        """Tasks, per field how many have it (and its kind), how many have every field, and per
        consumer how many it consumed: what `distbatch status` shows of a controller."""
        fields = {}
        for name in self.known_fields():
            column = self.columns.get(name)
            fields[name] = {
                "produced": self._produced(name),
                "partial": len(column.partial) if column is not None else 0,
                "dtype": column.dtype if column is not None else None,
                "ragged": column.ragged if column is not None else False,
            }
        by_version: dict[int, int] = {}
        for version in self.versions.values():
            by_version[version] = by_version.get(version, 0) + 1
        return {
            "tasks": len(self.task_of),
            "ready": self.count_ready(self.known_fields()),
            "clearing": len(self.clearing),
            "fields": fields,
            "consumed": {name: len(indexes) for name, indexes in self.consumed.items()},
            "policy_versions": {str(v): n for v, n in sorted(by_version.items())},
        }

    def set_custom_meta(self, checked: Mapping[str, dict[str, Any]]) -> None:
        """Attach checked objects to tasks; an unknown task sets nothing."""
        unknown = [t for t in checked if t not in self.index_of]
        if unknown:
            raise InvalidArgumentError(f"partition {self.partition_id!r} has no tasks {unknown[:5]}")
        for task_id, meta in checked.items():
            self.custom_meta[self.index_of[task_id]] = meta

    def custom_meta_of(self, task_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """Copies of the custom metadata of those `task_ids` that have some."""
        out = {}
        for task_id in task_ids:
            i = self.index_of.get(task_id)
            if i is not None and i in self.custom_meta:
                out[task_id] = json.loads(json.dumps(self.custom_meta[i]))
        return out

    def settle_clear(
        self, indexes: list[int], plan: Mapping[str, list[ShardKey]], failed: Collection[str]
    ) -> list[int]:
        """After a clear's deletes: the tasks whose shards all went (returned, for the caller to
        forget); a kept task keeps only the shards still there, so a deleted one is never handed
        out again."""
        self.mark_clearing(indexes, -1)
        stuck = {self.index_of[k.task_id] for n in failed for k in plan[n] if k.task_id in self.index_of}
        forgotten = [i for i in indexes if i not in stuck]
        for node, keys in plan.items():
            if node not in failed:
                self.drop_rows(node, keys)
        return forgotten


def _set_or_drop(known: dict[int, int], rows: Sequence[int], values: np.ndarray | None) -> None:
    """`known[row]` = the row's value where it is nonzero, dropped where it is 0 (or all None)."""
    if values is None or not values.any():
        for row in rows:
            known.pop(row, None)
        return
    for row, value in zip(rows, values.tolist()):
        if value:
            known[row] = value
        else:
            known.pop(row, None)
