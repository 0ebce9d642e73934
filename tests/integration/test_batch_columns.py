"""Reading a batch: fields, columns, indexing and slicing, LOCAL and REMOTE; a REMOTE column gathers
only that field, once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from batch_support import (
    DBM,
    LENS,
    assert_same,
    data_requests,
    delta,
    fetch_requests,
    rows,
    sample_local,
    sent_bytes,
)

from distbatch import (
    BatchMeta,
    BatchStatus,
    BatchStatusError,
    DistributedBatchMemory,
)

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
    # a sub-batch whose tasks happen to share a length is still ragged: the field's kind decides
    sub = b[[0, 2]]
    assert_same(sub["input_ids"], [local["input_ids"][0], local["input_ids"][2]])
    assert isinstance(b[[0, 1]]["input_ids"], list)


def test_sub_batch_of_cached_remote_column_is_ragged_like_a_fresh_gather(
    remote: Callable[..., DistributedBatchMemory],
) -> None:
    local = sample_local()
    b = remote(local)
    fresh = b[[3, 5]]["input_ids"]  # gathered for the sub-batch alone
    b["input_ids"]  # now cached on the parent (a ragged list)
    from_cache = b[[3, 5]]["input_ids"]
    assert isinstance(fresh, list) and fresh[0].shape == fresh[1].shape
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


