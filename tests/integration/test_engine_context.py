"""An engine's first contact: its `WorkerContext` (node, rank, world size) is valid in its
constructor, and a group's `engine_kwargs` arrive there as keyword arguments.

Real workers on loopback: started by `WorkerGroup.local`, by `python -m rpc_server` by hand, or
started bare and given their engine by `WorkerGroup.connect(..., engine=)`. Engine kwargs that
would not arrive as themselves are refused before anything starts.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from engines_for_tests import ECHO, ENGINES_ENV
from process_support import children

from distbatch import ShardClient, WorkerGroup
from distbatch.batch.calls import encode_call
from distbatch.errors import EngineError, RequestError, WorkerUnavailableError
from distbatch.launch import WorkerProcess, read_first_line, spawn_workers
from distbatch.launch.flags import MAX_ENGINE_KWARGS_BYTES

KWARGS = {"model": "tiny-llm", "layers": [2, 4], "optim": {"lr": 1e-6, "fused": True, "clip": None}}
NO_TOKEN = {"DISTBATCH_TOKEN": ""}
HTTP = requests.Session()
HTTP.trust_env = False


@pytest.fixture(scope="module")
def kwargs_pair(module_client: ShardClient) -> Iterator[WorkerGroup]:
    """Two workers hosting the echo engine, built with `KWARGS`."""
    with WorkerGroup.local(2, ECHO, engine_kwargs=KWARGS, env=ENGINES_ENV, client=module_client) as group:
        yield group


@pytest.fixture
def bare_pair() -> Iterator[list[WorkerProcess]]:
    """Two workers started without an engine but accepting one (as by Slurm or by hand), stopped
    after the test."""
    workers = spawn_workers(2, args=["--accept-engine"], env=ENGINES_ENV)
    yield workers
    for worker in workers:
        worker.stop()


# --------------------------------------------------------------------------- local groups


def test_local_workers_know_node_rank_and_world_size_in_the_constructor(kwargs_pair: WorkerGroup) -> None:
    seen = kwargs_pair.call_all("identity")
    assert [s["node"] for s in seen] == kwargs_pair.nodes  # not "unbound"
    assert [s["rank"] for s in seen] == [0, 1]
    assert [s["world_size"] for s in seen] == [2, 2]


def test_engine_kwargs_reach_the_constructor_unchanged(kwargs_pair: WorkerGroup) -> None:
    assert [s["config"] for s in kwargs_pair.call_all("identity")] == [KWARGS, KWARGS]


def test_engine_kwargs_the_factory_does_not_take_fail_the_start_naming_them() -> None:
    with pytest.raises(WorkerUnavailableError) as raised:
        WorkerGroup.local(1, "engines_for_tests:StrictEngine", engine_kwargs={"modle": "x"}, env=ENGINES_ENV)
    message = str(raised.value)
    assert "exited with code 2" in message
    assert "cannot build engine 'engines_for_tests:StrictEngine': StrictEngine(model)" in message
    assert "does not take engine_kwargs ['modle']" in message


def test_engine_kwargs_fitting_a_factory_without_context() -> None:
    with WorkerGroup.local(
        1, "engines_for_tests:StrictEngine", engine_kwargs={"model": "m-1"}, env=ENGINES_ENV
    ) as group:
        assert group.call_on(0, "which") == "m-1"


# --------------------------------------------------------------------------- refused before anything starts


class NotJson:
    pass


BAD_KWARGS: dict[str, tuple[Any, type[Exception], str]] = {
    "tensor": ({"weights": torch.zeros(2)}, TypeError, r"engine_kwargs\['weights'\] is a Tensor"),
    "nested tensor": ({"opt": {"betas": [0.9, torch.tensor(0.99)]}}, TypeError, r"\['opt'\]\['betas'\]\[1\]"),
    "set": ({"tags": {"a", "b"}}, TypeError, r"engine_kwargs\['tags'\] is a set"),
    "tuple": ({"shape": (2, 3)}, TypeError, r"engine_kwargs\['shape'\] is a tuple.*pass a list"),
    "object": ({"thing": NotJson()}, TypeError, r"engine_kwargs\['thing'\] is a NotJson"),
    "nan": ({"lr": math.nan}, ValueError, r"engine_kwargs\['lr'\] is nan"),
    "infinity": ({"clip": [1.0, math.inf]}, ValueError, r"engine_kwargs\['clip'\]\[1\] is inf"),
    "int dict key": ({"table": {1: "a"}}, TypeError, r"engine_kwargs\['table'\] has the key 1"),
    "not an identifier": ({"model-path": "x"}, ValueError, r"'model-path' is not a Python identifier"),
    "context": ({"context": 1}, ValueError, r"'context' is taken"),
    "not a mapping": ([("lr", 1.0)], TypeError, r"must be a mapping"),
    "too big": (
        {"blob": "x" * MAX_ENGINE_KWARGS_BYTES},
        ValueError,
        r"over the 64K bound \(the biggest is 'blob'\)",
    ),
}


@pytest.fixture
def nothing_may_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh temporary directory for log directories; afterwards: no child process and no
    log directory was made."""
    monkeypatch.delenv("DISTBATCH_LOG_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = children(zombies=False)
    yield tmp_path
    assert children(zombies=False) == before
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("case", sorted(BAD_KWARGS))
def test_local_refuses_engine_kwargs_that_are_not_json_before_starting(
    case: str, nothing_may_start: Path
) -> None:
    kwargs, error, message = BAD_KWARGS[case]
    with pytest.raises(error, match=message):
        WorkerGroup.local(2, ECHO, engine_kwargs=kwargs, env=ENGINES_ENV)


@pytest.mark.parametrize("case", ["tensor", "nan", "not an identifier"])
def test_connect_and_ray_refuse_bad_engine_kwargs_before_contacting_anything(
    case: str, nothing_may_start: Path
) -> None:
    kwargs, error, message = BAD_KWARGS[case]
    with pytest.raises(error, match=message):  # nothing listens there: contacting it would be another error
        WorkerGroup.connect(["127.0.0.1:1"], engine=ECHO, engine_kwargs=kwargs)
    with pytest.raises(error, match=message):
        WorkerGroup.ray(2, ECHO, engine_kwargs=kwargs)


def test_engine_kwargs_without_an_engine_are_refused(nothing_may_start: Path) -> None:
    with pytest.raises(ValueError, match="name the engine too"):
        WorkerGroup.local(1, engine_kwargs={"lr": 1.0})
    with pytest.raises(ValueError, match="pass engine= too"):
        WorkerGroup.connect(["127.0.0.1:1"], engine_kwargs={"lr": 1.0})


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rank", "1"], "--rank is the group's to set"),
        (["--world-size", "4"], "--world-size is the group's to set"),
        (["--world-si", "4"], "unknown worker flag '--world-si': did you mean --world-size"),  # in full
        (["--max", "1G"], "unknown worker flag '--max': did you mean one of --max-bytes"),  # was an exit
        (["--engine-kwargs", "{}"], "--engine-kwargs is the group's to set: pass engine_kwargs="),
        (["--port", "not-a-port"], "bad worker flag"),
        (["--port", "40123"], r"--port is the group's to choose: each worker listens on a free port"),
        (["--address-file", "addr"], "--address-file would be written by every worker"),
    ],
)
def test_local_refuses_flags_the_group_sets_or_that_are_bad(
    args: list[str], message: str, nothing_may_start: Path
) -> None:
    with pytest.raises(ValueError, match=message):
        WorkerGroup.local(2, ECHO, args=args, env=ENGINES_ENV)


# --------------------------------------------------------------------------- connect


def test_connect_builds_the_engine_ranked_by_address_order(
    bare_pair: list[WorkerProcess], module_client: ShardClient
) -> None:
    addresses = [bare_pair[1].node, bare_pair[0].node]  # not the order they were started in
    group = WorkerGroup.connect(addresses, engine=ECHO, engine_kwargs=KWARGS, client=module_client)
    seen = group.call_all("identity")
    assert seen == [
        {"node": addresses[0], "rank": 0, "world_size": 2, "config": KWARGS},
        {"node": addresses[1], "rank": 1, "world_size": 2, "config": KWARGS},
    ]
    assert [module_client.health(a)["rank"] for a in addresses] == [0, 1]
    assert group.call_on(0, "bump", "k") == 1
    group.shutdown()  # leaves the workers, and their engines, running

    again = WorkerGroup.connect(addresses, engine=ECHO, engine_kwargs=KWARGS, client=module_client)
    assert again.call_on(0, "bump", "k") == 2  # the same engine object: reconnecting rebuilt nothing
    with pytest.raises(RequestError, match="already hosts an engine") as info:
        WorkerGroup.connect(addresses, engine=ECHO, engine_kwargs={"model": "other"}, client=module_client)
    assert info.value.status == 409
    with pytest.raises(RequestError, match="already hosts an engine"):
        WorkerGroup.connect(
            list(reversed(addresses)), engine=ECHO, engine_kwargs=KWARGS, client=module_client
        )
    # Without engine=: the engines as they are, in any order.
    reversed_group = WorkerGroup.connect(list(reversed(addresses)), client=module_client)
    assert [s["rank"] for s in reversed_group.call_all("identity")] == [1, 0]


def test_connect_reports_an_engine_that_fails_to_build_and_the_worker_stays_usable(
    bare_pair: list[WorkerProcess], module_client: ShardClient
) -> None:
    nodes = [w.node for w in bare_pair]
    with pytest.raises(EngineError, match="rank 0 of 2: no GPU for this rank") as info:
        WorkerGroup.connect(nodes, engine="engines_for_tests:BrokenEngine", client=module_client)
    assert info.value.node == nodes[0]  # both failed: the first in worker order is raised
    assert info.value.exception_type == "RuntimeError"
    assert "raise RuntimeError" in info.value.remote_traceback
    assert all(module_client.health(n)["engine"] is None for n in nodes)
    with pytest.raises(RequestError, match="does not take engine_kwargs") as bad:
        WorkerGroup.connect(nodes, engine="engines_for_tests:StrictEngine", engine_kwargs={"x": 1},
                            client=module_client)  # fmt: skip
    assert bad.value.status == 400
    group = WorkerGroup.connect(nodes, engine=ECHO, client=module_client)
    assert [s["rank"] for s in group.call_all("identity")] == [0, 1]
    log = bare_pair[1].log_file
    assert log is not None and "the engine's constructor raised RuntimeError: rank 1 of 2" in log.read_text()


def test_a_worker_builds_no_engine_on_request_unless_started_with_accept_engine(
    start_worker: Any, module_client: ShardClient
) -> None:
    worker = start_worker()  # a store only, as every worker is by default
    with pytest.raises(RequestError, match="start it with --accept-engine") as info:
        WorkerGroup.connect([worker.node], engine="os:system", engine_kwargs={"command": "true"},
                            client=module_client)  # fmt: skip
    assert info.value.status == 403 and info.value.code == "engine_not_accepted"
    assert module_client.health(worker.node)["engine"] is None


def test_a_worker_started_with_its_engine_keeps_it_when_connect_asks_for_the_same(
    start_worker: Any, module_client: ShardClient
) -> None:
    worker = start_worker("--engine", ECHO, "--engine-kwargs", '{"model": "m"}', env=ENGINES_ENV)
    group = WorkerGroup.connect(
        [worker.node], engine=ECHO, engine_kwargs={"model": "m"}, client=module_client
    )
    assert group.call_on(0, "identity") == {
        "node": worker.node,
        "rank": 0,
        "world_size": 1,
        "config": {"model": "m"},
    }
    with pytest.raises(RequestError, match="already hosts an engine"):
        WorkerGroup.connect([worker.node], engine=ECHO, client=module_client)


# --------------------------------------------------------------------------- a worker started by hand


def _start_by_hand(*flags: str) -> tuple[subprocess.Popen[bytes], str | None]:
    process = subprocess.Popen(
        [sys.executable, "-m", "rpc_server", "--exit-with-parent", str(os.getpid()), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **NO_TOKEN, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    return process, read_first_line(process, 60.0)


def _identity(node: str) -> Any:
    reply = HTTP.post(
        f"http://{node}/v1/call/identity",
        data=encode_call([], {}),
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["result"]["json"]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], {"rank": 0, "world_size": 1, "config": {}}),
        (["--rank", "2", "--world-size", "4", "--engine-kwargs", '{"model": "m"}'],
         {"rank": 2, "world_size": 4, "config": {"model": "m"}}),
    ],
)  # fmt: skip
def test_a_worker_started_by_hand_is_rank_0_of_1_unless_its_flags_say(
    flags: list[str], expected: dict[str, Any]
) -> None:
    process, node = _start_by_hand("--engine", ECHO, *flags)
    try:
        assert node is not None, process.stderr.read().decode() if process.stderr else ""
        assert _identity(node) == {"node": node, **expected}
    finally:
        process.kill()
        process.communicate(timeout=10)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rank", "4", "--world-size", "4"], "--rank must be an integer in [0, 4), got 4"),
        (["--world-size", "0"], "--world-size must be an integer >= 1"),
        (["--engine-kwargs", '{"lr": NaN}'], "engine_kwargs['lr'] is nan"),
        (["--engine-kwargs", "[1]"], "engine_kwargs must be a mapping"),
    ],
)
def test_bad_rank_and_engine_kwargs_flags_stop_the_worker_with_a_message(
    flags: list[str], message: str
) -> None:
    process, node = _start_by_hand("--engine", ECHO, *flags)
    _, stderr = process.communicate(timeout=30)
    assert node is None and process.returncode == 2
    assert message in stderr.decode()


def test_help_shows_the_new_flags_and_their_defaults() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rpc_server", "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    squeezed = " ".join(out.split())
    assert "--rank N this worker's index in its group, the engine's context.rank (default: 0)" in squeezed
    assert (
        "--world-size N how many workers its group has, the engine's context.world_size (default: 1)"
        in squeezed
    )
    assert "--engine-kwargs JSON keyword arguments for the engine factory" in squeezed
    assert "(at most 64K; default: none)" in squeezed
