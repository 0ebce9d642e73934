"""Ray across simulated hosts (bench/cluster/ray_peer.py): a Ray head in one network namespace and a
raylet in each of two more, every NIC shaped by tbf; a tiny grpo batch is put by a producer
actor on each worker host and got by a consumer actor on each, as the bench does. Skipped where
this machine cannot create namespaces (not root, no iproute2, no CAP_NET_ADMIN) or where Ray is
not installed (failed instead under DISTBATCH_REQUIRE_RAY=1). Traffic stays between the
namespaces' addresses; Ray's files go to a temp dir of its own, not /tmp/ray.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cluster_support import remove_stale_ray, running
from ray_support import import_ray

from simcluster import check, leftovers

import_ray()

from bench.cluster.ray_peer import parse_args, ray_temp_dir, run_hosts  # noqa: E402

_REASON = check()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"no simulated cluster here: {_REASON}")

WORKER_HOSTS = 2  # + host 0: the head and the controller


def test_ray_gets_the_grpo_chunks_across_hosts_and_leaves_nothing(tmp_path: Path) -> None:
    """Two worker hosts: each consumer gets its balanced chunk (half of it from the other host)
    with `ray.get`, equal to distbatch's own chunk; then no namespace, link, Ray process or Ray
    temp dir is left.

    Long (half a minute alone): a Ray cluster across three namespaces starts first, and the
    chunks cross links shaped to 100 Mbit/s."""
    remove_stale_ray("dtr")
    prefix = f"dtr{os.getpid()}"
    args = parse_args(
        ["--prompts=16", "--n=4", "--mean-len=256", "--repeats=1", "--check", f"--prefix={prefix}",
         f"--out={tmp_path}"]
    )  # fmt: skip
    result = run_hosts(WORKER_HOSTS, args, tmp_path / "logs")

    assert result["equal"] is True  # every field of every chunk, against chunk_balanced's
    assert sum(result["tasks"]) == 16 * 4 and all(result["tasks"])
    assert 0 < result["busiest_link_bytes"] < result["batch_bytes"]
    # The pieces crossed the worker hosts' NICs (host 0 carried only the control traffic).
    for host in (1, 2):
        assert result["links"][host]["sent"] > result["busiest_link_bytes"] / 2, result["links"]
    assert result["ray_get_s"] > 0

    assert result["stopped_pids"], "no Ray process was found in the namespaces"
    assert [p for p in result["stopped_pids"] if running(p)] == []
    assert leftovers(prefix) == []
    assert not ray_temp_dir(prefix).exists()
