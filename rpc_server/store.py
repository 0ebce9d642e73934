"""The worker's shard store: thread-safe, all-or-nothing puts, a byte capacity."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from distbatch.ids import ShardKey

logger = logging.getLogger("rpc_server")


class StoredShard(NamedTuple):
    """One shard in wire form, so serving it needs no (de)serialisation.

    `dtype` is the safetensors dtype name for a tensor, or None for a JSON value,
    whose UTF-8 JSON text is then `data`. (A NamedTuple: one is built per shard.)
    """

    dtype: str | None
    shape: tuple[int, ...]
    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)


class StoreCapacityError(Exception):
    """The put would exceed the store's capacity; nothing was stored."""


class UnknownStageError(Exception):
    """A commit or abort named a stage that does not exist (never staged, or expired)."""


class MissingShardsError(Exception):
    """Some requested keys are not stored."""

    def __init__(self, keys: list[ShardKey]) -> None:
        super().__init__(f"{len(keys)} shard(s) not found")
        self.keys = keys


@dataclass(frozen=True, slots=True)
class StoreStats:
    shards: int
    tasks: int
    bytes: int
    capacity: int | None
    staged_bytes: int = 0
    evicted_shards: int = 0
    evicted_bytes: int = 0

    def as_dict(self) -> dict[str, int | None]:
        return {
            "staged_bytes": self.staged_bytes,
            "evicted_shards": self.evicted_shards,
            "evicted_bytes": self.evicted_bytes,
            "shards": self.shards,
            "tasks": self.tasks,
            "bytes": self.bytes,
            "capacity": self.capacity,
            "free": None if self.capacity is None else self.capacity - self.bytes - self.staged_bytes,
        }


class ShardStore:
    """Shards keyed by task id then field; every public method is atomic.

    With `max_idle_seconds`, the store remembers when each task was last put or
    fetched (per task, oldest first) so that `evict_idle` can drop tasks nobody
    touched for that long; without it, nothing is tracked and nothing is evicted.

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
        self._clock = clock  # for last-access times and stage expiry (tests pass a fake one)
        # task id -> clock() of its last put or fetch, least recent first.
        self._last_access: OrderedDict[str, float] | None = OrderedDict() if max_idle_seconds else None
        self._evicted_shards = 0
        self._evicted_bytes = 0
        self._tasks: dict[str, dict[str, StoredShard]] = {}
        self._shard_count = 0
        self._bytes = 0
        # Puts split over several requests are staged, then committed at once.
        # Staged bytes count against capacity so that a commit cannot overflow.
        self._stages: dict[str, tuple[float, dict[ShardKey, StoredShard]]] = {}
        self._staged_bytes = 0
        self._committed: dict[str, tuple[float, tuple[int, int]]] = {}
        self._lock = threading.Lock()
        # Runs only while stages exist (started by `stage`, exits when none are left).
        self._stage_sweeper: threading.Thread | None = None
        self._closed = threading.Event()

    def put(self, shards: Mapping[ShardKey, StoredShard]) -> tuple[int, int]:
        """Store every shard or none; an existing key is replaced (puts are idempotent).

        Returns (shards stored, bytes stored). Raises `StoreCapacityError`
        when the store would grow past its capacity.
        """
        incoming = sum(s.nbytes for s in shards.values())
        with self._lock:
            replaced = 0
            new_keys = 0
            for task_id, field in shards:
                old = self._tasks.get(task_id, {}).get(field)
                if old is None:
                    new_keys += 1
                else:
                    replaced += old.nbytes
            after = self._bytes + incoming - replaced
            self._check_capacity(after, incoming)
            self._apply(shards, after, new_keys)
        return len(shards), incoming

    def _check_capacity(self, stored_after: int, incoming: int, now: float | None = None) -> None:
        """Raise `StoreCapacityError` unless `stored_after` plus staged bytes fits (caller holds the lock).

        Before refusing, drop stages expired at `now` (default: the clock): their reservations
        must not refuse a put. `stage()` passes the time it already expired stages at, so a
        stage it is extending cannot expire between its accounting and the check.
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

    def _apply(self, shards: Mapping[ShardKey, StoredShard], after: int, new_keys: int) -> None:
        for (task_id, field), shard in shards.items():
            self._tasks.setdefault(task_id, {})[field] = shard
        self._bytes = after
        self._shard_count += new_keys
        if self._last_access is not None:
            self._touch({task_id for task_id, _ in shards})

    def _touch(self, task_ids: Iterable[str]) -> None:
        """Mark tasks as used now (caller holds the lock; only when tracking is on)."""
        last_access = self._last_access
        if last_access is None:  # idle tracking is off
            return
        now = self._clock()
        for task_id in task_ids:
            last_access[task_id] = now
            last_access.move_to_end(task_id)

    def _forget(self, task_id: str) -> None:
        if self._last_access is not None:
            self._last_access.pop(task_id, None)

    def evict_idle(self) -> tuple[int, int]:
        """Delete every task not put or fetched for `max_idle_seconds`; returns (shards, bytes).

        Staged puts are not touched (they expire by `stage_ttl`).
        """
        if self._last_access is None or self.max_idle_seconds is None:
            return 0, 0
        count = freed = 0
        with self._lock:
            cutoff = self._clock() - self.max_idle_seconds
            last_access = self._last_access
            while last_access:
                task_id, touched = next(iter(last_access.items()))
                if touched > cutoff:
                    break  # oldest first: everything after this is fresher
                del last_access[task_id]
                fields = self._tasks.pop(task_id, None)
                if fields:
                    count += len(fields)
                    freed += sum(s.nbytes for s in fields.values())
            self._account_deleted(count, freed)
            self._evicted_shards += count
            self._evicted_bytes += freed
        return count, freed

    def _expire_stages(self, now: float) -> tuple[int, int]:
        """Drop stages untouched for `stage_ttl` (caller holds the lock); returns (stages, bytes) dropped."""
        dropped = released = 0
        for stage_id, (touched, shards) in list(self._stages.items()):
            if now - touched > self.stage_ttl:
                del self._stages[stage_id]
                nbytes = sum(s.nbytes for s in shards.values())
                self._staged_bytes -= nbytes
                dropped += 1
                released += nbytes
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
        """Drop every stage untouched for `stage_ttl` seconds; returns (stages, bytes released).

        Each drop is logged as a WARNING (a client died mid-put, or stalled longer than the TTL).
        """
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

    def stage(self, stage_id: str, shards: Mapping[ShardKey, StoredShard]) -> tuple[int, int]:
        """Hold shards under `stage_id` until `commit`; invisible to fetches until then.

        Re-staging a key replaces it (retries are safe). Staged bytes are
        reserved against capacity. Stages untouched for `stage_ttl` seconds
        are dropped (see the class docstring).
        """
        incoming = sum(s.nbytes for s in shards.values())
        with self._lock:
            now = self._clock()
            self._expire_stages(now)  # first: this stage itself may have expired
            if stage_id in self._committed:
                raise UnknownStageError(f"stage {stage_id!r} is already committed")
            _, staged = self._stages.get(stage_id, (now, {}))
            released = sum(staged[k].nbytes for k in shards if k in staged)
            self._check_capacity(self._bytes + incoming - released, incoming, now)
            staged.update(shards)
            self._stages[stage_id] = (now, staged)
            self._staged_bytes += incoming - released
            self._start_stage_sweeper()
        return len(shards), incoming

    def commit(self, stage_id: str) -> tuple[int, int]:
        """Store everything staged under `stage_id` at once; idempotent for a while after."""
        with self._lock:
            now = self._clock()
            self._expire_stages(now)
            if stage_id in self._committed:
                return self._committed[stage_id][1]
            if stage_id not in self._stages:
                raise UnknownStageError(f"no stage {stage_id!r} (never staged, aborted or expired)")
            _, staged = self._stages.pop(stage_id)
            incoming = sum(s.nbytes for s in staged.values())
            self._staged_bytes -= incoming
            replaced = new_keys = 0
            for task_id, field in staged:
                old = self._tasks.get(task_id, {}).get(field)
                if old is None:
                    new_keys += 1
                else:
                    replaced += old.nbytes
            # Capacity was reserved when staging, and replacing only frees bytes.
            self._apply(staged, self._bytes + incoming - replaced, new_keys)
            result = (len(staged), incoming)
            self._committed[stage_id] = (now, result)
        return result

    def abort(self, stage_id: str) -> int:
        """Drop a stage; returns how many shards it held (0 if none). Idempotent."""
        with self._lock:
            _, staged = self._stages.pop(stage_id, (0.0, {}))
            self._staged_bytes -= sum(s.nbytes for s in staged.values())
        return len(staged)

    def get(self, keys: Iterable[ShardKey]) -> list[StoredShard]:
        """The shards for `keys`, in order; `MissingShardsError` lists any absent."""
        found: list[StoredShard] = []
        missing: list[ShardKey] = []
        keys = keys if isinstance(keys, (list, tuple)) else list(keys)
        with self._lock:
            for key in keys:
                shard = self._tasks.get(key[0], {}).get(key[1])
                if shard is None:
                    missing.append(key)
                else:
                    found.append(shard)
            if self._last_access is not None and not missing:
                self._touch({key[0] for key in keys})
        if missing:
            raise MissingShardsError(missing)
        return found

    def delete_keys(self, keys: Iterable[ShardKey]) -> tuple[int, int]:
        """Delete the given shards; absent keys are skipped. Returns (count, bytes freed)."""
        count = freed = 0
        with self._lock:
            for task_id, field in keys:
                fields = self._tasks.get(task_id)
                if fields is None or field not in fields:
                    continue
                freed += fields.pop(field).nbytes
                count += 1
                if not fields:
                    del self._tasks[task_id]
                    self._forget(task_id)
            self._account_deleted(count, freed)
        return count, freed

    def delete_if_same(self, shards: Mapping[ShardKey, StoredShard]) -> tuple[int, int]:
        """Delete each key only while it still holds that very shard object (identity).

        For dropping what one put stored (an abandoned engine call) without touching a
        later put's shards under the same keys. Returns (count, bytes freed).
        """
        count = freed = 0
        with self._lock:
            tasks = self._tasks
            for (task_id, field), shard in shards.items():
                fields = tasks.get(task_id)
                if fields is None or fields.get(field) is not shard:
                    continue
                del fields[field]
                freed += shard.nbytes
                count += 1
                if not fields:
                    del tasks[task_id]
                    self._forget(task_id)
            self._account_deleted(count, freed)
        return count, freed

    def delete_tasks(self, task_ids: Iterable[str]) -> tuple[int, int]:
        """Delete every field of the given tasks. Returns (count, bytes freed)."""
        count = freed = 0
        with self._lock:
            for task_id in task_ids:
                fields = self._tasks.pop(task_id, None)
                if fields:
                    count += len(fields)
                    freed += sum(s.nbytes for s in fields.values())
                    self._forget(task_id)
            self._account_deleted(count, freed)
        return count, freed

    def _account_deleted(self, count: int, freed: int) -> None:
        self._shard_count -= count
        self._bytes -= freed

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                self._shard_count,
                len(self._tasks),
                self._bytes,
                self.max_bytes,
                self._staged_bytes,
                self._evicted_shards,
                self._evicted_bytes,
            )

    def __len__(self) -> int:
        return self._shard_count


class IdleSweeper:
    """A daemon thread that calls `store.evict_idle()` every `interval` seconds until `stop()`.

    For controllers that crash (or forget) and never clear: their shards would
    otherwise hold the worker's memory forever. Each sweep that evicts logs a WARNING.
    """

    def __init__(self, store: ShardStore, interval: float | None = None) -> None:
        if store.max_idle_seconds is None:
            raise ValueError("the store has no max_idle_seconds: nothing to sweep")
        self.store = store
        self.interval = interval if interval is not None else min(max(store.max_idle_seconds / 4, 0.05), 10.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="idle-sweeper", daemon=True)

    def start(self) -> IdleSweeper:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sweep()

    def sweep(self) -> tuple[int, int]:
        count, freed = self.store.evict_idle()
        if count:
            logger.warning(
                "evicted %d shard(s), %d bytes idle for over %gs (for crashed controllers that never clear)",
                count,
                freed,
                self.store.max_idle_seconds,
            )
        return count, freed

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
