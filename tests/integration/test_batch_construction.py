"""Building batches: from_dict, from_list, from_meta, task ids, schemas, and the errors bad input gets."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from batch_support import DBM, assert_same

from distbatch import (
    BatchMeta,
    BatchStatus,
    FieldMeta,
    MetaFormatError,
)

# --------------------------------------------------------------------------- construction


def test_from_dict_splits_tensors_on_dim0_and_lists_per_task() -> None:
    x = torch.arange(12).reshape(4, 3)
    b = DBM.from_dict({"x": x, "s": ["a", "b", "c", "d"], "j": [[1], {"k": 2}, None, 3.5]})
    assert len(b) == 4 and b.status is BatchStatus.LOCAL
    assert_same(b["x"], x)
    assert_same(b[1]["x"], torch.tensor([3, 4, 5]))
    assert b[1]["s"] == "b" and b[1]["j"] == {"k": 2}
    assert b["j"] == [[1], {"k": 2}, None, 3.5]


def test_from_dict_accepts_numpy_and_per_task_tensor_lists() -> None:
    import numpy as np

    b = DBM.from_dict(
        {"a": np.arange(6).reshape(3, 2), "r": [torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)]}
    )
    assert_same(b["a"], torch.arange(6).reshape(3, 2))
    assert_same(b["r"], torch.tensor([1.0, 2.0, 3.0]))
    assert b[0]["r"].dim() == 0


def test_from_dict_default_task_ids_are_fresh_and_unique() -> None:
    a = DBM.from_dict({"x": torch.zeros(50)})
    b = DBM.from_dict({"x": torch.zeros(50)})
    assert len(set(a.task_ids)) == 50 and len(set(b.task_ids)) == 50
    assert not set(a.task_ids) & set(b.task_ids)
    # valid ids, usable as-is on the wire
    assert all(DBM.from_dict({"x": [0]}, task_ids=[t]) for t in a.task_ids[:3])


def test_from_dict_explicit_task_ids_are_kept() -> None:
    ids = ["job-1:t@0", "job-1:t@1", "job-1:t=2+x"]
    b = DBM.from_dict({"x": torch.zeros(3)}, task_ids=ids)
    assert b.task_ids == ids


@pytest.mark.parametrize(
    "ids",
    [
        ["a/b", "c", "d"],  # path separator
        ["../x", "c", "d"],
        ["", "c", "d"],
        ["a b", "c", "d"],
        [5, "c", "d"],
        ["x" * 201, "c", "d"],
        ["a", "a", "b"],  # duplicate
        ["a", "b"],  # too few
        ["a", "b", "c", "d"],  # too many
    ],
)
def test_from_dict_rejects_bad_task_ids(ids: list[Any]) -> None:
    with pytest.raises(ValueError):
        DBM.from_dict({"x": torch.zeros(3)}, task_ids=ids)


def test_from_dict_mismatched_field_lengths_name_the_field() -> None:
    with pytest.raises(ValueError, match="'rewards'"):
        DBM.from_dict({"input_ids": torch.zeros(3, 2), "rewards": [1.0, 2.0]})
    with pytest.raises(ValueError, match="'rewards'"):
        DBM.from_dict({"input_ids": [torch.zeros(2)] * 3, "rewards": torch.zeros(4)})


@pytest.mark.parametrize(
    "data",
    [
        {"x": torch.tensor(1.0)},  # 0-d: no task dimension
        {"x": 5},
        {"x": {"a": 1}},
        {"x": [torch.zeros(2), 1]},  # tensors mixed with JSON
        {"x": [torch.zeros(2), torch.zeros(2, dtype=torch.int64)]},  # mixed dtypes
        {"bad/name": [1]},
        {"": [1]},
    ],
)
def test_from_dict_rejects_bad_values(data: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        DBM.from_dict(data)


def test_from_list() -> None:
    samples = [{"ids": torch.arange(n), "uid": f"u{n}"} for n in (2, 3, 2)]
    b = DBM.from_list(samples, task_ids=["t0", "t1", "t2"])
    assert b.task_ids == ["t0", "t1", "t2"] and b.fields == ["ids", "uid"]
    assert b["uid"] == ["u2", "u3", "u2"]
    assert_same(b[1]["ids"], torch.arange(3))
    assert DBM.from_list([]).status is BatchStatus.EMPTY


def test_from_list_mismatched_keys_name_the_sample() -> None:
    samples = [{"a": 1, "b": 2}, {"a": 1, "b": 2}, {"a": 1}]
    with pytest.raises(ValueError, match="sample 2"):
        DBM.from_list(samples)
    with pytest.raises(ValueError, match="sample 1"):
        DBM.from_list([{"a": 1}, {"a": 1, "c": 3}])


def _fake_meta(n: int = 3) -> BatchMeta:
    """Metadata naming shards on nodes nobody listens on: building and slicing must not care."""
    return BatchMeta(
        [f"fm-{i}" for i in range(n)],
        ["127.0.0.1:9", "127.0.0.1:10"],
        {
            "input_ids": FieldMeta("I32", [i % 2 for i in range(n)], [(3 + i,) for i in range(n)]),
            "uid": FieldMeta(None, [0] * n, [()] * n),
        },
    )


def test_from_meta_builds_remote_without_network() -> None:
    meta = _fake_meta()
    b = DBM.from_meta(meta)
    assert b.status is BatchStatus.REMOTE and b.meta is meta
    assert b.task_ids == ["fm-0", "fm-1", "fm-2"] and b.fields == ["input_ids", "uid"]
    assert b.lengths() == [3, 4, 5]
    sub = b[1:]
    assert sub.status is BatchStatus.REMOTE and sub.task_ids == ["fm-1", "fm-2"]
    # a sub-batch names only the nodes its shards are on
    assert b.select_fields(["input_ids"])[[1]].meta.nodes == ["127.0.0.1:10"]
    assert DBM.from_meta(BatchMeta([], [])).status is BatchStatus.EMPTY


def _meta_json_with(mutate: Callable[[dict[str, Any]], None]) -> str:
    doc = json.loads(DBM.from_meta(_fake_meta()).to_json())
    mutate(doc)
    return json.dumps(doc)


def _set(path: list[Any], value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        target = doc
        for key in path[:-1]:
            target = target[key]
        if path[-1] != "../x":  # every other case replaces something the encoder wrote
            assert path[-1] in target if isinstance(target, dict) else path[-1] < len(target), path
        target[path[-1]] = value

    return mutate


def _drop(path: list[Any]) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        target = doc
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return mutate


BAD_JSON = {
    "not json": "{not json",
    "empty": "",
    "a list": "[]",
    "deep nesting": "[" * 100_000 + "]" * 100_000,
    "status LOCAL": json.dumps({"status": "LOCAL"}),
    "no status": json.dumps({"meta": {}}),
    "meta missing": json.dumps({"status": "REMOTE"}),
}
BAD_META = {
    "version": _set(["meta", "version"], 2),
    "path-like task id": _set(["meta", "task_ids", 0], "../../etc/passwd"),
    "slash task id": _set(["meta", "task_ids", 0], "a/b"),
    "empty task id": _set(["meta", "task_ids", 0], ""),
    "int task id": _set(["meta", "task_ids", 0], 7),
    "duplicate task ids": _set(["meta", "task_ids"], ["a", "a", "b"]),
    "task ids a string": _set(["meta", "task_ids"], "abc"),
    "task ids an object": _set(["meta", "task_ids"], {"a": 1, "b": 2, "c": 3}),
    "node with path": _set(["meta", "nodes", 0], "127.0.0.1:9/v1/shards"),
    "node url with path": _set(["meta", "nodes", 0], "http://127.0.0.1:9/x"),
    "node without port": _set(["meta", "nodes", 0], "localhost"),
    "node with space": _set(["meta", "nodes", 0], "a b:1"),
    "node not a string": _set(["meta", "nodes", 0], 9),
    "nodes a string": _set(["meta", "nodes"], "ab"),
    "field name path": _set(
        ["meta", "fields", "../x"], {"dtype": None, "nodes": [0, 3], "shapes": {"uniform": []}}
    ),
    "unknown dtype": _set(["meta", "fields", "input_ids", "dtype"], "F99"),
    "dtype a list": _set(["meta", "fields", "input_ids", "dtype"], ["F32"]),
    # node indexes travel as runs: [index, count, index, count, ...]
    "node index out of range": _set(["meta", "fields", "input_ids", "nodes"], [0, 1, 2, 1, 0, 1]),
    "negative node index": _set(["meta", "fields", "input_ids", "nodes"], [0, 1, -1, 1, 0, 1]),
    "bool node index": _set(["meta", "fields", "input_ids", "nodes"], [0, 1, True, 1, 0, 1]),
    "too few node indexes": _set(["meta", "fields", "input_ids", "nodes"], [0, 1, 1, 1]),
    "too many node indexes": _set(["meta", "fields", "input_ids", "nodes"], [0, 4]),
    "zero-length run": _set(["meta", "fields", "input_ids", "nodes"], [1, 0, 0, 3]),
    "odd run list": _set(["meta", "fields", "input_ids", "nodes"], [0, 1, 1]),
    "runs not a list": _set(["meta", "fields", "input_ids", "nodes"], {"0": 3}),
    "negative uniform dim": _set(["meta", "fields", "uid", "shapes"], {"uniform": [-1]}),
    "uniform not a list": _set(["meta", "fields", "uid", "shapes"], {"uniform": 3}),
    "shapes like unknown field": _set(["meta", "fields", "uid", "shapes"], {"like": "nope"}),
    "shapes like itself": _set(["meta", "fields", "uid", "shapes"], {"like": "uid"}),
    "shapes object with two keys": _set(
        ["meta", "fields", "uid", "shapes"], {"uniform": [], "like": "input_ids"}
    ),
    "negative dim": _set(["meta", "fields", "input_ids", "shapes"], [1, 3, 1, -4, 1, 5]),
    "float dim": _set(["meta", "fields", "input_ids", "shapes"], [1, 3, 1, 4.5, 1, 5]),
    "truncated shapes": _set(["meta", "fields", "input_ids", "shapes"], [1, 3, 1, 4, 1]),
    "extra shapes": _set(["meta", "fields", "input_ids", "shapes"], [1, 3, 1, 4, 1, 5, 0]),
    "huge ndim": _set(["meta", "fields", "input_ids", "shapes"], [65] + [1] * 65 + [1, 4, 1, 5]),
    "shapes not a list": _set(["meta", "fields", "input_ids", "shapes"], "1,3"),
    "field not an object": _set(["meta", "fields", "input_ids"], 5),
    "fields not an object": _set(["meta", "fields"], []),
    "no fields": _drop(["meta", "fields"]),
    "no task ids": _drop(["meta", "task_ids"]),
    "no dtype": _drop(["meta", "fields", "uid", "dtype"]),
}


@pytest.mark.parametrize("text", list(BAD_JSON.values()), ids=list(BAD_JSON))
def test_from_json_rejects_malformed_text(text: str) -> None:
    with pytest.raises(MetaFormatError) as info:
        DBM.from_json(text)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("mutate", list(BAD_META.values()), ids=list(BAD_META))
def test_from_json_rejects_bad_metadata(mutate: Callable[[dict[str, Any]], None]) -> None:
    text = _meta_json_with(mutate)
    with pytest.raises(MetaFormatError) as info:
        DBM.from_json(text)
    assert isinstance(info.value, ValueError)


def test_from_json_accepts_its_own_output_and_empty() -> None:
    b = DBM.from_meta(_fake_meta())
    again = DBM.from_json(b.to_json())
    assert again.status is BatchStatus.REMOTE and again.meta == b.meta
    assert DBM.from_json(b.to_json().encode()).meta == b.meta
    assert DBM.from_json(DBM().to_json()).status is BatchStatus.EMPTY


def test_empty_batch_basics(nodes: list[str]) -> None:
    e = DBM()
    assert e.status is BatchStatus.EMPTY
    assert len(e) == 0 and e.task_ids == [] and e.fields == [] and e.keys() == []
    assert e.meta is None and "x" not in e
    assert "EMPTY" in repr(e) and "0" in repr(e)
    with pytest.raises(KeyError, match="'x'"):
        e["x"]
    with pytest.raises(IndexError):
        e[0]
    assert e[0:5].status is BatchStatus.EMPTY
    assert [c.status for c in e.chunk(3)] == [BatchStatus.EMPTY] * 3
    assert [c.status for c in e.chunk_balanced(2)] == [BatchStatus.EMPTY] * 2
    assert e.to_local().status is BatchStatus.EMPTY
    assert e.to_remote(nodes[0]).status is BatchStatus.EMPTY
    assert e.get_data() == {}
    assert e.clear() == 0
    assert pickle.loads(pickle.dumps(e)).status is BatchStatus.EMPTY
    assert DBM.from_dict({}).status is BatchStatus.EMPTY
    assert DBM.concat([]).status is BatchStatus.EMPTY
    assert DBM.concat([DBM(), DBM()]).status is BatchStatus.EMPTY


