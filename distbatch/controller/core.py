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

**Policy versions.** A put may say which policy version generated its tasks (`version=`); the
controller keeps it with each task (checkpointed, in `summary`, `policy_versions`), knows the
trainer's current version (`set_policy_version`), and a consumer may ask for tasks at most
`max_staleness` versions old: older ready tasks are left for later (``stale="wait"``) or
deleted and counted (``stale="drop"``). What was served how stale, and how many were dropped,
is in `summary()["staleness"]`.

**Delivery is at-least-once.** A `get_meta` that hands out tasks marks them
consumed. A caller that may lose the answer (a dropped reply, a failed fetch)
passes a ``request_id``: the controller remembers recent answers (bounded by
count and age) and answers the same id again with the same tasks instead of
consuming new ones.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from distbatch.atomic import write_json_atomically
from distbatch.batch.memory import BatchStatus, DistributedBatchMemory
from distbatch.checks import check_int
from distbatch.client.default import default_client
from distbatch.client.results import DeleteResult
from distbatch.client.shard_client import ShardClient
from distbatch.controller.answers import DEFAULT_REQUEST_MEMORY, DEFAULT_REQUEST_TTL, AnswerMemory
from distbatch.controller.arguments import (
    check_get_meta_args,
    check_put_meta,
    check_staleness,
    checked_node,
    custom_meta_object,
    id_list,
    partial_field_set,
    put_versions,
    refuse_local_batch,
)
from distbatch.controller.checkpoint import CHECKPOINT_VERSION, partitions_from_state, partitions_to_state
from distbatch.controller.partitions import NO_VERSION, Partition, as_rows, at
from distbatch.controller.results import ForgottenNode
from distbatch.errors import (
    ClearError,
    DistBatchError,
    InvalidArgumentError,
    NodeError,
    UnknownFieldError,
    UnknownPartitionError,
)
from distbatch.ids import ShardKey, validate_id
from distbatch.samplers import BaseSampler, GRPOGroupNSampler, RankAwareSampler, SequentialSampler

logger = logging.getLogger("distbatch.controller")

# Partition -> (its object, the indexes a clear or forget_node marked as being cleared in it).
Marked = dict[str, tuple[Partition, list[int]]]


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
        self._answers = AnswerMemory(request_memory, request_ttl)  # checks both before anything else
        self.sampler = sampler if sampler is not None else SequentialSampler()
        self._client = client
        self._partitions: dict[str, Partition] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        # get_meta calls now waiting for producers, per (partition id, task name)
        self._waiting: Counter[tuple[str, str]] = Counter()
        self._policy_version = 0
        # Tasks served per staleness (current policy version minus the task's), tasks dropped.
        self._served_staleness: Counter[int] = Counter()
        self._dropped = 0
        # Per partition, the indexes a restore found in flight, not reissued yet; and how many were.
        self._reissue: dict[str, set[int]] = {}
        self._reissued = 0

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
        names = id_list(expected_fields, "expected_fields", "field")
        with self._changed:
            partition = self._partitions.setdefault(partition_id, Partition(partition_id))
            partition.expected.update(names)
            self._changed.notify_all()

    def put(
        self,
        partition_id: str,
        batch: DistributedBatchMemory,
        *,
        version: Any = None,
        partial: bool | Iterable[str] = False,
    ) -> int:
        """Register a REMOTE batch's tasks and fields in a partition; returns tasks added.

        `version`: the policy version that generated the tasks, one int for the batch or one per
        task (a task put again keeps the older of its versions); what `get_meta(max_staleness=)`
        compares with `policy_version()`. Tasks put without one are never stale.

        `partial`: the batch's fields (`True`) or those named that are still being generated (a
        partial rollout, grown with `DistributedBatchMemory.extend`): the controller knows where
        they are (`inflight`, `clear_tasks`, checkpoints) but they are not produced, so no
        consumer is given them, until the producer puts them again without naming them as partial
        (the batch `extend` returned).

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
        refuse_local_batch(batch)
        meta = batch.meta
        if meta is None:  # REMOTE always has meta; keeps type checkers honest
            return 0
        check_put_meta(meta)
        versions = put_versions(version, len(meta.task_ids))
        partial_fields = partial_field_set(partial, meta.fields)
        with self._changed:
            partition = self._partitions.get(partition_id) or Partition(partition_id)
            plan = partition.check_put(meta, _group_size(self.sampler))
            self._partitions[partition_id] = partition
            rows = partition.register(meta, plan, partial_fields)
            pending = self._reissue.get(partition_id)
            if pending:  # put again since the restore: its producer has it, no reissue
                pending.difference_update(rows.tolist())
            if versions is not None:
                partition.set_versions(rows, versions)
            self._changed.notify_all()
        return len(plan.new)

    def inflight(self, partition_id: str) -> DistributedBatchMemory:
        """The partition's tasks with a partial value (put with `partial=True`, not completed),
        as a REMOTE batch of the fields every one of them has: what a producer resumes."""
        validate_id(partition_id, "partition_id")
        with self._lock:
            partition = self._partitions.get(partition_id)
            return self._batch_of(partition, [] if partition is None else partition.inflight())

    def reissue(self, partition_id: str) -> DistributedBatchMemory:
        """After `load_state_dict` / `load_checkpoint`: the partition's tasks that were in flight
        when the checkpoint was taken and still are, each handed out once (later calls leave
        them out), as `inflight` gives them; an EMPTY batch when there are none."""
        validate_id(partition_id, "partition_id")
        with self._lock:
            partition = self._partitions.get(partition_id)
            pending = self._reissue.pop(partition_id, set())
            if partition is None:
                return self._batch_of(None, [])
            indexes = [i for i in partition.inflight() if i in pending]
            self._reissued += len(indexes)
            return self._batch_of(partition, indexes)

    def _batch_of(self, partition: Partition | None, indexes: list[int]) -> DistributedBatchMemory:
        """A REMOTE batch of `indexes` with the fields all of them have (lock held)."""
        if partition is None or not indexes:
            return DistributedBatchMemory()
        meta = partition.meta_for(indexes, partition.fields_of_all(indexes))
        return DistributedBatchMemory.from_meta(meta, self._client)

    def set_policy_version(self, version: int) -> None:
        """The trainer's current policy version (an int >= 0, from 0): staleness is measured
        against it. Waiting consumers look again."""
        version = check_int(version, "version", 0)
        with self._changed:
            self._policy_version = version
            self._changed.notify_all()

    def policy_version(self) -> int:
        """The trainer's current policy version, as last set (0 until then)."""
        with self._lock:
            return self._policy_version

    def policy_versions(self, partition_id: str, task_ids: Iterable[str]) -> dict[str, int]:
        """The policy version each of `task_ids` was put with (those that have one)."""
        validate_id(partition_id, "partition_id")
        ids = id_list(task_ids, "task_ids", "task_id")
        with self._lock:
            partition = self._partitions.get(partition_id)
            return {} if partition is None else partition.versions_of(ids)

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
        max_staleness: int | None = None,
        stale: str = "wait",
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

        `max_staleness`: only tasks generated by a policy at most this many versions older than
        `policy_version()` are sampled (tasks put without a version always are). Older ready
        tasks stay for later with ``stale="wait"`` (the call polls or waits for fresh ones), or
        are deleted from the workers and the partition (for every consumer) and counted with
        ``stale="drop"``, before the call waits or returns. Staleness is judged per task: give
        a GRPO group one version (put it whole) so a drop takes it whole.

        Raises `UnknownPartitionError` for a partition the controller does not
        have (when not waiting), `UnknownFieldError` for a field the partition
        has never had nor declared, `InvalidArgumentError` for bad arguments.
        """
        fields = check_get_meta_args(
            partition_id, task_name, fields, batch_size, timeout, request_id, sampling_config
        )
        max_staleness = check_staleness(max_staleness, stale)
        request = (partition_id, task_name, tuple(fields), batch_size, sampling_config)
        freshness = None if max_staleness is None else (max_staleness, stale)
        deadline = None if not timeout else time.monotonic() + timeout
        while True:
            drops: list[_Drop] = []
            try:
                batch = self._wait_for_batch(request, deadline, request_id, freshness, drops)
            finally:
                for drop in drops:  # outside the lock: deletes on the workers, before any wait
                    self._finish_drop(drop)
            if batch is not None:
                return batch

    def _wait_for_batch(
        self,
        request: tuple[Any, ...],
        deadline: float | None,
        request_id: str | None,
        freshness: tuple[int, str] | None,
        drops: list[_Drop],
    ) -> DistributedBatchMemory | None:
        """`get_meta` under the lock: sample, or wait for producers until the deadline; None
        when stale tasks were marked for dropping and the call would wait: the caller deletes
        them (the lock released) and asks again, so none stays hidden for a whole wait."""
        partition_id, task_name = request[0], request[1]
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
                    batch = self._sample(partition, request, request_id, freshness, drops)
                    if batch is not None:
                        return batch
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is None or remaining <= 0:
                    return DistributedBatchMemory()
                if drops:
                    return None
                self._waiting[partition_id, task_name] += 1
                try:
                    self._changed.wait(min(remaining, threading.TIMEOUT_MAX))
                finally:
                    self._waiting[partition_id, task_name] -= 1
                    if not self._waiting[partition_id, task_name]:
                        del self._waiting[partition_id, task_name]

    def _sample(
        self,
        partition: Partition,
        request: tuple[Any, ...],
        request_id: str | None,
        freshness: tuple[int, str] | None = None,
        drops: list[_Drop] | None = None,
    ) -> DistributedBatchMemory | None:
        """Ask the sampler for a batch of `partition`'s ready tasks; None when it gives none.

        Called with the lock held. As TransferQueue's controller does, a sampler is called only
        when the ready list holds a batch, or when it can answer this rank from its cache; else
        its check_call (if it has one) refuses bad arguments at once.
        """
        partition_id, task_name, field_tuple, batch_size, sampling_config = request
        fields = list(field_tuple)
        unknown = [f for f in fields if not partition.knows(f)]
        if unknown:
            raise UnknownFieldError(partition_id, unknown, partition.known_fields())
        ready = partition.ready(task_name, fields)
        if freshness is not None:
            max_staleness, stale_policy = freshness
            ready, stale = partition.split_stale(ready, self._policy_version - max_staleness)
            if stale and stale_policy == "drop" and drops is not None:
                # Hidden at once (being cleared); deleted once the lock is released.
                partition.mark_clearing(stale, +1)
                drops.append(_Drop(partition.partition_id, partition, stale, partition.keys_by_node(stale)))
        call = {
            "partition_id": partition_id,
            "task_name": task_name,
            "partition": partition,
            **sampling_config,
        }
        cached = _has_cached_result(self.sampler, partition_id, task_name, sampling_config)
        if len(ready) >= batch_size or cached:
            sampled, consumed = self.sampler(ready, batch_size, **call)
        else:
            check_call = getattr(self.sampler, "check_call", None)
            if callable(check_call):
                check_call(batch_size, **call)
            return None
        if not sampled:
            return None
        missing = partition.unknown(sampled)
        if missing:
            raise DistBatchError(f"sampler returned unknown task indexes {missing[:5]}")
        meta = partition.meta_for(sampled, fields)
        partition.consume(task_name, consumed)
        if partition.has_versions():  # what this consumer took (a rank served from the cache counts once)
            versions = at(partition.versions, as_rows(consumed))
            ages = np.maximum(self._policy_version - versions[versions != NO_VERSION], 0)
            self._served_staleness.update(ages.tolist())
        if request_id is not None:
            self._answers.remember(request_id, request, partition_id, meta.task_ids)
        return DistributedBatchMemory.from_meta(meta, self._client)

    def _recall_answer(self, request_id: str, request: tuple[Any, ...]) -> DistributedBatchMemory | None:
        """The batch `request_id` was answered with, rebuilt (None if forgotten or its tasks are gone)."""
        answer = self._answers.lookup(request_id, request)
        if answer is None:
            return None
        fields = request[2]
        partition = self._partitions.get(answer.partition_id)
        rows = _rows_with(partition, answer.task_ids, fields) if partition is not None else None
        if partition is None or rows is None:
            self._answers.drop(request_id)  # cleared since: nothing of it can be delivered any more
            return None
        return DistributedBatchMemory.from_meta(partition.meta_for(rows, fields), self._client)

    # ------------------------------------------------------------------ status

    def waiting_consumers(self) -> int:
        """How many `get_meta` calls are waiting for producers right now (a starvation gauge)."""
        with self._lock:
            return sum(self._waiting.values())

    def partitions(self) -> list[str]:
        with self._lock:
            return list(self._partitions)

    def summary(self) -> dict[str, Any]:
        """Every partition at a glance, as JSON-able data (what `distbatch status` shows).

        ``{"waiting_consumers": n, "partitions": {id: {...}}}``; per partition: ``exists``,
        ``tasks``, ``ready`` (tasks with every field), ``clearing`` (tasks a clear is deleting),
        ``fields`` (per field: ``produced``, ``partial``, ``dtype``, ``ragged``), ``consumed`` (per consumer
        task name: tasks it took), ``policy_versions`` (tasks per policy version they were put
        with) and ``waiting`` (per task name: `get_meta` calls waiting for producers). A
        partition that consumers wait for but nobody created yet is listed too, with
        ``"exists": false``. Then ``policy_version`` (the trainer's, as set) and ``staleness``:
        ``served`` (tasks handed out, by how many versions old they were) and ``dropped``; and
        ``reissued``: in-flight tasks `reissue` handed out after a restore.
        """
        with self._lock:
            out = {pid: {"exists": True, **p.summary(), "waiting": {}} for pid, p in self._partitions.items()}
            for (pid, task_name), count in self._waiting.items():
                entry = out.setdefault(pid, {"exists": False, **Partition(pid).summary(), "waiting": {}})
                entry["waiting"][task_name] = count
            return {
                "waiting_consumers": sum(self._waiting.values()),
                "partitions": out,
                "policy_version": self._policy_version,
                "staleness": self._staleness_summary(),
                "reissued": self._reissued,
            }

    def staleness(self) -> dict[str, Any]:
        """Tasks handed out per staleness (how many policy versions old, as string keys) and
        tasks dropped as stale: `summary()["staleness"]`, without the partitions' summaries."""
        with self._lock:
            return self._staleness_summary()

    def _staleness_summary(self) -> dict[str, Any]:
        """Tasks served per staleness (as string keys: JSON) and tasks dropped as stale."""
        served = {str(age): n for age, n in sorted(self._served_staleness.items())}
        return {"served": served, "dropped": self._dropped}

    def production_status(self, partition_id: str, fields: Sequence[str] | None = None) -> dict[str, Any]:
        """Tasks in the partition, how many have each field, and how many have all of `fields`.

        A status query never raises for an unknown partition: it reports zero tasks.
        """
        validate_id(partition_id, "partition_id")
        if fields is not None:
            fields = id_list(fields, "fields", "field")
        with self._lock:
            partition = self._partitions.get(partition_id)
            if partition is None:
                return {"tasks": 0, "produced": {}, "ready": 0}
            return partition.production(list(fields) if fields is not None else partition.known_fields())

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
        checked = {validate_id(t, "task_id"): custom_meta_object(meta, t) for t, meta in custom_meta.items()}
        with self._lock:
            partition = self._partitions.get(partition_id)
            if partition is None:
                raise UnknownPartitionError(partition_id, self._partitions)
            partition.set_custom_meta(checked)

    def get_custom_meta(self, partition_id: str, task_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The custom metadata of those `task_ids` that have some, by task id."""
        validate_id(partition_id, "partition_id")
        wanted = id_list(task_ids, "task_ids", "task_id")
        with self._lock:
            partition = self._partitions.get(partition_id)
            return {} if partition is None else partition.custom_meta_of(wanted)

    def consumption_status(self, partition_id: str, task_name: str) -> dict[str, int]:
        """How many of the partition's tasks `task_name` has consumed."""
        validate_id(partition_id, "partition_id")
        validate_id(task_name, "task_name")
        with self._lock:
            partition = self._partitions.get(partition_id)
            if partition is None:
                return {"tasks": 0, "consumed": 0}
            return {"tasks": partition.task_count, "consumed": partition.consumed_count(task_name)}

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
            partition.reset_consumption(task_name)
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

    def _delete_marked(
        self, marked: Marked, keys_by_node: dict[str, list[ShardKey]]
    ) -> tuple[dict[str, int], dict[str, NodeError]]:
        """`_delete_on_workers` for tasks marked as being cleared; if it raises (an interrupt),
        the marks go first, so those tasks are not hidden for ever."""
        try:
            return self._delete_on_workers(keys_by_node)
        except BaseException:
            with self._changed:
                for partition_id, (partition, indexes) in marked.items():
                    if self._partitions.get(partition_id) is partition:  # not replaced by a load
                        partition.mark_clearing(indexes, -1)
                self._changed.notify_all()
            raise

    def clear_tasks(self, partition_id: str, task_ids: Iterable[str]) -> int:
        """Delete these tasks' shards on the workers, then forget the tasks; returns shards deleted.

        If a worker cannot be reached, `ClearError` says which shards stayed;
        tasks whose shards all went are forgotten, the others kept for a retry (or, for a
        worker gone for good, dropped with `forget_node`).
        """
        validate_id(partition_id, "partition_id")
        ids = id_list(task_ids, "task_ids", "task_id")
        with self._lock:
            partition = self._partitions.get(partition_id)
            if partition is None:
                return 0
            rows = partition.rows_of(ids)
            indexes = rows[rows >= 0].tolist()
            plan = partition.keys_by_node(indexes)
            # While the deletes run (outside the lock), nobody is handed these tasks and no
            # producer adds a field to them: a new shard would outlive the forgotten task.
            partition.mark_clearing(indexes, +1)
        deleted_by_node, failed, _ = self._clear_marked(_Drop(partition_id, partition, indexes, plan))
        deleted = sum(deleted_by_node.values())
        if failed:
            raise ClearError(failed, deleted, {n: len(plan[n]) for n in failed}, deleted_by_node)
        return deleted

    def _clear_marked(self, clear: _Drop) -> tuple[dict[str, int], dict[str, NodeError], int]:
        """Delete the shards of tasks marked as being cleared, then forget those whose shards all
        went (the others stay, for a retry); the shards deleted per node, the nodes that failed,
        and how many tasks were forgotten."""
        partition_id, partition, indexes, plan = clear
        deleted_by_node, failed = self._delete_marked({partition_id: (partition, indexes)}, plan)
        forgotten: list[int] = []
        with self._changed:
            if self._partitions.get(partition_id) is partition:
                forgotten = partition.settle_clear(indexes, plan, failed)
                self._answers.forget(partition_id, partition.task_ids_at(forgotten))
                partition.forget(forgotten)
                _forget_in_sampler(self.sampler, partition_id, forgotten)
                self._changed.notify_all()
        return deleted_by_node, failed, len(forgotten)

    def _finish_drop(self, drop: _Drop) -> None:
        """Delete the stale tasks a `get_meta(stale="drop")` hid, and count those forgotten; a
        worker that cannot be reached is logged (the consumer's call does not fail for stale
        data), and the tasks it holds are kept (ready again: a later drop tries again)."""
        try:
            _, failed, forgotten = self._clear_marked(drop)
        except Exception:
            logger.warning(
                "dropping %d stale task(s) of %r failed", len(drop.indexes), drop.partition_id, exc_info=True
            )
            return
        with self._lock:
            self._dropped += forgotten
        if failed:
            logger.warning(
                "dropped %d stale task(s) of %r, but could not delete their shards on %s",
                len(drop.indexes),
                drop.partition_id,
                sorted(failed),
            )

    def clear_partition(self, partition_id: str) -> int:
        """Delete every shard of the partition on the workers, then drop the partition.

        Raises `ClearError` (keeping what could not be deleted) if a worker is down; see
        `forget_node` for one that will not come back.
        """
        validate_id(partition_id, "partition_id")
        with self._lock:
            partition = self._partitions.get(partition_id)
            if partition is None:
                return 0
            task_ids = partition.task_ids()
        deleted = self.clear_tasks(partition_id, task_ids)
        with self._changed:
            partition = self._partitions.get(partition_id)
            if partition is not None and not partition.task_count:
                del self._partitions[partition_id]
                self.sampler.clear_cache(partition_id)
                self._answers.forget(partition_id)
        return deleted

    def forget_node(self, node: str) -> ForgottenNode:
        """Drop every task that has a shard on `node`, a worker gone for good; returns what was lost.

        For a node that will not come back, when `clear_partition` / `clear_tasks` keep raising
        `ClearError` for it. Every partition forgets those tasks (their fields, consumption,
        custom metadata and the samplers' cached answers naming them): no `get_meta` hands them
        out again, checkpoints no longer hold them, and clears no longer need the node.

        The node itself is never contacted. A lost task's other shards, on live nodes (a task
        whose fields were put on several workers), are deleted there, best effort; those a
        live node did not answer for are listed in the result's ``undeleted``, for the caller
        to delete later. While those deletes run, the tasks are not handed out and a put that
        adds to them raises `ClearInProgressError`, as during a clear.

        A node the controller does not know (never seen, or already forgotten) is not an error:
        the result is empty, so calling again is harmless. An address that is not ``host:port``
        is an `InvalidArgumentError`.
        """
        node = checked_node(node)
        with self._lock:
            marked: Marked = {}
            for partition_id, partition in self._partitions.items():
                indexes = partition.rows_on(node)
                if indexes:
                    partition.mark_clearing(indexes, +1)
                    marked[partition_id] = (partition, indexes)
            plans = [partition.keys_by_node(indexes) for partition, indexes in marked.values()]
        on_node = {key for plan in plans for key in plan.get(node, ())}
        elsewhere: dict[str, list[ShardKey]] = {}
        for plan in plans:
            for other, keys in plan.items():
                if other != node:
                    elsewhere.setdefault(other, []).extend(keys)
        elsewhere = {n: list(dict.fromkeys(keys)) for n, keys in elsewhere.items()}  # one key once
        deleted_by_node, failed = self._delete_marked(marked, elsewhere)
        lost = self._forget_marked(marked)
        if lost:
            logger.warning(
                "forgot node %s: %d task(s) lost in %d partition(s) (%s)",
                node,
                sum(map(len, lost.values())),
                len(lost),
                ", ".join(lost),
            )
        return ForgottenNode(
            node=node,
            lost=lost,
            shards_lost=len(on_node),
            deleted=sum(deleted_by_node.values()),
            undeleted={n: tuple(elsewhere[n]) for n in failed},
            failed={n: exc.detail for n, exc in failed.items()},
        )

    def move_node(self, old: str, new: str) -> int:
        """Say that the shards `old` held are now served at `new`: a durable worker (`--data-dir`)
        started again on its directory at another address. Every partition's tasks that name
        `old` name `new` from now on (batches `get_meta` hands out, clears, `forget_node`);
        nothing is contacted or copied. Returns how many tasks moved (0 for a node the
        controller does not know: harmless to call again). Batch handles taken before name
        `old`: move them with `DistributedBatchMemory.moved`."""
        old, new = checked_node(old), checked_node(new)
        with self._changed:
            moved = sum(p.move_node(old, new) for p in self._partitions.values())
            self._changed.notify_all()
        if moved:
            logger.info("moved %d task(s) from node %s to %s", moved, old, new)
        return moved

    def _forget_marked(self, marked: Marked) -> dict[str, tuple[str, ...]]:
        """Unmark and forget the marked tasks of each partition still there; their ids per partition."""
        lost: dict[str, tuple[str, ...]] = {}
        with self._changed:
            for partition_id, (partition, indexes) in marked.items():
                if self._partitions.get(partition_id) is not partition:  # replaced by a load meanwhile
                    continue
                partition.mark_clearing(indexes, -1)
                task_ids = tuple(partition.task_ids_at(indexes))
                self._answers.forget(partition_id, task_ids)
                partition.forget(indexes)
                _forget_in_sampler(self.sampler, partition_id, indexes)
                if task_ids:
                    lost[partition_id] = task_ids
            self._changed.notify_all()
        return lost

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
            partitions = partitions_to_state(self._partitions)
            return {
                "version": CHECKPOINT_VERSION,
                "partitions": partitions,
                "sampler": sampler_state(),
                "policy_version": self._policy_version,
                "staleness": self._staleness_summary(),
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace this controller's state with a `state_dict` (validated before anything changes).

        Remembered `get_meta` answers are not part of a checkpoint: they are forgotten.
        """
        partitions = partitions_from_state(state)
        policy_version, served, dropped = _staleness_from_state(state)
        with self._changed:
            self.sampler.load_state_dict(state.get("sampler", {}))
            self._partitions = partitions
            self._policy_version, self._served_staleness, self._dropped = policy_version, served, dropped
            self._reissue = {pid: set(p.inflight()) for pid, p in partitions.items() if p.inflight()}
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
    rows = partition.rows_of(task_ids)
    if (rows < 0).any() or any((partition.columns[f].node[rows] < 0).any() for f in fields):
        return None
    return rows.tolist()


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


class _Drop(NamedTuple):
    """Tasks of a partition marked as being cleared, and their shards by node: what a clear (or
    a stale drop) deletes once the lock is released."""

    partition_id: str
    partition: Partition
    indexes: list[int]
    plan: dict[str, list[ShardKey]]


def _staleness_from_state(state: Mapping[str, Any]) -> tuple[int, Counter[int], int]:
    """A checkpoint's policy version and staleness counters (absent in older ones: zeros)."""
    try:
        version = check_int(state.get("policy_version", 0), "policy_version", 0)
        staleness = state.get("staleness", {})
        served = Counter(
            {
                check_int(int(age), "a staleness", 0): check_int(n, "a count", 0)
                for age, n in staleness.get("served", {}).items()
            }
        )
        return version, served, check_int(staleness.get("dropped", 0), "dropped", 0)
    except (AttributeError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"invalid controller checkpoint: {exc}") from None
