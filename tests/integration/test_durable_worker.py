"""A durable worker (`--data-dir`) killed with SIGKILL and started again on its directory serves
every shard it had committed, byte for byte, with the generation its batch handles name."""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from distbatch import Controller, DistributedBatchMemory, ShardClient
from distbatch.errors import CapacityError, ShardNotFoundError, WorkerUnavailableError
from distbatch.launch import WorkerProcess, spawn_workers

NO_TOKEN = {"DISTBATCH_TOKEN": ""}


def _batch(n: int, seed: int) -> dict[str, list]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 200, (n,), generator=gen).tolist()
    return {
        "input_ids": [torch.randint(0, 50_000, (k,), generator=gen, dtype=torch.int32) for k in lengths],
        "reward": [torch.rand((), generator=gen) for _ in lengths],
        "uid": [f"p{i // 4}" for i in range(n)],
    }


def _moved(batch: DistributedBatchMemory, old: str, new: str, client: ShardClient) -> DistributedBatchMemory:
    """The same batch handle, its shards now on `new` (the restarted worker's address)."""
    return DistributedBatchMemory.from_json(batch.to_json().replace(json.dumps(old), json.dumps(new)), client)


def _stats(node: str) -> dict:
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
        f"http://{node}/v1/stats", timeout=10
    ) as response:
        return json.loads(response.read())


def _durable(node: str) -> dict:
    return _stats(node)["durable"]


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "write-behind"])
def test_a_killed_worker_comes_back_with_its_shards(
    start_worker: Callable[..., WorkerProcess], tmp_path: Path, sync: bool
) -> None:
    flags = ["--data-dir", str(tmp_path), *(["--sync"] if sync else [])]
    first = start_worker(*flags, env=NO_TOKEN)
    columns = _batch(300, seed=1)
    with ShardClient() as client:
        put = DistributedBatchMemory.from_dict(columns).to_remote(first.node, client)
        later = DistributedBatchMemory.from_dict(_batch(40, seed=2)).to_remote(first.node, client)
        cleared = later.to_json()
        later.clear()  # a delete: it must stay deleted
    deadline = time.monotonic() + 30
    while not sync and _durable(first.node)["pending_records"] and time.monotonic() < deadline:
        time.sleep(0.05)  # written behind: on disk a moment later
    assert _durable(first.node)["pending_records"] == 0
    first.kill()
    second = start_worker(*flags, env=NO_TOKEN)
    stats = _durable(second.node)
    assert stats is not None and stats["failed"] is None
    with ShardClient() as client:
        got = _moved(put, first.node, second.node, client).get_data()
        for name, values in columns.items():
            if name == "uid":
                assert got[name] == values
                continue
            assert len(got[name]) == len(values)
            assert all(torch.equal(g, w) for g, w in zip(got[name], values))
        with pytest.raises(ShardNotFoundError):
            _moved(DistributedBatchMemory.from_json(cleared), first.node, second.node, client).get_data()


def test_the_controller_and_old_handles_follow_a_restarted_worker(
    start_worker: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    """SIGKILL between a put and a get_meta: the restarted worker says where it was; the
    controller's `move_node` and a handle's `moved` point at it; every task comes back intact,
    none is reported lost."""
    flags = ["--data-dir", str(tmp_path / "w0"), "--sync"]
    first = start_worker(*flags, env=NO_TOKEN)
    other = start_worker(env=NO_TOKEN)  # a second worker, not durable, untouched
    columns = _batch(64, seed=3)
    with ShardClient() as client:
        controller = Controller(client=client)
        batch = DistributedBatchMemory.from_dict(columns)
        handle = DistributedBatchMemory.concat(
            [batch[:32].to_remote(first.node, client), batch[32:].to_remote(other.node, client)]
        )
        controller.put("p", handle)
        first.kill()
        second = start_worker(*flags, env=NO_TOKEN)
        assert _durable(second.node)["previous_nodes"] == [first.node]
        assert controller.move_node(first.node, second.node) == 32
        assert controller.move_node(first.node, second.node) == 0  # harmless again
        got = controller.get_meta("p", "train", list(columns), 64)
        assert len(got) == 64 and set(got.meta.nodes) == {second.node, other.node}
        data = got.get_data()
        order = [int(t.rsplit("-", 1)[-1]) for t in got.task_ids]
        assert all(torch.equal(data["input_ids"][k], columns["input_ids"][i]) for k, i in enumerate(order))
        old = handle.moved(first.node, second.node)
        assert old.meta is not None and set(old.meta.nodes) == {second.node, other.node}
        assert all(torch.equal(a, b) for a, b in zip(old.get_data()["input_ids"], columns["input_ids"]))
        assert controller.clear_partition("p") == 64 * 3  # the moved tasks are cleared where they are


def test_a_group_gives_each_worker_its_own_directory(tmp_path: Path) -> None:
    """`{rank}` in `--data-dir`: a group's workers, which share their flags, each get a directory."""
    workers = spawn_workers(2, args=["--data-dir", str(tmp_path / "w{rank}")], env=NO_TOKEN)
    try:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["w0", "w1"]
        assert (tmp_path / "w1" / "node").read_text().strip() == workers[1].node
    finally:
        for worker in workers:
            worker.stop()


def test_a_local_group_restarts_a_worker_on_its_directory(tmp_path: Path) -> None:
    """`WorkerGroup.restart(i)`: worker i again, with its flags and rank, on a new port; the
    group calls it there, and it holds what it had. A group of connected workers cannot."""
    from distbatch import WorkerGroup
    from distbatch.errors import InvalidArgumentError

    columns = _batch(20, seed=8)
    with WorkerGroup.local(
        2, args=["--data-dir", str(tmp_path / "w{rank}"), "--sync"], env=NO_TOKEN
    ) as group:
        old = group.nodes[1]
        handle = DistributedBatchMemory.from_dict(columns).to_remote(old, group.client)
        group.processes[1].kill()
        new = group.restart(1)
        assert new != old and group.nodes == [group.processes[0].node, new]
        assert group.client.health(new)["rank"] == 1
        got = handle.moved(old, new).get_data()
        assert all(torch.equal(g, w) for g, w in zip(got["input_ids"], columns["input_ids"]))
        with pytest.raises(InvalidArgumentError, match="WorkerGroup.local"):
            WorkerGroup.connect(group.nodes).restart(0)
    with WorkerGroup.local(1, env=NO_TOKEN) as solo:  # its log directory outlives the swap
        before = solo.nodes[0]
        solo.processes[0].kill(meant=True)  # a drill, not a failure
        assert solo.restart(0) != before and solo.client.health(solo.nodes[0])["rank"] == 0
        assert solo.log_dir is not None and solo.log_dir.is_dir()
        logs = solo.processes[0].logs
    assert logs is not None and not logs.failed  # every exit clean or meant: no logs kept for it


def test_a_put_killed_half_way_comes_back_whole_or_not_at_all(
    start_worker: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    """A put staged over many requests (a client's small request bound), the worker SIGKILLed
    while the parts arrive: the restarted worker holds the batch committed before, and of the
    interrupted one every task or none (never some)."""
    flags = ["--data-dir", str(tmp_path)]
    first = start_worker(*flags, env=NO_TOKEN)
    before, interrupted = _batch(50, seed=4), _batch(400, seed=5)
    with ShardClient(max_bytes_per_request=8 << 10, timeout=20) as client:
        kept = DistributedBatchMemory.from_dict(before).to_remote(first.node, client)
        failures: list[BaseException] = []
        big = DistributedBatchMemory.from_dict(interrupted)

        def put() -> None:
            try:
                big.to_remote(first.node, client)
            except BaseException as exc:  # noqa: BLE001 (reported below)
                failures.append(exc)

        thread = threading.Thread(target=put)
        thread.start()
        deadline = time.monotonic() + 20
        while not _stats(first.node)["staged_bytes"] and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.002)  # until parts of it are staged on the worker
        while _durable(first.node)["pending_records"]:
            time.sleep(0.005)  # the earlier batch on disk: what a kill may not lose
        first.kill()
        thread.join(30)
        assert failures and isinstance(failures[0], WorkerUnavailableError)
    second = start_worker(*flags, env=NO_TOKEN)
    with ShardClient() as client:
        got = (
            DistributedBatchMemory.from_json(kept.to_json(), client).moved(first.node, second.node).get_data()
        )
        assert all(torch.equal(g, w) for g, w in zip(got["input_ids"], before["input_ids"]))
    assert _stats(second.node)["tasks"] in (50, 50 + 400)


def test_a_gather_cut_by_a_kill_succeeds_against_the_restarted_worker(
    start_worker: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    flags = ["--data-dir", str(tmp_path), "--sync"]
    first = start_worker(*flags, env=NO_TOKEN)
    columns = _batch(400, seed=6)
    with ShardClient(max_bytes_per_request=8 << 10, timeout=20) as client:
        remote = DistributedBatchMemory.from_dict(columns).to_remote(first.node, client)
        text = remote.to_json()
        failures: list[BaseException] = []
        gathered = threading.Event()

        def gather() -> None:  # fresh handles (a handle keeps what it gathered), until one fails
            try:
                for _ in range(1000):
                    DistributedBatchMemory.from_json(text, client).get_data()
                    gathered.set()
            except BaseException as exc:  # noqa: BLE001 (reported below)
                failures.append(exc)

        thread = threading.Thread(target=gather)
        thread.start()
        assert gathered.wait(20)
        first.kill()  # in the middle of one of them (each is ~40 requests)
        thread.join(30)
        assert failures and isinstance(failures[0], WorkerUnavailableError)
        second = start_worker(*flags, env=NO_TOKEN)
        got = remote.moved(first.node, second.node).get_data()
        assert all(torch.equal(g, w) for g, w in zip(got["input_ids"], columns["input_ids"]))


def test_status_says_a_durable_worker_is_on_disk(
    start_worker: Callable[..., WorkerProcess], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from distbatch.cli import main

    durable = start_worker("--data-dir", str(tmp_path), "--sync", env=NO_TOKEN)
    plain = start_worker(env=NO_TOKEN)
    with ShardClient() as client:
        DistributedBatchMemory.from_dict(_batch(8, seed=7)).to_remote(durable.node, client)
    assert main(["status", durable.node, plain.node]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows[durable.node].endswith("on disk") and rows[plain.node].rstrip().endswith("-")


def _metric(node: str, name: str) -> float:
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
        f"http://{node}/metrics", timeout=10
    ) as response:
        lines = response.read().decode().splitlines()
    (value,) = [line.split()[-1] for line in lines if line.startswith(f"{name} ")]
    return float(value)


def test_a_full_durable_worker_spills_instead_of_refusing(
    start_worker: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    """Four batches of ~120 kB into a worker of 200 kB memory with a data directory: every put is
    taken, memory stays within the bound, every batch gathers intact (over HTTP and the same-host
    path), what came from disk is counted, and a restart serves it all again."""
    flags = ["--data-dir", str(tmp_path), "--max-bytes", "200000"]
    first = start_worker(*flags, env=NO_TOKEN)
    batches = [_batch(300, seed=10 + i) for i in range(4)]
    with ShardClient() as client:
        handles = [DistributedBatchMemory.from_dict(b).to_remote(first.node, client) for b in batches]
        stats = _stats(first.node)
        assert stats["memory_bytes"] <= 200_000 and stats["on_disk_bytes"] > 200_000
        assert stats["bytes"] == stats["memory_bytes"] + stats["on_disk_bytes"]
        for handle, columns in zip(handles, batches):
            got = DistributedBatchMemory.from_json(handle.to_json(), client).get_data()
            assert all(torch.equal(g, w) for g, w in zip(got["input_ids"], columns["input_ids"]))
    with ShardClient(same_host=False) as client:
        got = DistributedBatchMemory.from_json(handles[0].to_json(), client).get_data()
        assert all(torch.equal(g, w) for g, w in zip(got["input_ids"], batches[0]["input_ids"]))
    stats = _stats(first.node)
    assert stats["read_back_bytes_total"] >= stats["on_disk_bytes"] and stats["read_back_shards_total"] > 0
    assert _metric(first.node, "distbatch_on_disk_bytes") == stats["on_disk_bytes"]
    assert _metric(first.node, "distbatch_spilled_bytes_total") >= stats["on_disk_bytes"]
    first.stop()
    second = start_worker(*flags, env=NO_TOKEN)
    assert _stats(second.node)["memory_bytes"] <= 200_000
    with ShardClient() as client:
        for handle, columns in zip(handles, batches):
            got = handle.moved(first.node, second.node).get_data()
            assert all(torch.equal(g, w) for g, w in zip(got["input_ids"], columns["input_ids"]))


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB filesystem of its own (a tmpfs mounted for the test): a disk that really fills."""
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_refuses_changes_and_keeps_every_acknowledged_put(
    start_worker: Callable[..., WorkerProcess], small_disk: Path
) -> None:
    """`--sync` on a 2 MiB disk: puts are taken until a record does not fit; that put and every
    later change get 507 saying the disk refused (ENOSPC), the worker serves what it holds, and
    a worker started again on the full disk recovers exactly the acknowledged puts."""
    flags = ["--data-dir", str(small_disk), "--sync"]
    first = start_worker(*flags, env=NO_TOKEN)
    acknowledged: list[tuple[DistributedBatchMemory, dict]] = []
    with ShardClient() as client:
        with pytest.raises(CapacityError, match="could not be written") as refused:
            for i in range(60):  # ~120 kB each: the disk is full well before
                columns = _batch(300, seed=100 + i)
                acknowledged.append(
                    (DistributedBatchMemory.from_dict(columns).to_remote(first.node, client), columns)
                )
        assert "No space left on device" in str(refused.value)
        assert 5 < len(acknowledged) < 60
        with pytest.raises(CapacityError, match="cannot write"):
            DistributedBatchMemory.from_dict(_batch(4, seed=99)).to_remote(first.node, client)
        assert "No space left" in _durable(first.node)["failed"]
        handle, columns = acknowledged[-1]
        got = DistributedBatchMemory.from_json(handle.to_json(), client).get_data()
        assert all(torch.equal(g, w) for g, w in zip(got["input_ids"], columns["input_ids"]))
    assert not [
        p.name for p in (small_disk / "log").iterdir() if p.name.endswith(".tmp")
    ]  # torn file removed
    first.kill()
    second = start_worker(*flags, env=NO_TOKEN)
    assert _stats(second.node)["tasks"] == 300 * len(acknowledged)
    with ShardClient() as client:
        for handle, columns in acknowledged:
            got = (
                DistributedBatchMemory.from_json(handle.to_json(), client)
                .moved(first.node, second.node)
                .get_data()
            )
            assert all(torch.equal(g, w) for g, w in zip(got["input_ids"], columns["input_ids"]))


def test_a_worker_killed_while_it_compacts_its_log_comes_back_whole(
    start_worker: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    """30 MB kept, 60 MB put and cleared: the clear leaves the log holding three times what the
    worker does, so it compacts (writes a snapshot of the 30 MB). SIGKILL the moment the
    snapshot's hidden directory appears: the restarted worker drops the half snapshot, replays
    the log, and holds the kept batch intact and nothing of the cleared one."""
    import os
    import signal

    flags = ["--data-dir", str(tmp_path), "--sync"]  # the clear is on disk when answered
    first = start_worker(*flags, env=NO_TOKEN)
    gen = torch.Generator().manual_seed(11)
    kept = {"blob": torch.randn(120, 1 << 16, generator=gen)}  # 120 x 256 KiB
    with ShardClient() as client:
        handle = DistributedBatchMemory.from_dict(kept).to_remote(first.node, client)
        dropped = DistributedBatchMemory.from_dict({"blob": torch.randn(240, 1 << 16, generator=gen)})
        dropped = dropped.to_remote(first.node, client)
        seen: list[str] = []

        def kill_when_compacting() -> None:
            root = tmp_path / "snapshot"
            stop = time.monotonic() + 30
            while time.monotonic() < stop:
                found = [p.name for p in root.iterdir() if p.name.startswith(".")] if root.is_dir() else []
                if found:
                    os.kill(first.pid, signal.SIGKILL)
                    seen.extend(found)
                    return
                time.sleep(0.0002)

        watcher = threading.Thread(target=kill_when_compacting)
        watcher.start()
        cleared = dropped.to_json()
        dropped.clear()  # answered before the compaction it starts
        watcher.join(40)
    first.kill()
    assert seen, "the worker never began a compaction"
    assert [p.name for p in (tmp_path / "snapshot").iterdir()] == seen  # killed mid-snapshot
    second = start_worker(*flags, env=NO_TOKEN)
    assert not (tmp_path / "snapshot").exists() or not list((tmp_path / "snapshot").iterdir())
    assert _stats(second.node)["tasks"] == 120
    with ShardClient() as client:
        got = handle.moved(first.node, second.node).get_data()
        assert torch.equal(got["blob"], kept["blob"])
        with pytest.raises(ShardNotFoundError):
            DistributedBatchMemory.from_json(cleared, client).moved(first.node, second.node).get_data()


def test_a_restarted_worker_tells_a_served_controller_where_it_is(
    start_worker: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    """`--controller HOST:PORT`: a worker started again on its directory asks the served
    controller to move its tasks to the new address itself; trainers gather them from there
    with no one calling `move_node`."""
    from distbatch.controller.server import serve_controller

    columns = _batch(16, seed=12)
    controller = Controller()
    with serve_controller(controller) as server:
        flags = ["--data-dir", str(tmp_path), "--sync", "--controller", server.address]
        first = start_worker(*flags, env=NO_TOKEN)
        with ShardClient() as client:
            controller.put("p", DistributedBatchMemory.from_dict(columns).to_remote(first.node, client))
            first.kill()
            second = start_worker(*flags, env=NO_TOKEN)
            deadline = time.monotonic() + 30
            while not (_durable(second.node)["controller"] or {}).get("done") and time.monotonic() < deadline:
                time.sleep(0.02)
            notice = _durable(second.node)["controller"]
            assert notice == {
                "address": server.address,
                "moved": {first.node: 16},
                "done": True,
                "error": None,
            }
            got = controller.get_meta("p", "train", ["input_ids"], 16, timeout=5)
            assert set(got.meta.nodes) == {second.node}
            data = got.get_data()
            order = [int(t.rsplit("-", 1)[-1]) for t in got.task_ids]
            assert all(
                torch.equal(data["input_ids"][k], columns["input_ids"][i]) for k, i in enumerate(order)
            )
