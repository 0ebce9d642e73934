"""Properties of the wire format under hypothesis: random bundles round-trip exactly, and ids
outside the alphabet are refused at encode. Random and mutated bytes (hostile input) are fuzzed in
the system tier, `tests/system/test_wire_fuzz.py`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch
from bundle_support import (
    bundle_keys,
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


# What `batches` draws from, made once (a strategy built inside the composite is a new object at
# every draw, whose properties hypothesis works out again before drawing from it).
TASK_ID_LISTS = {n: st.lists(short_ids, min_size=n, max_size=n, unique=True) for n in range(8)}
FIELD_KINDS = st.sampled_from(["uniform", "ragged", "mixed", "json"])
BATCH_DTYPES = st.sampled_from(AVAILABLE_DTYPES)
TAILS = st.lists(st.integers(0, 3), max_size=2).map(tuple)
FIRST_DIMS = st.integers(0, 5)
RANKED_SHAPES = [st.lists(st.integers(0, 3), min_size=rank, max_size=rank).map(tuple) for rank in range(3)]
SEEDS = st.integers(0, 2**31)


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[str], dict[tuple[str, str], Any]]:
    """A batch as a trainer makes one: tasks x fields, each field uniform, ragged (0-length rows
    too), of mixed ranks (0-d values too) or JSON, over every task or some of them (`rows`)."""
    n = draw(st.integers(0, 7))
    task_ids = draw(TASK_ID_LISTS[n])
    shards: dict[tuple[str, str], Any] = {}
    for f in range(draw(st.integers(1, 4))):
        field = f"f{f}"
        partial = draw(st.booleans())
        covered = [draw(st.booleans()) if partial else True for _ in task_ids]
        kind = draw(FIELD_KINDS)
        dtype = draw(BATCH_DTYPES)
        fixed = draw(shapes)
        tail = draw(TAILS)
        for i, (task_id, keep) in enumerate(zip(task_ids, covered)):
            if not keep:
                continue
            if kind == "json":
                shards[(task_id, field)] = draw(json_values)
                continue
            if kind == "uniform":
                shape = fixed
            elif kind == "ragged":
                shape = (draw(FIRST_DIMS), *tail)
            else:  # ranks 0, 1, 2, 0, ...: 0-d values beside others
                shape = draw(RANKED_SHAPES[i % 3])
            shards[(task_id, field)] = random_tensor(dtype, shape, seed=draw(SEEDS))
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
