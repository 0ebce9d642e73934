"""A durable worker (`--data-dir`) killed with SIGKILL and started again on its directory serves
every shard it had committed, byte for byte, with the generation its batch handles name."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from distbatch import DistributedBatchMemory, ShardClient
from distbatch.errors import ShardNotFoundError
from distbatch.launch import WorkerProcess

NO_TOKEN = {"DISTBATCH_TOKEN": ""}


def _batch(n: int, seed: int) -> dict[str, list]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 200, (n,), generator=gen).tolist()
    return {
        "input_ids": [torch.randint(0, 50_000, (k,), generator=gen, dtype=torch.int32) for k in lengths],
        "reward": [torch.rand((), generator=gen) for _ in lengths],
        "uid": [f"p{i // 4}" for i in range(n)],
    }


def _moved(batch: DistributedBatchMemory, old: str, new: str, client: ShardClient) -> DistributedBatchMemory:
    """The same batch handle, its shards now on `new` (the restarted worker's address)."""
    return DistributedBatchMemory.from_json(batch.to_json().replace(json.dumps(old), json.dumps(new)), client)


def _durable(node: str) -> dict:
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
        f"http://{node}/v1/stats", timeout=10
    ) as response:
        return json.loads(response.read())["durable"]


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "write-behind"])
def test_a_killed_worker_comes_back_with_its_shards(
    start_worker: Callable[..., WorkerProcess], tmp_path: Path, sync: bool
) -> None:
    flags = ["--data-dir", str(tmp_path), *(["--sync"] if sync else [])]
    first = start_worker(*flags, env=NO_TOKEN)
    columns = _batch(300, seed=1)
    with ShardClient() as client:
        put = DistributedBatchMemory.from_dict(columns).to_remote(first.node, client)
        later = DistributedBatchMemory.from_dict(_batch(40, seed=2)).to_remote(first.node, client)
        cleared = later.to_json()
        later.clear()  # a delete: it must stay deleted
    deadline = time.monotonic() + 30
    while not sync and _durable(first.node)["pending_records"] and time.monotonic() < deadline:
        time.sleep(0.05)  # written behind: on disk a moment later
    assert _durable(first.node)["pending_records"] == 0
    first.kill()
    second = start_worker(*flags, env=NO_TOKEN)
    stats = _durable(second.node)
    assert stats is not None and stats["failed"] is None
    with ShardClient() as client:
        got = _moved(put, first.node, second.node, client).get_data()
        for name, values in columns.items():
            if name == "uid":
                assert got[name] == values
                continue
            assert len(got[name]) == len(values)
            assert all(torch.equal(g, w) for g, w in zip(got[name], values))
        with pytest.raises(ShardNotFoundError):
            _moved(DistributedBatchMemory.from_json(cleared), first.node, second.node, client).get_data()
