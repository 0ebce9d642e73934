"""`Controller`: which samples are ready, which consumer took them, which rank gets which.

TransferQueue-style bookkeeping over metadata only. Producers `put` REMOTE
batches (their data already sits on workers); consumers ask `get_meta` for a
batch of ready, unconsumed tasks chosen by a sampler and get a REMOTE batch
back. Tasks live in partitions; each task has a per-partition index, which is
what samplers see.

**Mistakes fail at once.** `get_meta` for a partition the controller does not
have raises `UnknownPartitionError` (naming the partitions it has) unless the
call waits (``timeout > 0``): a consumer may start before its producer. A field
nobody has put into the partition, nor declared with `create_partition`, can
never become ready: `UnknownFieldError` at once, waiting or not.

**Delivery is at-least-once.** A `get_meta` that hands out tasks marks them
consumed. A caller that may lose the answer (a dropped reply, a failed fetch)
passes a ``request_id``: the controller remembers recent answers (bounded by
count and age) and answers the same id again with the same tasks instead of
consuming new ones.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from distbatch.atomic import write_json_atomically
from distbatch.batch.memory import BatchStatus, DistributedBatchMemory
from distbatch.batch.meta import BatchMeta, FieldMeta
from distbatch.client.shard_client import DeleteResult, ShardClient, default_client
from distbatch.errors import (
    BatchStatusError,
    ClearError,
    ClearInProgressError,
    DistBatchError,
    InvalidArgumentError,
    NodeError,
    SchemaConflictError,
    UnknownFieldError,
    UnknownPartitionError,
)
from distbatch.ids import ShardKey, validate_id, validate_node
from distbatch.samplers import BaseSampler, GRPOGroupNSampler, RankAwareSampler, SequentialSampler
from distbatch.wire.container import ITEMSIZE

CHECKPOINT_VERSION = 1
# Keyword arguments the controller itself gives the sampler.
RESERVED_SAMPLING_KEYS = frozenset({"partition", "partition_id", "task_name"})
# Per-task custom metadata (`Controller.set_custom_meta`): JSON bytes allowed per task.
MAX_CUSTOM_META_BYTES = 64 << 10
# Answers remembered per request id (see `Controller`): how many, and for how long.
DEFAULT_REQUEST_MEMORY = 4096
DEFAULT_REQUEST_TTL = 600.0


@dataclass
class _Column:
    """One field of a partition: dtype, and per task index its node and shape."""

    dtype: str | None
    node: dict[int, int] = field(default_factory=dict)
    shape: dict[int, tuple[int, ...]] = field(default_factory=dict)


@dataclass
class _Answer:
    """What one `get_meta` request id was answered: the request, the tasks handed out, when."""

    request: tuple[Any, ...]
    partition_id: str
    task_ids: list[str]
    at: float


@dataclass
class Partition:
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
    # Fields declared with create_partition: a consumer may wait for them before any put.
    expected: set[str] = field(default_factory=set)
    # Per-task JSON objects set with Controller.set_custom_meta (TransferQueue's custom_meta).
    custom_meta: dict[int, dict[str, Any]] = field(default_factory=dict)

    def knows(self, name: str) -> bool:
        """Whether `name` was ever put into this partition or declared for it."""
        return name in self.columns or name in self.expected

    def known_fields(self) -> list[str]:
        return list(self.columns) + sorted(self.expected.difference(self.columns))

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
            raise InvalidArgumentError(
                f"partition {self.partition_id!r} has no tensor field {field!r} for lengths"
            )
        out = []
        for i in indexes:
            shape = column.shape.get(i)
            if shape is None:
                raise InvalidArgumentError(
                    f"task {self.task_of.get(i, i)!r} has no field {field!r} for lengths"
                )
            out.append(shape[0] if shape else 1)
        return out

    def get_custom_meta(self, indexes: Sequence[int]) -> dict[int, dict[str, Any]]:
        """Custom metadata of those `indexes` that have some, by index (TransferQueue's
        ``DataPartitionStatus.get_custom_meta``, which samplers such as
        `SeqlenBalancedSampler` read ``total_lengths`` from)."""
        return {i: self.custom_meta[i] for i in indexes if i in self.custom_meta}

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
            self.custom_meta.pop(i, None)
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
        request_memory: how many `get_meta` answers to remember by request id (the
            oldest are forgotten first); a retry of a forgotten one consumes new tasks.
        request_ttl: seconds an answer is remembered.
    """

    process_local = True
    """This object is the controller: a copy in another process would be a different one."""

    def __init__(
        self,
        sampler: BaseSampler | None = None,
        *,
        client: ShardClient | None = None,
        request_memory: int = DEFAULT_REQUEST_MEMORY,
        request_ttl: float = DEFAULT_REQUEST_TTL,
    ) -> None:
        if isinstance(request_memory, bool) or not isinstance(request_memory, int) or request_memory < 0:
            raise InvalidArgumentError(f"request_memory must be an int >= 0, got {request_memory!r}")
        if (
            isinstance(request_ttl, bool)
            or not isinstance(request_ttl, (int, float))
            or not request_ttl >= 0  # NaN too
        ):
            raise InvalidArgumentError(f"request_ttl must be a number of seconds >= 0, got {request_ttl!r}")
        self.sampler = sampler if sampler is not None else SequentialSampler()
        self._client = client
        self._partitions: dict[str, Partition] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._waiting = 0  # get_meta calls now waiting for producers
        self._request_memory = request_memory
        self._request_ttl = float(request_ttl)
        self._answers: OrderedDict[str, _Answer] = OrderedDict()  # by request id, oldest first

    @property
    def client(self) -> ShardClient:
        return self._client or default_client()

    # ------------------------------------------------------------------ producing

    def create_partition(self, partition_id: str, expected_fields: Iterable[str] = ()) -> None:
        """Create the partition now (if new) and declare fields it will get; idempotent.

        A consumer may then ask for it, and for the declared fields, before the
        first put, and wait instead of getting `UnknownPartitionError` /
        `UnknownFieldError`. Use it when stages put their fields at different
        times (prompts first, responses later). Declared fields add up.
        """
        validate_id(partition_id, "partition_id")
        names = _id_list(expected_fields, "expected_fields", "field")
        with self._changed:
            partition = self._partitions.setdefault(partition_id, Partition(partition_id))
            partition.expected.update(names)
            self._changed.notify_all()

    def put(self, partition_id: str, batch: DistributedBatchMemory) -> int:
        """Register a REMOTE batch's tasks and fields in a partition; returns tasks added.

        Tasks already known get the new fields (a later stage's output joins
        the same rows). New tasks get one contiguous block of indexes, in batch
        order. A field whose dtype differs from the partition's raises
        `SchemaConflictError` and nothing is registered. With a GRPO group
        sampler (`GRPOGroupNSampler`, `SeqlenBalancedSampler`, or one wrapped by
        `RankAwareSampler`), a put must add whole groups: a number of new tasks
        that is not a multiple of ``n_samples_per_prompt`` could never be
        served and raises `InvalidArgumentError`, registering nothing.
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
            partition = self._partitions.get(partition_id) or Partition(partition_id)
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
            new = [t for t in meta.task_ids if t not in partition.index_of]
            n = _group_size(self.sampler)
            if len(new) % n:
                raise InvalidArgumentError(
                    f"the put adds {len(new)} new task(s) to partition {partition_id!r}, not whole groups "
                    f"of n_samples_per_prompt={n}: put each prompt's {n} responses together (groups "
                    "are aligned blocks of indexes, so a partial group could never be completed)"
                )
            self._partitions[partition_id] = partition
            if new:
                start = partition.allocate(len(new))
                for offset, task_id in enumerate(new):
                    partition.index_of[task_id] = start + offset
                    partition.task_of[start + offset] = task_id
            rows = [partition.index_of[t] for t in meta.task_ids]
            local_nodes = [partition.intern_node(n) for n in meta.nodes]
            for name, fm in meta.fields.items():
                column = partition.columns.setdefault(name, _Column(fm.dtype))
                for row, node, shape in zip(rows, fm.nodes.tolist(), fm.shapes.tolist()):
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
        request_id: str | None = None,
        **sampling_config: Any,
    ) -> DistributedBatchMemory:
        """A REMOTE batch of ready tasks not yet consumed by `task_name`, chosen by the sampler.

        Polling by default: an EMPTY batch when there is not enough. With
        `timeout` (seconds), waits up to that long for producers, without
        blocking other callers, also for the partition itself to appear.
        `sampling_config` (e.g. `dp_rank`, `batch_index`) goes to the sampler.

        `request_id`: the same id asked again (a retry after a lost reply or a
        failed fetch) gets the same tasks, from memory, instead of new ones;
        reusing an id for another request is an `InvalidArgumentError`.

        Raises `UnknownPartitionError` for a partition the controller does not
        have (when not waiting), `UnknownFieldError` for a field the partition
        has never had nor declared, `InvalidArgumentError` for bad arguments.
        """
        validate_id(partition_id, "partition_id")
        validate_id(task_name, "task_name")
        fields = _id_list(fields, "fields", "field")
        if not fields:
            raise InvalidArgumentError("ask for at least one field")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise InvalidArgumentError(f"batch_size must be a positive int, got {batch_size!r}")
        reserved = sorted(RESERVED_SAMPLING_KEYS.intersection(sampling_config))
        if reserved:
            raise InvalidArgumentError(
                f"sampling config may not set {reserved}: the controller passes them itself"
            )
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or math.isnan(timeout)
            or timeout < 0
        ):
            raise InvalidArgumentError(
                f"timeout must be None or a non-negative number of seconds, got {timeout!r}"
            )
        if request_id is not None:
            validate_id(request_id, "request_id")
        request = (partition_id, task_name, tuple(fields), batch_size, sampling_config)
        deadline = None if not timeout else time.monotonic() + timeout
        with self._changed:
            while True:
                if request_id is not None:
                    again = self._recall_answer(request_id, request)
                    if again is not None:
                        return again
                partition = self._partitions.get(partition_id)
                if partition is None and deadline is None:
                    raise UnknownPartitionError(partition_id, self._partitions)
                if partition is not None:
                    unknown = [f for f in fields if not partition.knows(f)]
                    if unknown:
                        raise UnknownFieldError(partition_id, unknown, partition.known_fields())
                    ready = partition.ready(task_name, fields)
                    # As TransferQueue's controller does, a sampler is called only when the ready
                    # list holds a batch, or when it can answer this rank from its cache; else its
                    # check_call (if it has one) refuses bad arguments at once.
                    call = {
                        "partition_id": partition_id,
                        "task_name": task_name,
                        "partition": partition,
                        **sampling_config,
                    }
                    if len(ready) >= batch_size or _has_cached_result(
                        self.sampler, partition_id, task_name, sampling_config
                    ):
                        sampled, consumed = self.sampler(ready, batch_size, **call)
                    else:
                        check_call = getattr(self.sampler, "check_call", None)
                        if callable(check_call):
                            check_call(batch_size, **call)
                        sampled, consumed = [], []
                    if sampled:
                        missing = [i for i in sampled if i not in partition.task_of]
                        if missing:
                            raise DistBatchError(f"sampler returned unknown task indexes {missing[:5]}")
                        meta = partition.meta_for(sampled, fields)
                        partition.consumed.setdefault(task_name, set()).update(consumed)
                        if request_id is not None:
                            self._remember_answer(request_id, request, partition_id, meta.task_ids)
                        return DistributedBatchMemory.from_meta(meta, self._client)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is None or remaining <= 0:
                    return DistributedBatchMemory()
                self._waiting += 1
                try:
                    self._changed.wait(min(remaining, threading.TIMEOUT_MAX))
                finally:
                    self._waiting -= 1

    def _recall_answer(self, request_id: str, request: tuple[Any, ...]) -> DistributedBatchMemory | None:
        """The batch `request_id` was answered with, rebuilt (None if forgotten or its tasks are gone)."""
        self._expire_answers()
        answer = self._answers.get(request_id)
        if answer is None:
            return None
        if answer.request != request:
            raise InvalidArgumentError(
                f"request_id {request_id!r} was already used for another get_meta request "
                "(another partition, task, fields, batch size or sampling config): use a new id per request"
            )
        fields = request[2]
        partition = self._partitions.get(answer.partition_id)
        rows = _rows_with(partition, answer.task_ids, fields) if partition is not None else None
        if partition is None or rows is None:
            del self._answers[request_id]  # cleared since: nothing of it can be delivered any more
            return None
        return DistributedBatchMemory.from_meta(partition.meta_for(rows, fields), self._client)

    def _remember_answer(
        self, request_id: str, request: tuple[Any, ...], partition_id: str, task_ids: list[str]
    ) -> None:
        if self._request_memory == 0:
            return
        self._answers[request_id] = _Answer(request, partition_id, list(task_ids), time.monotonic())
        self._answers.move_to_end(request_id)
        while len(self._answers) > self._request_memory:
            self._answers.popitem(last=False)

    def _expire_answers(self) -> None:
        limit = time.monotonic() - self._request_ttl
        while self._answers:
            oldest = next(iter(self._answers.values()))
            if oldest.at >= limit:
                break
            self._answers.popitem(last=False)

    def _forget_answers(self, partition_id: str, task_ids: Iterable[str] | None = None) -> None:
        """Drop remembered answers of the partition (those naming any of `task_ids`, if given)."""
        gone = None if task_ids is None else set(task_ids)
        for request_id, answer in list(self._answers.items()):
            if answer.partition_id == partition_id and (gone is None or gone.intersection(answer.task_ids)):
                del self._answers[request_id]

    # ------------------------------------------------------------------ status

    def waiting_consumers(self) -> int:
        """How many `get_meta` calls are waiting for producers right now (a starvation gauge)."""
        with self._lock:
            return self._waiting

    def partitions(self) -> list[str]:
        with self._lock:
            return list(self._partitions)

    def production_status(self, partition_id: str, fields: Sequence[str] | None = None) -> dict[str, Any]:
        """Tasks in the partition, how many have each field, and how many have all of `fields`.

        A status query never raises for an unknown partition: it reports zero tasks.
        """
        validate_id(partition_id, "partition_id")
        if fields is not None:
            fields = _id_list(fields, "fields", "field")
        with self._lock:
            partition = self._partitions.get(partition_id)
            if partition is None:
                return {"tasks": 0, "produced": {}, "ready": 0}
            names = list(fields) if fields is not None else partition.known_fields()
            produced = {n: len(partition.columns[n].node) if n in partition.columns else 0 for n in names}
            ready = len(partition.ready("\0", names)) if names else 0
            return {"tasks": len(partition.task_of), "produced": produced, "ready": ready}

    def set_custom_meta(self, partition_id: str, custom_meta: Mapping[str, Mapping[str, Any]]) -> None:
        """Attach a JSON object to each named task (replacing what it had), as TransferQueue's
        ``set_custom_meta`` does; samplers read it through ``partition.get_custom_meta``.

        ``{"total_lengths": n}`` is what `SeqlenBalancedSampler` balances on. Keys
        are task ids of the partition; each object is at most 64 KiB of JSON and
        goes into checkpoints; ``total_lengths``, when present, must be a
        non-negative int. An unknown task or a bad object is an
        `InvalidArgumentError` (a bad task id an `InvalidIdError`), and then
        nothing is set. Clearing a task drops it.
        """
        validate_id(partition_id, "partition_id")
        if not isinstance(custom_meta, Mapping):
            raise InvalidArgumentError(f"custom_meta must map task ids to objects, got {type(custom_meta)}")
        checked = {validate_id(t, "task_id"): _custom_meta_object(meta, t) for t, meta in custom_meta.items()}
        with self._lock:
            partition = self._partitions.get(partition_id)
            if partition is None:
                raise UnknownPartitionError(partition_id, self._partitions)
            unknown = [t for t in checked if t not in partition.index_of]
            if unknown:
                raise InvalidArgumentError(f"partition {partition_id!r} has no tasks {unknown[:5]}")
            for task_id, meta in checked.items():
                partition.custom_meta[partition.index_of[task_id]] = meta

    def get_custom_meta(self, partition_id: str, task_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The custom metadata of those `task_ids` that have some, by task id."""
        validate_id(partition_id, "partition_id")
        wanted = _id_list(task_ids, "task_ids", "task_id")
        with self._lock:
            partition = self._partitions.get(partition_id)
            if partition is None:
                return {}
            out = {}
            for task_id in wanted:
                i = partition.index_of.get(task_id)
                if i is not None and i in partition.custom_meta:
                    out[task_id] = json.loads(json.dumps(partition.custom_meta[i]))  # a copy
            return out

    def consumption_status(self, partition_id: str, task_name: str) -> dict[str, int]:
        """How many of the partition's tasks `task_name` has consumed."""
        validate_id(partition_id, "partition_id")
        validate_id(task_name, "task_name")
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
        validate_id(partition_id, "partition_id")
        if task_name is not None:
            validate_id(task_name, "task_name")
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

    def _delete_on_workers(
        self, keys_by_node: dict[str, list[ShardKey]]
    ) -> tuple[dict[str, int], dict[str, NodeError]]:
        """Shards deleted per node that answered, and the error of each node that did not."""
        if not keys_by_node:
            return {}, {}
        outcome = self.client.delete_each(keys_by_node)
        deleted = {n: r.deleted for n, r in outcome.items() if isinstance(r, DeleteResult)}
        failed = {n: r for n, r in outcome.items() if isinstance(r, NodeError)}
        return deleted, failed

    def clear_tasks(self, partition_id: str, task_ids: Iterable[str]) -> int:
        """Delete these tasks' shards on the workers, then forget the tasks; returns shards deleted.

        If a worker cannot be reached, `ClearError` says which shards stayed;
        tasks whose shards all went are forgotten, the others kept for a retry.
        """
        validate_id(partition_id, "partition_id")
        ids = _id_list(task_ids, "task_ids", "task_id")
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
            deleted_by_node, failed = self._delete_on_workers(plan)
            deleted = sum(deleted_by_node.values())
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
                self._forget_answers(
                    partition_id, [partition.task_of[i] for i in forgotten if i in partition.task_of]
                )
                partition.forget(forgotten)
                _forget_in_sampler(self.sampler, partition_id, forgotten)
                self._changed.notify_all()
        if failed:
            raise ClearError(failed, deleted, {n: len(plan[n]) for n in failed}, deleted_by_node)
        return deleted

    def clear_partition(self, partition_id: str) -> int:
        """Delete every shard of the partition on the workers, then drop the partition.

        Raises `ClearError` (keeping what could not be deleted) if a worker is down.
        """
        validate_id(partition_id, "partition_id")
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
                self._forget_answers(partition_id)
        return deleted

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe snapshot: every partition's tasks, fields, consumption, and the sampler state."""
        sampler_state = getattr(self.sampler, "state_dict", None)
        if not callable(sampler_state):
            raise InvalidArgumentError(
                f"the sampler {type(self.sampler).__name__} has no state_dict(), so its cache cannot be "
                "checkpointed: subclass distbatch.samplers.BaseSampler (TransferQueue's own classes cannot)"
            )
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
                    "expected_fields": sorted(p.expected),
                    "custom_meta": [[i, meta] for i, meta in sorted(p.custom_meta.items())],
                }
            return {
                "version": CHECKPOINT_VERSION,
                "partitions": partitions,
                "sampler": sampler_state(),
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace this controller's state with a `state_dict` (validated before anything changes).

        Remembered `get_meta` answers are not part of a checkpoint: they are forgotten.
        """
        if not isinstance(state, Mapping) or state.get("version") != CHECKPOINT_VERSION:
            raise InvalidArgumentError(f"expected a controller checkpoint of version {CHECKPOINT_VERSION}")
        partitions: dict[str, Partition] = {}
        try:
            if not isinstance(state["partitions"], Mapping):
                raise ValueError("'partitions' must be an object")
            for pid, raw in state["partitions"].items():
                p = Partition(validate_id(pid, "partition_id"), next_index=_count(raw["next_index"]))
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
                expected = raw.get("expected_fields", [])
                if not isinstance(expected, list):
                    raise ValueError("'expected_fields' must be a list")
                p.expected = {validate_id(f, "field") for f in expected}
                for i, meta in raw.get("custom_meta", []):
                    if _count(i) not in p.task_of:
                        raise ValueError(f"custom_meta names unknown task index {i}")
                    p.custom_meta[i] = _custom_meta_object(meta, p.task_of[i])
                partitions[pid] = p
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"invalid controller checkpoint: {exc}") from None
        with self._changed:
            self.sampler.load_state_dict(state.get("sampler", {}))
            self._partitions = partitions
            self._answers.clear()
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


def _rows_with(partition: Partition, task_ids: Sequence[str], fields: Sequence[str]) -> list[int] | None:
    """The indexes of `task_ids` if every one is still there with every field, else None."""
    rows = []
    for task_id in task_ids:
        i = partition.index_of.get(task_id)
        if i is None or any(i not in partition.columns[f].node for f in fields):
            return None
        rows.append(i)
    return rows


def _has_cached_result(
    sampler: BaseSampler, partition_id: str, task_name: str, sampling_config: Mapping[str, Any]
) -> bool:
    """Whether the sampler can answer this rank from its cache (a duck-typed sampler may not say)."""
    check = getattr(sampler, "has_cached_result", None)
    return bool(check(partition_id, task_name, sampling_config)) if callable(check) else False


def _group_size(sampler: BaseSampler) -> int:
    """n_samples_per_prompt of a GRPO group sampler (also one inside `RankAwareSampler`), else 1."""
    if isinstance(sampler, RankAwareSampler):
        sampler = sampler.sampler
    return sampler.n_samples_per_prompt if isinstance(sampler, GRPOGroupNSampler) else 1


def _id_list(values: Any, name: str, what: str) -> list[str]:
    """`values` as a list of valid ids (`what`: "field" or "task_id"); one string is refused, as a
    caller who passed ``"x"`` for ``["x"]`` would otherwise get one id per character."""
    refuse_one_string(values, name, what)
    return [validate_id(v, what) for v in _iterable(values, name)]


def refuse_one_string(values: Any, name: str, what: str) -> None:
    """InvalidArgumentError when a list of ids (`what`: "field" or "task_id") is one string."""
    if isinstance(values, (str, bytes)):
        noun = "field names" if what == "field" else "task ids"
        raise InvalidArgumentError(f"{name} must be a list of {noun}, not one string: {values!r}")


def _iterable(value: Any, name: str) -> Iterable[Any]:
    """`value` if it is a list-like of names, else `InvalidArgumentError` (an int, a dict, None...)."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise InvalidArgumentError(f"{name} must be a list of names, got {type(value).__name__}")
    return value


def _custom_meta_object(meta: Any, task_id: str) -> dict[str, Any]:
    """A JSON object of at most `MAX_CUSTOM_META_BYTES`, as a fresh copy; else InvalidArgumentError."""
    if not isinstance(meta, Mapping):
        raise InvalidArgumentError(f"custom_meta of task {task_id!r} must be an object, got {type(meta)}")
    try:
        text = json.dumps(dict(meta), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"custom_meta of task {task_id!r} is not JSON: {exc}") from None
    if len(text) > MAX_CUSTOM_META_BYTES:
        raise InvalidArgumentError(
            f"custom_meta of task {task_id!r} is {len(text)} bytes of JSON, over {MAX_CUSTOM_META_BYTES}"
        )
    copy = json.loads(text)
    if not all(isinstance(k, str) for k in meta):
        raise InvalidArgumentError(f"custom_meta of task {task_id!r} must have string keys")
    length = copy.get("total_lengths")
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 0):
        raise InvalidArgumentError(
            f"custom_meta total_lengths of task {task_id!r} must be a non-negative int, got {length!r}"
        )
    return copy


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
        raise InvalidArgumentError("the batch lists a task id twice")
    for node in meta.nodes:
        try:
            validate_node(node)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
    for name, fm in meta.fields.items():
        validate_id(name, "field")
        if fm.dtype is not None and fm.dtype not in ITEMSIZE:
            raise InvalidArgumentError(f"field {name!r} has unknown dtype {fm.dtype!r}")
        if len(fm.nodes) != len(meta.task_ids) or len(fm.shapes) != len(meta.task_ids):
            raise InvalidArgumentError(f"field {name!r} does not have one node and one shape per task")
        nodes = np.asarray(fm.nodes)
        if nodes.dtype.kind not in "iu" or (
            len(nodes) and not 0 <= int(nodes.min()) <= int(nodes.max()) < len(meta.nodes)
        ):
            raise InvalidArgumentError(f"field {name!r} names a node the batch does not list")
