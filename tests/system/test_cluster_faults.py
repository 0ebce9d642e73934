"""Faults across simulated hosts (`simcluster`, issue 25 point 4): a host's cable is pulled
(`Cluster.set_link(host, up=False)`: no reset ever reaches anyone, packets just vanish) in the
middle of a put, of an engine call, while loaders wait in the controller's `get_meta`, or for
good under a worker whose data the controller's partitions name.

A put or an engine call cut off fails by its progress or liveness watchdog (a few seconds,
passed as parameters), never by a total deadline, nothing of it stored, and the same call
succeeds once the link is back (a slow put that keeps moving is never cut); loaders whose
controller is cut off lose no task and go on by themselves; a worker's host gone for good is
forgotten by the controller, every partition left consistent. Clients run in one host as scripts
spoken to by lines (`cluster_support.HostScript`); every process, link and namespace is restored
or removed by the fixtures. Skipped where this machine cannot create namespaces or tbf qdiscs,
like tests/system/test_cluster.py.
"""

from __future__ import annotations

import textwrap
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from cluster_support import HostScript, HostWorker, cluster_env, fresh_cluster

from simcluster import Cluster, check

RATE = "200mbit"
SLOW_RATE = "20mbit"
SLOW_RATE_BITS = 20e6
STALL = 2.0  # the clients' stall timeout, seconds
LIVENESS = 3.0  # the engine calls' liveness timeout, seconds
SLACK = 2.0  # seconds for a process to notice and report, on a loaded 2-core machine
OUTAGE = 4.0  # seconds the controller's host is cut off
MIB = 1 << 20
CLIENT, WORKER, OTHER = 0, 1, 2  # the hosts: the client's, a worker's, a third one

_REASON = check()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"no simulated cluster here: {_REASON}")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Three hosts at 200 Mbit/s; each test finds every link up (the fixture below restores them)."""
    with fresh_cluster(3, RATE, "f") as made:
        yield made


@pytest.fixture
def links_restored(cluster: Cluster) -> Iterator[Cluster]:
    """The module's cluster; every host's link is up again after the test, whatever it did."""
    yield cluster
    for host in range(cluster.hosts):
        cluster.set_link(host, up=True)


Start = Callable[..., HostWorker]
Run = Callable[..., HostScript]


@pytest.fixture
def on_hosts(tmp_path: Path) -> Iterator[tuple[Start, Run]]:
    """Factories: `worker(cluster, host, *flags, pythonpath=())` starts a worker in a host;
    `script(cluster, host, source, *args)` runs a script there. All stopped at teardown (scripts
    first), their logs' tails printed (pytest shows them for a failed test). Request it after
    the cluster fixture, so it is torn down before the cluster."""
    workers: list[HostWorker] = []
    scripts: list[HostScript] = []

    def worker(cluster: Cluster, host: int, *flags: str, pythonpath: Sequence[Path] = ()) -> HostWorker:
        log = tmp_path / f"worker-{host}-{len(workers)}.log"
        started = HostWorker(cluster, host, log, flags, env=cluster_env(pythonpath))
        workers.append(started)
        return started

    def script(cluster: Cluster, host: int, source: str, *args: str) -> HostScript:
        path = tmp_path / f"script-{len(scripts)}.py"
        path.write_text(source)
        log = tmp_path / f"script-{len(scripts)}.log"
        started = HostScript(cluster, host, path, args, log, cluster_env())
        scripts.append(started)
        return started

    yield worker, script
    for process in [*scripts, *workers]:
        process.stop()
        print(f"--- {process.log.name}:\n{process.log.read_text(errors='replace')[-4000:]}")


def _wait_for_bytes(cluster: Cluster, host: int, at_least: int, timeout: float = 30.0) -> None:
    """Return once host `host`'s NIC has received `at_least` bytes (a transfer is under way)."""
    deadline = time.monotonic() + timeout
    while cluster.link_stats(host)["received"] < at_least:
        assert time.monotonic() < deadline, f"host {host} did not receive {at_least} bytes in {timeout} s"
        time.sleep(0.02)


# --------------------------------------------------------------------------- 1: a put


PUT_CLIENT = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from distbatch import DistributedBatchMemory, ShardClient

    node, stall, max_bytes, nbytes = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    rows = nbytes // (4096 * 4)
    data = torch.randn(rows, 4096, generator=torch.Generator().manual_seed(5))
    ids = [f"up-{i}" for i in range(rows)]
    client = ShardClient(timeout=120.0, stall_timeout=stall, max_bytes_per_request=max_bytes)
    remote = None
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command, start, answer = line.strip(), time.perf_counter(), {}
        try:
            if command == "put":
                remote = DistributedBatchMemory.from_dict({"x": data}, task_ids=ids).to_remote(node, client)
            elif command == "get":
                answer["equal"] = bool(torch.equal(remote.to_local()["x"], data))
            elif command == "stats":
                answer["stats"] = client.stats(node)
                answer["tasks"] = client.list_tasks(node)["tasks"]
            elif command == "clear":
                remote.clear()
        except Exception as exc:
            answer.update(error=str(exc), type=type(exc).__name__)
        answer["s"] = time.perf_counter() - start
        print(json.dumps(answer), flush=True)
    """
)
PUT_BYTES = 32 * MIB  # 1.3 s over 200 Mbit/s


def _stored(script: HostScript) -> dict[str, int]:
    """What the worker holds, by its stats: shards, tasks, bytes and bytes staged for a put."""
    answer = script.ask("stats")
    assert "error" not in answer, answer
    stats = answer["stats"]
    return {key: stats[key] for key in ("shards", "tasks", "bytes", "staged_bytes")} | {
        "listed": len(answer["tasks"])
    }


EMPTY = {"shards": 0, "tasks": 0, "bytes": 0, "staged_bytes": 0, "listed": 0}


@pytest.mark.parametrize("parts", [1, 4, 32], ids=["one-request", "staged-parts", "more-parts-than-slots"])
def test_a_link_down_mid_put_fails_by_the_stall_timeout_and_stores_nothing(
    links_restored: Cluster, on_hosts: tuple[Start, Run], parts: int
) -> None:
    """A 32 MiB put from host 0 to a worker in host 1 (one request, or parts staged and then
    committed: 4 sent at once, or 32 of 1 MiB, far more than the client's 8 connections to a worker,
    each small enough to sit whole in the kernel's send queue when the link goes down); host 1's
    cable is pulled once a quarter is through. The put fails with
    `WorkerUnavailableError` naming the worker and saying it stalled, within the stall timeout
    (not the client's 120 s); the worker holds nothing of it (no shard, nothing staged) once the
    link is back; the same put then succeeds and reads back equal."""
    cluster = links_restored
    start_worker, run_script = on_hosts
    worker = start_worker(cluster, WORKER)
    client = run_script(cluster, CLIENT, PUT_CLIENT, worker.node, str(STALL), str(PUT_BYTES // parts),
                        str(PUT_BYTES))  # fmt: skip
    assert client.answer() == {"ready": True}
    assert _stored(client) == EMPTY
    received = cluster.link_stats(WORKER)["received"]
    client.send("put")
    _wait_for_bytes(cluster, WORKER, received + PUT_BYTES // 4)
    cut = time.monotonic()
    cluster.set_link(WORKER, up=False)
    try:
        failed = client.answer(timeout=STALL * 4 + 30)
        noticed = time.monotonic() - cut
    finally:
        cluster.set_link(WORKER, up=True)
    print(
        f"put cut mid-upload ({parts} part(s)): failed in {failed['s']:.2f} s, {noticed:.2f} s after the cut"
    )
    print(f"  {failed.get('type')}: {failed.get('error')}")
    assert failed.get("type") == "WorkerUnavailableError", failed
    assert "stalled" in failed["error"] and worker.node in failed["error"], failed
    assert noticed <= STALL * 1.25 + SLACK, failed  # the stall timeout, not the client's 120 s

    # Nothing of it on the worker: no shard stored, nothing left staged.
    deadline = time.monotonic() + STALL * 2 + SLACK
    while (stored := _stored(client)) != EMPTY and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stored == EMPTY

    again = client.ask("put")
    assert "error" not in again, again
    assert client.ask("get").get("equal") is True
    assert _stored(client)["shards"] == PUT_BYTES // (4096 * 4)
    assert "error" not in client.ask("clear")
    assert _stored(client) == EMPTY


@pytest.fixture
def slow_cluster() -> Iterator[Cluster]:
    """Two hosts whose NICs run at 20 Mbit/s."""
    with fresh_cluster(2, SLOW_RATE, "s") as made:
        yield made


@pytest.mark.parametrize("parts", [1, 4], ids=["one-request", "staged-parts"])
def test_a_slow_put_that_keeps_moving_is_never_cut(
    slow_cluster: Cluster, on_hosts: tuple[Start, Run], parts: int
) -> None:
    """Over a 20 Mbit/s link a 16 MiB put takes about 6.7 s, past the 2 s stall timeout (the
    parts of a staged put share the link, each moving slower still): it moves all along, so it
    succeeds, and so does the gather back. (A stall timeout of 1 s was too short for a shaped
    link on a loaded machine: a flow that loses segments waits out TCP's retransmission backoff,
    0.2 + 0.4 + 0.8 s, without a byte.)"""
    start_worker, run_script = on_hosts
    stall, nbytes = STALL, 16 * MIB
    worker = start_worker(slow_cluster, WORKER)
    client = run_script(slow_cluster, CLIENT, PUT_CLIENT, worker.node, str(stall), str(nbytes // parts),
                        str(nbytes))  # fmt: skip
    assert client.answer() == {"ready": True}
    put = client.ask("put")
    get = client.ask("get")
    print(
        f"{nbytes >> 20} MiB at {SLOW_RATE} ({parts} part(s)): put {put['s']:.2f} s, gather {get['s']:.2f} s"
    )
    assert "error" not in put, put
    assert get.get("equal") is True, get
    floor = 0.8 * nbytes * 8 / SLOW_RATE_BITS
    assert put["s"] >= max(floor, 2 * stall) and get["s"] >= max(floor, 2 * stall), (put, get)
    assert "error" not in client.ask("clear")


# --------------------------------------------------------------------------- 2: an engine call


NAPPER = textwrap.dedent(
    """
    import time

    class Napper:
        \"\"\"An engine whose calls take as long as they are told.\"\"\"

        def __init__(self, context=None):
            self.context = context

        def nap(self, seconds):
            time.sleep(seconds)
            return {"slept": seconds}
    """
)

ENGINE_CLIENT = textwrap.dedent(
    """
    import json, sys, time
    from distbatch import ShardClient, WorkerGroup

    node, liveness = sys.argv[1], float(sys.argv[2])
    client = ShardClient(timeout=60.0, connect_timeout=2.0)
    group = WorkerGroup.connect(
        [node], engine="xhost_napper:Napper", client=client, liveness_timeout=liveness
    )
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        start, answer = time.perf_counter(), {}
        try:
            answer["result"] = group.call_on(0, "nap", float(line))
        except Exception as exc:
            answer.update(error=str(exc), type=type(exc).__name__)
        answer["s"] = time.perf_counter() - start
        print(json.dumps(answer), flush=True)
    """
)


def test_a_link_down_mid_engine_call_fails_by_the_liveness_timeout_and_a_new_call_succeeds(
    links_restored: Cluster, on_hosts: tuple[Start, Run], tmp_path: Path
) -> None:
    """A group connected from host 0 to a worker in host 1 (started with --accept-engine; the
    engine module is on the worker's import path) calls a 5 s method; host 1's cable is pulled
    1 s in. The call fails with `WorkerUnavailableError` naming the worker, saying it stopped
    answering, within the liveness timeout (no hang); the link comes back and a new call succeeds."""
    cluster = links_restored
    start_worker, run_script = on_hosts
    engines = tmp_path / "engines"
    engines.mkdir()
    (engines / "xhost_napper.py").write_text(NAPPER)
    worker = start_worker(cluster, WORKER, "--accept-engine", pythonpath=[engines])
    client = run_script(cluster, CLIENT, ENGINE_CLIENT, worker.node, str(LIVENESS))
    assert client.answer() == {"ready": True}
    assert client.ask("0.1")["result"] == {"slept": 0.1}

    client.send("5")
    time.sleep(1.0)
    cut = time.monotonic()
    cluster.set_link(WORKER, up=False)
    try:
        failed = client.answer(timeout=LIVENESS * 4 + 30)
        noticed = time.monotonic() - cut
    finally:
        cluster.set_link(WORKER, up=True)
    print(f"engine call cut 1 s in: failed in {failed['s']:.2f} s, {noticed:.2f} s after the cut")
    assert failed.get("type") == "WorkerUnavailableError", failed
    assert worker.node in failed["error"] and "stopped answering" in failed["error"], failed
    assert noticed <= LIVENESS * 1.25 + SLACK, failed

    again = client.ask("0.2")
    print(f"the next call: {again['s']:.2f} s")
    assert again.get("result") == {"slept": 0.2}, again


# --------------------------------------------------------------------------- 3: the controller's host


CONTROLLER = textwrap.dedent(
    """
    import json, sys
    from distbatch.controller import Controller
    from distbatch.controller.server import serve_controller
    from distbatch.samplers import SequentialSampler

    server = serve_controller(Controller(SequentialSampler()), host=sys.argv[1], port=0)
    print(json.dumps({"address": server.address}), flush=True)
    sys.stdin.read()  # until the test closes stdin
    server.shutdown()
    """
)

LOADERS = textwrap.dedent(
    """
    import json, sys, threading, time, uuid
    import torch
    from distbatch import DistributedBatchMemory, ShardClient, WorkerUnavailableError
    from distbatch.batch import BatchStatus
    from distbatch.controller.remote import RemoteController

    controller, node = sys.argv[1], sys.argv[2]
    PUTS, PER_PUT, GROUPS, RANKS, RUN_LIMIT = 12, 2, ("train", "ref"), 2, 90.0
    client = ShardClient(timeout=10.0, connect_timeout=1.0)
    # 2 s per call (plus its 1 s wait): shorter than the outage, so calls fail and are asked again.
    rc = RemoteController(controller, client=client, timeout=2.0)
    ids = [f"t{i}" for i in range(PUTS * PER_PUT)]
    lock = threading.Lock()
    produced, delivered, errors, wrong = [], {g: [] for g in GROUPS}, [], []
    began = time.time()

    def produce():
        for k in range(PUTS):
            chunk = ids[k * PER_PUT : (k + 1) * PER_PUT]
            x = torch.arange(k * PER_PUT, (k + 1) * PER_PUT)[:, None]
            batch = DistributedBatchMemory.from_dict({"x": x}, task_ids=chunk).to_remote(node, client)
            while True:
                try:
                    rc.put("p", batch)
                    break
                except WorkerUnavailableError as exc:  # the controller unreachable: record it again
                    with lock:
                        errors.append([time.time(), "producer", type(exc).__name__, str(exc)])
                    time.sleep(0.2)
            with lock:
                produced.extend(chunk)
            if k == PUTS // 3:
                print(json.dumps({"producing": len(produced)}), flush=True)
            time.sleep(0.3)

    def consume(group, rank):
        request_id = uuid.uuid4().hex
        while time.time() - began < RUN_LIMIT:
            with lock:
                if {task_id for _, task_id in delivered[group]} >= set(ids):
                    return
            try:
                batch = rc.get_meta("p", group, ["x"], PER_PUT, timeout=1.0, request_id=request_id)
            except WorkerUnavailableError as exc:  # as documented: ask again with the same request id
                with lock:
                    errors.append([time.time(), f"{group}{rank}", type(exc).__name__, str(exc)])
                time.sleep(0.2)
                continue
            if batch.status is BatchStatus.EMPTY:
                continue
            x = batch.to_local()["x"]
            with lock:
                wrong.extend(t for t, v in zip(batch.task_ids, x.tolist()) if ids.index(t) != v[0])
                delivered[group].extend([time.time(), t] for t in batch.task_ids)
            request_id = uuid.uuid4().hex

    def guarded(target, *args):
        try:
            target(*args)
        except BaseException as exc:  # a thread that dies is a failure the test reports
            with lock:
                crashed.append(f"{target.__name__}{args}: {type(exc).__name__}: {exc}")
            raise

    crashed = []
    threads = [threading.Thread(target=guarded, args=(produce,))]
    threads += [threading.Thread(target=guarded, args=(consume, g, r)) for g in GROUPS for r in range(RANKS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(RUN_LIMIT + 30)
    status = {g: rc.consumption_status("p", g) for g in GROUPS}
    print(json.dumps({
        "ids": ids, "produced": produced, "delivered": delivered, "errors": errors, "wrong": wrong,
        "hung": sum(t.is_alive() for t in threads), "crashed": crashed, "status": status,
        "began": began, "ended": time.time(),
    }), flush=True)
    """
)


def test_a_controller_cut_off_while_loaders_wait_loses_no_task(
    links_restored: Cluster, on_hosts: tuple[Start, Run]
) -> None:
    """A served controller in host 2; in host 0 a producer puts 24 tasks (their data on a worker
    in host 1) while two consumer groups of two ranks each long-poll `get_meta`. A third of the
    way in, host 2's cable is pulled for 4 s, longer than a `get_meta` call may take, so the
    calls fail (`WorkerUnavailableError` naming the controller) and are asked again with the same
    request id, as documented. Every task is delivered to each group (at least
    once) with its data intact, every thread ends by itself, and soon after the link is back."""
    cluster = links_restored
    start_worker, run_script = on_hosts
    worker = start_worker(cluster, WORKER)
    controller = run_script(cluster, OTHER, CONTROLLER, cluster.address(OTHER))
    address = controller.answer()["address"]
    loaders = run_script(cluster, CLIENT, LOADERS, address, worker.node)
    assert loaders.answer()["producing"] > 0
    cluster.set_link(OTHER, up=False)
    down_at = time.time()
    time.sleep(OUTAGE)
    cluster.set_link(OTHER, up=True)
    up_at = time.time()
    run = loaders.answer(timeout=150)
    errors = run.pop("errors")
    print(f"controller cut off {down_at - run['began']:.2f} s to {up_at - run['began']:.2f} s; "
          f"run ended at {run['ended'] - run['began']:.2f} s; {len(errors)} error(s) seen:")  # fmt: skip
    for at, who, kind, message in errors:
        print(f"  {at - run['began']:6.2f} s {who}: {kind}: {message}")
    ids = run["ids"]
    assert run["hung"] == 0 and run["crashed"] == [] and run["wrong"] == []
    assert sorted(run["produced"]) == sorted(ids)
    for group, got in run["delivered"].items():
        counts = Counter(task_id for _, task_id in got)
        print(f"  {group}: {len(counts)} tasks, {sum(counts.values()) - len(counts)} delivered twice")
        assert set(counts) == set(ids), group  # none lost
        assert run["status"][group] == {"tasks": len(ids), "consumed": len(ids)}
        assert max(at for at, _ in got) > up_at  # the outage was mid-run: deliveries resumed after it
    assert all(address in message for _, _, _, message in errors), errors
    assert run["ended"] - up_at < 20  # recovered by themselves, soon
    controller.stop()


# --------------------------------------------------------------------------- 4: a worker's host gone


FORGET = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from distbatch import DistributedBatchMemory, ShardClient
    from distbatch.batch import BatchStatus
    from distbatch.controller import Controller
    from distbatch.errors import ClearError

    live, dead = sys.argv[1], sys.argv[2]
    client = ShardClient(timeout=3.0, connect_timeout=1.0, retries=1, stall_timeout=2.0)
    ctl = Controller(client=client)

    def remote(node, task_ids, **columns):
        return DistributedBatchMemory.from_dict(columns, task_ids=task_ids).to_remote(node, client)

    def numbered(task_ids, first):
        return torch.arange(first, first + len(task_ids), dtype=torch.float32)[:, None]

    on_live, split, on_dead = ["l0", "l1", "l2"], ["s0", "s1"], ["d0", "d1"]
    q_live, q_dead = ["ql0", "ql1"], ["qd0", "qd1"]
    ctl.put("p", remote(live, on_live + split, x=numbered(on_live + split, 0)))
    ctl.put("p", remote(dead, on_dead, x=numbered(on_dead, 5), y=numbered(on_dead, 5)))
    ctl.put("p", remote(dead, split, y=numbered(split, 3)))
    ctl.put("q", remote(live, q_live, x=numbered(q_live, 0)))
    ctl.put("q", remote(dead, q_dead, x=numbered(q_dead, 2)))
    seen = ctl.get_meta("p", "seen", ["x"], 7)
    print(json.dumps({"ready": len(seen)}), flush=True)
    sys.stdin.readline()  # the test pulled the dead host's cable

    out = {}
    start = time.perf_counter()
    try:
        ctl.get_meta("p", "probe", ["x", "y"], 4).to_local()
    except Exception as exc:
        out["gather"] = [type(exc).__name__, str(exc), time.perf_counter() - start]
    start = time.perf_counter()
    try:
        ctl.clear_partition("q")
    except ClearError as exc:
        out["clear"] = [list(exc.failed), exc.deleted, time.perf_counter() - start]
    start = time.perf_counter()
    out["forgotten"] = ctl.forget_node(dead).to_dict()
    out["forget_s"] = time.perf_counter() - start
    fresh = ctl.get_meta("p", "fresh", ["x"], 3)
    out["fresh"] = fresh.task_ids
    out["fresh_x"] = fresh.to_local()["x"][:, 0].tolist()
    out["fresh_more"] = str(ctl.get_meta("p", "fresh", ["x"], 1).status)
    out["fresh_y"] = str(ctl.get_meta("p", "fresh-y", ["y"], 1, timeout=0.2).status)
    out["q"] = str(ctl.get_meta("q", "fresh", ["x"], 1).status)
    out["production"] = ctl.production_status("p", ["x", "y"])
    out["seen"] = ctl.consumption_status("p", "seen")
    state = ctl.state_dict()["partitions"]
    out["state_nodes"] = {pid: part["nodes"] for pid, part in state.items()}
    out["state_rows"] = {
        pid: sorted({part["nodes"][row[1]] for column in part["columns"].values() for row in column["rows"]})
        for pid, part in state.items()
    }
    out["live_stats"] = client.stats(live)["shards"]
    start = time.perf_counter()
    out["cleared"] = ctl.clear_partition("p")
    out["clear_s"] = time.perf_counter() - start
    out["partitions"] = ctl.partitions()
    out["live_after"] = client.stats(live)["shards"]
    print(json.dumps(out), flush=True)
    """
)


def test_a_workers_host_gone_for_good_is_forgotten_and_every_partition_stays_consistent(
    links_restored: Cluster, on_hosts: tuple[Start, Run]
) -> None:
    """A controller in host 0 has partitions over a worker in host 1 and one in host 2: p holds
    tasks on host 1, tasks on host 2, and tasks split across both; q holds some on each. Host 2's
    cable is pulled for good. A gather of its tasks fails by the stall or connect timeout and a
    clear by the client's, both naming it; `forget_node` (never contacting it) returns at once
    with exactly the tasks that had a shard there as lost, deletes the split tasks' shards on host
    1; what is left is deliverable, its data gathered from host 1, and clears need host 2 no more."""
    cluster = links_restored
    start_worker, run_script = on_hosts
    live = start_worker(cluster, WORKER)
    dead = start_worker(cluster, OTHER)
    script = run_script(cluster, CLIENT, FORGET, live.node, dead.node)
    assert script.answer() == {"ready": 7}
    cluster.set_link(OTHER, up=False)  # for good: the fixture brings it back only after the test
    out = script.ask("go", timeout=60)
    print(f"after the cut: gather failed in {out['gather'][2]:.2f} s, clear in {out['clear'][2]:.2f} s, "
          f"forget_node took {out['forget_s']:.3f} s, the clear after it {out['clear_s']:.3f} s")  # fmt: skip

    kind, message, took = out["gather"]
    print(f"  the gather: {kind}: {message}")
    assert kind == "WorkerUnavailableError" and dead.node in message, message
    assert took <= 3.0 + SLACK  # the client's 3 s at most, not a hang
    assert out["clear"][:2] == [[dead.node], 2]  # q_live's two went from host 1; q_dead's are stuck
    assert out["clear"][2] <= 3.0 * 2 + SLACK
    forgotten = out["forgotten"]
    assert forgotten["lost"] == {"p": ["s0", "s1", "d0", "d1"], "q": ["qd0", "qd1"]}
    assert forgotten["shards_lost"] == 4 + 2 + 2 and forgotten["deleted"] == 2  # d: x, y; s: y; qd: x
    assert forgotten["undeleted"] == {} and forgotten["failed"] == {}
    assert out["forget_s"] < 1.0  # host 2 was never waited for

    assert out["fresh"] == ["l0", "l1", "l2"] and out["fresh_x"] == [0.0, 1.0, 2.0]
    assert out["fresh_more"] == out["fresh_y"] == out["q"] == "BatchStatus.EMPTY"
    assert out["production"] == {"tasks": 3, "produced": {"x": 3, "y": 0}, "ready": 0}
    assert out["seen"] == {"tasks": 3, "consumed": 3}
    assert out["state_rows"]["p"] == [live.node] and out["state_rows"]["q"] == []
    assert out["live_stats"] == 3  # l0 to l2's x; split's x deleted, q_live's cleared
    assert out["cleared"] == 3 and out["clear_s"] < 1.0 and out["live_after"] == 0
    assert out["partitions"] == ["q"]  # emptied by forget_node; p is gone with its clear
