"""`WorkerGroup.ray` on a real two-node Ray cluster (`ray.cluster_utils.Cluster`; skipped without ray).

Each node is a separate raylet with its own loopback address (127.0.0.2 and 127.0.0.3), so
placement shows in the workers' addresses and every byte stays on loopback; a worker on one
node gathers the columns it needs straight from a worker on the other.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ray_support import host, import_ray, ray_workers, run_pipeline_on_ray_and_locally, wait_for_free_cpus

ray = import_ray()

import torch  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import placement_group_table  # noqa: E402

from distbatch import DistributedBatchMemory, ShardClient, WorkerGroup, WorkerUnavailableError  # noqa: E402
from distbatch.launch.ray_actors import init_local_ray, prepare_ray_environment  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}
ECHO = "engines_for_tests:EchoEngine"
HEAD_IP, SECOND_IP = "127.0.0.2", "127.0.0.3"
CPUS_PER_NODE = 1.0
SMALL_OBJECT_STORE = 80 * 1024 * 1024  # our data never enters Ray's object store


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    if ray.is_initialized():
        pytest.fail("ray was initialised before this module")
    prepare_ray_environment()
    node_args: dict[str, Any] = {"num_cpus": CPUS_PER_NODE, "object_store_memory": SMALL_OBJECT_STORE}
    started = Cluster(
        initialize_head=True,
        head_node_args={**node_args, "node_ip_address": HEAD_IP, "include_dashboard": False},
    )
    try:
        started.add_node(**node_args, node_ip_address=SECOND_IP)
        started.wait_for_nodes(timeout=60)
        # The driver joins through the head's own loopback address (Ray would swap 127.0.0.1 for
        # the machine's external IP, which this test must not use).
        ray.init(
            address=started.address, _node_ip_address=HEAD_IP, log_to_driver=False, configure_logging=False
        )
        yield started
    finally:
        ray.shutdown()
        started.shutdown()


def node_ids_by_ip() -> dict[str, str]:
    return {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}


def test_the_cluster_has_two_loopback_nodes(cluster: Cluster) -> None:
    assert sorted(node_ids_by_ip()) == [HEAD_IP, SECOND_IP]
    assert ray.cluster_resources()["CPU"] == 2 * CPUS_PER_NODE


def test_init_local_ray_joins_a_running_cluster_and_keeps_its_auth(cluster: Cluster) -> None:
    token = os.environ.get("RAY_AUTH_TOKEN")
    ray.shutdown()  # the driver leaves; the cluster runs on
    init_local_ray(address=cluster.address, _node_ip_address=HEAD_IP, configure_logging=False)
    assert ray.is_initialized() and sorted(node_ids_by_ip()) == [HEAD_IP, SECOND_IP]
    assert os.environ.get("RAY_AUTH_TOKEN") == token  # joining never makes up a new token


def test_worker_group_joins_the_cluster_named_by_ray_address(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    ray.shutdown()  # as in a script `ray job submit` runs: no ray.init, RAY_ADDRESS set
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    with WorkerGroup.ray(2, ECHO, env=ENV, placement="strict_spread") as g:
        assert sorted(host(n) for n in g.nodes) == [HEAD_IP, SECOND_IP]  # not a new local cluster
    assert sorted(node_ids_by_ip()) == [HEAD_IP, SECOND_IP]


def test_strict_spread_serves_from_both_nodes_and_gathers_across_them(cluster: Cluster) -> None:
    with WorkerGroup.ray(2, ECHO, env=ENV, placement="strict_spread") as g:
        assert sorted(host(n) for n in g.nodes) == [HEAD_IP, SECOND_IP]
        ids = node_ids_by_ip()
        actor_nodes = ray.get([a.node_id.remote() for a in ray_workers(g).actors])
        assert actor_nodes == [ids[host(n)] for n in g.nodes]  # each server binds its own node's address
        assert [w["node"] for w in g.call_all("whoami")] == g.nodes
        with ShardClient(timeout=20.0) as client:
            local = DistributedBatchMemory.from_dict(
                {"x": torch.arange(10, dtype=torch.float32)}, task_ids=[f"two-{i}" for i in range(10)]
            )
            stored = [c.to_remote(node, client) for c, node in zip(local.chunk(2), g.nodes)]
            batch = DistributedBatchMemory.concat(stored)
            # Each worker sums the chunk held on the *other* node: the bytes cross nodes, not the driver.
            assert g.call("total", list(reversed(batch.chunk(2)))) == [sum(range(5, 10)), sum(range(5))]
            batch.clear()
        assert g.call_all("store_shards") == [0, 0]


def test_pack_puts_both_workers_on_one_node(cluster: Cluster) -> None:
    with WorkerGroup.ray(2, ECHO, env=ENV, placement="pack") as g:
        assert len({host(n) for n in g.nodes}) == 1
        assert len(g.call_all("whoami")) == 2


def test_node_ids_pin_each_worker_to_its_node(cluster: Cluster) -> None:
    ids = node_ids_by_ip()
    with WorkerGroup.ray(3, ECHO, env=ENV, node_ids=[ids[SECOND_IP], ids[HEAD_IP], ids[SECOND_IP]]) as g:
        assert [host(n) for n in g.nodes] == [SECOND_IP, HEAD_IP, SECOND_IP]
        assert ray_workers(g).placement_group is None
        assert [w["node"] for w in g.call_all("whoami")] == g.nodes


def test_unknown_node_id_is_refused_before_any_actor_starts(cluster: Cluster) -> None:
    assert wait_for_free_cpus(2 * CPUS_PER_NODE) == 2 * CPUS_PER_NODE  # earlier groups' CPUs are back
    with pytest.raises(ValueError, match="no live Ray node"):
        WorkerGroup.ray(1, ECHO, env=ENV, node_ids=["ff" * 28])
    with pytest.raises(ValueError, match="2 node ids for 1 workers"):
        WorkerGroup.ray(1, ECHO, env=ENV, node_ids=list(node_ids_by_ip().values()))
    time.sleep(0.5)
    assert ray.available_resources()["CPU"] == 2 * CPUS_PER_NODE


def test_strict_spread_over_more_workers_than_nodes_fails_cleanly(cluster: Cluster) -> None:
    with pytest.raises(WorkerUnavailableError, match="not placed"):
        WorkerGroup.ray(3, ECHO, env=ENV, placement="strict_spread", startup_timeout=3)
    assert wait_for_free_cpus(2 * CPUS_PER_NODE) == 2 * CPUS_PER_NODE


def test_shutdown_frees_both_nodes(cluster: Cluster) -> None:
    g = WorkerGroup.ray(2, ECHO, env=ENV, placement="strict_spread")
    workers = ray_workers(g)
    actors, group = list(workers.actors), workers.placement_group
    assert wait_for_free_cpus(2 * CPUS_PER_NODE - 0.5) == 2 * CPUS_PER_NODE - 0.5
    g.shutdown()
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.pid.remote(), timeout=30)
    assert placement_group_table(group)["state"] == "REMOVED"
    with ShardClient(timeout=2.0) as client:
        for node in g.nodes:
            with pytest.raises(WorkerUnavailableError):
                client.health(node)
    assert wait_for_free_cpus(2 * CPUS_PER_NODE) == 2 * CPUS_PER_NODE


def test_a_lost_node_surfaces_as_worker_unavailable(cluster: Cluster) -> None:
    third_ip = "127.0.0.4"
    doomed = cluster.add_node(
        num_cpus=CPUS_PER_NODE, object_store_memory=SMALL_OBJECT_STORE, node_ip_address=third_ip
    )
    try:
        cluster.wait_for_nodes(timeout=60)
        ids = node_ids_by_ip()
        with WorkerGroup.ray(2, ECHO, env=ENV, node_ids=[ids[HEAD_IP], ids[third_ip]], call_timeout=10) as g:
            survivor, victim = g.nodes
            assert host(victim) == third_ip
            cluster.remove_node(doomed)  # the raylet and every process on it are killed
            doomed = None
            with pytest.raises(WorkerUnavailableError, match=victim.replace(".", r"\.")):
                g.call_all("whoami")
            assert g.call_on(survivor, "whoami")["node"] == survivor
    finally:
        if doomed is not None:
            cluster.remove_node(doomed)


def test_grpo_pipeline_over_two_nodes_matches_local(cluster: Cluster) -> None:
    """Long (10-30 s): the traffic job runs on the two-node Ray cluster and again on local workers, step
    for step."""
    job = ["--steps", "2", "--prompts", "4", "--n", "4", "--mean-len", "2048", "--max-len", "8192"]
    on_ray, _ = run_pipeline_on_ray_and_locally([*job, "--rollout-workers", "2", "--train-workers", "2"])
    assert {host(n) for n in on_ray.rollout_nodes + on_ray.train_nodes} == {HEAD_IP, SECOND_IP}
    assert wait_for_free_cpus(2 * CPUS_PER_NODE) == 2 * CPUS_PER_NODE
