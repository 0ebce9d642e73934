"""No leaks: many put / gather / clear cycles leave an empty store and bounded memory, sockets, threads.

One real worker; the cycles go through the public batch API and the
process-wide default client. Numbers (worker RSS after warm-up and after the
cycles, fds, threads, connections) are printed; run with `-s` to see them.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from distbatch import DistributedBatchMemory
from distbatch.client import default_client
from distbatch.launch import WorkerProcess, spawn_worker

MiB = 1 << 20
RSS_GROWTH_LIMIT = 32 * MiB


@pytest.fixture
def leak_worker() -> Iterator[WorkerProcess]:
    worker = spawn_worker(env={"DISTBATCH_TOKEN": ""})
    try:
        yield worker
    finally:
        worker.stop()


def _status_field(pid: int | str, name: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{name} not in /proc/{pid}/status")


def rss_bytes(pid: int | str) -> int:
    return _status_field(pid, "VmRSS") * 1024


def threads(pid: int | str) -> int:
    return _status_field(pid, "Threads")


def open_fds(pid: int | str) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def connections_to(port: int) -> int:
    """ESTABLISHED TCP connections from this process to 127.0.0.1:`port` (the kernel's count)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote, state, inode = fields[2], fields[3], fields[9]
        if state == "01" and inode in inodes and int(remote.split(":")[1], 16) == port:
            count += 1
    return count


class ConnectionSampler:
    """Samples `connections_to(port)` every 50 ms on a thread while the `with` block runs."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="connection-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, connections_to(self.port))
            self.samples += 1

    def wait_for(self, count: int, timeout: float = 5.0) -> bool:
        """Whether a sample has seen `count` connections within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while self.peak < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.peak >= count

    def __enter__(self) -> ConnectionSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def make_batch(cycle: int, tasks: int, seq_len: int) -> DistributedBatchMemory:
    return DistributedBatchMemory.from_dict(
        {
            "input_ids": torch.randint(0, 50_000, (tasks, seq_len)),
            "logprobs": torch.randn(tasks, seq_len),
            "reward": [float(i) for i in range(tasks)],
        },
        task_ids=[f"c{cycle}-t{i}" for i in range(tasks)],
    )


def run_cycles(node: str, start: int, count: int, tasks: int, seq_len: int) -> None:
    for cycle in range(start, start + count):
        local = make_batch(cycle, tasks, seq_len)
        remote = local.to_remote(node)
        gathered = remote.to_local()
        assert torch.equal(gathered["input_ids"], local["input_ids"])
        assert remote.clear() == tasks * 3


@pytest.mark.parametrize(
    ("cycles", "tasks", "seq_len"),
    [
        pytest.param(1000, 8, 256, id="1000x8x256"),  # ~24 KiB a cycle
        pytest.param(2000, 32, 4096, id="2000x32x4096", marks=pytest.mark.slow),  # ~1.5 MiB a cycle
    ],
)
def test_put_gather_clear_cycles_do_not_leak(
    leak_worker: WorkerProcess, cycles: int, tasks: int, seq_len: int
) -> None:
    """Long (20-90 s): a thousand put, gather and clear cycles, counting sockets, threads and memory
    after each batch of them: a leak shows only over many cycles."""
    node = leak_worker.node
    port = int(node.rsplit(":", 1)[1])
    client = default_client()
    limit_per_node = client.max_connections_per_node

    warmup = max(50, cycles // 10)
    run_cycles(node, 0, warmup, tasks, seq_len)
    worker_rss0, worker_fds0, worker_threads0 = (
        rss_bytes(leak_worker.pid),
        open_fds(leak_worker.pid),
        threads(leak_worker.pid),
    )
    our_rss0, our_fds0, our_threads0 = rss_bytes("self"), open_fds("self"), threading.active_count()
    requests0 = client.traffic().requests

    started = time.monotonic()
    with ConnectionSampler(port) as sampler:
        # The sampler sees a connection we hold open (so a low peak below is not a blind sampler);
        # the client's own connections are short (the server closes each) and may fall between samples.
        with socket.create_connection(("127.0.0.1", port)):
            assert sampler.wait_for(1)
        sampler.peak = 0
        run_cycles(node, warmup, cycles, tasks, seq_len)
    peak_connections = sampler.peak
    elapsed = time.monotonic() - started
    requests1 = client.traffic().requests

    worker_rss1, worker_fds1, worker_threads1 = (
        rss_bytes(leak_worker.pid),
        open_fds(leak_worker.pid),
        threads(leak_worker.pid),
    )
    our_rss1, our_fds1, our_threads1 = rss_bytes("self"), open_fds("self"), threading.active_count()
    print(
        f"\n{cycles} cycles of {tasks} tasks x {seq_len} in {elapsed:.1f}s: "
        f"worker RSS {worker_rss0 / MiB:.1f} -> {worker_rss1 / MiB:.1f} MiB "
        f"({(worker_rss1 - worker_rss0) / MiB:+.1f}), fds {worker_fds0} -> {worker_fds1}, "
        f"threads {worker_threads0} -> {worker_threads1}; "
        f"client RSS {our_rss0 / MiB:.1f} -> {our_rss1 / MiB:.1f} MiB, fds {our_fds0} -> {our_fds1}, "
        f"threads {our_threads0} -> {our_threads1}, peak connections {peak_connections} "
        f"({sampler.samples} samples)"
    )

    # the store is empty: every shard put was deleted, nothing staged is left behind
    stats = client.stats(node)
    assert (stats["shards"], stats["tasks"], stats["bytes"], stats["staged_bytes"]) == (0, 0, 0, 0), stats
    # the worker's memory, sockets and threads stay bounded
    assert worker_rss1 - worker_rss0 < RSS_GROWTH_LIMIT
    assert worker_fds1 <= worker_fds0 + limit_per_node
    assert worker_threads1 <= worker_threads0 + limit_per_node
    # the client: one process-wide object, a bounded pool, no thread or fd growth
    assert default_client() is client
    assert requests1 - requests0 == 3 * cycles  # every call went through it, no retries
    assert sampler.samples > 10 and peak_connections <= limit_per_node
    assert connections_to(port) <= limit_per_node
    assert our_fds1 <= our_fds0 + limit_per_node
    assert our_threads1 == our_threads0
    assert our_rss1 - our_rss0 < 4 * RSS_GROWTH_LIMIT  # torch's allocator may keep some, but not per cycle
