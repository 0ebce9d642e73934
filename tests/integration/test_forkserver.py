"""Workers forked from the fork server (`distbatch.launch.forkserver`, `rpc_server.forkserver`):
the default for `spawn_workers` with this interpreter; they serve, report exit codes as a
new process would, run under their own environment and import path, and a start-up environment
of their own gets a server of its own."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import time
from pathlib import Path

import pytest
from engines_for_tests import ECHO, ENGINES_ENV
from process_support import is_fork_server, parent_of

from distbatch import ShardClient, WorkerGroup, WorkerUnavailableError
from distbatch.launch import spawn_workers
from distbatch.launch.forkserver import ENV_SPAWN, ForkedProcess, startup_environment


def test_workers_are_forked_serve_and_report_exit_codes_as_a_new_process_would() -> None:
    workers = spawn_workers(2)
    try:
        assert all(isinstance(w.process, ForkedProcess) for w in workers)
        (server,) = {parent_of(w.pid) for w in workers}
        assert is_fork_server(server) and parent_of(server) == os.getpid()
        with ShardClient(timeout=10.0) as client:
            assert [client.health(w.node)["node"] for w in workers] == [w.node for w in workers]
        assert workers[0].process.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            workers[0].process.wait(0.1)
        workers[0].kill()
        assert workers[0].process.returncode == -signal.SIGKILL
        workers[1].stop()
        assert workers[1].process.returncode == 0  # SIGTERM: a clean shutdown
        # The server reaps them once it has told us their codes: no zombie stays behind.
        deadline = time.monotonic() + 30
        while any(Path(f"/proc/{w.pid}").exists() for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(Path(f"/proc/{w.pid}").exists() for w in workers)
    finally:
        for w in workers:
            w.stop()


def test_a_worker_that_fails_to_start_reports_its_code_and_log(tmp_path: Path) -> None:
    with pytest.raises(WorkerUnavailableError, match="exited with code 2 before printing its address"):
        spawn_workers(
            1, args=["--engine", "engines_for_tests:NoSuchEngine"], env=ENGINES_ENV, log_dir=tmp_path
        )


def test_the_engine_sees_its_own_environment_and_import_path(tmp_path: Path) -> None:
    """PYTHONPATH becomes the fork's import path (an engine module only it names), and any other
    variable is in its environment, as in a new process."""
    (tmp_path / "only_here.py").write_text(
        "import os\n"
        "class Engine:\n"
        "    def __init__(self, context=None):\n"
        "        pass\n"
        "    def env(self, name):\n"
        "        return os.environ.get(name)\n"
    )
    env = {"PYTHONPATH": str(tmp_path), "FORKED_WORKER_MARK": "mine"}
    with WorkerGroup.local(1, "only_here:Engine", env=env) as group:
        assert isinstance(group.processes[0].process, ForkedProcess)
        assert group.call_all("env", "FORKED_WORKER_MARK") == ["mine"]


def test_a_start_up_environment_of_its_own_gets_a_server_of_its_own() -> None:
    """OMP_NUM_THREADS is read when a native library loads, so a worker asking for another value
    is forked from a server started with it."""
    assert startup_environment({"OMP_NUM_THREADS": "1", "PYTHONPATH": "x", "A": "b"}) == (
        ("OMP_NUM_THREADS", "1"),
    )
    with (
        WorkerGroup.local(1, ECHO, env={**ENGINES_ENV, "OMP_NUM_THREADS": "3"}) as own,
        WorkerGroup.local(1, ECHO, env=ENGINES_ENV) as plain,
    ):
        server = parent_of(own.processes[0].pid)
        assert is_fork_server(server) and server != parent_of(plain.processes[0].pid)
        assert b"OMP_NUM_THREADS=3" in Path(f"/proc/{server}/environ").read_bytes().split(b"\0")


def test_spawn_exec_starts_new_interpreters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_SPAWN, "exec")
    workers = spawn_workers(1)
    try:
        assert isinstance(workers[0].process, subprocess.Popen)
        assert "rpc_server" in Path(f"/proc/{workers[0].pid}/cmdline").read_bytes().decode()
    finally:
        workers[0].stop()


def test_a_worker_inherits_this_process_as_it_is_now() -> None:
    """Resource limits and priority are a child's inheritance: a worker started after they
    changed here has the new ones (from a server started as this process is now)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    lowered = (1 << 40) + 4096  # bytes: no file here gets that big
    resource.setrlimit(resource.RLIMIT_FSIZE, (lowered, hard))
    try:
        workers = spawn_workers(1)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    try:
        limits = Path(f"/proc/{workers[0].pid}/limits").read_text().splitlines()
        (file_size,) = [line for line in limits if line.startswith("Max file size")]
        assert file_size.split()[3] == str(lowered)
    finally:
        workers[0].stop()
