"""Where each shard's value lives: task rows, and per field the segment and row holding it.

A task is a row number; per field, two arrays say which segment and which row of it hold that
task's value. Lookups, assignments and kills are array operations over those tables. Kept apart
from the segments themselves: the index knows segment ids, never their bytes. Nothing here
locks: the store calls it with its lock held.
"""

from __future__ import annotations

import bisect
import collections
import itertools
from collections.abc import Sequence

import numpy as np

from distbatch.wire.shapes import unique_ints


class FieldIndex:
    """Per task row: the segment (-1: none) and the row in it holding this field's value, and
    the generation of the put that stored it (so a stale batch handle can be told apart).

    Sized to the highest row the field has touched (rows past it hold nothing), and
    dropped by the store once the field holds no value: a field costs memory for the
    rows it spans, never for every task the store knows.
    """

    __slots__ = ("seg", "pos", "gen", "live")

    def __init__(self) -> None:
        self.seg = np.full(0, -1, dtype=np.int64)
        self.pos = np.zeros(0, dtype=np.int64)
        self.gen = np.zeros(0, dtype=np.int64)
        self.live = 0  # rows holding a value

    def ensure(self, max_row: int) -> None:
        if max_row < len(self.seg):
            return
        extra = max(max_row + 1, 2 * len(self.seg), 64) - len(self.seg)
        self.seg = np.concatenate([self.seg, np.full(extra, -1, dtype=np.int64)])
        self.pos = np.concatenate([self.pos, np.zeros(extra, dtype=np.int64)])
        self.gen = np.concatenate([self.gen, np.zeros(extra, dtype=np.int64)])

    def segs_at(self, rows: np.ndarray) -> np.ndarray:
        """The segment at each of `rows` (-1 for none, rows past the index included)."""
        if len(rows) and int(rows.max()) < len(self.seg):
            return self.seg[rows]
        out = np.full(len(rows), -1, dtype=np.int64)
        inside = rows < len(self.seg)
        out[inside] = self.seg[rows[inside]]
        return out

    def nbytes(self) -> int:
        return self.seg.nbytes + self.pos.nbytes + self.gen.nbytes


class TaskRows:
    """Task ids and their row numbers both ways, the free rows, and each task's last access."""

    def __init__(self) -> None:
        self.row_of: dict[str, int] = {}
        self.ids = np.empty(0, dtype=object)  # row -> task id (None: free)
        self.free: list[int] = []
        self.next_row = 0  # the high-water mark
        self.access = np.zeros(0, dtype=np.float64)  # clock() of each task's last put / fetch

    def __len__(self) -> int:
        return len(self.row_of)

    def lookup(self, task_ids: Sequence[str]) -> np.ndarray:
        """Rows of `task_ids`, -1 for tasks the store does not hold."""
        return np.fromiter(
            map(self.row_of.get, task_ids, itertools.repeat(-1)), dtype=np.int64, count=len(task_ids)
        )

    def assign(self, task_ids: Sequence[str], rows: np.ndarray) -> np.ndarray:
        """Fill in rows for the tasks where `rows` is -1 (new tasks); returns the full rows."""
        new = np.flatnonzero(rows < 0)
        if not len(new):
            return rows
        count = len(new)
        reused = self.free[max(0, len(self.free) - count) :]
        del self.free[len(self.free) - len(reused) :]
        fresh = count - len(reused)
        start = self.next_row
        self.next_row += fresh
        if self.next_row > len(self.ids):
            self._grow(max(self.next_row, 2 * len(self.ids), 1024))
        assigned = np.concatenate(
            [np.asarray(reused, dtype=np.int64), np.arange(start, start + fresh, dtype=np.int64)]
        )
        rows = rows.copy()
        rows[new] = assigned
        new_ids = [task_ids[i] for i in new.tolist()]
        self.row_of.update(zip(new_ids, assigned.tolist()))
        self.ids[assigned] = new_ids
        return rows

    def _grow(self, capacity: int) -> None:
        extra = capacity - len(self.ids)
        self.ids = np.concatenate([self.ids, np.full(extra, None, dtype=object)])
        self.access = np.concatenate([self.access, np.zeros(extra, dtype=np.float64)])

    def held(self) -> np.ndarray:
        """The rows of every task held, in row order."""
        return np.flatnonzero(self.ids[: self.next_row] != None)  # noqa: E711 (elementwise)

    def held_among(self, rows: np.ndarray) -> np.ndarray:
        """Those of `rows` that belong to a task (free rows left out)."""
        return rows[self.ids[rows] != None]  # noqa: E711 (elementwise)

    def release(self, rows: np.ndarray) -> None:
        """Forget the tasks at `rows` (held rows, distinct); the rows become free."""
        ids = self.ids[rows].tolist()
        collections.deque(map(self.row_of.pop, ids), maxlen=0)
        self.ids[rows] = None
        self.free.extend(rows.tolist())

    def touch(self, rows: np.ndarray, now: float) -> None:
        self.access[rows] = now

    def idle(self, cutoff: float) -> np.ndarray:
        """The held rows last put or fetched at `cutoff` or before."""
        held = self.held()
        return held[self.access[held] <= cutoff]


class ShardIndex:
    """The task rows and, per field, its `FieldIndex`: which segment row holds each shard."""

    def __init__(self) -> None:
        self.rows = TaskRows()
        self.fields: dict[str, FieldIndex] = {}

    def names(self) -> list[str]:
        return list(self.fields)

    def nbytes(self) -> int:
        return sum(index.nbytes() for index in self.fields.values())

    def place(self, name: str, rows: np.ndarray, seg_id: int, generation: int = 0) -> None:
        """Field `name` of the tasks at `rows` is now row i of segment `seg_id`, stored by put
        `generation` (rows hold none)."""
        index = self.fields.get(name)
        if index is None:
            index = self.fields[name] = FieldIndex()
        index.ensure(int(rows.max()))
        index.seg[rows] = seg_id
        index.pos[rows] = np.arange(len(rows))
        index.gen[rows] = generation
        index.live += len(rows)

    def alias(
        self, name: str, rows: np.ndarray, sources: np.ndarray, generation: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        """Field `name` of the tasks at `rows` (holding none) is now the value the tasks at
        `sources` hold (one each), stored by put `generation`; returns its (segments, positions)."""
        index = self.fields[name]
        index.ensure(int(rows.max()))
        segs, positions = index.seg[sources], index.pos[sources]
        index.seg[rows] = segs
        index.pos[rows] = positions
        index.gen[rows] = generation
        index.live += len(rows)
        return segs, positions

    def rows_in(self, name: str, seg_id: int, generation: int | None = None) -> np.ndarray:
        """The task rows whose field `name` is a row of segment `seg_id` (and was stored by put
        `generation`, if given): a pass over the field's index."""
        index = self.fields.get(name)
        if index is None:
            return np.zeros(0, dtype=np.int64)
        hit = index.seg == seg_id
        if generation is not None:
            hit &= index.gen == generation
        return np.flatnonzero(hit)

    def repoint_segment(self, name: str, seg_id: int, moved: np.ndarray) -> None:
        """Segment `seg_id` of field `name` was rebuilt: row p is now row `moved[p]`."""
        rows = self.rows_in(name, seg_id)
        index = self.fields[name]
        index.pos[rows] = moved[index.pos[rows]]

    def kill(
        self, name: str, rows: np.ndarray, only_segment: int | None = None
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """Drop field `name` of the tasks at `rows` (if they hold it, in `only_segment` if given);
        returns the (segments, positions) that held the dropped values, None if none did."""
        index = self.fields.get(name)
        if index is None or not len(rows):
            return None
        rows = unique_ints(rows)
        segs = index.segs_at(rows)
        keep = segs >= 0 if only_segment is None else segs == only_segment
        if not keep.any():
            return None
        rows, segs = rows[keep], segs[keep]
        positions = index.pos[rows]
        index.seg[rows] = -1
        index.live -= len(rows)
        if index.live == 0:
            del self.fields[name]
        return segs, positions

    def release_empty(self, rows: np.ndarray) -> None:
        """Free the task rows among `rows` that hold no field any more (rows already free are skipped)."""
        rows = self.rows.held_among(unique_ints(rows))
        if not len(rows):
            return
        held = np.zeros(len(rows), dtype=bool)
        for index in self.fields.values():
            held |= index.segs_at(rows) >= 0
        empty = rows[~held]
        if len(empty):
            self.rows.release(empty)

    def values_at(self, name: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(segments, positions) of the values field `name` holds at `rows` (-1 rows skipped)."""
        index = self.fields.get(name)
        if index is None:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        rows = rows[rows >= 0]
        segs = index.segs_at(rows)
        held = segs >= 0
        return segs[held], index.pos[rows[held]]

    def locate(self, name: str, rows: np.ndarray) -> np.ndarray:
        """The segment holding field `name` at each of `rows` (-1: none, or -1 rows of no task)."""
        index = self.fields.get(name)
        if index is None:
            return np.full(len(rows), -1)
        return np.where(rows >= 0, index.segs_at(np.maximum(rows, 0)), -1)

    def generations(self, name: str, rows: np.ndarray) -> np.ndarray:
        """The generation of field `name`'s value at each of `rows` (rows that `locate` found)."""
        index = self.fields.get(name)
        return index.gen[rows] if index is not None else np.zeros(len(rows), dtype=np.int64)

    def replaced(
        self, name: str, rows: np.ndarray, segs: np.ndarray, generations: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Of the values of field `name` at `rows` (held where `segs` >= 0), those a put other
        than `generations` names stored (0: any): (their positions in `rows`, their generations)."""
        at = np.flatnonzero((segs >= 0) & (generations != 0))
        if not len(at):
            return at, at
        stored = self.generations(name, rows[at])
        stale = stored != generations[at]
        return at[stale], stored[stale]

    def positions(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Where field `name` of the tasks at `rows` sits in its segment (rows that `locate` found)."""
        index = self.fields.get(name)
        return index.pos[rows] if index is not None else np.full(len(rows), -1)

    def live_in(self, name: str, task_rows: np.ndarray, seg_id: int) -> np.ndarray:
        """Which of segment `seg_id`'s rows (its tasks at `task_rows`) still hold field `name`."""
        index = self.fields.get(name)
        if index is None:
            return np.zeros(len(task_rows), dtype=bool)
        live = index.segs_at(task_rows) == seg_id
        live[live] &= index.pos[task_rows[live]] == np.flatnonzero(live)
        return live

    def repoint(self, name: str, task_rows: np.ndarray) -> None:
        """Field `name` of the tasks at `task_rows` moved to rows 0.. of a new segment of the same id."""
        self.fields[name].pos[task_rows] = np.arange(len(task_rows))

    def tasks_page(self, after: str | None, limit: int) -> tuple[list[tuple[str, list[str]]], int]:
        """The held tasks in id order, after `after`, at most `limit`: (task id, its fields in
        name order) each, and how many tasks are held."""
        held = self.rows.held()
        ids = self.rows.ids[held].tolist()
        order = sorted(range(len(ids)), key=ids.__getitem__)
        names = [ids[i] for i in order]
        start = 0 if after is None else bisect.bisect_right(names, after)
        page = order[start : start + limit]
        rows = held[page] if page else np.zeros(0, dtype=np.int64)
        return [(ids[i], f) for i, f in zip(page, self._fields_at(rows))], len(ids)

    def fields_of(self, task_ids: Sequence[str]) -> list[list[str]]:
        """Each task's fields in name order (empty for a task not held)."""
        rows = self.rows.lookup(task_ids)
        out: list[list[str]] = [[] for _ in task_ids]
        present = np.flatnonzero(rows >= 0)
        for i, names in zip(present.tolist(), self._fields_at(rows[present])):
            out[i] = names
        return out

    def _fields_at(self, rows: np.ndarray) -> list[list[str]]:
        """The fields (in name order) of the tasks at `rows`: a pass per field, not per task."""
        fields: list[list[str]] = [[] for _ in range(len(rows))]
        for name in sorted(self.fields):
            for i in np.flatnonzero(self.fields[name].segs_at(rows) >= 0).tolist():
                fields[i].append(name)
        return fields
