"""Building a fetch's response columns from segments: byte runs gathered or sent as views,
shapes in request order, and the run tables of shared-memory answers."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import NamedTuple

import numpy as np

from distbatch.shm import SharedRegion
from distbatch.wire.bundle import RawColumn
from distbatch.wire.container import parts_size
from distbatch.wire.shapes import RowShapes
from rpc_server.errors import SharedMemoryUnavailable
from rpc_server.store.segments import Segment

# A fetch whose rows form more runs than this, averaging under `GATHER_RUN_BYTES`, copies
# them into one buffer instead of sending each run as its own part.
MAX_SEND_RUNS = 64

GATHER_RUN_BYTES = 64 << 10


def gather_bytes(data: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The byte ranges (`starts`, `sizes`) of `data`, one after another, in a new array."""
    out = np.empty(int(sizes.sum()), dtype=np.uint8)
    for start, stop, at in byte_runs(starts, sizes):
        out[at : at + stop - start] = data[start:stop]
    return out


def byte_runs(starts: np.ndarray, sizes: np.ndarray) -> Iterable[tuple[int, int, int]]:
    """Maximal runs of adjacent byte ranges: (start, stop, offset in the output) each."""
    if not len(starts):
        return []
    run_starts, run_stops, first = run_bounds(starts, sizes)
    offsets = np.concatenate([[0], np.cumsum(sizes)])[first]
    return zip(run_starts.tolist(), run_stops.tolist(), offsets.tolist())


def run_bounds(starts: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs of adjacent byte ranges (at least one range): their starts, their stops, and
    the index of each run's first range."""
    ends = starts + sizes
    breaks = np.flatnonzero(starts[1:] != ends[:-1]) + 1
    first = np.concatenate([[0], breaks])
    last = np.concatenate([breaks, [len(starts)]]) - 1
    return starts[first], ends[last], first


class Picked(NamedTuple):
    """One field of a fetch: per asked task, its segment and position; the segments by id."""

    name: str
    segs: np.ndarray
    positions: np.ndarray
    used: dict[int, Segment]
    shared: bool


class RegionSlots:
    """The shared regions one same-host reply refers to, each numbered once."""

    def __init__(self) -> None:
        self.regions: list[SharedRegion] = []
        self._slot: dict[int, int] = {}

    def slot(self, region: SharedRegion) -> int:
        slot = self._slot.get(id(region))
        if slot is None:
            slot = self._slot[id(region)] = len(self.regions)
            self.regions.append(region)
        return slot


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
        shapes = shapes_in_order(segs, positions, used)
        # Rows in request order, as runs of rows from one segment.
        change = np.flatnonzero(np.diff(segs)) + 1
        chunks = [(used[int(segs[c[0]])], positions[c]) for c in np.split(np.arange(len(segs)), change)]
    if share is not None:
        runs = np.concatenate([run_table(seg, rows, share) for seg, rows in chunks])
        return RawColumn(first.dtype, shapes, (), int(runs[:, 2].sum()), runs=runs)
    parts = [part for seg, rows in chunks for part in segment_parts(seg, rows)]
    if len(chunks) > 1 and len(parts) > MAX_SEND_RUNS:
        parts = [np.concatenate([np.frombuffer(p, dtype=np.uint8) for p in parts]).data]
    return RawColumn(first.dtype, shapes, parts, parts_size(parts))


def by_segment(
    segs: np.ndarray, positions: np.ndarray, used: dict[int, Segment]
) -> Iterator[tuple[Segment, np.ndarray]]:
    """Each segment with the positions of its rows (grouped: one step per segment, not per row)."""
    if len(used) == 1:
        yield next(iter(used.values())), positions
        return
    order = np.argsort(segs, kind="stable")
    for group in np.split(order, np.flatnonzero(np.diff(segs[order])) + 1):
        yield used[int(segs[group[0]])], positions[group]


def shapes_in_order(segs: np.ndarray, positions: np.ndarray, used: dict[int, Segment]) -> RowShapes:
    """The rows' shapes in request order, from several segments: grouped by segment (stable),
    each group's shapes taken at once, then put back in request order."""
    order = np.argsort(segs, kind="stable")
    groups = []
    bounds = np.flatnonzero(np.diff(segs[order])) + 1
    for chunk in np.split(order, bounds):
        seg = used[int(segs[chunk[0]])]
        groups.append(seg.shapes.take(positions[chunk]))  # type: ignore[union-attr]
    return RowShapes.concat(groups).take(np.argsort(order, kind="stable"))


def run_table(seg: Segment, positions: np.ndarray, share: RegionSlots) -> np.ndarray:
    """The bytes of `positions` of `seg` as maximal runs in its region: an (n, 3) int64 table of
    (region slot, offset, length), in order, empty runs left out."""
    sizes = seg.sizes[positions]
    if not int(sizes.sum()):
        return np.zeros((0, 3), dtype=np.int64)  # no bytes: no region to name
    region = seg.buffer.region
    if region is None or seg.region_offset is None:  # `fetch_shared` moves every segment first
        raise SharedMemoryUnavailable(f"segment {seg.id} of field {seg.field!r} is not in a shared region")
    run_starts, run_stops, _ = run_bounds(seg.starts[positions] + seg.region_offset, sizes)
    table = np.empty((len(run_starts), 3), dtype=np.int64)
    table[:, 0] = share.slot(region)
    table[:, 1] = run_starts
    table[:, 2] = run_stops - run_starts
    return table[table[:, 2] > 0]


def segment_parts(seg: Segment, positions: np.ndarray) -> list[memoryview]:
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
