"""A field's kind (fixed-shape or ragged) is part of its schema, and an empty batch keeps its schema.

The column type of `batch[field]` is decided once, when the values are given (a tensor, or
per-task tensors of one shape: fixed; per-task tensors of different shapes: ragged), and every
slice, chunk, union, concat, gather, controller answer and engine call keeps it. A zero-task
slice or chunk keeps its fields: indexing gives an empty column, `packed` gives no values and `[0]`.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch

from distbatch import BatchMeta, BatchStatus, Controller, DistributedBatchMemory, WorkerGroup
from distbatch.errors import MetaFormatError

DBM = DistributedBatchMemory
LENS = [3, 5, 4, 4]  # ragged, but the last two tasks share a length


def sample() -> DBM:
    return DBM.from_dict(
        {
            "ids": [torch.arange(n, dtype=torch.int32) for n in LENS],
            "hidden": torch.randn(4, 2, dtype=torch.bfloat16),
            "pairs": [torch.ones(n, 3, dtype=torch.float16) for n in LENS],
            "text": ["a", "b", "c", "d"],
        },
        task_ids=["t0", "t1", "t2", "t3"],
    )


def test_ragged_stays_a_list_for_every_slice_chunk_and_gather(convert: Callable[..., Any]) -> None:
    b = convert(sample())
    for part in (b[2:], b[[2, 3]], b.chunk(2)[1], b.select_fields(["ids"])[2:]):
        ids = part["ids"]
        assert isinstance(ids, list) and [t.shape[0] for t in ids] == [4, 4]
        assert torch.cat(ids).dtype == torch.int32  # what a user writes for a ragged field
    assert isinstance(b[2:]["hidden"], torch.Tensor) and b[2:]["hidden"].shape == (2, 2)
    # a chunk that happens to be all one length, gathered on its own, is still ragged
    assert isinstance(b.chunk_balanced(2)[0]["pairs"], list)
    again = DBM.concat([b[2:], b[:2]])
    assert [t.shape[0] for t in again["ids"]] == [4, 4, 3, 5]


def test_kind_is_decided_when_the_values_are_given() -> None:
    equal = DBM.from_dict({"x": [torch.zeros(2), torch.ones(2)]})
    assert isinstance(equal["x"], torch.Tensor)  # per-task tensors of one shape: fixed
    ragged = DBM.from_dict({"x": [torch.zeros(2), torch.ones(3)]})
    both = DBM.concat([equal, ragged])  # fixed and ragged parts: ragged
    assert isinstance(both["x"], list) and isinstance(both[:2]["x"], list)
    wider = DBM.from_dict({"x": torch.zeros(2, 3)})
    assert isinstance(DBM.concat([equal, wider])[:2]["x"], list)  # fixed of two shapes: ragged


def test_the_kind_travels_in_metadata_json_and_pickle(remote: Callable[..., DBM]) -> None:
    b = remote(sample())[2:]
    meta = b.meta
    assert meta is not None and meta.fields["ids"].ragged and not meta.fields["hidden"].ragged
    assert meta.fields["ids"].shapes.shape == (4,)  # both tasks share a shape, the field is ragged
    loaded = BatchMeta.from_json(meta.to_json())
    assert loaded == meta and loaded.fields["ids"].ragged
    assert isinstance(DBM.from_json(b.to_json())["ids"], list)
    assert isinstance(pickle.loads(pickle.dumps(b))["ids"], list)


def test_metadata_with_a_bad_kind_is_refused() -> None:
    meta = BatchMeta(["t0"], ["127.0.0.1:1"], {}).to_dict()
    meta["fields"] = {"x": {"dtype": "F32", "nodes": [0, 1], "shapes": {"uniform": [2]}, "ragged": "yes"}}
    with pytest.raises(MetaFormatError, match="'ragged' must be true or false"):
        BatchMeta.from_dict(meta)
    meta["fields"] = {"x": ["not", "an", "object"]}
    with pytest.raises(MetaFormatError, match="must be an object"):
        BatchMeta.from_dict(meta)


def test_an_empty_slice_keeps_its_schema(convert: Callable[..., Any]) -> None:
    b = convert(sample())
    for empty in (b[:0], b[[]], b.chunk_balanced(5)[4], b[:0][:0], b[:0].select_fields(["ids", "text"])):
        assert empty.status is BatchStatus.EMPTY and len(empty) == 0
        assert set(empty.fields) <= {"ids", "hidden", "pairs", "text"} and "ids" in empty.fields
        values, offsets = empty.packed("ids")
        assert values.shape == (0,) and values.dtype == torch.int32
        assert offsets.tolist() == [0] and offsets.dtype == torch.int32
        assert empty["ids"] == [] and empty["text"] == []
        assert empty.lengths("ids") == []
    empty = b[:0]
    assert empty["hidden"].shape == (0, 2) and empty["hidden"].dtype == torch.bfloat16
    assert empty.packed("pairs")[0].shape == (0, 3)  # the trailing dims survive
    assert empty.packed("hidden")[0].shape == (0,) and empty.packed("hidden")[1].tolist() == [0]
    with pytest.raises(ValueError, match="JSON values"):
        empty.packed("text")
    with pytest.raises(KeyError, match="no field"):
        empty["nope"]
    assert empty.get_data()["hidden"].shape == (0, 2)


def test_an_empty_batch_keeps_its_schema_through_json_pickle_and_combining(
    remote: Callable[..., DBM],
) -> None:
    empty = remote(sample())[:0]
    copies = (DBM.from_json(empty.to_json()), pickle.loads(pickle.dumps(empty)), DBM.concat([empty, empty]))
    for copy in copies:
        assert copy.status is BatchStatus.EMPTY and copy.fields == ["ids", "hidden", "pairs", "text"]
        assert copy["hidden"].dtype == torch.bfloat16 and copy.packed("pairs")[0].shape == (0, 3)
    assert DBM.from_json('{"status": "EMPTY"}').fields == []  # from older writers
    extra = DBM.from_dict({"score": torch.ones(3)})[:0]
    assert empty.union(extra).fields == ["ids", "hidden", "pairs", "text", "score"]
    with pytest.raises(ValueError, match="in both batches"):
        empty.union(empty)
    assert DBM().fields == [] and DBM().to_json() == '{"status":"EMPTY"}'


def test_an_engine_gets_its_empty_chunk_with_fields(echo_pair: WorkerGroup) -> None:
    local = DBM.from_dict({"x": [torch.arange(3), torch.arange(5)]}, task_ids=["t0", "t1"])
    batch = local.to_remote(echo_pair.nodes[0], echo_pair.client)
    try:
        chunks = batch.chunk_balanced(3)  # 2 tasks for 3 ranks: one chunk is empty
        assert [len(c) for c in chunks] == [1, 1, 0]
        one, empty = echo_pair.call("packed_rows", [chunks[0], chunks[2]])
        (rows,) = chunks[0].lengths("x")
        expected = {"fields": ["x"], "rows": rows, "offsets": [0, rows], "dtype": "torch.int64"}
        assert one == {**expected, "column": "list"}
        assert empty == {**expected, "rows": 0, "offsets": [0], "column": "list"}
        # an engine's per-task columns for an empty chunk come back as an empty batch with fields
        fixed = DBM.from_dict({"x": torch.ones(2)})[:0]  # an empty LOCAL batch carries its fields too
        results = echo_pair.call("columns", [fixed, fixed])
        assert all(r.status is BatchStatus.EMPTY and "y" in r.fields for r in results)
    finally:
        batch.clear()


def test_the_controller_keeps_a_fields_kind(remote: Callable[..., DBM]) -> None:
    controller = Controller()
    controller.create_partition("p")
    batch = remote(sample())
    controller.put("p", batch)
    got = controller.get_meta("p", "t", ["ids", "hidden"], 2)
    assert isinstance(got["ids"], list) and isinstance(got["hidden"], torch.Tensor)
    rest = controller.get_meta("p", "t", ["ids"], 2)
    assert rest.task_ids == ["t2", "t3"] and isinstance(rest["ids"], list)  # equal lengths, still ragged
    # and through a checkpoint
    restored = Controller()
    restored.load_state_dict(controller.state_dict())
    again = restored.get_meta("p", "u", ["ids"], 2)
    assert isinstance(again["ids"], list)


def test_a_partition_field_put_with_two_fixed_shapes_becomes_ragged(remote: Callable[..., DBM]) -> None:
    controller = Controller()
    controller.create_partition("p")
    first = remote(DBM.from_dict({"x": torch.zeros(2, 4)}, task_ids=["a0", "a1"]))
    second = remote(DBM.from_dict({"x": torch.zeros(2, 6)}, task_ids=["b0", "b1"]))
    controller.put("p", first)
    controller.put("p", second)
    got = controller.get_meta("p", "t", ["x"], 2)
    assert got.task_ids == ["a0", "a1"] and isinstance(got["x"], list)  # the same shape, yet ragged
