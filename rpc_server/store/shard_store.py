"""The worker's shard store: columns kept as immutable segments, indexed per task with numpy.

A put's fields each become one *segment*: the rows' bytes in one buffer (the request
body itself, not a copy), with numpy arrays of byte offsets, sizes and shapes. A task
is a row number; per field, two arrays say which segment and which row of it hold that
task's value. Puts, fetches and deletes are array operations over those tables: no
Python object is made per shard, and no loop runs once per row, except over the runs
of rows a scattered fetch touches.

Memory: segments of one put share its body buffer. A segment goes when its last row
is deleted, and the buffer when its last segment goes (the memory returns to the OS:
bodies are anonymous mappings). A buffer whose live rows fall under half of it is
compacted: its live rows are copied into buffers of their own. `stats()` reports live
bytes (what capacity counts) and held bytes (what the process holds).
"""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from distbatch.ids import ShardKey
from distbatch.shm import SharedRegion, aligned_offsets
from distbatch.wire.bundle import LAYER_MARK, Bundle, RawColumn, column_field
from distbatch.wire.container import RawTensor, parts_size
from distbatch.wire.shapes import RowShapes, unique_ints
from rpc_server.errors import (
    MissingShardsError,
    SharedMemoryUnavailable,
    StoreCapacityError,
    UnknownStageError,
)
from rpc_server.store.columns import Picked, RegionSlots, by_segment, column_of, gather_bytes
from rpc_server.store.segments import BodyBuffer, FieldIndex, Segment, Stage

logger = logging.getLogger("rpc_server")

# A 404 lists at most this many missing keys (and says how many there are).
MAX_MISSING_LISTED = 10_000
# A same-host fetch looks again this often when the rows it moves into shared memory change meanwhile.
SHARE_ATTEMPTS = 3
# A buffer this large or larger is compacted once under half of it is live.
COMPACT_MIN_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class StoreStats:
    shards: int
    tasks: int
    bytes: int
    capacity: int | None
    staged_bytes: int = 0
    evicted_shards: int = 0
    evicted_bytes: int = 0
    held_bytes: int = 0
    segments: int = 0
    shared_bytes: int = 0
    shared_regions: int = 0

    def as_dict(self) -> dict[str, int | None]:
        return {
            "staged_bytes": self.staged_bytes,
            "evicted_shards": self.evicted_shards,
            "evicted_bytes": self.evicted_bytes,
            "shards": self.shards,
            "tasks": self.tasks,
            "bytes": self.bytes,
            "live_bytes": self.bytes,
            "held_bytes": self.held_bytes,
            "segments": self.segments,
            "shared_bytes": self.shared_bytes,
            "shared_regions": self.shared_regions,
            "capacity": self.capacity,
            "free": None if self.capacity is None else self.capacity - self.bytes - self.staged_bytes,
        }


class PutReceipt(NamedTuple):
    """What one put stored: counts, and its segments by id (not the data, so holding a
    receipt holds no memory); `delete_put` deletes the rows still in those segments."""

    stored: int
    bytes: int
    segments: tuple[tuple[str, int], ...]


def bundle_from_raw(shards: Mapping[Any, Any]) -> Bundle:
    """`{(task_id, field): RawTensor | JSON value}` as a bundle (no torch; one step per shard).

    For callers that hold single shards (tests, tools); the data path uses bundles.
    """
    task_index: dict[str, int] = {}
    by_field: dict[str, list[tuple[int, Any]]] = {}
    for (task_id, field), value in shards.items():
        row = task_index.setdefault(task_id, len(task_index))
        by_field.setdefault(field, []).append((row, value))
    columns: dict[str, RawColumn] = {}
    for field, items in by_field.items():
        rows = np.asarray([r for r, _ in items], dtype=np.int64)
        values = [v for _, v in items]
        if all(isinstance(v, RawTensor) for v in values):
            dtypes = {v.dtype for v in values}
            if len(dtypes) > 1:
                raise ValueError(f"field {field!r} mixes dtypes {sorted(dtypes)}")
            parts = [v.data for v in values]
            column = RawColumn(
                values[0].dtype, RowShapes.from_list([v.shape for v in values]), parts, parts_size(parts)
            )
        else:
            column = RawColumn(None, values=values)
        if not np.array_equal(rows, np.arange(len(task_index))):
            column.rows = rows
        columns[field] = column
    return Bundle(list(task_index), columns)


class ShardStore:
    """Columns of shards keyed by task id and field; every public method is atomic.

    With `max_idle_seconds`, the store remembers when each task was last put or fetched
    so that `evict_idle` can drop tasks nobody touched for that long; without it, nothing
    is tracked and nothing is evicted.

    A staged put untouched for `stage_ttl` seconds (by `clock`) is dropped and its
    reserved capacity released: by a sweeper thread the store runs while it holds
    stages, and before any put or stage would be refused for capacity. So a client
    killed mid-put cannot make every later put fail with 507.
    """

    def __init__(
        self,
        max_bytes: int | None = None,
        stage_ttl: float = 600.0,
        max_idle_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_shared_bytes: int | None = None,
    ) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        if max_idle_seconds is not None and not max_idle_seconds > 0:
            raise ValueError("max_idle_seconds must be > 0")
        if not stage_ttl > 0:
            raise ValueError("stage_ttl must be > 0")
        self.max_bytes = max_bytes
        self.stage_ttl = stage_ttl
        self.max_idle_seconds = max_idle_seconds
        # Shared regions (same-host puts, buffers moved out for same-host readers) may hold at
        # most this many bytes; past it, same-host requests fall back to HTTP.
        self.max_shared_bytes = max_shared_bytes
        # And at most this many regions (each holds descriptors; the same-host service sets it
        # from the open-file limit).
        self.max_shared_regions: int | None = None
        self._shared_bytes = 0
        self._shared_regions = 0
        self._clock = clock  # for last-access times and stage expiry (tests pass a fake one)
        self._lock = threading.Lock()
        # Task rows: id -> row, row -> id (None: free), free rows, and the high-water mark.
        self._row_of: dict[str, int] = {}
        self._ids = np.empty(0, dtype=object)
        self._free: list[int] = []
        self._next_row = 0
        self._access = np.zeros(0, dtype=np.float64)  # clock() of each task's last put / fetch
        self._fields: dict[str, FieldIndex] = {}
        self._segments: dict[int, Segment] = {}
        self._seg_ids = itertools.count()
        self._buffers: dict[int, BodyBuffer] = {}  # id(buffer) -> buffer, for held bytes
        self._shards = 0
        self._bytes = 0
        self._evicted_shards = 0
        self._evicted_bytes = 0
        # Puts split over several requests are staged, then committed at once.
        # Staged bytes count against capacity so that a commit cannot overflow.
        self._stages: dict[str, Stage] = {}
        self._staged_bytes = 0
        self._committed: dict[str, tuple[float, tuple[int, int]]] = {}
        # Runs only while stages exist (started by `stage`, exits when none are left).
        self._stage_sweeper: threading.Thread | None = None
        self._closed = threading.Event()

    # ------------------------------------------------------------------ task rows (lock held)

    def _lookup(self, task_ids: Sequence[str]) -> np.ndarray:
        """Rows of `task_ids`, -1 for tasks the store does not hold."""
        return np.fromiter(
            map(self._row_of.get, task_ids, itertools.repeat(-1)), dtype=np.int64, count=len(task_ids)
        )

    def _assign(self, task_ids: Sequence[str], rows: np.ndarray) -> np.ndarray:
        """Fill in rows for the tasks where `rows` is -1 (new tasks); returns the full rows."""
        new = np.flatnonzero(rows < 0)
        if not len(new):
            return rows
        count = len(new)
        reused = self._free[max(0, len(self._free) - count) :]
        del self._free[len(self._free) - len(reused) :]
        fresh = count - len(reused)
        start = self._next_row
        self._next_row += fresh
        if self._next_row > len(self._ids):
            self._grow(max(self._next_row, 2 * len(self._ids), 1024))
        assigned = np.concatenate(
            [np.asarray(reused, dtype=np.int64), np.arange(start, start + fresh, dtype=np.int64)]
        )
        rows = rows.copy()
        rows[new] = assigned
        new_ids = [task_ids[i] for i in new.tolist()]
        self._row_of.update(zip(new_ids, assigned.tolist()))
        self._ids[assigned] = new_ids
        return rows

    def _grow(self, capacity: int) -> None:
        extra = capacity - len(self._ids)
        self._ids = np.concatenate([self._ids, np.full(extra, None, dtype=object)])
        self._access = np.concatenate([self._access, np.zeros(extra, dtype=np.float64)])

    def _field(self, name: str) -> FieldIndex:
        index = self._fields.get(name)
        if index is None:
            index = self._fields[name] = FieldIndex()
        return index

    def _release_empty(self, rows: np.ndarray) -> None:
        """Free the task rows among `rows` that hold no field any more (rows already free are skipped)."""
        rows = unique_ints(rows)
        rows = rows[self._ids[rows] != None]  # noqa: E711 (elementwise)
        if not len(rows):
            return
        held = np.zeros(len(rows), dtype=bool)
        for index in self._fields.values():
            held |= index.segs_at(rows) >= 0
        empty = rows[~held]
        if not len(empty):
            return
        ids = self._ids[empty].tolist()
        collections.deque(map(self._row_of.pop, ids), maxlen=0)
        self._ids[empty] = None
        self._free.extend(empty.tolist())

    def _touch(self, rows: np.ndarray) -> None:
        if self.max_idle_seconds is not None and len(rows):
            self._access[rows] = self._clock()

    # ------------------------------------------------------------------ killing rows (lock held)

    def _kill(self, name: str, rows: np.ndarray, only_segment: int | None = None) -> tuple[int, int]:
        """Drop field `name` of the tasks at `rows` (if they hold it); returns (count, bytes)."""
        index = self._fields.get(name)
        if index is None or not len(rows):
            return 0, 0
        rows = unique_ints(rows)
        segs = index.segs_at(rows)
        keep = segs >= 0 if only_segment is None else segs == only_segment
        if not keep.any():
            return 0, 0
        rows, segs = rows[keep], segs[keep]
        positions = index.pos[rows]
        index.seg[rows] = -1
        index.live -= len(rows)
        if index.live == 0:
            del self._fields[name]
        return self._account_dead(segs, positions)

    def _account_dead(self, segs: np.ndarray, positions: np.ndarray) -> tuple[int, int]:
        """Rows at (`segs`, `positions`) just died: update counts, free segments, then compact
        buffers left mostly dead (after all the accounting: compaction replaces segments)."""
        count = freed = 0
        sparse: dict[int, BodyBuffer] = {}
        for seg_id in unique_ints(segs).tolist():
            seg = self._segments[seg_id]
            dead = positions[segs == seg_id] if len(segs) > 1 else positions
            nbytes = int(seg.sizes[dead].sum())
            count += len(dead)
            freed += nbytes
            seg.buffer.live_bytes -= nbytes
            seg.live -= len(dead)
            if seg.live == 0:
                self._drop_segment(seg)
            elif seg.buffer.size >= COMPACT_MIN_BYTES and 2 * seg.buffer.live_bytes < seg.buffer.size:
                sparse[id(seg.buffer)] = seg.buffer
        self._shards -= count
        self._bytes -= freed
        for key, buffer in sparse.items():
            if key in self._buffers and buffer.members and 2 * buffer.live_bytes < buffer.size:
                self._compact_buffer(buffer)
        return count, freed

    def _segment_live(self, seg: Segment) -> np.ndarray:
        """Which of the segment's rows are still the value of their task's field."""
        index = self._fields.get(seg.field)
        rows = seg.task_rows
        if index is None:
            return np.zeros(len(rows), dtype=bool)
        live = index.segs_at(rows) == seg.id
        live[live] &= index.pos[rows[live]] == np.flatnonzero(live)
        return live

    def _drop_segment(self, seg: Segment) -> None:
        del self._segments[seg.id]
        buffer = seg.buffer
        buffer.members.discard(seg.id)
        if not buffer.members:
            self._forget_buffer(buffer)

    def _keep_buffer(self, buffer: BodyBuffer) -> None:
        self._buffers[id(buffer)] = buffer
        if buffer.region is not None:
            self._shared_bytes += buffer.region.size
            self._shared_regions += 1

    def _forget_buffer(self, buffer: BodyBuffer) -> None:
        """Stop holding `buffer`; a shared region's descriptor closes once no request holds it."""
        if self._buffers.pop(id(buffer), None) is not None and buffer.region is not None:
            self._shared_bytes -= buffer.region.size
            self._shared_regions -= 1

    def _compact_buffer(self, buffer: BodyBuffer) -> None:
        """Copy the live rows of every segment in `buffer` into buffers of their own."""
        for seg in [self._segments[s] for s in sorted(buffer.members)]:
            live = self._segment_live(seg)
            keep = np.flatnonzero(live)
            sizes = seg.sizes[keep]
            own = BodyBuffer(int(sizes.sum()))
            if seg.dtype is not None:
                data = gather_bytes(seg.bytes_array, seg.starts[keep], sizes)
                column = RawColumn(seg.dtype, seg.tensor_shapes.take(keep), [data.data], len(data))
            else:
                values = seg.values or []
                column = RawColumn(None, values=[values[i] for i in keep.tolist()])
                data = None
            fresh = Segment(seg.id, seg.field, column, seg.task_rows[keep], own, data)
            fresh.sizes = sizes  # keep the accounting exact (JSON sizes are an even split)
            fresh.starts = (
                np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if len(keep) else sizes
            )
            self._fields[seg.field].pos[fresh.task_rows] = np.arange(len(keep))
            own.live_bytes = own.size
            own.members.add(seg.id)
            self._keep_buffer(own)
            self._segments[seg.id] = fresh
            buffer.live_bytes -= own.size
        self._forget_buffer(buffer)

    def _check_shared(self, nbytes: int, regions: int = 1) -> None:
        """`SharedMemoryUnavailable` unless `regions` more shared regions of `nbytes` fit (lock held)."""
        limit = self.max_shared_bytes
        if limit is not None and self._shared_bytes + nbytes > limit:
            raise SharedMemoryUnavailable(
                f"shared regions would hold {self._shared_bytes + nbytes} bytes, over this worker's"
                f" --shm-max-bytes of {limit}"
            )
        count = self.max_shared_regions
        if count is not None and self._shared_regions + regions > count:
            raise SharedMemoryUnavailable(
                f"the worker holds {self._shared_regions} shared regions, its bound (from its open-file"
                f" limit) is {count}"
            )

    def _unshared(self, buffer: BodyBuffer) -> list[Segment]:
        """The tensor segments of `buffer` holding bytes outside any shared region (lock held)."""
        members = [self._segments[s] for s in sorted(buffer.members)]
        return [seg for seg in members if seg.outside_region]

    def _move_to_regions(self, buffers: Iterable[BodyBuffer]) -> None:
        """Copy the tensor segments of each buffer into one new shared region per buffer, so
        same-host readers can map them. The copies are made outside the lock (segments never
        change); a buffer whose segments changed meanwhile keeps its old home (the caller
        looks again)."""
        plans: list[tuple[BodyBuffer, list[Segment], list[int], list[Any]]] = []
        planned = 0
        with self._lock:
            for buffer in buffers:
                moving = self._unshared(buffer)
                if not moving or id(buffer) not in self._buffers:
                    continue
                sizes = [seg.data.nbytes for seg in moving]  # type: ignore[union-attr]
                offsets, pads = aligned_offsets(sizes)
                planned += offsets[-1] + sizes[-1]
                self._check_shared(planned, len(plans) + 1)  # before copying anything
                parts: list[Any] = []
                for seg, pad in zip(moving, pads):
                    parts += [bytes(pad), seg.data] if pad else [seg.data]
                plans.append((buffer, moving, offsets, parts))
        made = []
        for buffer, moving, offsets, parts in plans:
            try:
                made.append((buffer, moving, offsets, SharedRegion.from_parts(parts)))
            except OSError as exc:
                raise SharedMemoryUnavailable(f"the kernel refused a shared region: {exc}") from None
        with self._lock:
            for buffer, moving, offsets, region in made:
                current = id(buffer) in self._buffers and all(self._segments.get(s.id) is s for s in moving)
                if current:
                    self._check_shared(region.size)
                    self._rehome(buffer, moving, offsets, region)

    def _rehome(
        self, buffer: BodyBuffer, moving: list[Segment], offsets: list[int], region: SharedRegion
    ) -> None:
        """Point `moving` (segments of `buffer`) at their copies in `region` (lock held)."""
        own = BodyBuffer(region.size, region)
        for seg, offset in zip(moving, offsets):
            size = seg.data.nbytes  # type: ignore[union-attr]
            live = int(seg.sizes[self._segment_live(seg)].sum())
            self._segments[seg.id] = seg.rehomed(region.array[offset : offset + size], own, offset)
            own.members.add(seg.id)
            own.live_bytes += live
            buffer.members.discard(seg.id)
            buffer.live_bytes -= live
        self._keep_buffer(own)
        if not buffer.members:
            self._forget_buffer(buffer)
        elif buffer.region is None and not any(self._segments[s].dtype is not None for s in buffer.members):
            buffer.size = buffer.live_bytes  # only JSON values are left, which hold no body bytes

    # ------------------------------------------------------------------ putting

    def put(
        self,
        bundle: Bundle | Mapping[Any, Any],
        body_size: int | None = None,
        region: SharedRegion | None = None,
    ) -> PutReceipt:
        """Store every shard of `bundle` or none; existing keys are replaced (puts are idempotent).

        The bundle's tensor bytes are kept as they are (views of the request body: no copy);
        `body_size` is that body's size, for the held-bytes account. A mapping of single
        shards (`bundle_from_raw`'s input) is accepted too. `region`: the shared region the
        body is (a same-host put), so its columns go to same-host readers as they are. Raises
        `StoreCapacityError` when the store would grow past its capacity.
        """
        if not isinstance(bundle, Bundle):
            bundle = bundle_from_raw(bundle)
        with self._lock:
            incoming, replaced = self._measure(bundle)
            self._check_capacity(self._bytes + incoming - replaced, incoming)
            if region is not None:
                self._check_shared(region.size)
            return self._apply(bundle, body_size, region)

    def _measure(self, bundle: Bundle) -> tuple[int, int]:
        """(bytes the bundle brings, bytes of the stored values it replaces) (lock held)."""
        incoming = replaced = 0
        rows = self._lookup(bundle.task_ids)
        for key, column in bundle.columns.items():
            incoming += int(column.row_nbytes().sum())
            index = self._fields.get(column_field(key))
            if index is None:
                continue
            col_rows = rows if column.rows is None else rows[column.rows]
            col_rows = col_rows[col_rows >= 0]
            segs = index.segs_at(col_rows)
            held = segs >= 0
            for seg_id in unique_ints(segs[held]).tolist():
                seg = self._segments[seg_id]
                replaced += int(seg.sizes[index.pos[col_rows[held & (segs == seg_id)]]].sum())
        return incoming, replaced

    def _apply(self, bundle: Bundle, body_size: int | None, region: SharedRegion | None = None) -> PutReceipt:
        """Store a measured bundle (lock held; capacity already checked)."""
        rows = self._assign(bundle.task_ids, self._lookup(bundle.task_ids))
        columns = bundle.columns
        buffer = BodyBuffer(0, region)
        stored = nbytes = 0
        segments: list[tuple[str, int]] = []
        for key, column in columns.items():
            name = column_field(key)
            col_rows = rows if column.rows is None else rows[column.rows]
            if not len(col_rows):
                continue  # a column of no rows stores nothing
            self._kill(name, col_rows)
            seg = Segment(next(self._seg_ids), name, column, col_rows, buffer)
            index = self._field(name)
            index.ensure(int(col_rows.max()))
            index.seg[col_rows] = seg.id
            index.pos[col_rows] = np.arange(len(col_rows))
            index.live += len(col_rows)
            size = int(seg.sizes.sum())
            buffer.live_bytes += size
            buffer.members.add(seg.id)
            self._segments[seg.id] = seg
            segments.append((name, seg.id))
            stored += len(col_rows)
            nbytes += size
        # The body is held while a tensor column points into it; JSON values are parsed objects.
        keeps_body = any(self._segments[seg_id].dtype is not None for _, seg_id in segments)
        if not keeps_body:
            buffer.region = None  # nothing refers to the body: no need to keep its region
        buffer.size = max(body_size or 0, buffer.live_bytes) if keeps_body else buffer.live_bytes
        if buffer.members:
            self._keep_buffer(buffer)
        self._shards += stored
        self._bytes += nbytes
        self._touch(rows)
        self._release_empty(rows)  # tasks no column covered hold nothing
        return PutReceipt(stored, nbytes, tuple(segments))

    def _check_capacity(self, stored_after: int, incoming: int, now: float | None = None) -> None:
        """Raise `StoreCapacityError` unless `stored_after` plus staged bytes fits (caller holds the lock).

        Before refusing, drop stages expired at `now` (default: the clock): their reservations
        must not refuse a put.
        """
        if self.max_bytes is None or stored_after + self._staged_bytes <= self.max_bytes:
            return
        self._expire_stages(self._clock() if now is None else now)
        would_use = stored_after + self._staged_bytes
        if would_use > self.max_bytes:
            staged = f" ({self._staged_bytes} reserved by staged puts)" if self._staged_bytes else ""
            raise StoreCapacityError(
                f"storing {incoming} bytes would use {would_use} of {self.max_bytes} bytes{staged}"
            )

    # ------------------------------------------------------------------ staging

    def stage(
        self,
        stage_id: str,
        bundle: Bundle | Mapping[Any, Any],
        body_size: int | None = None,
        part: str = "",
        region: SharedRegion | None = None,
    ) -> tuple[int, int]:
        """Hold a bundle under `stage_id` until `commit`; invisible to fetches until then.

        Re-staging the same `part` (by default: the same tasks and fields) replaces it, so a
        retried request is safe. Staged bytes
        are reserved against capacity. Stages untouched for `stage_ttl` seconds are dropped.
        """
        if not isinstance(bundle, Bundle):
            bundle = bundle_from_raw(bundle)
        incoming = bundle.nbytes()
        with self._lock:
            now = self._clock()
            self._expire_stages(now)  # first: this stage itself may have expired
            if stage_id in self._committed:
                raise UnknownStageError(f"stage {stage_id!r} is already committed")
            stage = self._stages.get(stage_id) or Stage(now)
            # Unnamed parts are named by what they hold, so a re-sent request replaces itself.
            key = part or f"#{hash((tuple(bundle.task_ids), tuple(bundle.columns)))}"
            released = stage.parts[key][0].nbytes() if key in stage.parts else 0
            self._check_capacity(self._bytes + incoming - released, incoming, now)
            if region is not None:
                self._check_shared(region.size)
            stage.parts[key] = (bundle, body_size or incoming, region)
            stage.nbytes += incoming - released
            stage.touched = now
            self._stages[stage_id] = stage
            self._staged_bytes += incoming - released
            self._start_stage_sweeper()
        return bundle.shard_count(), incoming

    def commit(self, stage_id: str) -> tuple[int, int]:
        """Store everything staged under `stage_id` at once; idempotent for a while after."""
        with self._lock:
            now = self._clock()
            self._expire_stages(now)
            if stage_id in self._committed:
                return self._committed[stage_id][1]
            stage = self._stages.pop(stage_id, None)
            if stage is None:
                raise UnknownStageError(f"no stage {stage_id!r} (never staged, aborted or expired)")
            self._staged_bytes -= stage.nbytes
            stored = nbytes = 0
            # Capacity was reserved when staging, and replacing only frees bytes.
            for bundle, body_size, region in stage.parts.values():
                receipt = self._apply(bundle, body_size, region)
                stored, nbytes = stored + receipt.stored, nbytes + receipt.bytes
            result = (stored, nbytes)
            self._committed[stage_id] = (now, result)
        return result

    def abort(self, stage_id: str) -> int:
        """Drop a stage; returns how many shards it held (0 if none). Idempotent."""
        with self._lock:
            stage = self._stages.pop(stage_id, None)
            if stage is None:
                return 0
            self._staged_bytes -= stage.nbytes
        return sum(bundle.shard_count() for bundle, _, _ in stage.parts.values())

    def _expire_stages(self, now: float) -> tuple[int, int]:
        """Drop stages untouched for `stage_ttl` (caller holds the lock); returns (stages, bytes) dropped."""
        dropped = released = 0
        for stage_id, stage in list(self._stages.items()):
            if now - stage.touched > self.stage_ttl:
                del self._stages[stage_id]
                self._staged_bytes -= stage.nbytes
                dropped += 1
                released += stage.nbytes
        for stage_id, (done, _) in list(self._committed.items()):
            if now - done > self.stage_ttl:
                del self._committed[stage_id]
        if dropped:  # a client staged part of a put and never committed or aborted it
            logger.warning(
                "dropped %d staged put(s), %d bytes, not committed within %gs (a client died mid-put?)",
                dropped,
                released,
                self.stage_ttl,
            )
        return dropped, released

    def expire_stages(self) -> tuple[int, int]:
        """Drop every stage untouched for `stage_ttl` seconds; returns (stages, bytes released)."""
        with self._lock:
            return self._expire_stages(self._clock())

    def _start_stage_sweeper(self) -> None:
        """Start the sweeper thread unless it runs (caller holds the lock, and just staged)."""
        if self._stage_sweeper is None and not self._closed.is_set():
            self._stage_sweeper = threading.Thread(
                target=self._sweep_stages, name="stage-sweeper", daemon=True
            )
            self._stage_sweeper.start()

    def _sweep_stages(self) -> None:
        """Expire stages every `stage_ttl / 4` seconds (10 at most); exit once the store holds none."""
        interval = min(max(self.stage_ttl / 4, 0.05), 10.0)
        while not self._closed.wait(interval):
            self.expire_stages()
            with self._lock:  # the same lock `stage` holds to decide whether to start a sweeper
                if not self._stages:
                    self._stage_sweeper = None
                    return
        with self._lock:
            self._stage_sweeper = None

    def close(self) -> None:
        """Stop the stage sweeper for good (a server shutting down); stored data stays readable."""
        self._closed.set()
        with self._lock:
            sweeper = self._stage_sweeper
        if sweeper is not None and sweeper is not threading.current_thread():
            sweeper.join(timeout=5)

    # ------------------------------------------------------------------ fetching

    def fetch(self, task_ids: Sequence[str], fields: Sequence[str]) -> Bundle:
        """The product `task_ids` x `fields` as a bundle whose columns point into the segments.

        `MissingShardsError` lists every absent key. The bytes are not copied when the rows
        form a few runs; scattered rows are gathered into one buffer per field.
        """
        return Bundle(list(task_ids), self._columns(self._pick(task_ids, fields)))

    def fetch_shared(
        self, task_ids: Sequence[str], fields: Sequence[str], inline_below: int = 0
    ) -> tuple[Bundle, list[SharedRegion]]:
        """`fetch` for a same-host reader: tensor columns of `inline_below` bytes or more come as
        runs in shared regions (`RawColumn.runs`; slots index the returned regions), moving a
        buffer into a region first where it is not in one yet (one copy, once per buffer).

        Smaller columns and JSON come inline, as `fetch` gives them. Holding the regions keeps
        their descriptors open. `SharedMemoryUnavailable` when a region cannot be made.
        """
        for _ in range(SHARE_ATTEMPTS):
            pending: dict[int, BodyBuffer] = {}
            picked = self._pick(task_ids, fields, share_from=inline_below, pending=pending)
            if not pending:
                slots = RegionSlots()
                columns = self._columns(picked, slots)
                return Bundle(list(task_ids), columns), slots.regions
            self._move_to_regions(pending.values())
        raise SharedMemoryUnavailable("the rows kept changing while being moved into shared memory")

    def _pick(
        self,
        task_ids: Sequence[str],
        fields: Sequence[str],
        share_from: int | None = None,
        pending: dict[int, BodyBuffer] | None = None,
    ) -> list[Picked]:
        """Per field: the segment and position of each task's value (`MissingShardsError` for
        any absent). With `share_from`, the tensor fields of that many bytes or more are marked
        shared; buffers holding their bytes outside a shared region go into `pending`."""
        with self._lock:
            rows = self._lookup(task_ids)
            picked: list[Picked] = []
            missing: list[ShardKey] = []
            missing_count = 0
            for name in fields:
                index = self._fields.get(name)
                segs = index.segs_at(np.maximum(rows, 0)) if index is not None else np.full(len(rows), -1)
                segs = np.where(rows >= 0, segs, -1)
                absent = np.flatnonzero(segs < 0)
                if len(absent):
                    missing_count += len(absent)
                    room = MAX_MISSING_LISTED - len(missing)
                    missing += [ShardKey(task_ids[i], name) for i in absent[: max(room, 0)].tolist()]
                    continue
                positions = index.pos[rows] if index is not None else segs
                used = {s: self._segments[s] for s in unique_ints(segs).tolist()}
                shared = share_from is not None and self._shares(segs, positions, used, share_from, pending)
                picked.append(Picked(name, segs, positions, used, shared))
            if not missing:
                self._touch(rows)
        if missing:
            raise MissingShardsError(missing, missing_count)
        return picked

    def _shares(
        self,
        segs: np.ndarray,
        positions: np.ndarray,
        used: dict[int, Segment],
        share_from: int,
        pending: dict[int, BodyBuffer] | None,
    ) -> bool:
        """Whether a field's rows go by reference: tensors of `share_from` bytes or more. If so,
        the buffers of segments not in a shared region yet go into `pending` (lock held)."""
        if any(seg.dtype is None for seg in used.values()):
            return False
        nbytes = sum(int(seg.sizes[rows].sum()) for seg, rows in by_segment(segs, positions, used))
        if nbytes < share_from:
            return False
        if pending is not None:
            for seg in used.values():
                if seg.outside_region:
                    pending[id(seg.buffer)] = seg.buffer
        return True

    def _columns(self, picked: list[Picked], slots: RegionSlots | None = None) -> dict[str, RawColumn]:
        """The picked rows as columns (outside the lock: segments never change once built)."""
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

    def fetch_keys(self, keys: Sequence[ShardKey]) -> Bundle:
        """Explicit keys as a bundle: tasks in first-seen order, each field on the tasks asking for it."""
        keys = list(dict.fromkeys(keys))  # a key asked for twice is sent once
        task_ids = list(dict.fromkeys(task_id for task_id, _ in keys))
        position = {t: i for i, t in enumerate(task_ids)}
        by_field: dict[str, list[int]] = {}
        for task_id, field in keys:
            by_field.setdefault(field, []).append(position[task_id])
        missing: list[ShardKey] = []
        missing_count = 0
        columns: dict[str, RawColumn] = {}
        for field, task_rows in by_field.items():
            ids = [task_ids[i] for i in task_rows]
            try:
                fetched = self.fetch(ids, [field]).columns
            except MissingShardsError as exc:
                missing += exc.keys[: max(MAX_MISSING_LISTED - len(missing), 0)]
                missing_count += exc.count
                continue
            for key, column in fetched.items():
                rows = np.asarray(task_rows, dtype=np.int64)
                if column.rows is not None:
                    rows = rows[column.rows]
                column.rows = None if np.array_equal(rows, np.arange(len(task_ids))) else rows
                columns[key] = column
        if missing:
            raise MissingShardsError(missing, missing_count)
        return Bundle(task_ids, columns)

    def get(self, keys: Iterable[ShardKey]) -> Bundle:
        """Alias of `fetch_keys` (the name the per-shard store had)."""
        return self.fetch_keys(list(keys))

    # ------------------------------------------------------------------ deleting

    def delete_tasks(self, task_ids: Iterable[str]) -> tuple[int, int]:
        """Delete every field of the given tasks. Returns (count, bytes freed)."""
        task_ids = list(task_ids)
        with self._lock:
            rows = self._lookup(task_ids)
            return self._delete_rows(rows[rows >= 0], list(self._fields))

    def delete_product(self, task_ids: Iterable[str], fields: Iterable[str]) -> tuple[int, int]:
        """Delete `fields` of the given tasks (absent ones are skipped). Returns (count, bytes freed)."""
        task_ids = list(task_ids)
        with self._lock:
            rows = self._lookup(task_ids)
            return self._delete_rows(rows[rows >= 0], list(dict.fromkeys(fields)))

    def delete_keys(self, keys: Iterable[ShardKey]) -> tuple[int, int]:
        """Delete the given shards; absent keys are skipped. Returns (count, bytes freed)."""
        by_field: dict[str, list[str]] = {}
        for task_id, field in keys:
            by_field.setdefault(field, []).append(task_id)
        count = freed = 0
        with self._lock:
            touched: list[np.ndarray] = []
            for field, task_ids in by_field.items():
                rows = self._lookup(task_ids)
                rows = unique_ints(rows[rows >= 0])
                c, b = self._kill(field, rows)
                count, freed = count + c, freed + b
                touched.append(rows)
            if touched:
                self._release_empty(np.concatenate(touched))
        return count, freed

    def _delete_rows(self, rows: np.ndarray, fields: Sequence[str]) -> tuple[int, int]:
        rows = unique_ints(rows)
        count = freed = 0
        for name in fields:
            c, b = self._kill(name, rows)
            count, freed = count + c, freed + b
        self._release_empty(rows)
        return count, freed

    def delete_put(self, receipt: PutReceipt) -> tuple[int, int]:
        """Delete what one put stored, where it is still there (a later put's values under the same
        keys survive). For dropping an abandoned engine call's result. Returns (count, bytes freed)."""
        count = freed = 0
        with self._lock:
            touched: list[np.ndarray] = []
            for name, seg_id in receipt.segments:
                seg = self._segments.get(seg_id)
                if seg is None:
                    continue
                touched.append(seg.task_rows)
                c, b = self._kill(name, seg.task_rows, only_segment=seg_id)
                count, freed = count + c, freed + b
            if touched:
                self._release_empty(np.concatenate(touched))
        return count, freed

    def evict_idle(self) -> tuple[int, int]:
        """Delete every task not put or fetched for `max_idle_seconds`; returns (shards, bytes).

        Staged puts are not touched (they expire by `stage_ttl`).
        """
        if self.max_idle_seconds is None:
            return 0, 0
        with self._lock:
            cutoff = self._clock() - self.max_idle_seconds
            held = np.flatnonzero(self._ids[: self._next_row] != None)  # noqa: E711 (elementwise)
            idle = held[self._access[held] <= cutoff]
            count, freed = self._delete_rows(idle, list(self._fields))
            self._evicted_shards += count
            self._evicted_bytes += freed
        return count, freed

    # ------------------------------------------------------------------ reporting

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                self._shards,
                len(self._row_of),
                self._bytes,
                self.max_bytes,
                self._staged_bytes,
                self._evicted_shards,
                self._evicted_bytes,
                sum(b.size for b in self._buffers.values()) + sum(i.nbytes() for i in self._fields.values()),
                len(self._segments),
                self._shared_bytes,
                self._shared_regions,
            )

    def list_tasks(
        self, after: str | None = None, limit: int = 1000
    ) -> tuple[list[tuple[str, list[str]]], int]:
        """The held tasks in id order, after `after`, at most `limit`: (task id, its fields) each,
        and how many tasks the store holds. For operators (`distbatch ls`), not the data path."""
        with self._lock:
            held = np.flatnonzero(self._ids[: self._next_row] != None)  # noqa: E711 (elementwise)
            ids = self._ids[held].tolist()
            order = sorted(range(len(ids)), key=ids.__getitem__)
            names = [ids[i] for i in order]
            start = 0 if after is None else bisect.bisect_right(names, after)
            page = order[start : start + limit]
            rows = held[page] if page else np.zeros(0, dtype=np.int64)
            fields: list[list[str]] = [[] for _ in page]
            for name in sorted(self._fields):
                for i in np.flatnonzero(self._fields[name].segs_at(rows) >= 0).tolist():
                    fields[i].append(name)
            return [(ids[i], f) for i, f in zip(page, fields)], len(ids)

    def __len__(self) -> int:
        return self._shards


