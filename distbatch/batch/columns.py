"""Columns held in memory: one field's per-task values as a stacked tensor or a list.

Owns what a LOCAL batch does to its data: turning user input into columns, taking rows,
concatenating, packing for varlen trainers (`pack_rows` serves gathered columns too), making
columns safe to pickle, and exporting them as a wire bundle. Separate from the batch object
because none of it depends on the batch's status or state: these are functions of columns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from distbatch import wire
from distbatch.batch.meta import SHARE_ORDINALS, BatchMeta, FieldMeta, pick
from distbatch.batch.ragged import RaggedViews, compact_tensor, nested_column
from distbatch.errors import InvalidArgumentError, WireFormatError
from distbatch.ids import validate_id
from distbatch.wire.shapes import RowShapes

Column = torch.Tensor | list[Any]


def checked_values(name: str, values: Sequence[Any]) -> list[Any]:
    """Per-task values as a list, checked: all tensors of one dtype, or no tensor at all."""
    values = list(values)
    tensors = [isinstance(v, torch.Tensor) for v in values]
    if any(tensors) and not all(tensors):
        raise InvalidArgumentError(f"field {name!r} mixes tensors and non-tensor values")
    if values and tensors[0]:
        dtypes = {v.dtype for v in values}
        if len(dtypes) > 1:
            raise InvalidArgumentError(f"field {name!r} mixes dtypes {sorted(map(str, dtypes))}")
    return values


def normalize_column(name: str, values: Sequence[Any]) -> Column:
    """New per-task values as a column: stacked (a fixed-shape field) when all are tensors of
    one shape, else a list (ragged tensors, or JSON values). This decides the field's kind
    once, when the values are given; slices, chunks and gathers keep it."""
    values = checked_values(name, values)
    if values and isinstance(values[0], torch.Tensor) and len({tuple(v.shape) for v in values}) == 1:
        return torch.stack(values)
    return values


def to_column(name: str, value: Any) -> Column:
    """A field's value as given to `from_dict` or `batch[name] = ...`, as a column.

    A nested tensor (jagged or strided) is a ragged field whose tasks are its `unbind()` (see
    `nested_column`).
    """
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            col = nested_column(name, value)
            return col if isinstance(col, RaggedViews) else normalize_column(name, col)
        if value.dim() == 0:
            raise InvalidArgumentError(f"field {name!r} is a 0-d tensor; it needs a leading task dimension")
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ == "ndarray":
        return _numpy_column(name, value)
    if isinstance(value, (list, tuple)):
        return normalize_column(name, value)
    raise InvalidArgumentError(
        f"field {name!r}: expected a tensor or a list of per-task values, got {type(value).__name__}"
    )


def _numpy_column(name: str, value: np.ndarray) -> Column:
    """A numpy array as a column: numbers as a tensor over its memory, strings (and an object
    array's items) as per-task values."""
    if value.dtype.kind in "UO":
        return normalize_column(name, value.tolist())
    try:
        return to_column(name, torch.from_numpy(value))
    except TypeError:
        raise InvalidArgumentError(
            f"field {name!r}: a numpy array of dtype {value.dtype} cannot be a column: pass numbers, "
            "strings, or per-task values (a list)"
        ) from None


def columns_from_dict(data: Mapping[str, Any]) -> tuple[dict[str, Column], int | None]:
    """`from_dict`'s input as validated columns of one length, and that length (None: no field)."""
    columns: dict[str, Column] = {}
    count: int | None = None
    first = ""
    for name, value in data.items():
        validate_id(name, "field")
        col = to_column(name, value)
        n = column_len(col)
        if count is None:
            count, first = n, name
        elif n != count:
            raise InvalidArgumentError(f"field {name!r} has {n} entries but field {first!r} has {count}")
        columns[name] = col
    return columns, count


def fields_of_samples(samples: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """`from_list`'s per-task dicts (all with the same keys) as per-field lists."""
    if not samples:
        return {}
    names = list(samples[0])
    for i, sample in enumerate(samples):
        if set(sample) != set(names):
            raise InvalidArgumentError(
                f"sample {i} has fields {sorted(sample)}, sample 0 has {sorted(names)}"
            )
    return {n: [s[n] for s in samples] for n in names}


def column_len(col: Column) -> int:
    return col.shape[0] if isinstance(col, torch.Tensor) else len(col)


def take_column(col: Column, indices: Sequence[int] | np.ndarray) -> Column:
    rows = np.asarray(indices, dtype=np.int64).reshape(-1)
    if isinstance(col, torch.Tensor):
        return col[torch.from_numpy(rows)]
    if isinstance(col, RaggedViews) and len(rows) and rows[0] >= 0 and bool(np.all(np.diff(rows) == 1)):
        return col.rows(int(rows[0]), int(rows[-1]) + 1)  # a chunk or slice: still one packed tensor
    return pick(col, rows)  # a ragged column stays a list, whatever shapes the picked tasks have


def column_items(col: Column) -> list[Any]:
    return list(col.unbind(0)) if isinstance(col, torch.Tensor) else list(col)


def concat_columns(name: str, cols: Sequence[Column]) -> Column:
    """One column of `cols` one after another: stacked when every part is a stacked tensor of
    the same per-task shape, else ragged (a list), like the field's metadata says."""
    if all(isinstance(c, torch.Tensor) for c in cols):
        tails = {tuple(c.shape[1:]) for c in cols}  # type: ignore[union-attr]
        dtypes = {c.dtype for c in cols}  # type: ignore[union-attr]
        if len(dtypes) > 1:
            raise InvalidArgumentError(f"field {name!r} has different dtypes across batches: {dtypes}")
        if len(tails) == 1:
            return torch.cat(list(cols))  # type: ignore[arg-type]
    return checked_values(name, [v for c in cols for v in column_items(c)])


def take_columns(data: Mapping[str, Column], rows: np.ndarray) -> dict[str, Column]:
    return {name: take_column(col, rows) for name, col in data.items()}


def merge_columns(
    mine: Mapping[str, Column], theirs: Mapping[str, Column], rows: np.ndarray | None, order: Sequence[str]
) -> dict[str, Column]:
    """A union's columns in `order`: `theirs` win a clash, taken at `rows` unless aligned (None)."""
    data = dict(mine)
    for name, col in theirs.items():
        data[name] = col if rows is None else take_column(col, rows)
    return {name: data[name] for name in order}


def column_lengths(name: str, col: Column) -> list[int]:
    """Per-task length (first dimension; 1 for a 0-d value) of a tensor column."""
    if isinstance(col, torch.Tensor):
        return [col.shape[1] if col.dim() > 1 else 1] * col.shape[0]
    if isinstance(col, RaggedViews):
        return col.lengths.tolist()
    if col and not isinstance(col[0], torch.Tensor):
        raise InvalidArgumentError(f"field {name!r} holds JSON values; lengths need a tensor field")
    return [v.shape[0] if v.dim() else 1 for v in col]


def column_shapes(col: Column) -> RowShapes:
    """Each task's shape in a column (`()` for JSON values); a list of tensors costs a step per task."""
    if isinstance(col, torch.Tensor):
        return RowShapes.uniform(col.shape[0], col.shape[1:])
    if isinstance(col, RaggedViews):
        return RowShapes.ragged(col.lengths, col.values.shape[1:])
    if col and isinstance(col[0], torch.Tensor):
        return RowShapes.from_list([tuple(v.shape) for v in col])
    return RowShapes.uniform(len(col), ())


def is_ragged(col: Column) -> bool:
    """Whether a column is a ragged tensor field: per-task tensors in a list."""
    if isinstance(col, RaggedViews):
        return True
    return isinstance(col, list) and bool(col) and isinstance(col[0], torch.Tensor)


# ----------------------------------------------------------------------------- schema


def schema_of(data: Mapping[str, Column]) -> dict[str, FieldMeta]:
    """The columns' schema (dtype, kind, per-task shape or trailing dims) over zero tasks: what
    a batch keeps of them when it holds no task, so an empty slice or chunk still has its fields."""
    none = np.zeros(0, dtype=np.int32)
    out: dict[str, FieldMeta] = {}
    for name, col in data.items():
        if isinstance(col, torch.Tensor):
            out[name] = FieldMeta(wire.dtype_name(col.dtype), none, RowShapes.uniform(0, col.shape[1:]))
        elif is_ragged(col):
            first = col.values if isinstance(col, RaggedViews) else col[0]  # it may hold zero tasks
            tail = tuple(first.shape[1:]) if first.dim() else ()
            out[name] = FieldMeta(wire.dtype_name(first.dtype), none, RowShapes(0, shape=(0, *tail)), True)
        else:
            out[name] = FieldMeta(None, none, RowShapes.uniform(0, ()))
    return out


def empty_column(fm: FieldMeta) -> Column:
    """A field's column over zero tasks: an empty stacked tensor of its shape, or an empty list."""
    if fm.dtype is None or fm.ragged or fm.shapes.shape is None:
        return []
    return torch.empty((0, *fm.shapes.shape), dtype=wire.torch_dtype(fm.dtype))


def empty_packed(name: str, fm: FieldMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """`packed()` of a field over zero tasks: no values (of its dtype and trailing dims) and `[0]`."""
    if fm.dtype is None:
        raise InvalidArgumentError(f"field {name!r} holds JSON values; packed() needs a tensor field")
    tail = fm.shapes.packable() or ()
    values = torch.empty((0, *tail), dtype=wire.torch_dtype(fm.dtype))
    return values, torch.zeros(1, dtype=torch.int32)


# ----------------------------------------------------------------------------- pickling


def column_for_pickle(col: Column) -> Column:
    if isinstance(col, torch.Tensor):
        return compact_tensor(col)
    if isinstance(col, RaggedViews):
        return col  # pickles its packed tensor once, compacted
    return [compact_tensor(v) if isinstance(v, torch.Tensor) else v for v in col]


# ----------------------------------------------------------------------------- packing


def cu_seqlens(lengths: np.ndarray) -> torch.Tensor:
    """int32 offsets where each of the rows of `lengths` starts, and the total at the end."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:
        raise InvalidArgumentError(f"{int(offsets[-1])} packed rows do not fit int32 cu_seqlens")
    return torch.from_numpy(offsets.astype(np.int32))


def pack_rows(name: str, flat: torch.Tensor, shapes: RowShapes) -> tuple[torch.Tensor, torch.Tensor]:
    """(values along dim 0, int32 cu_seqlens) from a flat tensor of every row's elements."""
    if shapes.shape == () or (shapes.ranks is not None and not shapes.ranks.any()):
        return flat.reshape(shapes.n), cu_seqlens(np.ones(shapes.n, dtype=np.int64))  # 0-d: one each
    tail = shapes.packable()
    if tail is None:
        raise InvalidArgumentError(
            f"field {name!r}: tasks differ in rank or trailing dimensions, so their values cannot be "
            "concatenated along dim 0; index the field for a list of per-task tensors instead"
        )
    lengths = shapes.first_dims()
    return flat.reshape(int(lengths.sum()), *tail), cu_seqlens(lengths)


def pack_column(name: str, col: Column) -> tuple[torch.Tensor, torch.Tensor]:
    """`packed()` of a column held in memory: a view for a stacked tensor, the packed tensor itself
    for `RaggedViews` (a nested tensor's values, a gathered buffer), one `cat` for other lists."""
    if isinstance(col, torch.Tensor):
        n = col.shape[0]
        return pack_rows(name, col.reshape(-1), RowShapes.uniform(n, col.shape[1:]))
    if isinstance(col, RaggedViews):
        return col.values.contiguous(), cu_seqlens(col.lengths)
    if not col or not isinstance(col[0], torch.Tensor):
        raise InvalidArgumentError(f"field {name!r} holds JSON values; packed() needs a tensor field")
    shapes = RowShapes.from_list([tuple(v.shape) for v in col])
    flat = torch.cat([v.reshape(-1) for v in col])
    return pack_rows(name, flat, shapes)


def to_device(
    values: torch.Tensor, cu: torch.Tensor, device: torch.device | str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if device is None:
        return values, cu
    return values.to(device), cu.to(device)


# ----------------------------------------------------------------------------- export


def export_bundle(
    task_ids: list[str],
    data: Mapping[str, Column],
    node: str,
    copy: bool = False,
    share: Mapping[str, int] | None = None,
    same_tensors: bool = True,
) -> tuple[wire.Bundle, BatchMeta]:
    """Columns as a wire bundle (one column per field) plus the metadata naming `node` as holder.

    `copy=True`: no column shares memory with `data`'s tensors (one copy per column at most).
    Tasks of a list column that hold the very same tensor object, and each group of `share[field]`
    consecutive tasks (checked equal), share one stored value: it travels once, the others
    name it (`RawColumn.alias`; `same_tensors=False` leaves the identity test out), and the
    metadata says so (`FieldMeta.shared`, as ordinals
    until the put's generation turns them into keys: `BatchMeta.stored_by`).
    """
    columns: dict[str, wire.RawColumn] = {}
    fields: dict[str, FieldMeta] = {}
    n = len(task_ids)
    share = dict(share or {})
    unknown = sorted(set(share) - set(data))
    if unknown:
        raise InvalidArgumentError(f"share= names fields the batch does not have: {unknown}")
    for name, col in data.items():
        leaders = _share_leaders(name, col, share.get(name), same_tensors)
        if leaders is None:
            column = _wire_column(name, col, task_ids, copy)
            shapes = column.shapes if column.shapes is not None else RowShapes.uniform(n, ())
            ordinals = None
        else:
            column, shapes, ordinals = _shared_wire_column(name, col, task_ids, copy, leaders)
        columns[name] = column
        nodes = np.zeros(n, dtype=np.int32)
        fields[name] = FieldMeta(column.dtype, nodes, shapes, is_ragged(col), None, ordinals)
    return wire.Bundle(list(task_ids), columns), BatchMeta(list(task_ids), [node], fields)


def _share_leaders(
    name: str, col: Column, group_size: int | None, same_tensors: bool = True
) -> np.ndarray | None:
    """Per task, the first task whose value it shares (itself if none); None when no task shares.

    With `group_size`, consecutive groups of that many tasks, whose values must be equal
    (`InvalidArgumentError` naming the first that is not); else the tasks of a list column that
    hold the very same tensor (same memory, shape and strides: no bytes compared)."""
    n = column_len(col)
    if group_size is not None:
        if not isinstance(group_size, int) or group_size < 1 or n % group_size:
            raise InvalidArgumentError(f"share[{name!r}] must divide the batch's {n} tasks into groups")
        leaders = np.arange(n, dtype=np.int64) // group_size * group_size
        _check_equal_groups(name, col, leaders)
        return leaders if group_size > 1 else None
    if not same_tensors or isinstance(col, (torch.Tensor, RaggedViews)):
        return None
    if not col or not isinstance(col[0], torch.Tensor):
        return None
    objects = list(map(id, col))  # C-level: no step per task unless some object repeats
    if len(set(objects)) == n:
        return None
    first: dict[int, int] = {}
    leaders = np.fromiter((first.setdefault(k, i) for i, k in enumerate(objects)), dtype=np.int64, count=n)
    return None if len(first) == n else leaders


def _check_equal_groups(name: str, col: Column, leaders: np.ndarray) -> None:
    if isinstance(col, torch.Tensor):
        same = (col == col[torch.from_numpy(leaders)]).reshape(len(col), -1).all(1)
        differs = np.flatnonzero(~same.cpu().numpy()).tolist()
    else:
        differs = [i for i, j in enumerate(leaders.tolist()) if i != j and not _equal(col[i], col[j])]
    if len(differs):
        raise InvalidArgumentError(
            f"share[{name!r}]: task {int(differs[0])} differs from the first task of its group; "
            "only tasks with equal values can share one"
        )


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a == b)


def _shared_wire_column(
    name: str, col: Column, task_ids: list[str], copy: bool, leaders: np.ndarray
) -> tuple[wire.RawColumn, RowShapes, np.ndarray]:
    """The column over the tasks that lead their group, the others as aliases of them; every
    task's shape; per task its group's ordinal (from 1; 0 for a task alone)."""
    own = np.flatnonzero(leaders == np.arange(len(leaders)))
    column = _wire_column(name, take_column(col, own), pick(task_ids, own), copy)
    column.rows = own
    members = np.flatnonzero(leaders != np.arange(len(leaders)))
    column.alias, column.alias_of = members, pick(task_ids, leaders[members])
    position = np.zeros(len(leaders), dtype=np.int64)
    position[own] = np.arange(len(own))
    whole = RowShapes.uniform(len(leaders), ())  # JSON values
    shapes = whole if column.shapes is None else column.shapes.take(position[leaders])
    sizes = np.bincount(leaders, minlength=len(leaders))
    grouped = own[sizes[own] > 1]
    if len(grouped) >= SHARE_ORDINALS:
        raise InvalidArgumentError(
            f"field {name!r}: {len(grouped)} shared values in one put, at most {SHARE_ORDINALS - 1}: "
            "put the batch in parts"
        )
    ordinal = np.zeros(len(leaders), dtype=np.int64)
    ordinal[grouped] = np.arange(1, len(grouped) + 1)
    return column, shapes, ordinal[leaders]


def _wire_column(name: str, col: Column, task_ids: list[str], copy: bool) -> wire.RawColumn:
    """A stacked tensor travels as it is (no per-task work), so does the packed tensor of
    `RaggedViews`; another ragged column's tensors travel from where they lie (`wire.Pieces`;
    with `copy`, packed with one `cat`)."""
    if isinstance(col, RaggedViews):
        shapes = RowShapes.ragged(col.lengths, col.values.shape[1:])
        return _tensor_wire_column(name, col.values, copy, shapes)
    if not isinstance(col, torch.Tensor):
        return wire.list_column(name, col, task_ids, copy=copy, scatter=not copy)
    return _tensor_wire_column(name, col, copy)


def _tensor_wire_column(
    name: str, tensor: torch.Tensor, copy: bool, shapes: RowShapes | None = None
) -> wire.RawColumn:
    """One tensor of every row's values as a wire column (`shapes`: packed ragged rows)."""
    if (problem := wire.tensor_problem(tensor)) is not None:
        raise WireFormatError(f"field {name!r}: {problem}")
    tensor = tensor.detach()
    if copy and tensor.device.type == "cpu":
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    try:
        return wire.tensor_column(tensor, shapes)
    except WireFormatError as exc:
        raise WireFormatError(f"field {name!r}: {exc}") from None
