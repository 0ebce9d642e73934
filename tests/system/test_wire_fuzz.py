"""Hostile bytes at the wire decoder, fuzzed: random and mutated containers are refused with
`WireFormatError`, never another exception, and what is accepted decodes to what it holds.

No process or socket: the decoder alone, under hypothesis (`FUZZ` settings). Random bytes, random
JSON headers, structural and field mutations of valid headers, byte flips of valid containers and
forged header lengths. `parse_bundle` and `decode_bundle` must agree on every input. The round-trip
properties of the same format are unit tests (`tests/unit/test_wire_properties.py`).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from bundle_support import GOOD, bundle_keys, container, forge, good_spec, split_container
from hypothesis import given
from hypothesis import strategies as st
from wire_support import FUZZ, bits, json_identical

from distbatch import wire
from distbatch.errors import WireFormatError


def _or_refused(decode: Any, buf: bytes) -> Any:
    """`decode(buf)`, or None when it raises WireFormatError; any other exception fails the test."""
    try:
        return decode(buf)
    except WireFormatError:
        return None
    except Exception as exc:  # pragma: no cover - the failure being looked for
        raise AssertionError(f"{decode.__name__} raised {type(exc).__name__}: {exc}") from exc


def check_decode_is_total(buf: bytes) -> None:
    """`parse_bundle` and `decode_bundle` agree: both succeed, or both raise WireFormatError (never
    anything else); when they succeed, every value decoded is what the raw columns hold, and a
    container the bundle layer accepts is one the container layer accepts."""
    parsed, decoded = _or_refused(wire.parse_bundle, buf), _or_refused(wire.decode_bundle, buf)
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
