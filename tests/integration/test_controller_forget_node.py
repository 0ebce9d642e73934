"""`Controller.forget_node` against real workers: a worker gone for good takes its tasks out of
every partition (never contacted itself), split tasks' live shards are deleted or listed, clears
and checkpoints go on without it; the same over HTTP (`RemoteController`, the raw endpoint)."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from batch_support import remote, shards_on

from distbatch import ForgottenNode, InvalidArgumentError, ShardClient
from distbatch.batch import BatchStatus
from distbatch.controller import Controller
from distbatch.controller.remote import RemoteController
from distbatch.controller.server import ControllerServer
from distbatch.errors import ClearError, ClearInProgressError
from distbatch.ids import ShardKey
from distbatch.launch import WorkerProcess

HTTP = requests.Session()
HTTP.trust_env = False



def ids(name: str, count: int) -> list[str]:
    pre = uuid.uuid4().hex[:6]
    return [f"{pre}-{name}{i}" for i in range(count)]


@pytest.fixture
def quick() -> Iterator[ShardClient]:
    """A client that gives up on a dead worker within seconds."""
    with ShardClient(timeout=3.0, connect_timeout=1.0, retries=1) as client:
        yield client


class Layout:
    """Partition p: `on_live` (x on live), `split` (x on live, y on dead), `on_dead` (x and y on
    dead); partition q: `q_live` and `q_dead` (x); partition r: `r_live` only (never touched)."""

    def __init__(self, ctl: Any, live: str, dead: str) -> None:
        self.on_live, self.split, self.on_dead = ids("live", 3), ids("split", 2), ids("dead", 2)
        self.q_live, self.q_dead, self.r_live = ids("ql", 2), ids("qd", 2), ids("rl", 2)
        assert ctl.put("p", remote(live, self.on_live + self.split, x=torch.zeros(5, 2))) == 5
        assert ctl.put("p", remote(dead, self.on_dead, x=torch.ones(2, 2), y=torch.ones(2, 1))) == 2
        assert ctl.put("p", remote(dead, self.split, y=torch.ones(2, 1))) == 0
        assert ctl.put("q", remote(live, self.q_live, x=torch.zeros(2, 2))) == 2
        assert ctl.put("q", remote(dead, self.q_dead, x=torch.zeros(2, 2))) == 2
        assert ctl.put("r", remote(live, self.r_live, x=torch.zeros(2, 2))) == 2
        self.live, self.dead = live, dead

    def expected(self) -> ForgottenNode:
        """What forgetting `dead` loses: p's split and on_dead (index order), q's q_dead; the dead
        worker held on_dead's x and y, split's y and q_dead's x; split's x goes from live."""
        return ForgottenNode(
            node=self.dead,
            lost={"p": tuple(self.split + self.on_dead), "q": tuple(self.q_dead)},
            shards_lost=4 + 2 + 2,
            deleted=2,
        )


def task_ids_in(state: dict[str, Any], partition_id: str) -> set[str]:
    return {t for _, t in state["partitions"][partition_id]["tasks"]}


def assert_never_served(ctl: Any, layout: Layout, consumer: str) -> None:
    """A new consumer gets only the tasks that are still whole, waiting or not."""
    everything = ctl.get_meta("p", consumer, ["x"], 3)
    assert sorted(everything.task_ids) == sorted(layout.on_live)
    assert torch.equal(everything["x"], torch.zeros(3, 2))  # the data is really there
    assert ctl.get_meta("p", consumer, ["x"], 1).status is BatchStatus.EMPTY
    assert ctl.get_meta("p", f"{consumer}-xy", ["x", "y"], 1).status is BatchStatus.EMPTY
    assert ctl.get_meta("p", f"{consumer}-y", ["y"], 1, timeout=0.2).status is BatchStatus.EMPTY
    assert ctl.get_meta("q", consumer, ["x"], 1).status is BatchStatus.EMPTY  # q_live were cleared
    assert sorted(ctl.get_meta("r", consumer, ["x"], 2).task_ids) == sorted(layout.r_live)


def test_forget_node_drops_a_dead_workers_tasks_from_every_partition(
    fresh_workers: list[WorkerProcess], quick: ShardClient, tmp_path: Path
) -> None:
    live, dead = fresh_workers
    ctl = Controller(client=quick)
    layout = Layout(ctl, live.node, dead.node)
    assert len(ctl.get_meta("p", "seen", ["x"], 7)) == 7  # a consumer took every task of p
    ctl.set_custom_meta("p", {layout.on_dead[0]: {"total_lengths": 3}, layout.on_live[0]: {"k": 1}})
    dead.kill()

    # The dead worker's tasks can never be cleared: every clear needs it.
    with pytest.raises(ClearError) as info:
        ctl.clear_partition("q")
    assert list(info.value.failed) == [dead.node] and info.value.deleted == 2  # q_live went
    with pytest.raises(ClearError):
        ctl.clear_tasks("p", layout.on_dead)
    assert shards_on(quick, live.node) == 3 + 2 + 2  # on_live, split's x, r_live

    start = time.monotonic()
    result = ctl.forget_node(dead.node)
    assert time.monotonic() - start < 5
    assert result == layout.expected()
    assert result.tasks == 6 and result.to_dict()["tasks"] == 6
    assert shards_on(quick, live.node) == 3 + 2  # split's x was deleted on the live worker

    assert_never_served(ctl, layout, "fresh")
    assert ctl.consumption_status("p", "seen") == {"tasks": 3, "consumed": 3}
    assert ctl.production_status("p", ["x", "y"]) == {"tasks": 3, "produced": {"x": 3, "y": 0}, "ready": 0}
    assert ctl.get_custom_meta("p", [layout.on_dead[0], layout.on_live[0]]) == {layout.on_live[0]: {"k": 1}}

    # Checkpoints hold none of them, and nothing names the dead worker any more.
    path = ctl.save_checkpoint(tmp_path / "ctl.json")
    state = ctl.state_dict()
    assert task_ids_in(state, "p") == set(layout.on_live) and task_ids_in(state, "q") == set()
    dead_index = state["partitions"]["p"]["nodes"].index(dead.node)
    rows = [row for column in state["partitions"]["p"]["columns"].values() for row in column["rows"]]
    assert rows and all(n != dead_index for _, n, *_ in rows)
    restored = Controller(client=quick)
    restored.load_checkpoint(path)
    assert restored.state_dict() == state
    assert_never_served(restored, layout, "restored")

    # Forgetting again, or a node nobody knew, is an empty answer; a bad address is refused.
    assert ctl.forget_node(dead.node) == ForgottenNode(dead.node)
    assert ctl.forget_node("127.0.0.1:9").tasks == 0
    assert ctl.forget_node(f"http://{dead.node}/").lost == {}
    with pytest.raises(InvalidArgumentError, match="host:port"):
        ctl.forget_node("not an address")

    # The clears that failed now go through without the dead worker.
    assert ctl.clear_partition("q") == 0 and ctl.clear_partition("p") == 3
    assert ctl.partitions() == ["r"]
    assert ctl.clear_partition("r") == 2 and shards_on(quick, live.node) == 0



def test_forget_node_never_contacts_the_node(fresh_workers: list[WorkerProcess], quick: ShardClient) -> None:
    """A stopped worker (SIGSTOP) would hang any request until the client's timeout, and would
    still hold its shards afterwards: forget_node returns at once and they are all there."""
    stalled, live = fresh_workers
    ctl = Controller(client=quick)
    mine, split = ids("s", 3), ids("split", 1)
    ctl.put("p", remote(stalled.node, mine + split, x=torch.zeros(4, 1)))
    ctl.put("p", remote(live.node, split, y=torch.zeros(1, 1)))
    os.kill(stalled.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        result = ctl.forget_node(stalled.node)
        assert time.monotonic() - start < 2  # the client's timeout is 3 s
    finally:
        os.kill(stalled.pid, signal.SIGCONT)
    assert result == ForgottenNode(stalled.node, {"p": tuple(mine + split)}, shards_lost=4, deleted=1)
    assert shards_on(quick, stalled.node) == 4 and shards_on(quick, live.node) == 0
    assert ctl.production_status("p") == {"tasks": 0, "produced": {"x": 0, "y": 0}, "ready": 0}


def test_forget_node_lists_the_shards_a_live_worker_could_not_delete(
    fresh_workers: list[WorkerProcess], quick: ShardClient
) -> None:
    gone, down = fresh_workers
    ctl = Controller(client=quick)
    split = ids("split", 2)
    ctl.put("p", remote(gone.node, split, x=torch.zeros(2, 1)))
    ctl.put("p", remote(down.node, split, y=torch.zeros(2, 1), z=torch.zeros(2, 1)))
    gone.kill()
    down.kill()  # the other worker is down too: its shards of the lost tasks cannot be deleted now
    result = ctl.forget_node(gone.node)
    assert result.lost == {"p": tuple(split)} and result.shards_lost == 2 and result.deleted == 0
    assert list(result.failed) == [down.node] and result.failed[down.node]
    keys = {ShardKey(t, f) for t in split for f in ("y", "z")}
    assert set(result.undeleted[down.node]) == keys and len(result.undeleted[down.node]) == 4
    assert ForgottenNode.from_dict(result.to_dict()) == result
    # The tasks are gone all the same: nothing of them is handed out, and p clears at once.
    assert ctl.get_meta("p", "t", ["y"], 1).status is BatchStatus.EMPTY
    assert ctl.clear_partition("p") == 0 and ctl.partitions() == []


def test_a_put_to_tasks_being_forgotten_waits_for_the_deletes(
    fresh_workers: list[WorkerProcess], quick: ShardClient
) -> None:
    """While forget_node deletes a lost task's live shards, a put that adds to it is refused (as
    during a clear), so no new shard outlives the forgotten task; afterwards it is a new task."""
    gone, stalled = fresh_workers
    slow = ShardClient(timeout=30.0)
    ctl = Controller(client=slow)
    split = ids("split", 1)
    ctl.put("p", remote(gone.node, split, x=torch.zeros(1, 1)))
    ctl.put("p", remote(stalled.node, split, y=torch.zeros(1, 1)))
    late = remote(stalled.node, split, z=torch.zeros(1, 1))
    gone.kill()
    os.kill(stalled.pid, signal.SIGSTOP)  # the delete of split's y hangs until SIGCONT
    try:
        with ThreadPoolExecutor(1) as pool:
            forgetting = pool.submit(ctl.forget_node, gone.node)
            deadline = time.monotonic() + 10
            while ctl.summary()["partitions"]["p"]["clearing"] != 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert ctl.get_meta("p", "t", ["x"], 1).status is BatchStatus.EMPTY
            with pytest.raises(ClearInProgressError):
                ctl.put("p", late)
            os.kill(stalled.pid, signal.SIGCONT)
            result = forgetting.result(timeout=30)
    finally:
        os.kill(stalled.pid, signal.SIGCONT)
        slow.close()
    assert result.lost == {"p": tuple(split)} and result.deleted == 1
    assert quick.stats(stalled.node)["shards"] == 1  # `late`'s z, never registered
    assert ctl.put("p", late) == 1  # a new task now
    assert ctl.clear_partition("p") == 1


# --------------------------------------------------------------------------- over HTTP


def test_forget_node_over_http(
    fresh_workers: list[WorkerProcess],
    serve: Callable[..., ControllerServer],
    quick: ShardClient,
    tmp_path: Path,
) -> None:
    live, dead = fresh_workers
    server = serve(Controller(client=quick))
    rc = RemoteController(server.address, timeout=20)
    layout = Layout(rc, live.node, dead.node)
    dead.kill()
    with pytest.raises(ClearError):
        rc.clear_partition("q")

    result = rc.forget_node(dead.node)
    assert isinstance(result, ForgottenNode) and result == layout.expected()
    assert_never_served(rc, layout, "fresh")
    assert rc.forget_node(dead.node) == ForgottenNode(dead.node)
    with pytest.raises(InvalidArgumentError, match="host:port"):
        rc.forget_node("nope")

    # The raw endpoint: JSON in, the result's JSON out; bad bodies are 400s, not 500s.
    url = f"http://{server.address}/v1/controller/forget_node"
    raw = HTTP.post(url, json={"node": "127.0.0.1:9"}, timeout=10)
    assert raw.status_code == 200
    assert raw.json() == {
        "node": "127.0.0.1:9",
        "lost": {},
        "tasks": 0,
        "shards_lost": 0,
        "deleted": 0,
        "undeleted": {},
        "failed": {},
    }
    for body in ({}, {"node": 5}, {"node": "a b"}, {"node": ["x:1"]}, [1]):
        answer = HTTP.post(url, json=body, timeout=10)
        assert answer.status_code == 400 and answer.json()["error"] == "bad_request", body

    path = rc.save_checkpoint(tmp_path / "ctl.json")
    assert task_ids_in(rc.state_dict(), "p") == set(layout.on_live)
    restored = Controller(client=quick)
    restored.load_checkpoint(path)
    assert_never_served(restored, layout, "restored")
    assert rc.clear_partition("q") == 0 and rc.clear_partition("p") == 3 and rc.clear_partition("r") == 2
