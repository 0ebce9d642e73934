"""CUDA tensors into the store and back out, on a real worker: one copy per column each way.

A trainer's batch lives on the GPU. Putting it must copy each column to the host once (a
ragged column of per-task GPU tensors is joined on the device first, then copied: not one copy
per task), and `packed(..., device="cuda")` / `nested(..., device="cuda")` after a gather must
copy each column's values and offsets to the device once. The copies are counted with the
profiler's CUDA memcpy records. Skipped where no CUDA device is present (CI has none).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from distbatch import DistributedBatchMemory, ShardClient
from distbatch.launch import WorkerProcess
from distbatch.transport.shm import ENV_HOST_ID, ENV_SWITCH
from distbatch.wire.host_copy import CHUNK_BYTES, PinnedRing

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DBM = DistributedBatchMemory
TASKS = 64


def _gpu_batch() -> tuple[dict[str, object], dict[str, object]]:
    """The same columns on the GPU and on the CPU: dense bf16, ragged int64 (a list of per-task
    tensors), ragged float32 as a jagged nested tensor, and a 0-d per-task float."""
    gen = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, 300, (TASKS,), generator=gen).tolist()
    ids = [torch.randint(0, 50_000, (n,), generator=gen) for n in lengths]
    logprobs = [torch.randn(n, generator=gen) for n in lengths]
    cpu = {
        # 40 MiB: copied to the host through the pinned ring (distbatch.wire.host_copy), 3 chunks
        "activations": torch.randn(TASKS, (40 << 20) // 4 // TASKS, generator=gen),
        "hidden": torch.randn(TASKS, 16, generator=gen).to(torch.bfloat16),
        "input_ids": ids,
        "logprobs": torch.nested.nested_tensor(logprobs, layout=torch.jagged),
        "reward": torch.randn(TASKS, generator=gen),
    }
    gpu = {
        "activations": cpu["activations"].cuda(),
        "hidden": cpu["hidden"].cuda(),
        "input_ids": [t.cuda() for t in ids],
        "logprobs": cpu["logprobs"].cuda(),
        "reward": cpu["reward"].cuda(),
    }
    return gpu, cpu


def _memcpy_count(prof: profile, kind: str) -> int:
    return sum(1 for e in prof.events() if f"Memcpy {kind}" in e.name)


@pytest.fixture(params=[True, False], ids=["same-host", "http"])
def path(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    start_worker: Callable[..., WorkerProcess],
) -> Iterator[tuple[WorkerProcess, ShardClient, bool]]:
    """A worker and a client on the same-host path (on for both, as tests/integration/test_shm.py
    does) or on HTTP."""
    monkeypatch.delenv(ENV_SWITCH, raising=False)
    monkeypatch.delenv(ENV_HOST_ID, raising=False)
    worker = start_worker(env={"DISTBATCH_TOKEN": ""})
    with ShardClient(token="", same_host=request.param) as client:
        yield worker, client, request.param


def test_gpu_columns_go_in_with_one_copy_each_and_come_back_equal(
    path: tuple[WorkerProcess, ShardClient, bool],
) -> None:
    worker, gpu_client, same_host_path = path
    gpu, cpu = _gpu_batch()
    local = DBM.from_dict(gpu)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        remote = local.to_remote(worker.node, client=gpu_client)
        torch.cuda.synchronize()
    try:
        # one device-to-host copy per column that holds GPU data (a big one in chunks of the
        # pinned ring, never one per task); the ragged list column is joined on the device
        # (one cat) before its copy; offsets are built on the host
        chunks = math.ceil(cpu["activations"].nbytes / CHUNK_BYTES)
        assert _memcpy_count(prof, "DtoH") <= len(gpu) - 1 + chunks, [
            e.name for e in prof.events() if "Memcpy" in e.name
        ]
        same_host = gpu_client.traffic().same_host_requests
        assert same_host >= 1 if same_host_path else same_host == 0
        back = remote.to_local()
        assert torch.equal(back["activations"], cpu["activations"])
        assert torch.equal(back["hidden"], cpu["hidden"])
        assert torch.equal(back["reward"], cpu["reward"])
        for i in range(TASKS):
            assert torch.equal(back["input_ids"][i], cpu["input_ids"][i])
            assert torch.equal(back["logprobs"][i], cpu["logprobs"][i])
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            values, offsets = remote.packed("input_ids", device="cuda")  # gathered: one buffer
            nested = remote.nested("logprobs", device="cuda")
            dense, _ = remote.packed("hidden", device="cuda")
            torch.cuda.synchronize()
        assert values.is_cuda and offsets.is_cuda and nested.is_cuda and dense.is_cuda
        # values and offsets: one host-to-device copy each per column (hidden: its offsets too)
        assert _memcpy_count(prof, "HtoD") <= 6
        assert torch.equal(values.cpu(), torch.cat(cpu["input_ids"]))
        assert torch.equal(nested.values().cpu(), cpu["logprobs"].values())
        assert torch.equal(dense.cpu().reshape(TASKS, 16), cpu["hidden"])
    finally:
        remote.clear()


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(10_007, 3),  # not a whole number of chunks
        lambda: torch.randn(300, 40).t(),  # not contiguous
        lambda: torch.randint(0, 2, (50_001,), dtype=torch.bool),
        lambda: torch.randn(7_777, dtype=torch.complex64),
        lambda: torch.randn(9_999).to(torch.bfloat16),
        lambda: torch.empty(0, 5),
    ],
    ids=["ragged-tail", "transposed", "bool", "complex", "bf16", "empty"],
)
def test_the_pinned_ring_copies_any_tensor_exactly(make: Callable[[], torch.Tensor]) -> None:
    """Small chunks, so most tensors take many of them and both buffers are refilled."""
    value = make()
    ring = PinnedRing(torch.device("cuda", 0), chunk_bytes=4096)
    for _ in range(2):  # the ring is reused
        copied = ring.to_host(value.cuda())
        assert copied.device.type == "cpu" and copied.is_contiguous()
        assert copied.dtype == value.dtype and torch.equal(copied, value)


def test_the_bench_gpu_rows_run_on_the_device() -> None:
    """`bench.cuda` (issue 34's GPU rows) on this device: the put from it and the gather to it
    move the batch intact (the bench checks every field) and each row has its limit beside it."""
    from bench import cuda

    result = cuda.run("tiny", workers=1, repeats=2)
    assert result["device"].startswith("cuda")
    for entry in result["kinds"].values():
        assert entry["d2h"]["gbps"] > 0 and entry["h2d"]["gbps"] > 0
        assert entry["put_over_d2h"] > 0 and entry["gather_over_h2d"] > 0
    assert "put/d2h" in cuda.table(result)
