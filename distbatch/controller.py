"""`Controller`: which samples are ready, which consumer took them, which rank gets which.

TransferQueue-style bookkeeping over metadata only. Producers `put` REMOTE
batches (their data already sits on workers); consumers ask `get_meta` for a
batch of ready, unconsumed tasks chosen by a sampler and get a REMOTE batch
back. Tasks live in partitions; each task has a per-partition index, which is
what samplers see.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distbatch.atomic import write_json_atomically
from distbatch.batch import BatchStatus, DistributedBatchMemory
from distbatch.client import DeleteResult, ShardClient, default_client, validate_node
from distbatch.errors import BatchStatusError, DistBatchError, NodeError
from distbatch.ids import ShardKey, validate_id
from distbatch.meta import BatchMeta, FieldMeta
from distbatch.samplers import BaseSampler, SequentialSampler
from distbatch.wire import ITEMSIZE

CHECKPOINT_VERSION = 1
# Keyword arguments the controller itself gives the sampler.
RESERVED_SAMPLING_KEYS = frozenset({"partition", "partition_id", "task_name"})


class SchemaConflictError(DistBatchError, ValueError):
    """A put gives a field a dtype (or kind) other than the one the partition has."""


class ClearError(DistBatchError):
    """Some shards could not be deleted (a worker down); `failed` maps node -> error.

    The controller keeps its bookkeeping for the tasks involved, so the clear
    can be retried once the worker is back; `deleted` counts what did go.
    """

    def __init__(self, failed: Mapping[str, NodeError], deleted: int, undeleted: Mapping[str, int]) -> None:
        detail = "; ".join(
            f"{node}: {undeleted[node]} shard(s) ({err.detail})" for node, err in failed.items()
        )
        super().__init__(f"could not delete shards on {len(failed)} node(s): {detail}")
        self.failed = dict(failed)
        self.deleted = deleted
        self.undeleted = dict(undeleted)


class ClearInProgressError(DistBatchError):
    """A put named tasks whose clear is under way: their shards are being deleted right now."""


@dataclass
class _Column:
    """One field of a partition: dtype, and per task index its node and shape."""

    dtype: str | None
    node: dict[int, int] = field(default_factory=dict)
    shape: dict[int, tuple[int, ...]] = field(default_factory=dict)


@dataclass
class _Partition:
    partition_id: str
    index_of: dict[str, int] = field(default_factory=dict)
    task_of: dict[int, str] = field(default_factory=dict)
    nodes: list[str] = field(default_factory=list)
    node_index: dict[str, int] = field(default_factory=dict)
    columns: dict[str, _Column] = field(default_factory=dict)
    consumed: dict[str, set[int]] = field(default_factory=dict)
    next_index: int = 0
    # Indexes whose shards a clear is deleting (count of clears in flight): never handed out.
    clearing: dict[int, int] = field(default_factory=dict)

    def intern_node(self, node: str) -> int:
        if node not in self.node_index:
            self.node_index[node] = len(self.nodes)
            self.nodes.append(node)
        return self.node_index[node]

    def allocate(self, count: int) -> int:
        """First index of a free block of `count` indexes, aligned to `count`.

        Freed indexes are reused, and a put of whole GRPO groups always lands
        on group-aligned indexes (a block of k*n starts at a multiple of n).
        """
        if len(self.task_of) < self.next_index:  # there are holes to reuse
            for start in range(0, self.next_index, count):
                if all(i not in self.task_of for i in range(start, start + count)):
                    self.next_index = max(self.next_index, start + count)
                    return start
        start = -(-self.next_index // count) * count
        self.next_index = start + count
        return start

    def ready(self, task_name: str, fields: Sequence[str]) -> list[int]:
        """Indexes that have every field produced and are not consumed by `task_name`."""
        if not fields or any(f not in self.columns for f in fields):
            return []
        columns = sorted((self.columns[f] for f in fields), key=lambda c: len(c.node))
        have = set(columns[0].node)
        for column in columns[1:]:
            have.intersection_update(column.node)
        have.difference_update(self.consumed.get(task_name, ()))
        have.difference_update(self.clearing)
        return sorted(have)

    def sample_lengths(self, indexes: Sequence[int], field: str) -> list[int]:
        """Per-sample lengths (first dimension of `field`), for length-aware samplers."""
        column = self.columns.get(field)
        if column is None or column.dtype is None:
            raise ValueError(f"partition {self.partition_id!r} has no tensor field {field!r} for lengths")
        out = []
        for i in indexes:
            shape = column.shape.get(i)
            if shape is None:
                raise ValueError(f"task index {i} has no field {field!r}")
            out.append(shape[0] if shape else 1)
        return out

    def meta_for(self, indexes: Sequence[int], fields: Sequence[str]) -> BatchMeta:
        node_map: dict[int, int] = {}
        nodes: list[str] = []
        cols: dict[str, FieldMeta] = {}
        for name in fields:
            column = self.columns[name]
            node_list = []
            for i in indexes:
                n = column.node[i]
                if n not in node_map:
                    node_map[n] = len(nodes)
                    nodes.append(self.nodes[n])
                node_list.append(node_map[n])
            cols[name] = FieldMeta(column.dtype, node_list, [column.shape[i] for i in indexes])
        return BatchMeta([self.task_of[i] for i in indexes], nodes, cols)

    def keys_by_node(self, indexes: Iterable[int]) -> dict[str, list[ShardKey]]:
        out: dict[str, list[ShardKey]] = {}
        index_set = set(indexes)
        for name, column in self.columns.items():
            for i in index_set:
                n = column.node.get(i)
                if n is not None:
                    out.setdefault(self.nodes[n], []).append(ShardKey(self.task_of[i], name))
        return out

    def drop_rows(self, node: str, keys: Iterable[ShardKey]) -> None:
        """Forget that `node` holds these shards (they were deleted) while their tasks stay."""
        n = self.node_index.get(node)
        for key in keys:
            i = self.index_of.get(key.task_id)
            column = self.columns.get(key.field)
            if i is not None and column is not None and column.node.get(i) == n:
                del column.node[i]
                column.shape.pop(i, None)

    def mark_clearing(self, indexes: Iterable[int], delta: int) -> None:
        for i in indexes:
            count = self.clearing.get(i, 0) + delta
            if count > 0:
                self.clearing[i] = count
            else:
                self.clearing.pop(i, None)

    def forget(self, indexes: Iterable[int]) -> None:
        for i in list(indexes):
            task_id = self.task_of.pop(i, None)
            if task_id is None:
                continue
            del self.index_of[task_id]
            for column in self.columns.values():
                column.node.pop(i, None)
                column.shape.pop(i, None)
            for consumed in self.consumed.values():
                consumed.discard(i)


class Controller:
    """Per-partition, per-task bookkeeping of produced fields and consumption.

    Args:
        sampler: decides which ready tasks make a batch (default `SequentialSampler`).
        client: used to delete shards on the workers (default: the process-wide one).
    """

    def __init__(self, sampler: BaseSampler | None = None, *, client: ShardClient | None = None) -> None:
        self.sampler = sampler if sampler is not None else SequentialSampler()
        self._client = client
        self._partitions: dict[str, _Partition] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._waiting = 0  # get_meta calls now waiting for producers

    @property
    def client(self) -> ShardClient:
        return self._client or default_client()

    # ------------------------------------------------------------------ producing

    def put(self, partition_id: str, batch: DistributedBatchMemory) -> int:
        """Register a REMOTE batch's tasks and fields in a partition; returns tasks added.

        Tasks already known get the new fields (a later stage's output joins
        the same rows). New tasks get one contiguous block of indexes, in batch
        order. A field whose dtype differs from the partition's raises
        `SchemaConflictError` and nothing is registered.
        """
        validate_id(partition_id, "partition_id")
        if batch.status is BatchStatus.EMPTY:
            return 0
        if batch.status is BatchStatus.LOCAL:
            raise BatchStatusError(
                "the controller holds metadata only: put a REMOTE batch (to_remote(node) a LOCAL one first)"
            )
        meta = batch.meta
        if meta is None:  # REMOTE always has meta; keeps type checkers honest
            return 0
        _check_meta(meta)
        with self._changed:
            partition = self._partitions.get(partition_id) or _Partition(partition_id)
            for name, fm in meta.fields.items():
                column = partition.columns.get(name)
                if column is not None and column.dtype != fm.dtype:
                    have, given = column.dtype or "JSON", fm.dtype or "JSON"
                    raise SchemaConflictError(
                        f"field {name!r} is {have} in partition {partition_id!r}, the put gives {given}"
                    )
            clearing = [t for t in meta.task_ids if partition.index_of.get(t) in partition.clearing]
            if clearing:
                raise ClearInProgressError(
                    f"{len(clearing)} task(s) of partition {partition_id!r} are being cleared "
                    f"(e.g. {clearing[0]!r}): put them again once clear_tasks returns"
                )
            self._partitions[partition_id] = partition
            new = [t for t in meta.task_ids if t not in partition.index_of]
            if new:
                start = partition.allocate(len(new))
                for offset, task_id in enumerate(new):
                    partition.index_of[task_id] = start + offset
                    partition.task_of[start + offset] = task_id
            rows = [partition.index_of[t] for t in meta.task_ids]
            local_nodes = [partition.intern_node(n) for n in meta.nodes]
            for name, fm in meta.fields.items():
                column = partition.columns.setdefault(name, _Column(fm.dtype))
                for row, node, shape in zip(rows, fm.nodes, fm.shapes):
                    column.node[row] = local_nodes[node]
                    column.shape[row] = shape
            self._changed.notify_all()
        return len(new)

    # ------------------------------------------------------------------ consuming

    def get_meta(
        self,
        partition_id: str,
        task_name: str,
        fields: Sequence[str],
        batch_size: int,
        *,
        timeout: float | None = None,
        **sampling_config: Any,
    ) -> DistributedBatchMemory:
        """A REMOTE batch of ready tasks not yet consumed by `task_name`, chosen by the sampler.

        Polling by default: an EMPTY batch when there is not enough. With
        `timeout` (seconds), waits up to that long for producers, without
        blocking other callers. `sampling_config` (e.g. `dp_rank`,
        `batch_index`) goes to the sampler.
        """
        validate_id(partition_id, "partition_id")
        validate_id(task_name, "task_name")
        if isinstance(fields, (str, bytes)):
            raise ValueError(f"fields must be a list of field names, not one string: {fields!r}")
        fields = [validate_id(f, "field") for f in fields]
        if not fields:
            raise ValueError("ask for at least one field")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        reserved = sorted(RESERVED_SAMPLING_KEYS.intersection(sampling_config))
        if reserved:
            raise ValueError(f"sampling config may not set {reserved}: the controller passes them itself")
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or math.isnan(timeout)
            or timeout < 0
        ):
            raise ValueError(f"timeout must be None or a non-negative number of seconds, got {timeout!r}")
        deadline = None if not timeout else time.monotonic() + timeout
        with self._changed:
            while True:
                partition = self._partitions.get(partition_id)
                if partition is not None:
                    ready = partition.ready(task_name, fields)
                    sampled, consumed = self.sampler(
                        ready,
                        batch_size,
                        partition_id=partition_id,
                        task_name=task_name,
                        partition=partition,
                        **sampling_config,
                    )
                    if sampled:
                        missing = [i for i in sampled if i not in partition.task_of]
                        if missing:
                            raise DistBatchError(f"sampler returned unknown task indexes {missing[:5]}")
                        partition.consumed.setdefault(task_name, set()).update(consumed)
                        return DistributedBatchMemory.from_meta(
                            partition.meta_for(sampled, fields), self._client
                        )
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is None or remaining <= 0:
                    return DistributedBatchMemory()
                self._waiting += 1
                try:
                    self._changed.wait(min(remaining, threading.TIMEOUT_MAX))
                finally:
                    self._waiting -= 1

    # ------------------------------------------------------------------ status

    def waiting_consumers(self) -> int:
        """How many `get_meta` calls are waiting for producers right now (a starvation gauge)."""
        with self._lock:
            return self._waiting

    def partitions(self) -> list[str]:
        with self._lock:
            return list(self._partitions)

    def production_status(self, partition_id: str, fields: Sequence[str] | None = None) -> dict[str, Any]:
        """Tasks in the partition, how many have each field, and how many have all of `fields`."""
        with self._lock:
            partition = self._partitions.get(partition_id)
            if partition is None:
                return {"tasks": 0, "produced": {}, "ready": 0}
            names = list(fields) if fields is not None else list(partition.columns)
            produced = {n: len(partition.columns[n].node) if n in partition.columns else 0 for n in names}
            ready = len(partition.ready("\0", names)) if names else 0
            return {"tasks": len(partition.task_of), "produced": produced, "ready": ready}

    def consumption_status(self, partition_id: str, task_name: str) -> dict[str, int]:
        """How many of the partition's tasks `task_name` has consumed."""
        with self._lock:
            partition = self._partitions.get(partition_id)
            if partition is None:
                return {"tasks": 0, "consumed": 0}
            consumed = partition.consumed.get(task_name, set())
            return {"tasks": len(partition.task_of), "consumed": len(consumed)}

    def all_consumed(self, partition_id: str, task_name: str) -> bool:
        status = self.consumption_status(partition_id, task_name)
        return status["tasks"] > 0 and status["consumed"] >= status["tasks"]

    def reset_consumption(self, partition_id: str, task_name: str | None = None) -> None:
        """Forget what `task_name` (or every consumer) consumed, to replay the partition."""
        with self._changed:
            partition = self._partitions.get(partition_id)
            if partition is None:
                return
            if task_name is None:
                partition.consumed.clear()
            else:
                partition.consumed.pop(task_name, None)
            self.sampler.clear_cache(partition_id)
            self._changed.notify_all()

    # ------------------------------------------------------------------ clearing

    def _delete_on_workers(self, keys_by_node: dict[str, list[ShardKey]]) -> tuple[int, dict[str, NodeError]]:
        if not keys_by_node:
            return 0, {}
        outcome = self.client.delete_each(keys_by_node)
        deleted = sum(r.deleted for r in outcome.values() if isinstance(r, DeleteResult))
        failed = {n: r for n, r in outcome.items() if isinstance(r, NodeError)}
        return deleted, failed

    def clear_tasks(self, partition_id: str, task_ids: Iterable[str]) -> int:
        """Delete these tasks' shards on the workers, then forget the tasks; returns shards deleted.

        If a worker cannot be reached, `ClearError` says which shards stayed;
        tasks whose shards all went are forgotten, the others kept for a retry.
        """
        ids = [validate_id(t, "task_id") for t in task_ids]
        with self._lock:
            partition = self._partitions.get(partition_id)
            if partition is None:
                return 0
            indexes = [partition.index_of[t] for t in ids if t in partition.index_of]
            plan = partition.keys_by_node(indexes)
            # While the deletes run (outside the lock), nobody is handed these tasks and no
            # producer adds a field to them: a new shard would outlive the forgotten task.
            partition.mark_clearing(indexes, +1)
        try:
            deleted, failed = self._delete_on_workers(plan)
        except BaseException:
            with self._changed:
                partition = self._partitions.get(partition_id)
                if partition is not None:
                    partition.mark_clearing(indexes, -1)
                self._changed.notify_all()
            raise
        with self._changed:
            partition = self._partitions.get(partition_id)
            if partition is not None:
                partition.mark_clearing(indexes, -1)
                stuck = {
                    partition.index_of[k.task_id]
                    for n in failed
                    for k in plan[n]
                    if k.task_id in partition.index_of
                }
                forgotten = [i for i in indexes if i not in stuck]
                # A kept task keeps only the shards that are still there: the deleted ones must
                # never be handed out again (they would fail every fetch).
                for node, keys in plan.items():
                    if node not in failed:
                        partition.drop_rows(node, keys)
                partition.forget(forgotten)
                _forget_in_sampler(self.sampler, partition_id, forgotten)
                self._changed.notify_all()
        if failed:
            raise ClearError(failed, deleted, {n: len(plan[n]) for n in failed})
        return deleted

    def clear_partition(self, partition_id: str) -> int:
        """Delete every shard of the partition on the workers, then drop the partition.

        Raises `ClearError` (keeping what could not be deleted) if a worker is down.
        """
        with self._lock:
            partition = self._partitions.get(partition_id)
            if partition is None:
                return 0
            task_ids = list(partition.index_of)
        deleted = self.clear_tasks(partition_id, task_ids)
        with self._changed:
            partition = self._partitions.get(partition_id)
            if partition is not None and not partition.task_of:
                del self._partitions[partition_id]
                self.sampler.clear_cache(partition_id)
        return deleted

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe snapshot: every partition's tasks, fields, consumption, and the sampler state."""
        with self._lock:
            partitions = {}
            for pid, p in self._partitions.items():
                partitions[pid] = {
                    "tasks": [[i, t] for i, t in sorted(p.task_of.items())],
                    "next_index": p.next_index,
                    "nodes": list(p.nodes),
                    "columns": {
                        name: {
                            "dtype": c.dtype,
                            "rows": [[i, c.node[i], list(c.shape[i])] for i in sorted(c.node)],
                        }
                        for name, c in p.columns.items()
                    },
                    "consumed": {name: sorted(s) for name, s in p.consumed.items()},
                }
            return {
                "version": CHECKPOINT_VERSION,
                "partitions": partitions,
                "sampler": self.sampler.state_dict(),
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace this controller's state with a `state_dict` (validated before anything changes)."""
        if not isinstance(state, Mapping) or state.get("version") != CHECKPOINT_VERSION:
            raise ValueError(f"expected a controller checkpoint of version {CHECKPOINT_VERSION}")
        partitions: dict[str, _Partition] = {}
        try:
            if not isinstance(state["partitions"], Mapping):
                raise ValueError("'partitions' must be an object")
            for pid, raw in state["partitions"].items():
                p = _Partition(validate_id(pid, "partition_id"), next_index=_count(raw["next_index"]))
                for i, t in raw["tasks"]:
                    i = _count(i)
                    if i in p.task_of or validate_id(t, "task_id") in p.index_of:
                        raise ValueError(f"task index {i} or task id {t!r} is listed twice")
                    p.task_of[i] = t
                    p.index_of[t] = i
                if p.task_of and p.next_index <= max(p.task_of):
                    raise ValueError(f"next_index {p.next_index} is not past every task index")
                for node in raw["nodes"]:
                    p.intern_node(validate_node(node))
                for name, col in raw["columns"].items():
                    dtype = col["dtype"]
                    if dtype is not None and dtype not in ITEMSIZE:
                        raise ValueError(f"field {name!r} has unknown dtype {dtype!r}")
                    column = p.columns.setdefault(validate_id(name, "field"), _Column(dtype))
                    for i, n, shape in col["rows"]:
                        if _count(i) not in p.task_of or not _count(n) < len(p.nodes):
                            raise ValueError(f"field {name!r} names unknown task index {i} or node {n}")
                        column.node[i] = n
                        column.shape[i] = tuple(_count(d) for d in shape)
                for name, indexes in raw["consumed"].items():
                    consumed = {_count(i) for i in indexes}
                    if not consumed <= p.task_of.keys():
                        raise ValueError(f"consumer {name!r} consumed unknown task indexes")
                    p.consumed[validate_id(name, "task_name")] = consumed
                partitions[pid] = p
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"invalid controller checkpoint: {exc}") from None
        with self._changed:
            self.sampler.load_state_dict(state.get("sampler", {}))
            self._partitions = partitions
            self._changed.notify_all()

    def save_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """Write `state_dict()` as JSON atomically (temp file, fsync, rename)."""
        return write_json_atomically(path, self.state_dict())

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Load a checkpoint written by `save_checkpoint`."""
        with open(path) as handle:
            self.load_state_dict(json.load(handle))


def _forget_in_sampler(sampler: BaseSampler, partition_id: str, indexes: list[int]) -> None:
    """Drop the sampler's cached results for cleared indexes (they may be reused).

    A sampler ported from TransferQueue may only have `clear_cache`; then the
    whole partition's cache goes, which is safe but may re-sample pending batches.
    """
    forget = getattr(sampler, "forget_indexes", None)
    if forget is not None:
        forget(partition_id, indexes)
    else:
        sampler.clear_cache(partition_id)


def _count(value: Any) -> int:
    """A non-negative int from a checkpoint (an index, a node number, a dimension), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a non-negative int, got {value!r}")
    return value


def _check_meta(meta: BatchMeta) -> None:
    """Refuse metadata that `BatchMeta.from_dict` would refuse (a hand-built one may be anything)."""
    for task_id in meta.task_ids:
        validate_id(task_id, "task_id")
    if len(set(meta.task_ids)) != len(meta.task_ids):
        raise ValueError("the batch lists a task id twice")
    for node in meta.nodes:
        validate_node(node)
    for name, fm in meta.fields.items():
        validate_id(name, "field")
        if fm.dtype is not None and fm.dtype not in ITEMSIZE:
            raise ValueError(f"field {name!r} has unknown dtype {fm.dtype!r}")
        if len(fm.nodes) != len(meta.task_ids) or len(fm.shapes) != len(meta.task_ids):
            raise ValueError(f"field {name!r} does not have one node and one shape per task")
        if not all(isinstance(n, int) and 0 <= n < len(meta.nodes) for n in fm.nodes):
            raise ValueError(f"field {name!r} names a node the batch does not list")
