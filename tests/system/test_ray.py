"""`WorkerGroup.ray`: workers as Ray actors on a real local Ray cluster (skipped without ray).

The data plane is the same HTTP one as `WorkerGroup.local`; Ray only places and stops the actors.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ray_support import (
    host,
    import_ray,
    local_ray_for_module,
    ray_workers,
    run_pipeline_on_ray_and_locally,
    wait_for_free_cpus,
)

ray = import_ray()

import torch  # noqa: E402

from distbatch import (  # noqa: E402
    CapacityError,
    DistributedBatchMemory,
    ShardClient,
    WorkerGroup,
    WorkerUnavailableError,
)

ROOT = Path(__file__).resolve().parents[2]
TESTS_DIR = Path(__file__).resolve().parents[1]
ENV = {"PYTHONPATH": str(TESTS_DIR)}
ECHO = "engines_for_tests:EchoEngine"


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Iterator[None]:
    yield from local_ray_for_module(2)


KWARGS = {"launcher": "ray", "sizes": [1, 2]}


@pytest.fixture(scope="module")
def group() -> Iterator[WorkerGroup]:
    with WorkerGroup.ray(2, ECHO, env=ENV, engine_kwargs=KWARGS) as g:
        yield g


def test_lazy_import_keeps_ray_out_of_the_core() -> None:
    code = "import distbatch, distbatch.launch.group, sys; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def is_loopback(node: str) -> bool:
    return ipaddress.ip_address(host(node)).is_loopback


def test_the_local_cluster_and_its_workers_stay_on_loopback(group: WorkerGroup) -> None:
    # Ray swaps 127.0.0.1 for the machine's external address; init_local_ray must not let it.
    assert [n["NodeManagerAddress"] for n in ray.nodes()] == [ray.util.get_node_ip_address()]
    assert ipaddress.ip_address(ray.util.get_node_ip_address()).is_loopback
    assert all(is_loopback(node) for node in group.nodes)
    actor_ips = ray.get([a.node.remote() for a in ray_workers(group).actors])
    assert actor_ips == group.nodes


def test_ray_workers_are_distinct_actors_serving_http(group: WorkerGroup) -> None:
    assert len(group) == 2 and len(set(group.nodes)) == 2
    who = group.call_all("whoami")
    assert [w["node"] for w in who] == group.nodes
    pids = ray.get([a.pid.remote() for a in ray_workers(group).actors])
    assert [w["pid"] for w in who] == pids
    assert os.getpid() not in pids


def test_ray_workers_know_rank_world_size_node_and_kwargs_in_the_constructor(group: WorkerGroup) -> None:
    assert group.call_all("identity") == [
        {"node": node, "rank": rank, "world_size": 2, "config": KWARGS}
        for rank, node in enumerate(group.nodes)
    ]


def test_ray_workers_share_one_log_directory_per_node(group: WorkerGroup) -> None:
    files = [Path(f) for f in ray.get([a.log_file.remote() for a in ray_workers(group).actors])]
    assert [f.name.split("-")[1] for f in files] == ["0", "1"]  # named by rank
    assert files[0].parent == files[1].parent  # one node: one directory for the group


def test_call_and_call_all(group: WorkerGroup) -> None:
    echoed = group.call("echo", ["a", "b"], k=1)
    assert [e["value"] for e in echoed] == ["a", "b"]
    assert [e["node"] for e in echoed] == group.nodes
    assert all(e["kwargs"] == {"k": 1} for e in echoed)
    assert [e["value"] for e in group.call_all("echo", 7)] == [7, 7]
    assert group.call_on(1, "json_value", "list") == [1, "two", 3.0, None, [4]]


def test_batches_stay_on_the_ray_workers(group: WorkerGroup) -> None:
    with ShardClient(timeout=20.0) as client:
        local = DistributedBatchMemory.from_dict(
            {"x": torch.arange(8, dtype=torch.float32)}, task_ids=[f"ray-{i}" for i in range(8)]
        )
        stored = [c.to_remote(node, client) for c, node in zip(local.chunk(2), group.nodes)]
        batch = DistributedBatchMemory.concat(stored)
        assert torch.equal(batch.to_local()["x"], torch.arange(8, dtype=torch.float32))
        # Each worker gathers its chunk's columns from wherever they live (worker -> worker).
        totals = group.call("total", list(reversed(batch.chunk(2))))
        assert totals == [sum(range(4, 8)), sum(range(4))]
        made = DistributedBatchMemory.concat(
            [group.call_on(0, "make_batch", 3, "made-a"), group.call_on(1, "make_batch", 2, "made-b")]
        )
        assert len(made) == 5 and set(made.meta.nodes) == set(group.nodes)
        assert made.to_local()["z"].tolist() == [0.0, 10.0, 20.0, 0.0, 10.0]
        made.clear()
        batch.clear()
    assert group.call_all("store_shards") == [0, 0]


@pytest.mark.parametrize("placement", ["spread", "pack"])
def test_placement_strategies_start_on_one_node(placement: str) -> None:
    with WorkerGroup.ray(2, ECHO, env=ENV, placement=placement, resources={"CPU": 0.25}) as g:
        assert len(g.call_all("whoami")) == 2
        node_ip = ray.util.get_node_ip_address()
        assert all(host(node) == node_ip for node in g.nodes)  # both on the only node


def test_unplaceable_group_fails_cleanly() -> None:
    with pytest.raises(WorkerUnavailableError, match="not placed"):
        WorkerGroup.ray(2, ECHO, env=ENV, placement="strict_spread", startup_timeout=3)
    assert wait_for_free_cpus(2.0 - 0.5) == 2.0 - 0.5  # only the module group holds CPUs


def test_store_flags_reach_the_ray_workers(tmp_path: Path) -> None:
    """Store flags, `--data-dir` (`{rank}`: the worker's rank) and `--sync` among them: the
    worker is durable, each put on disk when answered, where a restart would find it."""
    flags = [
        "--max-bytes",
        "4096",
        "--max-idle-seconds",
        "600",
        "--data-dir",
        str(tmp_path / "w{rank}"),
        "--sync",
    ]
    with WorkerGroup.ray(1, ECHO, env=ENV, args=flags) as g, ShardClient(timeout=10.0) as client:
        (node,) = g.nodes
        assert client.stats(node)["capacity"] == 4096
        assert (tmp_path / "w0" / "node").read_text().split() == [node]
        small = DistributedBatchMemory.from_dict(
            {"x": torch.zeros(16)}, task_ids=[f"fits-{i}" for i in range(16)]
        )
        small.to_remote(node, client)
        big = DistributedBatchMemory.from_dict({"x": torch.zeros(1, 2048)}, task_ids=["too-big"])
        with pytest.raises(CapacityError):
            big.to_remote(node, client)
        assert client.stats(node)["tasks"] == 16  # the refused put stored nothing
        assert (
            client.stats(node)["durable"]["durable_seq"] == 1
            and len(list((tmp_path / "w0" / "log").iterdir())) == 1
        )


def test_runtime_env_reaches_the_engine() -> None:
    runtime_env = {"env_vars": {"DISTBATCH_TEST_MARK": "from-runtime-env"}}
    with WorkerGroup.ray(1, ECHO, env=ENV, runtime_env=runtime_env) as g:
        assert g.call_on(0, "environ", "DISTBATCH_TEST_MARK") == "from-runtime-env"
        # `env` still applies: its PYTHONPATH first, then the actor's import path (as for local workers).
        assert g.call_on(0, "environ", "PYTHONPATH").split(os.pathsep)[0] == ENV["PYTHONPATH"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--host", "0.0.0.0"], "does not apply to Ray workers"),
        (["--port=0"], "does not apply to Ray workers"),
        (["--hos", "0.0.0.0"], "unknown worker flag '--hos': did you mean --host"),  # no abbreviations
        (["--max-bytes", "lots"], "'lots' is not a size"),
        (["--max-idle-seconds", "0"], "must be > 0"),
        (["--no-such-flag"], "unknown worker flag '--no-such-flag'"),
        (["--rank", "1"], "--rank is the group's to set"),
        (["--engine-kwargs", "{}"], "pass engine_kwargs= to the group"),
    ],
)
def test_bad_store_flags_are_refused_before_any_actor_starts(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WorkerGroup.ray(1, ECHO, env=ENV, args=flags)
    assert wait_for_free_cpus(2.0 - 0.5) == 2.0 - 0.5  # only the module group holds CPUs


def test_engine_that_fails_to_load_is_worker_unavailable() -> None:
    with pytest.raises(WorkerUnavailableError, match="failed to start"):
        WorkerGroup.ray(1, "engines_for_tests:NoSuchEngine", env=ENV, startup_timeout=60)


def test_shutdown_kills_actors_and_frees_the_placement_group() -> None:
    g = WorkerGroup.ray(2, ECHO, env=ENV)
    workers = ray_workers(g)
    actors, placement = list(workers.actors), workers.placement_group
    g.shutdown()
    for actor in actors:
        # ray.kill returns before the kill lands: a call sent at once may still be served (it
        # was, once, on a loaded machine). Dead means: calls fail, within a bound.
        deadline = time.monotonic() + 60
        with pytest.raises(ray.exceptions.RayActorError):
            while time.monotonic() < deadline:
                ray.get(actor.pid.remote(), timeout=30)
                time.sleep(0.2)
    from ray.util.placement_group import placement_group_table

    assert placement_group_table(placement)["state"] == "REMOVED"
    with ShardClient(timeout=2.0) as client, pytest.raises(WorkerUnavailableError):
        client.health(g.nodes[0])
    g.shutdown()  # idempotent


def test_killed_actor_surfaces_as_worker_unavailable() -> None:
    with WorkerGroup.ray(2, ECHO, env=ENV, call_timeout=10) as g:
        assert len(g.call_all("whoami")) == 2
        victim = g.nodes[1]
        ray.kill(ray_workers(g).actor(victim), no_restart=True)
        deadline = time.monotonic() + 10
        with pytest.raises(WorkerUnavailableError) as info:
            while time.monotonic() < deadline:
                g.call_on(victim, "whoami")  # the first calls may race the kill
                time.sleep(0.1)
        assert victim in str(info.value)
        with pytest.raises(WorkerUnavailableError, match=victim.replace(".", r"\.")):
            g.call_all("whoami")
        assert g.call_on(0, "whoami")["node"] == g.nodes[0]  # the other worker is unaffected


def test_grpo_pipeline_with_ray_launcher_matches_local() -> None:
    job = ["--steps", "1", "--prompts", "4", "--n", "4", "--mean-len", "4096", "--max-len", "8192"]
    on_ray, _ = run_pipeline_on_ray_and_locally([*job, "--rollout-workers", "2", "--train-workers", "2"])
    assert all(is_loopback(n) for n in on_ray.rollout_nodes + on_ray.train_nodes)
