"""TransferQueue's batch layout and ours: a put's TensorDict as columns, a gather as TensorDict.

TransferQueue returns a field of per-sample 0-d tensors as one dense tensor, every other tensor
field as a jagged nested tensor (even when every sample has the same shape), and anything else
as a *NonTensorStack*. Ours are columns (stacked, ragged or JSON); converting costs no copy
per sample: a nested tensor is built over the gathered values and offsets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict

from distbatch.batch.gather import Gathered
from distbatch.batch.ragged import jagged_nested
from distbatch.errors import InvalidArgumentError, WireFormatError

# Task ids of the samples TransferQueue stores with us: its global index, which is unique
# among live samples (a cleared sample's index is reused, so a clear really deletes).
TASK_PREFIX = "tq"


def task_ids(global_indexes: list[int]) -> list[str]:
    return [f"{TASK_PREFIX}{gi}" for gi in global_indexes]


def columns_of(data: TensorDict) -> dict[str, Any]:
    """A put's fields as columns: tensors (dense or jagged nested) as they are, other values
    (a *NonTensorStack*) as a list, which must be JSON."""
    out: dict[str, Any] = {}
    for name in data.keys():
        if not isinstance(name, str):
            raise WireFormatError(f"field {name!r}: Distbatch stores top-level string fields only")
        value = data.get(name)
        if isinstance(value, torch.Tensor):
            out[name] = value
        elif isinstance(value, TensorDict):
            raise WireFormatError(f"field {name!r} is a nested TensorDict; put its leaves as fields")
        else:
            out[name] = list(value.tolist())
    return out


def field_schema(data: TensorDict) -> dict[str, dict[str, Any]]:
    """TransferQueue's field schema of a put (`transfer_queue.metadata.extract_field_schema`'s
    result, equal to it), without splitting a nested tensor into one tensor per sample: its
    per-sample shapes come from its offsets."""
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
        lengths = _jagged_lengths(value)
        if len(lengths) != size:
            raise InvalidArgumentError(f"field {name!r} has {len(lengths)} samples, the batch {size}")
        tail = tuple(value.values().shape[1:])
        shapes = [(length, *tail) for length in lengths]
        schema[name] = {
            "dtype": value.dtype,
            "shape": torch.Size(shapes[0]),
            "is_nested": True,
            "is_non_tensor": False,
            "per_sample_shapes": shapes,
        }
    return schema


def _jagged_lengths(value: torch.Tensor) -> list[int]:
    """Each sample's length along the ragged dimension of a jagged nested tensor."""
    if value.layout != torch.jagged or value._ragged_idx != 1:  # type: ignore[attr-defined]
        return [int(t.shape[0]) for t in value.unbind()]  # another layout: as TransferQueue does it
    lengths = value.lengths()  # type: ignore[attr-defined]  # a jagged nested tensor's
    if lengths is None:
        lengths = value.offsets().diff()  # type: ignore[attr-defined]
    return lengths.tolist()  # integer offsets: plain ints


def tensordict_of(gathered: Mapping[str, Gathered], names: list[str], size: int) -> TensorDict:
    """Gathered fields in TransferQueue's layout, one entry per name, `size` samples."""
    return TensorDict({name: _packed_like_tq(name, gathered[name]) for name in names}, batch_size=size)


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
