"""DistributedBatchMemory against real worker servers (3 module-scoped `python -m rpc_server` on loopback).

"Moves no data" and "gathers only that field, once" are checked through the
servers' own request counters (`GET /metrics`), never by mocking.
"""

from __future__ import annotations

import json
import math
import pickle
import random
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from distbatch import (
    BatchMeta,
    BatchStatus,
    BatchStatusError,
    DistributedBatchMemory,
    FieldMeta,
    MetaFormatError,
    ShardClient,
    default_client,
    set_default_client,
)
from distbatch.launch import WorkerProcess

DBM = DistributedBatchMemory
LENS = [3, 8, 3, 5, 9, 5]  # ragged, but tasks 0/2 and 3/5 share a length


# --------------------------------------------------------------------------- server observation


def _metrics(node: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{node}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def _stats(node: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{node}/v1/stats", timeout=10) as response:
        return json.loads(response.read())


def fetch_requests(nodes: list[str]) -> list[int]:
    """Per node: `POST /v1/shards/fetch` requests served so far."""
    prefix = 'distbatch_requests_total{endpoint="/v1/shards/fetch"'
    return [int(sum(v for k, v in _metrics(n).items() if k.startswith(prefix))) for n in nodes]


def data_requests(nodes: list[str]) -> list[int]:
    """Per node: every request served so far except the observation endpoints themselves."""
    out = []
    for node in nodes:
        total = 0.0
        for key, value in _metrics(node).items():
            if key.startswith("distbatch_requests_total{") and not any(
                f'endpoint="{ep}"' in key for ep in ("/metrics", "/v1/stats", "/health")
            ):
                total += value
        out.append(int(total))
    return out


def sent_bytes(nodes: list[str]) -> list[int]:
    return [int(_metrics(n)["distbatch_sent_bytes_total"]) for n in nodes]


def delta(after: list[int], before: list[int]) -> list[int]:
    return [a - b for a, b in zip(after, before)]


# --------------------------------------------------------------------------- data helpers


def sample_local(n: int = 6, seed: int = 0) -> DistributedBatchMemory:
    """A realistic LOCAL batch: ragged int32 ids, fp32 logprobs, bf16, bool, 0-d scalars, JSON."""
    g = torch.Generator().manual_seed(seed)
    lens = [LENS[i % len(LENS)] for i in range(n)]
    return DBM.from_dict(
        {
            "input_ids": [
                torch.randint(0, 32000, (length,), dtype=torch.int32, generator=g) for length in lens
            ],
            "logprobs": [-torch.rand(length, generator=g) for length in lens],
            "hidden": torch.randn(n, 4, generator=g).to(torch.bfloat16),
            "mask": torch.rand(n, 3, generator=g) > 0.5,
            "reward": torch.randn(n, generator=g),  # one 0-d scalar per task
            "text": [f"response {i} \u00e9\u4e2d" for i in range(n)],
            "info": [
                {"i": i, "tags": ["a", "b"][: i % 3], "score": i / 2, "ok": i % 2 == 0, "none": None}
                for i in range(n)
            ],
        }
    )


def assert_same(a: Any, b: Any) -> None:
    """Exact equality of columns / values: dtype, shape and bits for tensors."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{type(b).__name__} is not a tensor"
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
        assert torch.equal(a, b)
    elif isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def assert_batches_equal(a: DistributedBatchMemory, b: DistributedBatchMemory) -> None:
    assert a.task_ids == b.task_ids
    assert a.fields == b.fields
    for name in a.fields:
        assert_same(a[name], b[name])


def rows(column: Any) -> list[Any]:
    return list(column.unbind(0)) if isinstance(column, torch.Tensor) else list(column)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def nodes(shared_workers: list[WorkerProcess]) -> list[str]:
    return [w.node for w in shared_workers]


@pytest.fixture
def remote(nodes: list[str]) -> Iterator[Callable[..., DistributedBatchMemory]]:
    """Push a LOCAL batch as contiguous chunks onto the given nodes (all 3 by default).

    Whatever a test pushed is cleared from the shared workers afterwards.
    """
    made: list[DistributedBatchMemory] = []

    def push(local: DistributedBatchMemory, on: list[str] | None = None) -> DistributedBatchMemory:
        on = on or nodes
        parts = local.chunk(len(on))
        batch = DBM.concat([part.to_remote(node) for part, node in zip(parts, on)])
        made.append(batch)
        return batch

    yield push
    for batch in made:
        batch.clear()


@pytest.fixture(params=["LOCAL", "REMOTE"])
def status(request: pytest.FixtureRequest) -> BatchStatus:
    return BatchStatus[request.param]


@pytest.fixture
def convert(status: BatchStatus, remote: Callable[..., DistributedBatchMemory]) -> Callable[..., Any]:
    """LOCAL batch -> a batch of the parametrized status (REMOTE: spread over the 3 nodes)."""

    def make(local: DistributedBatchMemory) -> DistributedBatchMemory:
        if status is BatchStatus.LOCAL or local.status is BatchStatus.EMPTY:
            return local
        return remote(local)

    return make


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


# --------------------------------------------------------------------------- properties and columns


def test_basic_properties(convert: Callable[..., Any], status: BatchStatus) -> None:
    local = sample_local()
    b = convert(local)
    assert b.status is status
    assert len(b) == 6 and b.task_ids == local.task_ids
    names = ["input_ids", "logprobs", "hidden", "mask", "reward", "text", "info"]
    assert b.fields == names and b.keys() == names
    assert "hidden" in b and "nope" not in b
    ids = b.task_ids
    ids.append("mutated")
    assert len(b.task_ids) == 6  # a copy, not the internal list
    if status is BatchStatus.LOCAL:
        assert b.meta is None
    else:
        assert isinstance(b.meta, BatchMeta) and len(b.meta.nodes) == 3
    text = repr(b)
    assert status.value in text and "6" in text and len(text) < 300


def test_columns_stack_when_shapes_agree(convert: Callable[..., Any]) -> None:
    local = sample_local()
    b = convert(local)
    hidden = b["hidden"]
    assert isinstance(hidden, torch.Tensor) and hidden.shape == (6, 4) and hidden.dtype == torch.bfloat16
    assert isinstance(b["mask"], torch.Tensor) and b["mask"].dtype == torch.bool
    reward = b["reward"]
    assert isinstance(reward, torch.Tensor) and reward.shape == (6,) and reward.dtype == torch.float32
    ids = b["input_ids"]
    assert isinstance(ids, list) and [t.shape[0] for t in ids] == LENS
    assert all(t.dtype == torch.int32 for t in ids)
    assert b["text"] == local["text"] and b["info"] == local["info"]
    # a sub-batch whose tasks happen to share a length gets a stacked column
    sub = b[[0, 2]]
    assert_same(sub["input_ids"], torch.stack([local["input_ids"][0], local["input_ids"][2]]))
    assert isinstance(b[[0, 1]]["input_ids"], list)


def test_sub_batch_of_cached_remote_column_is_stacked_like_a_fresh_gather(
    remote: Callable[..., DistributedBatchMemory],
) -> None:
    local = sample_local()
    b = remote(local)
    fresh = b[[3, 5]]["input_ids"]  # gathered for the sub-batch alone
    b["input_ids"]  # now cached on the parent (a ragged list)
    from_cache = b[[3, 5]]["input_ids"]
    assert isinstance(fresh, torch.Tensor)
    assert_same(from_cache, fresh)


def test_remote_column_gathers_only_that_field_and_only_once(
    remote: Callable[..., DistributedBatchMemory], nodes: list[str]
) -> None:
    n = 12
    big_per_task = 16384 * 4
    local = DBM.from_dict({"small": torch.arange(n, dtype=torch.int32), "big": torch.randn(n, 16384)})
    b = remote(local)
    assert len(b.meta.nodes) == 3
    f0, s0 = fetch_requests(nodes), sent_bytes(nodes)
    small = b["small"]
    f1, s1 = fetch_requests(nodes), sent_bytes(nodes)
    assert delta(f1, f0) == [1, 1, 1]  # one request per node holding it
    # each node holds 4 tasks of "big" (256 KiB); what it sent is far below one task's worth
    assert all(d < big_per_task for d in delta(s1, s0)), delta(s1, s0)
    assert_same(small, torch.arange(n, dtype=torch.int32))
    again = b["small"]
    assert delta(fetch_requests(nodes), f1) == [0, 0, 0]
    assert_same(again, small)
    # the other field is gathered on its own access, again once per node
    assert_same(b["big"], local["big"])
    f2 = fetch_requests(nodes)
    assert delta(f2, f1) == [1, 1, 1]
    b["big"]
    b["small"]
    assert fetch_requests(nodes) == f2


def test_unknown_field_is_key_error_naming_it(convert: Callable[..., Any]) -> None:
    b = convert(sample_local())
    with pytest.raises(KeyError, match="'no_such_field'"):
        b["no_such_field"]


# --------------------------------------------------------------------------- indexing


def test_row_access(convert: Callable[..., Any]) -> None:
    local = sample_local()
    b = convert(local)
    for i in (0, 3, 5, -1, -6):
        row = b[i]
        assert list(row) == local.fields
        want = local[i]
        for name in local.fields:
            assert_same(want[name], row[name])
    assert b[-1]["text"] == b[5]["text"] == local["text"][5]
    assert b[torch.tensor(2)]["text"] == local["text"][2]
    for bad in (6, 100, -7):
        with pytest.raises(IndexError):
            b[bad]


def test_sub_batches(convert: Callable[..., Any], status: BatchStatus) -> None:
    local = sample_local()
    b = convert(local)
    ids = local.task_ids
    cases = {
        "slice": (slice(1, 4), [1, 2, 3]),
        "step": (slice(None, None, 2), [0, 2, 4]),
        "negative slice": (slice(-2, None), [4, 5]),
        "list": ([4, 1], [4, 1]),
        "negative list": ([-1, 0], [5, 0]),
        "bool mask": ([True, False, True, False, False, True], [0, 2, 5]),
        "tensor mask": (torch.tensor([False, True, True, False, False, False]), [1, 2]),
        "tensor index": (torch.tensor([3, 0]), [3, 0]),
        "range": (range(2, 4), [2, 3]),
    }
    for name, (key, picked) in cases.items():
        sub = b[key]
        assert sub.status is status, name
        assert sub.task_ids == [ids[i] for i in picked], name
        assert sub.fields == local.fields
        for field in ("input_ids", "hidden", "reward", "info"):
            assert_same(rows(sub[field]), [rows(local[field])[i] for i in picked])
    assert b[10:20].status is BatchStatus.EMPTY and b[[]].status is BatchStatus.EMPTY
    with pytest.raises(ValueError):
        b[[1, 1]]  # a batch holds each task once
    with pytest.raises(IndexError):
        b[[0, 6]]
    with pytest.raises(IndexError):
        b[[True, False]]  # mask of the wrong length
    with pytest.raises(TypeError):
        b[1.5]
    with pytest.raises(TypeError):
        b[[0, "a"]]


def test_remote_sub_batches_move_no_data(
    remote: Callable[..., DistributedBatchMemory], nodes: list[str]
) -> None:
    b = remote(sample_local(n=9))
    before = data_requests(nodes)
    subs = [
        b[2:7],
        b[[8, 0, 4]],
        b[[i % 2 == 0 for i in range(9)]],
        *b.chunk(4),
        *b.chunk_balanced(3),
        b.select_fields(["hidden", "text"]),
        DBM.concat(b.chunk(2)),
    ]
    assert all(s.status is BatchStatus.REMOTE for s in subs)
    assert data_requests(nodes) == before
    # once the parent has gathered a field, sub-batches carry it: no request either
    b["hidden"]
    after_gather = data_requests(nodes)
    assert_same(b[2:7]["hidden"], b["hidden"][2:7])
    assert_same(b.chunk(3)[1]["hidden"], b["hidden"][3:6])
    assert data_requests(nodes) == after_gather


def test_setitem_and_delitem_on_local() -> None:
    b = sample_local()
    b["advantages"] = torch.arange(6.0)
    b["tag"] = ["x"] * 6
    assert b.fields[-2:] == ["advantages", "tag"]
    assert_same(b["advantages"], torch.arange(6.0))
    b["reward"] = torch.zeros(6)  # replace
    assert_same(b["reward"], torch.zeros(6))
    with pytest.raises(ValueError, match="'short'"):
        b["short"] = torch.zeros(5)
    with pytest.raises(ValueError):
        b["bad/name"] = torch.zeros(6)
    del b["advantages"]
    assert "advantages" not in b
    with pytest.raises(KeyError, match="'advantages'"):
        del b["advantages"]


def test_setitem_and_delitem_rejected_on_remote_and_empty(
    remote: Callable[..., DistributedBatchMemory],
) -> None:
    r = remote(sample_local())
    with pytest.raises(BatchStatusError, match=r"to_local\(\)"):
        r["new"] = torch.zeros(6)
    with pytest.raises(BatchStatusError, match=r"to_local\(\)"):
        del r["hidden"]
    assert "hidden" in r and "new" not in r
    e = DBM()
    with pytest.raises(BatchStatusError, match="from_dict"):
        e["new"] = torch.zeros(0)
    with pytest.raises(BatchStatusError, match="from_dict"):
        del e["x"]


# --------------------------------------------------------------------------- moving data


def test_to_remote_to_local_round_trip_exactly(
    remote: Callable[..., DistributedBatchMemory], nodes: list[str]
) -> None:
    local = sample_local()
    r = remote(local)  # over 3 nodes
    assert r.status is BatchStatus.REMOTE and sorted(r.meta.nodes) == sorted(nodes)
    back = r.to_local()
    assert back.status is BatchStatus.LOCAL and back.meta is None
    assert_batches_equal(back, local)
    data = r.get_data()
    assert list(data) == local.fields
    for name, col in local.get_data().items():
        assert_same(col, data[name])
    # LOCAL -> one node -> LOCAL again
    single = back.to_remote(nodes[1])
    try:
        assert single.meta.nodes == [nodes[1]]
        assert_batches_equal(single.to_local(), local)
        assert single[2]["reward"].dim() == 0
        assert_same(single[2]["reward"], local["reward"][2])
    finally:
        single.clear()
    assert local.to_local() is local
    with pytest.raises(BatchStatusError, match=r"to_local\(\)"):
        r.to_remote(nodes[0])


def test_to_remote_rejects_bad_node() -> None:
    with pytest.raises(ValueError):
        sample_local().to_remote("not a node")


# --------------------------------------------------------------------------- chunk


@pytest.mark.parametrize("n", [1, 2, 4, 6, 7])
def test_chunk_contiguous_ordered_and_concat_restores(convert: Callable[..., Any], n: int) -> None:
    local = sample_local()
    b = convert(local)
    parts = b.chunk(n)
    assert len(parts) == n
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 6
    assert sizes == sorted(sizes, reverse=True)
    assert [t for p in parts for t in p.task_ids] == local.task_ids
    for p in parts:
        if len(p):
            assert p.status is b.status
    joined = DBM.concat(parts)
    assert joined.status is b.status
    assert_batches_equal(joined, local)


@pytest.mark.parametrize("n", [0, -1, 1.5, "2", None, True])
def test_chunk_rejects_bad_count(n: Any) -> None:
    with pytest.raises(ValueError):
        sample_local().chunk(n)


# --------------------------------------------------------------------------- chunk_balanced


def _lognormal_lengths(n: int, seed: int, sigma: float, mu: float = 6.0) -> list[int]:
    rng = random.Random(seed)
    return [max(1, min(16384, int(math.exp(rng.gauss(mu, sigma))))) for _ in range(n)]


def _group_batch(lengths: list[int], group_size: int) -> DistributedBatchMemory:
    return DBM.from_dict(
        {
            "input_ids": [torch.full((length,), i, dtype=torch.int32) for i, length in enumerate(lengths)],
            "uid": [f"g{i // group_size}" for i in range(len(lengths))],
        }
    )


def test_chunk_balanced_remote_moves_nothing_and_keeps_groups(
    remote: Callable[..., DistributedBatchMemory], nodes: list[str]
) -> None:
    group_size, k = 4, 4
    lengths = _lognormal_lengths(64, seed=1, sigma=0.8, mu=4.0)
    local = _group_batch(lengths, group_size)
    b = remote(local)
    assert len(b.meta.nodes) == 3
    before = data_requests(nodes)
    parts = b.chunk_balanced(k, group_size=group_size, length_field="input_ids")
    default_field = b.chunk_balanced(k, group_size=group_size)  # input_ids is the default
    assert data_requests(nodes) == before, "balancing a REMOTE batch fetched data"
    assert [p.task_ids for p in default_field] == [p.task_ids for p in parts]
    assert all(p.status is BatchStatus.REMOTE for p in parts)
    assert [len(p) for p in parts] == [16] * k
    # same split as the LOCAL batch, from the same lengths
    assert [p.task_ids for p in local.chunk_balanced(k, group_size=group_size)] == [p.task_ids for p in parts]
    # every task exactly once, order kept inside a chunk
    position = {t: i for i, t in enumerate(local.task_ids)}
    assert sorted(t for p in parts for t in p.task_ids) == sorted(local.task_ids)
    for p in parts:
        idx = [position[t] for t in p.task_ids]
        assert idx == sorted(idx)
    # groups intact: gather uid and check each chunk holds whole consecutive groups
    owner: dict[str, int] = {}
    for c, p in enumerate(parts):
        uids = p["uid"]
        for start in range(0, len(uids), group_size):
            group = uids[start : start + group_size]
            assert len(set(group)) == 1, group
            assert group[0] not in owner
            owner[group[0]] = c
        ids = p["input_ids"]
        assert [int(t[0]) for t in ids] == [position[t] for t in p.task_ids]  # data follows the task
    assert len(owner) == 64 // group_size
    totals = [sum(b.lengths()[position[t]] for t in p.task_ids) for p in parts]
    assert max(totals) - min(totals) <= max(
        sum(lengths[i : i + group_size]) for i in range(0, 64, group_size)
    )


def test_chunk_balanced_quality_on_lognormal_lengths(capsys: pytest.CaptureFixture[str]) -> None:
    # REMOTE from metadata alone (its nodes do not even exist) and LOCAL agree exactly
    n, k = 256, 4
    results = {}
    for sigma in (0.5, 1.0):
        lengths = _lognormal_lengths(n, seed=7, sigma=sigma)
        meta = BatchMeta(
            [f"q{sigma}-{i}" for i in range(n)],
            ["127.0.0.1:9", "127.0.0.1:10", "127.0.0.1:11"],
            {"input_ids": FieldMeta("I32", [i % 3 for i in range(n)], [(length,) for length in lengths])},
        )
        r_parts = DBM.from_meta(meta).chunk_balanced(k)
        local = DBM.from_dict(
            {"input_ids": [torch.zeros(length, dtype=torch.int32) for length in lengths]},
            task_ids=meta.task_ids,
        )
        l_parts = local.chunk_balanced(k)
        assert [p.task_ids for p in r_parts] == [p.task_ids for p in l_parts]
        assert [len(p) for p in r_parts] == [n // k] * k
        totals = [sum(p.lengths()) for p in r_parts]
        ratio = max(totals) / min(totals)
        results[sigma] = ratio
        with capsys.disabled():
            print(
                f"\nchunk_balanced {n} tasks -> {k}, lognormal(6, {sigma}): "
                f"totals {totals}, max/min {ratio:.4f}"
            )
        assert max(totals) - min(totals) <= max(lengths)  # guaranteed by largest differencing
    assert results[0.5] < 1.05


def test_chunk_balanced_non_divisible_group_counts(convert: Callable[..., Any]) -> None:
    # 10 groups of 2 into 4 chunks: group counts 3, 3, 2, 2
    lengths = [5, 9, 1, 1, 7, 2, 3, 3, 8, 8, 4, 6, 2, 2, 9, 1, 5, 5, 3, 7]
    b = convert(_group_batch(lengths, 2))
    parts = b.chunk_balanced(4, group_size=2)
    assert sorted(len(p) for p in parts) == [4, 4, 6, 6]
    assert sorted(t for p in parts for t in p.task_ids) == sorted(b.task_ids)
    # zero-length tasks (empty responses) must not unbalance the counts either
    zeros = [0] * 9 + [1] * 6 + [3]
    parts = convert(_group_batch(zeros, 1)).chunk_balanced(5)
    assert sorted(len(p) for p in parts) == [3, 3, 3, 3, 4]
    # fewer groups than chunks: the extra chunks are EMPTY
    parts = convert(_group_batch([4, 4, 2, 2], 2)).chunk_balanced(3, group_size=2)
    assert sorted(len(p) for p in parts) == [0, 2, 2]


def test_chunk_balanced_rejects_bad_arguments(convert: Callable[..., Any]) -> None:
    b = convert(_group_batch([3, 4, 5, 6, 7, 8, 9, 10], 2))
    for group_size in (0, -2, 3, 16, 1.5, "2"):
        with pytest.raises(ValueError):
            b.chunk_balanced(2, group_size=group_size)
    for n in (0, -1, 2.0):
        with pytest.raises(ValueError):
            b.chunk_balanced(n)
    with pytest.raises(ValueError):
        b.chunk_balanced(2, length_field="uid")  # a JSON field has no length
    with pytest.raises(KeyError, match="'nope'"):
        b.chunk_balanced(2, length_field="nope")
    with pytest.raises(ValueError):
        convert(DBM.from_dict({"uid": ["a", "b"]})).chunk_balanced(2)  # no tensor field at all


# --------------------------------------------------------------------------- union / concat


def _pair(convert: Callable[..., Any]) -> tuple[DistributedBatchMemory, DistributedBatchMemory, list[str]]:
    """Two batches over the same tasks; the second lists them in another order."""
    ids = [f"u-{random.getrandbits(40):x}-{i}" for i in range(6)]
    a = DBM.from_dict({"input_ids": [torch.arange(n) for n in LENS], "uid": [f"g{i}" for i in range(6)]}, ids)
    order = [3, 0, 5, 1, 4, 2]
    b = DBM.from_dict(
        {"values": [torch.full((LENS[i],), float(i)) for i in order], "score": [i * 10 for i in order]},
        [ids[i] for i in order],
    )
    return convert(a), convert(b), ids


def test_union_aligns_by_task_id_out_of_place(convert: Callable[..., Any], status: BatchStatus) -> None:
    a, b, ids = _pair(convert)
    u = a.union(b)
    assert u.status is status
    assert u.task_ids == ids and u.fields == ["input_ids", "uid", "values", "score"]
    assert u["score"] == [i * 10 for i in range(6)]
    for i, v in enumerate(u["values"]):
        assert_same(v, torch.full((LENS[i],), float(i)))
    assert_same(u["input_ids"], a["input_ids"])
    assert a.fields == ["input_ids", "uid"] and b.fields == ["values", "score"]  # inputs untouched
    # the other direction keeps the other's order
    v = b.union(a)
    assert v.task_ids == b.task_ids and v["uid"] == [f"g{i}" for i in [3, 0, 5, 1, 4, 2]]


def test_union_field_clash_needs_overwrite(convert: Callable[..., Any]) -> None:
    a, b, ids = _pair(convert)
    # (rotated order: when REMOTE, no task's new "uid" lands on the node holding its old one,
    # so the two batches do not name the same stored shard)
    rotated = ids[2:] + ids[:2]
    clash = convert(DBM.from_dict({"uid": [f"new-{t}" for t in rotated]}, rotated))
    with pytest.raises(ValueError, match="uid"):
        a.union(clash)
    u = a.union(clash, overwrite=True)
    assert u.fields == ["input_ids", "uid"] and u.task_ids == ids
    assert u["uid"] == [f"new-{t}" for t in ids]
    assert a["uid"] == [f"g{i}" for i in range(6)]


def test_union_in_place_and_failure_leaves_batch_unchanged(convert: Callable[..., Any]) -> None:
    a, b, ids = _pair(convert)

    def snapshot(batch: DistributedBatchMemory) -> tuple[Any, ...]:
        return batch.status, batch.task_ids, batch.fields, batch.get_data()

    before = snapshot(a)
    clash = convert(DBM.from_dict({"uid": ["x"] * 6}, ids[2:] + ids[:2]))  # see test above
    other_tasks = convert(DBM.from_dict({"more": [1] * 6}))
    for bad, exc in (
        (clash, ValueError),
        (other_tasks, ValueError),
        (DBM.from_dict({"m": [1] * 6}, ids), None),
    ):
        if exc is None:  # status mismatch, when a is REMOTE
            if a.status is BatchStatus.LOCAL:
                continue
            exc = BatchStatusError
        with pytest.raises(exc):
            a.union_(bad)
        after = snapshot(a)
        assert after[:3] == before[:3]
        for name in before[3]:
            assert_same(before[3][name], after[3][name])
    assert a.union_(b) is a
    assert a.fields == ["input_ids", "uid", "values", "score"] and a.task_ids == ids
    assert a["score"] == [i * 10 for i in range(6)]


def test_union_of_fields_from_different_nodes(nodes: list[str]) -> None:
    ids = [f"xn-{random.getrandbits(40):x}-{i}" for i in range(5)]
    x = DBM.from_dict({"x": torch.arange(5)}, ids).to_remote(nodes[0])
    y = DBM.from_dict({"y": [torch.ones(i + 1) for i in range(5)]}, list(reversed(ids))).to_remote(nodes[1])
    try:
        u = x.union(y)
        assert u.status is BatchStatus.REMOTE and sorted(u.meta.nodes) == sorted(nodes[:2])
        f0 = fetch_requests(nodes)
        assert_same(u["x"], torch.arange(5))
        f1 = fetch_requests(nodes)
        assert delta(f1, f0) == [1, 0, 0]
        assert [t.shape[0] for t in u["y"]] == [5, 4, 3, 2, 1]
        assert delta(fetch_requests(nodes), f1) == [0, 1, 0]
        assert_batches_equal(u.to_local(), DBM.from_dict({"x": torch.arange(5), "y": u["y"]}, ids))
    finally:
        assert x.clear() + y.clear() == 10


def test_union_mixed_status_and_empty(remote: Callable[..., DistributedBatchMemory]) -> None:
    local = sample_local()
    r = remote(DBM.from_dict({"extra": torch.arange(6)}, local.task_ids))
    with pytest.raises(BatchStatusError, match=r"to_local\(\)"):
        local.union(r)
    with pytest.raises(BatchStatusError):
        r.union(local)
    for batch in (local, r):
        for u in (batch.union(DBM()), DBM().union(batch)):
            assert u is not batch
            assert u.status is batch.status
            assert_batches_equal(u, batch)
    assert DBM().union(DBM()).status is BatchStatus.EMPTY


def test_concat_rules(convert: Callable[..., Any], status: BatchStatus) -> None:
    a = convert(sample_local(n=4, seed=1))
    b = convert(sample_local(n=3, seed=2))
    c = DBM.concat([a, DBM(), b])
    assert c.status is status and c.task_ids == a.task_ids + b.task_ids
    for name in a.fields:
        assert_same(rows(c[name]), rows(a[name]) + rows(b[name]))
    with pytest.raises(ValueError, match="duplicate"):
        DBM.concat([a, b, a[1:2]])
    with pytest.raises(ValueError, match="fields"):
        DBM.concat([a, b.select_fields(["hidden", "text"])])
    assert DBM.concat([DBM(), a]).task_ids == a.task_ids


def test_concat_mixed_status(remote: Callable[..., DistributedBatchMemory]) -> None:
    local = sample_local(n=2)
    r = remote(sample_local(n=3))
    with pytest.raises(BatchStatusError):
        DBM.concat([local, r])
    with pytest.raises(BatchStatusError):
        DBM.concat([r, DBM(), local])


# --------------------------------------------------------------------------- clear


@pytest.fixture
def fresh_nodes(start_worker: Callable[..., WorkerProcess]) -> list[str]:
    """Three workers of this test's own (started concurrently), so their stores start empty."""
    with ThreadPoolExecutor(3) as pool:
        workers = list(pool.map(lambda _: start_worker(), range(3)))
    return [w.node for w in workers]


def test_clear_deletes_on_every_node(fresh_nodes: list[str]) -> None:
    local = sample_local(n=9)
    b = DBM.concat([p.to_remote(node) for p, node in zip(local.chunk(3), fresh_nodes)])
    assert sorted(b.meta.nodes) == sorted(fresh_nodes)
    assert [_stats(n)["shards"] for n in fresh_nodes] == [3 * 7] * 3
    # a sub-batch clears only its own shards
    assert b[0:2].clear() == 2 * 7
    assert [_stats(n)["shards"] for n in fresh_nodes] == [1 * 7, 3 * 7, 3 * 7]
    assert b.clear() == 7 * 7
    for node in fresh_nodes:
        stats = _stats(node)
        assert stats["shards"] == 0 and stats["bytes"] == 0 and stats["tasks"] == 0, stats
    assert b.clear() == 0  # idempotent
    assert local.clear() == 0  # LOCAL data lives on no worker


# --------------------------------------------------------------------------- pickle / json


def test_remote_pickle_carries_metadata_only(
    remote: Callable[..., DistributedBatchMemory], nodes: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    sizes = {}
    for length in (1024, 32768):
        local = DBM.from_dict({"input_ids": torch.randint(0, 1000, (8, length), dtype=torch.int32)})
        r = remote(local, on=[nodes[0]])
        r["input_ids"]  # a gathered cache must not be pickled either
        sizes[length] = len(pickle.dumps(r))
        again = pickle.loads(pickle.dumps(r))
        assert again.status is BatchStatus.REMOTE and again.meta == r.meta
        assert_same(again["input_ids"], local["input_ids"])
    with capsys.disabled():
        print(f"\npickled REMOTE batch of 8 tasks: {sizes} bytes (1024 vs 32768 tokens)")
    assert abs(sizes[1024] - sizes[32768]) <= 8
    assert sizes[32768] < 2000


def test_local_pickle_round_trip() -> None:
    local = sample_local()
    again = pickle.loads(pickle.dumps(local))
    assert again.status is BatchStatus.LOCAL
    assert_batches_equal(again, local)


def test_local_pickle_of_a_slice_does_not_carry_the_base() -> None:
    base = torch.randn(4096, 64)  # 1 MiB
    whole = len(pickle.dumps(base))
    for data in (
        {"x": base[:4]},
        {"x": base[100:104, :16]},
        {"x": [base[i, : i + 1] for i in range(4)]},
    ):
        b = DBM.from_dict(data)
        size = len(pickle.dumps(b))
        assert size < 20_000 < whole, size
        assert_batches_equal(pickle.loads(pickle.dumps(b)), b)
    sliced = DBM.from_dict({"x": base})[10:12]
    assert len(pickle.dumps(sliced)) < 20_000


def test_to_json_round_trip_and_local_refused(remote: Callable[..., DistributedBatchMemory]) -> None:
    local = sample_local()
    r = remote(local)
    text = r.to_json()
    again = DBM.from_json(text)
    assert again.status is BatchStatus.REMOTE and again.to_json() == text
    assert again.task_ids == r.task_ids and again.fields == r.fields
    assert_batches_equal(again.to_local(), local)
    with pytest.raises(BatchStatusError, match="to_remote"):
        local.to_json()


def test_metadata_bytes_per_shard(
    remote: Callable[..., DistributedBatchMemory], capsys: pytest.CaptureFixture[str]
) -> None:
    n = 512
    lengths = _lognormal_lengths(n, seed=3, sigma=0.7, mu=5.5)
    local = DBM.from_dict(
        {
            "input_ids": [torch.zeros(length, dtype=torch.int32) for length in lengths],
            "logprobs": [torch.zeros(length) for length in lengths],
            "response_mask": [torch.ones(length, dtype=torch.bool) for length in lengths],
            "reward": torch.zeros(n),
            "uid": [f"prompt-{i // 8}" for i in range(n)],
        }
    )
    r = remote(local)
    shards = n * len(r.fields)
    # as pushed (contiguous per node), and shuffled so that neighbouring tasks sit on different nodes
    perm = list(range(n))
    random.Random(5).shuffle(perm)
    for label, batch in (("contiguous", r), ("shuffled", r[perm])):
        text = batch.to_json()
        per_shard = len(text) / shards
        pickled = len(pickle.dumps(batch)) / shards
        with capsys.disabled():
            print(
                f"\nmetadata of {n} tasks x {len(r.fields)} fields on {len(r.meta.nodes)} nodes ({label}): "
                f"to_json {len(text)} B = {per_shard:.1f} B/shard, pickle {pickled:.1f} B/shard"
            )
        assert per_shard < 40 and pickled < 40


# --------------------------------------------------------------------------- clients


def test_gather_with_explicit_or_default_client(nodes: list[str]) -> None:
    # A client limited to one key per request is visible in the servers' counters:
    # gathering 6 shards costs it 6 requests, the ordinary default client 1.
    local = DBM.from_dict({"x": torch.arange(6)})
    one_key = ShardClient(max_keys_per_request=1, timeout=20)
    node = nodes[0]
    r = local.to_remote(node, client=one_key)
    try:
        assert r.client is one_key and r[1:3].client is one_key and r.chunk(2)[0].client is one_key

        def cost(batch: DistributedBatchMemory) -> int:
            before = fetch_requests([node])[0]
            assert_same(batch["x"], torch.arange(6))
            return fetch_requests([node])[0] - before

        set_default_client(None)
        assert cost(r) == 6
        assert cost(DBM.from_meta(r.meta, client=one_key)) == 6
        assert cost(DBM.from_meta(r.meta)) == 1
        assert cost(DBM.from_json(r.to_json())) == 1
        set_default_client(one_key)
        try:
            assert default_client() is one_key
            assert cost(DBM.from_meta(r.meta)) == 6
            with ShardClient(timeout=20) as plain:
                assert cost(DBM.from_meta(r.meta, client=plain)) == 1
        finally:
            set_default_client(None)
        assert default_client() is not one_key
        assert cost(DBM.from_meta(r.meta)) == 1
    finally:
        r.clear()
        one_key.close()
