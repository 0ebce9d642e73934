"""The torch layer of the wire format: tensors, lists of tensors and JSON values to columns
(`tensor_column`, `list_column`, `json_column`, `bundle_from_shards`) and back (`column_tensor`,
`decode_column`, `bundle_to_shards`), one tensor per field, zero-copy on decode. torch is
imported inside the functions that need it, so importing the wire package stays torch-free."""


from __future__ import annotations

import functools
import json
import operator
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from distbatch.errors import InvalidIdError, WireFormatError
from distbatch.gc_pause import paused_gc
from distbatch.ids import ShardKey, validate_key
from distbatch.wire.container import (
    ITEMSIZE,
    Buffer,
    Part,
    Pieces,
    RawTensor,
    join_parts,
)
from distbatch.wire.host_copy import HOST_COPIES
from distbatch.wire.shapes import RowShapes

if TYPE_CHECKING:
    import torch
from distbatch.wire.bundle import LAYER_MARK, Bundle, RawColumn, build_bundle, column_field, parse_bundle
from distbatch.wire.json_values import check_json, dump_if_exact, find_non_json

TORCH_DTYPE_NAMES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2": "F8_E5M2",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0",
    "int16": "I16",
    "uint16": "U16",
    "float16": "F16",
    "bfloat16": "BF16",
    "int32": "I32",
    "uint32": "U32",
    "float32": "F32",
    "int64": "I64",
    "uint64": "U64",
    "float64": "F64",
    "complex64": "C64",
    "complex128": "C128",
}


@functools.cache
def _torch_dtype_table() -> tuple[dict[Any, str], dict[str, Any]]:
    import torch

    to_name: dict[Any, str] = {}
    for attr, name in TORCH_DTYPE_NAMES.items():
        dtype = getattr(torch, attr, None)
        if isinstance(dtype, torch.dtype):
            to_name[dtype] = name
    return to_name, {name: dtype for dtype, name in to_name.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype (`WireFormatError` if it has none)."""
    try:
        return _torch_dtype_table()[0][dtype]
    except KeyError:
        raise WireFormatError(f"unsupported tensor dtype {dtype}") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire name (`WireFormatError` if this torch lacks it)."""
    try:
        return _torch_dtype_table()[1][name]
    except KeyError:
        raise WireFormatError(f"dtype {name!r} is not available in this torch build") from None


def tensor_problem(tensor: torch.Tensor) -> str | None:
    """Why `tensor` cannot be stored or sent, or None if it can; callers prefix the field's name.

    Only dense (strided) tensors with data, of a dtype in `ITEMSIZE`, travel:
    sparse, nested, quantized and meta tensors do not.
    """
    import torch

    if tensor.is_nested:
        return "a nested tensor cannot be stored: pass its components as a list of tensors (a ragged field)"
    if tensor.layout != torch.strided:
        return f"a {tensor.layout} tensor cannot be stored, only a dense one: call .to_dense() first"
    if tensor.device.type == "meta":
        return "a tensor on the meta device holds no data to store"
    if tensor.dtype not in _torch_dtype_table()[0]:
        hint = ": call .dequantize() first" if tensor.is_quantized else ""
        return f"a {tensor.dtype} tensor cannot be stored{hint}"
    return None


def tensor_to_raw(tensor: torch.Tensor) -> RawTensor:
    """Describe a tensor's bytes without copying when it is already a contiguous CPU tensor."""
    import torch

    if tensor.layout != torch.strided or tensor.is_nested:
        raise WireFormatError(str(tensor_problem(tensor)))
    name = dtype_name(tensor.dtype)
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        if tensor.device.type == "meta":
            raise WireFormatError(str(tensor_problem(tensor)))
        tensor = HOST_COPIES.to_host(tensor)
    tensor = tensor.resolve_conj().resolve_neg().contiguous()
    shape = tuple(tensor.shape)
    if tensor.numel() == 0:
        return RawTensor(name, shape, b"")
    flat = tensor.reshape(-1).view(torch.uint8)
    return RawTensor(name, shape, flat.numpy().data)


def raw_to_tensor(raw: RawTensor) -> torch.Tensor:
    """A tensor over `raw.data` (zero-copy when the buffer is writable)."""
    import torch

    dtype = torch_dtype(raw.dtype)
    if raw.nbytes == 0:
        return torch.empty(raw.shape, dtype=dtype)
    tensor = torch.frombuffer(raw.data, dtype=dtype)
    if tensor.data_ptr() % tensor.element_size():
        # The spec allows unaligned offsets; copy rather than hand out an unaligned tensor.
        tensor = torch.frombuffer(raw.data, dtype=torch.uint8).clone().view(dtype)
    return tensor.reshape(raw.shape)


def is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def shard_problem(key: ShardKey, value: Any, exc: Exception) -> str:
    """What is wrong with one shard's value, naming its task and field (and the spot inside JSON)."""
    name = f"task {key.task_id!r}, field {key.field!r}"
    if is_tensor(value) and (problem := tensor_problem(value)) is not None:
        return f"{name}: {problem}"
    where = find_non_json(value)[0] if isinstance(value, (dict, list, tuple)) else ""
    return f"{name}{', at ' + where if where else ''}: {exc}"

_JSON_SCALARS = frozenset({str, int, float, bool, type(None)})


def json_column(name: str, values: Sequence[Any], task_ids: Sequence[str]) -> RawColumn:
    """A JSON field's values, checked (exact round trip) and encoded once as one array.

    Scalars are checked by type in one pass. Containers are first encoded and decoded as a
    whole (C code) and compared with the originals: only values that do not come back equal
    (tuples, non-string keys) or that cannot be encoded are walked value by value, and the
    nesting depth is read off the text with numpy, so a column of small dicts costs no
    Python loop per task.
    """
    values = list(values)
    text: str | None = None
    if not set(map(type, values)) <= _JSON_SCALARS:
        text = dump_if_exact(values)
        if text is None:
            for i, value in enumerate(values):
                if type(value) not in _JSON_SCALARS:
                    try:
                        values[i] = check_json(value)
                    except WireFormatError as exc:
                        key = ShardKey(task_ids[i], name) if i < len(task_ids) else ShardKey("?", name)
                        raise WireFormatError(shard_problem(key, value, exc)) from None
    try:
        if text is None:
            text = json.dumps(values, separators=(",", ":"), ensure_ascii=False)
    except (ValueError, RecursionError) as exc:  # e.g. an int longer than sys.get_int_max_str_digits()
        raise WireFormatError(f"field {name!r}: cannot encode JSON value: {exc}") from None
    try:
        text.encode()
    except UnicodeEncodeError:
        text = json.dumps(values, separators=(",", ":"))  # lone surrogates travel as \u escapes
    return RawColumn(None, values=values, text=text)

_DTYPE_OF = operator.attrgetter("dtype")
_BASE_OF = operator.attrgetter("_base")
# A ragged column of at least this many separate tensors is put as `Pieces` (when asked to):
# below it, one `cat` costs less than describing the pieces.
SCATTER_MIN_TENSORS = 64


def tensor_column(tensor: torch.Tensor, shapes: RowShapes | None = None) -> RawColumn:
    """A column from one tensor holding every row's values along dim 0 (one copy at most:
    to the host, or to make it contiguous).

    Without `shapes`, row i is `tensor[i]` (a fixed-shape field); with them, the rows'
    values are concatenated in `tensor` (a packed ragged field).
    """
    raw = tensor_to_raw(tensor)
    if shapes is None:
        if not raw.shape:
            raise WireFormatError("a 0-d tensor has no rows: give it a leading task dimension")
        shapes = RowShapes.uniform(raw.shape[0], raw.shape[1:])
    elif int(shapes.counts().sum()) * ITEMSIZE[raw.dtype] != raw.nbytes:
        raise WireFormatError("the packed values do not hold the elements the shapes call for")
    return RawColumn(raw.dtype, shapes, [raw.data] if raw.nbytes else [], raw.nbytes)


def list_column(
    name: str, values: Sequence[Any], task_ids: Sequence[str], copy: bool = False, scatter: bool = False
) -> RawColumn:
    """A column from one value per task: tensors (any shapes, one dtype) or JSON values.

    Tensors are joined with one `cat` (one copy; on their device, then one copy to the
    host). The per-task work is attribute reads in comprehensions; a field whose tasks
    share rank and trailing dims is joined as it is, others are flattened first. 1-D views
    laid end to end in one storage are taken as one view (no copy) unless `copy` (for a
    store that keeps the column while its owner may write to the tensors). `scatter`: many
    separate 1-D CPU tensors are not joined at all but kept where they lie (`Pieces`), for a
    put that writes them out with gathering writes.
    """
    import torch

    values = list(values)
    kinds = set(map(type, values))
    if not any(issubclass(k, torch.Tensor) for k in kinds):
        if any(k.__module__ == "numpy" and k.__name__ == "ndarray" for k in kinds):
            return list_column(name, [_from_numpy(v) for v in values], task_ids, copy, scatter)
        return json_column(name, values, task_ids)
    if not all(issubclass(k, torch.Tensor) for k in kinds):
        values = [_from_numpy(v) for v in values]
        bad = next(i for i, v in enumerate(values) if not isinstance(v, torch.Tensor))
        raise WireFormatError(
            f"field {name!r} mixes tensors and other values (task {task_ids[bad]!r} holds a "
            f"{type(values[bad]).__name__}): a field holds tensors or JSON values, not both"
        )
    fast = _pack_fast(values, copy, scatter)
    if fast is not None:
        packed, shapes = fast
        if isinstance(packed, Pieces):
            return RawColumn(dtype_name(values[0].dtype), shapes, [packed], packed.nbytes)
        return tensor_column(packed, shapes)
    traits = {(v.dtype, v.layout, v.device, v.is_nested, v.is_quantized) for v in values}
    for trait in traits:
        dtype, layout, device, nested, quantized = trait
        if nested or layout != torch.strided or device.type == "meta" or quantized:
            i = next(i for i, v in enumerate(values) if tensor_problem(v) is not None)
            raise WireFormatError(f"task {task_ids[i]!r}, field {name!r}: {tensor_problem(values[i])}")
        if dtype not in _torch_dtype_table()[0]:
            i = next(i for i, v in enumerate(values) if v.dtype == dtype)
            raise WireFormatError(f"task {task_ids[i]!r}, field {name!r}: {tensor_problem(values[i])}")
    dtypes = {t[0] for t in traits}
    if len(dtypes) > 1:
        raise WireFormatError(f"field {name!r} mixes dtypes {sorted(map(str, dtypes))}")
    sizes = [v.shape for v in values]
    shapes = RowShapes.from_list(sizes)
    with torch.no_grad():
        if len({t[2] for t in traits}) > 1:
            values = [v.cpu() for v in values]
        if shapes.packable() is None or shapes.shape == ():
            values = [v.reshape(-1) for v in values]  # ranks or trailing dims differ: flat
        packed = torch.cat(values) if len(values) > 1 else values[0].reshape(-1)
    return tensor_column(packed, shapes)


def _pack_fast(
    values: list[torch.Tensor], copy: bool = False, scatter: bool = False
) -> tuple[torch.Tensor | Pieces, RowShapes] | None:
    """The common case, without reading each tensor's shape (torch's slowest attribute): 1-D
    CPU tensors of one storable dtype. Views laid end to end in one storage (what `split`
    makes, and what a gather hands out) are taken as one view, no copy; with `scatter`, many
    others stay where they lie (`Pieces`); else they are joined with one `cat`. None: use the
    careful path (it names any task whose value is wrong)."""
    import torch

    if set(map(torch.Tensor.dim, values)) != {1}:
        return None
    dtypes = set(map(_DTYPE_OF, values))
    if len(dtypes) != 1 or next(iter(dtypes)) not in _torch_dtype_table()[0]:
        return None
    first = values[0]
    if first.layout != torch.strided or first.device.type != "cpu" or first.is_nested or first.is_quantized:
        return None
    n = len(values)
    lengths = np.fromiter(map(torch.Tensor.numel, values), dtype=np.int64, count=n)
    shapes = RowShapes.ragged(lengths)
    itemsize = first.element_size()
    pointers = np.fromiter(map(torch.Tensor.data_ptr, values), dtype=np.int64, count=n)
    base = first._base if first._base is not None else first
    views = values if first._base is not None else values[1:]  # each a view of `base`
    complex_ = first.dtype.is_complex  # only a complex tensor can hold a conjugate bit
    end_to_end = (
        bool(np.array_equal(pointers[1:], pointers[:-1] + lengths[:-1] * itemsize))
        and all(map(torch.Tensor.is_contiguous, values))
        and not (complex_ and any(map(torch.Tensor.is_conj, values)))
        and not any(map(torch.Tensor.is_neg, values))
        and not base.is_conj()
        and not base.is_neg()
        and set(map(id, map(_BASE_OF, views))) <= {id(base)}
        and base.layout == torch.strided
    )
    if not end_to_end and scatter and not copy and n >= SCATTER_MIN_TENSORS:
        pieces = _pieces(values, pointers, lengths * itemsize)
        if pieces is not None:
            return pieces, shapes
    with torch.no_grad():
        if end_to_end and base.is_contiguous():
            start = (int(pointers[0]) - base.data_ptr()) // itemsize
            total = int(lengths.sum())
            if (
                start >= 0
                and start + total <= base.numel()
                and base.data_ptr() + start * itemsize == pointers[0]
            ):
                view = base.detach().reshape(-1)[start : start + total]
                return (view.clone() if copy else view), shapes
        try:
            packed = torch.cat(values) if n > 1 else first.detach().reshape(-1)
        except (RuntimeError, NotImplementedError):  # mixed devices or layouts: the careful path says which
            return None
        if packed.layout != torch.strided or packed.device.type != "cpu" or packed.is_quantized:
            return None
        return packed, shapes


def _pieces(values: list[torch.Tensor], pointers: np.ndarray, nbytes: np.ndarray) -> Pieces | None:
    """1-D tensors as `Pieces` (their addresses and byte lengths), if every one is a plain
    contiguous CPU tensor whose memory holds its values as they read; else None."""
    import torch

    if (  # 1-D already: no nested tensor; only a complex one can hold a conjugate bit
        not all(map(operator.attrgetter("is_cpu"), values))
        or set(map(operator.attrgetter("layout"), values)) != {torch.strided}
        or not all(map(torch.Tensor.is_contiguous, values))
        or (values[0].dtype.is_complex and any(map(torch.Tensor.is_conj, values)))
        or any(map(torch.Tensor.is_neg, values))
    ):
        return None
    iov = np.empty((len(values), 2), dtype=np.uint64)
    iov[:, 0] = pointers
    iov[:, 1] = nbytes
    return Pieces(values, iov, _joined_bytes)


def _joined_bytes(values: Sequence[torch.Tensor]) -> memoryview:
    """The tensors' bytes one after another (one `cat`)."""
    import torch

    with torch.no_grad():
        joined = torch.cat([v.detach() for v in values]) if len(values) > 1 else values[0].detach().clone()
    return joined.view(torch.uint8).numpy().data


def _from_numpy(value: Any) -> Any:
    if type(value).__module__ == "numpy" and type(value).__name__ == "ndarray":
        import torch

        if any(stride < 0 for stride in value.strides):
            value = value.copy()  # torch.from_numpy refuses negative strides
        try:
            return torch.from_numpy(value)
        except TypeError:
            raise WireFormatError(f"unsupported numpy dtype {value.dtype}") from None
    return value


def column_tensor(column: RawColumn) -> torch.Tensor:
    """A tensor column's values as one tensor over its bytes (zero-copy when they are in one
    writable buffer): `[m, *shape]` for uniform rows, `[sum(lengths), *tail]` for ragged ones,
    1-D otherwise."""
    import torch

    shapes = column.tensor_shapes
    buffer = column.single_buffer()
    dtype = torch_dtype(column.tensor_dtype)
    if shapes.shape is not None:
        shape: tuple[int, ...] = (shapes.n, *shapes.shape)
    elif shapes.lengths is not None:
        shape = (int(shapes.lengths.sum()), *(shapes.tail or ()))
    else:
        shape = (int(shapes.counts().sum()),)
    if buffer.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if buffer.readonly:
        buffer = memoryview(bytearray(buffer))
    return raw_to_tensor(RawTensor(column.tensor_dtype, shape, buffer))


def split_rows(values: torch.Tensor, shapes: RowShapes) -> list[torch.Tensor]:
    """Per-task views of a column's values (no copies)."""
    import torch

    if shapes.n == 0:
        return []
    if shapes.shape is not None:
        return list(values.reshape(shapes.n, *shapes.shape).unbind(0))
    if shapes.lengths is not None:
        rows = values.reshape(int(shapes.lengths.sum()), *(shapes.tail or ()))  # explicit: a tail may be 0
        return list(torch.split(rows, shapes.lengths.tolist()))
    flat = values.reshape(-1)
    pieces = torch.split(flat, shapes.counts().tolist())
    return [piece.view(shape) for piece, shape in zip(pieces, shapes.tolist())]


def decode_column(column: RawColumn) -> Any:
    """A column as users see it: a stacked tensor when every row has the same shape, else a list
    of per-task tensors (views); JSON values as a list."""
    if column.dtype is None:
        return list(column.values or [])
    values = column_tensor(column)
    shapes = column.tensor_shapes
    if shapes.shape is not None:
        return values.reshape(shapes.n, *shapes.shape)
    return split_rows(values, shapes)


def bundle_from_shards(shards: Mapping[Any, Any]) -> Bundle:
    """`{(task_id, field): value}` as a bundle: tasks in first-seen order, one column per field.

    Values of one field that differ in dtype (or mix tensors and JSON) go to one column per
    kind: `field`, `field#1`, `field#2`... (see `column_field`).
    """
    task_index: dict[str, int] = {}
    by_column: dict[str, tuple[list[int], list[Any]]] = {}
    kinds: dict[str, dict[str, int]] = {}
    for key, value in shards.items():
        try:
            task_id, field = validate_key(key)
        except InvalidIdError as exc:
            raise WireFormatError(str(exc)) from None
        row = task_index.setdefault(task_id, len(task_index))
        field_kinds = kinds.setdefault(field, {})
        layer = field_kinds.setdefault(_value_kind(value), len(field_kinds))
        rows, values = by_column.setdefault(f"{field}{LAYER_MARK}{layer}" if layer else field, ([], []))
        rows.append(row)
        values.append(value)
    task_ids = list(task_index)
    columns: dict[str, RawColumn] = {}
    for field, (rows, values) in by_column.items():
        if any(b < a for a, b in zip(rows, rows[1:])):  # keep each column's rows ascending
            order = sorted(range(len(rows)), key=rows.__getitem__)
            rows, values = [rows[i] for i in order], [values[i] for i in order]
        ids = [task_ids[r] for r in rows]
        columns[field] = list_column(column_field(field), values, ids)
        if rows != list(range(len(task_ids))):
            columns[field].rows = np.asarray(rows, dtype=np.int64)
    return Bundle(task_ids, columns)


def _value_kind(value: Any) -> str:
    dtype = getattr(value, "dtype", None)
    if dtype is not None and type(value).__module__.partition(".")[0] in ("torch", "numpy"):
        return str(dtype)
    return "json"


def bundle_to_shards(bundle: Bundle) -> dict[ShardKey, Any]:
    """A decoded bundle as `{ShardKey: tensor | JSON value}` (tensors are views)."""
    out: dict[ShardKey, Any] = {}
    task_ids = bundle.task_ids
    for key, column in bundle.columns.items():
        field = column_field(key)
        if column.dtype is None:
            items = column.values or []
        else:
            items = split_rows(column_tensor(column), column.tensor_shapes)
        ids = task_ids if column.rows is None else [task_ids[r] for r in column.rows.tolist()]
        for task_id, value in zip(ids, items):
            out[ShardKey(task_id, field)] = value
    return out


def encode_bundle(shards: Mapping[Any, Any]) -> list[Part]:
    """Encode `{(task_id, field): value}` as container parts (join them to get the bytes)."""
    with paused_gc():
        return build_bundle(bundle_from_shards(shards))


def encode_bundle_bytes(shards: Mapping[Any, Any]) -> bytes:
    """Encode a bundle into one `bytes` object."""
    return join_parts(encode_bundle(shards))


def decode_bundle(buf: Buffer) -> dict[ShardKey, Any]:
    """Decode a container into `{ShardKey: tensor | JSON value}`.

    Tensors share memory with `buf` when it is writable (a `bytearray`); a read-only
    buffer (`bytes`) is copied once first, so no tensor ever aliases immutable memory.
    """
    if memoryview(buf).readonly:
        buf = bytearray(buf)
    return bundle_to_shards(parse_bundle(buf))
