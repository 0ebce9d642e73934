"""`DistributedBatchMemory`: one batch object, LOCAL (data here), REMOTE (metadata only) or EMPTY.

A REMOTE batch names, per task and field, the worker that holds the shard;
indexing a field gathers just that column from those workers, concurrently,
and caches it. Slicing, chunking, balancing, union and concat of a REMOTE
batch move no data: they rearrange metadata.
"""

from __future__ import annotations

import enum
import json
import operator
import sys
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from distbatch import wire
from distbatch.balance import balanced_group_partitions
from distbatch.batch.meta import BatchMeta, FieldMeta, pick
from distbatch.client.shard_client import DeleteResult, ShardClient, cut_points, default_client
from distbatch.errors import BatchStatusError, ClearError, NodeError, WireFormatError
from distbatch.gc_pause import paused_gc
from distbatch.ids import validate_id, validate_node
from distbatch.wire.shapes import RowShapes

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


def _take_column(col: Column, indices: Sequence[int] | np.ndarray) -> Column:
    rows = np.asarray(indices, dtype=np.int64).reshape(-1)
    if isinstance(col, torch.Tensor):
        return col[torch.from_numpy(rows)]
    # Re-normalize: the picked tasks of a ragged column may all share one shape.
    return _normalize_column("", pick(col, rows))


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
        for dup in ids:
            if dup in seen:
                raise ValueError(f"duplicate task id {dup!r}")
            seen.add(dup)
    return ids


def new_task_ids(count: int) -> list[str]:
    """Fresh task ids, unique across processes and runs."""
    prefix = uuid.uuid4().hex[:12]
    return [f"{prefix}-{i}" for i in range(count)]


def _reorder(items: list[Any], order: np.ndarray) -> list[Any]:
    """`items` placed so that item k lands at position order[k]."""
    if len(items) <= 1:
        return list(items)
    return list(operator.itemgetter(*np.argsort(order, kind="stable").tolist())(items))


def _cu_seqlens(lengths: np.ndarray) -> torch.Tensor:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:
        raise ValueError(f"{int(offsets[-1])} packed rows do not fit int32 cu_seqlens")
    return torch.from_numpy(offsets.astype(np.int32))


def _cat(tensors: Sequence[torch.Tensor], allocate: Callable[[int], Any] | None) -> torch.Tensor:
    """One flat tensor of `tensors` (the tensor itself when there is one): joined into a buffer
    from `allocate` (the client's recycled receive buffers) when given, else into fresh memory."""
    if len(tensors) == 1:
        return tensors[0]
    if not tensors:
        return torch.empty(0)
    total = sum(t.numel() for t in tensors)
    nbytes = total * tensors[0].element_size()
    if allocate is None or not nbytes:
        return torch.cat(list(tensors))
    out = torch.frombuffer(allocate(nbytes), dtype=tensors[0].dtype, count=total)
    return torch.cat(list(tensors), out=out)


class _Gathered:
    """One field gathered from the workers, in task order: JSON values, or the flat tensors of
    every task's elements (one per response, in order) plus their shapes: the columnar form
    both views come from. A ragged column's per-task views point into the responses, so
    several responses are never joined just to be split again."""

    __slots__ = ("pieces", "piece_shapes", "shapes", "json", "allocate")

    def __init__(
        self,
        pieces: list[torch.Tensor],
        piece_shapes: list[RowShapes],
        json: list[Any] | None = None,
        allocate: Callable[[int], Any] | None = None,
    ) -> None:
        self.pieces, self.piece_shapes, self.json = pieces, piece_shapes, json
        self.shapes = RowShapes.concat(piece_shapes) if json is None else None
        # Where joined responses go (the client's recycled receive buffers, already mapped in,
        # so the one copy a join costs is not also a page fault per 4 KiB).
        self.allocate = allocate

    @property
    def tensor_shapes(self) -> RowShapes:
        """Every task's shape (a JSON field has none)."""
        if self.shapes is None:
            raise ValueError("a JSON field has no shapes")
        return self.shapes

    @staticmethod
    def assemble(
        name: str,
        n: int,
        pieces: list[tuple[np.ndarray, wire.RawColumn]],
        allocate: Callable[[int], Any] | None = None,
    ) -> _Gathered:
        """Put the responses' columns (each covering some batch rows) in batch order.

        Responses that cover the batch in order are used as they are (zero-copy); rows
        interleaved across nodes cost one gather.
        """
        order = np.concatenate([rows for rows, _ in pieces]) if pieces else np.zeros(0, dtype=np.int64)
        in_order = bool(np.array_equal(order, np.arange(n)))
        if pieces[0][1].dtype is None:
            values = [v for _, column in pieces for v in column.values or []]
            return _Gathered([], [], values if in_order else _reorder(values, order))
        dtypes = {column.dtype for _, column in pieces}
        if len(dtypes) > 1:
            raise WireFormatError(
                f"field {name!r} came back with different dtypes {sorted(map(str, dtypes))}"
            )
        flats = [wire.column_tensor(column).reshape(-1) for _, column in pieces]
        piece_shapes = [column.shapes for _, column in pieces]
        if in_order:
            return _Gathered(flats, piece_shapes, allocate=allocate)  # type: ignore[arg-type]
        shapes = RowShapes.concat(piece_shapes)  # type: ignore[arg-type]
        flat = _cat(flats, allocate)
        back = np.argsort(order, kind="stable")
        if shapes.shape is not None:  # equal rows: one C-level take
            width = max(1, int(np.prod(shapes.shape)))
            taken = flat.view(-1, width)[torch.from_numpy(back)].reshape(-1) if flat.numel() else flat
            return _Gathered([taken], [shapes.take(back)])
        rows = list(torch.split(flat, shapes.counts().tolist()))
        return _Gathered([_cat(_reorder(rows, order), allocate) if rows else flat], [shapes.take(back)])

    def flat(self) -> torch.Tensor:
        """Every task's elements in one tensor (joins several responses: one copy)."""
        return _cat(self.pieces, self.allocate)

    def column(self) -> Column:
        """The column as `batch[field]` gives it: stacked when shapes agree, else a list of views."""
        if self.json is not None:
            return list(self.json)
        shapes = self.tensor_shapes
        if shapes.shape is not None:
            return self.flat().view(shapes.n, *shapes.shape)
        with paused_gc():  # one tensor per task: no collection passes over them mid-build
            return [
                view
                for piece, shapes in zip(self.pieces, self.piece_shapes)
                for view in wire.split_rows(piece, shapes)
            ]

    def packed(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self.json is not None:
            raise ValueError(f"field {name!r} holds JSON values; packed() needs a tensor field")
        return _pack(name, self.flat(), self.tensor_shapes)


def _pack(name: str, flat: torch.Tensor, shapes: RowShapes) -> tuple[torch.Tensor, torch.Tensor]:
    """(values along dim 0, int32 cu_seqlens) from a flat tensor of every row's elements."""
    if shapes.shape == () or (shapes.ranks is not None and not shapes.ranks.any()):
        return flat.reshape(shapes.n), _cu_seqlens(np.ones(shapes.n, dtype=np.int64))  # 0-d: one each
    tail = shapes.packable()
    if tail is None:
        raise ValueError(
            f"field {name!r}: tasks differ in rank or trailing dimensions, so their values cannot be "
            "concatenated along dim 0; index the field for a list of per-task tensors instead"
        )
    lengths = shapes.first_dims()
    return flat.reshape(int(lengths.sum()), *tail), _cu_seqlens(lengths)


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
        # Gathered fields of a REMOTE batch: a column, or a `_Gathered` not yet split into
        # per-task views (what `packed` and `afetch` leave; `_cached_column` splits it once).
        self._cache: dict[str, Column | _Gathered] = {}
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

    def _remote_meta(self) -> BatchMeta:
        """The metadata of a REMOTE batch (callers have checked the status)."""
        if self._meta is None:
            raise BatchStatusError(f"this {self.status.name} batch has no metadata")
        return self._meta

    @classmethod
    def _make_remote(
        cls, meta: BatchMeta, client: ShardClient | None, cache: dict[str, Column | _Gathered] | None = None
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
        from distbatch.errors import MetaFormatError

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
            col = self._cached_column(name)
        return col if isinstance(col, torch.Tensor) else list(col)

    def _cached_column(self, name: str) -> Column:
        """A cached field as a column, splitting a gathered one into per-task views once."""
        value = self._cache[name]
        if isinstance(value, _Gathered):
            value = self._cache[name] = value.column()
        return value

    def _cached_columns(self) -> dict[str, Column]:
        return {name: self._cached_column(name) for name in list(self._cache)}

    def _row(self, index: int) -> dict[str, Any]:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"task index {index} out of range for {n} tasks")
        index %= n
        if self._meta is None:
            return {name: col[index] for name, col in (self._data or {}).items()}
        missing = [f for f in self.fields if f not in self._cache]
        fetched = self._meta.take([index])
        one = DistributedBatchMemory._make_remote(fetched, self._client)._gather(missing) if missing else {}
        with self._lock:
            cached = {f: self._cached_column(f)[index] for f in self.fields if f not in one}
        return {f: one[f][0] if f in one else cached[f] for f in self.fields}

    def _take(self, indices: Sequence[int] | np.ndarray) -> DistributedBatchMemory:
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        if self._meta is None:
            data = {name: _take_column(col, indices) for name, col in (self._data or {}).items()}
            return self._make_local(pick(self._task_ids, indices), data)
        with self._lock:
            cache: dict[str, Column | _Gathered] = {
                name: _take_column(col, indices) for name, col in self._cached_columns().items()
            }
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
        return {name: gathered.column() for name, gathered in self._gather_columns(names).items()}

    def _gather_columns(self, names: Sequence[str]) -> dict[str, _Gathered]:
        """Fetch fields as one request per node and field set (split to the client's bounds),
        nodes concurrently; each field comes back as one tensor of values in task order."""
        plan = self._fetch_plan(names)
        if plan is None:
            return {}
        requests, placed = plan
        bar = self._progress_bar(names)
        try:
            bundles = self.client.fetch_products(requests, progress=bar.update if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()
        return self._assemble(names, requests, placed, bundles)

    async def _agather_columns(self, names: Sequence[str]) -> dict[str, _Gathered]:
        plan = self._fetch_plan(names)
        if plan is None:
            return {}
        requests, placed = plan
        bundles = await self.client.afetch_products(requests)
        return self._assemble(names, requests, placed, bundles)

    def _fetch_plan(
        self, names: Sequence[str]
    ) -> tuple[list[tuple[str, list[str], list[str]]], list[np.ndarray]] | None:
        """The requests that gather `names` (per node and field set, cut to the client's bounds)
        and the batch rows each covers; None when there is nothing to fetch."""
        meta = self._meta
        if meta is None or not names:
            return None
        client = self.client
        requests: list[tuple[str, list[str], list[str]]] = []
        placed: list[np.ndarray] = []  # the batch rows each request covers
        for node, products in meta.plan(list(names)).items():
            max_bytes = client.request_bytes_bound(node)
            for rows, fields in products:
                per_task = sum(meta.fields[f].row_nbytes()[rows] for f in fields)
                cuts = cut_points(per_task, max_bytes, client.max_keys_per_request)
                for a, b in zip(cuts, cuts[1:]):
                    chunk = rows[a:b]
                    requests.append((node, pick(self._task_ids, chunk), fields))
                    placed.append(chunk)
        return requests, placed

    def _progress_bar(self, names: Sequence[str]) -> Any:
        """A tqdm bar for a big gather when a person is watching (stderr is a terminal), else None."""
        meta = self._remote_meta()
        total = meta.select_fields(names).total_bytes()
        if total < self.progress_min_bytes or not sys.stderr.isatty():
            return None
        from tqdm import tqdm

        return tqdm(total=total, unit="B", unit_scale=True, desc=f"gather {len(meta)} tasks")

    def _assemble(
        self,
        names: Sequence[str],
        requests: list[tuple[str, list[str], list[str]]],
        placed: list[np.ndarray],
        bundles: list[wire.Bundle],
    ) -> dict[str, _Gathered]:
        pieces: dict[str, list[tuple[np.ndarray, wire.RawColumn]]] = {name: [] for name in names}
        for (node, _, fields), rows, bundle in zip(requests, placed, bundles):
            for name in fields:
                column = bundle.columns.get(name)
                if column is None or column.rows is not None:
                    raise WireFormatError(
                        f"{node}: field {name!r} came back in several dtypes; the batch's metadata "
                        f"says {self._meta.fields[name].dtype}"  # type: ignore[union-attr]
                    )
                pieces[name].append((rows, column))
        allocate = self.client.receive_buffer
        return {name: _Gathered.assemble(name, len(self), pieces[name], allocate) for name in names}

    async def afetch(self, fields: Sequence[str] | None = None) -> DistributedBatchMemory:
        """Gather `fields` (default: all) of a REMOTE batch into its cache without blocking the
        caller's event loop; `batch[field]` then answers from memory. Returns the batch."""
        names = self.fields if fields is None else list(fields)
        for name in names:
            self._require_field(name)
        missing = [n for n in names if n not in self._cache]
        if self._meta is not None and missing:
            gathered = await self._agather_columns(missing)
            with self._lock:
                for name, value in gathered.items():
                    self._cache.setdefault(name, value)
        return self

    async def ato_local(self) -> DistributedBatchMemory:
        """`to_local()` for async controllers: gathers on the caller's loop without blocking it."""
        if self._meta is None:
            return self
        await self.afetch()
        return self.to_local()

    def to_local(self) -> DistributedBatchMemory:
        """A LOCAL batch with every field, gathering what is not cached yet (LOCAL/EMPTY: self)."""
        if self._meta is None:
            return self
        with self._lock:
            missing = [f for f in self.fields if f not in self._cache]
            self._cache.update(self._gather(missing))
            data = {f: self._cached_column(f) for f in self.fields}
        return self._make_local(list(self._task_ids), data)

    def packed(
        self, field: str, device: torch.device | str | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(values, cu_seqlens)`: the tasks' values of `field` concatenated along dim 0, and an
        int32 tensor of the N+1 offsets where each task starts (the flash-attn varlen convention).

        For trainers that remove padding. Built without per-task tensors when REMOTE (the
        gathered column is already one buffer); a LOCAL ragged column costs one `cat`.
        0-d values count as one row each. `device=` moves both with one copy each.
        """
        self._require_field(field)
        if self._meta is not None:
            with self._lock:
                cached = self._cache.get(field)
                if cached is None:
                    cached = self._cache[field] = self._gather_columns([field])[field]
            if isinstance(cached, _Gathered):
                values, cu = cached.packed(field)
                return _to_device(values, cu, device)
            col: Column = cached
        else:
            col = (self._data or {})[field]
        values, cu = _pack_column(field, col)
        return _to_device(values, cu, device)

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
        node = validate_node(node)
        columns: dict[str, wire.RawColumn] = {}
        fields: dict[str, FieldMeta] = {}
        n = len(self)
        for name, col in (self._data or {}).items():
            if isinstance(col, torch.Tensor):
                if (problem := wire.tensor_problem(col)) is not None:
                    raise WireFormatError(f"field {name!r}: {problem}")
                tensor = col.detach()
                if copy and tensor.device.type == "cpu":
                    tensor = tensor.clone(memory_format=torch.contiguous_format)
                try:
                    column = wire.tensor_column(tensor)
                except WireFormatError as exc:
                    raise WireFormatError(f"field {name!r}: {exc}") from None
            else:
                column = wire.list_column(name, col, self._task_ids, copy=copy)
            columns[name] = column
            shapes = column.shapes if column.shapes is not None else RowShapes.uniform(n, ())
            fields[name] = FieldMeta(column.dtype, np.zeros(n, dtype=np.int32), shapes)
        return wire.Bundle(list(self._task_ids), columns), BatchMeta(list(self._task_ids), [node], fields)


    def to_remote(self, node: str, client: ShardClient | None = None) -> DistributedBatchMemory:
        """Push a LOCAL batch's columns to `node`; returns the REMOTE batch that points at them."""
        if self.status is BatchStatus.EMPTY:
            return DistributedBatchMemory()
        if self._meta is not None:
            raise BatchStatusError("batch is already REMOTE; to_local() first to move it elsewhere")
        bundle, meta = self.export_bundle(node)
        client = client or self._client
        (client or default_client()).put_bundle(meta.nodes[0], bundle)
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
        plan = self._clear_plan()
        try:
            outcome = self.client.delete_products_each(plan)
        finally:
            with self._lock:  # even a partial clear may have deleted cached shards
                self._cache.clear()
        return _cleared(plan, outcome)

    async def aclear(self) -> int:
        """`clear()` for async controllers, on the caller's loop without blocking it."""
        if self._meta is None:
            return 0
        plan = self._clear_plan()
        try:
            outcome = await self.client.adelete_products_each(plan)
        finally:
            with self._lock:
                self._cache.clear()
        return _cleared(plan, outcome)

    def _clear_plan(self) -> dict[str, list[tuple[list[str], list[str]]]]:
        return {
            node: [(pick(self._task_ids, rows), names) for rows, names in products]
            for node, products in self._remote_meta().plan(list(self._remote_meta().fields)).items()
        }

    # ------------------------------------------------------------------ splitting

    def chunk(self, n: int) -> list[DistributedBatchMemory]:
        """`n` contiguous batches in order; sizes differ by at most one."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"chunk count must be a positive int, got {n!r}")
        base, extra = divmod(len(self), n)
        out, start = [], 0
        for i in range(n):
            size = base + (1 if i < extra else 0)
            out.append(self._take(np.arange(start, start + size)))
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
        lengths = np.asarray(self.lengths(length_field), dtype=np.int64)
        group_lengths = lengths.reshape(-1, group_size).sum(axis=1)
        parts = balanced_group_partitions(group_lengths.tolist(), n)
        parts.sort(key=lambda p: p[0] if p else len(group_lengths))
        offsets = np.arange(group_size)
        return [
            self._take((np.asarray(part, dtype=np.int64)[:, None] * group_size + offsets).reshape(-1))
            for part in parts
        ]

    # ------------------------------------------------------------------ combining

    def union(self, other: DistributedBatchMemory, overwrite: bool = False) -> DistributedBatchMemory:
        """A new batch with the fields of both, rows aligned by task id."""
        if other.status is BatchStatus.EMPTY:
            return self._take(np.arange(len(self)))
        if self.status is BatchStatus.EMPTY:
            return other._take(np.arange(len(other)))
        if self.status is not other.status:
            raise BatchStatusError(
                f"cannot union a {self.status.value} batch with a {other.status.value} one: "
                "call to_local() on the REMOTE one or to_remote(node) on the LOCAL one"
            )
        aligned = self._task_ids == other._task_ids  # the usual case, checked in C
        if not aligned and set(self._task_ids) != set(other._task_ids):
            mine, theirs = set(self._task_ids), set(other._task_ids)
            missing = sorted(mine - theirs)[:5]
            extra = sorted(theirs - mine)[:5]
            raise ValueError(f"union needs the same task ids: missing in other {missing}, extra {extra}")
        clash = [f for f in other.fields if f in self.fields]
        if clash and not overwrite:
            raise ValueError(f"fields {clash} are in both batches; pass overwrite=True to replace them")
        rows: np.ndarray | None = None
        if not aligned:
            position = dict(zip(other._task_ids, range(len(other._task_ids))))
            rows = np.fromiter(map(position.__getitem__, self._task_ids), dtype=np.int64, count=len(self))
        order = self.fields + [f for f in other.fields if f not in self.fields]
        if self._meta is None:
            data = dict(self._data or {})
            for name, col in (other._data or {}).items():
                data[name] = col if rows is None else _take_column(col, rows)
            return self._make_local(list(self._task_ids), {f: data[f] for f in order})
        other_meta = other._meta if other._meta is not None else BatchMeta([], [])
        meta = BatchMeta.merge(list(self._task_ids), [(self._meta, None), (other_meta, rows)], order)
        cache: dict[str, Column | _Gathered] = {n: c for n, c in self._cache.items() if n not in other.fields}
        with other._lock:
            if rows is None:
                cache.update(other._cache)
            else:
                cache.update((name, _take_column(col, rows)) for name, col in other._cached_columns().items())
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
            cache: dict[str, Column | _Gathered] = {}
            for name in names:
                columns = []
                for b in parts:
                    with b._lock:
                        if name in b._cache:
                            columns.append(b._cached_column(name))
                if len(columns) == len(parts):
                    cache[name] = _concat_columns(name, columns)
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
            # The metadata object itself: numpy arrays pickle as bytes, far faster than JSON lists.
            return {"status": "REMOTE", "meta": self._meta}
        if status is BatchStatus.LOCAL:
            data = {name: _column_for_pickle(col) for name, col in (self._data or {}).items()}
            return {"status": "LOCAL", "task_ids": self._task_ids, "data": data}
        return {"status": "EMPTY"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        if state["status"] == "REMOTE":
            meta = state["meta"]
            if not isinstance(meta, BatchMeta):  # pickled by an earlier version: the dict form
                meta = BatchMeta.from_dict(meta)
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


def _pack_column(name: str, col: Column) -> tuple[torch.Tensor, torch.Tensor]:
    """`packed()` of a column held in memory: a view for a stacked tensor, one `cat` for a list."""
    if isinstance(col, torch.Tensor):
        n = col.shape[0]
        return _pack(name, col.reshape(-1), RowShapes.uniform(n, col.shape[1:]))
    if not col or not isinstance(col[0], torch.Tensor):
        raise ValueError(f"field {name!r} holds JSON values; packed() needs a tensor field")
    shapes = RowShapes.from_list([tuple(v.shape) for v in col])
    flat = torch.cat([v.reshape(-1) for v in col])
    return _pack(name, flat, shapes)


def _to_device(
    values: torch.Tensor, cu: torch.Tensor, device: torch.device | str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if device is None:
        return values, cu
    return values.to(device), cu.to(device)


def _cleared(
    plan: dict[str, list[tuple[list[str], list[str]]]], outcome: dict[str, DeleteResult | NodeError]
) -> int:
    """The count a clear deleted, or `ClearError` naming the nodes that failed."""
    deleted = {n: r.deleted for n, r in outcome.items() if isinstance(r, DeleteResult)}
    failed = {n: r for n, r in outcome.items() if isinstance(r, NodeError)}
    if failed:
        undeleted = {n: sum(len(ids) * len(names) for ids, names in plan[n]) for n in failed}
        raise ClearError(failed, sum(deleted.values()), undeleted, deleted_by_node=deleted)
    return sum(deleted.values())
