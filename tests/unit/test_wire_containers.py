"""The safetensors container: interop with the real `safetensors` package both ways, the oddities we
accept, and every malformed container and bundle we refuse.
"""

from __future__ import annotations

import json
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
from wire_support import (
    AVAILABLE,
    DTYPE_PARAMS,
    assert_bundle_equal,
    assert_identical,
    assert_same_value,
    assert_wire_error,
    column_rows,
    entry,
    flat_cat,
    random_tensor,
    safetensors_supports,
)

from distbatch import wire

# --------------------------------------------------------------------------- safetensors interop


def _skip_unless_safetensors_has(name: str, dtype: torch.dtype) -> None:
    if not safetensors_supports(dtype):
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
    supported = [(n, d) for n, d in AVAILABLE if safetensors_supports(d)]
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


