"""What the TransferQueue backend's test modules share: TransferQueue and Ray imported (or the
module skipped, or failed where `scripts/test` requires them), a local Ray cluster per module
whose every worker registers the backend, the config, a GRPO-shaped batch in TransferQueue's
layout, and how a TransferQueue user compares answers.
"""

from __future__ import annotations

import importlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from ray_support import import_ray, local_ray_for_module

ray = import_ray()
if os.environ.get("DISTBATCH_REQUIRE_TQ") == "1":
    tq = importlib.import_module("transfer_queue")
else:
    tq = pytest.importorskip("transfer_queue")
from tensordict import NonTensorData, NonTensorStack, TensorDict  # noqa: E402

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
    same lengths, a dense mask, a scalar reward per sample, strings and dicts; and as
    TransferQueue's README and tests build ragged fields, strided nested tensors (torch's default
    layout): ragged rows of one width, and images whose every dimension differs."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (n,), generator=gen).tolist()
    ids = [torch.randint(0, 1000, (k,), generator=gen) for k in lengths]
    sides = torch.randint(1, 4, (n, 2), generator=gen).tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's prototype notice for strided ones
        hidden = torch.nested.nested_tensor([torch.randn(k, 3, generator=gen) for k in lengths])
        images = torch.nested.nested_tensor([torch.rand(h, w, generator=gen) for h, w in sides])
    return TensorDict(
        {
            "input_ids": torch.nested.nested_tensor(ids, layout=torch.jagged),
            "logprobs": torch.nested.nested_tensor(
                [torch.randn(k, generator=gen).to(torch.bfloat16) for k in lengths], layout=torch.jagged
            ),
            "hidden": hidden,
            "image": images,
            "mask": torch.rand(n, 4, generator=gen) > 0.5,
            "reward": torch.rand(n, generator=gen),
            "prompt": NonTensorStack(*[f"prompt {i}" for i in range(n)]),
            # numpy arrays and bytes, as TransferQueue's own tests put them: each sample's value
            # comes back as its own type (numpy bytes_ / str_ / int64, bytes, an object's str).
            "np_bytes": np.array([f"bs_{i}".encode() for i in range(n)], dtype="|S10"),
            "np_str": np.array([f"s{i}" for i in range(n)]),
            "np_obj": np.array([f"obj_{i}" for i in range(n)], dtype=object),
            "np_int": np.array([np.int64(i) for i in range(n)], dtype=object),
            "raw": NonTensorStack(*[bytes([i]) * i for i in range(n)]),
            "records": NonTensorData(data=[{"i": i} for i in range(n)], batch_size=(n,)),
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
        if a.is_nested and a.layout == torch.jagged:
            return torch.equal(a.values(), b.values()) and torch.equal(a.offsets(), b.offsets())
        if a.is_nested:  # strided: task by task
            return same(list(a.unbind()), list(b.unbind()))
        return a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, NonTensorStack):
        items, theirs = a.tolist(), b.tolist() if isinstance(b, NonTensorStack) else None
        return theirs == items and [type(x) for x in items] == [type(x) for x in theirs]
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)
