"""The `distbatch` command line against real workers: status, ls (paged), show, clear, worker."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from flask import Flask
from werkzeug.serving import make_server

from distbatch import Controller, DistributedBatchMemory, ShardClient
from distbatch.cli import main
from distbatch.controller.server import ControllerServer
from distbatch.launch import WorkerProcess


@pytest.fixture
def filled(start_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    """A worker holding 25 tasks: every one has `x`, the even ones `y` too."""
    worker = start_worker()
    with ShardClient() as client:
        shards: dict[tuple[str, str], object] = {}
        for i in range(25):
            shards[(f"t{i:02d}", "x")] = torch.arange(100)
            if i % 2 == 0:
                shards[(f"t{i:02d}", "y")] = f"label-{i}"
        client.put(worker.node, shards)
    return worker


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_status_shows_each_worker_and_says_which_are_unreachable(
    filled: WorkerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "status", filled.node, "--json")
    assert code == 0
    row = json.loads(out)[filled.node]
    assert row["shards"] == 25 + 13 and row["tasks"] == 25
    assert row["live_bytes"] > 25 * 800 and row["uptime_seconds"] > 0 and row["engine"] is None
    dead = "127.0.0.1:9"  # discard port: nothing listens there
    code, out, _ = run(capsys, "--timeout", "2", "status", filled.node, dead)
    assert code == 1
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["worker", "shards", "tasks"]
    assert lines[1].split()[:3] == [filled.node, "38", "25"]
    assert lines[2].startswith(dead) and "unreachable" in lines[2]


@pytest.fixture
def not_a_worker() -> Iterator[str]:
    """An HTTP server on loopback that answers every path 404 (as a web app on the wrong port would)."""
    server = make_server("127.0.0.1", 0, Flask("elsewhere"), threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_port}"
    server.shutdown()
    thread.join(10)


def test_status_keeps_every_column_of_a_live_worker_after_a_failed_one(
    filled: WorkerProcess,
    start_worker: Callable[..., WorkerProcess],
    not_a_worker: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows of workers that could not be asked come first; each says why in its own words."""
    monkeypatch.delenv("DISTBATCH_TOKEN", raising=False)
    secured = start_worker(env={"DISTBATCH_TOKEN": "secret"})
    dead = "127.0.0.1:9"  # discard port: nothing listens there
    code, out, _ = run(capsys, "--timeout", "2", "status", dead, secured.node, not_a_worker, filled.node)
    assert code == 1
    header, *rows = out.splitlines()
    assert header.split() == [*"worker shards tasks live held capacity shared uptime engine disk".split()]
    said = [row.split(None, 1) for row in rows]  # the address, then what the row says
    # One short reason, single-spaced: no aiohttp internals ("ClientConnectorError ... ssl:default").
    assert said[0] == [dead, "unreachable: connection refused"]
    assert said[1][0] == secured.node and said[1][1].startswith("refused: AuthError: ")
    assert said[2][0] == not_a_worker and said[2][1].startswith("not a worker: RequestError: HTTP 404")
    assert all(node not in rest for node, rest in said[:3])  # the address once per row
    cells = re.split(r"\s{2,}", rows[3])  # columns are two spaces apart at least
    assert cells[:3] == [filled.node, "38", "25"] and len(cells) == 10 and cells[-2:] == ["-", "-"]  # all ten
    code, out, _ = run(capsys, "--timeout", "2", "status", dead, filled.node, "--json")
    table = json.loads(out)
    assert table[dead] == {"state": "unreachable", "error": "connection refused"}
    assert table[filled.node]["tasks"] == 25


def test_timeout_goes_before_or_after_the_sub_command(
    filled: WorkerProcess, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[float] = []
    real = ShardClient.__init__

    def client(self: ShardClient, *args: Any, **kwargs: Any) -> None:
        seen.append(kwargs["timeout"])
        real(self, *args, **kwargs)

    monkeypatch.setattr(ShardClient, "__init__", client)
    assert run(capsys, "status", filled.node, "--timeout", "1")[0] == 0  # was "unrecognized arguments"
    assert run(capsys, "--timeout", "2", "status", filled.node)[0] == 0
    assert run(capsys, "ls", filled.node, "--timeout", "3", "--limit", "1")[0] == 0
    assert run(capsys, "--timeout", "4", "clear", filled.node, "--tasks", "t00", "--timeout", "5")[0] == 0
    assert run(capsys, "status", filled.node)[0] == 0
    assert seen == [1.0, 2.0, 3.0, 5.0, 10.0]  # after the sub-command wins; 10 s when given nowhere
    with pytest.raises(SystemExit) as shown:
        main(["status", "--help"])
    assert shown.value.code == 0 and "--timeout S" in capsys.readouterr().out


def test_status_of_a_controller_shows_its_partitions_next_to_workers(
    filled: WorkerProcess,
    serve: Callable[..., ControllerServer],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Per partition: tasks, tasks with every field, consumed per consumer, get_meta calls
    waiting per consumer (a partition awaited but not created too), fields; workers as before."""
    monkeypatch.delenv("DISTBATCH_TOKEN", raising=False)
    controller = Controller()
    server = serve(controller)

    def put(partition: str, ids: list[str], **columns: object) -> None:
        controller.put(
            partition, DistributedBatchMemory.from_dict(columns, task_ids=ids).to_remote(filled.node)
        )

    ids = [f"c{i}" for i in range(4)]
    put("step-1", ids, x=torch.zeros(4, 2))
    put("step-1", ids[:2], y=torch.ones(2, 1))
    assert len(controller.get_meta("step-1", "train", ["x"], 2)) == 2
    with ThreadPoolExecutor(max_workers=2) as pool:
        waiting = [
            pool.submit(controller.get_meta, "step-1", "critic", ["x", "y"], 4, timeout=30),
            pool.submit(controller.get_meta, "step-2", "rollout", ["x"], 1, timeout=30),
        ]
        deadline = time.monotonic() + 10
        while controller.waiting_consumers() < 2 and time.monotonic() < deadline:
            time.sleep(0.02)

        code, out, _ = run(capsys, "status", filled.node, server.address)
        assert code == 0
        workers, block = out.split("\n\n")
        assert workers.splitlines()[0].split()[:3] == ["worker", "shards", "tasks"]
        assert workers.splitlines()[1].split()[:3] == [filled.node, str(38 + 6), str(25 + 4)]
        title, header, *rows = block.splitlines()
        assert title == f"controller {server.address}: 2 partition(s), 2 get_meta call(s) waiting"
        assert re.split(r"\s{2,}", header) == ["partition", "tasks", "ready", "consumed", "waiting", "fields"]
        assert re.split(r"\s{2,}", rows[0]) == ["step-1", "4", "2", "train=2", "critic=1", "x=4 y=2"]
        assert re.split(r"\s{2,}", rows[1]) == ["step-2 (not created)", "0", "0", "-", "rollout=1", "-"]

        code, out, _ = run(capsys, "status", server.address, "--json")
        table = json.loads(out)[server.address]
        assert code == 0 and table["role"] == "controller" and table["waiting_consumers"] == 2
        step = table["partitions"]["step-1"]
        assert step["consumed"] == {"train": 2} and step["waiting"] == {"critic": 1}
        assert step["fields"]["y"] == {"produced": 2, "partial": 0, "dtype": "F32", "ragged": False}

        put("step-1", ids[2:], y=torch.ones(2, 1))
        put("step-2", ["c9"], x=torch.zeros(1, 2))
        assert [len(w.result(timeout=30)) for w in waiting] == [4, 1]
    code, out, _ = run(capsys, "status", server.address, filled.node)  # the order given is kept
    controller_block, workers_block = out.split("\n\n")
    assert controller_block.startswith(f"controller {server.address}:")
    assert workers_block.splitlines()[1].startswith(filled.node)
    code, out, _ = run(capsys, "status", server.address)  # a controller alone: its table only
    assert code == 0 and out.startswith(f"controller {server.address}: 2 partition(s), 0 get_meta")
    cells = re.split(r"\s{2,}", out.splitlines()[2])
    assert cells == ["step-1", "4", "4", "train=2 critic=4", "-", "x=4 y=4"]


def test_status_of_a_controller_needs_its_token(
    serve: Callable[..., ControllerServer],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = serve(Controller(), token="secret")
    monkeypatch.setenv("DISTBATCH_TOKEN", "wrong")
    code, out, _ = run(capsys, "status", server.address)
    said = " ".join(out.splitlines()[1].split())
    assert code == 1 and said.startswith(f"{server.address} refused: AuthError")
    monkeypatch.setenv("DISTBATCH_TOKEN", "secret")
    code, out, _ = run(capsys, "status", server.address)
    assert out.strip() == f"controller {server.address}: 0 partition(s), 0 get_meta call(s) waiting"
    assert code == 0


def test_ls_pages_through_task_ids_in_order_with_their_fields(
    filled: WorkerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "ls", filled.node, "--limit", "10")
    assert code == 0
    rows = [line.split("\t") for line in out.splitlines()]
    assert [r[0] for r in rows] == [f"t{i:02d}" for i in range(10)]
    assert rows[0][1] == "x,y" and rows[1][1] == "x"
    assert "10 of 25" in err and "--after t09" in err
    code, out, _ = run(capsys, "ls", filled.node, "--limit", "10", "--after", "t09", "--json")
    page = json.loads(out)
    assert [t for t, _ in page["tasks"]] == [f"t{i:02d}" for i in range(10, 20)]
    assert page["next"] == "t19" and page["total"] == 25
    code, out, _ = run(capsys, "ls", filled.node, "--limit", "7", "--all", "--json")
    every = json.loads(out)
    assert [t for t, _ in every["tasks"]] == [f"t{i:02d}" for i in range(25)] and every["next"] is None


def test_show_describes_each_field_of_the_named_tasks(
    filled: WorkerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    with ShardClient() as client:
        half = torch.zeros(2, 3, dtype=torch.bfloat16)
        client.put(filled.node, {("m+1", "h"): half, ("m+1", "s"): torch.tensor(1.5)})  # "+": an id char
    code, out, err = run(capsys, "show", filled.node, "t01", "m+1", "t00", "gone")
    assert code == 1 and f"{filled.node} holds no task gone" in err
    rows = [line.split() for line in out.splitlines()]
    assert rows[0] == ["task", "field", "dtype", "shape", "bytes"]
    assert rows[1:] == [
        ["t01", "x", "I64", "100", "800", "B"],
        ["m+1", "h", "BF16", "2x3", "12", "B"],
        ["m+1", "s", "F32", "()", "4", "B"],
        ["t00", "x", "I64", "100", "800", "B"],
        ["t00", "y", "json", "-", "9", "B"],  # '"label-0"'
    ]
    code, out, _ = run(capsys, "show", filled.node, "t00", "--json")
    answer = json.loads(out)
    assert code == 0 and answer["missing"] == []
    assert answer["tasks"]["t00"] == [
        {"field": "x", "dtype": "I64", "shape": [100], "bytes": 800},
        {"field": "y", "dtype": "json", "shape": None, "bytes": 9},
    ]


def test_the_task_lookup_names_what_a_worker_does_not_hold(filled: WorkerProcess) -> None:
    with ShardClient() as client:
        # Past one request's 4 KB of ids (30 of 190 characters), and a repeat.
        unknown = [f"x-{i:02d}-" + "y" * 185 for i in range(30)]
        many = [f"t{i:02d}" for i in range(25)] + unknown + ["t00"]
        held, missing = client.task_fields(filled.node, many)
        assert list(held) == [f"t{i:02d}" for i in range(25)] and missing == unknown
        assert held["t02"] == ["x", "y"] and held["t03"] == ["x"]
        for query in ("?ids=", "?ids=a,,b", "?ids=../x"):
            with pytest.raises(Exception, match="400|invalid|ids"):
                client.request_json(filled.node, "GET", f"/v1/tasks{query}")


def test_the_listing_endpoint_checks_its_arguments(filled: WorkerProcess) -> None:
    with ShardClient() as client:
        for query in ("?limit=0", "?limit=10001", "?limit=ten", "?after=../x"):
            with pytest.raises(Exception, match="400|limit|invalid"):
                client.request_json(filled.node, "GET", f"/v1/tasks{query}")


def test_clear_named_tasks_or_everything_with_confirmation(
    filled: WorkerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "clear", filled.node, "--tasks", "t00", "t01", "nope")
    assert code == 1 and "deleted 3 shard(s)" in out  # the ids it holds are deleted all the same
    assert f"{filled.node} holds no task nope" in err  # and the one it does not is named
    with pytest.raises(SystemExit) as refused:
        main(["clear", filled.node, "--all"])
    assert refused.value.code == 2 and "--yes" in capsys.readouterr().err
    with ShardClient() as client:
        assert client.stats(filled.node)["tasks"] == 23  # nothing deleted without --yes
        code, out, _ = run(capsys, "clear", filled.node, "--all", "--yes")
        assert code == 0 and "deleted 35 shard(s)" in out
        assert client.stats(filled.node)["shards"] == 0


def test_clear_takes_the_address_after_the_task_ids(
    filled: WorkerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run(capsys, "clear", "--tasks", "t00", "t01", filled.node)
    assert code == 0 and "deleted 3 shard(s)" in out and filled.node in out  # t00's x and y, t01's x
    with pytest.raises(SystemExit) as missing:
        main(["clear", "--tasks", "t02", "t03"])
    assert missing.value.code == 2
    assert (
        "clear needs the worker's HOST:PORT, e.g. distbatch clear HOST:PORT --tasks"
        in capsys.readouterr().err
    )
    with ShardClient() as client:
        assert client.stats(filled.node)["tasks"] == 23  # t02 and t03 are still there


def test_worker_help_names_the_command_it_was_given_as() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from distbatch.cli import main; raise SystemExit(main())",
            "worker",
            "--help",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: distbatch worker") and "python -m rpc_server" not in done.stdout
    assert "DISTBATCH_TOKEN" in done.stdout and "(default: 1G)" in done.stdout


def test_a_bad_address_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as bad:
        main(["status", "not-an-address"])
    assert bad.value.code == 2 and "not-an-address" in capsys.readouterr().err


def test_worker_runs_the_worker_server() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "distbatch.cli", "worker", "--port", "0", "--max-bytes", "1000000"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        node = process.stdout.readline().strip()
        with ShardClient() as client:
            assert client.stats(node)["capacity"] == 1_000_000
    finally:
        process.terminate()
        process.wait(10)
        if process.stdout is not None:
            process.stdout.close()


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--port", "99999"], "argument --port: '99999' is not a port: use 0 to 65535"),  # was :34463
        (["--port", "-1"], "argument --port: '-1' is not a port: use 0 to 65535"),  # was OverflowError
        (["--max", "1G"], "unrecognized arguments: --max 1G"),  # was "ambiguous option"
        (["--max-byte", "1G"], "unrecognized arguments: --max-byte 1G"),  # was taken for --max-bytes
    ],
)
def test_the_worker_refuses_a_bad_port_or_an_abbreviated_flag_before_listening(
    flags: list[str], said: str
) -> None:
    for command in (["-m", "rpc_server"], ["-m", "distbatch.cli", "worker"]):
        done = subprocess.run([sys.executable, *command, *flags], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and done.stdout == "", done  # no address: it never listened
        assert said in done.stderr and "Traceback" not in done.stderr


def test_the_package_installs_the_distbatch_command() -> None:
    import shutil
    from pathlib import Path

    command = shutil.which("distbatch", path=str(Path(sys.executable).parent))
    assert command, "installing the package puts a `distbatch` command next to python"
    done = subprocess.run([command, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "status" in done.stdout and "worker" in done.stdout
