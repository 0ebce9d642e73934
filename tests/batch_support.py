"""Helpers the batch tests share: sample batches, equality checks, placing a batch on workers, and
the workers' own request counters (read from `GET /metrics`), by which "moves no data" is checked
without mocking anything.
"""

from __future__ import annotations

import json
import math
import random
import urllib.request
from collections.abc import Sequence
from typing import Any

import torch

from distbatch import BatchStatus, DistributedBatchMemory, ShardClient

DBM = DistributedBatchMemory
LENS = [3, 8, 3, 5, 9, 5]  # ragged, but tasks 0/2 and 3/5 share a length



# --------------------------------------------------------------------------- server observation


def remote(node: str, task_ids: Sequence[str], **columns: Any) -> DistributedBatchMemory:
    """A REMOTE batch whose shards were really pushed to `node` (columns as `from_dict` takes)."""
    return DistributedBatchMemory.from_dict(columns, task_ids=list(task_ids)).to_remote(node)


def shards_on(client: ShardClient, node: str) -> int:
    """How many shards `node` holds (its `/v1/stats`)."""
    return int(client.stats(node)["shards"])


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


def lognormal_lengths(n: int, seed: int, sigma: float, mu: float = 6.0) -> list[int]:
    """`n` sequence lengths drawn from a lognormal, as RL rollouts are (clamped to 1..16384)."""
    rng = random.Random(seed)
    return [max(1, min(16384, int(math.exp(rng.gauss(mu, sigma))))) for _ in range(n)]


# --------------------------------------------------------------------------- placing on workers


def place(local: DBM, how: str, nodes: list[str], module_client: ShardClient, pushed: list[DBM]) -> DBM:
    """`local` as a REMOTE batch: on one node, split over two, or interleaved task by task."""
    n = len(local)
    if how == "one_node":
        parts = [local.to_remote(nodes[0], module_client)]
    elif how == "two_nodes":
        half = n // 2
        parts = [
            local[:half].to_remote(nodes[0], module_client),
            local[half:].to_remote(nodes[1], module_client),
        ]
    else:
        parts = [local[[i]].to_remote(nodes[i % 2], module_client) for i in range(n)]
    pushed.extend(parts)
    batch = DBM.concat(parts)
    assert batch.status is BatchStatus.REMOTE and batch.task_ids == local.task_ids
    return batch
