"""The wire format: a bundle of shards ``{(task_id, field): value}`` as one safetensors container,
laid out by column (task ids once, one entry per field, tables to cut it back into tasks).

Covers the per-shard torch API (`encode_bundle_bytes` / `decode_bundle`), the column
layer (`list_column` / `tensor_column` / `decode_column`), the raw layer (`build_bundle`
/ `parse_bundle` over `build_container` / `parse_container`), zero-copy and alignment,
interop with the real `safetensors` package both ways, every malformation we can name
(of the container and of the bundle format inside it), and hypothesis round-trip / fuzz
properties.
"""

from __future__ import annotations

import json
import math
import string
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch
from bundle_support import (
    GOOD,
    GOOD_VALUES,
    MALFORMED_BUNDLES,
    Raw,
    bundle_keys,
    container,
    describe,
    forge,
    good_spec,
    split_container,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distbatch import wire
from distbatch.errors import DistBatchError, WireFormatError
from distbatch.ids import ShardKey
from distbatch.wire.shapes import RowShapes

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


# --------------------------------------------------------------------------- dtype table


def test_dtype_table_is_consistent_with_itemsizes() -> None:
    assert set(wire.TORCH_DTYPE_NAMES.values()) == set(wire.ITEMSIZE)
    for name, dtype in AVAILABLE:
        assert wire.dtype_name(dtype) == name
        assert wire.torch_dtype(name) == dtype
        assert wire.ITEMSIZE[name] == dtype.itemsize
    # The dtypes the task names must all be present in this torch (2.13).
    for required in ("bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64"):
        assert getattr(torch, required) in AVAILABLE_DTYPES
    for required in ("float16", "bfloat16", "float32", "float64", "complex64", "complex128", "float8_e4m3fn"):
        assert getattr(torch, required) in AVAILABLE_DTYPES


def test_unknown_dtype_names_and_unsupported_torch_dtypes_raise() -> None:
    assert_wire_error(lambda: wire.torch_dtype("F128"))
    assert_wire_error(lambda: wire.torch_dtype("f32"))
    assert_wire_error(lambda: wire.dtype_name(torch.complex32))
    assert_wire_error(lambda: wire.dtype_name(torch.quint8))


# --------------------------------------------------------------------------- tensor round trips


@pytest.mark.parametrize(("name", "dtype"), DTYPE_PARAMS)
@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5), (2, 3, 4), (0,), (0, 5), (3, 0)], ids=str)
def test_every_dtype_round_trips_bit_exactly(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = random_tensor(dtype, shape, seed=len(shape) * 31 + sum(shape))
    buf = wire.encode_bundle_bytes({("task-1", "x"): tensor})
    header, _ = split_container(buf)
    # One task: the field's data entry is that task's value with a leading task dimension.
    assert header["x"]["dtype"] == name
    assert header["x"]["shape"] == [1, *shape]
    assert set(header) == {"__metadata__", "x"}
    assert description_of(buf) == {
        "version": 2,
        "task_ids": ["task-1"],
        "fields": {"x": {"dtype": name, "layout": "uniform"}},
    }
    for source in (buf, bytearray(buf), memoryview(buf)):
        assert_identical(wire.decode_bundle(source)[("task-1", "x")], tensor)


@pytest.mark.parametrize(("name", "dtype"), DTYPE_PARAMS)
def test_every_dtype_round_trips_in_every_layout(name: str, dtype: torch.dtype) -> None:
    """Ragged (lengths), general (ranks + dims: 0-d and empty values too) and partial (rows)
    fields of every dtype: the right tables, and the same bits back."""
    tasks = ["a", "b", "c", "d"]
    seq = [random_tensor(dtype, (n, 2), seed=n) for n in (3, 0, 1, 5)]
    mixed = [random_tensor(dtype, shape, seed=i) for i, shape in enumerate([(), (2, 3), (0,), (4,)])]
    bundle: dict[Any, Any] = {}
    for i, task in enumerate(tasks):
        bundle[(task, "seq")] = seq[i]
        bundle[(task, "mixed")] = mixed[i]
        if i % 2:
            bundle[(task, "odd")] = random_tensor(dtype, (2,), seed=10 + i)
    buf = wire.encode_bundle_bytes(bundle)
    header, _ = split_container(buf)
    assert set(header) == {
        "__metadata__",
        *("seq", "seq/lengths"),
        *("mixed", "mixed/ranks", "mixed/dims"),
        *("odd", "odd/rows"),
    }
    fields = description_of(buf)["fields"]
    assert fields == {
        "seq": {"dtype": name, "layout": "ragged"},
        "mixed": {"dtype": name, "layout": "general"},
        "odd": {"dtype": name, "rows": True, "layout": "uniform"},
    }
    assert header["seq"]["shape"] == [9, 2]
    assert header["mixed"]["shape"] == [1 + 6 + 0 + 4]
    assert header["odd"]["shape"] == [2, 2]
    for source in (buf, bytearray(buf)):
        assert_bundle_equal(wire.decode_bundle(source), bundle)


@pytest.mark.parametrize(
    "dtype",
    [d for d in AVAILABLE_DTYPES if (d.is_floating_point or d.is_complex) and d.itemsize > 1],
    ids=str,
)
def test_special_float_values_keep_their_bits(dtype: torch.dtype) -> None:
    values = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.5, -2.25]
    tensor = torch.tensor(values, dtype=torch.float64).to(dtype)
    got = round_trip({("t", "v"): tensor})[("t", "v")]
    assert_identical(got, tensor)
    if not dtype.is_complex:
        assert math.copysign(1.0, float(got[1])) == -1.0
        assert torch.isnan(got[4])


def test_all_dtypes_in_one_bundle() -> None:
    bundle = {
        (f"task-{i}", f"f.{name}"): random_tensor(dtype, (i % 4, 3) if i % 2 else (5,), seed=i)
        for i, (name, dtype) in enumerate(AVAILABLE)
    }
    bundle[("task-0", "meta")] = {"note": "mixed"}
    assert_bundle_equal(round_trip(bundle), bundle)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.arange(12.0).reshape(3, 4).t(), id="transposed"),
        pytest.param(lambda: torch.arange(60).reshape(6, 10)[::2, 1::3], id="step-sliced"),
        pytest.param(lambda: torch.arange(10, dtype=torch.int16)[3:7], id="offset-slice"),
        pytest.param(lambda: torch.arange(3.0).expand(4, 3), id="expanded-stride-0"),
        pytest.param(
            lambda: torch.arange(120.0).reshape(2, 3, 4, 5).to(memory_format=torch.channels_last),
            id="channels-last",
        ),
        pytest.param(lambda: torch.arange(24.0).reshape(2, 3, 4).permute(2, 0, 1), id="permuted"),
        pytest.param(lambda: (torch.arange(4.0) + 1j * torch.arange(4.0)).conj(), id="conj-view"),
        pytest.param(lambda: torch.randn(5, 6, dtype=torch.bfloat16).t()[1:, ::2], id="bf16-strided"),
        pytest.param(lambda: torch.arange(8).reshape(2, 4).diagonal(), id="diagonal"),
    ],
)
def test_non_contiguous_inputs_arrive_contiguous_with_the_same_values(
    make: Callable[[], torch.Tensor],
) -> None:
    tensor = make()
    got = round_trip({("t", "x"): tensor})[("t", "x")]
    assert got.is_contiguous()
    assert_identical(got, tensor.resolve_conj().contiguous())
    assert torch.equal(got, tensor)


def test_requires_grad_tensors_are_sent_detached() -> None:
    leaf = torch.randn(3, 4, requires_grad=True)
    non_leaf = leaf * 2
    bundle = {("t", "leaf"): leaf, ("t", "nonleaf"): non_leaf}
    out = round_trip(bundle)
    assert_identical(out[("t", "leaf")], leaf.detach())
    assert_identical(out[("t", "nonleaf")], non_leaf.detach())
    assert leaf.requires_grad and leaf.grad is None  # the input is left alone


def test_encoding_copies_so_later_changes_to_the_source_do_not_leak() -> None:
    tensor = torch.arange(6, dtype=torch.int32)
    buf = wire.encode_bundle_bytes({("t", "x"): tensor})
    tensor.fill_(-1)
    assert torch.equal(wire.decode_bundle(buf)[("t", "x")], torch.arange(6, dtype=torch.int32))


def test_encode_bundle_parts_join_to_the_same_bytes() -> None:
    bundle = {("a", "x"): torch.arange(5), ("a", "y"): [1, "two"], ("b", "x"): torch.ones(2, 2)}
    parts = wire.encode_bundle(bundle)
    assert wire.join_parts(parts) == wire.encode_bundle_bytes(bundle)
    assert b"".join(bytes(p) for p in parts) == wire.encode_bundle_bytes(bundle)


def test_ragged_per_task_shapes() -> None:
    bundle: dict[Any, Any] = {}
    for i in range(20):
        bundle[(f"prompt-0:resp-{i}", "input_ids")] = torch.arange(i * 7 % 23, dtype=torch.int64)
        bundle[(f"prompt-0:resp-{i}", "logprobs")] = torch.randn(i * 7 % 23, dtype=torch.bfloat16)
        bundle[(f"prompt-0:resp-{i}", "image")] = torch.rand(i % 3, 4, 4)
        bundle[(f"prompt-0:resp-{i}", "reward")] = float(i) / 3
    assert_bundle_equal(round_trip(bundle), bundle)


def test_ten_thousand_shards_in_one_bundle() -> None:
    bundle: dict[Any, Any] = {}
    for i in range(5000):
        bundle[(f"task-{i:05d}", "ids")] = torch.arange(i % 13, dtype=torch.int32) + i
        bundle[(f"task-{i:05d}", "uid")] = f"uid-{i // 8}"
    assert len(bundle) == 10_000
    buf = wire.encode_bundle_bytes(bundle)
    # One entry per field (and its length table), however many tasks: the header names each task once.
    header, _ = split_container(buf)
    assert set(header) == {"__metadata__", "ids", "ids/lengths"}
    assert set(header["__metadata__"]) == {"format", "distbatch", "json/uid"}
    assert header["ids"]["shape"] == [sum(i % 13 for i in range(5000))]
    parsed = wire.parse_bundle(buf)
    assert len(parsed.task_ids) == 5000 and parsed.shard_count() == 10_000
    assert parsed.columns["ids"].shapes.kind == "ragged" and parsed.columns["uid"].dtype is None
    assert parsed.columns["ids"].rows is None and parsed.columns["uid"].rows is None
    out = wire.decode_bundle(bytearray(buf))
    assert len(out) == 10_000
    for i in (0, 1, 12, 13, 4321, 4999):
        assert torch.equal(out[(f"task-{i:05d}", "ids")], torch.arange(i % 13, dtype=torch.int32) + i)
        assert out[(f"task-{i:05d}", "uid")] == f"uid-{i // 8}"
    assert all(isinstance(k, ShardKey) for k in out)


def test_decoded_keys_are_shard_keys() -> None:
    out = round_trip({("t.1", "f"): 1, ShardKey("t.2", "g"): torch.zeros(1)})
    assert set(out) == {ShardKey("t.1", "f"), ShardKey("t.2", "g")}
    for key in out:
        assert type(key) is ShardKey
        assert key.wire_name() == f"{key.task_id}/{key.field}"


def test_empty_bundle_round_trips() -> None:
    buf = wire.encode_bundle_bytes({})
    assert wire.decode_bundle(buf) == {}
    parsed = wire.parse_bundle(buf)
    assert parsed.task_ids == [] and parsed.columns == {} and parsed.shard_count() == 0
    assert description_of(buf) == {"version": 2, "task_ids": [], "fields": {}}


def test_ids_at_the_alphabet_and_length_limits() -> None:
    long_id = ("aZ09._:@=+-" * 20)[:200]
    bundle = {(long_id, long_id): torch.ones(2), ("-", "+"): "x", ("..", "."): 1, ("a:b@c=d", "e+f"): None}
    assert_bundle_equal(round_trip(bundle), bundle)


@pytest.mark.parametrize(
    "array",
    [
        pytest.param(np.arange(6, dtype=np.float32).reshape(2, 3), id="f32"),
        pytest.param(np.array([True, False, True]), id="bool"),
        pytest.param(np.arange(6, dtype=np.uint16).reshape(3, 2).T, id="transposed-u16"),
        pytest.param(np.array(2.5), id="0-d"),
        pytest.param(np.zeros((0, 4), dtype=np.int64), id="empty"),
        pytest.param(np.arange(5, dtype=np.int64)[::-1], id="negative-stride"),
        pytest.param(np.arange(10, dtype=np.complex128)[::3], id="c128-step"),
    ],
)
def test_numpy_arrays_are_sent_as_tensors(array: np.ndarray) -> None:
    got = round_trip({("t", "x"): array})[("t", "x")]
    assert isinstance(got, torch.Tensor)
    assert tuple(got.shape) == array.shape
    assert np.array_equal(got.numpy(), array)


@pytest.mark.parametrize(
    "array",
    [
        pytest.param(np.array(["a", "b"]), id="str"),
        pytest.param(np.array([object(), 1], dtype=object), id="object"),
        pytest.param(np.array(["2024-01-01"], dtype="datetime64[D]"), id="datetime"),
    ],
)
def test_numpy_arrays_without_a_tensor_dtype_raise(array: np.ndarray) -> None:
    assert_wire_error(lambda: wire.encode_bundle_bytes({("t", "x"): array}))


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.zeros(3, dtype=torch.complex32), id="complex32"),
        pytest.param(lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8), id="quint8"),
        pytest.param(lambda: torch.eye(3).to_sparse(), id="sparse-coo"),
        pytest.param(lambda: torch.eye(3).to_sparse_csr(), id="sparse-csr"),
        pytest.param(lambda: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]), id="nested"),
    ],
)
@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's own "experimental / deprecated" notices
def test_unsendable_tensors_raise(make: Callable[[], torch.Tensor]) -> None:
    tensor = make()
    assert_wire_error(lambda: wire.encode_bundle_bytes({("t", "x"): tensor}))


# --------------------------------------------------------------------------- JSON values

JSON_VALUES = [
    pytest.param("", id="empty-str"),
    pytest.param("héllo wörld ✓ 🎉 \U0001f9ea 中文 \x00 \n\t\"'\\", id="unicode"),
    pytest.param(0, id="zero"),
    pytest.param(-17, id="negative-int"),
    pytest.param(2**63, id="2**63"),
    pytest.param(-(2**64) - 1, id="below-i64"),
    pytest.param(10**300 + 7, id="big-int"),
    pytest.param(1.5, id="float"),
    pytest.param(0.1, id="float-0.1"),
    pytest.param(5e-324, id="subnormal"),
    pytest.param(1.7976931348623157e308, id="max-float"),
    pytest.param(float("nan"), id="nan"),
    pytest.param(float("inf"), id="inf"),
    pytest.param(float("-inf"), id="-inf"),
    pytest.param(-0.0, id="-0.0"),
    pytest.param(True, id="true"),
    pytest.param(False, id="false"),
    pytest.param(None, id="none"),
    pytest.param([], id="empty-list"),
    pytest.param({}, id="empty-dict"),
    pytest.param([1, "a", None, True, 2.5, [[], {}]], id="mixed-list"),
    pytest.param({"b": 1, "a": [1, {"x": None}], "": "", "🎉": -0.0, "nan": float("nan")}, id="nested-dict"),
    pytest.param((1, (2, "x"), []), id="tuple"),
    pytest.param({"t": (1.0, -0.0)}, id="tuple-in-dict"),
]


@pytest.mark.parametrize("value", JSON_VALUES)
def test_json_values_round_trip_exactly(value: Any) -> None:
    buf = wire.encode_bundle_bytes({("task", "val"): value, ("task", "t"): torch.ones(1)})
    for source in (buf, bytearray(buf)):
        got = wire.decode_bundle(source)[("task", "val")]
        assert json_identical(got, as_json(value)), (got, value)


def test_negative_zero_keeps_its_sign() -> None:
    got = round_trip({("t", "z"): -0.0, ("t", "l"): [0.0, -0.0]})
    assert math.copysign(1.0, got[("t", "z")]) == -1.0
    assert [math.copysign(1.0, v) for v in got[("t", "l")]] == [1.0, -1.0]


def test_bool_stays_bool_and_int_stays_int() -> None:
    got = round_trip({("t", "b"): True, ("t", "i"): 1, ("t", "f"): 1.0})
    assert got[("t", "b")] is True
    assert type(got[("t", "i")]) is int
    assert type(got[("t", "f")]) is float


def test_json_values_ride_in_metadata_as_one_json_array_per_field() -> None:
    buf = wire.encode_bundle_bytes({("t", "j"): {"a": [1, 2]}, ("u", "j"): "é", ("t", "x"): torch.zeros(2)})
    header, _ = split_container(buf)
    assert json.loads(header["__metadata__"]["json/j"]) == [{"a": [1, 2]}, "é"]
    assert "j" not in header and "json/j" not in header  # no tensor entry for a JSON field
    assert description_of(buf) == {
        "version": 2,
        "task_ids": ["t", "u"],
        "fields": {"j": {"dtype": None}, "x": {"dtype": "F32", "rows": True, "layout": "uniform"}},
    }
    parsed = wire.parse_bundle(buf)
    assert parsed.columns["j"].values == [{"a": [1, 2]}, "é"] and parsed.columns["j"].rows is None
    assert parsed.columns["x"].rows is not None and parsed.columns["x"].rows.tolist() == [0]
    assert parsed.shard_count() == 3


def test_big_ints_up_to_the_interpreter_limit_round_trip_and_beyond_it_raise() -> None:
    limit = sys.get_int_max_str_digits()
    if limit == 0:
        pytest.skip("the int/str digit limit is disabled in this interpreter")
    for value in (10 ** (limit - 1), -(10 ** (limit - 1))):
        assert round_trip({("t", "n"): value})[("t", "n")] == value
    too_big = 10 ** (limit + 10)
    assert_wire_error(lambda: wire.encode_bundle_bytes({("t", "n"): too_big}))
    assert_wire_error(lambda: wire.encode_bundle_bytes({("t", "n"): [1, {"k": -too_big}]}))
    # A peer sending such a number: the decoder refuses it the same way.
    forged = forge(["t"], {"n": {"dtype": None}}, json_fields={"n": "[" + "1" * (limit + 10) + "]"})
    assert_wire_error(lambda: wire.decode_bundle(forged))
    fine = forge(["t"], {"n": {"dtype": None}}, json_fields={"n": "[" + "1" * (limit - 1) + "]"})
    assert wire.decode_bundle(fine)[("t", "n")] == int("1" * (limit - 1))


class Opaque:
    pass


@pytest.mark.parametrize(
    "value",
    [
        pytest.param({1: "a"}, id="int-key"),
        pytest.param({None: 1}, id="none-key"),
        pytest.param({True: 1}, id="bool-key"),
        pytest.param({(1, 2): 1}, id="tuple-key"),
        pytest.param({"ok": {2.5: 1}}, id="nested-float-key"),
        pytest.param({1, 2}, id="set"),
        pytest.param(frozenset(), id="frozenset"),
        pytest.param([1, {2}], id="set-in-list"),
        pytest.param(Opaque(), id="object"),
        pytest.param(object(), id="bare-object"),
        pytest.param(b"bytes", id="bytes"),
        pytest.param(bytearray(b"x"), id="bytearray"),
        pytest.param(1j, id="complex"),
        pytest.param(range(3), id="range"),
        pytest.param(print, id="function"),
        pytest.param(np.int64(3), id="np.int64"),
        pytest.param(np.int32(3), id="np.int32"),
        pytest.param(np.uint8(3), id="np.uint8"),
        pytest.param(np.float32(1.5), id="np.float32"),
        pytest.param(np.float16(1.5), id="np.float16"),
        pytest.param(np.bool_(True), id="np.bool_"),
        pytest.param(np.complex64(1j), id="np.complex64"),
        pytest.param([np.int64(1)], id="np-scalar-in-list"),
        pytest.param({"k": np.float32(2.0)}, id="np-scalar-in-dict"),
    ],
)
def test_values_that_are_not_json_raise_at_encode(value: Any) -> None:
    assert_wire_error(lambda: wire.encode_bundle_bytes({("t", "v"): value}))
    assert_wire_error(lambda: wire.encode_bundle({("t", "ok"): 1, ("t", "v"): value}))


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("\ud800", id="lone-surrogate"),
        pytest.param({"\udfff": 1}, id="lone-surrogate-key"),
        pytest.param(["é", "a\udc80b"], id="lone-surrogate-beside-unicode"),
    ],
)
def test_lone_surrogates_travel_as_json_escapes(value: Any) -> None:
    """A str holding a lone surrogate is valid JSON once escaped (`\\ud800`): the field's array
    is sent ASCII-escaped, so the header stays valid UTF-8 (safetensors reads it) and the value
    comes back the same. A raw surrogate in the header's text is refused (see MALFORMED_BUNDLES)."""
    buf = wire.encode_bundle_bytes({("t", "v"): value, ("u", "v"): "ü"})
    header_len = int.from_bytes(buf[:8], "little")
    header = buf[8 : 8 + header_len].decode("utf-8")  # strict: no surrogates in the bytes
    assert "\\ud" in header
    text = json.loads(header)["__metadata__"]["json/v"]
    assert text.isascii()
    assert json_identical(json.loads(text), [as_json(value), "ü"])
    got = round_trip({("t", "v"): value})[("t", "v")]
    assert json_identical(got, as_json(value))
    assert safetensors.torch.load(buf) == {}  # no tensors, and a header safetensors accepts


def nested_lists(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def nested_dicts(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = {"k": value}
    return value


def test_nesting_up_to_the_limit_round_trips() -> None:
    for value in (nested_lists(wire.MAX_JSON_DEPTH), nested_dicts(wire.MAX_JSON_DEPTH)):
        got = round_trip({("t", "deep"): value})[("t", "deep")]
        assert got == value


@pytest.mark.parametrize("depth", [wire.MAX_JSON_DEPTH + 5, 500, 100_000])
def test_excessive_nesting_raises_at_encode(depth: int) -> None:
    assert_wire_error(lambda: wire.encode_bundle_bytes({("t", "deep"): nested_lists(depth)}))
    assert_wire_error(lambda: wire.encode_bundle_bytes({("t", "deep"): nested_dicts(depth)}))


def test_self_referencing_value_raises_at_encode() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    assert_wire_error(lambda: wire.encode_bundle_bytes({("t", "loop"): loop}))
    cyclic: dict[str, Any] = {}
    cyclic["me"] = cyclic
    assert_wire_error(lambda: wire.encode_bundle_bytes({("t", "loop"): cyclic}))


# --------------------------------------------------------------------------- invalid keys at encode

BAD_IDS = [
    "",
    "a" * 201,
    "a/b",
    "../x",
    "..\\x",
    "a b",
    "tab\t",
    "line\n",
    "é",
    "🎉",
    "a\x00",
    "a,b",
    "a*",
    "~home",
    None,
    1,
    1.5,
    b"ab",
    ("a",),
]


@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
def test_invalid_task_id_or_field_raises_at_encode(bad: Any) -> None:
    value = torch.zeros(1)
    assert_wire_error(lambda: wire.encode_bundle_bytes({(bad, "field"): value}))
    assert_wire_error(lambda: wire.encode_bundle_bytes({("task", bad): 1}))
    # ShardKey does no checking of its own; the wire must still refuse it.
    assert_wire_error(lambda: wire.encode_bundle_bytes({ShardKey("task", bad): 1}))


@pytest.mark.parametrize(
    "key",
    ["ab", "task/field", ("a",), ("a", "b", "c"), (), 1, None, frozenset({"a", "b"})],
    ids=repr,
)
def test_keys_that_are_not_pairs_raise_at_encode(key: Any) -> None:
    assert_wire_error(lambda: wire.encode_bundle_bytes({key: 1}))
    assert_wire_error(lambda: wire.encode_bundle_bytes({("ok", "ok"): 1, key: torch.ones(1)}))


# --------------------------------------------------------------------------- zero copy and alignment


def test_decoding_a_bytearray_is_zero_copy() -> None:
    bundle = {
        ("t", "i64"): torch.arange(10, dtype=torch.int64),
        ("t", "f32"): torch.ones(3, 4),
        ("t", "u8"): torch.arange(5, dtype=torch.uint8),
        ("t", "bf16"): torch.randn(7, dtype=torch.bfloat16),
        ("t", "json"): {"x": 1},
    }
    buf = bytearray(wire.encode_bundle_bytes(bundle))
    out = wire.decode_bundle(buf)
    base = address(buf)
    for key in [k for k, v in bundle.items() if isinstance(v, torch.Tensor)]:
        tensor = out[key]
        start = tensor.data_ptr() - base
        assert 0 <= start and start + tensor.nbytes <= len(buf), key
        before = bits(tensor)
        buf[start] ^= 0xFF  # writing the buffer changes the tensor...
        assert bits(tensor) != before
        assert bits(tensor)[0] == before[0] ^ 0xFF
        buf[start] ^= 0xFF
        assert bits(tensor) == before
    # ...and writing the tensor changes the buffer.
    ids = out[("t", "i64")]
    ids[0] = 0x0102030405060708
    start = ids.data_ptr() - base
    assert bytes(buf[start : start + 8]) == (0x0102030405060708).to_bytes(8, "little")


def test_zero_copy_tensors_pin_the_bytearray() -> None:
    buf = bytearray(wire.encode_bundle_bytes({("t", "x"): torch.arange(4)}))
    out = wire.decode_bundle(buf)
    with pytest.raises(BufferError):  # resizing would leave the tensor pointing at freed memory
        buf.extend(b"\x00" * 1024)
    assert torch.equal(out[("t", "x")], torch.arange(4))
    del out
    buf.extend(b"\x00")  # released once the tensors are gone


def test_decoding_readonly_bytes_copies_and_does_not_warn() -> None:
    src = torch.arange(16, dtype=torch.float32)
    buf = wire.encode_bundle_bytes({("t", "x"): src, ("t", "y"): torch.arange(3, dtype=torch.int8)})
    snapshot = bytes(bytearray(buf))
    base = address(buf)
    for source in (buf, memoryview(buf)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("error")
            out = wire.decode_bundle(source)
        assert caught == []
        for tensor in out.values():
            ptr = tensor.data_ptr()
            assert not base <= ptr < base + len(buf), "tensor aliases immutable bytes"
            tensor.add_(1)  # writable: a private copy
        assert torch.equal(out[("t", "x")], src + 1)
        assert buf == snapshot


def test_parsing_returns_views_not_copies() -> None:
    bundle = {
        ("t", "x"): torch.arange(6, dtype=torch.int16),
        ("u", "x"): torch.arange(2, dtype=torch.int16) + 100,
        ("t", "e"): torch.zeros(0),
    }
    for buf in (wire.encode_bundle_bytes(bundle), bytearray(wire.encode_bundle_bytes(bundle))):
        parsed = wire.parse_container(buf)
        for raw in parsed.tensors.values():
            assert isinstance(raw.data, memoryview)
            assert raw.data.obj is buf
        raw = parsed.tensors["x"]
        assert raw.dtype == "I16" and raw.shape == (8,) and raw.nbytes == 16
        expected = torch.cat([torch.arange(6), torch.arange(2) + 100]).to(torch.int16)
        assert bytes(raw.data) == bytes(expected.numpy())
        assert parsed.tensors["x/lengths"].shape == (2,)
        # The bundle's columns are the same views (no copy), with their tables as numpy arrays.
        column = wire.parse_bundle(buf).columns["x"]
        assert [memoryview(p).obj for p in column.parts] == [buf]
        assert column.nbytes == 16 and bytes(column.single_buffer()) == bytes(expected.numpy())
        assert column.shapes == RowShapes.ragged([6, 2])


def _mixed_bundle(task_id: str) -> dict[Any, Any]:
    """Every dtype in every layout (odd sizes, so unaligned ends follow), over two tasks."""
    bundle: dict[Any, Any] = {}
    other = task_id + "-2"
    for i, (name, dtype) in enumerate(AVAILABLE):
        bundle[(task_id, f"{name}.odd")] = random_tensor(dtype, (3,), seed=i)  # ragged
        bundle[(other, f"{name}.odd")] = random_tensor(dtype, (1,), seed=i + 50)
        bundle[(task_id, f"{name}.one")] = random_tensor(dtype, (), seed=i + 100)  # general
        bundle[(other, f"{name}.one")] = random_tensor(dtype, (1, 3), seed=i + 150)
        bundle[(task_id, f"{name}.none")] = random_tensor(dtype, (0, 2), seed=i)  # uniform
        bundle[(other, f"{name}.none")] = random_tensor(dtype, (0, 2), seed=i)
        bundle[(other, f"{name}.part")] = random_tensor(dtype, (5,), seed=i + 200)  # rows
    bundle[(task_id, "json")] = "x" * (len(task_id) % 5)
    return bundle


@pytest.mark.parametrize("id_len", range(1, 33))
def test_every_encoded_tensor_is_aligned_to_its_element_size(id_len: int) -> None:
    # Varying the id length walks the header length through every residue mod 16.
    task_id = "t" * id_len
    bundle = _mixed_bundle(task_id)
    buf = wire.encode_bundle_bytes(bundle)
    header, data = split_container(buf)
    header_len = len(buf) - len(data) - 8
    for name, info in header.items():
        if name == "__metadata__":
            continue
        position = 8 + header_len + info["data_offsets"][0]
        assert position % wire.ITEMSIZE[info["dtype"]] == 0, (name, position)
    for source in (bytearray(buf), buf):
        out = wire.decode_bundle(source)
        for key, tensor in out.items():
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                assert tensor.data_ptr() % tensor.element_size() == 0, key
        assert_bundle_equal(out, bundle)


def test_misaligned_but_valid_container_decodes_to_aligned_tensors() -> None:
    """The spec allows any offsets; data and tables at odd ones still decode, to aligned tensors."""
    f32 = np.array([1.5, -2.0], dtype=np.float32).tobytes()
    f64 = np.array([3.25, 0.5], dtype=np.float64).tobytes()
    c128 = np.array([1 + 2j], dtype=np.complex128).tobytes()
    lengths = np.array([2, 0], dtype=np.int64).tobytes()
    rows = np.array([1], dtype=np.int64).tobytes()
    fields = {
        "u8": {"dtype": "U8", "layout": "uniform"},
        "f32": {"dtype": "F32", "layout": "uniform"},
        "f64": {"dtype": "F64", "layout": "ragged"},
        "c128": {"dtype": "C128", "layout": "uniform", "rows": True},
    }
    header = {
        "__metadata__": {"distbatch": describe(["a", "b"], fields)},
        "u8": entry("U8", [2], 0, 2),
        "f32": entry("F32", [2, 1], 2, 10),
        "f64": entry("F64", [2], 10, 26),
        "f64/lengths": entry("I64", [2], 26, 42),
        "c128": entry("C128", [1], 42, 58),
        "c128/rows": entry("I64", [1], 58, 66),
    }
    buf = container(header, b"\x07\x08" + f32 + f64 + lengths + c128 + rows)
    for source in (bytearray(buf), buf):
        out = wire.decode_bundle(source)
        for tensor in out.values():
            assert tensor.data_ptr() % tensor.element_size() == 0
        assert out[("a", "u8")].tolist() == 7 and out[("b", "u8")].tolist() == 8
        assert out[("a", "f32")].tolist() == [1.5] and out[("b", "f32")].tolist() == [-2.0]
        assert out[("a", "f64")].tolist() == [3.25, 0.5] and out[("b", "f64")].tolist() == []
        assert out[("b", "c128")].tolist() == 1 + 2j
        assert ("a", "c128") not in out


def test_decoding_an_offset_memoryview_of_a_bytearray() -> None:
    inner = wire.encode_bundle_bytes({("t", "x"): torch.arange(3, dtype=torch.float64), ("t", "j"): [1]})
    for shift in range(8):
        outer = bytearray(b"\xee" * shift) + bytearray(inner) + bytearray(b"\xee" * 3)
        view = memoryview(outer)[shift : shift + len(inner)]
        out = wire.decode_bundle(view)
        assert out[("t", "x")].tolist() == [0.0, 1.0, 2.0]
        assert out[("t", "x")].data_ptr() % 8 == 0
        assert out[("t", "j")] == [1]


# --------------------------------------------------------------------------- safetensors interop


def _safetensors_supports(dtype: torch.dtype) -> bool:
    try:
        safetensors.torch.load(safetensors.torch.save({"p": random_tensor(dtype, (2,))}))
    except Exception:
        return False
    return True


def _skip_unless_safetensors_has(name: str, dtype: torch.dtype) -> None:
    if not _safetensors_supports(dtype):
        if name == "C128":
            pytest.skip("C128 is our extension; the safetensors spec has no complex128")
        pytest.skip(f"safetensors {safetensors.__version__} cannot handle {name} at all")


@pytest.mark.parametrize(("name", "dtype"), DTYPE_PARAMS)
def test_our_bundles_load_with_safetensors(name: str, dtype: torch.dtype) -> None:
    """Every entry of our bundle is a plain tensor to the `safetensors` package, of the field's own
    dtype (bf16 stays bf16): the values laid end to end, and int64 tables beside them."""
    _skip_unless_safetensors_has(name, dtype)
    general = [
        random_tensor(dtype, (3, 4), seed=1),
        random_tensor(dtype, (0,)),
        random_tensor(dtype, (), seed=3),
    ]
    ragged = [
        random_tensor(dtype, (2, 3), seed=4),
        random_tensor(dtype, (5, 3), seed=5),
        random_tensor(dtype, (0, 3)),
    ]
    partial = [random_tensor(dtype, (), seed=6), random_tensor(dtype, (), seed=7)]
    tasks = ["task-1", "task-2", "task-3"]
    bundle: dict[Any, Any] = {}
    for i, task in enumerate(tasks):
        bundle[(task, "x")] = general[i]
        bundle[(task, "seq")] = ragged[i]
        if i:
            bundle[(task, "scalar")] = partial[i - 1]
    buf = wire.encode_bundle_bytes(bundle)
    loaded = safetensors.torch.load(buf)
    assert set(loaded) == {"x", "x/ranks", "x/dims", "seq", "seq/lengths", "scalar", "scalar/rows"}
    assert_identical(loaded["x"], flat_cat(general))
    assert loaded["x/ranks"].tolist() == [2, 1, 0]
    assert loaded["x/dims"].tolist() == [[3, 4], [0, 0], [0, 0]]
    assert_identical(loaded["seq"], torch.cat(ragged))
    assert loaded["seq/lengths"].tolist() == [2, 5, 0]
    assert_identical(loaded["scalar"], torch.stack(partial))
    assert loaded["scalar/rows"].tolist() == [1, 2]
    for table in ("x/ranks", "x/dims", "seq/lengths", "scalar/rows"):
        assert loaded[table].dtype == torch.int64
    # And our dtype name is the one safetensors itself writes.
    theirs, _ = split_container(safetensors.torch.save({"p": general[0]}))
    assert theirs["p"]["dtype"] == name


@pytest.mark.parametrize(("name", "dtype"), DTYPE_PARAMS)
def test_safetensors_written_bundles_decode_with_ours(name: str, dtype: torch.dtype) -> None:
    """A bundle written by `safetensors.torch.save` (our layout, its writer) decodes to the same bits."""
    _skip_unless_safetensors_has(name, dtype)
    uniform = [random_tensor(dtype, (2, 5), seed=5), random_tensor(dtype, (2, 5), seed=6)]
    ragged = [random_tensor(dtype, (3,), seed=7), random_tensor(dtype, (0,))]
    general = [random_tensor(dtype, (), seed=8), random_tensor(dtype, (2, 2), seed=9)]
    partial = random_tensor(dtype, (0, 3))
    tensors = {
        "x": torch.stack(uniform),
        "seq": torch.cat(ragged),
        "seq/lengths": torch.tensor([3, 0]),
        "g": flat_cat(general),
        "g/ranks": torch.tensor([0, 2]),
        "g/dims": torch.tensor([[0, 0], [2, 2]]),
        "p": partial.unsqueeze(0),
        "p/rows": torch.tensor([1]),
    }
    fields = {
        "x": {"dtype": name, "layout": "uniform"},
        "seq": {"dtype": name, "layout": "ragged"},
        "g": {"dtype": name, "layout": "general"},
        "p": {"dtype": name, "layout": "uniform", "rows": True},
        "uid": {"dtype": None},
    }
    metadata = {"distbatch": describe(["t1", "t2"], fields), "json/uid": '["u-1", {"n": 2}]'}
    buf = safetensors.torch.save(tensors, metadata=metadata)
    expected = {
        ("t1", "x"): uniform[0],
        ("t2", "x"): uniform[1],
        ("t1", "seq"): ragged[0],
        ("t2", "seq"): ragged[1],
        ("t1", "g"): general[0],
        ("t2", "g"): general[1],
        ("t2", "p"): partial,
        ("t1", "uid"): "u-1",
        ("t2", "uid"): {"n": 2},
    }
    for source in (buf, bytearray(buf)):
        assert_bundle_equal(wire.decode_bundle(source), expected)


def test_mixed_bundle_interop_both_ways_with_metadata(tmp_path: Any) -> None:
    supported = [(n, d) for n, d in AVAILABLE if _safetensors_supports(d)]
    values = {
        n: [random_tensor(d, (i % 3 + 1 + t, 2), seed=i + t) for t in range(2)]
        for i, (n, d) in enumerate(supported)
    }
    bundle: dict[Any, Any] = {(f"task-{t}", n): v[t] for n, v in values.items() for t in range(2)}
    bundle[("task-0", "uid")] = {"a": [1, "é"]}
    ours = wire.encode_bundle_bytes(bundle)
    path = tmp_path / "ours.safetensors"
    path.write_bytes(ours)
    with safetensors.safe_open(str(path), framework="pt") as handle:
        assert set(handle.keys()) == {*values, *(f"{n}/lengths" for n in values), "uid/rows"}
        meta = handle.metadata()
        assert json.loads(meta["json/uid"]) == [{"a": [1, "é"]}]
        assert json.loads(meta["distbatch"])["task_ids"] == ["task-0", "task-1"]
        for name, tensors in values.items():
            assert_identical(handle.get_tensor(name), torch.cat(tensors))
            assert handle.get_tensor(f"{name}/lengths").tolist() == [t.shape[0] for t in tensors]
    # safetensors-written, JSON shards carried in its metadata.
    theirs_tensors: dict[str, torch.Tensor] = {"uid/rows": torch.tensor([0])}
    for name, tensors in values.items():
        theirs_tensors[name] = torch.cat(tensors)
        theirs_tensors[f"{name}/lengths"] = torch.tensor([t.shape[0] for t in tensors])
    fields: dict[str, Any] = {n: {"dtype": n, "layout": "ragged"} for n in values}
    fields["uid"] = {"dtype": None, "rows": True}
    metadata = {
        "format": "pt",
        "distbatch": describe(["task-0", "task-1"], fields),
        "json/uid": '[{"a":[1,"é"]}]',
    }
    theirs = safetensors.torch.save(theirs_tensors, metadata=metadata)
    assert_bundle_equal(wire.decode_bundle(theirs), bundle)


def test_forged_bundle_in_every_layout_is_accepted() -> None:
    """`GOOD` (written by safetensors.numpy: uniform, ragged, general, rows in any order, JSON,
    a field split over `q` and `q#1`) parses column by column and decodes to the documented values."""
    parsed = wire.parse_bundle(GOOD)
    assert parsed.task_ids == ["t0", "t1", "t2"]
    kinds = {name: (c.dtype, c.shapes.kind if c.shapes else None) for name, c in parsed.columns.items()}
    assert kinds == {
        "u": ("F32", "uniform"),
        "r": ("I64", "ragged"),
        "g": ("U8", "general"),
        "p": ("I32", "uniform"),
        "j": (None, None),
        "k": (None, None),
        "q": ("I16", "uniform"),
        "q#1": (None, None),
    }
    assert sorted(bundle_keys(parsed)) == sorted(GOOD_VALUES)
    assert parsed.shard_count() == len(GOOD_VALUES)
    # The column layer: each column's rows, in its own row order.
    for name, column in parsed.columns.items():
        field = wire.column_field(name)
        rows = range(3) if column.rows is None else column.rows.tolist()
        for row, value in zip(rows, column_rows(column), strict=True):
            assert_same_value(value, GOOD_VALUES[(parsed.task_ids[row], field)])
    # The per-shard API, over every kind of buffer.
    for source in (GOOD, bytearray(GOOD), memoryview(GOOD)):
        out = wire.decode_bundle(source)
        assert set(out) == set(GOOD_VALUES)
        for key, value in GOOD_VALUES.items():
            assert_same_value(out[key], value)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"p/rows": [0, 2], "p": np.array([-9, 7], dtype=np.int32)}, id="rows-ascending"),
        pytest.param({"p/rows": [0, 1, 2], "p": np.array([-9, 0, 7], dtype=np.int32)}, id="rows-every-task"),
        pytest.param({"r/lengths": [1, 1, 1]}, id="ragged-equal-lengths"),
        pytest.param(
            {"g/ranks": [1, 1, 1], "g/dims": [[2], [2], [3]], "g": np.arange(7, dtype=np.uint8)},
            id="general-one-rank",
        ),
    ],
)
def test_valid_layouts_we_would_not_write_are_accepted(change: dict[str, Any]) -> None:
    """Rows in any order or covering every task, and layouts less compact than ours, are still valid."""
    spec = good_spec()
    spec["tensors"].update(change)
    buf = forge(spec["task_ids"], spec["fields"], spec["tensors"], spec["json"])
    out = wire.decode_bundle(buf)
    parsed = wire.parse_bundle(buf)
    assert sorted(out) == sorted(bundle_keys(parsed))
    assert_same_value(out[("t2", "p")], np.array(7, dtype=np.int32))
    assert_same_value(out[("t0", "p")], np.array(-9, dtype=np.int32))
    if "r/lengths" in change:
        assert [out[(t, "r")].tolist() for t in ("t0", "t1", "t2")] == [[[0, 1]], [[2, 3]], [[4, 5]]]
    if "g/ranks" in change:
        assert [out[(t, "g")].tolist() for t in ("t0", "t1", "t2")] == [[0, 1], [2, 3], [4, 5, 6]]


# --------------------------------------------------------------------------- raw layer


def _raw_bundle() -> wire.Bundle:
    """A bundle made of raw columns only: bytes, shape tables and JSON values, no tensors."""
    return wire.Bundle(
        ["a", "b"],
        {
            # two parts: gathered rows are written without being joined first
            "f": wire.RawColumn(
                "F32", RowShapes.uniform(2, (1,)), [b"\x00\x00\x80?", bytearray(b"\x00\x00\x00@")], 8
            ),
            "e": wire.RawColumn("C128", RowShapes.uniform(2, (0, 3)), [], 0),
            "r": wire.RawColumn("U8", RowShapes.ragged([3, 0]), [b"xyz"], 3),
            "g": wire.RawColumn(
                "I16", RowShapes.from_list([(), (2,)]), [np.array([1, 2, 3], "<i2").tobytes()], 6
            ),
            "p": wire.RawColumn("U8", RowShapes.uniform(1, ()), [b"\x07"], 1, rows=np.array([1])),
            "j": wire.RawColumn(None, values=[{"k": [1, 2]}, float("nan")]),
            "k": wire.RawColumn(None, values=["only b"], rows=np.array([1])),
        },
    )


def test_raw_layer_round_trip_without_torch_values() -> None:
    bundle = _raw_bundle()
    parts = wire.build_bundle(bundle)
    buf = wire.join_parts(parts)
    assert wire.parts_size(parts) == len(buf)
    parsed = wire.parse_bundle(buf)
    assert parsed.task_ids == bundle.task_ids and list(parsed.columns) == list(bundle.columns)
    for name, column in bundle.columns.items():
        got = parsed.columns[name]
        assert got.dtype == column.dtype
        assert (got.rows is None) == (column.rows is None)
        if column.rows is not None:
            assert got.rows.tolist() == column.rows.tolist()
        if column.dtype is None:
            assert json_identical(got.values, column.values)
        else:
            assert got.shapes == column.shapes
            assert bytes(got.single_buffer()) == b"".join(bytes(p) for p in column.parts)
    assert parsed.shard_count() == bundle.shard_count() == 12
    assert parsed.nbytes() == bundle.nbytes()
    decoded = wire.decode_bundle(buf)
    assert decoded[("a", "f")].tolist() == [1.0] and decoded[("b", "f")].tolist() == [2.0]
    assert tuple(decoded[("b", "e")].shape) == (0, 3) and decoded[("b", "e")].dtype == torch.complex128
    assert decoded[("a", "r")].tolist() == list(b"xyz") and decoded[("b", "r")].tolist() == []
    assert decoded[("a", "g")].tolist() == 1 and decoded[("b", "g")].tolist() == [2, 3]
    assert decoded[("b", "p")].tolist() == 7 and ("a", "p") not in decoded
    assert math.isnan(decoded[("b", "j")]) and decoded[("b", "k")] == "only b"


def test_raw_layer_needs_no_torch() -> None:
    """The worker builds and parses bundles without torch: the raw layer must not import it."""
    code = (
        "import sys, numpy as np\n"
        "from distbatch import wire\n"
        "from distbatch.wire.shapes import RowShapes\n"
        "b = wire.Bundle(['a', 'b'], {'r': wire.RawColumn('U8', RowShapes.ragged([2, 1]), [b'xyz'], 3),"
        " 'j': wire.RawColumn(None, values=[1, None])})\n"
        "buf = wire.join_parts(wire.build_bundle(b))\n"
        "p = wire.parse_bundle(buf)\n"
        "assert p.shard_count() == 4 and bytes(p.columns['r'].single_buffer()) == b'xyz'\n"
        "assert wire.join_parts(wire.build_bundle(p)) == buf\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_columns_from_a_packed_tensor_or_a_list_are_the_same_bundle() -> None:
    """`tensor_column` (one packed tensor + shapes, or a stacked one) and `list_column` (one value per
    task) lay out the same bytes; `decode_column` gives back a stacked tensor or per-task views."""
    values = [torch.arange(n * 2, dtype=torch.bfloat16).reshape(n, 2) + n for n in (3, 0, 2)]
    ids = ["a", "b", "c"]
    packed = wire.tensor_column(torch.cat(values), RowShapes.ragged([3, 0, 2], (2,)))
    listed = wire.list_column("x", values, ids)
    one = wire.join_parts(wire.build_bundle(wire.Bundle(ids, {"x": packed})))
    two = wire.join_parts(wire.build_bundle(wire.Bundle(ids, {"x": listed})))
    assert one == two
    rows = wire.decode_column(wire.parse_bundle(bytearray(one)).columns["x"])
    assert isinstance(rows, list) and len(rows) == 3
    for got, want in zip(rows, values, strict=True):
        assert_identical(got.contiguous(), want)
    stacked = torch.arange(6, dtype=torch.int32).reshape(3, 2)
    column = wire.tensor_column(stacked)
    assert column.shapes == RowShapes.uniform(3, (2,))
    back = wire.decode_column(
        wire.parse_bundle(wire.join_parts(wire.build_bundle(wire.Bundle(ids, {"s": column})))).columns["s"]
    )
    assert_identical(back, stacked)
    assert_wire_error(
        lambda: wire.tensor_column(torch.zeros(4), RowShapes.ragged([2, 3]))
    )  # 5 elements claimed
    assert_wire_error(lambda: wire.tensor_column(torch.tensor(1.0)))  # no rows
    assert_wire_error(lambda: wire.list_column("x", [torch.zeros(1), 1], ids[:2]))  # tensors and JSON
    assert_wire_error(
        lambda: wire.list_column("x", [torch.zeros(1), torch.zeros(1, dtype=torch.int8)], ids[:2])
    )


# --------------------------------------------------------------------------- accepted oddities


def test_extra_header_padding_and_free_form_metadata_are_accepted() -> None:
    fields = {
        "x": {"dtype": "U8", "layout": "ragged"},
        "f": {"dtype": "F32", "layout": "uniform", "rows": True},
        "e": {"dtype": "F64", "layout": "uniform"},
    }
    header = {
        "__metadata__": {
            "format": "pt",
            "creator": "someone else",
            "distbatch": describe(["a", "b", "c"], fields),
        },
        "x": entry("U8", [2], 4, 6),
        "f": entry("F32", [1], 0, 4),
        "x/lengths": entry("I64", [3], 6, 30),
        "f/rows": entry("I64", [1], 30, 38),
        "e": entry("F64", [3, 0, 7], 38, 38),
    }
    head = json.dumps(header).encode() + b" " * 37
    data = (
        np.float32(0.5).tobytes()
        + b"\x01\x02"
        + np.array([0, 2, 0], "<i8").tobytes()
        + np.array([1], "<i8").tobytes()
    )
    buf = len(head).to_bytes(8, "little") + head + data
    out = wire.decode_bundle(buf)
    assert out[("b", "f")].tolist() == 0.5
    assert out[("b", "x")].tolist() == [1, 2] and out[("a", "x")].tolist() == []
    assert tuple(out[("c", "e")].shape) == (0, 7)
    assert len(out) == 3 + 1 + 3


def test_null_metadata_is_accepted_like_safetensors_does() -> None:
    """The container layer reads `"__metadata__": null` as no metadata; with no description,
    a container of tensors is then no bundle, and one without any is an empty bundle."""
    buf = container({"__metadata__": None, "x": entry("I8", [1], 0, 1)}, b"\xff")
    parsed = wire.parse_container(buf)
    assert parsed.metadata == {} and set(parsed.tensors) == {"x"}
    assert "distbatch" in str(assert_wire_error(lambda: wire.decode_bundle(buf)))
    assert wire.decode_bundle(container({"__metadata__": None})) == {}


def test_header_only_container_is_an_empty_bundle() -> None:
    assert wire.decode_bundle(container({})) == {}
    assert wire.decode_bundle(container({"__metadata__": {"format": "pt"}})) == {}
    assert wire.decode_bundle(forge([], {})) == {}
    assert wire.decode_bundle(safetensors.torch.save({}, metadata={"format": "pt"})) == {}


# --------------------------------------------------------------------------- malformed containers

ONE = {"a/x": entry("U8", [4], 0, 4)}
MAX_HEADER = wire.MAX_HEADER_BYTES

MALFORMED: dict[str, bytes] = {
    # framing
    "empty": b"",
    "one-byte": b"\x00",
    "seven-bytes": b"\x00" * 7,
    "length-only-zero": b"\x00" * 8,
    "header-length-past-end": container(b"{}", length=100),
    "header-length-one-past-end": (9).to_bytes(8, "little") + b"{}      ",
    "header-length-over-max": (MAX_HEADER + 1).to_bytes(8, "little") + b"{}",
    "header-length-2**64-1": b"\xff" * 8 + b"{}",
    "header-length-2**63": (2**63).to_bytes(8, "little") + b"{}",
    # header text
    "non-utf8": container(b'{"a/x": "\xff\xfe"}'),
    "truncated-utf8": container(b'{"\xe2\x82": 1}'),
    "utf8-bom": container(b"\xef\xbb\xbf{}"),
    "invalid-json": container(b'{"a/x": '),
    "json-trailing-garbage": container(b"{} {}"),
    "json-single-quotes": container(b"{'a': 1}"),
    "empty-header": container(b"", pad=False),
    "spaces-only-header": container(b"        ", pad=False),
    "nul-header": container(b"\x00" * 8, pad=False),
    "deeply-nested-header": container(b"[" * 200_000 + b"]" * 200_000),
    "header-array": container([]),
    "header-string": container("x"),
    "header-number": container(1),
    "header-null": container(None),
    "header-true": container(True),
    "duplicate-tensor-names": container(
        b'{"a/x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},'
        b' "a/x": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}',
        b"\x00\x00",
    ),
    "duplicate-key-in-entry": container(
        b'{"a/x": {"dtype": "U8", "dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}', b"\x00"
    ),
    "duplicate-metadata-key": container(b'{"__metadata__": {"a/j": "1", "a/j": "2"}}'),
    "duplicate-metadata-object": container(b'{"__metadata__": {}, "__metadata__": {}}'),
    # tensor entries
    "entry-not-object": container({"a/x": [0, 1]}),
    "entry-null": container({"a/x": None}),
    "entry-string": container({"a/x": "U8"}),
    "entry-empty-object": container({"a/x": {}}),
    "unknown-dtype": container({"a/x": entry("F128", [1], 0, 16)}, b"\x00" * 16),
    "lowercase-dtype": container({"a/x": entry("f32", [1], 0, 4)}, b"\x00" * 4),
    "torch-style-dtype": container({"a/x": entry("float32", [1], 0, 4)}, b"\x00" * 4),
    "dtype-missing": container({"a/x": {"shape": [1], "data_offsets": [0, 1]}}, b"\x00"),
    "dtype-null": container({"a/x": entry(None, [1], 0, 1)}, b"\x00"),  # type: ignore[arg-type]
    "dtype-number": container({"a/x": entry(1, [1], 0, 1)}, b"\x00"),  # type: ignore[arg-type]
    "dtype-list": container({"a/x": entry(["U8"], [1], 0, 1)}, b"\x00"),  # type: ignore[arg-type]
    "dtype-object": container({"a/x": entry({"U8": 1}, [1], 0, 1)}, b"\x00"),  # type: ignore[arg-type]
    "shape-negative": container({"a/x": entry("U8", [-1], 0, 0)}),
    "shape-negative-pair": container({"a/x": entry("U8", [-2, -2], 0, 4)}, b"\x00" * 4),
    "shape-float": container({"a/x": entry("U8", [1.0], 0, 1)}, b"\x00"),
    "shape-string": container({"a/x": entry("U8", ["1"], 0, 1)}, b"\x00"),
    "shape-bool": container({"a/x": entry("U8", [True], 0, 1)}, b"\x00"),
    "shape-null-dim": container({"a/x": entry("U8", [None], 0, 1)}, b"\x00"),
    "shape-nested": container({"a/x": entry("U8", [[1]], 0, 1)}, b"\x00"),
    "shape-not-list": container({"a/x": entry("U8", 1, 0, 1)}, b"\x00"),  # type: ignore[arg-type]
    "shape-null": container({"a/x": entry("U8", None, 0, 1)}, b"\x00"),  # type: ignore[arg-type]
    "shape-missing": container({"a/x": {"dtype": "U8", "data_offsets": [0, 1]}}, b"\x00"),
    "shape-too-many-dims": container({"a/x": entry("U8", [1] * (wire.MAX_DIMS + 1), 0, 1)}, b"\x00"),
    "shape-huge-dim": container({"a/x": entry("U8", [2**70], 0, 1)}, b"\x00"),
    "offsets-past-end": container({"a/x": entry("U8", [4], 0, 4)}, b"\x00" * 3),
    "offsets-far-past-end": container({"a/x": entry("U8", [1], 10**30, 10**30 + 1)}, b"\x00"),
    "offsets-start-after-end": container({"a/x": entry("U8", [0], 3, 2)}, b"\x00" * 3),
    "offsets-reversed": container({"a/x": entry("U8", [2], 2, 0)}, b"\x00" * 2),
    "offsets-negative": container({"a/x": entry("U8", [1], -1, 0)}, b"\x00"),
    "offsets-float": container({"a/x": entry("U8", [1], 0.0, 1.0)}, b"\x00"),
    "offsets-bool": container({"a/x": entry("U8", [1], False, True)}, b"\x00"),
    "offsets-string": container({"a/x": entry("U8", [1], "0", "1")}, b"\x00"),
    "offsets-three": container({"a/x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 1]}}, b"\x00"),
    "offsets-one": container({"a/x": {"dtype": "U8", "shape": [0], "data_offsets": [0]}}),
    "offsets-object": container({"a/x": {"dtype": "U8", "shape": [1], "data_offsets": {"0": 1}}}, b"\x00"),
    "offsets-missing": container({"a/x": {"dtype": "U8", "shape": [1]}}, b"\x00"),
    "overlapping": container({"a/x": entry("U8", [4], 0, 4), "a/y": entry("U8", [4], 2, 6)}, b"\x00" * 6),
    "same-span-twice": container({"a/x": entry("U8", [4], 0, 4), "a/y": entry("U8", [4], 0, 4)}, b"\x00" * 4),
    "contained-span": container({"a/x": entry("U8", [8], 0, 8), "a/y": entry("U8", [2], 3, 5)}, b"\x00" * 8),
    "empty-inside-another": container(
        {"a/x": entry("U8", [8], 0, 8), "a/y": entry("U8", [0], 4, 4)}, b"\x00" * 8
    ),
    "gap-between-tensors": container(
        {"a/x": entry("U8", [4], 0, 4), "a/y": entry("U8", [4], 6, 10)}, b"\x00" * 10
    ),
    "gap-at-start": container({"a/x": entry("U8", [4], 2, 6)}, b"\x00" * 6),
    "trailing-bytes": container(ONE, b"\x00" * 6),
    "trailing-byte": container(ONE, b"\x00" * 5),
    "data-without-tensors": container({}, b"\x00\x01"),
    "data-with-only-json": container({"__metadata__": {"a/j": "1"}}, b"\x00"),
    "size-mismatch-small": container({"a/x": entry("F32", [2], 0, 4)}, b"\x00" * 4),
    "size-mismatch-large": container({"a/x": entry("F32", [1], 0, 8)}, b"\x00" * 8),
    "size-mismatch-empty-shape": container({"a/x": entry("F32", [0], 0, 4)}, b"\x00" * 4),
    "size-mismatch-scalar": container({"a/x": entry("C128", [], 0, 8)}, b"\x00" * 8),
    "truncated-data": container({"a/x": entry("F64", [2], 0, 16)}, b"\x00" * 15),
    # metadata
    "metadata-list": container({"__metadata__": []}),
    "metadata-list-of-pairs": container({"__metadata__": [["a/j", "1"]]}),
    "metadata-string": container({"__metadata__": "x"}),
    "metadata-empty-string": container({"__metadata__": ""}),
    "metadata-zero": container({"__metadata__": 0}),
    "metadata-false": container({"__metadata__": False}),
    "metadata-int-value": container({"__metadata__": {"format": 1}}),
    "metadata-null-value": container({"__metadata__": {"format": None}}),
    "metadata-object-value": container({"__metadata__": {"a/j": {"x": 1}}}),
    "metadata-list-value": container({"__metadata__": {"a/j": ["1"]}}),
    "shape-span-past-int64": container({"a/x": entry("U8", [2**62, 4, 0], 0, 0)}),
    "shape-span-zero-first": container({"a/x": entry("U8", [0, 2**40, 2**30], 0, 0)}),
    "shape-dim-2**63": container({"a/x": entry("U8", [2**63, 0], 0, 0)}),
}


@pytest.mark.parametrize("label", sorted(MALFORMED))
def test_malformed_container_raises_wire_format_error(label: str) -> None:
    buf = MALFORMED[label]
    for source in (buf, bytearray(buf), memoryview(buf)):
        assert_wire_error(lambda source=source: wire.parse_container(source))
        assert_wire_error(lambda source=source: wire.parse_bundle(source))
        assert_wire_error(lambda source=source: wire.decode_bundle(source))


def test_the_largest_shapes_tensors_take_are_valid() -> None:
    """The bound on shapes is torch's own (int64 strides): one dim up to 2**63 - 1 beside a zero."""
    for shape in ([2**63 - 1, 0], [0, 2**62, 1], [2**31, 2**31, 0]):
        buf = forge(["a"], {"x": {"dtype": "U8", "layout": "uniform"}}, {"x": Raw("U8", [1, *shape])})
        assert tuple(wire.decode_bundle(buf)[("a", "x")].shape) == tuple(shape)


@pytest.mark.parametrize("label", sorted(MALFORMED_BUNDLES))
def test_malformed_bundle_raises_wire_format_error(label: str) -> None:
    """Valid safetensors containers that break one rule of the bundle format each."""
    buf = MALFORMED_BUNDLES[label]
    wire.parse_container(buf)  # the container is fine: the bundle layer is what refuses it
    for source in (buf, bytearray(buf), memoryview(buf)):
        assert_wire_error(lambda source=source: wire.parse_bundle(source))
        assert_wire_error(lambda source=source: wire.decode_bundle(source))


def test_error_messages_say_what_is_wrong() -> None:
    def message(buf: bytes) -> str:
        return str(assert_wire_error(lambda: wire.decode_bundle(buf))).lower()

    assert "truncated" in message(MALFORMED["seven-bytes"])
    assert "exceeds" in message(MALFORMED["header-length-over-max"])
    assert "past the end" in message(MALFORMED["header-length-past-end"])
    assert "json" in message(MALFORMED["invalid-json"])
    assert "duplicate" in message(MALFORMED["duplicate-tensor-names"])
    assert "dtype" in message(MALFORMED["unknown-dtype"])
    assert "shape" in message(MALFORMED["shape-negative"])
    assert "overlap" in message(MALFORMED["overlapping"])
    assert "gap" in message(MALFORMED["gap-between-tensors"])
    assert "__metadata__" in message(MALFORMED["metadata-int-value"])
    assert "64-bit" in message(MALFORMED["shape-span-past-int64"])

    def bundle_message(label: str) -> str:
        return message(MALFORMED_BUNDLES[label])

    assert "distbatch" in bundle_message("no-description")
    assert "version" in bundle_message("version-3")
    assert "duplicate" in bundle_message("description-duplicate-key")
    assert "../x" in bundle_message("task-id-traversal")
    assert "'a\\nb'" in bundle_message("task-id-newline-inside")
    assert "duplicate" in bundle_message("task-ids-duplicate") and "t0" in bundle_message(
        "task-ids-duplicate"
    )
    assert "a/b" in bundle_message("field-name-slash")
    assert "q#01" in bundle_message("layer-leading-zero")
    assert "'u'" in bundle_message("dtype-mismatch") and "f64" in bundle_message("dtype-mismatch")
    assert "r/lengths" in bundle_message("lengths-missing")
    assert "lengths" in bundle_message("lengths-sum-short")
    assert "i64" in bundle_message("lengths-i32")
    assert "negative" in bundle_message("rows-negative")
    assert "past" in bundle_message("rows-past-the-tasks")
    assert "repeat" in bundle_message("rows-repeated")
    assert "'zz'" in bundle_message("stray-entry")
    assert "json/u" in bundle_message("stray-json-for-tensor-field")
    assert "3 values" in bundle_message("json-too-few")
    assert "json/j" in bundle_message("json-invalid")
    assert "utf-8" in bundle_message("json-lone-surrogate")
    assert "same task" in bundle_message("layers-overlap")


# --------------------------------------------------------------------------- hypothesis: round trips

# "__metadata__" is a valid id but safetensors reserves it (refused as a field: its own test).
ids = st.text(alphabet=ID_ALPHABET, min_size=1, max_size=200).filter(lambda t: t != "__metadata__")
short_ids = st.text(alphabet=ID_ALPHABET, min_size=1, max_size=12).filter(lambda t: t != "__metadata__")
# A few ids drawn often, so that fields cover several tasks and share them with other fields.
keys = st.tuples(
    st.one_of(st.sampled_from(["a", "b", "c"]), short_ids, ids),
    st.one_of(st.sampled_from(["x", "y"]), short_ids, ids),
)
shapes = st.lists(st.integers(0, 4), max_size=4).map(tuple)
tensors = st.builds(random_tensor, st.sampled_from(AVAILABLE_DTYPES), shapes, st.integers(0, 2**31))
# Lone surrogates included: they travel as \u escapes.
json_text = st.text(alphabet=st.characters() | st.characters(categories=["Cs"]))
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**200), max_value=2**200),
    st.floats(),  # NaN, +-inf and -0.0 included; compared with json_identical
    json_text,
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=8), children, max_size=4),
    ),
    max_leaves=12,
)
# Random keys: sparse fields (rows), and one field's values of several dtypes or kinds (`f#k`).
bundles = st.dictionaries(keys, st.one_of(tensors, json_values), max_size=8)


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[str], dict[tuple[str, str], Any]]:
    """A batch as a trainer makes one: tasks x fields, each field uniform, ragged (0-length rows
    too), of mixed ranks (0-d values too) or JSON, over every task or some of them (`rows`)."""
    n = draw(st.integers(0, 7))
    task_ids = draw(st.lists(short_ids, min_size=n, max_size=n, unique=True))
    shards: dict[tuple[str, str], Any] = {}
    for f in range(draw(st.integers(1, 4))):
        field = f"f{f}"
        partial = draw(st.booleans())
        covered = [draw(st.booleans()) if partial else True for _ in task_ids]
        kind = draw(st.sampled_from(["uniform", "ragged", "mixed", "json"]))
        dtype = draw(st.sampled_from(AVAILABLE_DTYPES))
        fixed = draw(shapes)
        tail = draw(st.lists(st.integers(0, 3), max_size=2).map(tuple))
        for i, (task_id, keep) in enumerate(zip(task_ids, covered)):
            if not keep:
                continue
            if kind == "json":
                shards[(task_id, field)] = draw(json_values)
                continue
            if kind == "uniform":
                shape = fixed
            elif kind == "ragged":
                shape = (draw(st.integers(0, 5)), *tail)
            else:  # ranks 0, 1, 2, 0, ...: 0-d values beside others
                shape = tuple(draw(st.lists(st.integers(0, 3), min_size=i % 3, max_size=i % 3)))
            shards[(task_id, field)] = random_tensor(dtype, shape, seed=draw(st.integers(0, 2**31)))
    order = draw(st.permutations(list(shards)))
    return task_ids, {key: shards[key] for key in order}


def _check_round_trip(bundle: dict[Any, Any]) -> None:
    """The per-shard API, the column layer and the raw layer all give `bundle` back."""
    buf = wire.encode_bundle_bytes(bundle)
    for source in (buf, bytearray(buf)):
        assert_bundle_equal(wire.decode_bundle(source), bundle)
    parsed = wire.parse_bundle(buf)
    assert parsed.shard_count() == len(bundle)
    assert sorted(bundle_keys(parsed)) == sorted(tuple(k) for k in bundle)
    # Tasks in first-seen order, each named once; one column per field (and dtype / kind).
    assert parsed.task_ids == list(dict.fromkeys(k[0] for k in bundle))
    assert {wire.column_field(c) for c in parsed.columns} == {k[1] for k in bundle}
    # The column layer gives every value back too.
    for name, column in parsed.columns.items():
        rows = range(len(parsed.task_ids)) if column.rows is None else column.rows.tolist()
        for row, value in zip(rows, column_rows(column), strict=True):
            assert_same_value(value, bundle[(parsed.task_ids[row], wire.column_field(name))])
    # The raw layer re-encodes what it parsed to the very same bytes.
    assert wire.join_parts(wire.build_bundle(parsed)) == buf
    # Re-encoding what we decoded keeps every value, and is stable after that one step (the
    # task order becomes the decoded one, field by field).
    again = wire.encode_bundle_bytes(wire.decode_bundle(buf))
    assert_bundle_equal(wire.decode_bundle(again), bundle)
    assert wire.encode_bundle_bytes(wire.decode_bundle(again)) == again


@ROUND_TRIP
@given(bundle=bundles)
def test_property_random_bundles_round_trip(bundle: dict[Any, Any]) -> None:
    _check_round_trip(bundle)


@ROUND_TRIP
@given(batch=batches())
def test_property_ragged_batches_round_trip(batch: tuple[list[str], dict[tuple[str, str], Any]]) -> None:
    task_ids, shards = batch
    _check_round_trip(shards)
    # Built column by column (the batch's own path: one `list_column` per field, `rows` for
    # partial fields, in the batch's task order), the same values come back through
    # build_bundle / parse_bundle / decode_column.
    columns: dict[str, wire.RawColumn] = {}
    for field in dict.fromkeys(k[1] for k in shards):
        rows = [i for i, t in enumerate(task_ids) if (t, field) in shards]
        values = [shards[(task_ids[i], field)] for i in rows]
        column = wire.list_column(field, values, [task_ids[i] for i in rows])
        if len(rows) != len(task_ids):
            column.rows = np.asarray(rows, dtype=np.int64)
        columns[field] = column
    built = wire.join_parts(wire.build_bundle(wire.Bundle(task_ids, columns)))
    parsed = wire.parse_bundle(bytearray(built))
    assert parsed.task_ids == task_ids
    for field, column in parsed.columns.items():
        rows = range(len(task_ids)) if column.rows is None else column.rows.tolist()
        for row, value in zip(rows, column_rows(column), strict=True):
            assert_same_value(value, shards[(task_ids[row], field)])
    assert_bundle_equal(wire.decode_bundle(built), shards)
    # And the `safetensors` package reads it: each data entry is the field's values end to end.
    tensor_fields = {f: c for f, c in parsed.columns.items() if c.dtype is not None}
    if all(_safetensors_supports(wire.torch_dtype(c.dtype)) for c in tensor_fields.values()):
        loaded = safetensors.torch.load(built)
        for field, column in tensor_fields.items():
            rows = range(len(task_ids)) if column.rows is None else column.rows.tolist()
            expected = [shards[(task_ids[r], field)] for r in rows]
            assert bits(loaded[field]) == b"".join(bits(v) for v in expected)
            assert loaded[field].dtype == wire.torch_dtype(column.dtype)


@ROUND_TRIP
@given(bundle=bundles)
def test_property_raw_layer_reencodes_identically(bundle: dict[Any, Any]) -> None:
    buf = wire.encode_bundle_bytes(bundle)
    parsed = wire.parse_bundle(buf)
    assert wire.join_parts(wire.build_bundle(parsed)) == buf
    # The container layer alone keeps every entry's bytes and the metadata as they were.
    container_ = wire.parse_container(buf)
    header, data = split_container(buf)
    assert container_.metadata == header["__metadata__"]
    for name, raw in container_.tensors.items():
        start, end = header[name]["data_offsets"]
        assert bytes(raw.data) == data[start:end]


bad_chars = st.characters(exclude_characters=ID_ALPHABET)


@FUZZ
@given(
    good=short_ids,
    bad=st.one_of(
        st.builds(
            lambda a, c, b: a + c + b, st.text(ID_ALPHABET, max_size=5), bad_chars, st.text(max_size=5)
        ),
        st.text(alphabet=ID_ALPHABET, min_size=201, max_size=260),
        st.just(""),
    ),
    field_side=st.booleans(),
)
def test_property_ids_outside_the_alphabet_raise_at_encode(good: str, bad: str, field_side: bool) -> None:
    key = (good, bad) if field_side else (bad, good)
    assert_wire_error(lambda: wire.encode_bundle_bytes({key: 1}))


# --------------------------------------------------------------------------- hypothesis: fuzzing


def check_decode_is_total(buf: bytes) -> None:
    """`parse_bundle` and `decode_bundle` agree: both succeed, or both raise WireFormatError (never
    anything else); when they succeed, every value decoded is what the raw columns hold, and a
    container the bundle layer accepts is one the container layer accepts."""
    try:
        parsed = wire.parse_bundle(buf)
    except WireFormatError:
        parsed = None
    except Exception as exc:  # pragma: no cover - the failure being looked for
        raise AssertionError(f"parse_bundle raised {type(exc).__name__}: {exc}") from exc
    try:
        decoded = wire.decode_bundle(buf)
    except WireFormatError:
        decoded = None
    except Exception as exc:  # pragma: no cover - the failure being looked for
        raise AssertionError(f"decode_bundle raised {type(exc).__name__}: {exc}") from exc
    assert (parsed is None) == (decoded is None)
    if parsed is None or decoded is None:
        return
    wire.parse_container(buf)
    assert sorted(decoded) == sorted(bundle_keys(parsed))
    for name, column in parsed.columns.items():
        field = wire.column_field(name)
        rows = range(len(parsed.task_ids)) if column.rows is None else column.rows.tolist()
        if column.dtype is None:
            for row, value in zip(rows, column.values or [], strict=True):
                assert json_identical(decoded[(parsed.task_ids[row], field)], value)
            continue
        assert column.shapes is not None
        data = bytes(column.single_buffer())
        offset = 0
        for row, shape, size in zip(rows, column.shapes.tolist(), column.row_nbytes().tolist(), strict=True):
            tensor = decoded[(parsed.task_ids[row], field)]
            assert isinstance(tensor, torch.Tensor)
            assert tuple(tensor.shape) == shape
            assert tensor.dtype == wire.torch_dtype(column.dtype)
            assert tensor.nbytes == size
            if tensor.numel():
                assert tensor.data_ptr() % tensor.element_size() == 0
                assert bits(tensor) == data[offset : offset + size]
            offset += size
        assert offset == len(data) == column.nbytes


def _valid_containers() -> list[bytes]:
    out = [
        wire.encode_bundle_bytes({}),
        wire.encode_bundle_bytes({("a", "x"): torch.arange(4, dtype=torch.uint8)}),
        wire.encode_bundle_bytes({("a", "j"): {"k": [1, 2.5, None, "é"]}}),
        wire.encode_bundle_bytes(
            {
                ("t1", "ids"): torch.arange(5, dtype=torch.int64),
                ("t1", "lp"): torch.randn(5, dtype=torch.bfloat16),
                ("t1", "mask"): torch.tensor([True, False]),
                ("t2", "ids"): torch.zeros(0, 3, dtype=torch.int32),
                ("t2", "c"): torch.ones(2, dtype=torch.complex128),
                ("t2", "uid"): "u-1",
                ("t3", "r"): float("nan"),
                ("t3", "ids"): torch.arange(3, dtype=torch.int64),
                ("t3", "lp"): torch.randn(2, 2, dtype=torch.bfloat16),
            }
        ),
        GOOD,  # written by safetensors: every layout, rows, JSON and a `field#1` column
    ]
    return out


VALID_CONTAINERS = _valid_containers()


def test_fuzz_seed_containers_are_valid() -> None:
    for buf in VALID_CONTAINERS:
        wire.parse_container(buf)
        wire.decode_bundle(buf)
        check_decode_is_total(buf)


@FUZZ
@given(buf=st.binary(max_size=400))
def test_fuzz_random_bytes(buf: bytes) -> None:
    check_decode_is_total(buf)


@FUZZ
@given(header=st.binary(max_size=300), data=st.binary(max_size=64), slack=st.integers(-3, 3))
def test_fuzz_random_header_bytes_with_a_plausible_length(header: bytes, data: bytes, slack: int) -> None:
    length = max(0, len(header) + slack)
    check_decode_is_total(length.to_bytes(8, "little") + header + data)


# Names the format gives meaning to: entries and tables, metadata keys, description keys, values.
NAMES = [
    *("x", "ids", "ids/lengths", "lp/ranks", "lp/dims", "uid/rows", "q#1", "t1", "t2", "a"),
    *("__metadata__", "format", "distbatch", "json/uid", "json/x", "dtype", "shape", "data_offsets"),
    *("version", "task_ids", "fields", "layout", "rows", "uniform", "ragged", "general"),
]
any_json = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(),
        st.text(max_size=10),
        st.sampled_from(sorted(wire.ITEMSIZE)),
        st.sampled_from(NAMES),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=10,
)


@FUZZ
@given(header=st.dictionaries(st.text(max_size=12), any_json, max_size=5), data=st.binary(max_size=40))
def test_fuzz_random_json_headers(header: dict[str, Any], data: bytes) -> None:
    check_decode_is_total(container(header, data))


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            found += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += _paths(v, (*prefix, i))
    return found


def _mutate_tree(data: st.DataObject, tree: Any) -> Any:
    """Replace, delete or add 1-3 nodes anywhere in a JSON tree (in place where it can be); the tree."""
    for _ in range(data.draw(st.integers(1, 3))):
        paths = _paths(tree)
        if not paths and not isinstance(tree, dict):
            return data.draw(any_json)
        action = data.draw(st.sampled_from(["replace", "delete", "add"] if paths else ["add"]))
        if action == "add":
            parents = [p for p in [(), *paths] if isinstance(_get(tree, p), dict)]
            if not parents:
                continue
            parent = _get(tree, data.draw(st.sampled_from(parents)))
            parent[data.draw(st.one_of(st.text(max_size=8), st.sampled_from(NAMES)))] = data.draw(any_json)
            continue
        path = data.draw(st.sampled_from(paths))
        parent = _get(tree, path[:-1])
        if action == "delete":
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(any_json)
    return tree


@FUZZ
@given(data=st.data())
def test_fuzz_structural_header_mutations(data: st.DataObject) -> None:
    buf = data.draw(st.sampled_from(VALID_CONTAINERS))
    header, body = split_container(buf)
    header = _mutate_tree(data, header)
    body = data.draw(st.sampled_from([body, body[:-1], body + b"\x00", b""]))
    check_decode_is_total(container(header, body, pad=data.draw(st.booleans())))


@FUZZ
@given(data=st.data())
def test_fuzz_description_and_json_field_mutations(data: st.DataObject) -> None:
    """The same inside the metadata's own JSON texts: the description, and JSON fields' arrays."""
    buf = data.draw(st.sampled_from([b for b in VALID_CONTAINERS if len(b) > 64]))
    header, body = split_container(buf)
    metadata = header["__metadata__"]
    key = data.draw(st.sampled_from(sorted(k for k in metadata if k == "distbatch" or k.startswith("json/"))))
    metadata[key] = json.dumps(_mutate_tree(data, json.loads(metadata[key])))
    check_decode_is_total(container(header, body))


@FUZZ
@given(
    lengths=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=0, max_size=4),
    rows=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=0, max_size=3),
    ranks=st.lists(st.integers(-3, 70), min_size=3, max_size=3),
    dims=st.lists(st.lists(st.integers(-1, 2**40), min_size=2, max_size=2), min_size=3, max_size=3),
    which=st.sets(st.sampled_from(["lengths", "rows", "ranks", "dims"]), min_size=1),
)
def test_fuzz_table_values(
    lengths: list[int], rows: list[int], ranks: list[int], dims: list[list[int]], which: set[str]
) -> None:
    """GOOD with random values (any int64) in its tables: decoded exactly as the tables say, or refused."""
    spec = good_spec()
    tables = {"r/lengths": lengths, "p/rows": rows, "g/ranks": ranks, "g/dims": dims}
    for name, values in tables.items():
        if name.partition("/")[2] in which:
            spec["tensors"][name] = np.asarray(values, dtype=np.int64)
    check_decode_is_total(forge(spec["task_ids"], spec["fields"], spec["tensors"], spec["json"]))


def _get(node: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        node = node[step]
    return node


mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(0, 7)),
    st.tuples(st.just("set"), st.integers(0, 10**6), st.integers(0, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6)),
    st.tuples(st.just("insert"), st.integers(0, 10**6), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("delete"), st.integers(0, 10**6), st.integers(1, 16)),
    st.tuples(st.just("splice"), st.integers(0, 10**6), st.integers(0, 10**6), st.integers(1, 32)),
)


def _mutate(buf: bytes, op: tuple[Any, ...]) -> bytes:
    out = bytearray(buf)
    if not out:
        return bytes(out) + (op[-1] if op[0] == "insert" else b"")
    kind, pos = op[0], op[1] % (len(out) + 1)
    if kind == "flip" and pos < len(out):
        out[pos] ^= 1 << op[2]
    elif kind == "set" and pos < len(out):
        out[pos] = op[2]
    elif kind == "truncate":
        del out[pos:]
    elif kind == "insert":
        out[pos:pos] = op[2]
    elif kind == "delete":
        del out[pos : pos + op[2]]
    elif kind == "splice":  # copy a chunk of the container over another place in it
        src = op[2] % len(out)
        out[pos : pos + op[3]] = out[src : src + op[3]]
    return bytes(out)


@FUZZ
@given(buf=st.sampled_from(VALID_CONTAINERS), ops=st.lists(mutation, min_size=1, max_size=4))
def test_fuzz_byte_mutations_of_valid_containers(buf: bytes, ops: list[tuple[Any, ...]]) -> None:
    for op in ops:
        buf = _mutate(buf, op)
    check_decode_is_total(buf)


@FUZZ
@given(
    buf=st.sampled_from(VALID_CONTAINERS),
    pos=st.integers(0, 7),
    value=st.integers(0, 255),
)
def test_fuzz_header_length_field(buf: bytes, pos: int, value: int) -> None:
    mutated = bytearray(buf)
    mutated[pos] = value
    check_decode_is_total(bytes(mutated))


def test_a_field_named_like_the_safetensors_metadata_key_is_refused() -> None:
    """safetensors keeps its string metadata under "__metadata__", where a tensor field of that name
    would put its entry: such a field is refused with a message saying why, on encode and on parse."""
    for value in (torch.ones(2), "json"):
        with pytest.raises(WireFormatError, match="reserves that name"):
            wire.encode_bundle_bytes({("t", "__metadata__"): value})
    fine = wire.encode_bundle_bytes({("t", "x"): torch.ones(2)})
    forged = fine.replace(b'"x"', b'"__metadata__"').replace(b'"x/', b'"__metadata__/')
    with pytest.raises(WireFormatError):
        wire.decode_bundle(forged)
