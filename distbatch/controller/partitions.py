"""A partition's bookkeeping: its tasks (id <-> per-partition index), per field which node holds
each task's shard and its shape, who consumed what, what is being cleared, custom metadata.

Plain data plus the queries the controller and samplers make of it (ready tasks, lengths, the
metadata of a batch); the `Controller` holds the lock around every use.

**Columns, not objects per task.** Everything kept per task is a numpy array indexed by the
task's index (a slot of the partition): its id (an object array), per field the node holding
its shard (-1: none), its shape (a rank and its dims), the generation of the put that
stored it, its share key and whether it is partial; per consumer a consumed mask; per task a
policy version (-1: none) and how many clears hold it. A task costs its id's string, 20-34
bytes of `index_of` (id <-> index, a hash table in numpy arrays: `TaskIndex`) and some 20
bytes a field, instead of a dict entry, an int and a tuple per field; a put, a `get_meta` and a
clear each run as a few array operations over the batch's rows, and `ready` is a handful of
boolean ANDs over the partition's slots (tens of microseconds for 100k tasks).

**Under the lock, no numpy call that lets the GIL go.** A served controller answers
`get_meta` under its lock while hundreds of request threads want the interpreter. numpy
releases the GIL in fancy indexing, sorts and loops over large arrays; a thread that does so
under the lock waits for the interpreter again (up to a switch interval, 5 ms) while every other
`get_meta` waits for the lock: measured, a 16-task `get_meta` went from 0.06 ms to 5 ms with a
few busy threads about. So what a `get_meta` does per call reads a few rows item by item
(`at`), and what it does over every task is kept instead:

**Ready tasks are kept, not recomputed.** `ready(task_name, fields)` is what every `get_meta`
asks. The answer for each (task
name, fields) asked is kept as a list in ascending order and edited where it can change, by the
put's or the consumption's own rows: a put (`register`), a consumption (`consume`), a forgotten
task (`forget`), a deleted shard (`drop_rows`), a reset (`reset_consumption`); tasks being
cleared are left out when it is read. It is built from the columns on first use, and at most
`MAX_READY_SETS` are kept per partition (least recently asked dropped, rebuilt when asked
again). Whatever changes the arrays goes through these methods once the partition is in use (a
checkpoint fills them before any `ready`).
"""

from __future__ import annotations

import json
from bisect import bisect_left
from collections.abc import Collection, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import numpy as np

from distbatch.batch.meta import NODE_INDEX, BatchMeta, FieldMeta, pick
from distbatch.controller.task_index import FEW_ROWS, MAX_SLOTS, TaskIndex
from distbatch.errors import (
    ClearInProgressError,
    InvalidArgumentError,
    SchemaConflictError,
    ShardElsewhereError,
)
from distbatch.ids import ShardKey
from distbatch.wire.shapes import RowShapes

NO_VERSION = -1  # a task put without a policy version: never stale
_UNSET = object()  # a column no value was put into yet
# (task name, fields) pairs whose ready set a partition keeps; past that, the least recently asked
# is dropped (and rebuilt, once, if asked again).
MAX_READY_SETS = 64
# Past this many indexes added or removed at once, a kept ready set is rebuilt, not edited in place.
_BULK = 64
_NEWEST = np.iinfo(np.int64).max


def _grown(array: np.ndarray, capacity: int, fill: Any) -> np.ndarray:
    """`array` with `capacity` rows, the new ones set to `fill`."""
    out = np.full((capacity, *array.shape[1:]), fill, dtype=array.dtype)
    out[: len(array)] = array
    return out


class _Ascending:
    """Distinct indexes in ascending order: a kept ready set.

    New tasks mostly get the highest indexes and consumers mostly take the lowest, so an
    addition is mostly an append and a removal a cut off the front or a bisection and a move of
    pointers in C; many at once (a clear) rebuild the list in one pass.
    """

    __slots__ = ("items",)

    def __init__(self, indexes: list[int]) -> None:
        self.items = indexes  # ascending, distinct

    def add_many(self, indexes: list[int]) -> None:
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
        if isinstance(indexes, list) and items[: len(indexes)] == indexes:
            # The lowest, in order: what a sampler mostly takes (checked before building a set
            # of them, which for a large batch is the biggest object a `get_meta` makes).
            del items[: len(indexes)]
            return
        gone = sorted(set(indexes))
        if items[: len(gone)] == gone:  # the lowest, in another order
            del items[: len(gone)]
        elif len(gone) > _BULK:
            drop = set(gone)
            self.items = [i for i in items if i not in drop]
        else:
            for i in gone:
                at = bisect_left(items, i)
                if at < len(items) and items[at] == i:
                    del items[at]


def at(array: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """`array[rows]` of a 1-D array; a few rows are read one at a time (see the module
    docstring: numpy's fancy indexing releases the GIL, and under the controller's lock a release
    can cost a thread switch; reading an item never releases it)."""
    if len(rows) > FEW_ROWS:
        return array[rows]
    return np.array(list(map(array.item, rows.tolist())), dtype=array.dtype)


def as_rows(indexes: Iterable[int] | np.ndarray) -> np.ndarray:
    """Task indexes as an int64 array (from a list, a range, a set or an array)."""
    if isinstance(indexes, np.ndarray):
        return indexes.astype(np.int64, copy=False).reshape(-1)
    if not isinstance(indexes, (list, tuple, range)):
        indexes = list(indexes)
    return np.asarray(indexes, dtype=np.int64).reshape(-1)


class Column:
    """One field of a partition: its dtype and kind, and per task slot its node, shape,
    generation, share key and whether its value is partial.

    `ragged` (the field's kind) sticks once set: a put of ragged values, or of fixed-shape
    values of another shape than earlier puts', makes every later `get_meta` say ragged, so a
    consumer's column type never depends on which tasks it was given.
    """

    __slots__ = (
        "dtype",
        "node",
        "ranks",
        "dims",
        "layout",
        "generation",
        "shared",
        "partial",
        "ragged",
        "fixed_shape",
    )

    def __init__(self, dtype: str | None, capacity: int) -> None:
        self.dtype = dtype
        # The node (the partition's numbering) holding each task's value; -1: no value.
        self.node = np.full(capacity, -1, dtype=NODE_INDEX)
        # Each task's shape: its rank, and per dimension (as many as the widest rank put so far)
        # an array of that dimension of each task (0 past its rank). One array a dimension, not
        # a table: numpy releases the GIL writing rows of a table (see the module docstring).
        self.ranks = np.zeros(capacity, dtype=np.int8)
        self.dims: list[np.ndarray] = []
        # (rank, trailing dims) every value put so far has; None once two differ (unset: none yet).
        self.layout: tuple[int, tuple[int, ...]] | None | object = _UNSET
        # The generation of the put that stored each task's value (0: not known), so batches
        # handed out by `get_meta` refuse values a later put of the same ids replaced.
        self.generation = np.zeros(capacity, dtype=np.int64)
        # Per task whose value it shares with others on its node, the key naming that value (0:
        # none); None until a put shares one.
        self.shared: np.ndarray | None = None
        # Tasks whose value is partial (`put(..., partial=True)`: a generation still growing):
        # held and located, never produced, so never ready, until a put without `partial`.
        self.partial = np.zeros(capacity, dtype=bool)
        self.ragged = False
        self.fixed_shape: tuple[int, ...] | None = None

    def grow(self, capacity: int) -> None:
        self.node = _grown(self.node, capacity, -1)
        self.ranks = _grown(self.ranks, capacity, 0)
        self.dims = [_grown(d, capacity, 0) for d in self.dims]
        self.generation = _grown(self.generation, capacity, 0)
        if self.shared is not None:
            self.shared = _grown(self.shared, capacity, 0)
        self.partial = _grown(self.partial, capacity, False)

    def learn_kind(self, fm: FieldMeta) -> None:
        """Fold a put's kind for this field into the partition's."""
        if fm.dtype is None or not len(fm.nodes):
            return
        if fm.ragged or (self.fixed_shape is not None and fm.shapes.shape != self.fixed_shape):
            self.ragged = True
        elif self.fixed_shape is None:
            self.fixed_shape = fm.shapes.shape

    def held(self) -> np.ndarray:
        """Mask of the slots that have a value of this field (partial or not)."""
        return self.node >= 0

    def produced(self) -> np.ndarray:
        """Mask of the slots that have a complete value of this field."""
        return (self.node >= 0) & ~self.partial

    def set_shapes(self, rows: np.ndarray, shapes: RowShapes) -> None:
        """Record the shapes of the values at `rows`, and whether every value put so far has one
        rank and one trailing shape (`layout`: then a batch's shapes are built without checks)."""
        given = (len(shapes.shape), shapes.shape[1:]) if shapes.shape is not None else None
        if shapes.lengths is not None:
            given = (1 + len(shapes.tail or ()), tuple(shapes.tail or ()))
        if not len(rows):
            pass
        elif self.layout is _UNSET:
            self.layout = given
        elif self.layout != given:
            self.layout = None
        if isinstance(given, tuple):  # one rank: first dims (or one shape), then the same tail
            rank, tail = given
            self.ranks[rows] = rank
            self._widen(rank)
            columns: list[Any] = [shapes.first_dims(), *tail] if rank else []
        else:
            ranks, table = shapes.general_tables()
            self.ranks[rows] = ranks.astype(np.int8)  # one dtype: a cast in an assignment lets the GIL go
            self._widen(table.shape[1])
            columns = [np.ascontiguousarray(table[:, k]) for k in range(table.shape[1])]
        for k, dim in enumerate(self.dims):
            dim[rows] = columns[k] if k < len(columns) else 0

    def _widen(self, width: int) -> None:
        while len(self.dims) < width:
            self.dims.append(np.zeros(len(self.node), dtype=np.int64))

    def shapes_at(self, rows: np.ndarray) -> RowShapes:
        """The shapes of the values at `rows`."""
        layout = self.layout
        if isinstance(layout, tuple):
            rank, tail = layout
            if rank == 0:
                return RowShapes(len(rows), shape=())
            return RowShapes(len(rows), tail=tail, lengths=self.first_dims(rows)).normalized()
        ranks = self.ranks[rows].astype(np.int64)
        width = int(ranks.max(initial=0))
        table = np.stack([d[rows] for d in self.dims[:width]], axis=1) if width else np.zeros((len(rows), 0))
        return RowShapes(len(rows), ranks=ranks, dims=table.astype(np.int64)).normalized()

    def first_dims(self, rows: np.ndarray) -> np.ndarray:
        """The first dimension of the values at `rows` (0 for a 0-d value)."""
        return at(self.dims[0], rows) if self.dims else np.zeros(len(rows), dtype=np.int64)

    def set_shared(self, rows: np.ndarray, keys: np.ndarray | None) -> None:
        if keys is not None and keys.any():
            if self.shared is None:
                self.shared = np.zeros(len(self.node), dtype=np.int64)
            self.shared[rows] = keys
        elif self.shared is not None:
            self.shared[rows] = 0

    def clear(self, rows: np.ndarray) -> None:
        """Forget the values at `rows`."""
        self.node[rows] = -1
        self.ranks[rows] = 0
        for dim in self.dims:
            dim[rows] = 0
        self.generation[rows] = 0
        if self.shared is not None:
            self.shared[rows] = 0
        self.partial[rows] = False


@dataclass(frozen=True)
class PutPlan:
    """What `Partition.check_put` found for a put: the tasks it adds (their ids, in batch
    order) and the index of each task it names (-1: a new one)."""

    new: list[str]
    rows: np.ndarray


@dataclass(eq=False)  # numpy columns have no one truth value: partitions compare by identity
class Partition:
    """One partition: its tasks, where each field of each task lives, and who consumed what."""

    partition_id: str
    # Task id <-> slot: `index_of[task_id]` is the task's slot, `task_of[slot]` its id.
    index_of: TaskIndex = field(default_factory=TaskIndex)
    nodes: list[str] = field(default_factory=list)
    node_index: dict[str, int] = field(default_factory=dict)
    columns: dict[str, Column] = field(default_factory=dict)
    next_index: int = 0
    # Fields declared with create_partition: a consumer may wait for them before any put.
    expected: set[str] = field(default_factory=set)
    # Per-task JSON objects set with Controller.set_custom_meta (TransferQueue's custom_meta).
    custom_meta: dict[int, dict[str, Any]] = field(default_factory=dict)
    # Indexes whose shards a clear is deleting (count of clears in flight): never handed out.
    clearing: dict[int, int] = field(default_factory=dict)
    # Per slot: the policy version the task was generated with (`put(..., version=)`;
    # NO_VERSION: never stale; a task is as old as its oldest part: a later put keeps the older).
    versions: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    versioned: bool = False  # whether `versions` ever held one
    # Per consumer (task name): a mask of the slots it consumed, and how many are set (a count
    # kept, not counted: a status query must not loop over every slot under the lock).
    consumed: dict[str, np.ndarray] = field(default_factory=dict)
    _consumed_counts: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    # (task name, fields) -> indexes with every one of those fields, not consumed by that task
    # name (tasks being cleared included: `ready` leaves them out); see the module docstring.
    _ready: dict[tuple[str, tuple[str, ...]], _Ascending] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    # ------------------------------------------------------------------ slots and tasks

    @property
    def task_of(self) -> np.ndarray:
        """Per slot, the task's id (None: free); read-only by convention (`add_tasks`, `forget`)."""
        return self.index_of.ids

    @property
    def capacity(self) -> int:
        return len(self.index_of.ids)

    @property
    def task_count(self) -> int:
        return len(self.index_of)

    def reserve(self, needed: int) -> None:
        """Room for slots [0, needed): every per-slot array grows (by half at least)."""
        if needed <= self.capacity:
            return
        capacity = max(needed, min(self.capacity + self.capacity // 2, MAX_SLOTS), 64)
        self.index_of.reserve(capacity)  # first: past MAX_SLOTS it refuses, nothing changed
        self.versions = _grown(self.versions, capacity, NO_VERSION)
        for name, mask in self.consumed.items():
            self.consumed[name] = _grown(mask, capacity, False)
        for column in self.columns.values():
            column.grow(capacity)

    def has_task(self, i: int) -> bool:
        return 0 <= i < self.capacity and self.task_of[i] is not None

    def live(self, indexes: Iterable[int] | np.ndarray) -> np.ndarray:
        """Those of `indexes` that hold a task, in order."""
        rows = as_rows(indexes)
        if len(rows) <= FEW_ROWS:
            return np.asarray([i for i in rows.tolist() if self.has_task(i)], dtype=np.int64)
        rows = rows[(rows >= 0) & (rows < self.capacity)]
        return rows[self.task_of[rows] != None]  # noqa: E711 (elementwise, on an object array)

    def task_ids_at(self, indexes: Iterable[int] | np.ndarray) -> list[str]:
        """The ids of the tasks at those of `indexes` that hold one, in order."""
        return at(self.task_of, self.live(indexes)).tolist()

    def unknown(self, indexes: Sequence[Any]) -> list[Any]:
        """Those of `indexes` (a sampler's answer) that are not the index of a task here."""
        rows = np.asarray(indexes)
        if rows.dtype.kind not in "iu":
            return list(indexes)
        rows = rows.astype(np.int64, copy=False).reshape(-1)
        live = self.live(rows)
        if len(live) == len(rows):
            return []
        known = set(live.tolist())
        return [i for i in rows.tolist() if i not in known]

    def task_ids(self) -> list[str]:
        """Every task's id, by index."""
        return list(self.index_of)

    def rows_of(self, task_ids: Sequence[str]) -> np.ndarray:
        """The index of each of `task_ids` (-1: not in this partition)."""
        return self.index_of.rows_of(task_ids)

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

    def column(self, name: str, dtype: str | None) -> Column:
        """Field `name`'s column, made (with `dtype`) on first use."""
        column = self.columns.get(name)
        if column is None:
            column = self.columns[name] = Column(dtype, self.capacity)
        return column

    def allocate(self, count: int) -> int:
        """First index of a free block of `count` indexes, aligned to `count`.

        Freed indexes are reused, and a put of whole GRPO groups always lands
        on group-aligned indexes (a block of k*n starts at a multiple of n).
        """
        blocks = min(self.next_index, self.capacity) // count
        if self.task_count < self.next_index and blocks:  # there are holes to reuse
            # An index a clear still holds (its task forgotten by `forget_node` meanwhile) is
            # not free yet: that clear settles by index.
            span = slice(0, blocks * count)
            free = self.task_of[span] == None  # noqa: E711 (elementwise, on an object array)
            held = [i for i in self.clearing if i < span.stop]
            free[held] = False
            whole = np.flatnonzero(free.reshape(blocks, count).all(axis=1))
            if len(whole):
                return int(whole[0]) * count
        start = -(-self.next_index // count) * count
        self.next_index = start + count
        return start

    def add_tasks(self, task_ids: Sequence[str]) -> int:
        """Give new `task_ids` one block of indexes, in order; the block's first index."""
        start = self.allocate(len(task_ids))
        self.reserve(start + len(task_ids))
        self.index_of.add(task_ids, np.arange(start, start + len(task_ids), dtype=np.int64))
        return start

    # ------------------------------------------------------------------ puts

    def check_put(self, meta: BatchMeta, group_size: int) -> PutPlan:
        """The tasks a put of `meta` would add, and the slots of those it names that are here;
        raises, changing nothing, if it may not happen:
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
        rows = self.rows_of(meta.task_ids)
        self._check_same_nodes(meta, rows)
        known = rows >= 0
        clearing = self.clearing
        held = [t for t, i in zip(meta.task_ids, rows.tolist()) if i in clearing] if clearing else []
        if held:
            raise ClearInProgressError(
                f"{len(held)} task(s) of partition {self.partition_id!r} are being cleared "
                f"(e.g. {held[0]!r}): put them again once clear_tasks returns"
            )
        new = pick(meta.task_ids, np.flatnonzero(~known))
        if len(new) % group_size:
            raise InvalidArgumentError(
                f"the put adds {len(new)} new task(s) to partition {self.partition_id!r}, not whole "
                f"groups of n_samples_per_prompt={group_size}: put each prompt's {group_size} responses "
                "together (groups are aligned blocks of indexes, so a partial group could never be completed)"
            )
        return PutPlan(new, rows)

    def _check_same_nodes(self, meta: BatchMeta, rows: np.ndarray) -> None:
        """`ShardElsewhereError` if a field this partition has for a task comes from another node."""
        fields = [name for name in meta.fields if name in self.columns]
        known = np.flatnonzero(rows >= 0)
        if not fields or not len(known):  # the usual later-stage put: new fields only
            return
        # The batch's nodes as this partition numbers them (-1: one it has never seen).
        local = np.asarray([self.node_index.get(node, -1) for node in meta.nodes], dtype=np.int64)
        for name in fields:
            held = self.columns[name].node[rows[known]]
            given = local[meta.fields[name].nodes[known].astype(np.intp)]  # int32 indexes let the GIL go
            moved = np.flatnonzero((held >= 0) & (held != given))
            if len(moved):
                i, first = int(known[moved[0]]), int(moved[0])
                there = self.nodes[int(held[first])]
                raise ShardElsewhereError(
                    f"task {meta.task_ids[i]!r} of partition {self.partition_id!r} already has field "
                    f"{name!r} on {there}; this put has it on {meta.nodes[int(meta.fields[name].nodes[i])]}."
                    " A task's field lives on one worker: put it there, or clear_tasks it first"
                )

    def register(self, meta: BatchMeta, plan: PutPlan, partial: AbstractSet[str] = frozenset()) -> np.ndarray:
        """Give the plan's new tasks one block of indexes, in batch order, and record where each
        of `meta`'s fields lives and its shape (`plan`: what `check_put` said, nothing changed
        since); the fields in `partial` are still growing: not produced until a later put that
        does not name them. The index of each task of `meta`, in order."""
        rows = plan.rows
        if plan.new:
            start = self.add_tasks(plan.new)
            rows = rows.copy()
            rows[rows < 0] = np.arange(start, start + len(plan.new), dtype=np.int64)
        local_nodes = np.asarray([self.intern_node(n) for n in meta.nodes], dtype=NODE_INDEX)
        for name, fm in meta.fields.items():
            column = self.column(name, fm.dtype)
            column.learn_kind(fm)
            column.node[rows] = local_nodes[fm.nodes.astype(np.intp)] if len(local_nodes) else -1
            column.set_shapes(rows, fm.shapes)
            column.generation[rows] = 0 if fm.generations is None else fm.generations
            column.set_shared(rows, fm.shared)
            column.partial[rows] = name in partial
        if partial:
            self._drop_ready(rows, partial)
        complete = meta.fields.keys() - partial
        if complete:
            self._add_ready(rows, complete)
        return rows

    def _drop_ready(self, rows: np.ndarray, put_fields: AbstractSet[str]) -> None:
        """Rows whose `put_fields` just became partial: out of every kept ready set asking for them."""
        gone = rows.tolist()
        for (_, names), ready in self._ready.items():
            if not put_fields.isdisjoint(names):
                ready.discard_many(gone)

    def _add_ready(self, rows: np.ndarray, put_fields: AbstractSet[str]) -> None:
        """Rows that just got `put_fields`: into each kept ready set they now belong to."""
        for (task_name, names), ready in self._ready.items():
            if put_fields.isdisjoint(names):
                continue
            have = np.ones(len(rows), dtype=bool)
            for name in names:
                column = self.columns[name]
                have &= (column.node[rows] >= 0) & ~column.partial[rows]
            consumed = self.consumed.get(task_name)
            if consumed is not None:
                have &= ~consumed[rows]
            ready.add_many(rows[have].tolist())

    def set_versions(self, rows: np.ndarray, versions: Sequence[int]) -> None:
        """Record the policy version of the task at each of `rows` (the older of two wins, also
        for a task named twice in one call)."""
        known = self.versions[rows]
        older = np.minimum(
            np.where(known == NO_VERSION, _NEWEST, known), np.asarray(versions, dtype=np.int64)
        )
        self.versions[rows] = _NEWEST
        np.minimum.at(self.versions, rows, older)
        self.versioned = self.versioned or bool(len(rows))

    # ------------------------------------------------------------------ queries

    def inflight(self) -> list[int]:
        """Indexes of the tasks with a partial value (their generation still growing), ascending."""
        mask = np.zeros(self.capacity, dtype=bool)
        for column in self.columns.values():
            mask |= column.partial
        return np.flatnonzero(mask).tolist()

    def fields_of_all(self, indexes: Sequence[int]) -> list[str]:
        """The fields every one of `indexes` has a value of (partial or not)."""
        rows = as_rows(indexes)
        return [name for name, c in self.columns.items() if bool((c.node[rows] >= 0).all())]

    def has_fields(self, i: int, fields: Iterable[str]) -> bool:
        """Whether task `i` has a value of each of `fields` (partial or not)."""
        return self.has_task(i) and all(self.columns[f].node[i] >= 0 for f in fields)

    def split_stale(self, indexes: Sequence[int], oldest: int) -> tuple[list[int], list[int]]:
        """`indexes` as (fresh, stale): stale ones have a policy version below `oldest`."""
        rows = as_rows(indexes)
        versions = at(self.versions, rows)
        stale = (versions != NO_VERSION) & (versions < oldest)
        if not stale.any():
            return list(indexes), []
        return rows[~stale].tolist(), rows[stale].tolist()

    def has_versions(self) -> bool:
        """Whether a task was ever given a policy version (then samplers order by version and
        consumption is counted by age; without, neither has anything to do)."""
        return self.versioned

    def versions_of(self, task_ids: Sequence[str]) -> dict[str, int]:
        """The policy versions of those `task_ids` that have one."""
        rows = self.rows_of(task_ids)
        versions = np.where(rows >= 0, self.versions[np.maximum(rows, 0)], NO_VERSION) if len(rows) else rows
        have = np.flatnonzero(versions != NO_VERSION)
        return dict(zip(pick(task_ids, have), versions[have].tolist()))

    def _ready_mask(self, task_name: str | None, fields: Sequence[str], *, clearing: bool) -> np.ndarray:
        """Slots with every one of `fields` produced, not consumed by `task_name` (when given);
        tasks being cleared too when `clearing`. Time in proportion to the partition's slots:
        to build a kept set, and for status queries."""
        mask = np.ones(self.capacity, dtype=bool)
        if self.clearing and not clearing:
            mask[list(self.clearing)] = False
        for name in set(fields):
            mask &= self.columns[name].produced()
        consumed = self.consumed.get(task_name) if task_name is not None else None
        if consumed is not None:
            mask &= ~consumed
        return mask

    def ready(self, task_name: str, fields: Sequence[str]) -> list[int]:
        """Indexes that have every field produced, are not being cleared and are not consumed by
        `task_name`, ascending."""
        if not fields or any(f not in self.columns for f in fields):
            return []
        key = (task_name, tuple(sorted(set(fields))))
        have = self._ready.pop(key, None)  # re-inserted last: the most recently asked
        if have is None:
            have = _Ascending(np.flatnonzero(self._ready_mask(task_name, fields, clearing=True)).tolist())
            while len(self._ready) >= MAX_READY_SETS:
                del self._ready[next(iter(self._ready))]
        self._ready[key] = have
        if self.clearing:
            clearing = self.clearing
            return [i for i in have.items if i not in clearing]
        return list(have.items)

    def count_ready(self, fields: Sequence[str]) -> int:
        """Tasks that have every one of `fields` (consumed or not, being cleared excluded)."""
        if not fields or any(f not in self.columns for f in fields):
            return 0
        return int(np.count_nonzero(self._ready_mask(None, fields, clearing=False)))

    def consume(self, task_name: str, indexes: Iterable[int]) -> None:
        """Mark `indexes` consumed by `task_name`: never ready for it again (until a reset)."""
        mask = self.consumed.get(task_name)
        if mask is None:
            mask = self.consumed[task_name] = np.zeros(self.capacity, dtype=bool)
        taken = indexes if isinstance(indexes, list) else list(indexes)
        if len(taken) > FEW_ROWS:
            rows = np.unique(np.asarray(taken, dtype=np.int64))
            added = len(rows) - int(np.count_nonzero(mask[rows]))
            mask[rows] = True
        else:
            added = 0
            for i in taken:
                if not mask[i]:
                    mask[i] = True
                    added += 1
        self._consumed_counts[task_name] = self._consumed_counts.get(task_name, 0) + added
        for (name, _), ready in self._ready.items():
            if name == task_name:
                ready.discard_many(taken)

    def consumed_count(self, task_name: str) -> int:
        """How many tasks `task_name` consumed."""
        return self._consumed_counts.get(task_name, 0)

    def reset_consumption(self, task_name: str | None = None) -> None:
        """Forget what `task_name` (or every consumer) consumed."""
        if task_name is None:
            self.consumed.clear()
            self._consumed_counts.clear()
            self._ready.clear()
            return
        self.consumed.pop(task_name, None)
        self._consumed_counts.pop(task_name, None)
        for key in [k for k in self._ready if k[0] == task_name]:
            del self._ready[key]

    def sample_lengths(self, indexes: Sequence[int], field: str) -> list[int]:
        """Per-sample lengths (first dimension of `field`), for length-aware samplers."""
        column = self.columns.get(field)
        if column is None or column.dtype is None:
            raise InvalidArgumentError(
                f"partition {self.partition_id!r} has no tensor field {field!r} for lengths"
            )
        rows = as_rows(indexes)
        inside = (rows >= 0) & (rows < self.capacity)
        missing = np.flatnonzero(~inside | (column.node[np.where(inside, rows, 0)] < 0))
        if len(missing):
            i = int(rows[missing[0]])
            task = self.task_of[i] if self.has_task(i) else i
            raise InvalidArgumentError(f"task {task!r} has no field {field!r} for lengths")
        return np.where(column.ranks[rows] > 0, column.first_dims(rows), 1).tolist()

    def get_custom_meta(self, indexes: Sequence[int]) -> dict[int, dict[str, Any]]:
        """Custom metadata of those `indexes` that have some, by index (TransferQueue's
        ``DataPartitionStatus.get_custom_meta``, which samplers such as
        `SeqlenBalancedSampler` read ``total_lengths`` from)."""
        return {i: self.custom_meta[i] for i in indexes if i in self.custom_meta}

    def meta_for(self, indexes: Sequence[int], fields: Sequence[str]) -> BatchMeta:
        """The batch metadata of `indexes` (tasks that have every one of `fields`), in order."""
        rows = as_rows(indexes)
        held = [at(self.columns[name].node, rows) for name in fields]
        # The nodes the batch names, in the partition's order, numbered from 0.
        if len(self.nodes) == 1:
            used = [0] if len(rows) and held else []
            held = [np.zeros(len(rows), dtype=NODE_INDEX) for _ in held]
        else:
            every = set().union(*(node.tolist() for node in held)) if held else set()
            used = sorted(every)
            local = {n: k for k, n in enumerate(used)}
            if len(rows) > FEW_ROWS:
                lookup = np.zeros(len(self.nodes), dtype=NODE_INDEX)
                lookup[used] = np.arange(len(used), dtype=NODE_INDEX)
                held = [lookup[node.astype(np.intp)] for node in held]
            else:
                held = [np.asarray([local[n] for n in node.tolist()], dtype=NODE_INDEX) for node in held]
        cols: dict[str, FieldMeta] = {}
        for name, node in zip(fields, held):
            column = self.columns[name]
            gens = at(column.generation, rows)
            shared = None if column.shared is None else at(column.shared, rows)
            cols[name] = FieldMeta(
                column.dtype,
                node,
                column.shapes_at(rows),
                column.ragged,
                gens if gens.any() else None,
                shared if shared is not None and shared.any() else None,
            )
        return BatchMeta(at(self.task_of, rows).tolist(), [self.nodes[n] for n in used], cols)

    def keys_by_node(self, indexes: Iterable[int]) -> dict[str, list[ShardKey]]:
        """The shards of the tasks at `indexes`, by the node holding each."""
        rows = np.unique(self.live(indexes))
        out: dict[str, list[ShardKey]] = {}
        for name, column in self.columns.items():
            node = column.node[rows]
            for n in np.unique(node[node >= 0]).tolist():
                ids = self.task_of[rows[node == n]].tolist()
                out.setdefault(self.nodes[n], []).extend(map(ShardKey, ids, repeat(name)))
        return out

    def rows_on(self, node: str) -> list[int]:
        """Indexes of the tasks that have a shard on `node`, in order."""
        n = self.node_index.get(node)
        if n is None:
            return []
        mask = np.zeros(self.capacity, dtype=bool)
        for column in self.columns.values():
            mask |= column.node == n
        return np.flatnonzero(mask).tolist()

    def move_node(self, old: str, new: str) -> int:
        """Say that `old`'s shards are now served by `new` (a durable worker restarted on another
        address); the number of tasks with a shard there."""
        n_old = self.node_index.get(old)
        if n_old is None or old == new:
            return 0
        moved = len(self.rows_on(old))
        n_new = self.node_index.get(new)
        if n_new is None:  # a name change: every reference stays
            del self.node_index[old]
            self.nodes[n_old] = new
            self.node_index[new] = n_old
        else:  # both known: old's references go to new (old's number stays, unused)
            for column in self.columns.values():
                column.node[column.node == n_old] = n_new
        return moved

    # ------------------------------------------------------------------ removal

    def drop_rows(self, node: str, keys: Iterable[ShardKey]) -> None:
        """Forget that `node` holds these shards (they were deleted) while their tasks stay."""
        n = self.node_index.get(node)
        if n is None:
            return
        by_field: dict[str, list[str]] = {}
        for key in keys:
            by_field.setdefault(key.field, []).append(key.task_id)
        dropped: dict[str, list[int]] = {}
        for name, task_ids in by_field.items():
            column = self.columns.get(name)
            if column is None:
                continue
            rows = self.rows_of(task_ids)
            rows = rows[rows >= 0]
            rows = rows[column.node[rows] == n]
            column.clear(rows)
            dropped[name] = rows.tolist()
        for (_, names), ready in self._ready.items():
            gone = [i for name in names for i in dropped.get(name, ())]
            if gone:
                ready.discard_many(gone)

    def mark_clearing(self, indexes: Iterable[int], delta: int) -> None:
        """Count a clear in flight holding `indexes` (+1), or one settled (-1)."""
        for i in indexes:
            count = self.clearing.get(i, 0) + delta
            if count > 0:
                self.clearing[i] = count
            else:
                self.clearing.pop(i, None)

    def forget(self, indexes: Iterable[int]) -> None:
        """Drop the tasks at `indexes`: their ids, values, consumption, versions, metadata."""
        rows = np.unique(self.live(indexes))
        if not len(rows):
            return
        self.index_of.remove(rows)
        self.versions[rows] = NO_VERSION
        if self.custom_meta:
            for i in rows.tolist():
                self.custom_meta.pop(i, None)
        for column in self.columns.values():
            column.clear(rows)
        for name, mask in self.consumed.items():
            self._consumed_counts[name] -= int(np.count_nonzero(mask[rows]))
            mask[rows] = False
        gone = rows.tolist()
        for ready in self._ready.values():
            ready.discard_many(gone)

    def settle_clear(
        self, indexes: list[int], plan: Mapping[str, list[ShardKey]], failed: Iterable[str]
    ) -> list[int]:
        """After a clear's deletes: the tasks whose shards all went (returned, for the caller to
        forget); a kept task keeps only the shards still there, so a deleted one is never handed
        out again."""
        self.mark_clearing(indexes, -1)
        failed = set(failed)
        stuck_ids = [k.task_id for n in failed for k in plan[n]]
        stuck = set(self.rows_of(stuck_ids).tolist())
        forgotten = [i for i in indexes if i not in stuck]
        for node, keys in plan.items():
            if node not in failed:
                self.drop_rows(node, keys)
        return forgotten

    # ------------------------------------------------------------------ status

    def production(self, names: list[str]) -> dict[str, Any]:
        """Tasks, how many have each of `names`, and how many have all of them."""
        produced = {n: self._produced(n) for n in names}
        return {"tasks": self.task_count, "produced": produced, "ready": self.count_ready(names)}

    def _produced(self, name: str) -> int:
        """Tasks with a complete (not partial) value of field `name`."""
        column = self.columns.get(name)
        return 0 if column is None else int(np.count_nonzero(column.produced()))

    def summary(self) -> dict[str, Any]:
        """Tasks, per field how many have it (and its kind), how many have every field, and per
        consumer how many it consumed: what `distbatch status` shows of a controller."""
        fields = {}
        for name in self.known_fields():
            column = self.columns.get(name)
            fields[name] = {
                "produced": self._produced(name),
                "partial": int(np.count_nonzero(column.partial)) if column is not None else 0,
                "dtype": column.dtype if column is not None else None,
                "ragged": column.ragged if column is not None else False,
            }
        versions, counts = np.unique(self.versions[self.versions != NO_VERSION], return_counts=True)
        return {
            "tasks": self.task_count,
            "ready": self.count_ready(self.known_fields()),
            "clearing": len(self.clearing),
            "fields": fields,
            "consumed": {name: self.consumed_count(name) for name in self.consumed},
            "policy_versions": {str(v): n for v, n in zip(versions.tolist(), counts.tolist())},
        }

    # ------------------------------------------------------------------ custom metadata

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
