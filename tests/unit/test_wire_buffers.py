"""The wire format without copies: decoded tensors are views of the body, alignment, and the raw
(numpy, torch-free) layer the worker uses.
"""

from __future__ import annotations

import math
import subprocess
import sys
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from bundle_support import (
    container,
    describe,
    split_container,
)
from wire_support import (
    AVAILABLE,
    address,
    assert_bundle_equal,
    assert_identical,
    assert_wire_error,
    bits,
    entry,
    json_identical,
    random_tensor,
)

from distbatch import wire
from distbatch.wire.shapes import RowShapes

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




@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 2, 5), (2, 0, 5), (2, 5, 0), ()])
@pytest.mark.parametrize("dtype", [np.float32, np.bool_, np.int8, np.uint16])
def test_byte_view_flattens_any_buffer_zero_sizes_included(shape: tuple[int, ...], dtype: type) -> None:
    """`memoryview.cast("B")` refuses a zero in the shape; `byte_view` gives every part's bytes."""
    array = np.arange(int(np.prod(shape)), dtype=np.int64).astype(dtype).reshape(shape)
    view = wire.byte_view(array)
    assert (view.format, view.ndim, view.nbytes) == ("B", 1, array.nbytes)
    assert bytes(view) == array.tobytes()


def test_byte_view_copies_only_what_is_not_contiguous() -> None:
    array = np.arange(24, dtype=np.int32).reshape(4, 6)
    flat = wire.byte_view(array)
    assert np.shares_memory(np.frombuffer(flat, dtype=np.int32), array)
    strided = array.T
    assert bytes(wire.byte_view(strided)) == np.ascontiguousarray(strided).tobytes()
    raw = b"abc"
    assert wire.byte_view(memoryview(raw)).obj is raw


def test_byte_view_of_a_strided_byte_view_is_contiguous() -> None:
    """A 1-D byte view that skips bytes is made flat too (a socket send refuses a strided one)."""
    every_other = memoryview(bytes(range(10)))[::2]
    flat = wire.byte_view(every_other)
    assert flat.c_contiguous and bytes(flat) == bytes(range(0, 10, 2))
