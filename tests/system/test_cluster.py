"""Across simulated hosts (`simcluster`): network namespaces on a bridge, each NIC shaped to
200 Mbit/s by tbf. A worker runs in one host, a client in another; the batch crosses the bridge
at the link's rate. Skipped where this machine cannot create namespaces or tbf qdiscs (not root,
no iproute2, a container without CAP_NET_ADMIN). Traffic stays between the namespaces' addresses.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_support import REPO, STEP_TIMEOUT, cluster_env, fresh_cluster, remove_stale, run_prefix

from distbatch import ShardClient
from distbatch.launch.local import log_tail, read_first_line
from simcluster import Cluster, check, down, leftovers

RATE = "200mbit"
RATE_BITS = 200e6
BATCH_SHAPE = (1024, 2048)  # float32: 8 MiB, 64 Mibit (67.1 Mbit)
BATCH_BITS = BATCH_SHAPE[0] * BATCH_SHAPE[1] * 4 * 8

_REASON = check()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"no simulated cluster here: {_REASON}")

CLIENT = textwrap.dedent(
    """
    import json, logging, sys, time
    import torch
    logging.basicConfig(level=logging.INFO, format="client log: %(name)s %(levelname)s %(message)s")
    from distbatch import DistributedBatchMemory

    node, rows, cols = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    data = torch.randn(rows, cols, generator=torch.Generator().manual_seed(7))
    local = DistributedBatchMemory.from_dict({"x": data, "row": list(range(rows))})
    start = time.perf_counter()
    remote = local.to_remote(node)
    put_s = time.perf_counter() - start
    start = time.perf_counter()
    back = remote.to_local()
    get_s = time.perf_counter() - start
    result = {
        "status": str(remote.status),
        "equal": bool(torch.equal(back["x"], data)) and back["row"] == list(range(rows)),
        "bytes": data.numel() * data.element_size(),
        "put_s": put_s,
        "get_s": get_s,
    }
    remote.clear()
    print(json.dumps(result))
    """
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with fresh_cluster(2, RATE, "c") as made:
        yield made


@pytest.fixture(scope="module")
def cluster_worker(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A distbatch worker (a store) in host 1, bound to its cluster address; yields its node.
    It runs without DISTBATCH_HOST_ID, as a worker in a pod would: its host id is the kernel's
    (boot id and network namespace)."""
    log = tmp_path_factory.mktemp("cluster") / "worker.log"
    env = cluster_env()
    env.pop("DISTBATCH_HOST_ID", None)
    with log.open("wb") as log_file:
        process = subprocess.Popen(
            ["ip", "netns", "exec", cluster.namespace(1),
             sys.executable, "-m", "rpc_server", "--host", cluster.address(1), "--port", "0",
             "--exit-with-parent", str(os.getpid()), "--log-level", "INFO"],
            stdout=subprocess.PIPE, stderr=log_file, env=env, cwd=REPO,
        )  # fmt: skip
    try:
        node = read_first_line(process, timeout=60.0)
        assert node is not None, f"the worker did not start: {log_tail(log)}"
        assert node.startswith(cluster.address(1) + ":"), node
        yield node
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        if process.stdout is not None:
            process.stdout.close()
        print(f"worker log tail:\n{log_tail(log)}")


def test_hosts_are_separate_namespaces(cluster: Cluster) -> None:
    """Each host has its own address, DISTBATCH_HOST_ID and a tbf qdisc on its NIC."""
    for host in range(2):
        shown = cluster.run(
            host, [sys.executable, "-c", "import os; print(os.environ['DISTBATCH_HOST_ID'])"],
            capture_output=True, text=True, timeout=STEP_TIMEOUT, check=True,
        )  # fmt: skip
        assert shown.stdout.strip() == cluster.host_id(host)
        addresses = cluster.run(
            host, ["ip", "-o", "-4", "addr", "show", "dev", "eth0"],
            capture_output=True, text=True, timeout=STEP_TIMEOUT, check=True,
        )  # fmt: skip
        assert f"{cluster.address(host)}/24" in addresses.stdout
        qdisc = cluster.run(
            host, ["tc", "qdisc", "show", "dev", "eth0"],
            capture_output=True, text=True, timeout=STEP_TIMEOUT, check=True,
        )  # fmt: skip
        assert "tbf" in qdisc.stdout and "200Mbit" in qdisc.stdout, qdisc.stdout


def test_put_and_gather_across_hosts(cluster: Cluster, cluster_worker: str, tmp_path: Path) -> None:
    """A client in host 0 puts an 8 MiB batch on the worker in host 1 and gathers it back, equal;
    the put crosses a 200 Mbit/s link, so it cannot take less than the link allows."""
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    done = cluster.run(
        0, [sys.executable, str(script), cluster_worker, str(BATCH_SHAPE[0]), str(BATCH_SHAPE[1])],
        capture_output=True, text=True, timeout=STEP_TIMEOUT, env=cluster_env(), cwd=REPO,
    )  # fmt: skip
    print(f"client stderr:\n{done.stderr}")
    print(f"client stdout:\n{done.stdout}")
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["equal"] is True
    assert "is on this host" not in done.stderr  # hosts differ: no shared memory across them
    assert result["bytes"] * 8 == BATCH_BITS
    # 64 Mibit over 200 Mbit/s is 0.34 s at best; a generous lower bound, never an upper one.
    floor = 0.6 * BATCH_BITS / RATE_BITS
    assert result["put_s"] >= floor, f"put of {BATCH_BITS / 1e6:.1f} Mbit took {result['put_s']:.3f} s"
    assert result["get_s"] >= floor, f"gather of {BATCH_BITS / 1e6:.1f} Mbit took {result['get_s']:.3f} s"
    print(
        f"8 MiB across hosts at {RATE}: put {result['put_s']:.3f} s "
        f"({BATCH_BITS / result['put_s'] / 1e6:.0f} Mbit/s), gather {result['get_s']:.3f} s "
        f"({BATCH_BITS / result['get_s'] / 1e6:.0f} Mbit/s)"
    )


def test_down_leaves_nothing() -> None:
    """A cluster of its own, downed twice: no namespace or link with its prefix remains."""
    prefix = run_prefix("d")
    made = Cluster.up(1, rate=RATE, prefix=prefix)
    try:
        assert leftovers(prefix), "up made nothing"
    finally:
        made.down()
    assert down(prefix) == []  # the second time: nothing left to remove
    namespaces = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=30, check=True
    )
    links = subprocess.run(
        ["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30, check=True
    )
    assert prefix not in namespaces.stdout
    assert prefix not in links.stdout


def test_without_a_host_id_hosts_tell_each_other_apart_by_namespace(
    cluster: Cluster, cluster_worker: str, tmp_path: Path
) -> None:
    """With no DISTBATCH_HOST_ID, a client in another network namespace of the same boot knows
    the worker is not on its host (boot id and namespace differ), so it never tries the
    same-host socket it could not reach: no failed handshake, no warning, HTTP at once."""
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    env = cluster_env()
    env.pop("DISTBATCH_HOST_ID", None)
    argv = [sys.executable, str(script), cluster_worker, "64", "64"]
    done = subprocess.run(
        ["ip", "netns", "exec", cluster.namespace(0), *argv],
        capture_output=True, text=True, timeout=STEP_TIMEOUT, env=env, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["equal"] is True
    assert "handshake failed" not in done.stderr and "WARNING" not in done.stderr, done.stderr
    assert "runs on another host" in done.stderr  # said once, at INFO


STALL_CLIENT = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from distbatch import DistributedBatchMemory, ShardClient, WorkerUnavailableError

    node, stall = sys.argv[1], float(sys.argv[2])
    data = torch.randn(2048, 4096, generator=torch.Generator().manual_seed(3))  # 32 MiB
    client = ShardClient(timeout=120.0, stall_timeout=stall)
    remote = DistributedBatchMemory.from_dict({"x": data}).to_remote(node, client)
    print("put", flush=True)
    for step in sys.stdin:
        fresh = DistributedBatchMemory.from_meta(remote.meta, client)
        start = time.perf_counter()
        try:
            ok = bool(torch.equal(fresh.to_local()["x"], data))
            print(json.dumps({"ok": ok, "s": time.perf_counter() - start}), flush=True)
        except WorkerUnavailableError as exc:
            print(json.dumps({"error": str(exc), "s": time.perf_counter() - start}), flush=True)
    remote.clear()
    """
)


def test_a_link_down_mid_gather_fails_by_the_stall_timeout_and_a_retry_succeeds(
    cluster: Cluster, cluster_worker: str, tmp_path: Path
) -> None:
    """The worker's host drops off the network in the middle of a 32 MiB gather (no reset ever
    arrives): the gather fails once no byte came for the stall timeout, saying it stalled, not
    after the client's 120 s total; the link comes back, and the same gather succeeds with the
    data intact (nothing lost on the worker)."""
    script = tmp_path / "stall_client.py"
    script.write_text(STALL_CLIENT)
    stall = 2.0
    argv = [sys.executable, str(script), cluster_worker, str(stall)]
    client = subprocess.Popen(
        ["ip", "netns", "exec", cluster.namespace(0), *argv],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=cluster_env(), cwd=REPO,
    )  # fmt: skip
    assert client.stdin is not None and client.stdout is not None
    try:
        assert client.stdout.readline().strip() == "put"
        client.stdin.write("gather\n")
        client.stdin.flush()
        time.sleep(0.4)  # 32 MiB take ~1.3 s over 200 Mbit/s: cut it in the middle
        cluster.set_link(1, up=False)
        try:
            failed = json.loads(client.stdout.readline())
        finally:
            cluster.set_link(1, up=True)
        assert "stalled" in failed.get("error", ""), failed
        assert failed["s"] <= 0.4 + stall * 1.25 + 2.0, failed  # the stall timeout, not 120 s
        client.stdin.write("retry\n")
        client.stdin.flush()
        again = json.loads(client.stdout.readline())
        assert again == {"ok": True, "s": again["s"]}, again
    finally:
        if client.stdin is not None:
            client.stdin.close()
        try:
            client.wait(STEP_TIMEOUT)
        except subprocess.TimeoutExpired:
            client.kill()
            client.wait(10)


def test_the_cluster_job_bench_runs_both_modes_and_leaves_nothing(tmp_path: Path) -> None:
    """bench/cluster/job.py on 2 worker hosts, a tiny batch: both modes time a data step and a main
    job step, the link bound comes from the batch, bytes crossed the hosts' NICs, every store is
    empty after, the table and plot are written and no namespace is left."""
    from bench.cluster.job import driver_main, parse_args

    remove_stale()
    prefix = run_prefix("j")
    args = parse_args(
        ["--hosts", "2", "--rate", RATE, "--prompts", "16", "--n", "4", "--mean-len", "256",
         "--repeats", "1", "--steps", "1", "--prefix", prefix, "--out", str(tmp_path)]
    )  # fmt: skip
    try:
        (result,) = driver_main(args, progress=lambda line: None)
    finally:
        down(prefix)
    assert leftovers(prefix) == []
    assert result["hosts"] == 2 and result["shards_left"] == 0
    assert result["batch_bytes"] > 0
    for mode in ("distributed", "centralised"):
        assert result[f"data_{mode}_s"] > 0 and result[f"main_job_{mode}_s"] > 0
        assert 0 <= result[f"data_{mode}_cpu"] <= 1.5
    # Centralised, every byte crosses the controller's NIC; distributed, at most a share of it
    # crosses any one worker's.
    assert result["data_centralised_bound_s"] > result["data_distributed_bound_s"] > 0
    assert result["data_tcp_s"] > 0  # plain TCP moved the same cross-host bytes
    # Connections stay bounded by the pairs of workers (4 here), not by the batch: between
    # workers, fewer than one per ordered pair; the controller's, by its client's per-worker
    # limit (its calls, pings and kept-alive pool).
    assert 0 < result["max_worker_connections"] <= 4 * 4
    per_worker = inspect.signature(ShardClient).parameters["max_connections_per_node"].default
    assert 0 < result["max_controller_connections"] <= per_worker * 4
    controller, *workers = result["links"]
    assert controller["received"] >= result["batch_bytes"] and controller["sent"] >= result["batch_bytes"]
    assert all(w["received"] > 0 and w["sent"] > 0 for w in workers)
    saved = json.loads((tmp_path / "cluster.json").read_text())
    assert saved["results"][0]["hosts"] == 2
