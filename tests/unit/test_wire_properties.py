"""Properties of the wire format under hypothesis: random bundles round-trip exactly, random and
mutated bytes are refused with `WireFormatError`, never another exception.
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
    bundle_keys,
    container,
    forge,
    good_spec,
    split_container,
)
from hypothesis import given
from hypothesis import strategies as st
from wire_support import (
    AVAILABLE_DTYPES,
    FUZZ,
    ID_ALPHABET,
    ROUND_TRIP,
    assert_bundle_equal,
    assert_same_value,
    assert_wire_error,
    bits,
    column_rows,
    json_identical,
    random_tensor,
    safetensors_supports,
)

from distbatch import wire
from distbatch.errors import WireFormatError

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
    if all(safetensors_supports(wire.torch_dtype(c.dtype)) for c in tensor_fields.values()):
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
