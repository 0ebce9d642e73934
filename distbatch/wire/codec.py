"""The wire format: a bundle of shards, laid out by column, as one safetensors container.

A bundle names its task ids once and carries one entry per field: the tasks' values
concatenated along dim 0. Tables say how to cut them back into tasks:

| layout  | entries for field `f`                                                        |
| ------- | ---------------------------------------------------------------------------- |
| uniform | `f`: shape `[m, *row_shape]` (every task has the same shape)                  |
| ragged  | `f`: `[sum(lengths), *tail]`, `f/lengths`: I64 `[m]` (first dim per task)     |
| general | `f`: 1-D `[total elements]`, `f/ranks`: I64 `[m]`, `f/dims`: I64 `[m, width]` |
| any     | `f/rows`: I64 `[m]`, when the field covers only some of the tasks (indexes)   |

JSON fields ride in the header's `__metadata__` as one JSON array per field, under
`json/<field>`; `__metadata__["distbatch"]` holds the task ids and each field's dtype and
layout. `/` is not in the id alphabet, so no table can clash with a field. The whole is a
valid safetensors container (the `safetensors` package loads it); nothing is pickled,
evaluated or base64-encoded.

Two layers: the *raw* layer (`Bundle`, `RawColumn`, `build_bundle`, `parse_bundle`)
works on dtype names, shape tables (numpy) and bytes and needs no torch, so a worker
stores and serves columns without materialising a tensor; the *torch* layer converts
columns to and from tensors, one tensor per field, zero-copy on decode.
"""

from __future__ import annotations

import functools
import json
import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from distbatch.errors import InvalidIdError, ShapeError, WireFormatError
from distbatch.gc_pause import paused_gc
from distbatch.ids import ShardKey, validate_id, validate_key
from distbatch.wire.container import (
    CONTENT_TYPE,
    ITEMSIZE,
    MAX_DIMS,
    MAX_HEADER_BYTES,
    METADATA_KEY,
    Buffer,
    Entry,
    RawTensor,
    build_container,
    join_parts,
    parse_container,
    parts_size,
    unique_keys,
)
from distbatch.wire.shapes import RowShapes, unique_ints

if TYPE_CHECKING:
    import torch

__all__ = [
    "CONTENT_TYPE",
    "ITEMSIZE",
    "MAX_DIMS",
    "MAX_HEADER_BYTES",
    "Buffer",
    "Bundle",
    "RawColumn",
    "RawTensor",
    "build_bundle",
    "join_parts",
    "paused_gc",
    "parse_bundle",
    "parts_size",
]

MAX_JSON_DEPTH = 64
BUNDLE_KEY = "distbatch"
BUNDLE_VERSION = 2
JSON_PREFIX = "json/"
TABLES = ("lengths", "ranks", "dims", "rows")
# A column's key is its field, or `field#k` for the k-th extra column of a field whose
# values differ in dtype across tasks (a column holds one dtype). `#` is not an id character.
LAYER_MARK = "#"
_INT64_MAX = 2**63 - 1
_LAYER = re.compile(r"[1-9][0-9]{0,3}")


def column_field(key: str) -> str:
    """The field a bundle column belongs to (its key without a `#k` layer suffix)."""
    return key.partition(LAYER_MARK)[0]


def _check_column_key(key: str) -> None:
    field, mark, layer = key.partition(LAYER_MARK)
    validate_id(field, "field")
    if field == METADATA_KEY:
        raise WireFormatError(
            f"a field cannot be named {METADATA_KEY!r}: safetensors reserves that name for the header's "
            "metadata, where a tensor field's entry would land"
        )
    if mark and _LAYER.fullmatch(layer) is None:
        raise WireFormatError(f"bad column name {key!r}: expected 'field' or 'field#k'")


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

_ID_LIST = re.compile(r"(?:[A-Za-z0-9._:@=+-]{1,200}\n)*")


def validate_id_list(ids: Any, what: str = "task_id") -> list[str]:
    """`ids` as a list of valid, distinct ids, checked with one regex pass (not one call per id)."""
    if not isinstance(ids, list):
        raise InvalidIdError(f"{what}s must be a list")
    text = "\n".join(ids) + "\n" if ids and set(map(type, ids)) == {str} else None
    # The newline count rules out an id that holds a newline itself (it would pass as two ids).
    if ids and (text is None or text.count("\n") != len(ids) or _ID_LIST.fullmatch(text) is None):
        for value in ids:
            validate_id(value, what)  # names the first bad one
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        dup = next(t for t in ids if t in seen or seen.add(t))  # type: ignore[func-returns-value]
        raise InvalidIdError(f"duplicate {what} {dup!r}")
    return ids


# --------------------------------------------------------------------------- raw layer


@dataclass(slots=True)
class RawColumn:
    """One field of a bundle in wire form.

    Tensors: `dtype` is a wire dtype name, `shapes` one shape per row and `parts` the
    rows' bytes in order (several buffers when gathered from several places; `nbytes`
    their total). JSON: `dtype` is None and `values` holds one value per row. `rows`
    indexes the bundle's task ids when the field covers only some of them, in that
    order; None means every task, in order.
    """

    dtype: str | None
    shapes: RowShapes | None = None
    parts: Sequence[Buffer] = ()
    nbytes: int = 0
    values: list[Any] | None = None
    rows: np.ndarray | None = None
    text: str | None = None  # the JSON array's text, when already encoded
    # Same-host replies only: where the rows' bytes lie in shared regions instead of `parts`,
    # one (region slot, byte offset, byte length) row per run, in row order.
    runs: np.ndarray | None = None

    @property
    def count(self) -> int:
        if self.dtype is None:
            return len(self.values or ())
        return self.tensor_shapes.n

    @property
    def tensor_dtype(self) -> str:
        """The wire dtype of a tensor column (`WireFormatError` for a JSON one)."""
        if self.dtype is None:
            raise WireFormatError("a JSON column has no dtype")
        return self.dtype

    @property
    def tensor_shapes(self) -> RowShapes:
        """The rows' shapes of a tensor column (`WireFormatError` for a JSON one)."""
        if self.shapes is None:
            raise WireFormatError("a JSON column has no shapes")
        return self.shapes

    @property
    def is_tensor(self) -> bool:
        return self.dtype is not None

    def row_nbytes(self) -> np.ndarray:
        """Bytes per row (int64); for JSON, the array text's length split evenly over the rows."""
        if self.dtype is not None:
            return self.tensor_shapes.counts() * ITEMSIZE[self.dtype]
        n = self.count
        # The array's text less its brackets and commas: each value's own text, exactly when
        # there is one value, near enough otherwise (an even split: no per-value dumps).
        total = max(len(self.json_text().encode()) - 1 - n, 0) if n else 0
        out = np.full(n, total // max(n, 1), dtype=np.int64)
        out[: total - int(out.sum())] += 1
        return out

    def json_text(self) -> str:
        if self.text is None:
            self.text = dump_json_array(self.values or [])
        return self.text

    def single_buffer(self) -> memoryview:
        """The rows' bytes as one buffer (joined once if they came in several parts)."""
        parts = [p for p in self.parts if len(p)]
        if len(parts) == 1:
            return memoryview(parts[0]).cast("B")
        if not parts:
            return memoryview(b"")
        return memoryview(join_parts(parts))


@dataclass(slots=True)
class Bundle:
    """Task ids plus one `RawColumn` per field."""

    task_ids: list[str]
    columns: dict[str, RawColumn]

    def shard_count(self) -> int:
        return sum(c.count for c in self.columns.values())

    def nbytes(self) -> int:
        return sum(int(c.row_nbytes().sum()) for c in self.columns.values())


def dump_json_array(values: Sequence[Any]) -> str:
    """A JSON array's compact UTF-8 text (its size is what the store counts); values holding
    lone surrogates, which UTF-8 cannot carry, travel as `\\u` escapes instead."""
    try:
        text = json.dumps(values, separators=(",", ":"), ensure_ascii=False)
    except (ValueError, TypeError, RecursionError) as exc:
        raise WireFormatError(f"cannot encode JSON value: {exc}") from None
    try:
        text.encode()
    except UnicodeEncodeError:
        text = json.dumps(values, separators=(",", ":"))
    return text


def _table(values: np.ndarray) -> memoryview:
    array = np.ascontiguousarray(values, dtype="<i8")
    return array.data.cast("B")


def build_bundle(bundle: Bundle) -> list[Buffer]:
    """Lay a bundle out as container parts (header first); tensor bytes are not copied."""
    description: dict[str, Any] = {}
    metadata: dict[str, str] = {"format": "pt"}
    entries: list[Entry] = []
    for name, column in bundle.columns.items():
        if column_field(name) == METADATA_KEY:
            _check_column_key(name)  # refused, saying why
        info: dict[str, Any] = {"dtype": column.dtype}
        if column.rows is not None:
            info["rows"] = True
            entries.append(Entry(f"{name}/rows", "I64", (len(column.rows),), [_table(column.rows)]))
        if column.dtype is None:
            metadata[JSON_PREFIX + name] = column.json_text()
            description[name] = info
            continue
        shapes = column.tensor_shapes
        info["layout"] = shapes.kind
        if shapes.shape is not None:
            data_shape: tuple[int, ...] = (shapes.n, *shapes.shape)
        elif shapes.lengths is not None:
            data_shape = (int(shapes.lengths.sum()), *(shapes.tail or ()))
            entries.append(Entry(f"{name}/lengths", "I64", (shapes.n,), [_table(shapes.lengths)]))
        else:
            data_shape = (int(shapes.counts().sum()),)
            ranks, dims = shapes.general_tables()
            entries.append(Entry(f"{name}/ranks", "I64", (shapes.n,), [_table(ranks)]))
            entries.append(Entry(f"{name}/dims", "I64", dims.shape, [_table(dims)]))
        if column.runs is not None:
            info["external"] = True
            info["shape"] = list(data_shape)
            entries.append(Entry(f"{name}/runs", "I64", (len(column.runs), 3), [_table(column.runs)]))
        else:
            entries.append(Entry(name, column.dtype, data_shape, column.parts))
        description[name] = info
    metadata[BUNDLE_KEY] = json.dumps(
        {"version": BUNDLE_VERSION, "task_ids": bundle.task_ids, "fields": description},
        separators=(",", ":"),
    )
    return build_container(entries, metadata)


# Resolves a column's runs (see `RawColumn.runs`) to its bytes, given the byte count they must make.
Resolver = Callable[[np.ndarray, int], Sequence[Buffer]]


def parse_bundle(buf: Buffer, resolve: Resolver | None = None) -> Bundle:
    """Validate a bundle and describe its columns (views into `buf`, no copies).

    Every malformation raises `WireFormatError`: container errors, a missing or
    unknown description, invalid or repeated ids, tables that do not match the data,
    entries no field claims. A column whose bytes travel by reference (same-host replies)
    is accepted only with `resolve`, which turns its runs into buffers.
    """
    with paused_gc():
        container = parse_container(buf)
        try:
            return _parse_bundle(container.tensors, container.metadata, resolve)
        except (InvalidIdError, ShapeError) as exc:
            raise WireFormatError(str(exc)) from None


def _load_json(name: str, text: str, unique_keys: bool = False) -> Any:
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError as exc:  # a lone surrogate, which no UTF-8 encoder accepts
            raise WireFormatError(f"{name!r}: JSON is not valid UTF-8: {exc}") from None
    try:
        # The description names each thing once: a repeated key (read as "last one wins" here,
        # maybe otherwise by another reader) is refused, as the container header does.
        return json.loads(text, object_pairs_hook=_unique_pairs if unique_keys else None)
    except WireFormatError as exc:
        raise WireFormatError(f"{name!r}: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise WireFormatError(f"{name!r}: invalid JSON: {exc}") from None


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return unique_keys(pairs, "the bundle description")


def _int_table(tensors: dict[str, RawTensor], name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    raw = tensors.get(name)
    if raw is None:
        raise WireFormatError(f"missing table {name!r}")
    if raw.dtype != "I64":
        raise WireFormatError(f"table {name!r} must be I64, not {raw.dtype}")
    if shape is not None and raw.shape != shape:
        raise WireFormatError(f"table {name!r} has shape {list(raw.shape)}, expected {list(shape)}")
    table = np.frombuffer(raw.data, dtype="<i8").reshape(raw.shape)
    if table.size and int(table.min()) < 0:
        raise WireFormatError(f"table {name!r} holds negative values")
    return table


def _parse_bundle(
    tensors: dict[str, RawTensor], metadata: dict[str, str], resolve: Resolver | None = None
) -> Bundle:
    text = metadata.get(BUNDLE_KEY)
    if text is None:
        if not tensors and not any(k.startswith(JSON_PREFIX) for k in metadata):
            return Bundle([], {})  # an empty container is an empty bundle
        raise WireFormatError(f"not a distbatch bundle: __metadata__ has no {BUNDLE_KEY!r} entry")
    description = _load_json(BUNDLE_KEY, text, unique_keys=True)
    if not isinstance(description, dict) or description.get("version") != BUNDLE_VERSION:
        raise WireFormatError(f"expected a bundle description of version {BUNDLE_VERSION}")
    task_ids = validate_id_list(description.get("task_ids"))
    fields = description.get("fields")
    if not isinstance(fields, dict):
        raise WireFormatError("the bundle description's 'fields' must be an object")
    parser = _BundleParser(tensors, metadata, resolve, len(task_ids))
    columns = {name: parser.column(name, info) for name, info in fields.items()}
    parser.check_nothing_left_over()
    if any(LAYER_MARK in key for key in columns):
        _check_layers(columns, len(task_ids))
    return Bundle(task_ids, columns)


class _BundleParser:
    """Reads a bundle's columns one field description at a time, and remembers which entries
    the fields claimed, so entries no field describes are refused at the end."""

    def __init__(
        self, tensors: dict[str, RawTensor], metadata: dict[str, str], resolve: Resolver | None, n: int
    ) -> None:
        self.tensors = tensors
        self.metadata = metadata
        self.resolve = resolve
        self.n = n
        self.claimed: set[str] = set()
        self.json_keys: set[str] = set()

    def column(self, name: str, info: Any) -> RawColumn:
        _check_column_key(name)
        if not isinstance(info, dict):
            raise WireFormatError(f"field {name!r}: description must be an object")
        rows = self._rows(name, info)
        m = self.n if rows is None else len(rows)
        dtype = info.get("dtype")
        if dtype is None:
            return self._json_column(name, m, rows)
        if not isinstance(dtype, str) or dtype not in ITEMSIZE:
            raise WireFormatError(f"field {name!r}: unsupported dtype {dtype!r}")
        external = info.get("external", False) is True
        tensors = self.tensors
        data = _external_data(tensors, name, dtype, info, self.claimed) if external else tensors.get(name)
        if data is None:
            raise WireFormatError(f"field {name!r} has no data entry")
        if data.dtype != dtype:
            raise WireFormatError(f"field {name!r}: data entry is {data.dtype}, described as {dtype}")
        self.claimed.add(name)
        shapes = self._shapes(name, info.get("layout"), data, m)
        if external:
            return self._external_column(name, dtype, data, shapes, rows)
        return RawColumn(dtype, shapes, [data.data], len(data.data), rows=rows)

    def _rows(self, name: str, info: dict[str, Any]) -> np.ndarray | None:
        """The tasks a column covers (its `rows` table), or None when it covers all of them."""
        flag = info.get("rows", False)
        if flag is False:
            return None
        if flag is not True:
            raise WireFormatError(f"field {name!r}: 'rows' must be true or false")
        self.claimed.add(f"{name}/rows")
        raw_rows = self.tensors.get(f"{name}/rows")
        if raw_rows is not None and len(raw_rows.shape) != 1:
            raise WireFormatError(f"table '{name}/rows' must be 1-D, has shape {list(raw_rows.shape)}")
        rows = _int_table(self.tensors, f"{name}/rows")
        if rows.size and int(rows.max()) >= self.n:
            raise WireFormatError(f"field {name!r}: a row index is past the {self.n} tasks")
        if len(unique_ints(rows)) != len(rows):
            raise WireFormatError(f"field {name!r}: rows repeat a task")
        return rows

    def _json_column(self, name: str, m: int, rows: np.ndarray | None) -> RawColumn:
        key = JSON_PREFIX + name
        if key not in self.metadata:
            raise WireFormatError(f"JSON field {name!r} has no {key!r} metadata")
        values = _load_json(key, self.metadata[key])
        if not isinstance(values, list) or len(values) != m:
            raise WireFormatError(f"JSON field {name!r} must be an array of {m} values")
        self.json_keys.add(key)
        return RawColumn(None, values=values, rows=rows, text=self.metadata[key])

    def _shapes(self, name: str, layout: Any, data: RawTensor, m: int) -> RowShapes:
        """The tasks' shapes from the column's layout and its tables, checked against the data."""
        tensors = self.tensors
        if layout == "uniform":
            if not data.shape or data.shape[0] != m:
                raise WireFormatError(
                    f"field {name!r}: uniform data must have {m} rows, has shape {list(data.shape)}"
                )
            return RowShapes.uniform(m, data.shape[1:])
        if layout == "ragged":
            self.claimed.add(f"{name}/lengths")
            lengths = _int_table(tensors, f"{name}/lengths", (m,))
            if not data.shape or _exact_sum(lengths) != data.shape[0]:
                raise WireFormatError(f"field {name!r}: lengths do not add up to the data's first dimension")
            return RowShapes(m, tail=data.shape[1:], lengths=lengths).normalized()
        if layout == "general":
            self.claimed.update((f"{name}/ranks", f"{name}/dims"))
            ranks = _int_table(tensors, f"{name}/ranks", (m,))
            dims_raw = tensors.get(f"{name}/dims")
            width = dims_raw.shape[1] if dims_raw is not None and len(dims_raw.shape) == 2 else -1
            if width < 0:
                raise WireFormatError(f"field {name!r}: 'dims' must be an (m, width) table")
            dims = _int_table(tensors, f"{name}/dims", (m, width))
            shapes = RowShapes.general(ranks, dims)
            if data.shape != (_exact_sum(shapes.counts()),):
                raise WireFormatError(f"field {name!r}: general data must be 1-D with one element per value")
            return shapes
        raise WireFormatError(f"field {name!r}: unknown layout {layout!r}")

    def _external_column(
        self, name: str, dtype: str, data: RawTensor, shapes: RowShapes, rows: np.ndarray | None
    ) -> RawColumn:
        """A column whose bytes travel by reference (shared-memory runs a same-host reply names)."""
        if self.resolve is None:
            raise WireFormatError(
                f"field {name!r} refers to shared memory; only a same-host reply may do that"
            )
        runs = _int_table(self.tensors, f"{name}/runs")
        nbytes = math.prod(data.shape) * ITEMSIZE[dtype]
        if _exact_sum(runs[:, 2]) != nbytes:
            raise WireFormatError(f"field {name!r}: runs hold other than {nbytes} bytes")
        return RawColumn(dtype, shapes, self.resolve(runs, nbytes), nbytes, rows=rows)

    def check_nothing_left_over(self) -> None:
        stray = set(self.tensors) - self.claimed
        if stray:
            raise WireFormatError(f"entries no field describes: {sorted(stray)[:5]}")
        stray_json = {k for k in self.metadata if k.startswith(JSON_PREFIX)} - self.json_keys
        if stray_json:
            raise WireFormatError(f"JSON entries no JSON field describes: {sorted(stray_json)[:5]}")


def _external_data(
    tensors: dict[str, RawTensor], name: str, dtype: str, info: dict[str, Any], claimed: set[str]
) -> RawTensor:
    """A stand-in data entry for a column whose bytes travel by reference: its dtype and the
    shape the description gives (checked as the container checks shapes), no bytes."""
    shape = info.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(type(d) is int and 0 <= d < _INT64_MAX for d in shape)
        or math.prod(shape) * ITEMSIZE[dtype] > _INT64_MAX
    ):
        raise WireFormatError(f"field {name!r}: bad shape {shape!r} for data held by reference")
    raw = tensors.get(f"{name}/runs")
    if raw is None or len(raw.shape) != 2 or raw.shape[1] != 3:
        raise WireFormatError(f"field {name!r}: data held by reference needs an (n, 3) runs table")
    claimed.add(f"{name}/runs")
    return RawTensor(dtype, tuple(shape), b"")


def _exact_sum(values: np.ndarray) -> int:
    """The sum of non-negative int64 values, exact: numpy's own sum wraps around past 2**63 - 1,
    which would let forged tables add up to the data's size."""
    if values.size and int(values.max()) > _INT64_MAX // values.size:
        return sum(values.tolist())
    return int(values.sum())


def _check_layers(columns: dict[str, RawColumn], n: int) -> None:
    """The columns of one field (`field`, `field#k`) must hold each task's value at most once."""
    by_field: dict[str, list[RawColumn]] = {}
    for key, column in columns.items():
        by_field.setdefault(column_field(key), []).append(column)
    for field, cols in by_field.items():
        if len(cols) > 1:
            rows = np.concatenate([np.arange(n) if c.rows is None else c.rows for c in cols])
            if len(unique_ints(rows)) != len(rows):
                raise WireFormatError(f"field {field!r}: two of its columns hold a value for the same task")


# --------------------------------------------------------------------------- torch layer


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
        tensor = tensor.cpu()
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


def check_json(value: Any, depth: int = 0) -> Any:
    """Return `value` as plain JSON types, or raise if it would not round-trip exactly."""
    if depth > MAX_JSON_DEPTH:
        raise WireFormatError(f"JSON value nested deeper than {MAX_JSON_DEPTH}")
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [check_json(v, depth + 1) for v in value]
    if isinstance(value, dict):
        for k in value:
            if not isinstance(k, str):
                raise WireFormatError(f"JSON object keys must be strings, got {k!r}")
        return {k: check_json(v, depth + 1) for k, v in value.items()}
    name = type(value).__name__
    if type(value).__module__.partition(".")[0] in ("torch", "numpy"):  # no torch import: raw layer
        # A shard value is a tensor or JSON; a tensor cannot be *part of* a JSON value.
        raise WireFormatError(
            f"a {name} cannot be part of a JSON value (str, int, float, bool, None, lists and dicts "
            "of those): make the tensor a value of its own, or convert it with .tolist() / .item()"
        )
    raise WireFormatError(
        f"cannot send a value of type {name}: a value is a torch.Tensor or JSON "
        "(str, int, float, bool, None, lists and dicts of those)"
    )


def find_non_json(value: Any) -> tuple[str, Any]:
    """The first part of `value` that JSON cannot hold: its path (`['key'][0]`, "" for `value`) and it.

    For a dict with a non-string key, the dict itself. Only called once encoding
    failed (it walks the value again), so the hot path pays nothing.
    """
    path = ""
    for _ in range(MAX_JSON_DEPTH + 2):
        if isinstance(value, dict):
            if not all(isinstance(k, str) for k in value):
                return path, value
            bad = next(((k, v) for k, v in value.items() if _not_json(v)), None)
        elif isinstance(value, (list, tuple)):
            bad = next(((i, v) for i, v in enumerate(value) if _not_json(v)), None)
        else:
            return path, value
        if bad is None:  # too deep: the container itself is the problem
            return path, value
        path, value = f"{path}[{bad[0]!r}]", bad[1]
    return path, value


def _not_json(value: Any) -> bool:
    try:
        check_json(value)
    except WireFormatError:
        return True
    return False


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
        text = _dump_if_exact(values)
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
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _dump_if_exact(values: list[Any]) -> str | None:
    """The values' JSON text if they encode, decode back equal and nest at most `MAX_JSON_DEPTH`
    deep; None when any value needs the careful walk (which says what is wrong)."""
    try:
        text = json.dumps(values, separators=(",", ":"), ensure_ascii=False, allow_nan=True)
        if json.loads(text) != values:
            return None
    except (TypeError, ValueError, RecursionError):
        return None
    skeleton = np.frombuffer(_JSON_STRING.sub("", text).encode(), dtype=np.uint8)
    steps = (skeleton == ord("[")).astype(np.int16) + (skeleton == ord("{"))
    steps -= (skeleton == ord("]")).astype(np.int16) + (skeleton == ord("}"))
    if len(steps) and int(np.cumsum(steps, dtype=np.int64).max()) > MAX_JSON_DEPTH + 1:  # +1: the array
        return None
    return text


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


def list_column(name: str, values: Sequence[Any], task_ids: Sequence[str], copy: bool = False) -> RawColumn:
    """A column from one value per task: tensors (any shapes, one dtype) or JSON values.

    Tensors are joined with one `cat` (one copy; on their device, then one copy to the
    host). The per-task work is attribute reads in comprehensions; a field whose tasks
    share rank and trailing dims is joined as it is, others are flattened first. 1-D views
    laid end to end in one storage are taken as one view (no copy) unless `copy` (for a
    store that keeps the column while its owner may write to the tensors).
    """
    import torch

    values = list(values)
    kinds = set(map(type, values))
    if not any(issubclass(k, torch.Tensor) for k in kinds):
        if any(k.__module__ == "numpy" and k.__name__ == "ndarray" for k in kinds):
            return list_column(name, [_from_numpy(v) for v in values], task_ids, copy)
        return json_column(name, values, task_ids)
    if not all(issubclass(k, torch.Tensor) for k in kinds):
        values = [_from_numpy(v) for v in values]
        bad = next(i for i, v in enumerate(values) if not isinstance(v, torch.Tensor))
        raise WireFormatError(
            f"field {name!r} mixes tensors and other values (task {task_ids[bad]!r} holds a "
            f"{type(values[bad]).__name__}): a field holds tensors or JSON values, not both"
        )
    fast = _pack_fast(values, copy)
    if fast is not None:
        return tensor_column(*fast)
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


def _pack_fast(values: list[torch.Tensor], copy: bool = False) -> tuple[torch.Tensor, RowShapes] | None:
    """The common case, without reading each tensor's shape (torch's slowest attribute): 1-D
    CPU tensors of one storable dtype. Views laid end to end in one storage (what `split`
    makes, and what a gather hands out) are taken as one view, no copy; others are joined
    with one `cat`. None: use the careful path (it names any task whose value is wrong)."""
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
    end_to_end = (
        bool(np.array_equal(pointers[1:], pointers[:-1] + lengths[:-1] * itemsize))
        and all(map(torch.Tensor.is_contiguous, values))
        and not any(map(torch.Tensor.is_conj, values))
        and not any(map(torch.Tensor.is_neg, values))
        and not base.is_conj()
        and not base.is_neg()
        and all(v._base is base or v is base for v in values)
        and base.layout == torch.strided
    )
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


def slice_column(column: RawColumn, start: int, stop: int, rows: np.ndarray | None = None) -> RawColumn:
    """Rows `start:stop` of a column (byte views, no copies); `rows` is the slice's own row table."""
    if column.dtype is None:
        return RawColumn(None, values=(column.values or [])[start:stop], rows=rows)
    sizes = column.row_nbytes()
    first = int(sizes[:start].sum())
    last = first + int(sizes[start:stop].sum())
    data = column.single_buffer()[first:last]
    shapes = column.tensor_shapes.take(slice(start, stop))
    return RawColumn(column.dtype, shapes, [data], last - first, rows=rows)


def concat_bundles(bundles: Sequence[Bundle]) -> Bundle:
    """Bundles over the same fields (every field on every task), tasks one after another."""
    if len(bundles) == 1:
        return bundles[0]
    names = list(bundles[0].columns)
    for bundle in bundles:
        if list(bundle.columns) != names or any(c.rows is not None for c in bundle.columns.values()):
            raise WireFormatError(
                "cannot join these parts: a field holds values of different dtypes for these tasks; "
                "fetch it in smaller groups of tasks"
            )
    columns: dict[str, RawColumn] = {}
    for name in names:
        cols = [b.columns[name] for b in bundles]
        if cols[0].dtype is None:
            columns[name] = RawColumn(None, values=[v for c in cols for v in c.values or []])
        else:
            parts = [p for c in cols for p in c.parts]
            shapes = RowShapes.concat([c.shapes for c in cols if c.shapes is not None])
            columns[name] = RawColumn(cols[0].dtype, shapes, parts, parts_size(parts))
    return Bundle([t for b in bundles for t in b.task_ids], columns)


# --------------------------------------------------------------------------- per-shard API


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


def encode_bundle(shards: Mapping[Any, Any]) -> list[Buffer]:
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
