"""TransferQueue's SimpleStorage across simulated hosts (bench/cluster/tq_peer.py): a Ray head with
TransferQueue's controller in one network namespace and a raylet in each of two more, each with
a storage unit, a producer and a consumer actor, every NIC shaped by tbf; a tiny grpo batch is
put by the producers and each balanced chunk got by a consumer, as the bench does. Skipped where
this machine cannot create namespaces (not root, no iproute2, no CAP_NET_ADMIN) or where Ray or
transferqueue is not installed (Ray: failed instead under DISTBATCH_REQUIRE_RAY=1). Traffic stays
between the namespaces' addresses; Ray's files go to a temp dir of its own, not /tmp/ray.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cluster_support import remove_stale_ray, running
from ray_support import import_ray

from bench.transferqueue import available
from simcluster import check, leftovers

import_ray()

from bench.cluster.ray_peer import ray_temp_dir  # noqa: E402
from bench.cluster.tq_peer import parse_args, run_hosts  # noqa: E402

_REASON = check() or available()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"cannot run here: {_REASON}")

WORKER_HOSTS = 2  # + host 0: the Ray head, TransferQueue's controller and the bench's


def test_transferqueue_moves_the_grpo_chunks_across_hosts_and_leaves_nothing(tmp_path: Path) -> None:
    """Two worker hosts, a storage unit on each: the producers' puts cross the links (a task's
    unit is its index mod 2), each consumer gets its balanced chunk, equal to distbatch's own;
    the keys are cleared; then no namespace, link, Ray process or Ray temp dir is left.

    Long (about a minute alone, more on a busy machine): a Ray cluster across three namespaces,
    TransferQueue's controller and storage units start before a byte moves, and every transfer
    crosses links shaped to 100 Mbit/s."""
    remove_stale_ray("dbt")
    prefix = f"dbt{os.getpid()}"
    args = parse_args(
        # Tokens long enough (2 MB in all) that data, not the time-bound control traffic of Ray's
        # and TransferQueue's actors, decides the byte counts below, however slow the machine.
        ["--prompts=16", "--n=4", "--mean-len=2048", "--repeats=1", f"--prefix={prefix}", f"--out={tmp_path}"]
    )
    result = run_hosts(WORKER_HOSTS, args, tmp_path / "logs")

    assert result["equal"] is True  # every field of every chunk, against chunk_balanced's
    assert sum(result["tasks"]) == 16 * 4 and all(result["tasks"])
    assert result["keys_left"] == 0
    assert result["placement"]["controller"] == 0 and sorted(result["placement"]["units"]) == [1, 2]
    # About half of each producer's share went to the unit on the other host, and half of each
    # chunk came back from it; host 0 carried only control traffic.
    for phase in ("put_moved", "get_moved"):
        for host in (1, 2):
            assert result[phase][host]["sent"] > result["batch_bytes"] / 8, (phase, result[phase])
    assert result["put_moved"][0]["received"] < result["batch_bytes"] / 8
    assert 0 < result["busiest_link_bytes"] < result["batch_bytes"]
    assert result["tq_put_s"] > 0 and result["tq_get_s"] > 0

    assert result["stopped_pids"], "no Ray process was found in the namespaces"
    assert [p for p in result["stopped_pids"] if running(p)] == []
    assert leftovers(prefix) == []
    assert not ray_temp_dir(prefix).exists()
