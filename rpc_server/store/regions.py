"""Shared memory for same-host readers: the budget for regions, moving buffers into them, and
the run tables a same-host reply names them by.

A same-host fetch hands tensor bytes out by reference: the segments must live in a shared
(memfd) region. A buffer not in one is copied into a new region once, then its segments are
rehomed there. Separate from the segments because this is the one store operation that copies
outside the store lock (a large copy must not stall every other request) and must check, under
the lock again, that what it copied is still current.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np

from distbatch.transport.shm import SharedRegion, aligned_offsets
from rpc_server.errors import SharedMemoryUnavailable
from rpc_server.store.segments import Buffer, Segment, SegmentTable, run_bounds


class SharedBudget:
    """How much shared memory the store may hold: bytes (`--shm-max-bytes`) and regions (each
    holds a descriptor: the same-host service sets it from the open-file limit). None: no bound."""

    def __init__(self, max_bytes: int | None = None, max_regions: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.max_regions = max_regions

    def check(self, segments: SegmentTable, nbytes: int, regions: int = 1) -> None:
        """`SharedMemoryUnavailable` unless `regions` more shared regions of `nbytes` fit (lock held)."""
        limit = self.max_bytes
        if limit is not None and segments.shared_bytes + nbytes > limit:
            raise SharedMemoryUnavailable(
                f"shared regions would hold {segments.shared_bytes + nbytes} bytes, over this worker's"
                f" --shm-max-bytes of {limit}"
            )
        count = self.max_regions
        if count is not None and segments.shared_regions + regions > count:
            raise SharedMemoryUnavailable(
                f"the worker holds {segments.shared_regions} shared regions, its bound (from its open-file"
                f" limit) is {count}"
            )


class _Move(NamedTuple):
    """One buffer's planned move: its tensor segments, their offsets in the region, its parts."""

    buffer: Buffer
    moving: list[Segment]
    offsets: list[int]
    parts: list[Any]


class RegionMover:
    """Moves buffers into shared regions: plans under the store lock, copies outside it, and
    rehomes under it again what did not change meanwhile (segments never change once built)."""

    def __init__(self, lock: threading.Lock, segments: SegmentTable, budget: SharedBudget) -> None:
        self._lock = lock
        self._segments = segments
        self._budget = budget

    def move(self, buffers: Iterable[Buffer]) -> None:
        """Copy the tensor segments of each buffer into one new shared region per buffer, so
        same-host readers can map them. A buffer whose segments changed meanwhile keeps its old
        home (the caller looks again)."""
        with self._lock:
            plans = self._plan(buffers)
        made = []
        for plan in plans:
            try:
                made.append((plan, SharedRegion.from_parts(plan.parts)))
            except OSError as exc:
                raise SharedMemoryUnavailable(f"the kernel refused a shared region: {exc}") from None
        with self._lock:
            for plan, region in made:
                if self._segments.unchanged(plan.buffer, plan.moving):
                    self._budget.check(self._segments, region.size)
                    self._segments.rehome(plan.buffer, plan.moving, plan.offsets, region)

    def _plan(self, buffers: Iterable[Buffer]) -> list[_Move]:
        """What to copy for each buffer still held with bytes outside a region (lock held); the
        budget is checked for all of them before anything is copied."""
        plans: list[_Move] = []
        planned = 0
        for buffer in buffers:
            moving = self._segments.unshared(buffer)
            if not moving or not self._segments.holds(buffer):
                continue
            sizes = [seg.data.nbytes for seg in moving]  # type: ignore[union-attr]
            offsets, pads = aligned_offsets(sizes)
            planned += offsets[-1] + sizes[-1]
            self._budget.check(self._segments, planned, len(plans) + 1)  # before copying anything
            parts: list[Any] = []
            for seg, pad in zip(moving, pads):
                parts += [bytes(pad), seg.data] if pad else [seg.data]
            plans.append(_Move(buffer, moving, offsets, parts))
        return plans


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
