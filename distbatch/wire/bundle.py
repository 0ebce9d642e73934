"""A bundle of shards laid out by column, as one safetensors container: the numpy layer.

A bundle names its task ids once and carries one entry per field: the tasks' values
concatenated along dim 0. Tables say how to cut them back into tasks:

| layout  | entries for field `f`                                                        |
| ------- | ---------------------------------------------------------------------------- |
| uniform | `f`: shape `[m, *row_shape]` (every task has the same shape)                  |
| ragged  | `f`: `[sum(lengths), *tail]`, `f/lengths`: I64 `[m]` (first dim per task)     |
| general | `f`: 1-D `[total elements]`, `f/ranks`: I64 `[m]`, `f/dims`: I64 `[m, width]` |
| any     | `f/rows`: I64 `[m]`, when the field covers only some of the tasks (indexes)   |
| any     | `f/append`: I64 `[m]`, when a put extends the stored values (see below)       |
| any     | `f/alias`: I64 `[a]`, tasks that share another task's value (see below)       |

A put's column with an `append` table extends each task's stored value along dim 0 instead of
replacing it (a partial rollout grows without re-sending its prefix): per row, the generation
of the put the stored value must come from (0: whichever, or none yet). Only tensor columns
append.

A put's column with an `alias` table stores, for each task it names (indexes into the task ids,
tasks the column itself does not cover), no bytes: the task shares the value of the task whose
id the description's `alias` list gives at the same place (covered by the column, or held by
the worker already). A GRPO group's prompt or image travels and is stored once, not n times.

JSON fields ride in the header's `__metadata__` as one JSON array per field, under
`json/<field>`; `__metadata__["distbatch"]` holds the task ids and each field's dtype and
layout. `/` is not in the id alphabet, so no table can clash with a field. The whole is a
valid safetensors container (the `safetensors` package loads it); nothing is pickled,
evaluated or base64-encoded.

This layer (`Bundle`, `RawColumn`, `build_bundle`, `parse_bundle`) works on dtype names,
shape tables (numpy) and bytes, and never imports torch: the worker stores and serves
columns without materialising a tensor. `distbatch.wire.tensors` is the torch layer on top.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from distbatch.errors import InvalidIdError, ShapeError, WireFormatError
from distbatch.gc_pause import paused_gc
from distbatch.ids import validate_id
from distbatch.wire.container import (
    ITEMSIZE,
    MAX_DIMS,
    METADATA_KEY,
    Buffer,
    Entry,
    Part,
    Pieces,
    RawTensor,
    build_container,
    byte_view,
    join_parts,
    parse_container,
    parts_size,
)
from distbatch.wire.json_values import dump_json_array, load_json
from distbatch.wire.shapes import RowShapes, unique_ints

BUNDLE_KEY = "distbatch"

BUNDLE_VERSION = 2

JSON_PREFIX = "json/"

TABLES = ("lengths", "ranks", "dims", "rows", "append", "alias")

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


_ID_LIST = re.compile(r"(?:[A-Za-z0-9._:@=+-]{1,200}\n)*")


def validate_ids(ids: Sequence[Any], what: str = "task_id") -> None:
    """Raise `InvalidIdError` naming the first of `ids` that is not a valid id; checked with one
    regex pass over them all, not one call per id."""
    count = len(ids)  # not `if ids`: a numpy array of ids has no one truth value
    text = "\n".join(ids) + "\n" if count and set(map(type, ids)) == {str} else None
    # The newline count rules out an id that holds a newline itself (it would pass as two ids).
    if count and (text is None or text.count("\n") != count or _ID_LIST.fullmatch(text) is None):
        for value in ids:
            validate_id(value, what)  # names the first bad one


def validate_id_list(ids: Any, what: str = "task_id") -> list[str]:
    """`ids` as a list of valid, distinct ids (`validate_ids`)."""
    if not isinstance(ids, list):
        raise InvalidIdError(f"{what}s must be a list")
    validate_ids(ids, what)
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        dup = next(t for t in ids if t in seen or seen.add(t))  # type: ignore[func-returns-value]
        raise InvalidIdError(f"duplicate {what} {dup!r}")
    return ids


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
    parts: Sequence[Part] = ()
    nbytes: int = 0
    values: list[Any] | None = None
    rows: np.ndarray | None = None
    text: str | None = None  # the JSON array's text, when already encoded
    # Same-host replies only: where the rows' bytes lie in shared regions instead of `parts`,
    # one (region slot, byte offset, byte length) row per run, in row order.
    runs: np.ndarray | None = None
    # Puts only: set when the rows extend the stored values instead of replacing them; per
    # row, the generation the stored value must have (0: any, or none stored yet).
    append: np.ndarray | None = None
    # Puts only: tasks (indexes into the bundle's task ids, none the column covers) that share
    # another task's value, and per such task the id of the task whose value it shares.
    alias: np.ndarray | None = None
    alias_of: list[str] | None = None
    # JSON only, never on the wire: each value's accounted bytes, where known exactly (a durable
    # worker's snapshot keeps the sizes its values were accounted at; see `row_nbytes`).
    json_sizes: np.ndarray | None = None

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
        if self.json_sizes is not None:
            return self.json_sizes
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
            return byte_view(parts[0])
        if not parts:
            return memoryview(b"")
        return memoryview(join_parts(parts))


@dataclass(slots=True)
class Bundle:
    """Task ids plus one `RawColumn` per field."""

    task_ids: list[str]
    columns: dict[str, RawColumn]

    def shard_count(self) -> int:
        """Shards the bundle names: a value per covered row, and one per task sharing a value."""
        return sum(c.count + (0 if c.alias is None else len(c.alias)) for c in self.columns.values())

    def nbytes(self) -> int:
        return sum(int(c.row_nbytes().sum()) for c in self.columns.values())


def _table(values: np.ndarray) -> memoryview:
    return byte_view(np.ascontiguousarray(values, dtype="<i8"))


def build_bundle(
    bundle: Bundle, ids_as_count: bool = False, extra_metadata: Mapping[str, str] | None = None
) -> list[Part]:
    """Lay a bundle out as container parts (header first); tensor bytes are not copied.

    `ids_as_count`: the description gives the number of task ids, not the ids (the answer to a
    request that named them, in this order, and asked for that: see `parse_bundle`'s `asked`).
    `extra_metadata`: more ``__metadata__`` entries (a durable worker's record header); their
    keys must not be the bundle's own (`BUNDLE_KEY`, ``format``, ``json/...``)."""
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
        if column.alias is not None:
            info["alias"] = list(column.alias_of or [])
            entries.append(Entry(f"{name}/alias", "I64", (len(column.alias),), [_table(column.alias)]))
        if column.dtype is None:
            if column.append is not None:
                raise WireFormatError(f"field {name!r}: only tensor values can be appended to")
            metadata[JSON_PREFIX + name] = column.json_text()
            description[name] = info
            continue
        if column.append is not None:
            info["append"] = True
            entries.append(Entry(f"{name}/append", "I64", (len(column.append),), [_table(column.append)]))
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
    _add_metadata(metadata, extra_metadata or {})
    metadata[BUNDLE_KEY] = json.dumps(
        {
            "version": BUNDLE_VERSION,
            "task_ids": len(bundle.task_ids) if ids_as_count else bundle.task_ids,
            "fields": description,
        },
        separators=(",", ":"),
    )
    return build_container(entries, metadata)


def _add_metadata(metadata: dict[str, str], extra: Mapping[str, str]) -> None:
    for key, value in extra.items():
        if key in metadata or key == BUNDLE_KEY or key.startswith(JSON_PREFIX):
            raise WireFormatError(f"metadata key {key!r} is the bundle's own")
        metadata[key] = value


# Resolves a column's runs (see `RawColumn.runs`) to its bytes, given the byte count they must make.
Resolver = Callable[[np.ndarray, int], Sequence[Buffer]]


def parse_bundle(buf: Buffer, resolve: Resolver | None = None, asked: list[str] | None = None) -> Bundle:
    """Validate a bundle and describe its columns (views into `buf`, no copies).

    Every malformation raises `WireFormatError`: container errors, a missing or
    unknown description, invalid or repeated ids, tables that do not match the data,
    entries no field claims. A column whose bytes travel by reference (same-host replies)
    is accepted only with `resolve`, which turns its runs into buffers. `asked`: the task
    ids a fetch named (already checked); an answer may then give their number instead of
    them (`build_bundle(ids_as_count=True)`), and must give exactly that number.
    """
    with paused_gc():
        container = parse_container(buf)
        try:
            return _parse_bundle(container.tensors, container.metadata, resolve, asked)
        except (InvalidIdError, ShapeError) as exc:
            raise WireFormatError(str(exc)) from None


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
    tensors: dict[str, RawTensor],
    metadata: dict[str, str],
    resolve: Resolver | None = None,
    asked: list[str] | None = None,
) -> Bundle:
    text = metadata.get(BUNDLE_KEY)
    if text is None:
        if not tensors and not any(k.startswith(JSON_PREFIX) for k in metadata):
            return Bundle([], {})  # an empty container is an empty bundle
        raise WireFormatError(f"not a distbatch bundle: __metadata__ has no {BUNDLE_KEY!r} entry")
    description = load_json(BUNDLE_KEY, text, unique_keys=True)
    if not isinstance(description, dict) or description.get("version") != BUNDLE_VERSION:
        raise WireFormatError(f"expected a bundle description of version {BUNDLE_VERSION}")
    named = description.get("task_ids")
    if isinstance(named, int) and not isinstance(named, bool):
        if asked is None or named != len(asked):
            expected = "no count: the request did not name its tasks" if asked is None else len(asked)
            raise WireFormatError(f"the answer counts {named} task ids where the request expects {expected}")
        task_ids = asked
    else:
        task_ids = validate_id_list(named)
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
        alias = self._alias(name, info, rows)
        dtype = info.get("dtype")
        if dtype is None:
            if info.get("append", False) is not False:
                raise WireFormatError(f"field {name!r}: only tensor values can be appended to")
            column = self._json_column(name, m, rows)
            column.alias, column.alias_of = alias
            return column
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
        append = self._append(name, info, m)
        column = RawColumn(dtype, shapes, [data.data], len(data.data), rows=rows, append=append)
        column.alias, column.alias_of = alias
        return column

    def _alias(
        self, name: str, info: dict[str, Any], rows: np.ndarray | None
    ) -> tuple[np.ndarray | None, list[str] | None]:
        """The column's `alias` table (tasks sharing another's value) and the ids of those
        others, checked: distinct tasks of the bundle that the column does not cover."""
        of = info.get("alias")
        if of is None:
            return None, None
        if not isinstance(of, list):
            raise WireFormatError(f"field {name!r}: 'alias' must list the ids of the tasks shared")
        self.claimed.add(f"{name}/alias")
        members = _int_table(self.tensors, f"{name}/alias", (len(of),))
        validate_id_list(list(dict.fromkeys(of)), "task_id")  # each distinct id once
        sources = list(of)
        if members.size and int(members.max()) >= self.n:
            raise WireFormatError(f"field {name!r}: an alias is past the {self.n} tasks")
        covered = np.arange(self.n) if rows is None else rows
        if len(unique_ints(members)) != len(members) or np.isin(members, covered).any():
            raise WireFormatError(f"field {name!r}: aliases repeat a task or name one the column covers")
        return members, sources

    def _has_table(self, name: str, info: dict[str, Any], table: str) -> bool:
        """Whether the description says the column has table `table` (then claimed)."""
        flag = info.get(table, False)
        if flag is False:
            return False
        if flag is not True:
            raise WireFormatError(f"field {name!r}: {table!r} must be true or false")
        self.claimed.add(f"{name}/{table}")
        return True

    def _append(self, name: str, info: dict[str, Any], m: int) -> np.ndarray | None:
        """The column's `append` table (expected generations), or None when it replaces."""
        if not self._has_table(name, info, "append"):
            return None
        return _int_table(self.tensors, f"{name}/append", (m,))

    def _rows(self, name: str, info: dict[str, Any]) -> np.ndarray | None:
        """The tasks a column covers (its `rows` table), or None when it covers all of them."""
        if not self._has_table(name, info, "rows"):
            return None
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
        values = load_json(key, self.metadata[key])
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


def slice_column(column: RawColumn, start: int, stop: int, rows: np.ndarray | None = None) -> RawColumn:
    """Rows `start:stop` of a column (byte views, no copies); `rows` is the slice's own row table."""
    if column.dtype is None:
        return RawColumn(None, values=(column.values or [])[start:stop], rows=rows)
    shapes = column.tensor_shapes.take(slice(start, stop))
    append = None if column.append is None else column.append[start:stop]
    if len(column.parts) == 1 and isinstance(column.parts[0], Pieces):  # one piece per row
        pieces = column.parts[0].rows(start, stop)
        return RawColumn(column.dtype, shapes, [pieces], pieces.nbytes, rows=rows, append=append)
    sizes = column.row_nbytes()
    first = int(sizes[:start].sum())
    last = first + int(sizes[start:stop].sum())
    data = column.single_buffer()[first:last]
    return RawColumn(column.dtype, shapes, [data], last - first, rows=rows, append=append)


def slice_aliases(column: RawColumn, sliced: RawColumn, start: int, stop: int) -> RawColumn:
    """`sliced` (tasks `start:stop` of `column`) with the aliases of those tasks, renumbered."""
    if column.alias is None:
        return sliced
    keep = np.flatnonzero((column.alias >= start) & (column.alias < stop))
    sliced.alias = column.alias[keep] - start
    sliced.alias_of = [(column.alias_of or [])[i] for i in keep.tolist()]
    return sliced


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
