"""Recycled receive buffers: reused only once nothing refers to them, bounded, expiring; and a
gather whose buffers are recycled never changes tensors a caller still holds."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch

from distbatch import DistributedBatchMemory, ShardClient
from distbatch.launch import WorkerProcess
from distbatch.transport.recv_pool import ENV_MAX_IDLE, MIN_POOLED_BYTES, RecvPool, default_max_idle_bytes

MIB = 1 << 20


def address(buffer: np.ndarray) -> int:
    return buffer.ctypes.data


def test_small_bodies_are_plain_bytearrays_and_big_ones_writable_arrays() -> None:
    pool = RecvPool(64 * MIB)
    small = pool.take(MIN_POOLED_BYTES - 1)
    assert isinstance(small, bytearray) and len(small) == MIN_POOLED_BYTES - 1
    big = pool.take(3 * MIB + 5)
    assert isinstance(big, np.ndarray) and big.nbytes == 3 * MIB + 5 and big.flags.writeable
    big[:] = 7
    assert int(big.sum()) == 7 * big.nbytes


def test_a_buffer_is_reused_only_after_its_last_view_goes() -> None:
    pool = RecvPool(64 * MIB)
    first = pool.take(4 * MIB)
    first_address = address(first)
    view = torch.frombuffer(memoryview(first), dtype=torch.uint8)  # what a gathered tensor holds
    del first
    gc.collect()
    second = pool.take(4 * MIB)  # the tensor still holds the first: a fresh mapping
    second_address = address(second)
    assert second_address != first_address and pool.reused == 0
    view[:] = 1
    second[:] = 2
    assert int(view.sum()) == view.numel()  # untouched by the second buffer's writes
    del view, second
    gc.collect()
    third = pool.take(4 * MIB - 100)
    assert pool.reused == 1 and address(third) in {first_address, second_address}


def test_idle_mappings_are_bounded_oldest_dropped_first() -> None:
    pool = RecvPool(8 * MIB)
    buffers = [pool.take(3 * MIB) for _ in range(4)]
    del buffers
    gc.collect()
    assert pool.idle_bytes <= 8 * MIB
    assert pool.idle_bytes == 6 * MIB  # two of the four fit, the oldest two were unmapped


def test_idle_mappings_expire() -> None:
    pool = RecvPool(64 * MIB, idle_seconds=1.0)
    buffer = pool.take(2 * MIB)
    del buffer  # the last reference: back in the pool at once (no cycle to collect)
    assert pool.idle_bytes == 2 * MIB
    deadline = time.monotonic() + 10
    while pool.idle_bytes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.idle_bytes == 0


def test_a_pool_of_zero_bytes_never_reuses() -> None:
    pool = RecvPool(0)
    for _ in range(3):
        buffer = pool.take(2 * MIB)
        del buffer
        gc.collect()
    assert pool.reused == 0 and pool.idle_bytes == 0


def test_a_closed_pool_keeps_nothing() -> None:
    pool = RecvPool(64 * MIB)
    buffer = pool.take(2 * MIB)
    pool.close()
    del buffer
    gc.collect()
    assert pool.idle_bytes == 0


def test_pool_size_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_MAX_IDLE, str(3 * MIB))
    assert default_max_idle_bytes() == 3 * MIB
    monkeypatch.setenv(ENV_MAX_IDLE, "lots")
    with pytest.raises(ValueError, match=ENV_MAX_IDLE):
        default_max_idle_bytes()
    with pytest.raises(ValueError):
        RecvPool(-1)


@pytest.fixture(scope="module")
def module_worker(module_worker_factory: Callable[..., WorkerProcess]) -> WorkerProcess:
    return module_worker_factory()


def test_gathers_reuse_buffers_without_touching_tensors_still_held(module_worker: WorkerProcess) -> None:
    """Gather a batch, keep its tensors, gather another: the held values stay what they were.
    Drop them, gather again: the buffer is recycled and the values are right."""
    gen = torch.Generator().manual_seed(0)
    first_values = [torch.randint(0, 1 << 30, (300_000,), generator=gen, dtype=torch.int32) for _ in range(8)]
    second_values = [v.flip(0) for v in first_values]
    with ShardClient(recv_pool_bytes=64 * MIB) as client:
        a = DistributedBatchMemory.from_dict({"x": first_values}).to_remote(module_worker.node, client)
        b = DistributedBatchMemory.from_dict({"x": second_values}).to_remote(module_worker.node, client)
        try:
            held = DistributedBatchMemory.from_meta(a.meta, client)["x"]
            for _ in range(3):
                other = DistributedBatchMemory.from_meta(b.meta, client)["x"]
                assert all(torch.equal(g, w) for g, w in zip(other, second_values))
                del other
                gc.collect()
            assert client._recv_pool.reused >= 1  # noqa: SLF001 - the pool is the thing under test
            assert all(torch.equal(g, w) for g, w in zip(held, first_values))
        finally:
            a.clear()
            b.clear()


def test_a_column_joined_from_two_workers_lands_in_a_recycled_buffer(
    start_worker: Callable[..., WorkerProcess],
) -> None:
    """A stacked column from two workers costs one join: into pooled memory (no page faults
    once warm), which is recycled after its tensor goes, while a held one is never touched."""
    nodes = [start_worker().node, start_worker().node]
    values = torch.arange(2 * 400_000, dtype=torch.float32).reshape(8, -1)
    with ShardClient(recv_pool_bytes=64 * MIB) as client:
        halves = DistributedBatchMemory.from_dict({"x": values}).chunk(2)
        batch = DistributedBatchMemory.concat([h.to_remote(n, client) for h, n in zip(halves, nodes)])
        try:
            held = DistributedBatchMemory.from_meta(batch.meta, client)["x"]
            reused = client._recv_pool.reused  # noqa: SLF001 - the pool is the thing under test
            for _ in range(3):
                again = DistributedBatchMemory.from_meta(batch.meta, client)["x"]
                assert torch.equal(again, values) and again.data_ptr() != held.data_ptr()
                del again
                gc.collect()
            # Per gather two responses and the join; the first join finds no idle mapping its size
            # (the held column has it), the next two do: 2 + 3 + 3 (responses alone would be 6).
            assert client._recv_pool.reused - reused >= 8  # noqa: SLF001
            assert torch.equal(held, values)
        finally:
            batch.clear()
