"""What the Ray test modules share: importing Ray (skip, or fail where it must be there) and probes.

`scripts/test` installs the Ray extra and sets DISTBATCH_REQUIRE_RAY=1, so a broken Ray
install fails the suite instead of silently skipping the Ray launcher's tests.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pytest

from distbatch import WorkerGroup

if TYPE_CHECKING:
    from distbatch.launch.ray_actors import RayWorkers


def import_ray() -> ModuleType:
    """`ray`, or a module-level skip when it is not installed and not required."""
    if os.environ.get("DISTBATCH_REQUIRE_RAY") == "1":
        return importlib.import_module("ray")
    return pytest.importorskip("ray")


def local_ray_for_module(num_cpus: int, **kwargs: Any) -> Iterator[None]:
    """A new local Ray cluster for one test module, shut down after it (the module's autouse
    fixture yields from here); fails the module if Ray is up already (a module before it did not
    shut it down). `kwargs` go to `init_local_ray` (a `runtime_env`, say)."""
    import ray

    from distbatch.launch.ray_actors import init_local_ray

    if ray.is_initialized():
        pytest.fail("ray was initialised before this module")
    init_local_ray(num_cpus=num_cpus, configure_logging=False, **kwargs)
    try:
        yield
    finally:
        ray.shutdown()


def ray_workers(group: WorkerGroup) -> RayWorkers:
    """The actors and placement group behind a Ray-launched group."""
    from distbatch.launch.ray_actors import RayWorkers

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


def run_pipeline_on_ray_and_locally(job: list[str]) -> tuple[Any, Any]:
    """The traffic job (examples/grpo_pipeline.py) with `--launcher ray`, then with local workers.

    Checks what must hold for any cluster: stores empty, metadata-only controller, and step
    for step the same tasks, tokens, per-rank balance, worker-to-worker bytes and loss.
    Returns both reports for cluster-specific checks (placement).
    """
    examples = str(Path(__file__).resolve().parents[1] / "examples")
    sys.path.insert(0, examples)
    try:
        import grpo_pipeline
    finally:
        sys.path.remove(examples)
    on_ray = grpo_pipeline.run_pipeline(grpo_pipeline.parse_args([*job, "--launcher", "ray"]), quiet=True)
    local = grpo_pipeline.run_pipeline(grpo_pipeline.parse_args(job), quiet=True)
    assert on_ray.shards_left == 0 and local.shards_left == 0
    worker_bytes, controller_bytes, _ = on_ray.totals()
    assert worker_bytes > 0 and controller_bytes < 0.02 * worker_bytes
    for r, lo in zip(on_ray.steps, local.steps, strict=True):
        assert (r.tasks, r.tokens, r.rank_tokens) == (lo.tasks, lo.tokens, lo.rank_tokens)
        assert r.worker_bytes == lo.worker_bytes  # the same shards moved, worker to worker
        assert r.controller_bytes == pytest.approx(lo.controller_bytes, rel=0.02)  # port digits differ
        assert r.mean_loss == pytest.approx(lo.mean_loss, rel=1e-6)
    return on_ray, local
