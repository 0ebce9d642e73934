"""Shared fixtures: real worker processes on loopback (port 0), stopped by their fixture."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from distbatch import ShardClient
from distbatch.launch import WorkerProcess, spawn_worker


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="also run the long variants")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="long variant: pass --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def start_worker() -> Iterator[Callable[..., WorkerProcess]]:
    """Factory: start a worker with extra CLI args / env; every one is stopped at teardown."""
    started: list[WorkerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> WorkerProcess:
        worker = spawn_worker(args=args, env=env)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture(scope="module")
def module_worker_factory() -> Iterator[Callable[..., WorkerProcess]]:
    """Like `start_worker`, for a module's tests; workers run without a token unless `env` sets one."""
    started: list[WorkerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> WorkerProcess:
        worker = spawn_worker(args=args, env=env if env is not None else {"DISTBATCH_TOKEN": ""})
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture
def worker(start_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    return start_worker()


@pytest.fixture(scope="module")
def shared_workers() -> Iterator[list[WorkerProcess]]:
    """Three workers shared by a module's tests (each test uses its own task ids)."""
    workers = [spawn_worker() for _ in range(3)]
    yield workers
    for w in workers:
        w.stop()


@pytest.fixture
def client() -> Iterator[ShardClient]:
    with ShardClient(timeout=20.0) as c:
        yield c
