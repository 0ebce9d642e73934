"""The TransferQueue backend when a worker dies mid-call: a distbatch worker SIGKILLed while a
large `kv_batch_put` or `kv_batch_get` is in flight makes the call raise, promptly, a
`WorkerUnavailableError` that names the worker and says it is unreachable; nothing of a failed
put is recorded or readable, and the data another worker holds (put earlier by another producer
process) stays intact and readable.

Real parts: a local Ray cluster (TransferQueue's controller, and a second producer process as a
Ray actor), `rpc_server` workers on loopback started here and passed as
`backend.Distbatch.endpoints`, real HTTP and, where a test says so, the same-host path (Unix
socket and shared memory). So that the kill lands while the call is certainly in flight (not
before it started, nor after it ended), the test stops the worker (SIGSTOP) and waits until the
kernel shows the call's bytes queued on that worker's sockets (`/proc/net/tcp`, `ss`) before
it SIGKILLs it; the fixtures stop every process they start, whatever the test did to it.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from ray_support import import_ray, local_ray_for_module
from thread_support import run_in_thread

from distbatch import ShardClient, WorkerUnavailableError
from distbatch.launch import WorkerProcess, spawn_workers
from distbatch.transport.shm import ENV_SWITCH

ray = import_ray()
if os.environ.get("DISTBATCH_REQUIRE_TQ") == "1":
    tq = importlib.import_module("transfer_queue")
else:
    tq = pytest.importorskip("transfer_queue")
from tensordict import TensorDict  # noqa: E402

import distbatch.transferqueue as dtq  # noqa: E402  (after the skip)
from distbatch.transferqueue.manager import home_worker, local_addresses  # noqa: E402

RAY_CPUS = 8
SETUP_HOOK = {"worker_process_setup_hook": "distbatch.transferqueue.register"}
TIMEOUT = 5.0  # backend.Distbatch.timeout: seconds one request may take, retries included
SLACK = 3.0  # past it: the client's retry backoff, a loaded machine
BIG_ROWS = 8
BIG_ROW = 4 << 20  # float32 elements a row: 8 rows of 16 MiB, 128 MiB in one call
KEPT = [f"kept{i}" for i in range(4)]

# Each test ends well within 30 s; the first also starts the module's Ray cluster.
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Iterator[None]:
    yield from local_ray_for_module(RAY_CPUS, runtime_env=SETUP_HOOK)


@ray.remote
class Producer:
    """Another process that puts to TransferQueue (a rollout worker, say): its home worker goes
    by its own process id, so its data lands on another worker than this process's."""

    def pid(self) -> int:
        return os.getpid()

    def put(self, keys: list[str], values: dict[str, Any], tag: dict[str, Any]) -> list[str]:
        import transfer_queue as remote_tq

        fields = TensorDict(values, batch_size=[len(keys)])
        meta = remote_tq.kv_batch_put(keys=keys, partition_id="p", fields=fields, tags=[tag] * len(keys))
        return sorted(meta.fields)


class Setup:
    """Workers, TransferQueue over them, and which worker takes whose puts."""

    def __init__(self, mine: WorkerProcess, theirs: WorkerProcess, producer: Any) -> None:
        self.mine = mine  # this process's home worker: its puts go there
        self.theirs = theirs  # the producer's home worker
        self.producer = producer

    def produce(self, keys: list[str], values: dict[str, torch.Tensor]) -> None:
        """The producer puts `values` under `keys` (tagged as its own) in partition "p"."""
        fields = ray.get(self.producer.put.remote(keys, values, {"by": "producer"}), timeout=60)
        assert fields == sorted(values)


@pytest.fixture
def path() -> str:
    """How this process reaches the workers: "http", or "same_host" (Unix socket and memfds)."""
    return "http"


@pytest.fixture
def setup(path: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Setup]:
    """A producer actor, as many workers as it takes for its home worker and this process's to
    differ (homes go by process id), and `tq.init` over them; all stopped after the test. The
    slow part of each test (5-10 s alone): the actor's process and TransferQueue's start."""
    if path == "same_host":
        if shutil.which("ss") is None:
            pytest.skip("needs `ss` to see a Unix socket's queue")
        monkeypatch.setenv(ENV_SWITCH, "1")  # the suite turns it off; this process and its workers
    producer = Producer.remote()  # type: ignore[attr-defined]
    workers: list[WorkerProcess] = []
    try:
        theirs = ray.get(producer.pid.remote(), timeout=60)
        me = os.getpid()
        n = next(n for n in itertools.count(2) if me % n != theirs % n)
        workers = spawn_workers(n)
        endpoints = [w.node for w in workers]
        mine, their_home = workers[me % n], workers[theirs % n]
        assert home_worker(endpoints, local_addresses(), me) == mine.node
        assert home_worker(endpoints, local_addresses(), theirs) == their_home.node
        tq.init(
            {
                "backend": {
                    "storage_backend": "Distbatch",
                    "Distbatch": {"endpoints": endpoints, "timeout": TIMEOUT},
                }
            }
        )
        # This process's first call to its home worker (where the same-host path is set up).
        tq.kv_put(key="warm", partition_id="warm", fields={"x": torch.zeros(1)})
        yield Setup(mine, their_home, producer)
    finally:
        close_everything(producer, workers)


def close_everything(producer: Any, workers: list[WorkerProcess]) -> None:
    """TransferQueue, the producer actor and the workers (a stopped one is woken first)."""
    try:
        dtq.close()
    finally:
        ray.kill(producer)
        for w in workers:
            if w.alive():
                _signal(w, signal.SIGCONT)
        for w in workers:
            w.stop()


def _signal(worker: WorkerProcess, sig: signal.Signals) -> None:
    try:
        os.kill(worker.pid, sig)
    except ProcessLookupError:
        pass


def kept_values() -> dict[str, torch.Tensor]:
    n = len(KEPT)
    return {"reward": torch.arange(float(n)), "ids": torch.arange(n * 3).reshape(n, 3)}


def big_fields(fill: float) -> TensorDict:
    return TensorDict({"blob": torch.full((BIG_ROWS, BIG_ROW), fill)}, batch_size=[BIG_ROWS])


def same_values(a: TensorDict, b: TensorDict) -> bool:
    """The same fields with the same values (a nested tensor: the same values and offsets)."""
    return sorted(a.keys()) == sorted(b.keys()) and all(
        same_tensor(a.get(name), b.get(name)) for name in a.keys()
    )


def same_tensor(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.is_nested != y.is_nested or x.dtype != y.dtype:
        return False
    if x.is_nested:
        return same_tensor(x.values(), y.values()) and same_tensor(x.offsets(), y.offsets())
    return x.shape == y.shape and torch.equal(x, y)


# ---------------------------------------------------------------------- what the kernel shows


def tcp_queues(worker: WorkerProcess) -> list[tuple[int, int]]:
    """(unread, unsent) bytes of each established TCP connection on `worker`'s port: what was
    sent to it that it has not read, and what it wrote that the other end has not read."""
    port = int(worker.node.rsplit(":", 1)[1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            local, state, queues = cols[1], cols[3], cols[4]
            if state == "01" and int(local.rsplit(":", 1)[1], 16) == port:
                tx, rx = (int(q, 16) for q in queues.split(":"))
                out.append((rx, tx))
    return out


def unix_unread(worker: WorkerProcess) -> int:
    """Bytes sent to `worker`'s same-host socket that it has not read (0 if it has none)."""
    table = subprocess.run(["ss", "-xapn"], capture_output=True, text=True, check=True).stdout
    rows = [line.split() for line in table.splitlines()]
    names = {r[4] for r in rows if len(r) > 6 and r[1] == "LISTEN" and f"pid={worker.pid}," in r[-1]}
    return sum(int(r[2]) for r in rows if len(r) > 4 and r[1] == "ESTAB" and r[4] in names)


def unread_by(worker: WorkerProcess, path: str) -> int:
    """Bytes a call has sent to `worker` that it has not read yet, on the given path."""
    if path == "same_host":
        return unix_unread(worker)
    return sum(rx for rx, _ in tcp_queues(worker))


def wait_for(condition: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {seconds} s")
        time.sleep(0.001)


def kill_and_wait(worker: WorkerProcess, thread: Any, outcome: dict[str, Any], call: str) -> BaseException:
    """SIGKILL `worker` while `call` runs on `thread`; the error it ended with, promptly."""
    assert thread.is_alive(), f"the {call} finished before the kill: nothing was tested"
    killed_at = time.monotonic()
    worker.kill()
    thread.join(TIMEOUT + SLACK + 5)
    assert not thread.is_alive(), f"the {call} hung on a dead worker"
    assert "value" not in outcome, f"the {call} finished after the kill: nothing was tested"
    assert outcome["at"] - killed_at <= TIMEOUT + SLACK
    return outcome["error"]


def assert_says_unreachable(error: BaseException, worker: WorkerProcess, call: str) -> None:
    """A distbatch error naming `worker`, saying it is unreachable and what became of `call`,
    with the client's own error as its cause."""
    assert isinstance(error, WorkerUnavailableError), repr(error)
    assert error.node == worker.node and error.reason
    text = str(error)
    assert text.startswith(f"{worker.node}: distbatch worker unreachable ({error.reason})"), text
    assert "it died, was stopped, or the network to it is down" in text, text
    assert f"TransferQueue's {call} of " in text, text
    assert isinstance(error.__cause__, WorkerUnavailableError) and error.__cause__.node == worker.node


# ---------------------------------------------------------------------- put


@pytest.mark.parametrize("path", ["http", "same_host"])
def test_a_worker_killed_mid_put_fails_the_put_clearly_and_nothing_of_it_is_recorded(
    setup: Setup, path: str
) -> None:
    setup.produce(KEPT, kept_values())
    before = tq.kv_batch_get(keys=KEPT, partition_id="p")
    new = [f"new{i}" for i in range(BIG_ROWS - len(KEPT))]
    # One put: new keys, and for the kept keys a new field and a new value of one they have.
    fields = big_fields(1.0)
    fields.set("reward", torch.full((BIG_ROWS,), -1.0))
    with ShardClient(timeout=TIMEOUT) as observer:
        theirs_before = observer.stats(setup.theirs.node)
        _signal(setup.mine, signal.SIGSTOP)
        thread, outcome = run_in_thread(
            lambda: tq.kv_batch_put(
                keys=KEPT + new, partition_id="p", fields=fields, tags=[{"by": "failed put"}] * BIG_ROWS
            )
        )
        wait_for(lambda: unread_by(setup.mine, path) > 0, 20, "the put never reached the worker")
        error = kill_and_wait(setup.mine, thread, outcome, "put")
        assert_says_unreachable(error, setup.mine, "put")
        assert "none of its fields was recorded" in str(error)

        # The other worker got none of it.
        theirs_after = observer.stats(setup.theirs.node)
        assert (theirs_after["shards"], theirs_after["bytes"], theirs_after["staged_bytes"]) == (
            theirs_before["shards"],
            theirs_before["bytes"],
            0,
        )

    # Nothing of it recorded: the kept keys read as before (no new field, the old values), with
    # their own tags. TransferQueue registered the new keys before it asked for the put (as with
    # its own storage): listed, with no tag and no field, so a read of them is refused.
    after = tq.kv_batch_get(keys=KEPT, partition_id="p")
    assert same_values(after, before)
    listed = tq.kv_list(partition_id="p")["p"]
    assert {key: listed[key] for key in KEPT} == dict.fromkeys(KEPT, {"by": "producer"})
    assert {key: listed[key] for key in new} == dict.fromkeys(new, {})
    with pytest.raises(ValueError, match="not ready"):
        tq.kv_batch_get(keys=new, partition_id="p")

    # Those keys are not stuck half-made: a process whose worker is up puts them whole.
    values = {"reward": torch.tensor([5.0, 6.0, 7.0, 8.0]), "ids": torch.ones(4, 3, dtype=torch.int64)}
    setup.produce(new, values)
    again = tq.kv_batch_get(keys=new, partition_id="p")
    assert torch.equal(again.get("reward"), values["reward"])
    assert tq.kv_list(partition_id="p")["p"]["new0"] == {"by": "producer"}
    # This process's own puts no longer go to the dead worker: the error named the one they go
    # to now (another of the workers), and a put from here succeeds there.
    new_home = str(error).split("this process's next puts go to ", 1)[1]
    assert new_home != setup.mine.node and new_home.startswith("127.0.0.1:")
    tq.kv_batch_put(keys=["later"], partition_id="p", fields=TensorDict({"reward": torch.tensor([9.0])}, [1]))
    assert tq.kv_batch_get(keys=["later"], partition_id="p").get("reward").tolist() == [9.0]
    # And all of them clear with the dead worker still down: none of their data was there.
    tq.kv_clear(keys=KEPT + new + ["later"], partition_id="p")
    assert not tq.kv_list(partition_id="p").get("p")


# ---------------------------------------------------------------------- get


@pytest.mark.parametrize("path", ["http", "same_host"])
def test_a_worker_killed_mid_get_fails_the_get_clearly_and_the_others_keep_serving(
    setup: Setup, path: str
) -> None:
    setup.produce(KEPT, kept_values())
    before = tq.kv_batch_get(keys=KEPT, partition_id="p")
    big = [f"big{i}" for i in range(BIG_ROWS)]
    tq.kv_batch_put(keys=big, partition_id="p", fields=big_fields(2.0))

    if path == "http":
        # Let the worker start writing its 128 MiB answer (its socket holds bytes this process
        # has not read yet), then stop it there: the answer is certainly cut short.
        thread, outcome = run_in_thread(lambda: tq.kv_batch_get(keys=big, partition_id="p"))
        wait_for(
            lambda: any(tx > 0 for _, tx in tcp_queues(setup.mine)) or not thread.is_alive(),
            20,
            "the worker never started answering the get",
        )
        _signal(setup.mine, signal.SIGSTOP)
    else:
        # Over the same-host path the answer is one short message (the data is in shared
        # memory): stop the worker, then kill it once the get's request waits on its socket.
        _signal(setup.mine, signal.SIGSTOP)
        thread, outcome = run_in_thread(lambda: tq.kv_batch_get(keys=big, partition_id="p"))
        wait_for(lambda: unread_by(setup.mine, path) > 0, 20, "the get never reached the worker")
    error = kill_and_wait(setup.mine, thread, outcome, "get")
    assert_says_unreachable(error, setup.mine, "get")

    # The other worker's data reads as before; the dead one's keeps failing fast, never hanging.
    assert same_values(tq.kv_batch_get(keys=KEPT, partition_id="p"), before)
    started = time.monotonic()
    with pytest.raises(WorkerUnavailableError) as again:
        tq.kv_batch_get(keys=big[:1], partition_id="p")
    assert_says_unreachable(again.value, setup.mine, "get")
    assert time.monotonic() - started <= TIMEOUT + SLACK


def test_puts_failing_together_on_a_dead_home_all_move_to_the_same_live_worker(setup: Setup) -> None:
    """Puts run concurrently; when their home worker is dead they all fail, and each moves the
    process's home only if it is still the dead one: all name the same live worker (none moves
    it back onto the dead one), and the next put succeeds there."""
    setup.mine.kill()
    row = TensorDict({"reward": torch.tensor([1.0])}, batch_size=[1])

    async def puts() -> list[Any]:
        calls = [tq.async_kv_batch_put(keys=[f"c{i}"], partition_id="p", fields=row) for i in range(4)]
        return await asyncio.gather(*calls, return_exceptions=True)

    errors = asyncio.run(puts())
    assert all(isinstance(e, WorkerUnavailableError) for e in errors), errors
    homes = {str(e).split("this process's next puts go to ", 1)[1] for e in errors}
    assert len(homes) == 1 and setup.mine.node not in homes, homes
    tq.kv_batch_put(keys=["after"], partition_id="p", fields=row)
    assert tq.kv_batch_get(keys=["after"], partition_id="p").get("reward").tolist() == [1.0]


def test_a_durable_worker_restarted_at_a_new_address_is_followed(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers with `--data-dir` (`backend.Distbatch.data_dir`, `{rank}` their slot): this
    process's home worker is SIGKILLed after a put and started again on its directory, at a new
    port. Without anyone telling TransferQueue, the next get finds every sample it held there
    (the manager reads where the directory says it serves, and checks the worker there has the
    slot's rank), with the same values; puts go there again, and clears reach it."""
    template = str(tmp_path / "w{rank}")
    workers: list[WorkerProcess] = []
    try:
        workers = spawn_workers(2, args=["--data-dir", template, "--sync"])
        endpoints = [w.node for w in workers]
        slot = endpoints.index(home_worker(endpoints, local_addresses(), os.getpid()))
        tq.init(config_for(endpoints, data_dir=template))
        values = kept_values()
        tq.kv_batch_put(keys=KEPT, partition_id="p", fields=TensorDict(values, batch_size=[len(KEPT)]))
        before = tq.kv_batch_get(keys=KEPT, partition_id="p")
        old = workers[slot]
        old.kill()
        (again,) = spawn_workers(1, args=["--data-dir", template, "--sync"], first_rank=slot, world_size=2)
        workers.append(again)
        assert again.node != old.node
        assert same_values(tq.kv_batch_get(keys=KEPT, partition_id="p"), before)
        tq.kv_batch_put(
            keys=["later"], partition_id="p", fields=TensorDict({"reward": torch.tensor([9.0])}, [1])
        )
        assert tq.kv_batch_get(keys=["later"], partition_id="p").get("reward").tolist() == [9.0]
        assert ShardClient().stats(again.node)["tasks"] >= len(KEPT) + 1  # both on the restarted worker
        tq.kv_clear(keys=[*KEPT, "later"], partition_id="p")
        assert ShardClient().stats(again.node)["tasks"] == 0
    finally:
        try:
            dtq.close()
        finally:
            for w in workers:
                w.stop()


def config_for(endpoints: list[str], **options: Any) -> dict[str, Any]:
    return {
        "backend": {
            "storage_backend": "Distbatch",
            "Distbatch": {"endpoints": endpoints, "timeout": TIMEOUT, **options},
        }
    }
