"""`ShardStore`: the store's public face, and the one lock every operation takes.

Each public method takes the lock and asks its collaborators: the held shards (`Shards`: index
and segments), the stage book, the shared-memory budget and mover, the column builder. What
only the facade decides is capacity (with staged reservations and stage expiry) and what runs
outside the lock: turning single shards into a bundle, building response columns (segments
never change once built), copying buffers into shared regions (`RegionMover` retakes the lock
to rehome them), and counting an aborted stage's shards. The collaborators never lock.
"""

from __future__ import annotations

import logging
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from distbatch.ids import ShardKey
from distbatch.transport.shm import SharedRegion
from distbatch.wire.bundle import Bundle, RawColumn
from rpc_server.errors import (
    DurableLogError,
    MissingShardsError,
    SharedMemoryUnavailable,
    StoreCapacityError,
    UnknownStageError,
)
from rpc_server.store.appends import check_stage
from rpc_server.store.columns import MAX_MISSING_LISTED, Picked, build_columns, pick
from rpc_server.store.durable import DurableLog, LogStats, Record, record_name
from rpc_server.store.records import PutReceipt, StoreStats, bundle_from_raw
from rpc_server.store.regions import RegionMover, RegionSlots, SharedBudget
from rpc_server.store.segments import Buffer
from rpc_server.store.shards import Shards
from rpc_server.store.snapshot import capture, snapshot_bundles
from rpc_server.store.spill import Spiller
from rpc_server.store.stages import StageBook, StagedPart
from rpc_server.store.sweeper import StageSweeper, sweep_interval

# Put generations start at a random point in this range, so a worker restarted at the same address
# (almost surely) never gives a put the generation an old batch handle names. Ten digits, however
# drawn (every batch's metadata and every gather request carries them, so their width sets bytes
# on the wire: two runs of one job move the same bytes).
GENERATION_START = (10**9, 4 * 10**9)

logger = logging.getLogger(__name__)

# After a durable worker replays its log, new puts' generations start this far above the newest
# replayed one: puts acknowledged but lost with the write-behind tail had generations above it,
# and batch handles naming them must never match a new value.
GENERATION_MARGIN = 1 << 24

# A durable store compacts its log once the log holds this many times the bytes the store does,
# and at least COMPACT_MIN_BYTES (a snapshot writes everything held: not for a few deleted bytes).
COMPACT_RATIO = 2.0
COMPACT_MIN_BYTES = 64 << 20

# A same-host fetch looks again this often when the rows it moves into shared memory change meanwhile.
SHARE_ATTEMPTS = 3


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
        log: DurableLog | None = None,
        sync: bool = False,
    ) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        if max_idle_seconds is not None and not max_idle_seconds > 0:
            raise ValueError("max_idle_seconds must be > 0")
        if not stage_ttl > 0:
            raise ValueError("stage_ttl must be > 0")
        self.max_bytes = max_bytes
        self.max_idle_seconds = max_idle_seconds
        self._clock = clock  # for last-access times and stage expiry (tests pass a fake one)
        self._lock = threading.Lock()
        self._shards = Shards(clock if max_idle_seconds is not None else None)
        segments = self._shards.segments
        # Shared regions (same-host puts, buffers moved out for same-host readers) are bounded;
        # past the bounds, same-host requests fall back to HTTP.
        self._shared = SharedBudget(max_shared_bytes)
        self._mover = RegionMover(self._lock, segments, self._shared)
        # Puts split over several requests are staged, then committed at once.
        self._stages = StageBook(stage_ttl)
        self._sweeper = StageSweeper(
            self._lock, sweep_interval(stage_ttl), self.expire_stages, self._stages.__bool__
        )
        self._evicted_shards = 0
        self._evicted_bytes = 0
        low, high = GENERATION_START
        self._last_generation = low + secrets.randbelow(high - low)
        # A durable worker's log (`durable`): each committed change is queued there under the
        # lock, in commit order; with `sync`, a put returns once its record is on disk.
        self._log = log
        self.sync = sync
        # Past `max_bytes`, a durable store spills its coldest shards to their record files.
        self._spiller = None if log is None else Spiller(log)
        self._compacting = threading.Lock()  # one snapshot at a time (`compact`)
        self._closing = False  # set by `close` under `_compacting`: no compaction after it

    def _next_generation(self) -> int:
        """A new put's generation (caller holds the lock)."""
        self._last_generation += 1
        return self._last_generation

    @property
    def stage_ttl(self) -> float:
        return self._stages.ttl

    @property
    def max_shared_bytes(self) -> int | None:
        """Shared regions may hold at most this many bytes (None: no bound)."""
        return self._shared.max_bytes

    @max_shared_bytes.setter
    def max_shared_bytes(self, value: int | None) -> None:
        self._shared.max_bytes = value

    @property
    def max_shared_regions(self) -> int | None:
        """At most this many shared regions (each holds a descriptor; the same-host service sets
        it from the open-file limit). None: no bound."""
        return self._shared.max_regions

    @max_shared_regions.setter
    def max_shared_regions(self, value: int | None) -> None:
        self._shared.max_regions = value

    def shared_room(self, nbytes: int) -> bool:
        """Whether one more shared region of `nbytes` fits the budget now (a put may still be
        refused if others fill it first)."""
        with self._lock:
            try:
                self._shared.check(self._shards.segments, nbytes)
            except SharedMemoryUnavailable:
                return False
        return True

    # ------------------------------------------------------------------ putting

    def put(
        self,
        bundle: Bundle | Mapping[Any, Any],
        body_size: int | None = None,
        region: SharedRegion | None = None,
    ) -> PutReceipt:
        """Store every shard of `bundle` or none; existing keys are replaced (puts are idempotent),
        or extended where a column appends (`RawColumn.append`; an append is not idempotent).

        The bundle's tensor bytes are kept as they are (views of the request body: no copy);
        `body_size` is that body's size, for the held-bytes account. A mapping of single
        shards (`bundle_from_raw`'s input) is accepted too. `region`: the shared region the
        body is (a same-host put), so its columns go to same-host readers as they are. Raises
        `StoreCapacityError` when the store would grow past its capacity.
        """
        if not isinstance(bundle, Bundle):
            bundle = bundle_from_raw(bundle)
        self._make_room(bundle.nbytes())
        with self._lock:
            self._shards.check_aliases([bundle])
            resolved, own = self._shards.resolve_appends(bundle)
            incoming, replaced, on_disk = self._shards.measure([resolved])
            self._check_capacity(self._shards.segments.nbytes + incoming - replaced, incoming, None, on_disk)
            if region is not None:
                self._shared.check(self._shards.segments, region.size)
            self._writable()
            generation = self._next_generation()
            record = self._record_file(0, 1)
            receipt = self._shards.apply(resolved, body_size, region, generation, own, record=record)
            seq = self._record("put", generation, [bundle])
        self._settle(seq)
        return receipt

    # ------------------------------------------------------------------ durability

    def _make_room(self, incoming: int = 0) -> None:
        """Before a change (outside the lock): wait while the durable log is too far behind; if
        `incoming` bytes would not fit in memory, wait until every record is on disk, so that
        what is held can be spilled."""
        if self._log is None:
            return
        self._log.wait_for_room()
        if self.max_bytes is None or not incoming:
            return
        with self._lock:
            short = self._memory_bytes() + self._stages.staged_bytes + incoming > self.max_bytes
        if short:
            self._log.wait(self._log.last_queued)

    def _memory_bytes(self) -> int:
        """Live bytes held in memory: not spilled (caller holds the lock)."""
        return self._shards.segments.nbytes - self._shards.segments.disk_bytes

    def _record_file(self, part: int, parts: int) -> tuple[int, Path] | None:
        """(number, file) of part `part` of the `parts` of the record the change about to be
        applied is logged as (caller holds the lock: no other record comes between); None
        without a log."""
        if self._log is None:
            return None
        seq = self._log.next_seq
        return seq, self._log.log_dir / record_name(seq, part, parts)

    def _writable(self) -> None:
        """`DurableLogError` before a change is applied, if its record could not be queued."""
        if self._log is not None:
            self._log.check()

    def _record(
        self,
        kind: str,
        generation: int = 0,
        bundles: Sequence[Bundle] = (),
        delete: dict[str, Any] | None = None,
    ) -> int:
        """Queue a change just applied on the durable log (caller holds the lock, so records are
        in the order of the changes; `_writable` was asked before applying it); its sequence
        number, 0 without a log."""
        if self._log is None:
            return 0
        return self._log.append(kind, generation, bundles, delete)

    def _settle(self, seq: int) -> None:
        """After a change (outside the lock): with `sync`, wait until its record is durable."""
        if seq and self.sync and self._log is not None and not self._log.wait(seq):
            raise DurableLogError(
                f"the change was applied but its record could not be written: {self._log.stats().failed}"
            )

    def recover(self, records: Sequence[Record]) -> tuple[int, int]:
        """Replay a durable log's records (`DurableLog.recovered`), in order, with their
        generations, into this empty store: what it held when they were written. Capacity is
        not checked (the data was accepted once). A record that cannot be applied ends the
        replay: it and the rest are set aside (logged). Later puts' generations start well
        above every replayed one (`GENERATION_MARGIN`): puts a crash lost had some above it,
        and batch handles may name them. Past `max_bytes`, the coldest are left on disk
        (spilled). Returns (puts, deletes) replayed."""
        puts = deletes = 0
        newest = 0
        with self._lock:
            for at, record in enumerate(records):
                try:
                    self._replay(record)
                except Exception as exc:
                    if record.snapshot:  # all that is left of the records it replaced
                        raise DurableLogError(
                            f"the snapshot cannot be replayed ({record.paths}): {exc}"
                        ) from exc
                    logger.error(
                        "durable log: record %d cannot be replayed; it and %d later set aside",
                        record.seq,
                        len(records) - at - 1,
                        exc_info=True,
                    )
                    if self._log is not None:
                        self._log.set_aside(records[at:])
                    break
                newest = max(newest, record.generation)
                deletes += record.kind == "delete"
                puts += record.kind != "delete"
            if newest:
                self._last_generation = max(self._last_generation, newest + GENERATION_MARGIN)
            over = 0 if self.max_bytes is None else self._memory_bytes() - self.max_bytes
            if over > 0 and self._spiller is not None:  # the log held more than memory may
                self._spiller.free(self._shards.segments, over)
        return puts, deletes

    def _replay(self, record: Record) -> None:
        """One record's change (caller holds the lock)."""
        if record.kind == "delete":
            self._replay_delete(record.delete or {})
            return
        self._shards.check_aliases(record.bundles)
        resolved = [self._shards.resolve_appends(bundle) for bundle in record.bundles]
        files = [(0, path) for path in record.paths]  # on disk already
        self._apply_parts(resolved, [(None, None)] * len(resolved), record.generation, files)

    def _apply_parts(
        self,
        resolved: Sequence[tuple[Bundle, frozenset[str]]],
        bodies: Sequence[tuple[int | None, SharedRegion | None]],
        generation: int,
        files: Sequence[tuple[int, Path] | None],
    ) -> tuple[int, int]:
        """Apply a commit's parts as one put (checked, appends resolved; caller holds the lock):
        every part's columns first, then every part's shared values, so a value shared across
        parts is there, and the latest, whatever order the parts arrived in. `files`: each
        part's record (its number and file; None without a log). (stored, bytes)."""
        stored = nbytes = 0
        for (bundle, own), (body_size, region), record in zip(resolved, bodies, files):
            receipt = self._shards.apply(
                bundle, body_size, region, generation, own, aliases=False, record=record
            )
            stored, nbytes = stored + receipt.stored, nbytes + receipt.bytes
        for bundle, _ in resolved:
            stored += self._shards.apply_aliases(bundle, generation).stored
        return stored, nbytes

    def _replay_delete(self, delete: Mapping[str, Any]) -> None:
        """A delete record's change (caller holds the lock)."""
        if "keys" in delete:
            self._shards.delete_keys(delete["keys"])
            return
        rows = self._shards.index.rows.lookup(list(delete.get("tasks", [])))
        fields = delete.get("fields")
        self._shards.delete_rows(rows[rows >= 0], self._shards.index.names() if fields is None else fields)

    def spill(self, nbytes: int | None = None) -> int:
        """Move up to `nbytes` (None: all) of the coldest shards' memory to disk now, as a put
        past `max_bytes` does (a durable worker only: `ValueError` otherwise); waits for the log
        to be written first. The bytes of memory freed."""
        if self._log is None or self._spiller is None:
            raise ValueError("only a durable store (one with a data directory) can spill")
        self._log.wait(self._log.last_queued)
        with self._lock:
            need = self._memory_bytes() if nbytes is None else nbytes
            return self._spiller.free(self._shards.segments, need)

    def compact(self) -> bool:
        """Write a snapshot of everything the store holds and drop the log records it replaces
        (`snapshot`, `DurableLog.write_snapshot`), so the disk holds what the store holds rather
        than every change since the directory was new. The store serves meanwhile: its lock is
        held only to read the index. False if nothing changed since the last snapshot, or one is
        being written now. A durable store only (`ValueError`)."""
        if self._log is None:
            raise ValueError("only a durable store (one with a data directory) has a log to compact")
        if not self._compacting.acquire(blocking=False):
            return False
        try:
            if self._closing:
                return False
            with self._lock:
                seq = self._log.last_queued
                if seq <= self._log.stats().snapshot_seq:
                    return False  # nothing changed since the last snapshot: nothing captured
                fields = capture(self._shards)
                held, last_generation = self._shards.segments.nbytes, self._last_generation
            free = shutil.disk_usage(self._log.directory).free
            if free < held + COMPACT_MIN_BYTES:  # a snapshot writes everything held
                logger.warning("durable log not compacted: %d bytes free, %d held", free, held)
                return False
            return self._log.write_snapshot(seq, snapshot_bundles(fields, last_generation))
        finally:
            self._compacting.release()

    def _settle_delete(self, seq: int) -> None:
        """After a delete (outside the lock): settle its record (`_settle`) and, when there was
        one, see whether the log is due a compaction."""
        self._settle(seq)
        if seq:
            self._compact_if_due()

    def _compact_if_due(self) -> None:
        """After a delete (caller holds nothing): compact in the background once the log holds
        more than `COMPACT_RATIO` times what the store does (and at least `COMPACT_MIN_BYTES`)."""
        if self._log is None or self._compacting.locked():
            return
        disk = self._log.stats().disk_bytes
        if disk < COMPACT_MIN_BYTES or disk < COMPACT_RATIO * self._shards.segments.nbytes:
            return
        threading.Thread(target=self._compact_quietly, name="durable-compaction", daemon=True).start()

    def _compact_quietly(self) -> None:
        try:
            self.compact()
        except Exception:  # a full disk, say: the log is whole, and the next delete tries again
            logger.warning("durable log compaction failed; the log is kept as it was", exc_info=True)

    def durable_stats(self) -> LogStats | None:
        """How the durable log stands (None: not a durable worker)."""
        return None if self._log is None else self._log.stats()

    def _check_capacity(
        self, stored_after: int, incoming: int, now: float | None = None, freed_on_disk: int = 0
    ) -> None:
        """Raise `StoreCapacityError` unless `stored_after` (of which `freed_on_disk` fewer bytes
        are spilled) plus staged bytes fits in memory (caller holds the lock).

        Before refusing, drop stages expired at `now` (default: the clock): their reservations
        must not refuse a put; then, on a durable worker, spill the coldest shards to disk.
        """
        if self.max_bytes is None:
            return
        in_memory = stored_after - (self._shards.segments.disk_bytes - freed_on_disk)
        if in_memory + self._stages.staged_bytes <= self.max_bytes:
            return
        self._stages.expire(self._clock() if now is None else now)
        staged_bytes = self._stages.staged_bytes
        would_use = in_memory + staged_bytes
        if would_use > self.max_bytes and self._spiller is not None:
            would_use -= self._spiller.free(self._shards.segments, would_use - self.max_bytes)
        if would_use > self.max_bytes:
            staged = f" ({staged_bytes} reserved by staged puts)" if staged_bytes else ""
            spill = " (what is held is spilled to disk, but not all of it could be)" if self._spiller else ""
            raise StoreCapacityError(
                f"storing {incoming} bytes would use {would_use} of {self.max_bytes} bytes of memory"
                f"{staged}{spill}: clear what is done with, or start the worker with a larger"
                " --max-bytes (the TransferQueue backend's option: capacity), or with --data-dir"
                " to spill to disk"
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
        self._make_room(incoming)
        with self._lock:
            now = self._clock()
            self._stages.expire(now)  # first: this stage itself may have expired
            if self._stages.committed(stage_id) is not None:
                raise UnknownStageError(f"stage {stage_id!r} is already committed")
            if self._stages.aborted(stage_id):
                raise UnknownStageError(f"stage {stage_id!r} was aborted")
            key = StageBook.part_key(bundle, part)
            released = self._stages.replaced_bytes(stage_id, key)
            self._check_capacity(self._shards.segments.nbytes + incoming - released, incoming, now)
            if region is not None:
                self._shared.check(self._shards.segments, region.size)
            held = StagedPart(bundle, body_size or incoming, region)
            self._stages.hold(stage_id, key, held, incoming - released, now)
            self._sweeper.ensure_running()
        return bundle.shard_count(), incoming

    def commit(self, stage_id: str) -> tuple[int, int, int]:
        """Store everything staged under `stage_id` at once, as one put (one generation);
        idempotent for a while after. Returns (shards stored, bytes, generation)."""
        self._make_room()
        with self._lock:
            now = self._clock()
            self._stages.expire(now)
            done = self._stages.committed(stage_id)
            if done is None:
                done, seq = self._commit(stage_id, now)
            else:  # a retry: answered as the commit was, once its record is durable too
                seq = 0 if self._log is None else self._log.last_queued
        self._settle(seq)
        return done

    def _commit(self, stage_id: str, now: float) -> tuple[tuple[int, int, int], int]:
        """`commit` of a stage not committed yet (caller holds the lock): (result, record number)."""
        held = self._stages.parts(stage_id)
        if held is None:
            raise UnknownStageError(f"no stage {stage_id!r} (never staged, aborted or expired)")
        # Everything is checked, appends resolved and capacity measured for every part before
        # any is applied; a refused commit leaves the stage as it was (to abort or retry).
        bundles = [part.bundle for part in held]
        check_stage(bundles)
        self._shards.check_aliases(bundles)
        resolved = [self._shards.resolve_appends(bundle) for bundle in bundles]
        incoming, replaced, on_disk = self._shards.measure([bundle for bundle, _ in resolved])
        after = self._shards.segments.nbytes + incoming - replaced - self._stages.reserved(stage_id)
        self._check_capacity(after, incoming, now, on_disk)  # the stage's own reservation released
        self._writable()
        generation = self._next_generation()
        parts = self._stages.take(stage_id) or []
        bodies = [(body_size, region) for _, body_size, region in parts]
        files = [self._record_file(k, len(parts)) for k in range(len(parts))]
        stored, nbytes = self._apply_parts(resolved, bodies, generation, files)
        result = (stored, nbytes, generation)
        self._stages.record_commit(stage_id, now, result)
        return result, self._record("put", generation, bundles)

    def abort(self, stage_id: str) -> int:
        """Drop a stage; returns how many shards it held (0 if none). Idempotent. Parts of it
        that arrive afterwards (within `stage_ttl`) are refused: the client gave up on the put."""
        with self._lock:
            parts = self._stages.take(stage_id)
            self._stages.record_abort(stage_id, self._clock())
        if parts is None:
            return 0
        return sum(part.bundle.shard_count() for part in parts)

    def expire_stages(self) -> tuple[int, int]:
        """Drop every stage untouched for `stage_ttl` seconds; returns (stages, bytes released)."""
        with self._lock:
            return self._stages.expire(self._clock())

    def close(self) -> None:
        """Stop the stage sweeper for good (a server shutting down), let a compaction under way
        finish, and write what the durable log still holds; stored data stays readable."""
        self._sweeper.close()
        if self._log is not None:
            with self._compacting:
                self._closing = True
            self._log.close()

    # ------------------------------------------------------------------ fetching

    def fetch(
        self, task_ids: Sequence[str], fields: Sequence[str], generations: np.ndarray | None = None
    ) -> Bundle:
        """The product `task_ids` x `fields` as a bundle whose columns point into the segments.

        `MissingShardsError` lists every absent key; with `generations` (per task, the put the
        asker's values came from; 0: any), `ReplacedShardsError` lists values a later put
        replaced. The bytes are not copied when the rows form a few runs; scattered rows are
        gathered into one buffer per field.
        """
        return Bundle(list(task_ids), build_columns(self._pick(task_ids, fields, generations)))

    def fetch_shared(
        self,
        task_ids: Sequence[str],
        fields: Sequence[str],
        inline_below: int = 0,
        generations: np.ndarray | None = None,
    ) -> tuple[Bundle, list[SharedRegion]]:
        """`fetch` for a same-host reader: tensor columns of `inline_below` bytes or more come as
        runs in shared regions (`RawColumn.runs`; slots index the returned regions), moving a
        buffer into a region first where it is not in one yet (one copy, once per buffer).

        Smaller columns and JSON come inline, as `fetch` gives them. Holding the regions keeps
        their descriptors open. `SharedMemoryUnavailable` when a region cannot be made.
        """
        for _ in range(SHARE_ATTEMPTS):
            pending: dict[int, Buffer] = {}
            picked = self._pick(task_ids, fields, generations, inline_below, pending)
            if not pending:
                slots = RegionSlots()
                columns = build_columns(picked, slots)
                return Bundle(list(task_ids), columns), slots.regions
            self._mover.move(pending.values())
        raise SharedMemoryUnavailable("the rows kept changing while being moved into shared memory")

    def _pick(
        self,
        task_ids: Sequence[str],
        fields: Sequence[str],
        generations: np.ndarray | None = None,
        share_from: int | None = None,
        pending: dict[int, Buffer] | None = None,
    ) -> list[Picked]:
        """`columns.pick` under the lock; a fetch that finds every key touches its tasks."""
        with self._lock:
            shards = self._shards
            rows = shards.index.rows.lookup(task_ids)
            picked = pick(
                shards.index, shards.segments, task_ids, rows, fields, share_from, pending, generations
            )
            shards.touch(rows)
            if self._spiller is not None:
                self._spiller.note_fetch(shards.segments, picked)
        return picked

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
            try:
                fetched = self.fetch([task_ids[i] for i in task_rows], [field]).columns
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
            rows = self._shards.index.rows.lookup(task_ids)
            held = rows[rows >= 0]
            if len(held):
                self._writable()
            result = self._shards.delete_rows(held, self._shards.index.names())
            seq = self._record("delete", delete={"tasks": task_ids, "fields": None}) if len(held) else 0
        self._settle_delete(seq)
        return result

    def delete_product(
        self, task_ids: Iterable[str], fields: Iterable[str], generations: np.ndarray | None = None
    ) -> tuple[int, int]:
        """Delete `fields` of the given tasks (absent ones are skipped). Returns (count, bytes freed).

        With `generations` (per task, as for `fetch`), a value a later put replaced is not the
        asker's to delete: `ReplacedShardsError`, and nothing is deleted.
        """
        task_ids = list(task_ids)
        fields = list(dict.fromkeys(fields))
        with self._lock:
            rows = self._shards.index.rows.lookup(task_ids)
            self._shards.check_generations(task_ids, rows, fields, generations, "deleted")
            held = rows[rows >= 0]
            if len(held):
                self._writable()
            result = self._shards.delete_rows(held, fields)
            seq = self._record("delete", delete={"tasks": task_ids, "fields": fields}) if result[0] else 0
        self._settle_delete(seq)
        return result

    def delete_keys(self, keys: Iterable[ShardKey]) -> tuple[int, int]:
        """Delete the given shards; absent keys are skipped. Returns (count, bytes freed)."""
        by_field: dict[str, list[str]] = {}
        for task_id, field in keys:
            by_field.setdefault(field, []).append(task_id)
        with self._lock:
            self._writable()
            result = self._shards.delete_keys(by_field)
            seq = self._record("delete", delete={"keys": by_field}) if result[0] else 0
        self._settle_delete(seq)
        return result

    def delete_put(self, receipt: PutReceipt) -> tuple[int, int]:
        """Delete what one put stored, where it is still there (a later put's values under the same
        keys survive). For dropping an abandoned engine call's result. Returns (count, bytes freed)."""
        with self._lock:
            keys = self._shards.keys_of_put(receipt) if self._log is not None else {}
            if keys:
                self._writable()
            result = self._shards.delete_put(receipt)
            seq = self._record("delete", delete={"keys": keys}) if keys else 0
        self._settle_delete(seq)
        return result

    def evict_idle(self) -> tuple[int, int]:
        """Delete every task not put or fetched for `max_idle_seconds`; returns (shards, bytes).

        Staged puts are not touched (they expire by `stage_ttl`).
        """
        if self.max_idle_seconds is None:
            return 0, 0
        with self._lock:
            idle = self._shards.index.rows.idle(self._clock() - self.max_idle_seconds)
            idle_ids = self._shards.index.rows.ids[idle].tolist() if self._log is not None else []
            count, freed = self._shards.delete_rows(idle, self._shards.index.names())
            if idle_ids:  # memory goes back even when the log cannot say so (a restart brings them back)
                try:
                    self._record("delete", delete={"tasks": idle_ids, "fields": None})
                except DurableLogError as exc:
                    logger.warning(
                        "evicted %d idle task(s) the durable log cannot record: %s", len(idle_ids), exc
                    )
            self._evicted_shards += count
            self._evicted_bytes += freed
        if count:
            self._compact_if_due()
        return count, freed

    # ------------------------------------------------------------------ reporting

    def stats(self) -> StoreStats:
        with self._lock:
            segments = self._shards.segments
            return StoreStats(
                segments.shards,
                len(self._shards.index.rows),
                segments.nbytes,
                self.max_bytes,
                self._stages.staged_bytes,
                self._evicted_shards,
                self._evicted_bytes,
                self._shards.held_bytes(),
                len(segments),
                segments.shared_bytes,
                segments.shared_regions,
                segments.disk_bytes,
                segments.spilled_bytes,
                0 if self._spiller is None else self._spiller.read_back_shards,
                0 if self._spiller is None else self._spiller.read_back_bytes,
            )

    def list_tasks(
        self, after: str | None = None, limit: int = 1000
    ) -> tuple[list[tuple[str, list[str]]], int]:
        """The held tasks in id order, after `after`, at most `limit`: (task id, its fields) each,
        and how many tasks the store holds. For operators (`distbatch ls`), not the data path."""
        with self._lock:
            return self._shards.index.tasks_page(after, limit)

    def fields_of(self, task_ids: Sequence[str]) -> list[list[str]]:
        """Each named task's fields in name order; empty for a task the store does not hold.
        For operators (`distbatch show`, `clear --tasks`), not the data path."""
        with self._lock:
            return self._shards.index.fields_of(task_ids)

    def __len__(self) -> int:
        return self._shards.segments.shards
