"""`DistributedBatchMemory`: one batch object, LOCAL (data here), REMOTE (metadata only) or EMPTY.

A REMOTE batch names, per task and field, the worker that holds the shard;
indexing a field gathers just that column from those workers, concurrently,
and caches it. Slicing, chunking, balancing, union and concat of a REMOTE
batch move no data: they rearrange metadata.

The batch checks its arguments and asks its state (`states`: EMPTY, LOCAL or REMOTE), which
answers with `columns` (a LOCAL batch's data), `remote` (a REMOTE batch's metadata and cache)
and `gather` (fetching fields); `ops` says which rows a rearrangement takes.
"""

from __future__ import annotations

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
    column_len,
    columns_from_dict,
    export_bundle,
    fields_of_samples,
    to_column,
    to_device,
)
from distbatch.batch.extend import extend_local, extend_remote, local_field_meta
from distbatch.batch.meta import BatchMeta, FieldMeta
from distbatch.batch.ragged import nested_of_packed
from distbatch.batch.remote import RemoteColumns
from distbatch.batch.states import (
    BatchState,
    BatchStatus,
    EmptyState,
    LocalState,
    local_state,
    remote_state,
    unpickled_state,
)
from distbatch.client.default import default_client
from distbatch.client.shard_client import ShardClient
from distbatch.errors import (
    BatchStatusError,
    InvalidArgumentError,
    InvalidTypeError,
    MetaFormatError,
    NotFoundError,
    OutOfRangeError,
)
from distbatch.ids import shown, validate_id, validate_node
from distbatch.twins import AWAITED, BLOCKING, Twin, run_blocking
from distbatch.wire.bundle import validate_ids

__all__ = ["BatchStatus", "DistributedBatchMemory", "new_task_ids"]


def _check_task_ids(task_ids: Iterable[Any], count: int) -> list[str]:
    ids = list(task_ids)
    validate_ids(ids, "task_id")
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
        # What the batch holds and how it answers, by status (`distbatch.batch.states`).
        self._state: BatchState = EmptyState()

    # ------------------------------------------------------------------ constructors

    @classmethod
    def _of(cls, state: BatchState) -> DistributedBatchMemory:
        batch = cls()
        batch._state = state
        return batch

    @classmethod
    def _make_empty(cls, schema: Mapping[str, FieldMeta]) -> DistributedBatchMemory:
        return cls._of(EmptyState(schema))

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
        return cls._of(local_state(ids, columns))

    @classmethod
    def from_list(
        cls, samples: Sequence[Mapping[str, Any]], task_ids: Sequence[str] | None = None
    ) -> DistributedBatchMemory:
        """A LOCAL batch from per-task dicts that all have the same keys."""
        return cls.from_dict(fields_of_samples(samples), task_ids=task_ids)

    @classmethod
    def from_meta(cls, meta: BatchMeta, client: ShardClient | None = None) -> DistributedBatchMemory:
        """A REMOTE batch over existing shards; `client` defaults to the process-wide one."""
        return cls._of(remote_state(RemoteColumns(meta, client)))

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
        return self._state.status

    @property
    def task_ids(self) -> list[str]:
        return list(self._state.task_ids)

    @property
    def fields(self) -> list[str]:
        return self._state.fields()

    def keys(self) -> list[str]:
        return self.fields

    @property
    def meta(self) -> BatchMeta | None:
        """Where every shard lives (REMOTE); None for LOCAL and EMPTY batches."""
        return self._state.meta

    @property
    def client(self) -> ShardClient:
        return self._state.client or default_client()

    def __len__(self) -> int:
        return len(self._state.task_ids)

    def __contains__(self, name: object) -> bool:
        return name in self.fields

    def __repr__(self) -> str:
        status = self.status.value
        fields = ", ".join(self.fields)
        meta = self._state.meta
        extra = f", nodes={len(meta.nodes)}" if meta is not None else ""
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
        col = self._state.column(name, self.progress_min_bytes)
        return col if isinstance(col, torch.Tensor) else list(col)

    def _row(self, index: int) -> dict[str, Any]:
        n = len(self)
        if not -n <= index < n:
            raise OutOfRangeError(f"task index {index} out of range for {n} tasks")
        return self._state.row(index % n, self.progress_min_bytes)

    def _take(self, indices: Sequence[int] | np.ndarray) -> DistributedBatchMemory:
        rows = np.asarray(indices, dtype=np.int64).reshape(-1)
        if not len(rows):
            return self._make_empty(self.schema_meta().fields)
        return self._of(self._state.take(rows))

    def __setitem__(self, name: str, value: Any) -> None:
        """Set field `name` of a LOCAL batch to a column, as `from_dict` takes one (a tensor with
        one row per task, a list of per-task values, or a jagged nested tensor)."""
        local = self._require_local("set a field")
        validate_id(name, "field")
        col = to_column(name, value)
        if column_len(col) != len(self):
            raise InvalidArgumentError(f"field {name!r} has {column_len(col)} entries for {len(self)} tasks")
        self._state = local.with_column(name, col)

    def __delitem__(self, name: str) -> None:
        if not isinstance(name, str):
            raise InvalidTypeError(
                f"del batch[{shown(name)}]: del removes a field, by name; to drop tasks, keep the "
                "others: batch = batch[mask] (a bool tensor), or batch[[indexes to keep]]"
            )
        local = self._require_local("delete a field")
        self._require_field(name)
        self._state = local.without(name)

    def select_fields(self, names: Iterable[str]) -> DistributedBatchMemory:
        """A batch with only `names` (no data moves; nothing is deleted on the workers)."""
        names = list(names)
        for name in names:
            self._require_field(name)
        return self._of(self._state.select(names))

    def _require_local(self, action: str) -> LocalState:
        """The LOCAL state, or `BatchStatusError` saying why `action` needs one."""
        if isinstance(self._state, LocalState):
            return self._state
        if self.status is BatchStatus.REMOTE:
            raise BatchStatusError(
                f"cannot {action} on a REMOTE batch: call to_local() first, or union() a batch "
                "that carries the new field"
            )
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
        await self._state.fetch(AWAITED, names, self.progress_min_bytes)
        return self

    async def _to_local(self, twin: Twin) -> DistributedBatchMemory:
        state = await self._state.to_local(twin, self.progress_min_bytes)
        return self if state is self._state else self._of(state)

    def to_local(self) -> DistributedBatchMemory:
        """A LOCAL batch with every field, gathering what is not cached yet (LOCAL/EMPTY: self)."""
        with self._state.reading():  # threads that want the fields gather them once
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
        return self._state.packed(field, self.progress_min_bytes)

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
        return self._state.field_meta(name)

    def get_data(self) -> dict[str, Column]:
        """Every field as a column (gathered first if REMOTE)."""
        local = self.to_local()
        return {name: local[name] for name in local.fields}

    def export_bundle(
        self, node: str, copy: bool = False, share: Mapping[str, int] | None = None
    ) -> tuple[wire.Bundle, BatchMeta]:
        """A LOCAL batch as a wire bundle (one column per field) plus the metadata naming `node`.

        A stacked tensor column travels as it is (no per-task work); a ragged one is packed
        with one `cat`. `copy=True` makes sure no column shares memory with the batch's
        tensors (for a store that keeps the bundle): one copy per column at most. Shared
        values (`share`, or tasks holding the very same tensor) travel once: see `to_remote`.
        """
        local = self._require_local("export shards")
        return export_bundle(list(local.task_ids), local.data, validate_node(node), copy, share)

    def to_remote(
        self, node: str, client: ShardClient | None = None, *, share: Mapping[str, int] | None = None
    ) -> DistributedBatchMemory:
        """Push a LOCAL batch's columns to `node`; returns the REMOTE batch that points at them.

        Group-shared values are stored once: tasks of a list column that hold the very same
        tensor object (``[image] * n``) share it without being asked, and `share={"field": n}`
        says each run of n consecutive tasks has one value of that field (checked equal; a GRPO
        group's prompt or ``pixel_values``). A gather then moves each shared value once per
        reader, and its tasks get views of it; deleting any of them is exact.
        """
        if self.status is BatchStatus.EMPTY:
            return self._of(self._state.take(np.zeros(0, dtype=np.int64)))
        if self.status is BatchStatus.REMOTE:
            raise BatchStatusError("batch is already REMOTE; to_local() first to move it elsewhere")
        bundle, meta = self.export_bundle(node, share=share)
        result = (client or default_client()).put_bundle(meta.nodes[0], bundle)
        return self._of(remote_state(RemoteColumns(meta.stored_by(result.generation), client)))

    async def _clear(self, twin: Twin) -> int:
        deleted = await self._state.clear(twin)
        self._state = EmptyState(self.schema_meta().fields)  # nothing left to read: its fields kept
        return deleted

    def clear(self) -> int:
        """Delete every shard this batch names on the nodes that hold them, and empty the batch
        (EMPTY, its fields kept); idempotent.

        Returns how many shards were deleted (0 for a LOCAL batch, whose data is not on any
        worker: it is dropped, and for an EMPTY one). Every node is tried; if some cannot be
        reached, `ClearError` reports per node what was deleted and what may remain, the batch
        stays as it was, and calling `clear()` again once they are back finishes the job. Other
        batches over the same shards (slices, chunks, copies) are not told: reading them raises
        `ShardNotFoundError`.
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
        return self._state.lengths(name)

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
            return [self._take([]) for _ in range(n)]
        task_lengths = self._balance_lengths(length_field, lengths)
        return [self._take(rows) for rows in ops.balanced_rows(task_lengths, n, group_size)]

    def split_micro_batches(
        self,
        max_tokens: int,
        *,
        count: int | None = None,
        length_field: str | None = None,
        lengths: Any = None,
    ) -> list[DistributedBatchMemory]:
        """This batch cut into micro-batches of at most `max_tokens` tokens each, from metadata
        alone (a REMOTE batch is cut without fetching a byte), balanced by tokens; tasks keep
        their relative order inside each. Tokens per task as `chunk_balanced` reads them
        (`lengths=`, `length_field=`, else the default length field).

        The fewest that fit, or exactly `count`: a data-parallel trainer's ranks must run the
        same number of micro-batches (each gradient all-reduce, each accumulation step, in step
        with the others), so the controller takes `micro_batch_count(chunks, max_tokens)` over
        every rank's chunk and each rank splits with that count (a rank with fewer tasks gets
        empty micro-batches at the end). A task longer than `max_tokens` is an
        `InvalidArgumentError` naming it, as is a `count` that cannot hold the batch."""
        task_lengths = self._micro_batch_lengths(length_field, lengths)
        rows = ops.micro_batch_rows(task_lengths, max_tokens, count)
        return [self._take(part) for part in sorted(rows, key=lambda r: r[0] if len(r) else len(self))]

    def _micro_batch_lengths(self, length_field: str | None, lengths: Any) -> np.ndarray:
        """Tokens per task for a micro-batch budget: as `chunk_balanced` reads lengths, where a
        padded field's width is what a micro-batch computes over (no warning)."""
        if not len(self) and lengths is None and length_field is None:
            return np.zeros(0, np.int64)
        return self._balance_lengths(length_field, lengths, warn=False)

    def _balance_lengths(self, length_field: str | None, lengths: Any, warn: bool = True) -> np.ndarray:
        """The per-task lengths `chunk_balanced` balances (see there); `warn=False` for a caller
        to whom a padded field's width is the right length (a micro-batch's token budget)."""
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
        if warn and len(self) > 1 and not fm.ragged:
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
            return self._make_empty({**self.schema_meta().fields, **other.schema_meta().fields})
        if other.status is BatchStatus.EMPTY:
            return self._take(np.arange(len(self)))
        if self.status is BatchStatus.EMPTY:
            return other._take(np.arange(len(other)))
        if self.status is not other.status:
            raise BatchStatusError(
                f"cannot union a {self.status.value} batch with a {other.status.value} one: "
                "call to_local() on the REMOTE one or to_remote(node) on the LOCAL one"
            )
        rows = ops.union_rows(self._state.task_ids, other._state.task_ids)
        clash = [f for f in other.fields if f in self.fields]
        if clash and not overwrite:
            raise InvalidArgumentError(
                f"fields {clash} are in both batches; pass overwrite=True to replace them"
            )
        order = self.fields + [f for f in other.fields if f not in self.fields]
        return self._of(self._state.union(other._state, rows, order))  # type: ignore[attr-defined]

    def union_(self, other: DistributedBatchMemory, overwrite: bool = False) -> DistributedBatchMemory:
        """`union` in place; on any error the batch is left unchanged."""
        result = self.union(other, overwrite=overwrite)
        # A blocking read that is gathering into this batch's cache finishes first.
        with self._state.reading():
            self._state = result._state
        return self

    def _extension(self, data: Mapping[str, Any] | DistributedBatchMemory) -> LocalState:
        """`extend`'s argument as a LOCAL state over this batch's tasks, in this batch's order."""
        if not isinstance(data, DistributedBatchMemory):
            data = DistributedBatchMemory.from_dict(data, task_ids=self.task_ids)
        if data.status is BatchStatus.REMOTE:
            raise BatchStatusError(
                "the rows to extend with must be LOCAL (or a dict of columns): to_local() first"
            )
        if data.status is BatchStatus.EMPTY and len(self):
            raise InvalidArgumentError(f"no rows to extend the batch's {len(self)} tasks with")
        unknown = [f for f in data.fields if f not in self.fields]
        if unknown:
            raise InvalidArgumentError(
                f"fields {unknown} are not in the batch: extend grows fields the batch has "
                "(put new fields with to_remote and union)"
            )
        hint = f"extend takes one row per task of the batch ({len(self)}; the rows name {len(data)})"
        rows = ops.union_rows(self.task_ids, data.task_ids, "extend", hint)
        state = data._state if rows is None else data._state.take(rows)
        if not isinstance(state, LocalState):  # (a LOCAL batch's rows are LOCAL)
            raise BatchStatusError("the rows to extend with must be LOCAL")
        return state

    async def _extend(
        self, twin: Twin, data: Mapping[str, Any] | DistributedBatchMemory
    ) -> DistributedBatchMemory:
        if self.status is BatchStatus.EMPTY:
            self._extension(data)  # checked all the same
            return self._take(np.arange(0))
        tails = self._extension(data)
        names = tails.fields()
        metas = {name: local_field_meta(name, tails.data[name]) for name in names}
        if self.status is BatchStatus.LOCAL:
            held = self._require_local("extend")
            pairs = [(n, local_field_meta(n, held.data[n]), metas[n]) for n in names]
            grown = extend_local(held.data, tails.data, pairs)
            return self._of(local_state(list(self.task_ids), grown))
        remote = self._state.remote  # type: ignore[attr-defined]
        return self._of(remote_state(await extend_remote(twin, remote, tails.data, metas)))

    def extend(self, data: Mapping[str, Any] | DistributedBatchMemory) -> DistributedBatchMemory:
        """A new batch whose tensor fields in `data` are longer: each task's value followed, along
        dim 0, by its row of `data` (a dict of columns, or a LOCAL batch, one row per task).

        The partial-rollout step: a REMOTE batch sends only the new rows, each to the worker that
        holds the task's value, which appends them there; the prefix never travels again. The
        grown fields are ragged. Each append names the generation of the value it extends (batches
        from `to_remote`, engine calls and the controller know it; one built by hand with
        `from_meta` may not, and then nothing is checked): this batch's handle reads and deletes
        nothing afterwards (`ShardsReplacedError`), and an extend through it again is refused,
        never applied twice. Appends to several workers are each
        all or nothing; if one fails, the error is raised and the others may have landed.
        """
        return run_blocking(self._extend(BLOCKING, data))

    async def aextend(self, data: Mapping[str, Any] | DistributedBatchMemory) -> DistributedBatchMemory:
        """`extend()` for async code, on the caller's loop without blocking it."""
        return await self._extend(AWAITED, data)

    @staticmethod
    def micro_batch_count(
        batches: Sequence[DistributedBatchMemory], max_tokens: int, *, length_field: str | None = None
    ) -> int:
        """How many micro-batches of at most `max_tokens` tokens each rank of a data-parallel
        group runs, given each rank's batch (`chunk_balanced`'s chunks): the smallest count at
        which every batch splits under the budget; pass it to each rank's
        `split_micro_batches(max_tokens, count=...)`. From metadata alone."""
        lengths = [b._micro_batch_lengths(length_field, None) for b in batches]
        fewest = [len(ops.micro_batch_rows(task_lengths, max_tokens)) for task_lengths in lengths]
        count = max(fewest, default=1)
        while True:  # each batch fits at the count some batch needs, or a count above it does
            try:
                for task_lengths in lengths:
                    ops.micro_batch_rows(task_lengths, max_tokens, count)
                return count
            except InvalidArgumentError:
                count += 1

    @staticmethod
    def concat(batches: Sequence[DistributedBatchMemory]) -> DistributedBatchMemory:
        """Tasks of `batches` one after another: same fields, same status, no repeated task id."""
        parts = [b for b in batches if b.status is not BatchStatus.EMPTY]
        if not parts:  # empty batches of one schema: that schema
            return DistributedBatchMemory._make_empty(batches[0].schema_meta().fields if batches else {})
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
        task_ids = [t for b in parts for t in b._state.task_ids]
        _check_task_ids(task_ids, len(task_ids))
        states: Any = [b._state for b in parts]  # all LocalState or all RemoteState
        return DistributedBatchMemory._of(type(states[0]).concat(states, names, task_ids))

    def moved(self, old: str, new: str) -> DistributedBatchMemory:
        """This REMOTE batch with the shards `old` held now on `new`: a durable worker
        (`--data-dir`) started again elsewhere serves them, with the same generations, so the
        handle reads and clears them there (see `Controller.move_node`). Anything else, or a
        batch with no shard on `old`, is returned as it is."""
        meta = self.meta
        if meta is None or old not in meta.nodes:
            return self
        return DistributedBatchMemory.from_meta(
            meta.moved(validate_node(old), validate_node(new)), self._state.client
        )

    # ------------------------------------------------------------------ serialization

    def schema_meta(self) -> BatchMeta:
        """The batch's fields (dtype, kind: fixed-shape or ragged, shape) as metadata over zero
        tasks: what an empty slice keeps, and what `to_json` and engine calls carry of an EMPTY batch."""
        return self._state.schema_meta()

    def to_json(self) -> str:
        """Metadata of a REMOTE (or EMPTY) batch as JSON; never carries data."""
        if self.status is BatchStatus.LOCAL:
            raise BatchStatusError(
                "to_json carries metadata only: to_remote(node) first, or pickle a LOCAL batch"
            )
        pickled = self._state.pickled()
        if "meta" in pickled:
            pickled["meta"] = pickled["meta"].to_dict()
        return json.dumps(pickled, separators=(",", ":"))

    def __getstate__(self) -> dict[str, Any]:
        return self._state.pickled()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._state = unpickled_state(state)
