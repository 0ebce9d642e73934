"""Helpers the wire tests share: the id alphabet, the dtypes this torch build has, round-trip and error
checks.
"""

from __future__ import annotations

import json
import math
import string
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
from bundle_support import (
    split_container,
)
from hypothesis import HealthCheck, settings

from distbatch import wire
from distbatch.errors import DistBatchError, WireFormatError
from distbatch.ids import ShardKey

# --------------------------------------------------------------------------- helpers

ID_ALPHABET = string.ascii_letters + string.digits + "._:@=+-"

# (wire name, torch attribute) for every dtype distbatch.wire maps, whether or not this torch has it.
DTYPE_TABLE = sorted((name, attr) for attr, name in wire.TORCH_DTYPE_NAMES.items())
# The ones this torch build has: (wire name, torch.dtype).
AVAILABLE = [(name, getattr(torch, attr)) for name, attr in DTYPE_TABLE if hasattr(torch, attr)]
AVAILABLE_DTYPES = [dtype for _, dtype in AVAILABLE]

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ROUND_TRIP = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def torch_dtype_param(name: str, attr: str) -> Any:
    dtype = getattr(torch, attr, None)
    marks = [] if dtype is not None else [pytest.mark.skip(reason=f"this torch has no torch.{attr}")]
    return pytest.param(name, dtype, id=name, marks=marks)


DTYPE_PARAMS = [torch_dtype_param(name, attr) for name, attr in DTYPE_TABLE]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bit patterns (NaNs, infs, -0.0, subnormals included); bools are 0/1."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    count = math.prod(shape) * dtype.itemsize
    raw = torch.randint(0, 256, (count,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def bits(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return bytes(flat.view(torch.uint8).numpy())


def assert_identical(actual: Any, expected: torch.Tensor) -> None:
    """Same dtype, shape and bytes (NaN-safe, -0.0-safe)."""
    assert isinstance(actual, torch.Tensor)
    assert actual.dtype == expected.dtype
    assert tuple(actual.shape) == tuple(expected.shape)
    assert actual.device.type == "cpu"
    assert actual.is_contiguous()
    assert not actual.requires_grad
    assert bits(actual) == bits(expected)


def as_json(value: Any) -> Any:
    """What a value looks like after a JSON round trip: tuples become lists."""
    if isinstance(value, (list, tuple)):
        return [as_json(v) for v in value]
    if isinstance(value, dict):
        return {k: as_json(v) for k, v in value.items()}
    return value


def json_identical(a: Any, b: Any) -> bool:
    """Strict equality: same types (bool is not int), NaN equals NaN, -0.0 is not 0.0, key order kept."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(json_identical(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(json_identical(a[k], b[k]) for k in a)
    return a == b


def assert_bundle_equal(decoded: dict[ShardKey, Any], bundle: dict[Any, Any]) -> None:
    assert set(decoded) == {ShardKey(*k) for k in bundle}
    for key, value in bundle.items():
        got = decoded[ShardKey(*key)]
        if isinstance(value, torch.Tensor):
            assert_identical(got, value)
        else:
            assert json_identical(got, as_json(value)), (key, got, value)


def round_trip(bundle: dict[Any, Any]) -> dict[ShardKey, Any]:
    return wire.decode_bundle(wire.encode_bundle_bytes(bundle))


def address(buf: bytes | bytearray) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


def entry(dtype: str, shape: list[Any], start: Any, end: Any) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}


def description_of(buf: bytes) -> dict[str, Any]:
    """The bundle's `__metadata__["distbatch"]`, parsed."""
    return json.loads(split_container(buf)[0]["__metadata__"]["distbatch"])


def flat_cat(values: list[torch.Tensor]) -> torch.Tensor:
    """The values' elements one after another (what a general-layout data entry holds)."""
    if not values:
        return torch.empty(0)
    return torch.cat([v.reshape(-1) for v in values])


def column_rows(column: wire.RawColumn) -> list[Any]:
    """A column's per-row values through the column layer (`decode_column`)."""
    decoded = wire.decode_column(column)
    return list(decoded.unbind(0)) if isinstance(decoded, torch.Tensor) else decoded


def assert_same_value(got: Any, expected: Any) -> None:
    """Tensors: same dtype, shape and bits (numpy expectations as tensors); JSON: strictly equal."""
    if isinstance(expected, np.ndarray):
        expected = torch.from_numpy(expected)
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), (got, expected)
        assert got.dtype == expected.dtype and tuple(got.shape) == tuple(expected.shape), (got, expected)
        assert bits(got) == bits(expected)
    else:
        assert json_identical(got, as_json(expected)), (got, expected)


def assert_wire_error(func: Callable[[], Any]) -> WireFormatError:
    """Exactly a WireFormatError, with a message and no chained exception to read past."""
    with pytest.raises(WireFormatError) as info:
        func()
    exc = info.value
    assert type(exc) is WireFormatError
    assert isinstance(exc, DistBatchError) and isinstance(exc, ValueError)
    assert str(exc)
    assert exc.__cause__ is None
    assert exc.__context__ is None or exc.__suppress_context__
    return exc


def safetensors_supports(dtype: torch.dtype) -> bool:
    """Whether the installed `safetensors` can save and load this dtype."""
    try:
        safetensors.torch.load(safetensors.torch.save({"p": random_tensor(dtype, (2,))}))
    except Exception:
        return False
    return True
