"""The worker's shard store: thread-safe, all-or-nothing puts, a byte capacity."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from distbatch.ids import ShardKey


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

    def as_dict(self) -> dict[str, int | None]:
        return {
            "staged_bytes": self.staged_bytes,
            "shards": self.shards,
            "tasks": self.tasks,
            "bytes": self.bytes,
            "capacity": self.capacity,
            "free": None if self.capacity is None else self.capacity - self.bytes - self.staged_bytes,
        }


class ShardStore:
    """Shards keyed by task id then field; every public method is atomic."""

    def __init__(self, max_bytes: int | None = None, stage_ttl: float = 600.0) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self.stage_ttl = stage_ttl
        self._tasks: dict[str, dict[str, StoredShard]] = {}
        self._shard_count = 0
        self._bytes = 0
        # Puts split over several requests are staged, then committed at once.
        # Staged bytes count against capacity so that a commit cannot overflow.
        self._stages: dict[str, tuple[float, dict[ShardKey, StoredShard]]] = {}
        self._staged_bytes = 0
        self._committed: dict[str, tuple[float, tuple[int, int]]] = {}
        self._lock = threading.Lock()

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
            self._check_capacity(after + self._staged_bytes, incoming)
            self._apply(shards, after, new_keys)
        return len(shards), incoming

    def _check_capacity(self, would_use: int, incoming: int) -> None:
        if self.max_bytes is not None and would_use > self.max_bytes:
            raise StoreCapacityError(
                f"storing {incoming} bytes would use {would_use} of {self.max_bytes} bytes"
            )

    def _apply(self, shards: Mapping[ShardKey, StoredShard], after: int, new_keys: int) -> None:
        for (task_id, field), shard in shards.items():
            self._tasks.setdefault(task_id, {})[field] = shard
        self._bytes = after
        self._shard_count += new_keys

    def _expire_stages(self, now: float) -> None:
        for stage_id, (touched, shards) in list(self._stages.items()):
            if now - touched > self.stage_ttl:
                del self._stages[stage_id]
                self._staged_bytes -= sum(s.nbytes for s in shards.values())
        for stage_id, (done, _) in list(self._committed.items()):
            if now - done > self.stage_ttl:
                del self._committed[stage_id]

    def stage(self, stage_id: str, shards: Mapping[ShardKey, StoredShard]) -> tuple[int, int]:
        """Hold shards under `stage_id` until `commit`; invisible to fetches until then.

        Re-staging a key replaces it (retries are safe). Staged bytes are
        reserved against capacity. Stages untouched for `stage_ttl` seconds
        are dropped.
        """
        incoming = sum(s.nbytes for s in shards.values())
        with self._lock:
            now = time.monotonic()
            self._expire_stages(now)
            if stage_id in self._committed:
                raise UnknownStageError(f"stage {stage_id!r} is already committed")
            _, staged = self._stages.get(stage_id, (now, {}))
            released = sum(staged[k].nbytes for k in shards if k in staged)
            self._check_capacity(self._bytes + self._staged_bytes + incoming - released, incoming)
            staged.update(shards)
            self._stages[stage_id] = (now, staged)
            self._staged_bytes += incoming - released
        return len(shards), incoming

    def commit(self, stage_id: str) -> tuple[int, int]:
        """Store everything staged under `stage_id` at once; idempotent for a while after."""
        with self._lock:
            now = time.monotonic()
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
        with self._lock:
            for key in keys:
                shard = self._tasks.get(key[0], {}).get(key[1])
                if shard is None:
                    missing.append(key)
                else:
                    found.append(shard)
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
            self._account_deleted(count, freed)
        return count, freed

    def _account_deleted(self, count: int, freed: int) -> None:
        self._shard_count -= count
        self._bytes -= freed

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                self._shard_count, len(self._tasks), self._bytes, self.max_bytes, self._staged_bytes
            )

    def __len__(self) -> int:
        return self._shard_count
