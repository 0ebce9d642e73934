"""What every tier shares: the suite's options, and real worker processes on loopback (port 0),
each stopped by its fixture.

The suite has three tiers, each with its own conftest:

- `tests/unit/`: library code in this process; no worker, no server, no listening socket
  (its conftest refuses them).
- `tests/integration/`: real `rpc_server` processes, real HTTP, the controller's HTTP face, the
  CLI, the examples, the README, the guide and the API reference.
- `tests/system/`: faults, soak, leaks, stress and hostile input, Ray clusters.

Support modules every tier imports (`bundle_support`, `engines_for_tests`, ...) sit beside this
file; pyproject puts `tests/` on the import path.

`scripts/test` runs the suite on several pytest-xdist workers, with this file's scheduler
(`pytest_xdist_make_scheduler`): each module is one unit of work, so its module-scoped workers
and Ray cluster start once; modules that must not run at the same time as each other form one
unit (`SHARED_GROUPS`); and the longest modules are handed out first (`LONGEST_FIRST`), so the
run ends when the short ones do.
"""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

from distbatch import ShardClient
from distbatch.launch import WorkerProcess, spawn_worker

if TYPE_CHECKING:
    # The controller imports torch (1.4 CPU-s): pytest-xdist's own process loads this file and
    # runs no test, so it does not pay for it (the `serve` fixture imports it when used).
    from distbatch.controller import Controller
    from distbatch.controller.server import ControllerServer
from distbatch.transport.shm import ENV_STRICT, ENV_SWITCH

TEST_PROCESS_GC_THRESHOLD0 = 10_000


def pytest_configure(config: pytest.Config) -> None:
    # Most tests check the HTTP path (its requests, bounds, retries and faults) with workers on
    # this host, where clients would otherwise take shared memory; tests of the same-host path
    # (tests/integration/test_shm.py) turn it back on for themselves and the workers they start.
    os.environ[ENV_SWITCH] = "0"
    # Where a test does take the same-host path, a request that falls back to HTTP because
    # something failed raises instead (workers inherit it): a lost fast path fails the test.
    # Tests that provoke a fallback on purpose turn it off (`lenient_same_host`).
    os.environ[ENV_STRICT] = "1"
    # Ray runs its worker processes (every actor: our workers, TransferQueue's) at nice 15, so on
    # a busy machine the Ray modules, the run's critical path, got the CPU last; here they run at
    # the priority of the test that started them (see `chains_come_first`).
    os.environ["RAY_worker_niceness"] = "0"
    # A test process holds about a million objects (torch, hypothesis, the parsed sources of the
    # layout checks), and each full collection walks them all: with the default thresholds, 24 of
    # them were 16% of the unit tier's CPU (gc.callbacks, timed). Collecting generation 0 every
    # 10,000 net allocations instead of 700 leaves 8 full collections (2.1 s instead of 5.6 s).
    # Only this process: the workers and scripts the tests start keep Python's defaults, and the
    # tests of `distbatch.gc_pause` set the thresholds they check.
    gc.set_threshold(TEST_PROCESS_GC_THRESHOLD0, *gc.get_threshold()[1:])


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", help="also run the long variants")


# Modules that run one after another on one xdist worker, each group in its own:
# - the simulated hosts of each module make namespaces, a bridge and its addresses in this
#   machine's own namespace, and shape its links; two at once would share the machine's
#   bridges and skew each other's link timings;
# - each Ray module starts a Ray cluster of its own (a dozen processes, an actor process per
#   worker): on 2 cores, more than two at once starve each other and everything else. Two
#   chains of about equal length: the longer is the suite's critical path (seconds in the suite,
#   `DISTBATCH_TEST_TIMELINE`, 2026-11-29: ray-a 173 + 123 + 49 = 345, ray-b 52 + 178 + 70 + 34
#   = 334; with the example in ray-a, 379 against 300).
SHARED_GROUPS = {
    "simulated-hosts": (
        "test_cluster.py",
        "test_cluster_faults.py",
        "test_cluster_ray.py",
        "test_cluster_tq.py",
    ),
    "ray-a": (
        "test_bench.py",
        "test_transferqueue_faults.py",
        "test_ray.py",
    ),
    "ray-b": (
        "test_transferqueue_backend.py",
        "test_transferqueue_backend_options.py",
        "test_ray_cluster.py",
        "test_transferqueue_example.py",
    ),
}
# The longest modules and groups (seconds alone, `--durations=0`), handed out first while the
# rest fill the other workers; then the system tier, the integration tier, the unit tier.
LONGEST_FIRST = (
    "test_transferqueue_backend.py",  # ray-b: 55 + 47 + 40 + 13
    "test_bench.py",  # ray-a: 67 + 45 + 40
    "test_cluster_faults.py",  # simulated hosts: about 120 in all
    "test_transferqueue_backend_options.py",
    "test_transferqueue_faults.py",
    "test_ray_cluster.py",
    "test_ray.py",
    "test_transferqueue_example.py",
    "test_cluster_tq.py",
    "test_cluster_ray.py",
    "test_cluster.py",
    "test_call_reliability.py",  # 60 s on 4 busy workers
    "test_server_bounds.py",  # 56
    "test_launch_output.py",  # 48
    "test_faults.py",  # 45
    "test_pipeline.py",  # 42
)
TIER_ORDER = ("system", "integration", "unit")
# Within the unit tier (run alone on 2 workers while a developer waits), the modules of most CPU
# first, so the other worker's short modules fill the end instead of one long module.
UNIT_LONGEST_FIRST = (
    "test_columns.py",  # 7.4 CPU-s
    "test_store.py",  # 3.8
    "test_wire_properties.py",  # 3.7
    "test_samplers_in_controller.py",  # 3.1
    "test_stall_watchdog.py",  # 2.9, sleeping
    "test_control_plane_wait.py",  # 2.6, sleeping
)


# Under xdist the chains above are the run's critical path, and Ray under CPU starvation slows by
# several times (one tq.init took 4 minutes instead of 8 s): the workers running any other
# module lower their own priority once (their workers and scripts inherit it), so the chains get
# the CPU first and the rest fills what they leave.
OTHERS_NICENESS = 5


def _shared_group(name: str) -> str | None:
    return next((group for group, modules in SHARED_GROUPS.items() if name in modules), None)


@pytest.fixture(scope="module", autouse=True)
def chains_come_first(request: pytest.FixtureRequest) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") and _shared_group(request.path.name) is None:
        now = os.getpriority(os.PRIO_PROCESS, 0)
        if now < OTHERS_NICENESS:
            os.nice(OTHERS_NICENESS - now)


def _start_rank(item: pytest.Item) -> tuple[int, ...]:
    name = item.path.name
    if name in LONGEST_FIRST:
        return (0, LONGEST_FIRST.index(name))
    tier = item.path.parent.name
    rank = TIER_ORDER.index(tier) if tier in TIER_ORDER else len(TIER_ORDER)
    if tier == "unit" and name in UNIT_LONGEST_FIRST:
        return (1, rank, UNIT_LONGEST_FIRST.index(name))
    return (1, rank, len(UNIT_LONGEST_FIRST))


# `DISTBATCH_TEST_TIMELINE=FILE`: each test's start and end (seconds since the epoch), the CPU
# seconds the pytest process itself spent on it (all its threads: in-process clients, hypothesis;
# not the processes it started, which `bench.suite_cpu` counts) and the xdist worker that ran it,
# one JSON line per test: where a parallel run waits, and on what.
TIMELINE = os.environ.get("DISTBATCH_TEST_TIMELINE")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not TIMELINE:
        return (yield)
    start, cpu = time.time(), time.process_time()
    try:
        return (yield)
    finally:
        line = {"test": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                "start": start, "end": time.time(), "cpu": time.process_time() - cpu}
        with open(TIMELINE, "a") as out:
            out.write(json.dumps(line) + "\n")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's module-at-a-time scheduler, with `SHARED_GROUPS` as single units and the units in
    collection order (`LONGEST_FIRST` first), not xdist's order by test count."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            name = module.rsplit("/", 1)[-1]
            return _shared_group(name) or module

    config.option.loadscopereorder = False
    return ModuleUnits(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_start_rank)  # stable: a module's tests keep their order
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="long variant: pass --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def worker_logs_in_one_place(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every worker the suite starts logs under pytest's own temp dir (pruned by pytest),
    instead of one new /tmp/distbatch-workers-* directory per group."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DISTBATCH_LOG_DIR", str(tmp_path_factory.mktemp("worker-logs")))
        yield


@pytest.fixture
def lenient_same_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """For a test that makes the same-host path fail on purpose: fall back to HTTP, as users get."""
    monkeypatch.setenv(ENV_STRICT, "0")


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
    """A client of the test's own, closed after it."""
    with ShardClient(timeout=20.0) as c:
        yield c


@pytest.fixture(scope="module")
def module_client() -> Iterator[ShardClient]:
    """One client for a module's tests and its module-scoped groups (calls wait up to 30 s)."""
    with ShardClient(timeout=30.0) as c:
        yield c


@pytest.fixture
def serve() -> Iterator[Callable[..., ControllerServer]]:
    """Factory: serve a Controller on loopback; every server is shut down at teardown."""
    servers: list[ControllerServer] = []

    from distbatch.controller.server import serve_controller

    def start(controller: Controller, **kwargs: Any) -> ControllerServer:
        server = serve_controller(controller, **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
