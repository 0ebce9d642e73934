"""`DistributedBatchMemory`: one batch object, LOCAL (data here), REMOTE (metadata only) or EMPTY.

A REMOTE batch names, per task and field, the worker that holds the shard;
indexing a field gathers just that column from those workers, concurrently,
and caches it. Slicing, chunking, balancing, union and concat of a REMOTE
batch move no data: they rearrange metadata.
"""

from __future__ import annotations

import enum
import json
import sys
import threading
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch

from distbatch import wire
from distbatch.balance import balanced_group_partitions
from distbatch.client import DeleteResult, ShardClient, default_client, validate_node
from distbatch.errors import BatchStatusError, ClearError, NodeError, WireFormatError
from distbatch.ids import validate_id
from distbatch.meta import BatchMeta, FieldMeta

Column = torch.Tensor | list[Any]


class BatchStatus(enum.Enum):
    LOCAL = "LOCAL"
    REMOTE = "REMOTE"
    EMPTY = "EMPTY"


# ----------------------------------------------------------------------------- columns


def _normalize_column(name: str, values: Sequence[Any]) -> Column:
    """Per-task values as a column: stacked when all tensors share shape and dtype, else a list."""
    values = list(values)
    tensors = [isinstance(v, torch.Tensor) for v in values]
    if any(tensors) and not all(tensors):
        raise ValueError(f"field {name!r} mixes tensors and non-tensor values")
    if not values or not tensors[0]:
        return values
    dtypes = {v.dtype for v in values}
    if len(dtypes) > 1:
        raise ValueError(f"field {name!r} mixes dtypes {sorted(map(str, dtypes))}")
    if len({tuple(v.shape) for v in values}) == 1:
        return torch.stack(values)
    return values


def _column_len(col: Column) -> int:
    return col.shape[0] if isinstance(col, torch.Tensor) else len(col)


def _take_column(col: Column, indices: Sequence[int]) -> Column:
    if isinstance(col, torch.Tensor):
        return col[torch.as_tensor(list(indices), dtype=torch.long)]
    # Re-normalize: the picked tasks of a ragged column may all share one shape.
    return _normalize_column("", [col[i] for i in indices])


def _column_items(col: Column) -> list[Any]:
    return list(col.unbind(0)) if isinstance(col, torch.Tensor) else list(col)


def _compact_tensor(t: torch.Tensor) -> torch.Tensor:
    """A tensor that owns exactly its bytes, so pickling a view does not drag its base along."""
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
        return t.clone(memory_format=torch.contiguous_format)
    return t


def _column_for_pickle(col: Column) -> Column:
    if isinstance(col, torch.Tensor):
        return _compact_tensor(col)
    return [_compact_tensor(v) if isinstance(v, torch.Tensor) else v for v in col]


def _column_meta(name: str, col: Column) -> tuple[str | None, list[tuple[int, ...]]]:
    """(wire dtype or None for JSON, per-task shapes) of a LOCAL column."""
    if isinstance(col, torch.Tensor):
        return wire.dtype_name(col.dtype), [tuple(col.shape[1:])] * col.shape[0]
    if col and isinstance(col[0], torch.Tensor):
        return wire.dtype_name(col[0].dtype), [tuple(v.shape) for v in col]
    return None, [()] * len(col)


def _to_column(name: str, value: Any) -> Column:
    if isinstance(value, torch.Tensor):
        if value.is_nested:  # has no shape[0]; its components are a ragged column
            raise ValueError(f"field {name!r} is a nested tensor: pass its components as a list of tensors")
        if value.dim() == 0:
            raise ValueError(f"field {name!r} is a 0-d tensor; it needs a leading task dimension")
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ == "ndarray":
        return _to_column(name, torch.from_numpy(value))
    if isinstance(value, (list, tuple)):
        return _normalize_column(name, value)
    raise ValueError(
        f"field {name!r}: expected a tensor or a list of per-task values, got {type(value).__name__}"
    )


def _check_task_ids(task_ids: Iterable[Any], count: int) -> list[str]:
    ids = [validate_id(t, "task_id") for t in task_ids]
    if len(ids) != count:
        raise ValueError(f"{len(ids)} task ids given for {count} tasks")
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        dup = next(t for t in ids if t in seen or seen.add(t))
        raise ValueError(f"duplicate task id {dup!r}")
    return ids


def new_task_ids(count: int) -> list[str]:
    """Fresh task ids, unique across processes and runs."""
    prefix = uuid.uuid4().hex[:12]
    return [f"{prefix}-{i}" for i in range(count)]


# ----------------------------------------------------------------------------- the batch


class DistributedBatchMemory:
    """A batch of tasks: LOCAL (holds data), REMOTE (holds where the data is) or EMPTY.

    Build one with `from_dict` / `from_list` (LOCAL), `from_meta` / `from_json`
    (REMOTE) or `DistributedBatchMemory()` (EMPTY). See the README for the
    full tour.
    """

    #: gathers of at least this many bytes show a tqdm bar when stderr is a terminal
    progress_min_bytes: ClassVar[int] = 64 << 20

    def __init__(self) -> None:
        self._task_ids: list[str] = []
        self._data: dict[str, Column] | None = None
        self._meta: BatchMeta | None = None
        self._cache: dict[str, Column] = {}
        self._client: ShardClient | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ constructors

    @classmethod
    def _make_local(cls, task_ids: list[str], data: dict[str, Column]) -> DistributedBatchMemory:
        batch = cls()
        if task_ids:
            batch._task_ids = task_ids
            batch._data = data
        return batch

    @classmethod
    def _make_remote(
        cls, meta: BatchMeta, client: ShardClient | None, cache: dict[str, Column] | None = None
    ) -> DistributedBatchMemory:
        batch = cls()
        if len(meta):
            batch._task_ids = list(meta.task_ids)
            batch._meta = meta
            batch._cache = cache or {}
            batch._client = client
        return batch

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], task_ids: Sequence[str] | None = None
    ) -> DistributedBatchMemory:
        """A LOCAL batch from columns: tensors are split on dim 0, lists hold one value per task."""
        columns: dict[str, Column] = {}
        count: int | None = None
        first = ""
        for name, value in data.items():
            validate_id(name, "field")
            col = _to_column(name, value)
            n = _column_len(col)
            if count is None:
                count, first = n, name
            elif n != count:
                raise ValueError(f"field {name!r} has {n} entries but field {first!r} has {count}")
            columns[name] = col
        if count is None:
            count = len(task_ids) if task_ids is not None else 0
        ids = new_task_ids(count) if task_ids is None else _check_task_ids(task_ids, count)
        return cls._make_local(ids, columns)

    @classmethod
    def from_list(
        cls, samples: Sequence[Mapping[str, Any]], task_ids: Sequence[str] | None = None
    ) -> DistributedBatchMemory:
        """A LOCAL batch from per-task dicts that all have the same keys."""
        if not samples:
            return cls.from_dict({}, task_ids=task_ids)
        names = list(samples[0])
        for i, sample in enumerate(samples):
            if set(sample) != set(names):
                raise ValueError(f"sample {i} has fields {sorted(sample)}, sample 0 has {sorted(names)}")
        return cls.from_dict({n: [s[n] for s in samples] for n in names}, task_ids=task_ids)

    @classmethod
    def from_meta(cls, meta: BatchMeta, client: ShardClient | None = None) -> DistributedBatchMemory:
        """A REMOTE batch over existing shards; `client` defaults to the process-wide one."""
        return cls._make_remote(meta, client)

    @classmethod
    def from_json(cls, text: str | bytes, client: ShardClient | None = None) -> DistributedBatchMemory:
        """Inverse of `to_json` (validated: bad JSON, ids or nodes raise a `ValueError`)."""
        from distbatch.meta import MetaFormatError

        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise MetaFormatError(f"batch JSON is not valid: {exc}") from None
        if not isinstance(data, dict) or data.get("status") not in ("REMOTE", "EMPTY"):
            raise MetaFormatError("batch JSON must have status REMOTE or EMPTY")
        if data["status"] == "EMPTY":
            return cls()
        return cls._make_remote(BatchMeta.from_dict(data.get("meta")), client)

    # ------------------------------------------------------------------ basic properties

    @property
    def status(self) -> BatchStatus:
        if not self._task_ids:
            return BatchStatus.EMPTY
        return BatchStatus.REMOTE if self._meta is not None else BatchStatus.LOCAL

    @property
    def task_ids(self) -> list[str]:
        return list(self._task_ids)

    @property
    def fields(self) -> list[str]:
        if self._meta is not None:
            return list(self._meta.fields)
        return list(self._data or {})

    def keys(self) -> list[str]:
        return self.fields

    @property
    def meta(self) -> BatchMeta | None:
        """Where every shard lives (REMOTE); None for LOCAL and EMPTY batches."""
        return self._meta

    @property
    def client(self) -> ShardClient:
        return self._client or default_client()

    def __len__(self) -> int:
        return len(self._task_ids)

    def __contains__(self, name: object) -> bool:
        return name in self.fields

    def __repr__(self) -> str:
        status = self.status.value
        fields = ", ".join(self.fields)
        extra = f", nodes={len(self._meta.nodes)}" if self._meta is not None else ""
        return f"DistributedBatchMemory(status={status}, tasks={len(self)}, fields=[{fields}]{extra})"

    # ------------------------------------------------------------------ indexing

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return self._column(key)
        if isinstance(key, int) or (isinstance(key, torch.Tensor) and key.dim() == 0):
            return self._row(int(key))
        return self._take(self._indices(key))

    def _indices(self, key: Any) -> list[int]:
        n = len(self)
        if isinstance(key, slice):
            return list(range(n))[key]
        if isinstance(key, torch.Tensor):
            key = key.tolist()
        if isinstance(key, range) or isinstance(key, (list, tuple)):
            items = list(key)
            if items and all(isinstance(v, bool) for v in items):
                if len(items) != n:
                    raise IndexError(f"boolean mask has {len(items)} entries for {n} tasks")
                return [i for i, keep in enumerate(items) if keep]
            out = []
            for v in items:
                if not isinstance(v, int) or isinstance(v, bool):
                    raise TypeError(f"batch indexes must be ints, got {v!r}")
                if not -n <= v < n:
                    raise IndexError(f"task index {v} out of range for {n} tasks")
                out.append(v % n)
            if len(set(out)) != len(out):
                raise ValueError("indexes repeat a task; a batch holds each task once")
            return out
        raise TypeError(f"cannot index a batch with {type(key).__name__}")

    def _require_field(self, name: str) -> None:
        if name not in self.fields:
            raise KeyError(f"no field {name!r} in batch; fields: {self.fields}")

    def _column(self, name: str) -> Column:
        self._require_field(name)
        if self._meta is None:
            col = (self._data or {})[name]
            return col if isinstance(col, torch.Tensor) else list(col)
        with self._lock:
            if name not in self._cache:
                self._cache.update(self._gather([name]))
            col = self._cache[name]
        return col if isinstance(col, torch.Tensor) else list(col)

    def _row(self, index: int) -> dict[str, Any]:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"task index {index} out of range for {n} tasks")
        index %= n
        if self._meta is None:
            return {name: col[index] for name, col in (self._data or {}).items()}
        missing = [f for f in self.fields if f not in self._cache]
        fetched = dict(zip(missing, self.client.fetch(self._meta.refs(missing, [index]))))
        return {f: fetched[f] if f in fetched else self._cache[f][index] for f in self.fields}

    def _take(self, indices: list[int]) -> DistributedBatchMemory:
        if self._meta is None:
            data = {name: _take_column(col, indices) for name, col in (self._data or {}).items()}
            return self._make_local([self._task_ids[i] for i in indices], data)
        with self._lock:
            cache = {name: _take_column(col, indices) for name, col in self._cache.items()}
        return self._make_remote(self._meta.take(indices), self._client, cache)

    def __setitem__(self, name: str, value: Any) -> None:
        self._require_local("set a field")
        validate_id(name, "field")
        col = _to_column(name, value)
        if _column_len(col) != len(self):
            raise ValueError(f"field {name!r} has {_column_len(col)} entries for {len(self)} tasks")
        self._data = {**(self._data or {}), name: col}

    def __delitem__(self, name: str) -> None:
        self._require_local("delete a field")
        self._require_field(name)
        del self._data[name]  # type: ignore[union-attr]

    def select_fields(self, names: Iterable[str]) -> DistributedBatchMemory:
        """A batch with only `names` (no data moves; nothing is deleted on the workers)."""
        names = list(names)
        for name in names:
            self._require_field(name)
        if self._meta is None:
            return self._make_local(list(self._task_ids), {n: (self._data or {})[n] for n in names})
        cache = {n: c for n, c in self._cache.items() if n in names}
        return self._make_remote(self._meta.select_fields(names), self._client, cache)

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

    def _gather(self, names: Sequence[str]) -> dict[str, Column]:
        """Fetch whole columns of a REMOTE batch from the workers, concurrently."""
        meta = self._meta
        if meta is None or not names:
            return {}
        refs = meta.refs(names)
        total = sum(r.nbytes or 0 for r in refs)
        bar = None
        if total >= self.progress_min_bytes and sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"gather {len(meta)} tasks")
        try:
            values = self.client.fetch(refs, progress=bar.update if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()
        width = len(names)
        return {name: _normalize_column(name, values[j::width]) for j, name in enumerate(names)}

    def to_local(self) -> DistributedBatchMemory:
        """A LOCAL batch with every field, gathering what is not cached yet (LOCAL/EMPTY: self)."""
        if self._meta is None:
            return self
        with self._lock:
            missing = [f for f in self.fields if f not in self._cache]
            self._cache.update(self._gather(missing))
            data = {f: self._cache[f] for f in self.fields}
        return self._make_local(list(self._task_ids), data)

    def get_data(self) -> dict[str, Column]:
        """Every field as a column (gathered first if REMOTE)."""
        local = self.to_local()
        return {name: local[name] for name in local.fields}

    def export_shards(self, node: str) -> tuple[dict[tuple[str, str], Any], BatchMeta]:
        """A LOCAL batch as `{(task_id, field): value}` plus the metadata naming `node` as holder."""
        self._require_local("export shards")
        node = validate_node(node)
        shards: dict[tuple[str, str], Any] = {}
        fields: dict[str, FieldMeta] = {}
        for name, col in (self._data or {}).items():
            if isinstance(col, torch.Tensor):
                if (problem := wire.tensor_problem(col)) is not None:
                    raise WireFormatError(f"field {name!r}: {problem}")
                col = col.detach().cpu().contiguous()
            try:
                dtype, shapes = _column_meta(name, col)
            except WireFormatError as exc:  # a list of tensors of a dtype the wire lacks
                raise WireFormatError(f"field {name!r}: {exc}") from None
            fields[name] = FieldMeta(dtype, [0] * len(self), shapes)
            for task_id, value in zip(self._task_ids, _column_items(col)):
                shards[(task_id, name)] = value
        return shards, BatchMeta(list(self._task_ids), [node], fields)

    def to_remote(self, node: str, client: ShardClient | None = None) -> DistributedBatchMemory:
        """Push a LOCAL batch's shards to `node`; returns the REMOTE batch that points at them."""
        if self.status is BatchStatus.EMPTY:
            return DistributedBatchMemory()
        if self._meta is not None:
            raise BatchStatusError("batch is already REMOTE; to_local() first to move it elsewhere")
        shards, meta = self.export_shards(node)
        client = client or self._client
        (client or default_client()).put(meta.nodes[0], shards)
        return self._make_remote(meta, client)

    def clear(self) -> int:
        """Delete every shard this batch names on the nodes that hold them; idempotent.

        Returns how many shards were deleted (0 for LOCAL / EMPTY batches, whose
        data is not on any worker). Every node is tried; if some cannot be reached,
        `ClearError` reports per node what was deleted and what may remain, and calling
        `clear()` again once they are back finishes the job.
        """
        if self._meta is None:
            return 0
        plan = self._meta.keys_by_node()
        try:
            outcome = self.client.delete_each(plan)
        finally:
            with self._lock:  # even a partial clear may have deleted cached shards
                self._cache.clear()
        deleted = {n: r.deleted for n, r in outcome.items() if isinstance(r, DeleteResult)}
        failed = {n: r for n, r in outcome.items() if isinstance(r, NodeError)}
        if failed:
            undeleted = {n: len(plan[n]) for n in failed}
            raise ClearError(failed, sum(deleted.values()), undeleted, deleted_by_node=deleted)
        return sum(deleted.values())

    # ------------------------------------------------------------------ splitting

    def chunk(self, n: int) -> list[DistributedBatchMemory]:
        """`n` contiguous batches in order; sizes differ by at most one."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"chunk count must be a positive int, got {n!r}")
        base, extra = divmod(len(self), n)
        out, start = [], 0
        for i in range(n):
            size = base + (1 if i < extra else 0)
            out.append(self._take(list(range(start, start + size))))
            start += size
        return out

    def lengths(self, field: str | None = None) -> list[int]:
        """Per-task length (first dimension) of a tensor field, from metadata when REMOTE."""
        name = field or self._default_length_field()
        self._require_field(name)
        if self._meta is not None:
            return self._meta.lengths(name)
        col = (self._data or {})[name]
        if isinstance(col, torch.Tensor):
            return [col.shape[1] if col.dim() > 1 else 1] * col.shape[0]
        if col and not isinstance(col[0], torch.Tensor):
            raise ValueError(f"field {name!r} holds JSON values; lengths need a tensor field")
        return [v.shape[0] if v.dim() else 1 for v in col]

    def _default_length_field(self) -> str:
        if self._meta is not None:
            tensor_fields = [n for n, fm in self._meta.fields.items() if fm.is_tensor]
        else:
            tensor_fields = [
                n
                for n, c in (self._data or {}).items()
                if isinstance(c, torch.Tensor) or (c and isinstance(c[0], torch.Tensor))
            ]
        if "input_ids" in tensor_fields:
            return "input_ids"
        if not tensor_fields:
            raise ValueError("no tensor field to take lengths from; pass length_field")
        return tensor_fields[0]

    def chunk_balanced(
        self, n: int, group_size: int = 1, length_field: str | None = None
    ) -> list[DistributedBatchMemory]:
        """`n` batches with balanced total length, groups of `group_size` kept together.

        Lengths come from metadata, so a REMOTE batch is balanced without
        fetching a byte. Chunks hold equal task counts when the group count is
        divisible by `n` (else counts differ by one group); tasks keep their
        relative order inside a chunk.
        """
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"chunk count must be a positive int, got {n!r}")
        if not isinstance(group_size, int) or group_size < 1 or len(self) % group_size:
            raise ValueError(f"{len(self)} tasks cannot be cut into groups of {group_size}")
        if not len(self):
            return [DistributedBatchMemory() for _ in range(n)]
        lengths = self.lengths(length_field)
        group_lengths = [sum(lengths[i : i + group_size]) for i in range(0, len(lengths), group_size)]
        parts = balanced_group_partitions(group_lengths, n)
        parts.sort(key=lambda p: p[0] if p else len(group_lengths))
        return [self._take([g * group_size + j for g in part for j in range(group_size)]) for part in parts]

    # ------------------------------------------------------------------ combining

    def union(self, other: DistributedBatchMemory, overwrite: bool = False) -> DistributedBatchMemory:
        """A new batch with the fields of both, rows aligned by task id."""
        if other.status is BatchStatus.EMPTY:
            return self._take(list(range(len(self))))
        if self.status is BatchStatus.EMPTY:
            return other._take(list(range(len(other))))
        if self.status is not other.status:
            raise BatchStatusError(
                f"cannot union a {self.status.value} batch with a {other.status.value} one: "
                "call to_local() on the REMOTE one or to_remote(node) on the LOCAL one"
            )
        if set(self._task_ids) != set(other._task_ids):
            mine, theirs = set(self._task_ids), set(other._task_ids)
            missing = sorted(mine - theirs)[:5]
            extra = sorted(theirs - mine)[:5]
            raise ValueError(f"union needs the same task ids: missing in other {missing}, extra {extra}")
        clash = [f for f in other.fields if f in self.fields]
        if clash and not overwrite:
            raise ValueError(f"fields {clash} are in both batches; pass overwrite=True to replace them")
        position = {t: i for i, t in enumerate(other._task_ids)}
        rows = [position[t] for t in self._task_ids]
        aligned = rows == list(range(len(rows)))
        order = self.fields + [f for f in other.fields if f not in self.fields]
        if self._meta is None:
            data = dict(self._data or {})
            for name, col in (other._data or {}).items():
                data[name] = col if aligned else _take_column(col, rows)
            return self._make_local(list(self._task_ids), {f: data[f] for f in order})
        other_meta = other._meta if other._meta is not None else BatchMeta([], [])
        meta = BatchMeta.merge(
            list(self._task_ids), [(self._meta, None), (other_meta, None if aligned else rows)], order
        )
        cache = {n: c for n, c in self._cache.items() if n not in other.fields}
        for name, col in other._cache.items():
            cache[name] = col if aligned else _take_column(col, rows)
        return self._make_remote(meta, self._client or other._client, cache)

    def union_(self, other: DistributedBatchMemory, overwrite: bool = False) -> DistributedBatchMemory:
        """`union` in place; on any error the batch is left unchanged."""
        result = self.union(other, overwrite=overwrite)
        with self._lock:
            self._task_ids, self._data, self._meta = result._task_ids, result._data, result._meta
            self._cache, self._client = result._cache, result._client
        return self

    @staticmethod
    def concat(batches: Sequence[DistributedBatchMemory]) -> DistributedBatchMemory:
        """Tasks of `batches` one after another: same fields, same status, no repeated task id."""
        parts = [b for b in batches if b.status is not BatchStatus.EMPTY]
        if not parts:
            return DistributedBatchMemory()
        statuses = {b.status for b in parts}
        if len(statuses) > 1:
            raise BatchStatusError(
                "cannot concat LOCAL and REMOTE batches: to_local() or to_remote(node) them first"
            )
        names = parts[0].fields
        for i, b in enumerate(parts[1:], start=1):
            if set(b.fields) != set(names):
                raise ValueError(f"batch {i} has fields {sorted(b.fields)}, batch 0 has {sorted(names)}")
        task_ids = [t for b in parts for t in b._task_ids]
        _check_task_ids(task_ids, len(task_ids))
        if parts[0]._meta is not None:
            metas = [b._meta for b in parts]
            for name in names:
                dtypes = {m.fields[name].dtype for m in metas}  # type: ignore[union-attr]
                if len(dtypes) > 1:
                    raise ValueError(f"field {name!r} has different dtypes across batches: {dtypes}")
            meta = BatchMeta.concat([m.select_fields(names) for m in metas])  # type: ignore[union-attr]
            cache = {}
            for name in names:
                if all(name in b._cache for b in parts):
                    cache[name] = _concat_columns(name, [b._cache[name] for b in parts])
            return DistributedBatchMemory._make_remote(meta, parts[0]._client, cache)
        data = {name: _concat_columns(name, [b._data[name] for b in parts]) for name in names}  # type: ignore[index]
        return DistributedBatchMemory._make_local(task_ids, data)

    # ------------------------------------------------------------------ serialization

    def to_json(self) -> str:
        """Metadata of a REMOTE (or EMPTY) batch as JSON; never carries data."""
        if self.status is BatchStatus.LOCAL:
            raise BatchStatusError(
                "to_json carries metadata only: to_remote(node) first, or pickle a LOCAL batch"
            )
        if self._meta is None:
            return json.dumps({"status": "EMPTY"})
        return json.dumps({"status": "REMOTE", "meta": self._meta.to_dict()}, separators=(",", ":"))

    def __getstate__(self) -> dict[str, Any]:
        status = self.status
        if status is BatchStatus.REMOTE:
            return {"status": "REMOTE", "meta": self._meta.to_dict()}  # type: ignore[union-attr]
        if status is BatchStatus.LOCAL:
            data = {name: _column_for_pickle(col) for name, col in (self._data or {}).items()}
            return {"status": "LOCAL", "task_ids": self._task_ids, "data": data}
        return {"status": "EMPTY"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        if state["status"] == "REMOTE":
            meta = BatchMeta.from_dict(state["meta"])
            self._task_ids, self._meta = list(meta.task_ids), meta
        elif state["status"] == "LOCAL":
            self._task_ids, self._data = list(state["task_ids"]), dict(state["data"])


def _concat_columns(name: str, cols: Sequence[Column]) -> Column:
    if all(isinstance(c, torch.Tensor) for c in cols):
        tails = {tuple(c.shape[1:]) for c in cols}  # type: ignore[union-attr]
        dtypes = {c.dtype for c in cols}  # type: ignore[union-attr]
        if len(dtypes) > 1:
            raise ValueError(f"field {name!r} has different dtypes across batches: {dtypes}")
        if len(tails) == 1:
            return torch.cat(list(cols))  # type: ignore[arg-type]
    return _normalize_column(name, [v for c in cols for v in _column_items(c)])
