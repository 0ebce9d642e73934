"""TransferQueue's batch layout and ours: a put's TensorDict as columns, a gather as TensorDict.

TransferQueue returns a field of per-sample 0-d tensors as one dense tensor, every other tensor
field as a jagged nested tensor (even when every sample has the same shape), and anything else
as a *NonTensorStack*. Ours are columns (stacked, ragged or JSON); converting costs no copy
per sample: a nested tensor is built over the gathered values and offsets.

Per-sample values that JSON would not give back as they came are stored as what they are and
their type kept with TransferQueue's per-sample backend metadata (`location`): `bytes` and
numpy's `bytes_` (a numpy byte-string array, split per sample) as a row of bytes each; numpy's
`str_` as JSON strings; numpy scalars (`int64`, `float32`, `bool_` ...) as JSON numbers. A get
hands each back as its own type, as SimpleStorage does (which pickles them; nothing is pickled
here).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, TensorDict

from distbatch.batch.gather import Gathered
from distbatch.batch.ragged import RaggedViews, jagged_nested, nested_sizes
from distbatch.errors import InvalidArgumentError, WireFormatError

# Task ids of the samples TransferQueue stores with us: its global index, which is unique
# among live samples (a cleared sample's index is reused, so a clear really deletes).
TASK_PREFIX = "tq"


def task_ids(global_indexes: list[int]) -> list[str]:
    return [f"{TASK_PREFIX}{gi}" for gi in global_indexes]


_BYTES, _NUMPY_BYTES, _NUMPY_STR, _NUMPY_SCALAR = "bytes", "numpy.bytes_", "numpy.str_", "numpy:"


def location(slot: int, value_type: str | None) -> int | list[Any]:
    """What TransferQueue keeps for one sample's field (its per-sample backend metadata): the
    slot of the worker that holds it, with the value type when it is stored as something else."""
    return slot if value_type is None else [slot, value_type]


def location_slot(entry: Any) -> int | None:
    """The worker slot of a `location` (None: no location)."""
    if isinstance(entry, list) and entry:
        entry = entry[0]
    return entry if isinstance(entry, int) and not isinstance(entry, bool) else None


def value_types(locations: list[dict[str, Any]], names: list[str]) -> dict[str, str]:
    """The value types recorded for a get's fields (`location`s), by field; a field put with
    different types over time takes the first sample's."""
    types: dict[str, str] = {}
    for where in locations:
        for name in names:
            entry = where.get(name)
            if isinstance(entry, list) and len(entry) == 2 and name not in types:
                types[name] = str(entry[1])
    return types


def columns_of(data: TensorDict) -> tuple[dict[str, Any], dict[str, str]]:
    """A put's fields as columns: tensors (dense or nested) as they are, other values (a
    *NonTensorStack* or *NonTensorData*) as a list of JSON values, or of bytes rows; and the
    value type of each field stored as something else (see the module's docstring)."""
    out: dict[str, Any] = {}
    types: dict[str, str] = {}
    for name in data.keys():
        if not isinstance(name, str):
            raise WireFormatError(f"field {name!r}: Distbatch stores top-level string fields only")
        value = data.get(name)
        if isinstance(value, torch.Tensor):
            out[name] = value
        elif isinstance(value, TensorDict):
            raise WireFormatError(f"field {name!r} is a nested TensorDict; put its leaves as fields")
        else:
            values = _sample_values(value)
            kind = _value_type(values)
            if kind is not None:
                types[name] = kind
            out[name] = values if kind is None else _stored(kind, values)
    return out, types


def _sample_values(value: Any) -> list[Any]:
    """A non-tensor field's value per sample, as TransferQueue splits it: a *NonTensorData* over
    a numpy array gives the array's items (numpy scalars: `bytes_`, `str_`, `int64` ..., or an
    object array's objects), over a list its items; a *NonTensorStack* its items."""
    if isinstance(value, NonTensorData):
        data = value.data
        if isinstance(data, (np.ndarray, list, tuple)) and len(data) == value.batch_size[0]:
            return list(data)
    return list(value.tolist())


def _value_type(values: list[Any]) -> str | None:
    """The type to keep for per-sample values JSON would not give back as they are (None: JSON)."""
    if not values:
        return None
    first = type(values[0])
    if any(type(v) is not first for v in values):
        return None  # mixed: JSON or refused by the wire, which names what it cannot carry
    if first is bytes:
        return _BYTES
    if first is np.bytes_:
        return _NUMPY_BYTES
    if first is np.str_:
        return _NUMPY_STR
    if issubclass(first, np.generic) and first is not np.object_:
        dtypes = {v.dtype.str for v in values}
        if len(dtypes) == 1 and values[0].dtype.kind in "biuf":
            return _NUMPY_SCALAR + dtypes.pop()
    return None


def _stored(kind: str, values: list[Any]) -> Any:
    if kind in (_BYTES, _NUMPY_BYTES):  # one buffer, a row of it per sample
        lengths = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
        packed = torch.frombuffer(bytearray(b"".join(values)) or bytearray(1), dtype=torch.uint8)
        return RaggedViews.of(packed[: int(lengths.sum())], lengths)
    return [v.item() for v in values]  # numpy str_ and scalars: JSON


def _restored(name: str, kind: str, gathered: Gathered) -> list[Any]:
    """Field `name`, gathered, of values stored as `kind`: each value back as its own type."""
    if kind in (_BYTES, _NUMPY_BYTES):
        values, offsets = gathered.packed(name)
        raw, bounds = values.numpy().tobytes(), offsets.tolist()
        make = bytes if kind == _BYTES else np.bytes_
        return [make(raw[a:b]) for a, b in zip(bounds, bounds[1:])]
    items = list(gathered.json or [])
    if kind == _NUMPY_STR:
        return [np.str_(v) for v in items]
    if kind.startswith(_NUMPY_SCALAR):
        scalar = np.dtype(kind[len(_NUMPY_SCALAR) :]).type
        return [scalar(v) for v in items]
    raise WireFormatError(f"unknown value type {kind!r} in TransferQueue's backend metadata")


def field_schema(data: TensorDict) -> dict[str, dict[str, Any]]:
    """TransferQueue's field schema of a put (`transfer_queue.metadata.extract_field_schema`'s
    result, equal to it), without splitting a nested tensor into one tensor per sample: its
    per-sample shapes come from its metadata (a jagged one's offsets, a strided one's sizes)."""
    schema: dict[str, dict[str, Any]] = {}
    size = data.batch_size[0]
    if size == 0:
        return schema
    for key in data.keys():
        name, value = str(key), data.get(key)
        if not isinstance(value, torch.Tensor):
            if len(value) != size:
                raise InvalidArgumentError(f"field {name!r} has {len(value)} values for {size} samples")
            schema[name] = {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": True}
            continue
        if not value.is_nested:
            if value.shape[0] != size:
                raise InvalidArgumentError(f"field {name!r} has {value.shape[0]} rows for {size} samples")
            shape = torch.Size([1]) if value.dim() == 1 else value.shape[1:]
            schema[name] = {"dtype": value.dtype, "shape": shape, "is_nested": False, "is_non_tensor": False}
            continue
        sizes = nested_sizes(value)  # each sample's shape, from the metadata: nothing unbound
        if len(sizes) != size:
            raise InvalidArgumentError(f"field {name!r} has {len(sizes)} samples, the batch {size}")
        shapes = [tuple(shape) for shape in sizes.tolist()]
        schema[name] = {
            "dtype": value.dtype,
            "shape": torch.Size(shapes[0]),
            "is_nested": True,
            "is_non_tensor": False,
            "per_sample_shapes": shapes,
        }
    return schema


def tensordict_of(
    gathered: Mapping[str, Gathered], names: list[str], size: int, types: Mapping[str, str] | None = None
) -> TensorDict:
    """Gathered fields in TransferQueue's layout, one entry per name, `size` samples; `types`:
    the fields stored as something else (`value_types`)."""
    types = types or {}
    return TensorDict(
        {
            name: _tq_pack(_restored(name, types[name], gathered[name]))
            if name in types
            else _packed_like_tq(name, gathered[name])
            for name in names
        },
        batch_size=size,
    )


def _packed_like_tq(name: str, gathered: Gathered) -> Any:
    if gathered.json is not None:
        return _tq_pack(list(gathered.json))
    shapes = gathered.tensor_shapes
    if shapes.shape == ():  # every sample a 0-d tensor: TransferQueue stacks them
        return gathered.flat()
    try:
        values, offsets = gathered.packed(name)
    except ValueError:  # samples differing in rank or trailing dims: TransferQueue's own fallbacks
        return _tq_pack(list(gathered.column()))
    return jagged_nested(values, offsets.to(torch.int64))


def _tq_pack(values: list[Any]) -> Any:
    """TransferQueue's packing of per-sample values (the same function its storage uses)."""
    from transfer_queue.storage.managers.simple_storage_manager import AsyncSimpleStorageManager

    return AsyncSimpleStorageManager._pack_field_values(values)
