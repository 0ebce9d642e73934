"""The wire format's tensors: the dtype table and round trips of every dtype, shape and layout
(uniform, ragged, general) through bundles.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from bundle_support import (
    split_container,
)
from wire_support import (
    AVAILABLE,
    AVAILABLE_DTYPES,
    DTYPE_PARAMS,
    assert_bundle_equal,
    assert_identical,
    assert_wire_error,
    description_of,
    random_tensor,
    round_trip,
)

from distbatch import wire
from distbatch.ids import ShardKey

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


