"""Fixtures of the integration tier: real worker processes on loopback, real HTTP.

The workers themselves (`start_worker`, `worker`, `shared_workers`, ...) come from the root
conftest, which the system tier shares; here are the batches built on them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from engines_for_tests import ECHO, ENGINES_ENV

from distbatch import BatchStatus, DistributedBatchMemory, ShardClient, WorkerGroup
from distbatch.launch import WorkerProcess, spawn_workers
from distbatch.transport.shm import ENV_HOST_ID, ENV_SWITCH

DBM = DistributedBatchMemory
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def grpo() -> Iterator[ModuleType]:
    """The traffic job's module, examples/grpo_pipeline.py (imported from examples/ for a module)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import grpo_pipeline

        yield grpo_pipeline
    finally:
        sys.path.remove(str(EXAMPLES))


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


@pytest.fixture
def pushed() -> Iterator[list[DistributedBatchMemory]]:
    """REMOTE batches a test made (it appends them); cleared at teardown."""
    batches: list[DistributedBatchMemory] = []
    yield batches
    for batch in batches:
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


@pytest.fixture(scope="module")
def echo_pair(module_client: ShardClient) -> Iterator[WorkerGroup]:
    """A group of two workers hosting the tests' `EchoEngine` (one per test module), stopped after."""
    group = WorkerGroup.local(2, ECHO, env=ENGINES_ENV, client=module_client)
    try:
        yield group
    finally:
        group.shutdown()


@pytest.fixture
def same_host(
    monkeypatch: pytest.MonkeyPatch, start_worker: Callable[..., WorkerProcess]
) -> Iterator[tuple[str, ShardClient]]:
    """A worker of the test's own and a client that reach each other over shared memory (the
    suite runs on HTTP otherwise); the test must have taken that path."""
    monkeypatch.delenv(ENV_SWITCH, raising=False)
    monkeypatch.delenv(ENV_HOST_ID, raising=False)
    worker = start_worker()
    with ShardClient() as client:
        yield worker.node, client
        assert client.traffic().same_host_sent > 0, "the same-host path was not taken"


@pytest.fixture
def fresh_workers() -> Iterator[list[WorkerProcess]]:
    """Two workers of the test's own: their stores start empty, and a test may kill one. Both
    stopped at teardown."""
    workers = spawn_workers(2)
    yield workers
    for w in workers:
        w.stop()
