"""A batch's status as one object: what an EMPTY, LOCAL or REMOTE batch holds and how it answers.

`DistributedBatchMemory` holds exactly one state and asks it, instead of testing which of
several attributes is set. Each state answers the questions whose answer depends on the
status: its tasks and fields, a field's schema, a column, a row, per-task lengths, packed
values, the rows or fields it keeps, gathering, clearing, union and concat with a state of
its own kind, and its pickled form. The batch checks arguments, refuses what a status cannot
do (`BatchStatusError`), and keeps the public API.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from distbatch.batch.columns import (
    Column,
    column_for_pickle,
    column_lengths,
    concat_columns,
    empty_column,
    empty_packed,
    merge_columns,
    pack_column,
    schema_of,
    take_column,
    take_columns,
)
from distbatch.batch.gather import Gathered, fetch, plan_fetch
from distbatch.batch.meta import BatchMeta, FieldMeta, pick
from distbatch.batch.remote import FieldCache, RemoteColumns
from distbatch.client.default import default_client
from distbatch.client.planning import DeleteProduct
from distbatch.client.results import DeleteResult
from distbatch.client.shard_client import ShardClient
from distbatch.errors import ClearError, NodeError, OutOfRangeError
from distbatch.twins import BLOCKING, Twin, run_blocking

_NO_ROWS = np.zeros(0, dtype=np.int64)


class BatchStatus(enum.Enum):
    LOCAL = "LOCAL"
    REMOTE = "REMOTE"
    EMPTY = "EMPTY"


class BatchState(Protocol):
    """What every state answers (`EmptyState`, `LocalState`, `RemoteState`)."""

    status: ClassVar[BatchStatus]

    @property
    def task_ids(self) -> list[str]: ...
    @property
    def meta(self) -> BatchMeta | None: ...
    @property
    def client(self) -> ShardClient | None: ...

    def fields(self) -> list[str]: ...
    def field_meta(self, name: str) -> FieldMeta: ...
    def schema_meta(self) -> BatchMeta: ...
    def column(self, name: str, progress_min_bytes: int) -> Column: ...
    def row(self, index: int, progress_min_bytes: int) -> dict[str, Any]: ...
    def packed(self, name: str, progress_min_bytes: int) -> tuple[torch.Tensor, torch.Tensor]: ...
    def lengths(self, name: str) -> list[int]: ...
    def take(self, rows: np.ndarray) -> BatchState: ...
    def select(self, names: list[str]) -> BatchState: ...
    def reading(self) -> contextlib.AbstractContextManager[Any]: ...
    async def fetch(self, twin: Twin, names: Sequence[str], progress_min_bytes: int) -> None: ...
    async def to_local(self, twin: Twin, progress_min_bytes: int) -> BatchState: ...
    async def clear(self, twin: Twin) -> int: ...
    def pickled(self) -> dict[str, Any]: ...


def local_state(task_ids: list[str], data: dict[str, Column]) -> BatchState:
    """LOCAL over `data`; EMPTY (keeping the fields' schema) when there are no tasks."""
    return LocalState(task_ids, data) if task_ids else EmptyState(schema_of(data))


def remote_state(remote: RemoteColumns) -> BatchState:
    """REMOTE over `remote`; EMPTY (keeping the fields' schema) when it names no tasks."""
    return RemoteState(remote) if len(remote.meta) else EmptyState(remote.meta.fields)


def unpickled_state(state: Mapping[str, Any]) -> BatchState:
    """The state `pickled()` gave (a REMOTE one may be in an earlier version's dict form)."""
    if state["status"] == "REMOTE":
        meta = state["meta"]
        if not isinstance(meta, BatchMeta):
            meta = BatchMeta.from_dict(meta)
        return RemoteState(RemoteColumns(meta, None))
    if state["status"] == "LOCAL":
        return LocalState(list(state["task_ids"]), dict(state["data"]))
    meta = state.get("meta")
    return EmptyState(meta.fields if isinstance(meta, BatchMeta) else {})


class _NothingToGather:
    """What LOCAL and EMPTY answer to gathers and clears: their data is not on any worker."""

    meta: BatchMeta | None = None
    client: ShardClient | None = None

    def reading(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    async def fetch(self, twin: Twin, names: Sequence[str], progress_min_bytes: int) -> None:
        return None

    async def to_local(self, twin: Twin, progress_min_bytes: int) -> BatchState:
        return self  # type: ignore[return-value]

    async def clear(self, twin: Twin) -> int:
        return 0


class EmptyState(_NothingToGather):
    """No tasks; the fields it keeps (dtype, kind, shape over zero tasks), so an empty slice or
    chunk still has them; {} for a batch that never had any."""

    status: ClassVar[BatchStatus] = BatchStatus.EMPTY

    def __init__(self, schema: Mapping[str, FieldMeta] | None = None) -> None:
        self.task_ids: list[str] = []
        self.schema = dict(schema or {})

    def fields(self) -> list[str]:
        return list(self.schema)

    def field_meta(self, name: str) -> FieldMeta:
        return self.schema[name]

    def schema_meta(self) -> BatchMeta:
        return BatchMeta([], [], dict(self.schema))

    def column(self, name: str, progress_min_bytes: int) -> Column:
        return empty_column(self.schema[name])

    def row(self, index: int, progress_min_bytes: int) -> dict[str, Any]:
        raise OutOfRangeError(f"task index {index} out of range for 0 tasks")

    def packed(self, name: str, progress_min_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        return empty_packed(name, self.schema[name])

    def lengths(self, name: str) -> list[int]:
        return []

    def take(self, rows: np.ndarray) -> BatchState:
        return EmptyState(self.schema)

    def select(self, names: list[str]) -> BatchState:
        return EmptyState({name: self.schema[name] for name in names})

    def pickled(self) -> dict[str, Any]:
        return {"status": "EMPTY", "meta": self.schema_meta()} if self.schema else {"status": "EMPTY"}


class LocalState(_NothingToGather):
    """The tasks' data here: one column per field (a tensor, a list of tensors or JSON values)."""

    status: ClassVar[BatchStatus] = BatchStatus.LOCAL

    def __init__(self, task_ids: list[str], data: dict[str, Column]) -> None:
        self.task_ids = task_ids
        self.data = data

    def fields(self) -> list[str]:
        return list(self.data)

    def field_meta(self, name: str) -> FieldMeta:
        return schema_of({name: self.data[name]})[name]

    def schema_meta(self) -> BatchMeta:
        return BatchMeta([], [], schema_of(self.data))

    def column(self, name: str, progress_min_bytes: int) -> Column:
        return self.data[name]

    def row(self, index: int, progress_min_bytes: int) -> dict[str, Any]:
        return {name: col[index] for name, col in self.data.items()}

    def packed(self, name: str, progress_min_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        return pack_column(name, self.data[name])

    def lengths(self, name: str) -> list[int]:
        return column_lengths(name, self.data[name])

    def take(self, rows: np.ndarray) -> BatchState:
        return local_state(pick(self.task_ids, rows), take_columns(self.data, rows))

    def select(self, names: list[str]) -> BatchState:
        return LocalState(list(self.task_ids), {name: self.data[name] for name in names})

    def with_column(self, name: str, column: Column) -> LocalState:
        """A copy with field `name` set (the columns stay shared, the dict is new)."""
        return LocalState(self.task_ids, {**self.data, name: column})

    def without(self, name: str) -> LocalState:
        return LocalState(self.task_ids, {n: col for n, col in self.data.items() if n != name})

    def union(self, other: LocalState, rows: np.ndarray | None, order: Sequence[str]) -> BatchState:
        return LocalState(list(self.task_ids), merge_columns(self.data, other.data, rows, order))

    @staticmethod
    def concat(parts: Sequence[LocalState], names: Sequence[str], task_ids: list[str]) -> BatchState:
        return LocalState(task_ids, {n: concat_columns(n, [p.data[n] for p in parts]) for n in names})

    def pickled(self) -> dict[str, Any]:
        data = {name: column_for_pickle(col) for name, col in self.data.items()}
        return {"status": "LOCAL", "task_ids": self.task_ids, "data": data}


class RemoteState:
    """Where the tasks' shards are (metadata, client) and the fields gathered so far."""

    status: ClassVar[BatchStatus] = BatchStatus.REMOTE

    def __init__(self, remote: RemoteColumns) -> None:
        self.remote = remote
        self.task_ids = list(remote.meta.task_ids)
        self.meta: BatchMeta | None = remote.meta
        self.client = remote.client

    def fields(self) -> list[str]:
        return list(self.remote.meta.fields)

    def field_meta(self, name: str) -> FieldMeta:
        return self.remote.meta.fields[name]

    def schema_meta(self) -> BatchMeta:
        return self.remote.meta.take(_NO_ROWS)

    def reading(self) -> contextlib.AbstractContextManager[Any]:
        """Held by blocking reads while they gather, so threads that want a field gather it once."""
        return self.remote.cache.lock

    def _cached(self, name: str, progress_min_bytes: int) -> FieldCache:
        """The cache, holding field `name` (gathered now if it did not)."""
        with self.reading():
            run_blocking(self.fetch(BLOCKING, [name], progress_min_bytes))
        return self.remote.cache

    def column(self, name: str, progress_min_bytes: int) -> Column:
        return self._cached(name, progress_min_bytes).column(name)

    def row(self, index: int, progress_min_bytes: int) -> dict[str, Any]:
        """Task `index`'s values: a field not gathered yet is fetched for this task alone."""
        remote = self.remote
        missing = remote.cache.missing(self.fields())
        fetched: dict[str, Column | Gathered] = {}
        if missing:
            one = RemoteColumns(remote.meta.take([index]), remote.client)
            fetched = run_blocking(_gather(BLOCKING, one, missing, progress_min_bytes))
        columns = {name: v.column() if isinstance(v, Gathered) else v for name, v in fetched.items()}
        return remote.row(index, {name: column[0] for name, column in columns.items()})

    def packed(self, name: str, progress_min_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cached(name, progress_min_bytes).packed(name)

    def lengths(self, name: str) -> list[int]:
        return self.remote.meta.lengths(name)

    def take(self, rows: np.ndarray) -> BatchState:
        return remote_state(self.remote.take(rows))

    def select(self, names: list[str]) -> BatchState:
        return remote_state(self.remote.select(names))

    async def fetch(self, twin: Twin, names: Sequence[str], progress_min_bytes: int) -> None:
        """Gather the fields of `names` the cache lacks into it."""
        missing = self.remote.cache.missing(names)
        if missing:
            self.remote.cache.store(await _gather(twin, self.remote, missing, progress_min_bytes))

    async def to_local(self, twin: Twin, progress_min_bytes: int) -> BatchState:
        names = self.fields()
        await self.fetch(twin, names, progress_min_bytes)
        return LocalState(list(self.task_ids), self.remote.cache.columns(names))

    async def clear(self, twin: Twin) -> int:
        """Delete every shard the batch names; the count, or `ClearError` naming failed nodes."""
        plan = self.remote.delete_plan()
        try:
            client = self.remote.client or default_client()
            outcome = await twin.call(client.delete_products_each, client.adelete_products_each, plan)
        finally:
            self.remote.cache.clear()  # even a partial clear may have deleted cached shards
        return _cleared(plan, outcome)

    def union(self, other: RemoteState, rows: np.ndarray | None, order: Sequence[str]) -> BatchState:
        return remote_state(self.remote.union(other.remote, rows, order))

    @staticmethod
    def concat(parts: Sequence[RemoteState], names: Sequence[str], task_ids: list[str]) -> BatchState:
        return remote_state(RemoteColumns.concat([p.remote for p in parts], names))

    def pickled(self) -> dict[str, Any]:
        # The metadata object itself: numpy arrays pickle as bytes, far faster than JSON lists.
        return {"status": "REMOTE", "meta": self.remote.meta}


async def _gather(
    twin: Twin, remote: RemoteColumns, names: Sequence[str], progress_min_bytes: int
) -> dict[str, Column | Gathered]:
    """Fetch whole fields of `remote` from the workers, nodes concurrently. A field whose tasks
    share stored values (`FieldMeta.shared`) is fetched once per value, and its tasks get views
    of it."""
    client = remote.client or default_client()
    meta = remote.meta
    shared = [name for name in names if meta.fields[name].has_shared]
    plain = [name for name in names if name not in shared]
    out: dict[str, Column | Gathered] = {}
    plan = plan_fetch(meta, plain, client) if plain else None
    if plan is not None:
        out.update(await fetch(twin, client, plan, progress_min_bytes))
    # Fields sharing the same way (one put's `share=` fields: the same keys on the same nodes)
    # are fetched together, one request per node for all of them.
    alike: dict[tuple[bytes, bytes], list[str]] = {}
    for name in shared:
        fm = meta.fields[name]
        alike.setdefault((fm.shared.tobytes(), fm.nodes.tobytes()), []).append(name)  # type: ignore[union-attr]
    for group in alike.values():
        kept, inverse = shared_rows(meta.fields[group[0]])
        plan = plan_fetch(meta.take(kept).select_fields(group), group, client)
        if plan is not None:  # (always: a field with shared values has tasks)
            gathered = await fetch(twin, client, plan, progress_min_bytes)
            out.update((name, take_column(gathered[name].column(), inverse)) for name in group)
    return out


def shared_rows(fm: FieldMeta) -> tuple[np.ndarray, np.ndarray]:
    """The tasks to fetch a field with shared values from (one per value, in task order), and
    per task the position among them of the one holding its value."""
    n = len(fm.nodes)
    shared = np.zeros(n, dtype=np.int64) if fm.shared is None else fm.shared
    own = -np.arange(1, n + 1, dtype=np.int64)  # a task alone: a key of its own
    keys = np.stack([np.where(shared != 0, shared, own), fm.nodes.astype(np.int64)])
    _, first, inverse = np.unique(keys, axis=1, return_index=True, return_inverse=True)
    order = np.argsort(first)
    rank = np.empty(len(first), dtype=np.int64)
    rank[order] = np.arange(len(first))
    return first[order], rank[inverse.reshape(-1)]


def _cleared(
    plan: dict[str, list[DeleteProduct]], outcome: dict[str, DeleteResult | NodeError]
) -> int:
    """The count a clear deleted, or `ClearError` naming the nodes that failed."""
    deleted = {n: r.deleted for n, r in outcome.items() if isinstance(r, DeleteResult)}
    failed = {n: r for n, r in outcome.items() if isinstance(r, NodeError)}
    if failed:
        undeleted = {n: sum(len(ids) * len(names) for ids, names, _ in plan[n]) for n in failed}
        raise ClearError(failed, sum(deleted.values()), undeleted, deleted_by_node=deleted)
    return sum(deleted.values())
