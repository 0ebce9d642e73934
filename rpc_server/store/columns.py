"""What a fetch answers: picking each field's rows (under the store lock), then building the
response columns from the segments (outside it: segments never change once built).

A run of consecutive rows is served as one slice of its segment, scattered rows are gathered in
one pass; for a same-host reader, tensor columns come as run tables into shared regions instead
of bytes (a spilled segment's rows copied into a region of their own). Separate from the store's
bookkeeping: this reads segments, it never changes them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

from distbatch.ids import ShardKey
from distbatch.transport.shm import SharedRegion
from distbatch.wire.bundle import LAYER_MARK, RawColumn
from distbatch.wire.container import parts_size
from distbatch.wire.shapes import RowShapes, unique_ints
from rpc_server.errors import MissingShardsError, SharedMemoryUnavailable
from rpc_server.store.index import ShardIndex
from rpc_server.store.records import ReplacedValues
from rpc_server.store.regions import RegionSlots, run_table
from rpc_server.store.segments import Buffer, Segment, SegmentTable, byte_runs, gather_bytes

# A 404 lists at most this many missing keys (and says how many there are).
MAX_MISSING_LISTED = 10_000
# A fetch whose rows form more runs than this, averaging under `GATHER_RUN_BYTES`, copies
# them into one buffer instead of sending each run as its own part.
MAX_SEND_RUNS = 64
GATHER_RUN_BYTES = 64 << 10


class Picked(NamedTuple):
    """One field of a fetch: per asked task, its segment and position; the segments by id."""

    name: str
    segs: np.ndarray
    positions: np.ndarray
    used: dict[int, Segment]
    shared: bool


def pick(
    index: ShardIndex,
    segments: SegmentTable,
    task_ids: Sequence[str],
    rows: np.ndarray,
    fields: Sequence[str],
    share_from: int | None = None,
    pending: dict[int, Buffer] | None = None,
    generations: np.ndarray | None = None,
) -> list[Picked]:
    """Per field: the segment and position of each task's value (at `rows`; store lock held).

    `MissingShardsError` lists every absent key; with `generations` (per task, the put its
    values came from; 0: any), `ReplacedShardsError` lists values a later put replaced. With
    `share_from`, the tensor fields of that many bytes or more are marked shared; buffers
    holding their bytes outside a shared region go into `pending`.
    """
    picked: list[Picked] = []
    missing: list[ShardKey] = []
    missing_count = 0
    replaced = ReplacedValues()
    for name in fields:
        segs = index.locate(name, rows)
        if generations is not None:
            replaced.add(task_ids, name, *index.replaced(name, rows, segs, generations), generations)
        absent = np.flatnonzero(segs < 0)
        if len(absent):
            missing_count += len(absent)
            room = MAX_MISSING_LISTED - len(missing)
            missing += [ShardKey(task_ids[i], name) for i in absent[: max(room, 0)].tolist()]
            continue
        positions = index.positions(name, rows)
        used = {s: segments.segments[s] for s in unique_ints(segs).tolist()}
        shared = share_from is not None and _shares(segs, positions, used, share_from, pending)
        picked.append(Picked(name, segs, positions, used, shared))
    replaced.raise_if_any("read")
    if missing:
        raise MissingShardsError(missing, missing_count)
    return picked


def _shares(
    segs: np.ndarray,
    positions: np.ndarray,
    used: dict[int, Segment],
    share_from: int,
    pending: dict[int, Buffer] | None,
) -> bool:
    """Whether a field's rows go by reference: tensors of `share_from` bytes or more. If so,
    the buffers of segments not in a shared region yet go into `pending` (lock held)."""
    if any(seg.dtype is None for seg in used.values()):
        return False
    nbytes = sum(int(seg.sizes[rows].sum()) for seg, rows in _by_segment(segs, positions, used))
    if nbytes < share_from:
        return False
    if pending is not None:
        for seg in used.values():
            if seg.outside_region and not seg.buffer.on_disk:  # spilled rows go by a copy of their own
                pending[id(seg.buffer)] = seg.buffer
    return True


def build_columns(picked: list[Picked], slots: RegionSlots | None = None) -> dict[str, RawColumn]:
    """The picked rows as columns (outside the lock: segments never change once built); the
    shared fields as runs in `slots`' regions when given."""
    columns: dict[str, RawColumn] = {}
    for name, segs, positions, used, shared in picked:
        share = slots if shared else None
        kinds: dict[str | None, list[int]] = {}
        for seg_id, seg in used.items():
            kinds.setdefault(seg.dtype, []).append(seg_id)
        if len(kinds) == 1:
            columns[name] = column_of(segs, positions, used, share)
            continue
        # The field holds different dtypes for these tasks: one column per dtype (`field#k`).
        for layer, seg_ids in enumerate(kinds.values()):
            rows_k = np.flatnonzero(np.isin(segs, seg_ids))
            column = column_of(segs[rows_k], positions[rows_k], {i: used[i] for i in seg_ids}, share)
            column.rows = rows_k
            columns[f"{name}{LAYER_MARK}{layer}" if layer else name] = column
    return columns


def column_of(
    segs: np.ndarray, positions: np.ndarray, used: dict[int, Segment], share: RegionSlots | None = None
) -> RawColumn:
    """One field's rows (in request order) from the segments holding them; with `share`, as runs
    in shared regions (every segment is in one) instead of bytes."""
    first = next(iter(used.values()))
    if first.dtype is None:
        if len(used) == 1:
            values = list(map((first.values or []).__getitem__, positions.tolist()))
        else:
            values = [used[s].values[p] for s, p in zip(segs.tolist(), positions.tolist())]  # type: ignore[index]
        return RawColumn(None, values=values)
    if len(used) == 1:
        shapes = first.shapes.take(positions)  # type: ignore[union-attr]
        chunks = [(first, positions)]
    else:
        shapes = _shapes_in_order(segs, positions, used)
        # Rows in request order, as runs of rows from one segment.
        change = np.flatnonzero(np.diff(segs)) + 1
        chunks = [(used[int(segs[c[0]])], positions[c]) for c in np.split(np.arange(len(segs)), change)]
    if share is not None:
        runs = np.concatenate([_shared_runs(seg, rows, share) for seg, rows in chunks])
        return RawColumn(first.dtype, shapes, (), int(runs[:, 2].sum()), runs=runs)
    parts = [part for seg, rows in chunks for part in _parts(seg, rows)]
    if len(chunks) > 1 and len(parts) > MAX_SEND_RUNS:
        parts = [np.concatenate([np.frombuffer(p, dtype=np.uint8) for p in parts]).data]
    return RawColumn(first.dtype, shapes, parts, parts_size(parts))


def _shared_runs(seg: Segment, positions: np.ndarray, share: RegionSlots) -> np.ndarray:
    """`run_table` of `positions` of `seg`; a spilled segment's rows are first copied from its
    record file into a region of their own, for this reply only (the segment stays on disk)."""
    if not seg.buffer.on_disk:
        return run_table(seg, positions, share)
    parts = _parts(seg, positions)
    size = parts_size(parts)
    if not size:
        return np.zeros((0, 3), dtype=np.int64)
    try:
        region = SharedRegion.from_parts(parts)
    except OSError as exc:
        raise SharedMemoryUnavailable(f"the kernel refused a shared region: {exc}") from None
    return np.array([[share.slot(region), 0, size]], dtype=np.int64)


def _by_segment(
    segs: np.ndarray, positions: np.ndarray, used: dict[int, Segment]
) -> Iterator[tuple[Segment, np.ndarray]]:
    """Each segment with the positions of its rows (grouped: one step per segment, not per row)."""
    if len(used) == 1:
        yield next(iter(used.values())), positions
        return
    order = np.argsort(segs, kind="stable")
    for group in np.split(order, np.flatnonzero(np.diff(segs[order])) + 1):
        yield used[int(segs[group[0]])], positions[group]


def _shapes_in_order(segs: np.ndarray, positions: np.ndarray, used: dict[int, Segment]) -> RowShapes:
    """The rows' shapes in request order, from several segments: grouped by segment (stable),
    each group's shapes taken at once, then put back in request order."""
    order = np.argsort(segs, kind="stable")
    groups = []
    bounds = np.flatnonzero(np.diff(segs[order])) + 1
    for chunk in np.split(order, bounds):
        seg = used[int(segs[chunk[0]])]
        groups.append(seg.shapes.take(positions[chunk]))  # type: ignore[union-attr]
    return RowShapes.concat(groups).take(np.argsort(order, kind="stable"))


def _parts(seg: Segment, positions: np.ndarray) -> list[memoryview]:
    """The bytes of `positions` of `seg`, in order: views for a few runs, one gathered copy for many."""
    starts, sizes = seg.starts[positions], seg.sizes[positions]
    runs = list(byte_runs(starts, sizes))
    total = int(sizes.sum())
    if len(runs) <= MAX_SEND_RUNS or total >= len(runs) * GATHER_RUN_BYTES:
        view = seg.bytes_array.data
        return [view[start:stop] for start, stop, _ in runs if stop > start]
    shapes = seg.shapes
    if shapes is not None and shapes.shape is not None and len(seg.sizes) and int(seg.sizes[0]):
        width = int(seg.sizes[0])  # equal rows: one C-level take
        rows = seg.bytes_array[: len(seg.sizes) * width].reshape(-1, width)
        return [np.take(rows, positions, axis=0).reshape(-1).data]
    return [gather_bytes(seg.bytes_array, starts, sizes).data]
