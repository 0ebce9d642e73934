"""Moving batches: to_remote / to_local, pickle and JSON of REMOTE batches (metadata only), and which
client gathers.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Callable

import pytest
import torch
from batch_support import (
    DBM,
    assert_batches_equal,
    assert_same,
    fetch_requests,
    lognormal_lengths,
    sample_local,
)

from distbatch import (
    BatchStatus,
    BatchStatusError,
    DistributedBatchMemory,
    ShardClient,
    default_client,
    set_default_client,
)

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
    lengths = lognormal_lengths(n, seed=3, sigma=0.7, mu=5.5)
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
