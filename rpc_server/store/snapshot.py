"""A durable store's snapshot: everything it holds, as put records, so the log's head can go.

The log grows with every change, deleted values and all. A *snapshot* at record `S` is the
store's state after record `S`, as put records that replaying rebuilds exactly: one put per
generation still held, in ascending order, each giving every value of that generation to its
task (so each value keeps the generation its batch handles name). A row several tasks share
(`RawColumn.alias`) is written once: its owner is the sharing task of the oldest generation, and
the others share its value in their own generation's put (never older than the owner's, so it is
there when they are replayed). Once a snapshot is on disk, the log keeps only the records after
`S` (`DurableLog.write_snapshot`).

`capture` runs under the store lock and only reads the index (vectorised, one step per field);
`snapshot_bundles` builds the bundles outside it, from the segments captured, which never change.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from distbatch.wire.bundle import Bundle, RawColumn
from distbatch.wire.shapes import RowShapes, unique_ints
from rpc_server.store.columns import Picked, build_columns
from rpc_server.store.segments import Segment
from rpc_server.store.shards import Shards


@dataclass
class FieldState:
    """Every value of one field: per task holding it, the task id, its segment and row, and the
    generation of the put that gave it (arrays of one length); the segments by id."""

    name: str
    task_ids: np.ndarray
    segs: np.ndarray
    positions: np.ndarray
    generations: np.ndarray
    used: dict[int, Segment]


def capture(shards: Shards) -> list[FieldState]:
    """What the store holds, field by field (caller holds the store lock; copies of the index)."""
    index = shards.index
    held = index.rows.held()
    fields = []
    for name in index.names():
        segs = index.locate(name, held)
        rows = held[segs >= 0]
        if not len(rows):
            continue
        segs = segs[segs >= 0]
        used = {s: shards.segments.segments[s] for s in unique_ints(segs).tolist()}
        fields.append(
            FieldState(
                name,
                index.rows.ids[rows],
                segs,
                index.positions(name, rows),
                index.generations(name, rows),
                used,
            )
        )
    return fields


def snapshot_bundles(fields: list[FieldState], last_generation: int) -> list[tuple[int, Bundle]]:
    """(generation, put) for every generation the fields hold, ascending (see the module), and
    last an empty put of `last_generation`, the newest the store gave: a recovery starts new
    generations above it, not above the newest still held (handles may name deleted ones)."""
    by_generation: dict[int, list[tuple[FieldState, np.ndarray, np.ndarray, np.ndarray]]] = {}
    for field in fields:
        owner = _owners(field)
        own = owner == np.arange(len(owner))
        order = np.argsort(field.generations, kind="stable")
        bounds = np.flatnonzero(np.diff(field.generations[order])) + 1
        for group in np.split(order, bounds):
            generation = int(field.generations[group[0]])
            by_generation.setdefault(generation, []).append(
                (field, group[own[group]], group[~own[group]], owner[group[~own[group]]])
            )
    puts = [(g, _bundle(by_generation[g])) for g in sorted(by_generation)]
    return [*puts, (last_generation, Bundle([], {}))]


def _owners(field: FieldState) -> np.ndarray:
    """Per value, the index of the value that owns its row: of the tasks sharing one row, the
    one of the oldest generation (itself when no other task shares it)."""
    row = field.segs.astype(np.int64) << 32 | field.positions.astype(np.int64)
    order = np.lexsort((field.generations, row))  # by row, oldest generation first
    first = np.ones(len(order), dtype=bool)
    first[1:] = row[order][1:] != row[order][:-1]
    heads = np.maximum.accumulate(np.where(first, np.arange(len(order)), 0))
    owner = np.empty(len(order), dtype=np.int64)
    owner[order] = order[heads]
    return owner


def _bundle(parts: list[tuple[FieldState, np.ndarray, np.ndarray, np.ndarray]]) -> Bundle:
    """One generation's put: each field's owned values as columns (a field of several dtypes as
    layers), and the tasks sharing another's value as the field's alias table."""
    task_ids = list(
        dict.fromkeys(
            t
            for field, own, shared, _ in parts
            for t in field.task_ids[np.concatenate([own, shared])].tolist()
        )
    )
    place = {t: i for i, t in enumerate(task_ids)}
    columns: dict[str, RawColumn] = {}
    for field, own, shared, owners in parts:
        at = np.fromiter((place[t] for t in field.task_ids[own].tolist()), dtype=np.int64, count=len(own))
        if len(own):
            segs, positions = field.segs[own], field.positions[own]
            used = {s: field.used[s] for s in unique_ints(segs).tolist()}
            sizes = _sizes(segs, positions, used)
            for key, column in build_columns([Picked(field.name, segs, positions, used, False)]).items():
                if column.dtype is None:  # as accounted when put (a JSON column's split is even)
                    column.json_sizes = sizes if column.rows is None else sizes[column.rows]
                column.rows = at if column.rows is None else at[column.rows]
                columns[key] = column
        if len(shared):
            column = columns.get(field.name) or _empty_like(field.used[int(field.segs[owners[0]])])
            column.alias = np.fromiter(
                (place[t] for t in field.task_ids[shared].tolist()), dtype=np.int64, count=len(shared)
            )
            column.alias_of = field.task_ids[owners].tolist()
            columns[field.name] = column
    return Bundle(task_ids, columns)


def _sizes(segs: np.ndarray, positions: np.ndarray, used: dict[int, Segment]) -> np.ndarray:
    """The accounted bytes of each value (one step per segment)."""
    sizes = np.empty(len(segs), dtype=np.int64)
    for seg_id, seg in used.items():
        at = np.flatnonzero(segs == seg_id)
        sizes[at] = seg.sizes[positions[at]]
    return sizes


def _empty_like(seg: Segment) -> RawColumn:
    """A column of no rows of `seg`'s kind (to carry an alias table for a field this put gives
    no value of its own)."""
    rows = np.zeros(0, dtype=np.int64)
    if seg.dtype is None:
        return RawColumn(None, values=[], rows=rows)
    return RawColumn(seg.dtype, RowShapes.uniform(0, ()), [], 0, rows=rows)
