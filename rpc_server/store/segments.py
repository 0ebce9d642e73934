"""The store's bytes: buffers, the immutable segments pointing into them, and their accounting.

A put's fields each become one *segment*: the rows' bytes in one buffer (the request body
itself, not a copy), with numpy arrays of byte offsets, sizes and shapes. Segments of one put
share its body buffer. A segment goes when its last row is deleted, and the buffer when its last
segment goes (the memory returns to the OS: bodies are anonymous mappings). A buffer whose live
rows fall under half of it is compacted: its live rows are copied into buffers of their own.
A buffer moved into a shared region (for same-host readers) is rehomed the same way.

Separate from the index (which row of which segment holds a shard) so that memory, its reuse
and its release are decided in one place. Nothing here locks: the store calls it with its lock
held, except the byte-run helpers, which only read immutable segments.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from distbatch.transport.shm import SharedRegion
from distbatch.wire.bundle import RawColumn
from distbatch.wire.shapes import RowShapes, unique_ints
from rpc_server.store.index import ShardIndex

# A buffer this large or larger is compacted once under half of it is live.
COMPACT_MIN_BYTES = 1 << 20


class Buffer:
    """One put's body (or a compacted segment's own copy): the memory segments point into.

    `region` is set when that memory is a shared region (a same-host put, or a buffer moved
    into shared memory for a same-host reader): its segments can be handed out by reference.
    On a durable worker, `record` names the file holding the same bytes (the log record's
    sequence number, on disk once the log is that far; and its path) and `keys` each segment's
    column key in it, so the buffer can be *spilled*: its tensor segments repointed at the file
    (`on_disk`), its memory let go.
    """

    __slots__ = ("size", "live_bytes", "members", "region", "record", "keys", "last_used", "on_disk")

    def __init__(self, size: int, region: SharedRegion | None = None) -> None:
        self.size = size
        self.live_bytes = 0
        self.members: set[int] = set()  # ids of the segments in it
        self.region = region
        self.record: tuple[int, Path] | None = None
        self.keys: dict[int, str] = {}
        self.last_used = 0  # `SegmentTable.tick` of the last put or fetch using it
        self.on_disk = False


class Segment:
    """One field's rows from one put; never mutated once built (compaction makes a new one)."""

    __slots__ = (
        "id",
        "field",
        "dtype",
        "data",
        "starts",
        "sizes",
        "shapes",
        "values",
        "task_rows",
        "buffer",
        "live",
        "refs",
        "region_offset",
    )

    def __init__(
        self,
        seg_id: int,
        field: str,
        column: RawColumn,
        task_rows: np.ndarray,
        buffer: Buffer,
        data: np.ndarray | None = None,
    ) -> None:
        self.id = seg_id
        self.field = field
        self.dtype = column.dtype
        self.sizes = column.row_nbytes()
        self.starts = np.zeros(len(self.sizes), dtype=np.int64)
        if len(self.sizes) > 1:
            np.cumsum(self.sizes[:-1], out=self.starts[1:])
        self.shapes = column.shapes
        self.values = column.values
        if data is None and column.dtype is not None:
            data = np.frombuffer(column.single_buffer(), dtype=np.uint8)
        self.data = data
        self.task_rows = task_rows
        self.buffer = buffer
        self.live = len(task_rows)  # rows still the value of some task's field
        # Per row, how many tasks' fields it is the value of, once another task shares a row
        # (an alias); None while every row is its own task's only (the usual case).
        self.refs: np.ndarray | None = None
        # Where `data` starts in the buffer's shared region (None: not in one).
        region = buffer.region
        self.region_offset = region.offset_of(data) if region is not None and data is not None else None

    @property
    def bytes_array(self) -> np.ndarray:
        """A tensor segment's bytes (a JSON segment has none: `values` holds its rows)."""
        if self.data is None:
            raise TypeError("a JSON segment has no bytes")
        return self.data

    @property
    def tensor_shapes(self) -> RowShapes:
        """A tensor segment's rows' shapes."""
        if self.shapes is None:
            raise TypeError("a JSON segment has no shapes")
        return self.shapes

    @property
    def has_bytes(self) -> bool:
        """A tensor value with bytes (what memory, a region or a spill file holds)."""
        return self.dtype is not None and self.data is not None and bool(self.data.nbytes)

    @property
    def outside_region(self) -> bool:
        """Tensor bytes not in a shared region yet (a same-host reader moves them into one)."""
        return self.has_bytes and self.region_offset is None

    def rehomed(self, data: np.ndarray, buffer: Buffer, region_offset: int | None) -> Segment:
        """The same rows with their bytes at `data` (a copy of `self.data` in `buffer`'s region,
        or in a record file)."""
        fresh = Segment.__new__(Segment)
        for name in Segment.__slots__:
            setattr(fresh, name, getattr(self, name))
        fresh.data, fresh.buffer, fresh.region_offset = data, buffer, region_offset
        return fresh

    def compacted(self, keep: np.ndarray) -> Segment:
        """The same segment (same id) holding only rows `keep`, copied into a buffer of its own."""
        sizes = self.sizes[keep]
        own = Buffer(int(sizes.sum()))
        if self.dtype is not None:
            data = gather_bytes(self.bytes_array, self.starts[keep], sizes)
            column = RawColumn(self.dtype, self.tensor_shapes.take(keep), [data.data], len(data))
        else:
            values = self.values or []
            column = RawColumn(None, values=[values[i] for i in keep.tolist()])
            data = None
        fresh = Segment(self.id, self.field, column, self.task_rows[keep], own, data)
        fresh.refs = None if self.refs is None else self.refs[keep]
        fresh.sizes = sizes  # keep the accounting exact (JSON sizes are an even split)
        fresh.starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if len(keep) else sizes
        own.live_bytes = own.size
        own.members.add(self.id)
        return fresh


class SegmentTable:
    """Every segment by id, every buffer held, and the live counts: what the store holds.

    Knows the index only to ask which of a segment's rows are live, and to repoint rows that
    compaction moved.
    """

    def __init__(self, index: ShardIndex) -> None:
        self._index = index
        self.segments: dict[int, Segment] = {}
        self._ids = itertools.count()
        self._buffers: dict[int, Buffer] = {}  # id(buffer) -> buffer, for held bytes
        self.shards = 0  # live rows
        self.nbytes = 0  # their bytes: what capacity counts
        self.shared_bytes = 0
        self.shared_regions = 0
        self.disk_bytes = 0  # live bytes of spilled segments (counted in `nbytes` too)
        self.disk_buffers = 0  # spilled buffers held (each maps its record file)
        self.spilled_bytes = 0  # every byte ever spilled
        self._tick = 0

    def tick(self) -> int:
        """A new use time (buffers used longest ago are spilled first)."""
        self._tick += 1
        return self._tick

    def __len__(self) -> int:
        return len(self.segments)

    def held_bytes(self) -> int:
        """What the buffers hold in memory, dead rows included (what the process holds for them;
        a spilled buffer's file is held by the disk)."""
        return sum(b.size for b in self._buffers.values() if not b.on_disk)

    def holds(self, buffer: Buffer) -> bool:
        return id(buffer) in self._buffers

    def add(self, name: str, column: RawColumn, task_rows: np.ndarray, buffer: Buffer) -> Segment:
        """A new segment of `buffer` holding `column` for the tasks at `task_rows` (all live)."""
        seg = Segment(next(self._ids), name, column, task_rows, buffer)
        buffer.live_bytes += int(seg.sizes.sum())
        buffer.members.add(seg.id)
        self.segments[seg.id] = seg
        return seg

    def share(self, segs: np.ndarray, positions: np.ndarray) -> None:
        """The rows at (`segs`, `positions`) are now also the value of one more task each."""
        for seg_id in unique_ints(segs).tolist():
            seg = self.segments[seg_id]
            if seg.refs is None:  # rows deleted before are dead: 0, the others their task's: 1
                seg.refs = self._live(seg).astype(np.int32)
            np.add.at(seg.refs, positions[segs == seg_id], 1)
        self.shards += len(segs)

    def keep_buffer(self, buffer: Buffer) -> None:
        self._buffers[id(buffer)] = buffer
        self.disk_buffers += buffer.on_disk
        if buffer.region is not None:
            self.shared_bytes += buffer.region.size
            self.shared_regions += 1

    def forget_buffer(self, buffer: Buffer) -> None:
        """Stop holding `buffer`; a shared region's descriptor closes once no request holds it."""
        if self._buffers.pop(id(buffer), None) is None:
            return
        self.disk_buffers -= buffer.on_disk
        if buffer.region is not None:
            self.shared_bytes -= buffer.region.size
            self.shared_regions -= 1

    def freed_by(self, segs: np.ndarray, positions: np.ndarray) -> tuple[int, int]:
        """The bytes dropping the values at (`segs`, `positions`) would free, and how many of
        them are spilled (on disk): a row shared by several tasks only when all of them are
        among those (one step per segment)."""
        total = on_disk = 0
        for seg_id in unique_ints(segs).tolist():
            seg = self.segments[seg_id]
            rows = positions[segs == seg_id]
            if seg.refs is not None:
                rows, counts = np.unique(rows, return_counts=True)
                rows = rows[counts >= seg.refs[rows]]
            nbytes = int(seg.sizes[rows].sum())
            total += nbytes
            on_disk += nbytes if seg.buffer.on_disk else 0
        return total, on_disk

    def account_dead(self, segs: np.ndarray, positions: np.ndarray) -> tuple[int, int]:
        """Rows at (`segs`, `positions`) just died: update counts, free segments, then compact
        buffers left mostly dead (after all the accounting: compaction replaces segments).
        Returns (rows, bytes) freed."""
        count = freed = 0
        sparse: dict[int, Buffer] = {}
        for seg_id in unique_ints(segs).tolist():
            seg = self.segments[seg_id]
            dead = positions[segs == seg_id] if len(segs) > 1 else positions
            count += len(dead)  # values: a shared row is one per task sharing it
            if seg.refs is not None:  # a row dies with the last task whose value it is
                np.subtract.at(seg.refs, dead, 1)
                dead = unique_ints(dead)
                dead = dead[seg.refs[dead] == 0]
            nbytes = int(seg.sizes[dead].sum())
            freed += nbytes
            seg.buffer.live_bytes -= nbytes
            if seg.buffer.on_disk:
                self.disk_bytes -= nbytes
            seg.live -= len(dead)
            if seg.live == 0:
                self._drop(seg)
            elif seg.buffer.size >= COMPACT_MIN_BYTES and 2 * seg.buffer.live_bytes < seg.buffer.size:
                sparse[id(seg.buffer)] = seg.buffer
        self.shards -= count
        self.nbytes -= freed
        for key, buffer in sparse.items():
            if key in self._buffers and buffer.members and 2 * buffer.live_bytes < buffer.size:
                self._compact(buffer)
        return count, freed

    def _drop(self, seg: Segment) -> None:
        del self.segments[seg.id]
        buffer = seg.buffer
        buffer.members.discard(seg.id)
        if not buffer.members:
            self.forget_buffer(buffer)

    def _live(self, seg: Segment) -> np.ndarray:
        """Which of the segment's rows are still the value of some task's field."""
        if seg.refs is not None:
            return seg.refs > 0
        return self._index.live_in(seg.field, seg.task_rows, seg.id)

    def _compact(self, buffer: Buffer) -> None:
        """Copy the live rows of every segment in `buffer` into buffers of their own."""
        for seg in [self.segments[s] for s in sorted(buffer.members)]:
            keep = np.flatnonzero(self._live(seg))
            fresh = seg.compacted(keep)
            if seg.refs is None:
                self._index.repoint(seg.field, fresh.task_rows)
            else:  # every task pointing here, sharing or not, follows its row
                moved = np.full(len(seg.sizes), -1, dtype=np.int64)
                moved[keep] = np.arange(len(keep))
                self._index.repoint_segment(seg.field, seg.id, moved)
            self.keep_buffer(fresh.buffer)
            self.segments[seg.id] = fresh
            buffer.live_bytes -= fresh.buffer.size
            if buffer.on_disk:  # its live rows are read back into memory; the file goes
                self.disk_bytes -= fresh.buffer.size
        self.forget_buffer(buffer)

    def unshared(self, buffer: Buffer) -> list[Segment]:
        """The tensor segments of `buffer` holding bytes outside any shared region."""
        members = [self.segments[s] for s in sorted(buffer.members)]
        return [seg for seg in members if seg.outside_region]

    def unchanged(self, buffer: Buffer, moving: Iterable[Segment]) -> bool:
        """Whether `buffer` is still held and `moving` are still its segments' current versions."""
        return self.holds(buffer) and all(self.segments.get(s.id) is s for s in moving)

    def rehome(self, buffer: Buffer, moving: list[Segment], offsets: list[int], region: SharedRegion) -> None:
        """Point `moving` (segments of `buffer`) at their copies in `region`, at `offsets`."""
        own = Buffer(region.size, region)
        own.record, own.last_used = buffer.record, buffer.last_used
        for seg, offset in zip(moving, offsets):
            if seg.id in buffer.keys:
                own.keys[seg.id] = buffer.keys[seg.id]
            size = seg.data.nbytes  # type: ignore[union-attr]
            live = int(seg.sizes[self._live(seg)].sum())
            self.segments[seg.id] = seg.rehomed(region.array[offset : offset + size], own, offset)
            own.members.add(seg.id)
            own.live_bytes += live
            buffer.members.discard(seg.id)
            buffer.live_bytes -= live
        self._moved_out(buffer, own)

    def _moved_out(self, buffer: Buffer, own: Buffer) -> None:
        """Segments of `buffer` moved to `own`: hold `own`, let `buffer` go as far as it can."""
        self.keep_buffer(own)
        if not buffer.members:
            self.forget_buffer(buffer)
        elif not any(self.segments[s].dtype is not None for s in buffer.members):
            # Only JSON values are left, which hold no body bytes (nor any of a shared region).
            if buffer.region is not None:
                self.shared_bytes -= buffer.region.size
                self.shared_regions -= 1
                buffer.region = None
            buffer.size = buffer.live_bytes

    def spill_candidates(self, durable_seq: int) -> list[Buffer]:
        """Buffers that can be spilled now (their record, if any, is on disk), used longest ago
        first."""
        found = [
            b
            for b in self._buffers.values()
            if not b.on_disk
            and (b.record is None or b.record[0] <= durable_seq)
            and any(self.segments[s].has_bytes for s in b.members)
        ]
        found.sort(key=lambda b: b.last_used)
        return found

    def spill(self, buffer: Buffer, homes: dict[int, np.ndarray]) -> int:
        """Point `buffer`'s tensor segments at `homes` (by segment id: the same bytes in a mapped
        file), so its memory goes; JSON values stay. The live bytes spilled (0: `homes` does not
        cover every tensor segment with bytes of the same size, and nothing changed)."""
        moving = [self.segments[s] for s in sorted(buffer.members) if self.segments[s].dtype is not None]
        for seg in moving:
            home = homes.get(seg.id)
            if home is None or seg.data is None or home.nbytes != seg.data.nbytes:
                return 0
        if not moving:
            return 0
        # Its size: the file's bytes it maps (compacted, as a buffer in memory is, once most of
        # them are dead: else one live row would keep a whole put's file on disk).
        own = Buffer(sum(homes[seg.id].nbytes for seg in moving))
        own.record, own.last_used, own.on_disk = buffer.record, buffer.last_used, True
        for seg in moving:
            live = int(seg.sizes[self._live(seg)].sum())
            self.segments[seg.id] = seg.rehomed(homes[seg.id], own, None)
            own.members.add(seg.id)
            if seg.id in buffer.keys:
                own.keys[seg.id] = buffer.keys[seg.id]
            own.live_bytes += live
            buffer.members.discard(seg.id)
            buffer.live_bytes -= live
        self._moved_out(buffer, own)
        self.disk_bytes += own.live_bytes
        self.spilled_bytes += own.live_bytes
        return own.live_bytes


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
