"""A store segment: one put's field as immutable rows over a body buffer, the per-field index
that says which segment and row hold each task's value, and a staged put's bookkeeping."""

from __future__ import annotations

import numpy as np

from distbatch.shm import SharedRegion
from distbatch.wire.bundle import Bundle, RawColumn
from distbatch.wire.shapes import RowShapes


class BodyBuffer:
    """One put's body (or a compacted segment's own copy): the memory segments point into.

    `region` is set when that memory is a shared region (a same-host put, or a buffer moved
    into shared memory for a same-host reader): its segments can be handed out by reference.
    """

    __slots__ = ("size", "live_bytes", "members", "region")

    def __init__(self, size: int, region: SharedRegion | None = None) -> None:
        self.size = size
        self.live_bytes = 0
        self.members: set[int] = set()  # ids of the segments in it
        self.region = region


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
        "region_offset",
    )

    def __init__(
        self,
        seg_id: int,
        field: str,
        column: RawColumn,
        task_rows: np.ndarray,
        buffer: BodyBuffer,
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
        self.live = len(task_rows)  # rows still the value of their task's field
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
    def outside_region(self) -> bool:
        """Tensor bytes not in a shared region yet (a same-host reader moves them into one)."""
        return (
            self.dtype is not None
            and self.region_offset is None
            and self.data is not None
            and bool(self.data.nbytes)
        )

    def rehomed(self, data: np.ndarray, buffer: BodyBuffer, region_offset: int) -> Segment:
        """The same rows with their bytes at `data` (a copy of `self.data` in `buffer`'s region)."""
        fresh = Segment.__new__(Segment)
        for name in Segment.__slots__:
            setattr(fresh, name, getattr(self, name))
        fresh.data, fresh.buffer, fresh.region_offset = data, buffer, region_offset
        return fresh


class FieldIndex:
    """Per task row: the segment (-1: none) and the row in it holding this field's value.

    Sized to the highest row the field has touched (rows past it hold nothing), and
    dropped by the store once the field holds no value: a field costs memory for the
    rows it spans, never for every task the store knows.
    """

    __slots__ = ("seg", "pos", "live")

    def __init__(self) -> None:
        self.seg = np.full(0, -1, dtype=np.int64)
        self.pos = np.zeros(0, dtype=np.int64)
        self.live = 0  # rows holding a value

    def ensure(self, max_row: int) -> None:
        if max_row < len(self.seg):
            return
        extra = max(max_row + 1, 2 * len(self.seg), 64) - len(self.seg)
        self.seg = np.concatenate([self.seg, np.full(extra, -1, dtype=np.int64)])
        self.pos = np.concatenate([self.pos, np.zeros(extra, dtype=np.int64)])

    def segs_at(self, rows: np.ndarray) -> np.ndarray:
        """The segment at each of `rows` (-1 for none, rows past the index included)."""
        if len(rows) and int(rows.max()) < len(self.seg):
            return self.seg[rows]
        out = np.full(len(rows), -1, dtype=np.int64)
        inside = rows < len(self.seg)
        out[inside] = self.seg[rows[inside]]
        return out

    def nbytes(self) -> int:
        return self.seg.nbytes + self.pos.nbytes


class Stage:
    __slots__ = ("touched", "parts", "nbytes")

    def __init__(self, touched: float) -> None:
        self.touched = touched
        # part name -> (bundle, its body size, the shared region holding the body if any)
        self.parts: dict[str, tuple[Bundle, int, SharedRegion | None]] = {}
        self.nbytes = 0
