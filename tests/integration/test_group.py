"""`WorkerGroup`: start / connect, call / call_all / call_on, shutdown, and no orphaned workers.

One engine group is shared by the module; lifecycle tests start engine-less workers (cheap).
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from engines_for_tests import ECHO, ENGINES_ENV
from process_support import children

from distbatch import DistributedBatchMemory, ShardClient, WorkerGroup, WorkerUnavailableError

ROOT = Path(__file__).resolve().parents[2]
ENV = ENGINES_ENV


# --------------------------------------------------------------------------- process helpers


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, exited but not yet reaped by its new parent, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_gone(pids: Sequence[int], timeout: float) -> list[int]:
    """Poll until every pid is gone or `timeout` passes; returns those still alive."""
    deadline = time.monotonic() + timeout
    alive = [p for p in pids if pid_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if pid_alive(p)]
    return alive


def kill_leftovers(pids: Sequence[int]) -> None:
    for pid in pids:
        if pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def read_line(process: subprocess.Popen[bytes], timeout: float) -> str:
    """The first stdout line of `process`, failing the test (not hanging) if it does not come."""
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    line = b""
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"no line from the controller within {timeout}s (got {line!r})")
            if selector.select(timeout=min(remaining, 0.5)):
                chunk = os.read(process.stdout.fileno(), 4096)
                if not chunk:
                    pytest.fail(f"controller closed stdout (rc={process.poll()}) after {line!r}")
                line += chunk
    return line.decode().strip()


def run_controller(code: str) -> tuple[subprocess.Popen[bytes], list[int]]:
    """Start a controller script that prints its workers' pids as its first line."""
    process = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        cwd=ROOT,
        env={**os.environ, **ENV},
    )
    try:
        pids = [int(p) for p in read_line(process, 60).split()]
    except BaseException:
        process.kill()
        process.wait()
        raise
    return process, pids


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def group(echo_pair: WorkerGroup) -> WorkerGroup:
    return echo_pair


# --------------------------------------------------------------------------- calls


def test_local_starts_distinct_workers(group: WorkerGroup, module_client: ShardClient) -> None:
    assert len(group) == 2
    assert len(set(group.nodes)) == 2
    assert [p.node for p in group.processes] == group.nodes
    assert len({p.pid for p in group.processes}) == 2
    for process in group.processes:
        assert process.alive() and pid_alive(process.pid)
        assert process.node.startswith("127.0.0.1:")
    for rank, node in enumerate(group.nodes):
        assert module_client.health(node) == {
            "status": "ok",
            "node": node,
            "engine": "EchoEngine",
            "rank": rank,
            "world_size": 2,
        }
    assert [w["pid"] for w in group.call_all("whoami")] == [p.pid for p in group.processes]
    assert repr(group) == f"WorkerGroup({group.nodes})"


def test_call_sends_chunk_i_to_worker_i(group: WorkerGroup) -> None:
    results = group.call("echo", ["first", {"second": 2}], extra=[1, 2])
    assert results == [
        {"node": group.nodes[0], "value": "first", "kwargs": {"extra": [1, 2]}},
        {"node": group.nodes[1], "value": {"second": 2}, "kwargs": {"extra": [1, 2]}},
    ]


def test_call_runs_workers_concurrently(group: WorkerGroup) -> None:
    started = time.monotonic()
    runs = group.call("slow", [1.0, 1.0])
    elapsed = time.monotonic() - started
    assert elapsed < 1.9, f"two 1 s calls on two workers took {elapsed:.2f}s"
    assert max(r["start"] for r in runs) < min(r["end"] for r in runs)  # they overlapped


def test_call_with_wrong_chunk_count_is_value_error(group: WorkerGroup, module_client: ShardClient) -> None:
    before = module_client.traffic()
    for chunks in ([], ["one"], ["a", "b", "c"]):
        with pytest.raises(ValueError, match="chunks for 2 workers"):
            group.call("echo", chunks)
    assert (module_client.traffic() - before).requests == 0


def test_call_with_batch_chunks_keeps_results_on_each_worker(
    group: WorkerGroup, module_client: ShardClient
) -> None:
    data = DistributedBatchMemory.from_dict({"x": torch.arange(6, dtype=torch.float32)})
    remote = data.to_remote(group.nodes[0], module_client)
    chunks = remote.chunk(2)
    results = group.call("columns", chunks, scale=10.0)
    try:
        for node, chunk, result in zip(group.nodes, chunks, results):
            assert result.task_ids == chunk.task_ids
            assert result.meta.nodes == [node]
        merged = DistributedBatchMemory.concat(results)
        assert merged.task_ids == remote.task_ids
        torch.testing.assert_close(merged["y"], torch.arange(6, dtype=torch.float32) * 10)
    finally:
        for result in results:
            result.clear()
        remote.clear()


def test_call_all_and_call_on(group: WorkerGroup) -> None:
    assert [r["node"] for r in group.call_all("whoami")] == group.nodes
    assert group.call_all("echo", 7, k="v") == [
        {"node": node, "value": 7, "kwargs": {"k": "v"}} for node in group.nodes
    ]
    assert group.call_on(1, "whoami")["node"] == group.nodes[1]
    assert group.call_on(group.nodes[0], "echo", "x")["node"] == group.nodes[0]
    assert group.call_on(f"http://{group.nodes[1]}", "whoami")["node"] == group.nodes[1]
    assert group.call_on(-1, "whoami")["node"] == group.nodes[-1]
    with pytest.raises(ValueError, match="not in this group"):
        group.call_on("127.0.0.1:1", "whoami")
    with pytest.raises(IndexError):
        group.call_on(5, "whoami")


def test_stats_in_worker_order(group: WorkerGroup) -> None:
    stats = group.stats()
    assert [s["node"] for s in stats] == group.nodes
    assert all({"shards", "tasks", "bytes"} <= set(s) for s in stats)


def test_connect_to_running_workers(group: WorkerGroup, module_client: ShardClient) -> None:
    connected = WorkerGroup.connect(group.nodes, client=module_client)
    assert connected.nodes == group.nodes and connected.processes == []
    assert [r["node"] for r in connected.call_all("whoami")] == group.nodes
    assert connected.call("echo", ["a", "b"])[1]["value"] == "b"
    connected.shutdown()  # a connected group leaves the workers running
    for node in group.nodes:
        assert module_client.health(node)["status"] == "ok"
    assert all(p.alive() for p in group.processes)
    with WorkerGroup.connect(list(reversed(group.nodes)), client=module_client) as reversed_group:
        assert [r["node"] for r in reversed_group.call_all("whoami")] == list(reversed(group.nodes))
    assert all(p.alive() for p in group.processes)


def test_connect_to_nothing_fails() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again at once: nothing listens there
    with ShardClient(timeout=5.0, retries=1) as quick:
        with pytest.raises(WorkerUnavailableError) as info:
            WorkerGroup.connect([f"127.0.0.1:{port}"], client=quick)
    assert info.value.node == f"127.0.0.1:{port}"
    with pytest.raises(ValueError):
        WorkerGroup.connect([])
    with pytest.raises(ValueError):
        WorkerGroup.connect(["no port here"])


# --------------------------------------------------------------------------- lifecycle


def test_shutdown_stops_every_process() -> None:
    group = WorkerGroup.local(2)
    try:
        pids = [p.pid for p in group.processes]
        assert all(pid_alive(p) for p in pids)
        assert [s["node"] for s in group.stats()] == group.nodes
    finally:
        group.shutdown()
    assert all(not p.alive() for p in group.processes)
    assert wait_gone(pids, 1.0) == []
    group.shutdown()  # idempotent


def test_context_manager_exit_stops_processes() -> None:
    with WorkerGroup.local(2) as group:
        pids = [p.pid for p in group.processes]
        assert all(pid_alive(p) for p in pids)
    assert all(not p.alive() for p in group.processes)
    assert wait_gone(pids, 1.0) == []


def test_exception_inside_with_block_stops_processes() -> None:
    pids: list[int] = []
    with pytest.raises(RuntimeError, match="inside the block"):
        with WorkerGroup.local(2) as group:
            pids = [p.pid for p in group.processes]
            raise RuntimeError("inside the block")
    assert len(pids) == 2
    assert wait_gone(pids, 1.0) == []


def test_failed_start_leaves_no_process() -> None:
    before = children(zombies=False)
    with pytest.raises(WorkerUnavailableError, match="no GPU for this rank"):
        WorkerGroup.local(2, "engines_for_tests:BrokenEngine", env=ENGINES_ENV)
    assert wait_gone(sorted(children(zombies=False) - before), 2.0) == []
    with pytest.raises(ValueError, match="bad worker flag"):  # refused before anything starts
        WorkerGroup.local(2, args=["--port", "not-a-port"])
    assert children(zombies=False) == before


CONTROLLER_SLEEPS = """
    import time
    from distbatch import WorkerGroup

    group = WorkerGroup.local(2)
    print(" ".join(str(p.pid) for p in group.processes), flush=True)
    time.sleep(120)
"""


def test_workers_exit_when_the_controller_is_killed() -> None:
    controller, pids = run_controller(CONTROLLER_SLEEPS)
    try:
        assert len(pids) == 2 and all(pid_alive(p) for p in pids)
        controller.send_signal(signal.SIGKILL)
        controller.wait(timeout=10)
        left = wait_gone(pids, 5.0)
        assert left == [], f"workers {left} outlived their SIGKILLed controller"
    finally:
        controller.kill()
        controller.wait()
        kill_leftovers(pids)


CONTROLLER_RAISES = """
    from distbatch import WorkerGroup
    from distbatch.launch import spawn_workers

    watched = WorkerGroup.local(1)
    # a worker that does not watch its parent: only the group's finalizer can stop this one
    processes = spawn_workers(1, exit_with_parent=False)
    unwatched = WorkerGroup([p.node for p in processes], processes=processes)
    print(" ".join(str(p.pid) for p in [*watched.processes, *processes]), flush=True)
    raise RuntimeError("controller failed")
"""


def test_controller_exception_leaves_no_worker() -> None:
    controller, pids = run_controller(CONTROLLER_RAISES)
    try:
        assert controller.wait(timeout=30) == 1
        left = wait_gone(pids, 3.0)
        assert left == [], f"workers {left} outlived their controller"
    finally:
        controller.kill()
        controller.wait()
        kill_leftovers(pids)


def test_a_long_engine_call_does_not_hold_up_data_to_the_same_worker() -> None:
    # One data connection per node: an engine call that takes seconds must not occupy it, or
    # every put and fetch to that worker would queue behind the training step.
    from concurrent.futures import ThreadPoolExecutor

    with ShardClient(max_connections_per_node=1, timeout=30) as module_client:
        with (
            WorkerGroup.local(1, ECHO, env=ENV, client=module_client) as group,
            ThreadPoolExecutor(1) as pool,
        ):
            (node,) = group.nodes
            running = pool.submit(group.call_on, 0, "slow", 3.0)
            time.sleep(0.3)  # the call is on the wire
            batch = DistributedBatchMemory.from_dict({"x": torch.arange(4.0)}, task_ids=list("abcd"))
            stored = batch.to_remote(node, module_client)
            assert torch.equal(stored.to_local()["x"], torch.arange(4.0))
            assert stored.clear() == 4
            assert not running.done()  # the data went through while the engine call still ran
            assert running.result(timeout=30)["end"] > 0
