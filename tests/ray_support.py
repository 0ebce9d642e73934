"""What the Ray test modules share: importing Ray (skip, or fail where it must be there) and probes.

`scripts/test` installs the Ray extra and sets DISTBATCH_REQUIRE_RAY=1, so a broken Ray
install fails the suite instead of silently skipping the Ray launcher's tests.
"""

from __future__ import annotations

import importlib
import os
import time
from types import ModuleType
from typing import TYPE_CHECKING

import pytest

from distbatch import WorkerGroup

if TYPE_CHECKING:
    from distbatch.ray_group import RayWorkers


def import_ray() -> ModuleType:
    """`ray`, or a module-level skip when it is not installed and not required."""
    if os.environ.get("DISTBATCH_REQUIRE_RAY") == "1":
        return importlib.import_module("ray")
    return pytest.importorskip("ray")


def ray_workers(group: WorkerGroup) -> RayWorkers:
    """The actors and placement group behind a Ray-launched group."""
    from distbatch.ray_group import RayWorkers

    (workers,) = [s for s in group.stoppers if isinstance(s, RayWorkers)]
    return workers


def host(node: str) -> str:
    return node.rsplit(":", 1)[0]


def wait_for_free_cpus(expected: float, timeout: float = 15.0) -> float:
    """Ray reports freed resources lazily: poll until `expected` CPUs are free or time runs out."""
    import ray

    deadline = time.monotonic() + timeout
    free = ray.available_resources().get("CPU", 0.0)
    while free != expected and time.monotonic() < deadline:
        time.sleep(0.2)
        free = ray.available_resources().get("CPU", 0.0)
    return free
