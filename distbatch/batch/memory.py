"""`DistributedBatchMemory`: one batch object, LOCAL (data here), REMOTE (metadata only) or EMPTY.

A REMOTE batch names, per task and field, the worker that holds the shard;
indexing a field gathers just that column from those workers, concurrently,
and caches it. Slicing, chunking, balancing, union and concat of a REMOTE
batch move no data: they rearrange metadata.

The batch checks its arguments and takes the LOCAL or the REMOTE path; the work is done
beside it: `columns` (a LOCAL batch's data), `remote` (a REMOTE batch's metadata and cache),
`gather` (fetching fields), `ops` (which rows a rearrangement takes).
"""

from __future__ import annotations

import contextlib
import enum
import json
import uuid
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from distbatch import wire
from distbatch.batch import ops
from distbatch.batch.columns import (
    Column,
    column_for_pickle,
    column_len,
    column_lengths,
    columns_from_dict,
    concat_columns,
    empty_column,
    empty_packed,
    export_bundle,
    fields_of_samples,
    merge_columns,
    pack_column,
    schema_of,
    take_columns,
    to_column,
    to_device,
)
from distbatch.batch.gather import Gathered, fetch, plan_fetch
from distbatch.batch.meta import BatchMeta, FieldMeta, pick
from distbatch.batch.ragged import nested_of_packed
from distbatch.batch.remote import FieldCache, RemoteColumns
from distbatch.client.default import default_client
from distbatch.client.planning import DeleteProduct
from distbatch.client.results import DeleteResult
from distbatch.client.shard_client import ShardClient
from distbatch.errors import (
    BatchStatusError,
    ClearError,
    InvalidArgumentError,
    InvalidTypeError,
    MetaFormatError,
    NodeError,
    NotFoundError,
    OutOfRangeError,
)
from distbatch.ids import shown, validate_id, validate_node
from distbatch.twins import AWAITED, BLOCKING, Twin, run_blocking


class BatchStatus(enum.Enum):
    LOCAL = "LOCAL"
    REMOTE = "REMOTE"
    EMPTY = "EMPTY"


def _check_task_ids(task_ids: Iterable[Any], count: int) -> list[str]:
    ids = [validate_id(t, "task_id") for t in task_ids]
    if len(ids) != count:
        raise InvalidArgumentError(f"{len(ids)} task ids given for {count} tasks")
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        for dup in ids:
            if dup in seen:
                raise InvalidArgumentError(f"duplicate task id {dup!r}")
            seen.add(dup)
    return ids


def new_task_ids(count: int) -> list[str]:
    """Fresh task ids, unique across processes and runs."""
    prefix = uuid.uuid4().hex[:12]
    return [f"{prefix}-{i}" for i in range(count)]


class DistributedBatchMemory:
    """A batch of tasks: LOCAL (holds data), REMOTE (holds where the data is) or EMPTY.

    Build one with `from_dict` / `from_list` (LOCAL), `from_meta` / `from_json`
    (REMOTE) or `DistributedBatchMemory()` (EMPTY). The guide's Batches page
    (docs/guide/batches.md) has the full tour.
    """

    #: gathers of at least this many bytes show a tqdm bar when stderr is a terminal
    progress_min_bytes: ClassVar[int] = 64 << 20

    def __init__(self) -> None:
        self._task_ids: list[str] = []
        self._data: dict[str, Column] | None = None  # LOCAL
        self._remote: RemoteColumns | None = None  # REMOTE
        # EMPTY: the fields it keeps (dtype, kind, shape over zero tasks), so an empty slice or
        # chunk still has them; {} for a batch that never had any.
        self._schema: dict[str, FieldMeta] = {}

    # ------------------------------------------------------------------ constructors

    @classmethod
    def _make_local(cls, task_ids: list[str], data: dict[str, Column]) -> DistributedBatchMemory:
        batch = cls()
        if task_ids:
            batch._task_ids = task_ids
            batch._data = data
        else:
            batch._schema = schema_of(data)
        return batch

    @classmethod
    def _make_remote(cls, remote: RemoteColumns) -> DistributedBatchMemory:
        batch = cls()
        if len(remote.meta):
            batch._task_ids = list(remote.meta.task_ids)
            batch._remote = remote
        else:
            batch._schema = dict(remote.meta.fields)
        return batch

    @classmethod
    def _make_empty(cls, schema: Mapping[str, FieldMeta]) -> DistributedBatchMemory:
        batch = cls()
        batch._schema = dict(schema)
        return batch

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], task_ids: Sequence[str] | None = None
    ) -> DistributedBatchMemory:
        """A LOCAL batch from columns: tensors are split on dim 0, lists hold one value per task.

        A jagged nested tensor (`layout=torch.jagged`, ragged in dim 1) is a ragged field whose
        tasks are its `unbind()`: views of its `values()`, which `packed` then returns without a
        copy. A strided nested tensor, or one ragged in another dim, is a `ValueError`.
        """
        columns, count = columns_from_dict(data)
        if count is None:
            count = len(task_ids) if task_ids is not None else 0
        ids = new_task_ids(count) if task_ids is None else _check_task_ids(task_ids, count)
        return cls._make_local(ids, columns)

    @classmethod
    def from_list(
        cls, samples: Sequence[Mapping[str, Any]], task_ids: Sequence[str] | None = None
    ) -> DistributedBatchMemory:
        """A LOCAL batch from per-task dicts that all have the same keys."""
        return cls.from_dict(fields_of_samples(samples), task_ids=task_ids)

    @classmethod
    def from_meta(cls, meta: BatchMeta, client: ShardClient | None = None) -> DistributedBatchMemory:
        """A REMOTE batch over existing shards; `client` defaults to the process-wide one."""
        return cls._make_remote(RemoteColumns(meta, client))

    @classmethod
    def from_json(cls, text: str | bytes, client: ShardClient | None = None) -> DistributedBatchMemory:
        """Inverse of `to_json` (validated: bad JSON, ids or nodes raise a `ValueError`)."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise MetaFormatError(f"batch JSON is not valid: {exc}") from None
        if not isinstance(data, dict) or data.get("status") not in ("REMOTE", "EMPTY"):
            raise MetaFormatError("batch JSON must have status REMOTE or EMPTY")
        if data["status"] == "EMPTY" and "meta" not in data:
            return cls()
        batch = cls.from_meta(BatchMeta.from_dict(data.get("meta")), client)
        if (data["status"] == "EMPTY") != (batch.status is BatchStatus.EMPTY):
            raise MetaFormatError(f"batch JSON says {data['status']}, its metadata has {len(batch)} tasks")
        return batch

    # ------------------------------------------------------------------ basic properties

    @property
    def status(self) -> BatchStatus:
        if not self._task_ids:
            return BatchStatus.EMPTY
        return BatchStatus.REMOTE if self._remote is not None else BatchStatus.LOCAL

    @property
    def task_ids(self) -> list[str]:
        return list(self._task_ids)

    @property
    def fields(self) -> list[str]:
        if self._remote is not None:
            return list(self._remote.meta.fields)
        return list(self._data if self._data is not None else self._schema)

    def keys(self) -> list[str]:
        return self.fields

    @property
    def meta(self) -> BatchMeta | None:
        """Where every shard lives (REMOTE); None for LOCAL and EMPTY batches."""
        return self._remote.meta if self._remote is not None else None

    @property
    def client(self) -> ShardClient:
        return (self._remote.client if self._remote is not None else None) or default_client()

    def __len__(self) -> int:
        return len(self._task_ids)

    def __contains__(self, name: object) -> bool:
        return name in self.fields

    def __repr__(self) -> str:
        status = self.status.value
        fields = ", ".join(self.fields)
        extra = f", nodes={len(self._remote.meta.nodes)}" if self._remote is not None else ""
        return f"DistributedBatchMemory(status={status}, tasks={len(self)}, fields=[{fields}]{extra})"

    # ------------------------------------------------------------------ indexing

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return self._column(key)
        if isinstance(key, int) or (isinstance(key, torch.Tensor) and key.dim() == 0):
            return self._row(int(key))
        return self._take(ops.task_indices(key, len(self)))

    def _require_field(self, name: str) -> None:
        if name not in self.fields:
            raise NotFoundError(f"no field {shown(name)} in batch; fields: {self.fields}")

    def _column(self, name: str) -> Column:
        self._require_field(name)
        if not self._task_ids:
            return empty_column(self._schema[name])
        col = (self._data or {})[name] if self._remote is None else self._cached(name).column(name)
        return col if isinstance(col, torch.Tensor) else list(col)

    def _cached(self, name: str) -> FieldCache:
        """A REMOTE batch's cache, holding field `name` (gathered now if it did not)."""
        cache = self._remote.cache  # type: ignore[union-attr]
        with cache.lock:  # threads that want the field gather it once
            run_blocking(_fetch(BLOCKING, self._remote, [name], self.progress_min_bytes))
        return cache

    def _row(self, index: int) -> dict[str, Any]:
        n = len(self)
        if not -n <= index < n:
            raise OutOfRangeError(f"task index {index} out of range for {n} tasks")
        index %= n
        if self._remote is None:
            return {name: col[index] for name, col in (self._data or {}).items()}
        missing = self._remote.cache.missing(self.fields)
        one = RemoteColumns(self._remote.meta.take([index]), self._remote.client) if missing else None
        fetched = run_blocking(_gather(BLOCKING, one, missing, self.progress_min_bytes)) if one else {}
        return self._remote.row(index, {name: gathered.column()[0] for name, gathered in fetched.items()})

    def _take(self, indices: Sequence[int] | np.ndarray) -> DistributedBatchMemory:
        rows = np.asarray(indices, dtype=np.int64).reshape(-1)
        if not len(rows):
            return self._make_empty(self.schema_meta().fields)
        if self._remote is not None:
            return self._make_remote(self._remote.take(rows))
        return self._make_local(pick(self._task_ids, rows), take_columns(self._data or {}, rows))

    def __setitem__(self, name: str, value: Any) -> None:
        """Set field `name` of a LOCAL batch to a column, as `from_dict` takes one (a tensor with
        one row per task, a list of per-task values, or a jagged nested tensor)."""
        self._require_local("set a field")
        validate_id(name, "field")
        col = to_column(name, value)
        if column_len(col) != len(self):
            raise InvalidArgumentError(f"field {name!r} has {column_len(col)} entries for {len(self)} tasks")
        self._data = {**(self._data or {}), name: col}

    def __delitem__(self, name: str) -> None:
        if not isinstance(name, str):
            raise InvalidTypeError(
                f"del batch[{shown(name)}]: del removes a field, by name; to drop tasks, keep the "
                "others: batch = batch[mask] (a bool tensor), or batch[[indexes to keep]]"
            )
        self._require_local("delete a field")
        self._require_field(name)
        del self._data[name]  # type: ignore[union-attr]

    def select_fields(self, names: Iterable[str]) -> DistributedBatchMemory:
        """A batch with only `names` (no data moves; nothing is deleted on the workers)."""
        names = list(names)
        for name in names:
            self._require_field(name)
        if self._remote is not None:
            return self._make_remote(self._remote.select(names))
        if not self._task_ids:
            return self._make_empty({n: self._schema[n] for n in names})
        return self._make_local(list(self._task_ids), {n: (self._data or {})[n] for n in names})

    def _require_local(self, action: str) -> None:
        status = self.status
        if status is BatchStatus.REMOTE:
            raise BatchStatusError(
                f"cannot {action} on a REMOTE batch: call to_local() first, or union() a batch "
                "that carries the new field"
            )
        if status is BatchStatus.EMPTY:
            raise BatchStatusError(
                f"cannot {action} on an EMPTY batch: build one with DistributedBatchMemory.from_dict()"
            )

    # ------------------------------------------------------------------ moving data

    async def afetch(self, fields: Sequence[str] | None = None) -> DistributedBatchMemory:
        """Gather `fields` (default: all) of a REMOTE batch into its cache without blocking the
        caller's event loop; `batch[field]` then answers from memory. Returns the batch."""
        names = self.fields if fields is None else list(fields)
        for name in names:
            self._require_field(name)
        await _fetch(AWAITED, self._remote, names, self.progress_min_bytes)
        return self

    async def _to_local(self, twin: Twin) -> DistributedBatchMemory:
        if self._remote is None:
            return self
        await _fetch(twin, self._remote, self.fields, self.progress_min_bytes)
        return self._make_local(list(self._task_ids), self._remote.cache.columns(self.fields))

    def to_local(self) -> DistributedBatchMemory:
        """A LOCAL batch with every field, gathering what is not cached yet (LOCAL/EMPTY: self)."""
        if self._remote is None:
            return self
        with self._remote.cache.lock:  # threads that want the fields gather them once
            return run_blocking(self._to_local(BLOCKING))

    async def ato_local(self) -> DistributedBatchMemory:
        """`to_local()` for async controllers: gathers on the caller's loop without blocking it."""
        return await self._to_local(AWAITED)

    def packed(
        self, field: str, device: torch.device | str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(values, cu_seqlens)`: the tasks' values of `field` concatenated along dim 0, and an
        int32 tensor of the N+1 offsets where each task starts (the flash-attn varlen convention).

        For trainers that remove padding. Built without per-task tensors when REMOTE (the
        gathered column is already one buffer); a LOCAL ragged column costs one `cat`, none
        when its tasks are views of one tensor (a nested tensor's values, or a column gathered
        from one node). 0-d values count as one row each. `device=` moves both with one copy each.
        """
        return to_device(*self._packed(field), device)

    def _packed(self, field: str) -> tuple[torch.Tensor, torch.Tensor]:
        self._require_field(field)
        if not self._task_ids:
            return empty_packed(field, self._schema[field])
        if self._remote is None:
            return pack_column(field, (self._data or {})[field])
        return self._cached(field).packed(field)

    def nested(self, field: str, device: torch.device | str | None = None) -> torch.Tensor:
        """`field` as a jagged nested tensor (`layout=torch.jagged`, TransferQueue's convention):
        `nt[i]` is task i's value, ragged along dim 1, trailing dims kept, dtype kept.

        Built from `packed(field)` without copying its values (`nt.values()` is the packed
        tensor, `nt.offsets()` the `cu_seqlens` as int64), so it costs what `packed` costs and
        shares what it shares: nothing is copied for a field given as a nested or stacked tensor
        or gathered from one node; one `cat`, into a new tensor on every call, joins a field
        gathered as a buffer per node (several nodes, each holding a run of the tasks) or given
        as a list of separate tensors. A REMOTE batch gathers the field (once, then cached), as
        `packed` does. A fixed-shape field gives tasks of one length; an EMPTY batch a nested tensor of
        zero tasks. `device=` moves values and offsets with one copy each.

        Raises `ValueError` for a JSON field, for a field of one scalar per task (`batch[field]`
        already is a `[n]` tensor) and for tasks that differ in rank or trailing dimensions.
        """
        self._require_field(field)
        fm = self._field_meta(field)
        if fm.dtype is None:
            raise InvalidArgumentError(f"field {field!r} holds JSON values; nested() needs a tensor field")
        if not fm.ragged and fm.shapes.shape == ():
            raise InvalidArgumentError(
                f"field {field!r} holds one scalar per task: batch[{field!r}] already is a tensor of "
                "shape [n]; a jagged nested tensor needs at least one dimension per task"
            )
        return nested_of_packed(*self._packed(field), device)

    def _field_meta(self, name: str) -> FieldMeta:
        """Field `name`'s schema: its dtype, its kind and (per task, or over zero tasks) its shape."""
        if self._remote is not None:
            return self._remote.meta.fields[name]
        if self._data is not None and self._task_ids:
            return schema_of({name: self._data[name]})[name]
        return self._schema[name]

    def get_data(self) -> dict[str, Column]:
        """Every field as a column (gathered first if REMOTE)."""
        local = self.to_local()
        return {name: local[name] for name in local.fields}

    def export_bundle(self, node: str, copy: bool = False) -> tuple[wire.Bundle, BatchMeta]:
        """A LOCAL batch as a wire bundle (one column per field) plus the metadata naming `node`.

        A stacked tensor column travels as it is (no per-task work); a ragged one is packed
        with one `cat`. `copy=True` makes sure no column shares memory with the batch's
        tensors (for a store that keeps the bundle): one copy per column at most.
        """
        self._require_local("export shards")
        return export_bundle(self._task_ids, self._data or {}, validate_node(node), copy)

    def to_remote(self, node: str, client: ShardClient | None = None) -> DistributedBatchMemory:
        """Push a LOCAL batch's columns to `node`; returns the REMOTE batch that points at them."""
        if self.status is BatchStatus.EMPTY:
            return self._make_empty(self._schema)
        if self._remote is not None:
            raise BatchStatusError("batch is already REMOTE; to_local() first to move it elsewhere")
        bundle, meta = self.export_bundle(node)
        result = (client or default_client()).put_bundle(meta.nodes[0], bundle)
        return self._make_remote(RemoteColumns(meta.stored_by(result.generation), client))

    async def _clear(self, twin: Twin) -> int:
        if self._remote is None:
            return 0
        plan = self._remote.delete_plan()
        try:
            client = self.client
            outcome = await twin.call(client.delete_products_each, client.adelete_products_each, plan)
        finally:
            self._remote.cache.clear()  # even a partial clear may have deleted cached shards
        return _cleared(plan, outcome)

    def clear(self) -> int:
        """Delete every shard this batch names on the nodes that hold them; idempotent.

        Returns how many shards were deleted (0 for LOCAL / EMPTY batches, whose
        data is not on any worker). Every node is tried; if some cannot be reached,
        `ClearError` reports per node what was deleted and what may remain, and calling
        `clear()` again once they are back finishes the job.
        """
        return run_blocking(self._clear(BLOCKING))

    async def aclear(self) -> int:
        """`clear()` for async controllers, on the caller's loop without blocking it."""
        return await self._clear(AWAITED)

    # ------------------------------------------------------------------ splitting

    def chunk(self, n: int) -> list[DistributedBatchMemory]:
        """`n` contiguous batches in order; sizes differ by at most one."""
        ops.check_chunk_count(n)
        return [self._take(rows) for rows in ops.chunk_rows(len(self), n)]

    def lengths(self, field: str | None = None) -> list[int]:
        """Per-task length (first dimension) of a tensor field, from metadata when REMOTE.

        With no `field`: `input_ids`, else the first ragged tensor field, else the first tensor field.
        """
        name = field or self._default_length_field()
        self._require_field(name)
        if not self._task_ids:
            return []
        if self._remote is not None:
            return self._remote.meta.lengths(name)
        return column_lengths(name, (self._data or {})[name])

    def _default_length_field(self) -> str:
        schema = self.schema_meta().fields
        tensors = [name for name, fm in schema.items() if fm.is_tensor]
        return ops.length_field(tensors, [name for name in tensors if schema[name].ragged])

    def chunk_balanced(
        self,
        n: int,
        group_size: int = 1,
        length_field: str | None = None,
        *,
        lengths: Any = None,
    ) -> list[DistributedBatchMemory]:
        """`n` batches with balanced total length, groups of `group_size` kept together.

        A task's length is, in order of preference: `lengths[i]` (a tensor, array or list of
        per-task integers, e.g. `batch["attention_mask"].sum(-1)`); the value of
        `length_field` when it names a per-task integer (a 0-d tensor per task, or JSON ints,
        e.g. a `seqlen` field); else the first dimension of `length_field` or of the default
        field (see `lengths`), read from metadata, so a REMOTE batch is balanced without
        fetching a byte. Balancing by a default field that is fixed-shape (padded: every task
        has its width) or one scalar per task (no length at all) would only balance task
        counts: that warns, saying which and what to pass instead.

        Chunks hold equal task counts when the group count is divisible by `n` (else counts
        differ by one group); tasks keep their relative order inside a chunk.
        """
        ops.check_chunk_count(n)
        if not isinstance(group_size, int) or group_size < 1 or len(self) % group_size:
            raise InvalidArgumentError(f"{len(self)} tasks cannot be cut into groups of {group_size}")
        if not len(self):
            if lengths is not None or length_field is not None:  # bad ones fail on an empty batch too
                self._balance_lengths(length_field, lengths)
            return [self._make_empty(self._schema) for _ in range(n)]
        task_lengths = self._balance_lengths(length_field, lengths)
        return [self._take(rows) for rows in ops.balanced_rows(task_lengths, n, group_size)]

    def _balance_lengths(self, length_field: str | None, lengths: Any) -> np.ndarray:
        """The per-task lengths `chunk_balanced` balances (see there)."""
        if lengths is not None:
            if length_field is not None:
                raise InvalidArgumentError("pass lengths= or length_field=, not both")
            return ops.check_lengths(lengths, len(self))
        if length_field is not None:
            self._require_field(length_field)
            fm = self.schema_meta().fields[length_field]
            if fm.dtype is None or (fm.shapes.shape == () and not fm.ragged):  # one value per task
                return ops.check_lengths(self[length_field], len(self), f"field {length_field!r}")
            return np.asarray(self.lengths(length_field), dtype=np.int64)
        name = self._default_length_field()
        task_lengths = np.asarray(self.lengths(name), dtype=np.int64)
        fm = self.schema_meta().fields[name]
        if len(self) > 1 and not fm.ragged:
            if fm.shapes.shape == ():  # one scalar per task: no sequence at all, padded or not
                why = (
                    f"no field gives a task's length (the default, {name!r}, holds one scalar per "
                    "task), so chunks balance task counts only: use chunk(n) for that, or pass lengths="
                )
            else:
                why = (
                    f"field {name!r} is fixed-shape (padded), so every task has length "
                    f"{int(task_lengths[0])} and chunks balance task counts only; pass lengths="
                )
            warnings.warn(
                f"chunk_balanced: {why} (e.g. batch['attention_mask'].sum(-1)) or length_field= "
                "naming a ragged field or a per-task length field",
                stacklevel=3,
            )
        return task_lengths

    # ------------------------------------------------------------------ combining

    def union(self, other: DistributedBatchMemory, overwrite: bool = False) -> DistributedBatchMemory:
        """A new batch with the fields of both, rows aligned by task id."""
        if self.status is BatchStatus.EMPTY and other.status is BatchStatus.EMPTY:
            clash = [f for f in other.fields if f in self.fields]
            if clash and not overwrite:
                raise InvalidArgumentError(
                    f"fields {clash} are in both batches; pass overwrite=True to replace them"
                )
            return self._make_empty({**self._schema, **other._schema})
        if other.status is BatchStatus.EMPTY:
            return self._take(np.arange(len(self)))
        if self.status is BatchStatus.EMPTY:
            return other._take(np.arange(len(other)))
        if self.status is not other.status:
            raise BatchStatusError(
                f"cannot union a {self.status.value} batch with a {other.status.value} one: "
                "call to_local() on the REMOTE one or to_remote(node) on the LOCAL one"
            )
        rows = ops.union_rows(self._task_ids, other._task_ids)
        clash = [f for f in other.fields if f in self.fields]
        if clash and not overwrite:
            raise InvalidArgumentError(
                f"fields {clash} are in both batches; pass overwrite=True to replace them"
            )
        order = self.fields + [f for f in other.fields if f not in self.fields]
        if self._remote is not None and other._remote is not None:
            return self._make_remote(self._remote.union(other._remote, rows, order))
        data = merge_columns(self._data or {}, other._data or {}, rows, order)
        return self._make_local(list(self._task_ids), data)

    def union_(self, other: DistributedBatchMemory, overwrite: bool = False) -> DistributedBatchMemory:
        """`union` in place; on any error the batch is left unchanged."""
        result = self.union(other, overwrite=overwrite)
        # A blocking read that is gathering into this batch's cache finishes first.
        with self._remote.cache.lock if self._remote is not None else contextlib.nullcontext():
            self._task_ids, self._data, self._remote = result._task_ids, result._data, result._remote
            self._schema = result._schema
        return self

    @staticmethod
    def concat(batches: Sequence[DistributedBatchMemory]) -> DistributedBatchMemory:
        """Tasks of `batches` one after another: same fields, same status, no repeated task id."""
        parts = [b for b in batches if b.status is not BatchStatus.EMPTY]
        if not parts:  # empty batches of one schema: that schema
            return DistributedBatchMemory._make_empty(batches[0]._schema if batches else {})
        if len({b.status for b in parts}) > 1:
            raise BatchStatusError(
                "cannot concat LOCAL and REMOTE batches: to_local() or to_remote(node) them first"
            )
        names = parts[0].fields
        for i, b in enumerate(parts[1:], start=1):
            if set(b.fields) != set(names):
                raise InvalidArgumentError(
                    f"batch {i} has fields {sorted(b.fields)}, batch 0 has {sorted(names)}"
                )
        task_ids = [t for b in parts for t in b._task_ids]
        _check_task_ids(task_ids, len(task_ids))
        remotes = [b._remote for b in parts if b._remote is not None]
        if remotes:
            return DistributedBatchMemory._make_remote(RemoteColumns.concat(remotes, names))
        data = {name: concat_columns(name, [b._data[name] for b in parts]) for name in names}  # type: ignore[index]
        return DistributedBatchMemory._make_local(task_ids, data)

    # ------------------------------------------------------------------ serialization

    def schema_meta(self) -> BatchMeta:
        """The batch's fields (dtype, kind: fixed-shape or ragged, shape) as metadata over zero
        tasks: what an empty slice keeps, and what `to_json` and engine calls carry of an EMPTY batch."""
        if self._remote is not None:
            return self._remote.meta.take(np.zeros(0, dtype=np.int64))
        if self._data is not None and self._task_ids:
            return BatchMeta([], [], schema_of(self._data))
        return BatchMeta([], [], dict(self._schema))

    def to_json(self) -> str:
        """Metadata of a REMOTE (or EMPTY) batch as JSON; never carries data."""
        if self.status is BatchStatus.LOCAL:
            raise BatchStatusError(
                "to_json carries metadata only: to_remote(node) first, or pickle a LOCAL batch"
            )
        if self._remote is None:
            empty: dict[str, Any] = {"status": "EMPTY"}
            if self._schema:
                empty["meta"] = self.schema_meta().to_dict()
            return json.dumps(empty, separators=(",", ":"))
        return json.dumps({"status": "REMOTE", "meta": self._remote.meta.to_dict()}, separators=(",", ":"))

    def __getstate__(self) -> dict[str, Any]:
        status = self.status
        if status is BatchStatus.REMOTE:
            # The metadata object itself: numpy arrays pickle as bytes, far faster than JSON lists.
            return {"status": "REMOTE", "meta": self.meta}
        if status is BatchStatus.LOCAL:
            data = {name: column_for_pickle(col) for name, col in (self._data or {}).items()}
            return {"status": "LOCAL", "task_ids": self._task_ids, "data": data}
        return {"status": "EMPTY", "meta": self.schema_meta()} if self._schema else {"status": "EMPTY"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        if state["status"] == "EMPTY" and isinstance(state.get("meta"), BatchMeta):
            self._schema = dict(state["meta"].fields)
        elif state["status"] == "REMOTE":
            meta = state["meta"]
            if not isinstance(meta, BatchMeta):  # pickled by an earlier version: the dict form
                meta = BatchMeta.from_dict(meta)
            self._task_ids, self._remote = list(meta.task_ids), RemoteColumns(meta, None)
        elif state["status"] == "LOCAL":
            self._task_ids, self._data = list(state["task_ids"]), dict(state["data"])


# What a REMOTE batch's gathers ask the workers for, and what comes of a clear.


async def _fetch(
    twin: Twin, remote: RemoteColumns | None, names: Sequence[str], progress_min_bytes: int
) -> None:
    """Gather the fields of `names` that `remote`'s cache lacks into it (None: nothing to do)."""
    if remote is None:
        return
    missing = remote.cache.missing(names)
    if missing:
        remote.cache.store(await _gather(twin, remote, missing, progress_min_bytes))


async def _gather(
    twin: Twin, remote: RemoteColumns, names: Sequence[str], progress_min_bytes: int
) -> dict[str, Gathered]:
    """Fetch whole fields of `remote` from the workers, nodes concurrently."""
    client = remote.client or default_client()
    plan = plan_fetch(remote.meta, names, client)
    if plan is None:
        return {}
    return await fetch(twin, client, plan, progress_min_bytes)


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
