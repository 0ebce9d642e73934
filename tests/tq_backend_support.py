"""What the TransferQueue backend's test modules share: TransferQueue and Ray imported (or the
module skipped, or failed where `scripts/test` requires them), a local Ray cluster per module
whose every worker registers the backend, the config, a GRPO-shaped batch in TransferQueue's
layout, and how a TransferQueue user compares answers.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from ray_support import import_ray, local_ray_for_module

ray = import_ray()
if os.environ.get("DISTBATCH_REQUIRE_TQ") == "1":
    tq = importlib.import_module("transfer_queue")
else:
    tq = pytest.importorskip("transfer_queue")
from tensordict import NonTensorStack, TensorDict  # noqa: E402

BACKENDS = ("SimpleStorage", "Distbatch")
# TransferQueue's controller, its two storage units and our workers are actors: give them CPUs.
RAY_CPUS = 8
SETUP_HOOK = {"worker_process_setup_hook": "distbatch.transferqueue.register"}


def tq_ray_cluster() -> Iterator[None]:
    """A local Ray cluster for one module (its autouse fixture yields from here). Every Ray
    worker of this job imports distbatch.transferqueue first (Ray's job-level setup hook), as a
    verl job would set it: the backend is registered wherever TransferQueue runs."""
    yield from local_ray_for_module(RAY_CPUS, runtime_env=SETUP_HOOK)


def config(backend: str, **options: Any) -> dict[str, Any]:
    return {"backend": {"storage_backend": backend, backend: options}}


def rollout(n: int, seed: int) -> TensorDict:
    """A GRPO-shaped batch in TransferQueue's layout: ragged ids (jagged), bf16 logprobs of the
    same lengths, a dense mask, a scalar reward per sample, strings and dicts."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (n,), generator=gen).tolist()
    ids = [torch.randint(0, 1000, (k,), generator=gen) for k in lengths]
    return TensorDict(
        {
            "input_ids": torch.nested.nested_tensor(ids, layout=torch.jagged),
            "logprobs": torch.nested.nested_tensor(
                [torch.randn(k, generator=gen).to(torch.bfloat16) for k in lengths], layout=torch.jagged
            ),
            "mask": torch.rand(n, 4, generator=gen) > 0.5,
            "reward": torch.rand(n, generator=gen),
            "prompt": NonTensorStack(*[f"prompt {i}" for i in range(n)]),
            "info": NonTensorStack(*[{"id": i, "tags": ["a", str(i)]} for i in range(n)]),
        },
        batch_size=[n],
    )


def same(a: Any, b: Any) -> bool:
    """Equal as a TransferQueue user sees them: types, dtypes, layouts, values."""
    if isinstance(a, TensorDict):
        return (
            isinstance(b, TensorDict)
            and a.batch_size == b.batch_size
            and sorted(a.keys()) == sorted(b.keys())
            and all(same(a.get(k), b.get(k)) for k in a.keys())
        )
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or (a.is_nested, a.dtype, a.layout) != (
            b.is_nested,
            b.dtype,
            b.layout,
        ):
            return False
        if a.is_nested:
            return torch.equal(a.values(), b.values()) and torch.equal(a.offsets(), b.offsets())
        return a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, NonTensorStack):
        return isinstance(b, NonTensorStack) and a.tolist() == b.tolist()
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)
