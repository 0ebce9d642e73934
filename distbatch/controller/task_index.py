"""A partition's task ids and their slots, in numpy arrays: an open-addressing hash table.

Why not a dict: a dict entry and an int object cost some 80 bytes a task, more than all of a
task's columns, and for a controller holding a million tasks that is 80 MB of lookup structure
for 20 MB of metadata. Here a task costs a pointer to its id (the slot's entry in `ids`, which
the partition reads as its ids column), the low 32 bits of its hash (4 bytes) and 4-byte buckets
of a table at most half full (made 3/16 to 3/8 full when it is rebuilt): 20 to 34 bytes.

Linear probing: a lookup walks from bucket ``hash(id) & mask`` to the id's bucket or to an empty
one; a removed task leaves a tombstone (`GONE`) so the walks past it still find what follows, and
the table is rebuilt when tombstones fill a quarter of it, or bigger when it is half full (once
per doubling of the tasks). The kept hash bits make a rebuild array operations only (64 ms for
a million tasks, under the lock; hashing their ids again made it 134) and let a batch lookup
skip comparing ids whose bits differ. The table is this process's: `hash` of a str
differs between processes, so a pickled index keeps its ids alone and rebuilds on load.

Like the partition's other reads (see `distbatch.controller.partitions`), a lookup or change of
at most `FEW_ROWS` ids goes item by item, never through numpy's fancy indexing, which releases
the GIL; a larger batch runs as a few array operations a probing round (most ids are done in
the first two rounds of a table at most half full).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from distbatch.errors import InvalidArgumentError, NotFoundError

# Up to this many rows, reads and writes under the controller's lock go item by item (`item`),
# never through numpy's fancy indexing, which releases the GIL.
FEW_ROWS = 256
EMPTY = -1  # a bucket never used since the last rebuild: a walk stops here
GONE = -2  # a bucket whose task was removed: a walk goes on past it, an insert may reuse it
MIN_BUCKETS = 16
MAX_SLOTS = np.iinfo(np.int32).max  # a bucket holds a slot as an int32
LOW_BITS = 0xFFFFFFFF  # the hash bits kept per slot: the widest table's mask has 31


class TaskIndex:
    """Task id -> slot (an index of the partition's columns), and slot -> task id (`ids`).

    Holds distinct ids; `add` is given ids not held yet (the partition checks a put first).
    """

    __slots__ = ("ids", "_low", "_table", "_count", "_gone")

    def __init__(self) -> None:
        self.ids: np.ndarray = np.empty(0, dtype=object)  # per slot: the task's id, None when free
        self._low = np.zeros(0, dtype=np.uint32)  # per slot: hash(id) & LOW_BITS
        self._table = np.full(MIN_BUCKETS, EMPTY, dtype=np.int32)  # per bucket: a slot, EMPTY or GONE
        self._count = 0
        self._gone = 0

    def __getstate__(self) -> dict[str, np.ndarray]:
        return {"ids": self.ids}  # hashes are this process's: rebuilt where it is loaded

    def __setstate__(self, state: dict[str, np.ndarray]) -> None:
        self.ids = state["ids"]
        held = np.flatnonzero(self.ids != None)  # noqa: E711 (elementwise, on an object array)
        self._count, self._gone = len(held), 0
        self._low = np.zeros(len(self.ids), dtype=np.uint32)
        self._low[held] = _low_bits(self.ids[held].tolist())
        self._rebuild()

    def __len__(self) -> int:
        return self._count

    def __contains__(self, task_id: object) -> bool:
        return isinstance(task_id, str) and self._find_one(task_id) >= 0

    def __getitem__(self, task_id: str) -> int:
        slot = self._find_one(task_id)
        if slot < 0:
            raise NotFoundError(f"no task {task_id!r}")
        return slot

    def get(self, task_id: str, default: int | None = None) -> int | None:
        """The slot of `task_id`, or `default`."""
        slot = self._find_one(task_id)
        return default if slot < 0 else slot

    def __iter__(self) -> Iterator[str]:
        """The ids held, by slot."""
        return iter(self.ids[self.ids != None].tolist())  # noqa: E711 (elementwise, on an object array)

    def nbytes(self) -> int:
        """Bytes of the arrays (the ids' strings not counted)."""
        return int(self.ids.nbytes + self._low.nbytes + self._table.nbytes)

    # ------------------------------------------------------------------ slots

    def reserve(self, capacity: int) -> None:
        """Room for slots [0, `capacity`); new ones free."""
        if capacity <= len(self.ids):
            return
        if capacity > MAX_SLOTS:
            raise InvalidArgumentError(
                f"a partition holds at most {MAX_SLOTS:,} task slots, not {capacity:,}"
            )
        ids = np.full(capacity, None, dtype=object)
        ids[: len(self.ids)] = self.ids
        low = np.zeros(capacity, dtype=np.uint32)
        low[: len(self._low)] = self._low
        self.ids, self._low = ids, low

    def rows_of(self, task_ids: Sequence[str]) -> np.ndarray:
        """The slot of each of `task_ids` (-1: not held), as int64."""
        count = len(task_ids)
        if count > FEW_ROWS:
            wanted = np.empty(count, dtype=object)
            wanted[:] = task_ids
            return self._find_many(_low_bits(task_ids), wanted)
        return np.array(self._walk(task_ids), dtype=np.int64)

    def add(self, task_ids: Sequence[str], slots: np.ndarray) -> None:
        """Hold new, distinct `task_ids` at the free `slots` (int64, one each)."""
        count = len(task_ids)
        if not count:
            return
        self._count += count
        if count > FEW_ROWS or 2 * (self._count + self._gone) > len(self._table):
            lows = _low_bits(task_ids)
            self.ids[slots] = task_ids
            self._low[slots] = lows
            if 2 * (self._count + self._gone) > len(self._table):
                self._rebuild()
            else:
                self._place(slots, lows)
            return
        # A few: each id stored and placed in one pass, item by item (no fancy indexing).
        table, ids, low_bits = self._table, self.ids, self._low
        mask = len(table) - 1
        for slot, task_id in zip(slots.tolist(), task_ids):
            low = hash(task_id) & LOW_BITS
            ids[slot] = task_id
            low_bits[slot] = low
            bucket = low & mask
            while (held := table.item(bucket)) >= 0:
                bucket = (bucket + 1) & mask
            if held == GONE:
                self._gone -= 1
            table[bucket] = slot

    def remove(self, slots: np.ndarray) -> None:
        """Stop holding the tasks at `slots` (distinct slots that hold one)."""
        count = len(slots)
        if not count:
            return
        mask = len(self._table) - 1
        table = self._table
        if count <= FEW_ROWS:
            for slot in slots.tolist():
                bucket = self._low.item(slot) & mask
                while table.item(bucket) != slot:
                    bucket = (bucket + 1) & mask
                table[bucket] = GONE
                self.ids[slot] = None
        else:
            buckets = self._low[slots].astype(np.int64) & mask
            todo = np.arange(count)
            while len(todo):
                found = table[buckets] == slots[todo]
                table[buckets[found]] = GONE
                todo, buckets = todo[~found], (buckets[~found] + 1) & mask
            self.ids[slots] = None
        self._count -= count
        self._gone += count
        if 4 * self._gone > len(self._table):
            self._rebuild()

    # ------------------------------------------------------------------ the table

    def _find_one(self, task_id: str) -> int:
        return self._walk((task_id,))[0]

    def _walk(self, task_ids: Sequence[str]) -> list[int]:
        """The slot of each of `task_ids` (-1: not held), one walk each, item by item (a loop of
        its own, not a call per id: a put of a few hundred tasks walks under the lock)."""
        table_item, id_item = self._table.item, self.ids.item
        mask = len(self._table) - 1
        found = []
        for task_id in task_ids:
            bucket = hash(task_id) & mask
            while True:
                slot = table_item(bucket)
                if slot == EMPTY or (slot >= 0 and id_item(slot) == task_id):
                    break
                bucket = (bucket + 1) & mask
            found.append(slot if slot >= 0 else -1)
        return found

    def _find_many(self, lows: np.ndarray, wanted: np.ndarray) -> np.ndarray:
        """The slots of the ids in `wanted` (an object array; -1: not held), given their hashes'
        low bits: every id walks one bucket a round, those neither found nor at an empty bucket
        go on. Ids are compared only where the bits match."""
        mask = len(self._table) - 1
        found = np.full(len(wanted), -1, dtype=np.int64)
        todo = np.arange(len(wanted))
        buckets = lows.astype(np.int64) & mask
        while len(todo):
            slots = self._table[buckets].astype(np.int64)
            live = np.flatnonzero(slots >= 0)
            live = live[self._low[slots[live]] == lows[todo[live]]]
            same = np.zeros(len(todo), dtype=bool)
            same[live] = self.ids[slots[live]] == wanted[todo[live]]
            found[todo[same]] = slots[same]
            walk = ~same & (slots != EMPTY)
            todo, buckets = todo[walk], (buckets[walk] + 1) & mask
        return found

    def _place(self, slots: np.ndarray, lows: np.ndarray) -> None:
        """Put each of `slots` in the first free bucket from its hash's. A round writes every
        slot whose bucket is free into it: where several asked for one bucket, the one written
        last holds it (read back), and the others walk on with those whose bucket was taken."""
        table = self._table
        mask = len(table) - 1
        slots = slots.astype(np.int32)
        buckets = lows.astype(np.int64) & mask
        while len(slots):
            seen = table[buckets]
            free = seen < 0
            table[buckets[free]] = slots[free]
            won = free & (table[buckets] == slots)
            self._gone -= int(np.count_nonzero(seen[won] == GONE))
            left = ~won
            slots, buckets = slots[left], (buckets[left] + 1) & mask

    def _rebuild(self) -> None:
        """A new table for the ids held, at most 3/8 full (so not rebuilt again soon)."""
        buckets = MIN_BUCKETS
        while 8 * self._count > 3 * buckets:
            buckets *= 2
        self._table = np.full(buckets, EMPTY, dtype=np.int32)
        self._gone = 0
        held = np.flatnonzero(self.ids != None)  # noqa: E711 (elementwise, on an object array)
        self._place(held, self._low[held])


def _low_bits(task_ids: Sequence[str]) -> np.ndarray:
    """`hash(id) & LOW_BITS` of each id, as uint32."""
    return (np.fromiter(map(hash, task_ids), np.int64, len(task_ids)) & LOW_BITS).astype(np.uint32)
