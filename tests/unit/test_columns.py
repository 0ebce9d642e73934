"""Columnar metadata against per-task references: `RowShapes`, `BatchMeta` and large balancing.

`RowShapes` and `BatchMeta` hold per-task shapes, nodes and dtypes as numpy arrays and
work on them without a loop per task. Each property here builds the same thing as a
plain list of per-task tuples (the obvious, slow form), applies the operation to both,
and compares task by task.
"""

from __future__ import annotations

import json
import math
import pickle
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distbatch import DistributedBatchMemory
from distbatch.batch.balance import EXACT_MAX_ITEMS, balanced_group_partitions
from distbatch.batch.meta import BatchMeta, FieldMeta, MetaFormatError
from distbatch.ids import ShardKey, ShardRef
from distbatch.wire import ITEMSIZE
from distbatch.wire.shapes import MAX_DIMS, RowShapes, ShapeError

PROPS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

Shape = tuple[int, ...]

# --------------------------------------------------------------------------- shape lists


# Strategies made once (hypothesis works out a new strategy object's properties before its first
# draw: building them inside the composites below at every draw was a large share of this module).
TASK_COUNTS = st.integers(0, 9)
LAYOUTS = st.sampled_from(["uniform", "ragged", "general"])
DIM = st.integers(0, 5)
UP_TO_3_DIMS = st.lists(DIM, max_size=3)
UP_TO_2_DIMS = st.lists(DIM, max_size=2)


@st.composite
def shape_lists(draw: st.DrawFn, n: int | None = None, kind: str | None = None) -> list[Shape]:
    """One shape per task, laid out uniform, ragged (same tail, own first dim) or anyhow."""
    if n is None:
        n = draw(TASK_COUNTS)
    kind = kind or draw(LAYOUTS)
    if kind == "uniform":
        shape = tuple(draw(UP_TO_3_DIMS))
        return [shape] * n
    if kind == "ragged":
        tail = tuple(draw(UP_TO_2_DIMS))
        return [(draw(DIM), *tail) for _ in range(n)]
    return [tuple(draw(UP_TO_3_DIMS)) for _ in range(n)]


def reference_kind(shapes: list[Shape]) -> str:
    if not shapes or all(s == shapes[0] for s in shapes):
        return "uniform"
    if all(len(s) >= 1 and len(s) == len(shapes[0]) and s[1:] == shapes[0][1:] for s in shapes):
        return "ragged"
    return "general"


def reference_packable(shapes: list[Shape]) -> Shape | None:
    if not shapes or any(len(s) == 0 for s in shapes):
        return None
    tails = {s[1:] for s in shapes}
    return next(iter(tails)) if len(tails) == 1 else None


def assert_shapes(rs: RowShapes, shapes: list[Shape]) -> None:
    assert rs.n == len(rs) == len(shapes)
    assert rs.tolist() == shapes
    assert list(rs) == shapes
    assert [rs.row(i) for i in range(len(shapes))] == shapes


# --------------------------------------------------------------------------- RowShapes


@PROPS
@given(shapes=shape_lists())
def test_from_list_round_trips_in_the_most_compact_layout(shapes: list[Shape]) -> None:
    rs = RowShapes.from_list(shapes)
    assert_shapes(rs, shapes)
    assert rs.kind == reference_kind(shapes)
    again = rs.normalized()
    assert again.kind == rs.kind and again.tolist() == shapes
    assert rs.counts().tolist() == [math.prod(s) for s in shapes]
    assert rs.counts().dtype == np.int64
    assert rs.first_dims().tolist() == [s[0] if s else 1 for s in shapes]
    assert rs.packable() == reference_packable(shapes)


@PROPS
@given(shapes=shape_lists(), data=st.data())
def test_every_layout_of_the_same_shapes_is_equal_and_normalizes_alike(
    shapes: list[Shape], data: st.DataObject
) -> None:
    n = len(shapes)
    width = max((len(s) for s in shapes), default=0)
    ranks = np.array([len(s) for s in shapes], dtype=np.int64)
    dims = np.zeros((n, width), dtype=np.int64)
    for i, s in enumerate(shapes):
        dims[i, : len(s)] = s
    general = RowShapes(n, ranks=ranks, dims=dims)  # the general layout, not normalized
    assert general.kind == "general"
    assert_shapes(general, shapes)
    assert general.counts().tolist() == [math.prod(s) for s in shapes]
    assert general.first_dims().tolist() == [s[0] if s else 1 for s in shapes]
    normal = general.normalized()
    assert normal.kind == reference_kind(shapes)
    assert_shapes(normal, shapes)
    assert normal == general == RowShapes.from_list(shapes) == RowShapes.general(ranks, dims)
    assert normal.packable() == reference_packable(shapes)
    if reference_packable(shapes) is not None:  # expressible as lengths + tail
        tail = shapes[0][1:]
        ragged = RowShapes.ragged([s[0] for s in shapes], tail)
        assert ragged == normal and ragged.kind == normal.kind
    other = data.draw(shape_lists(n=n))
    assert (RowShapes.from_list(other) == normal) == (other == shapes)


@PROPS
@given(shapes=shape_lists(), data=st.data())
def test_take_matches_indexing_a_list(shapes: list[Shape], data: st.DataObject) -> None:
    rs = RowShapes.from_list(shapes)
    n = len(shapes)
    indexes = data.draw(st.lists(st.integers(0, n - 1), max_size=12)) if n else []
    taken = rs.take(np.asarray(indexes, dtype=np.int64))
    expected = [shapes[i] for i in indexes]
    assert_shapes(taken, expected)
    assert taken.kind == reference_kind(expected)
    start, stop, step = data.draw(st.tuples(st.integers(-10, 10), st.integers(-10, 10), st.integers(1, 3)))
    assert_shapes(rs.take(slice(start, stop, step)), shapes[start:stop:step])


@PROPS
@given(parts=st.lists(shape_lists(), max_size=4))
def test_concat_matches_joining_lists(parts: list[list[Shape]]) -> None:
    joined = RowShapes.concat([RowShapes.from_list(p) for p in parts])
    expected = [s for p in parts for s in p]
    assert_shapes(joined, expected)
    assert joined.kind == reference_kind(expected)
    assert joined.packable() == reference_packable(expected)


@PROPS
@given(shapes=shape_lists())
def test_json_round_trip(shapes: list[Shape]) -> None:
    rs = RowShapes.from_list(shapes)
    text = json.dumps(rs.to_json())
    back = RowShapes.from_json(json.loads(text), len(shapes))
    assert back == rs
    assert_shapes(back, shapes)
    assert back.kind == rs.kind


@pytest.mark.parametrize(
    ("data", "n"),
    [
        ({"uniform": [2**40, 2**40]}, 2),  # one task spans 2**80 elements
        ({"uniform": [2**31]}, 2**32),  # together past int64
        ({"uniform": [2**70]}, 1),  # past int64 itself
        ({"tail": [2**40], "lengths": [2**40, 0]}, 2),
        ({"tail": [], "lengths": [2**70]}, 1),
        ([2, 2**40, 2**40], 1),
        ([1, 2**70], 1),
        ({"uniform": [-1]}, 1),
        ({"uniform": [True]}, 1),
        ({"uniform": [1.5]}, 1),
        ({"tail": [2], "lengths": [1]}, 2),  # lengths for 1 task, batch of 2
        ({"tail": [2], "lengths": [-1, 1]}, 2),
        ([2, 1], 1),  # truncated
        ([0, 0], 1),  # more entries than tasks
        ([1, -1], 1),
        ([1, 1.5], 1),
        ([MAX_DIMS + 1] + [1] * (MAX_DIMS + 1), 1),
        ({"uniform": [1], "tail": []}, 1),
        ("uniform", 1),
    ],
)
def test_malformed_or_overflowing_shapes_are_refused(data: Any, n: int) -> None:
    with pytest.raises(ShapeError):
        RowShapes.from_json(data, n)


def test_constructors_refuse_overflow_and_negative_dims() -> None:
    with pytest.raises(ShapeError):
        RowShapes.uniform(2, (2**40, 2**40))
    with pytest.raises(ShapeError):
        RowShapes.ragged([2**40, 2**40], (2**40,))
    with pytest.raises(ShapeError):
        RowShapes.ragged([1, -2])
    with pytest.raises(ShapeError):
        RowShapes.general([2], [[2**40, 2**40]])
    with pytest.raises(ShapeError):
        RowShapes.general([1], [[1, 5]])  # a dim past the task's rank
    with pytest.raises(ShapeError):
        RowShapes.from_list([(1,) * (MAX_DIMS + 1), (1,)])
    assert issubclass(ShapeError, ValueError)


# --------------------------------------------------------------------------- BatchMeta reference

NODES = [f"127.0.0.1:{9000 + i}" for i in range(5)]
DTYPES = [None, "F32", "I32", "BF16", "U8"]
DTYPE_CHOICES = st.sampled_from(DTYPES)


@st.composite
def schemas(draw: st.DrawFn) -> dict[str, str | None]:
    names = draw(
        st.lists(
            st.sampled_from(["input_ids", "logprobs", "reward", "uid", "mask"]),
            unique=True,
            min_size=1,
            max_size=3,
        )
    )
    return {name: draw(DTYPE_CHOICES) for name in names}


SCHEMAS = schemas()


NODE_LISTS = st.lists(st.sampled_from(NODES), min_size=1, max_size=4, unique=True)
NODE_PLACEMENTS = st.sampled_from(["one", "runs", "any"])
POSITION = st.integers(0, 2**16)


@st.composite
def metas(
    draw: st.DrawFn,
    schema: dict[str, str | None] | None = None,
    task_ids: list[str] | None = None,
    prefix: str = "task",
) -> tuple[BatchMeta, list[dict[str, Any]]]:
    """A random meta and its reference: per task, `{field: (node, dtype, shape)}`."""
    schema = schema if schema is not None else draw(SCHEMAS)
    if task_ids is None:
        n = draw(TASK_COUNTS)
        task_ids = [f"{prefix}-{i}" for i in range(n)]
    n = len(task_ids)
    nodes = draw(NODE_LISTS)
    fields: dict[str, FieldMeta] = {}
    rows: list[dict[str, Any]] = [{} for _ in range(n)]
    for name, dtype in schema.items():
        shapes = [()] * n if dtype is None else draw(shape_lists(n=n))
        # Nodes per task: one for all, in runs, or anyhow (positions mapped onto `nodes`).
        how = draw(NODE_PLACEMENTS)
        if how == "one":
            index = [draw(POSITION) % len(nodes)] * n
        else:
            index = [p % len(nodes) for p in draw(st.lists(POSITION, min_size=n, max_size=n))]
            if how == "runs":
                index.sort()
        fields[name] = FieldMeta(dtype, index, RowShapes.from_list(shapes))
        for i in range(n):
            rows[i][name] = (nodes[index[i]], dtype, shapes[i])
    return BatchMeta(list(task_ids), nodes, fields), rows


def per_task(meta: BatchMeta) -> list[dict[str, Any]]:
    """The meta read back one task at a time."""
    return [
        {name: (meta.node_of(name, i), fm.dtype, fm.shapes.row(i)) for name, fm in meta.fields.items()}
        for i in range(len(meta))
    ]


def assert_nodes_sane(meta: BatchMeta) -> None:
    """Node lists hold no repeats, every index points into them."""
    assert len(set(meta.nodes)) == len(meta.nodes)
    for fm in meta.fields.values():
        assert fm.nodes.dtype == np.int32
        assert len(fm.nodes) == len(meta)
        if len(fm.nodes):
            assert 0 <= int(fm.nodes.min()) and int(fm.nodes.max()) < len(meta.nodes)


def assert_compact(meta: BatchMeta, original_nodes: list[str]) -> None:
    """After take / merge: the nodes still named, no others (a single node may stay), original order."""
    assert_nodes_sane(meta)
    used = {meta.nodes[int(i)] for fm in meta.fields.values() for i in fm.nodes}
    if len(meta.nodes) > 1 or used:
        assert set(meta.nodes) == used
    order = [original_nodes.index(n) for n in meta.nodes if n in original_nodes]
    assert order == sorted(order)


@PROPS
@given(pair=metas(), data=st.data())
def test_take_matches_the_reference(
    pair: tuple[BatchMeta, list[dict[str, Any]]], data: st.DataObject
) -> None:
    meta, ref = pair
    assert per_task(meta) == ref
    n = len(meta)
    indexes = data.draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n)) if n else []
    sub = meta.take(indexes)
    assert sub.task_ids == [meta.task_ids[i] for i in indexes]
    assert list(sub.fields) == list(meta.fields)
    assert per_task(sub) == [ref[i] for i in indexes]
    assert_compact(sub, meta.nodes)
    assert per_task(meta.take(slice(1, None, 2))) == ref[1::2]
    names = data.draw(st.lists(st.sampled_from(list(meta.fields)), unique=True, min_size=1))
    selected = meta.select_fields(names)
    assert list(selected.fields) == names
    assert per_task(selected) == [{k: row[k] for k in names} for row in ref]
    assert_compact(selected, meta.nodes)


@PROPS
@given(pair=metas(), k=st.integers(1, 5))
def test_chunk_of_a_remote_batch_matches_the_reference(
    pair: tuple[BatchMeta, list[dict[str, Any]]], k: int
) -> None:
    meta, ref = pair
    batch = DistributedBatchMemory.from_meta(meta)
    chunks = batch.chunk(k)
    assert len(chunks) == k
    sizes = [len(c) for c in chunks]
    assert sum(sizes) == len(meta) and max(sizes) - min(sizes) <= 1
    start = 0
    for chunk, size in zip(chunks, sizes):
        assert chunk.task_ids == meta.task_ids[start : start + size]
        if size:
            assert chunk.meta is not None
            assert per_task(chunk.meta) == ref[start : start + size]
            assert_compact(chunk.meta, meta.nodes)
        start += size


@PROPS
@given(pair=metas(), k=st.integers(1, 4))
def test_chunk_balanced_of_a_remote_batch_keeps_each_tasks_metadata(
    pair: tuple[BatchMeta, list[dict[str, Any]]], k: int
) -> None:
    meta, ref = pair
    tensor_fields = [n for n, fm in meta.fields.items() if fm.is_tensor]
    if not tensor_fields or len(meta) < k:
        return
    batch = DistributedBatchMemory.from_meta(meta)
    chunks = batch.chunk_balanced(k, lengths=batch.lengths(tensor_fields[0]))  # metadata only
    position = {t: i for i, t in enumerate(meta.task_ids)}
    seen = [t for c in chunks for t in c.task_ids]
    assert sorted(seen) == sorted(meta.task_ids)
    sizes = [len(c) for c in chunks]
    assert max(sizes) - min(sizes) <= 1
    for chunk in chunks:
        rows = [position[t] for t in chunk.task_ids]
        assert rows == sorted(rows)  # relative order kept
        assert chunk.meta is not None and per_task(chunk.meta) == [ref[i] for i in rows]


@PROPS
@given(data=st.data())
def test_merge_matches_the_reference(data: st.DataObject) -> None:
    """Union of two metas over the same tasks (the second in another order): later part wins."""
    first, ref_first = data.draw(metas())
    ids = first.task_ids
    order = data.draw(st.permutations(range(len(ids))))
    second, ref_second = data.draw(metas(task_ids=[ids[i] for i in order]))
    rows = np.asarray([second.task_ids.index(t) for t in ids], dtype=np.int64)
    field_order = list(first.fields) + [f for f in second.fields if f not in first.fields]
    merged = BatchMeta.merge(list(ids), [(first, None), (second, rows)], field_order)
    expected = [{**ref_first[i], **ref_second[int(rows[i])]} for i in range(len(ids))]
    expected = [{f: row[f] for f in field_order} for row in expected]
    assert merged.task_ids == ids
    assert list(merged.fields) == field_order
    assert per_task(merged) == expected
    assert_compact(merged, list(dict.fromkeys(first.nodes + second.nodes)))


@PROPS
@given(data=st.data())
def test_concat_matches_the_reference(data: st.DataObject) -> None:
    schema = data.draw(schemas())
    count = data.draw(st.integers(1, 4))
    parts = [data.draw(metas(schema=schema, prefix=f"p{i}")) for i in range(count)]
    joined = BatchMeta.concat([m for m, _ in parts])
    assert joined.task_ids == [t for m, _ in parts for t in m.task_ids]
    assert per_task(joined) == [row for _, ref in parts for row in ref]
    assert_nodes_sane(joined)
    # through the batch API too (its cache is empty: metadata only)
    batches = [DistributedBatchMemory.from_meta(m) for m, _ in parts]
    combined = DistributedBatchMemory.concat(batches)
    if len(joined):
        assert combined.meta is not None and per_task(combined.meta) == per_task(joined)


@PROPS
@given(pair=metas(), data=st.data())
def test_plan_refs_and_keys_cover_each_shard_once(
    pair: tuple[BatchMeta, list[dict[str, Any]]], data: st.DataObject
) -> None:
    meta, ref = pair
    names = data.draw(st.lists(st.sampled_from(list(meta.fields)), unique=True, min_size=1))
    expected = sorted((row[name][0], i, name) for i, row in enumerate(ref) for name in names)
    planned = [
        (node, int(r), name)
        for node, products in meta.plan(names).items()
        for rows, fs in products
        for r in rows
        for name in fs
    ]
    assert sorted(planned) == expected  # every shard once, on its node
    for products in meta.plan(names).values():
        for rows, _ in products:
            assert len(rows) > 0 or not len(meta)  # no empty request for a batch with tasks
    refs = meta.refs(names)
    assert refs == [
        ShardRef(
            row[name][0],
            meta.task_ids[i],
            name,
            None if row[name][1] is None else math.prod(row[name][2]) * ITEMSIZE[row[name][1]],
        )
        for i, row in enumerate(ref)
        for name in names
    ]
    by_node = meta.keys_by_node()
    flat = sorted((node, key) for node, keys in by_node.items() for key in keys)
    assert flat == sorted(
        (row[name][0], ShardKey(meta.task_ids[i], name)) for i, row in enumerate(ref) for name in meta.fields
    )
    assert meta.total_bytes() == sum(
        math.prod(shape) * ITEMSIZE[dtype] for row in ref for _, dtype, shape in row.values() if dtype
    )
    for name, fm in meta.fields.items():
        if fm.is_tensor:
            assert meta.lengths(name) == [row[name][2][0] if row[name][2] else 1 for row in ref]
        else:
            with pytest.raises(ValueError):
                meta.lengths(name)


@PROPS
@given(pair=metas())
def test_pickle_and_json_round_trips(pair: tuple[BatchMeta, list[dict[str, Any]]]) -> None:
    meta, ref = pair
    for back in (pickle.loads(pickle.dumps(meta)), BatchMeta.from_json(meta.to_json())):
        assert back == meta
        assert back.task_ids == meta.task_ids and back.nodes == meta.nodes
        assert list(back.fields) == list(meta.fields)
        assert per_task(back) == ref
    # a server that sorts JSON keys (Flask's jsonify) may put a `like` field before its model
    back = BatchMeta.from_dict(json.loads(json.dumps(meta.to_dict(), sort_keys=True)))
    assert back == meta and per_task(back) == ref
    batch = DistributedBatchMemory.from_meta(meta)
    again = DistributedBatchMemory.from_json(batch.to_json())
    assert again.task_ids == meta.task_ids
    if len(meta):
        assert again.meta == meta
        assert pickle.loads(pickle.dumps(batch)).meta == meta


@pytest.mark.parametrize("ids", [[], ["only"], ["a", "b"]])
def test_pickle_of_tiny_metas(ids: list[str]) -> None:
    meta = BatchMeta(
        ids, [NODES[0]], {"x": FieldMeta("F32", [0] * len(ids), RowShapes.uniform(len(ids), (2,)))}
    )
    back = pickle.loads(pickle.dumps(meta))
    assert back.task_ids == ids and back == meta
    empty = pickle.loads(pickle.dumps(BatchMeta(ids, [], {})))
    assert empty.task_ids == ids


def test_malformed_meta_json_is_a_meta_format_error() -> None:
    meta = BatchMeta(["a", "b"], [NODES[0]], {"x": FieldMeta("F32", [0, 0], RowShapes.ragged([1, 2]))})
    good = meta.to_dict()
    bad_shapes = json.loads(json.dumps(good))
    bad_shapes["fields"]["x"]["shapes"] = {"uniform": [2**40, 2**40]}
    bad_runs = json.loads(json.dumps(good))
    bad_runs["fields"]["x"]["nodes"] = [0, 3]
    bad_like = json.loads(json.dumps(good))
    bad_like["fields"]["x"]["shapes"] = {"like": "nope"}
    for data in (bad_shapes, bad_runs, bad_like):
        with pytest.raises(MetaFormatError):
            BatchMeta.from_dict(data)


# --------------------------------------------------------------------------- balancing many items


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(EXACT_MAX_ITEMS + 1, EXACT_MAX_ITEMS + 3000),
    k=st.one_of(st.integers(1, 70), st.integers(EXACT_MAX_ITEMS - 10, EXACT_MAX_ITEMS + 3100)),
    kind=st.sampled_from(["uniform", "zeros", "heavy", "one_giant", "few_values"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_balanced_group_partitions_for_many_items(n: int, k: int, kind: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        lengths = rng.integers(0, 4096, n)
    elif kind == "zeros":
        lengths = np.zeros(n, dtype=np.int64)
    elif kind == "heavy":
        lengths = (rng.pareto(1.1, n) * 200).astype(np.int64)
    elif kind == "one_giant":
        lengths = np.ones(n, dtype=np.int64)
        lengths[rng.integers(0, n)] = 10**7
    else:
        lengths = rng.choice([128, 512, 2048], n)
    values = lengths.tolist()
    parts = balanced_group_partitions(values, k)
    assert len(parts) == k
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(n))  # every index exactly once
    counts = [len(p) for p in parts]
    assert max(counts) - min(counts) <= 1
    sums = [sum(values[i] for i in p) for p in parts]
    assert max(sums) - min(sums) <= max(values)
    assert all(p == sorted(p) for p in parts)


@pytest.mark.parametrize("n", [EXACT_MAX_ITEMS + 1, EXACT_MAX_ITEMS + 500])
def test_more_partitions_than_many_items(n: int) -> None:
    """Past the exact limit with more partitions than items (every item of positive length): each
    item alone in a partition, the rest empty."""
    parts = balanced_group_partitions([1] * n, n + 1)
    assert sorted(len(p) for p in parts) == [0] + [1] * n
    assert sorted(i for p in parts for i in p) == list(range(n))


def test_balanced_group_partitions_for_many_items_refuses_bad_input() -> None:
    n = EXACT_MAX_ITEMS + 5
    for k in (0, -1, True, 2.0):
        with pytest.raises(ValueError):
            balanced_group_partitions([1] * n, k)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        balanced_group_partitions([1] * (n - 1) + [-1], 3)
    with pytest.raises(ValueError):
        balanced_group_partitions([1] * (n - 1) + [1.5], 3)  # type: ignore[list-item]
