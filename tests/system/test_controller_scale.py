"""The control plane at scale: 256 consumers in 4 groups of 64 poll `get_meta` on one served
controller while a producer streams tasks. No call fails, every group gets every task exactly
once, and the run ends in bounded time. Timings are the benchmark's (`bench.control_plane`),
never asserted here.

Four groups of 64 ranks (four roles of an RL step, each data-parallel over 64 ranks) rather than
two of 128: each task is handed out four times, so the per-group bookkeeping is exercised four
ways at once, and 64 ranks still race for every batch of a group. The consumers share one
`ShardClient`, as ranks in one process share `default_client()`, allowed a connection each; with
the producer's, that is more connections at once than the controller's 256 request threads, and
no call may fail for it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from bench import control_plane
from distbatch.controller import Controller
from distbatch.controller.server import ControllerServer


@pytest.mark.timeout(300)
def test_256_consumers_in_4_groups_get_every_task_exactly_once(
    serve: Callable[..., ControllerServer],
) -> None:
    """Long (10-90 s): 256 consumers polling one served controller while a producer streams is the
    scale the test is about."""
    server = serve(Controller())
    scenario = control_plane.Scenario(
        consumers=256,
        groups=4,
        tasks=8192,  # 512 batches of 16 per group: about 8 per rank
        batch_size=16,
        chunk=256,
        put_interval=0.02,  # streaming: the producer is still announcing while ranks poll
        poll_interval=0.01,
        step_seconds=0.0,
        # Judged by progress: a stall of 30 s without a delivery fails it; the total time, which
        # a loaded machine stretches, only has the test's own timeout as a backstop.
        stall_seconds=30.0,
        max_seconds=270.0,
    )
    result = control_plane.run(server.address, scenario, progress_bar=False)

    assert result["failures"] == [] and result["ok"] and result["errors"] == 0
    assert result["tasks_delivered"] == 8192 * 4
    for group, delivery in result["delivery"].items():
        assert delivery["delivered"] == delivery["distinct"] == 8192, group
        assert delivery["duplicates"] == delivery["missing"] == delivery["unknown"] == 0, group
        # The load spread over the group's ranks, not a few fast threads (no fairness is promised).
        assert delivery["consumers_served"] > 16, (group, delivery)
    # The controller agrees: each group consumed every task, and the run forgot them after.
    assert result["consumed"] == {f"group{g}": 8192 for g in range(4)}
    assert result["answered_calls"] == 8192 * 4 // 16  # every answer a full batch
    assert result["get_meta"]["count"] == result["get_meta_calls"] > 0
    (partition,) = server.controller.partitions()
    assert server.controller.production_status(partition)["tasks"] == 0


@pytest.mark.timeout(120)
def test_a_scenario_that_could_not_deliver_every_task_is_refused() -> None:
    for bad in (
        control_plane.Scenario(consumers=10, groups=4),  # groups of unequal size
        control_plane.Scenario(tasks=1000, batch_size=16),  # a tail no full batch takes
        control_plane.Scenario(step_seconds=-1),
    ):
        with pytest.raises(ValueError):
            bad.check()
