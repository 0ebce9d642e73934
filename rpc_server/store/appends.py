"""Appends: a put's column that extends each task's stored value along dim 0 (a partial rollout
growing chunk by chunk) becomes an ordinary column holding the whole values, which the store then
puts as it puts any column, replacing the old values under a new generation.

The client sends only the new rows; the prefix is copied here, on the worker that holds it, in
one vectorised pass per column (two scatters of whole dim-0 rows: no step per task). Everything
is checked before anything changes: the stored values' generations (an append through a stale
handle is refused), their dtype and trailing dims. Nothing here locks: the store calls it with
its lock held.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from distbatch.ids import ShardKey
from distbatch.wire.bundle import LAYER_MARK, Bundle, RawColumn, column_field
from distbatch.wire.container import ITEMSIZE
from distbatch.wire.shapes import RowShapes, exclusive_cumsum, ragged_positions, unique_ints
from rpc_server.errors import AppendMismatchError, MissingShardsError
from rpc_server.store.columns import MAX_MISSING_LISTED, column_of
from rpc_server.store.index import ShardIndex
from rpc_server.store.records import ReplacedValues
from rpc_server.store.segments import SegmentTable


def resolve_appends(
    index: ShardIndex, segments: SegmentTable, bundle: Bundle
) -> tuple[Bundle, frozenset[str]]:
    """`bundle` with each appending column replaced by one holding the whole values, and the keys
    of those columns (their bytes are new memory, not views of the request body).

    `MissingShardsError` for a value the asker expected (a nonzero generation) that is gone,
    `ReplacedShardsError` for one a later put replaced, `AppendMismatchError` for values that
    cannot extend the stored ones; nothing changes in any case.
    """
    appending = [key for key, column in bundle.columns.items() if column.append is not None]
    if not appending:
        return bundle, frozenset()
    rows = index.rows.lookup(bundle.task_ids)
    columns = dict(bundle.columns)
    replaced = ReplacedValues()
    missing: list[ShardKey] = []
    missing_count = 0
    for key in appending:
        column = bundle.columns[key]
        if LAYER_MARK in key:
            raise AppendMismatchError(f"field {key!r}: a column of one dtype among several cannot append")
        expect = column.append if column.append is not None else np.zeros(0, dtype=np.int64)
        task_ids = (
            bundle.task_ids if column.rows is None else [bundle.task_ids[i] for i in column.rows.tolist()]
        )
        col_rows = rows if column.rows is None else rows[column.rows]
        segs = index.locate(key, col_rows)
        replaced.add(task_ids, key, *index.replaced(key, col_rows, segs, expect), expect)
        gone = np.flatnonzero((segs < 0) & (expect != 0))
        if len(gone):
            missing_count += len(gone)
            room = max(MAX_MISSING_LISTED - len(missing), 0)
            missing += [ShardKey(task_ids[i], key) for i in gone[:room].tolist()]
            continue
        columns[key] = _extended(key, column, index, segments, col_rows, segs)
    replaced.raise_if_any("appended to")
    if missing:
        raise MissingShardsError(missing, missing_count)
    return Bundle(bundle.task_ids, columns), frozenset(appending)


def _extended(
    name: str,
    column: RawColumn,
    index: ShardIndex,
    segments: SegmentTable,
    rows: np.ndarray,
    segs: np.ndarray,
) -> RawColumn:
    """The column of whole values: each held value followed by the column's row (a task that
    holds none gets the row alone)."""
    dtype = column.tensor_dtype
    new_shapes = column.tensor_shapes
    tail = new_shapes.packable()
    if tail is None:
        raise AppendMismatchError(
            f"field {name!r}: appended values need at least one dimension and the same trailing dims"
        )
    held = np.flatnonzero(segs >= 0)
    old_lengths = np.zeros(len(rows), dtype=np.int64)
    old_bytes = np.zeros(0, dtype=np.uint8)
    if len(held):
        used = {s: segments.segments[s] for s in unique_ints(segs[held]).tolist()}
        dtypes = {seg.dtype for seg in used.values()}
        if dtypes != {dtype}:
            shown = ", ".join(sorted(d or "JSON" for d in dtypes))
            raise AppendMismatchError(f"field {name!r} holds {shown}; the append gives {dtype}")
        stored = column_of(segs[held], index.positions(name, rows[held]), used)
        if stored.tensor_shapes.packable() != tail:
            raise AppendMismatchError(
                f"field {name!r}: the stored values' trailing dims are not the appended ones' {list(tail)}"
            )
        old_lengths[held] = stored.tensor_shapes.first_dims()
        old_bytes = np.frombuffer(stored.single_buffer(), dtype=np.uint8)
    new_lengths = new_shapes.first_dims()
    lengths = old_lengths + new_lengths
    unit = math.prod(tail) * ITEMSIZE[dtype]  # bytes of one dim-0 row
    out = np.empty(int(lengths.sum()) * unit, dtype=np.uint8)
    if unit:
        as_rows = np.dtype((np.void, unit))
        starts = exclusive_cumsum(lengths)
        target = out.view(as_rows)
        target[ragged_positions(starts, old_lengths)] = old_bytes.view(as_rows)
        new_bytes = np.frombuffer(column.single_buffer(), dtype=np.uint8)
        target[ragged_positions(starts + old_lengths, new_lengths)] = new_bytes.view(as_rows)
    shapes = RowShapes.ragged(lengths, tail)
    return RawColumn(dtype, shapes, [out.data], out.nbytes, rows=column.rows)


def check_stage(bundles: Sequence[Bundle]) -> None:
    """A staged put's parts may not name one task's field twice where a part appends to it or
    makes it share a value: the parts are resolved against the store as it was, so the second
    would silently undo the first. `AppendMismatchError`; nothing changes."""
    if len(bundles) < 2 or not any(
        c.append is not None or c.alias is not None for b in bundles for c in b.columns.values()
    ):
        return
    seen: set[tuple[str, str]] = set()
    for bundle in bundles:
        for key, column in bundle.columns.items():
            rows = range(len(bundle.task_ids)) if column.rows is None else column.rows.tolist()
            named = [bundle.task_ids[i] for i in rows]
            if column.alias is not None:
                named += [bundle.task_ids[i] for i in column.alias.tolist()]
            keys = {(t, column_field(key)) for t in named}
            again = seen & keys
            if again:
                task, name = min(again)
                raise AppendMismatchError(
                    f"two parts of one staged put name {task}/{name}, which one of them appends to or shares"
                )
            seen |= keys
