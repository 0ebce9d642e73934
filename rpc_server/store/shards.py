"""What the store holds: the index and the segment table, changed together.

Storing a bundle's columns (replacing the values they replace), dropping values, and freeing
the task rows left empty each touch both the index and the segments; this class keeps them
consistent, so the `ShardStore` facade only decides capacity, stages and locking. Nothing here
locks: the store calls it with its lock held.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from distbatch.transport.shm import SharedRegion
from distbatch.wire.bundle import Bundle, column_field
from distbatch.wire.shapes import unique_ints
from rpc_server.store.aliases import check_aliases
from rpc_server.store.appends import resolve_appends
from rpc_server.store.index import ShardIndex
from rpc_server.store.records import PutReceipt, ReplacedValues
from rpc_server.store.segments import Buffer, SegmentTable


def merged(a: PutReceipt, b: PutReceipt) -> PutReceipt:
    """Two receipts of one put (its columns, its shared values) as one."""
    return PutReceipt(a.stored + b.stored, a.bytes + b.bytes, (*a.segments, *b.segments), a.generation)


class Shards:
    """The index and the segments. With `clock`, each task's last put or fetch is recorded (for
    idle eviction); without it, nothing is tracked."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self.index = ShardIndex()
        self.segments = SegmentTable(self.index)
        self._clock = clock

    def touch(self, rows: np.ndarray) -> None:
        """The tasks at `rows` were just put or fetched."""
        if self._clock is not None and len(rows):
            self.index.rows.touch(rows, self._clock())

    def resolve_appends(self, bundle: Bundle) -> tuple[Bundle, frozenset[str]]:
        """`appends.resolve_appends` over what this holds."""
        return resolve_appends(self.index, self.segments, bundle)

    def measure(self, bundles: Sequence[Bundle]) -> tuple[int, int, int]:
        """(bytes the bundles bring, bytes their replacing frees, how many of those are spilled):
        a stored row other tasks share is freed only if all of its tasks are replaced."""
        incoming = 0
        replaced: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        for bundle in bundles:
            rows = self.index.rows.lookup(bundle.task_ids)
            for key, column in bundle.columns.items():
                incoming += int(column.row_nbytes().sum())
                col_rows = rows if column.rows is None else rows[column.rows]
                name = column_field(key)
                replaced.setdefault(name, []).append(self.index.values_at(name, col_rows))
        freed = freed_on_disk = 0
        for found in replaced.values():
            segs = np.concatenate([s for s, _ in found])
            total, on_disk = self.segments.freed_by(segs, np.concatenate([p for _, p in found]))
            freed, freed_on_disk = freed + total, freed_on_disk + on_disk
        return incoming, freed, freed_on_disk

    def check_generations(
        self,
        task_ids: Sequence[str],
        rows: np.ndarray,
        fields: Sequence[str],
        generations: np.ndarray | None,
        what: str,
    ) -> None:
        """`ReplacedShardsError` if a value held at `rows` was stored by another put than the
        one `generations` names per task (0: not known, not checked); absent values pass (a
        delete skips them)."""
        if generations is None:
            return
        found = ReplacedValues()
        for name in fields:
            at, stored = self.index.replaced(name, rows, self.index.locate(name, rows), generations)
            found.add(task_ids, name, at, stored, generations)
        found.raise_if_any(what)

    def apply(
        self,
        bundle: Bundle,
        body_size: int | None,
        region: SharedRegion | None = None,
        generation: int = 0,
        own: frozenset[str] = frozenset(),
        aliases: bool = True,
        record: tuple[int, Path] | None = None,
    ) -> PutReceipt:
        """Store a measured bundle (capacity already checked), replacing the values it replaces;
        its values carry `generation`, the put's. The columns keyed in `own` hold memory of their
        own (resolved appends), not views of the body. With `aliases` False, the bundle's shared
        values are left for `apply_aliases` (a staged put applies every part's columns first).
        `record`: the durable log's file the bundle is written to (its record's number, its
        path), so its body can be spilled there."""
        rows = self.index.rows.assign(bundle.task_ids, self.index.rows.lookup(bundle.task_ids))
        buffer = Buffer(0, region)
        buffer.record, buffer.last_used = record, self.segments.tick()
        stored = nbytes = 0
        segments: list[tuple[str, int]] = []
        owned: list[tuple[str, int]] = []
        for key, column in bundle.columns.items():
            name = column_field(key)
            col_rows = rows if column.rows is None else rows[column.rows]
            if not len(col_rows):
                continue  # a column of no rows stores nothing
            self.kill(name, col_rows)
            home = Buffer(0) if key in own else buffer
            seg = self.segments.add(name, column, col_rows, home)
            self.index.place(name, col_rows, seg.id, generation)
            if home is not buffer:
                self._keep_body(home, None, [(name, seg.id)])
                owned.append((name, seg.id))
            else:
                segments.append((name, seg.id))
                if record is not None:
                    buffer.keys[seg.id] = key
            stored += len(col_rows)
            nbytes += int(seg.sizes.sum())
        self._keep_body(buffer, body_size, segments)
        self.segments.shards += stored
        self.segments.nbytes += nbytes
        receipt = PutReceipt(stored, nbytes, (*segments, *owned), generation)
        if aliases:
            receipt = merged(receipt, self.apply_aliases(bundle, generation))
        self.touch(rows)
        self.index.release_empty(rows)  # tasks no column covered hold nothing
        return receipt

    def apply_aliases(self, bundle: Bundle, generation: int) -> PutReceipt:
        """The bundle's tasks that share a value (checked by `check_aliases`) now do."""
        shared_cols = [
            (key, column.alias, column.alias_of or [])
            for key, column in bundle.columns.items()
            if column.alias is not None and len(column.alias)
        ]
        if not shared_cols:
            return PutReceipt(0, 0, (), generation)
        rows = self.index.rows.assign(bundle.task_ids, self.index.rows.lookup(bundle.task_ids))
        stored = 0
        segments: list[tuple[str, int]] = []
        for key, members, sources in shared_cols:
            name = column_field(key)
            segs = self._share(name, rows[members], sources, generation)
            stored += len(members)
            segments += [(name, seg_id) for seg_id in segs]
        self.touch(rows)
        self.index.release_empty(rows)
        return PutReceipt(stored, 0, tuple(segments), generation)

    def _share(self, name: str, rows: np.ndarray, sources: list[str], generation: int) -> list[int]:
        """Field `name` of the tasks at `rows` becomes the value the tasks `sources` hold (one
        each); returns the segments those values are in."""
        self.kill(name, rows)
        segs, positions = self.index.alias(name, rows, self.index.rows.lookup(sources), generation)
        self.segments.share(segs, positions)
        return unique_ints(segs).tolist()

    def check_aliases(self, bundles: Sequence[Bundle]) -> None:
        """`aliases.check_aliases` over what this holds."""
        check_aliases(self.index, bundles)

    def _keep_body(self, buffer: Buffer, body_size: int | None, segments: list[tuple[str, int]]) -> None:
        """Hold a put's body buffer while its segments point into it."""
        # The body is held while a tensor column points into it; JSON values are parsed objects.
        keeps_body = any(self.segments.segments[seg_id].dtype is not None for _, seg_id in segments)
        if not keeps_body:
            buffer.region = None  # nothing refers to the body: no need to keep its region
        buffer.size = max(body_size or 0, buffer.live_bytes) if keeps_body else buffer.live_bytes
        if buffer.members:
            self.segments.keep_buffer(buffer)

    def kill(self, name: str, rows: np.ndarray, only_segment: int | None = None) -> tuple[int, int]:
        """Drop field `name` of the tasks at `rows` (if they hold it); returns (count, bytes)."""
        dead = self.index.kill(name, rows, only_segment)
        return (0, 0) if dead is None else self.segments.account_dead(*dead)

    def delete_rows(self, rows: np.ndarray, fields: Sequence[str]) -> tuple[int, int]:
        """Drop `fields` of the tasks at `rows`, then free the rows left empty; returns (count, bytes)."""
        rows = unique_ints(rows)
        count = freed = 0
        for name in fields:
            c, b = self.kill(name, rows)
            count, freed = count + c, freed + b
        self.index.release_empty(rows)
        return count, freed

    def delete_keys(self, by_field: Mapping[str, Sequence[str]]) -> tuple[int, int]:
        """Drop each field of the tasks listed under it (absent ones skipped); returns (count, bytes)."""
        count = freed = 0
        touched: list[np.ndarray] = []
        for field, task_ids in by_field.items():
            rows = self.index.rows.lookup(task_ids)
            rows = unique_ints(rows[rows >= 0])
            c, b = self.kill(field, rows)
            count, freed = count + c, freed + b
            touched.append(rows)
        if touched:
            self.index.release_empty(np.concatenate(touched))
        return count, freed

    def keys_of_put(self, receipt: PutReceipt) -> dict[str, list[str]]:
        """The keys `delete_put(receipt)` would delete now, by field (a durable log's record of it)."""
        keys: dict[str, list[str]] = {}
        for name, seg_id in receipt.segments:
            seg = self.segments.segments.get(seg_id)
            if seg is None:
                continue
            rows = seg.task_rows if seg.refs is None else self.index.rows_in(name, seg_id, receipt.generation)
            rows = rows[self.index.locate(name, rows) == seg_id] if len(rows) else rows
            keys.setdefault(name, []).extend(self.index.rows.ids[rows].tolist())
        return {name: ids for name, ids in keys.items() if ids}

    def delete_put(self, receipt: PutReceipt) -> tuple[int, int]:
        """Drop the values one put stored that are still there; returns (count, bytes)."""
        count = freed = 0
        touched: list[np.ndarray] = []
        for name, seg_id in receipt.segments:
            seg = self.segments.segments.get(seg_id)
            if seg is None:
                continue
            # A shared row's tasks are found by the put that stored each (aliases of later puts stay).
            rows = seg.task_rows if seg.refs is None else self.index.rows_in(name, seg_id, receipt.generation)
            touched.append(rows)
            c, b = self.kill(name, rows, only_segment=seg_id)
            count, freed = count + c, freed + b
        if touched:
            self.index.release_empty(np.concatenate(touched))
        return count, freed

    def held_bytes(self) -> int:
        """What the process holds for the shards: buffers (dead rows included) and the index."""
        return self.segments.held_bytes() + self.index.nbytes()
