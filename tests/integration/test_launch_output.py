"""Worker output and start-up: engines may print anything, in any amount.

A worker's stdout carries only its address; everything an engine prints or logs goes to the
worker's log file, so output can neither corrupt the address nor block the worker. A start that
fails says why (quoting the log) and leaves no process behind, and an engine module importable
in the controller is importable in its workers. Engines live in modules written to tmp dirs.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests
from process_support import children

from distbatch import WorkerGroup
from distbatch.batch.calls import encode_call
from distbatch.errors import WorkerUnavailableError
from distbatch.launch import read_first_line, spawn_workers

ADDRESS = re.compile(r"127\.0\.0\.1:(\d+)")
NO_TOKEN = {"DISTBATCH_TOKEN": ""}
HTTP = requests.Session()
HTTP.trust_env = False

CHATTY_ENGINE = '''
"""An engine that prints at import, at construction and on demand, like real training code."""
import os
import subprocess
import sys
import time

print("loading model weights...")  # before the worker has an address
print("import-time warning on stderr", file=sys.stderr)
if os.environ.get("CHATTY_FAIL_AT_IMPORT"):
    print("probing devices", flush=True)
    raise RuntimeError("CUDA_ERROR_NO_DEVICE: no GPU on this worker")
if os.environ.get("CHATTY_HANG_AT_IMPORT"):
    print("waiting for a lock that never comes", flush=True)
    time.sleep(600)


class Engine:
    def __init__(self) -> None:
        print("engine constructed")

    def ping(self) -> str:
        return "pong"

    def chat(self, nbytes: int, marker: str, stderr: bool = False) -> int:
        """Print `nbytes` in 100-byte lines to stdout (and as many to stderr), then `marker`."""
        line = "x" * 99
        for _ in range(nbytes // 100):
            print(line)
            if stderr:
                print(line, file=sys.stderr)
        print(marker)
        return nbytes

    def chat_below_python(self, nbytes: int, marker: str) -> int:
        """Write to fd 1 directly (as C code does) and from a subprocess, then `marker`."""
        chunk = b"y" * 1023 + b"\\n"
        for _ in range(nbytes // 1024):
            os.write(1, chunk)
        code = f"import sys; sys.stdout.write('z' * {nbytes}); print(); print({marker!r} + '-child')"
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
        os.write(1, marker.encode() + b"\\n")
        return nbytes
'''


@pytest.fixture
def engine_dir(tmp_path: Path) -> Path:
    """A directory holding the `chatty_engine` module (put on the workers' PYTHONPATH)."""
    directory = tmp_path / "engines"
    directory.mkdir()
    (directory / "chatty_engine.py").write_text(CHATTY_ENGINE)
    return directory


@pytest.fixture
def chatty_group(engine_dir: Path, tmp_path: Path) -> Iterator[WorkerGroup]:
    """One worker hosting the chatty engine; a call over 30 s fails instead of hanging the test."""
    group = WorkerGroup.local(
        1,
        "chatty_engine:Engine",
        env={**NO_TOKEN, "PYTHONPATH": str(engine_dir)},
        call_timeout=30,
        log_dir=tmp_path / "logs",
    )
    yield group
    group.shutdown()


def wait_for_text(path: Path, text: str, timeout: float = 10.0) -> str:
    """The file's content once it contains `text` (or whatever it holds at the deadline)."""
    deadline = time.monotonic() + timeout
    content = path.read_text(errors="replace")
    while text not in content and time.monotonic() < deadline:
        time.sleep(0.05)
        content = path.read_text(errors="replace")
    return content


# --------------------------------------------------------------------------- printing engines


def test_engine_printing_at_import_starts_and_logs_its_output(
    chatty_group: WorkerGroup, tmp_path: Path
) -> None:
    # Before the fix: "invalid node address 'loading model weights...'".
    (node,) = chatty_group.nodes
    assert ADDRESS.fullmatch(node), node
    assert chatty_group.call_on(0, "ping") == "pong"
    (log_file,) = chatty_group.log_files
    pid = chatty_group.processes[0].pid
    assert log_file == tmp_path / "logs" / f"worker-0-{pid}.log"
    log = wait_for_text(log_file, "engine constructed")
    assert "loading model weights..." in log  # stdout prints land in the log too
    assert "import-time warning on stderr" in log
    assert "engine constructed" in log
    assert node not in log.splitlines()  # the address line went to stdout only
    assert f"distbatch worker {node} serving" in log  # the worker's own line says where it is


@pytest.mark.parametrize(
    ("method", "nbytes", "stderr"),
    [
        pytest.param("chat", 200_000, False, id="print-200kB"),
        pytest.param("chat", 5_000_000, True, id="print-5MB-stdout-and-stderr"),
        pytest.param("chat_below_python", 1_000_000, False, id="fd1-and-subprocess-1MB"),
    ],
)
def test_engine_printing_a_lot_returns_promptly(
    chatty_group: WorkerGroup, method: str, nbytes: int, stderr: bool
) -> None:
    # Before the fix the worker blocked on its full stdout pipe: the call ran into the 30 s
    # call timeout (and, without one, hung forever).
    marker = f"END-OF-{method}-{nbytes}"
    kwargs = {"stderr": True} if stderr else {}
    started = time.monotonic()
    assert chatty_group.call_on(0, method, nbytes, marker, **kwargs) == nbytes
    elapsed = time.monotonic() - started
    assert elapsed < 20, f"{nbytes} bytes of output took {elapsed:.1f}s"
    assert chatty_group.call_on(0, "ping") == "pong"  # and it keeps answering
    (log_file,) = chatty_group.log_files
    log = wait_for_text(log_file, marker)  # unbuffered: the output is there once the call returns
    assert marker in log
    if method == "chat_below_python":
        assert marker + "-child" in log
    expected = nbytes * (2 if stderr else 1)
    assert log_file.stat().st_size >= expected


# --------------------------------------------------------------------------- failed starts


def test_failed_start_quotes_the_log_and_leaves_no_process(engine_dir: Path, tmp_path: Path) -> None:
    # Worker 0 would start fine; worker 1's engine raises at import. Both must be gone afterwards.
    before = children()
    env = {**NO_TOKEN, "PYTHONPATH": str(engine_dir)}
    started = time.monotonic()
    with pytest.raises(WorkerUnavailableError) as raised:
        spawn_workers(
            2,
            args=["--engine", "chatty_engine:Engine"],
            env=[env, {**env, "CHATTY_FAIL_AT_IMPORT": "1"}],
            startup_timeout=60,
            log_dir=tmp_path / "logs",
        )
    assert time.monotonic() - started < 30  # reported when it exits, not at the start timeout
    message = str(raised.value)
    assert "worker 1 exited with code 1 before printing its address" in message
    assert "CUDA_ERROR_NO_DEVICE: no GPU on this worker" in message  # the log's tail: the traceback
    logs = sorted((tmp_path / "logs").glob("worker-*.log"))
    assert [p.name.split("-")[1] for p in logs] == ["0", "1"]
    assert str(logs[1]) in message
    assert children() == before
    for log in logs:  # the pid in each log's name: no such process any more
        pid = int(log.stem.split("-")[2])
        assert not Path(f"/proc/{pid}").exists(), f"worker {pid} outlived a failed start"


def test_start_timeout_quotes_the_log_and_leaves_no_process(engine_dir: Path, tmp_path: Path) -> None:
    """The engine prints a line, then hangs at import: the start times out, quoting the log.
    Whether the worker got as far as the print within the timeout depends on the machine's load,
    so the timeout grows (3, 10, 30 s) until one start has printed it; every start times out and
    leaves no process."""
    before = children()
    for timeout in (3, 10, 30):
        with pytest.raises(WorkerUnavailableError) as raised:
            WorkerGroup.local(
                1,
                "chatty_engine:Engine",
                env={**NO_TOKEN, "PYTHONPATH": str(engine_dir), "CHATTY_HANG_AT_IMPORT": "1"},
                startup_timeout=timeout,
                log_dir=tmp_path / f"logs-{timeout}",
            )
        message = str(raised.value)
        assert f"worker 0 printed no address within {timeout}s" in message
        assert children() == before
        if "waiting for a lock that never comes" in message:
            break
    assert "waiting for a lock that never comes" in message


def test_default_log_dir_is_a_fresh_temporary_directory(
    engine_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DISTBATCH_LOG_DIR", raising=False)
    with pytest.raises(WorkerUnavailableError) as raised:
        spawn_workers(
            1,
            args=["--engine", "chatty_engine:NoSuchEngine"],
            env={**NO_TOKEN, "PYTHONPATH": str(engine_dir)},
            startup_timeout=60,
        )
    message = str(raised.value)
    assert "exited with code 2" in message
    assert "has no attribute 'NoSuchEngine'" in message
    match = re.search(r"its log (\S+/distbatch-workers-[^/]+/worker-0-\d+\.log)", message)
    assert match is not None, message
    log = Path(match.group(1))
    assert log.is_file()
    log.unlink()
    log.parent.rmdir()  # it held nothing else


# --------------------------------------------------------------------------- the group's log directory


@pytest.fixture
def temp_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No $DISTBATCH_LOG_DIR, and a temporary directory of the test's own, where a group's log
    directory is made."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.delenv("DISTBATCH_LOG_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def test_a_group_logs_into_one_directory_removed_when_it_stops_cleanly(temp_root: Path) -> None:
    group = WorkerGroup.local(2, env=NO_TOKEN)
    (log_dir,) = temp_root.iterdir()  # one directory for the group, not one per worker
    assert log_dir.name.startswith("distbatch-workers-") and group.log_dir == log_dir
    pids = [p.pid for p in group.processes]
    assert sorted(log_dir.iterdir()) == sorted(group.log_files)
    assert [f.name for f in group.log_files] == [f"worker-{i}-{pid}.log" for i, pid in enumerate(pids)]
    group.shutdown()
    assert list(temp_root.iterdir()) == []  # nothing piles up run after run


def test_a_failed_start_keeps_the_group_log_directory_and_names_it(temp_root: Path) -> None:
    with pytest.raises(WorkerUnavailableError) as raised:
        WorkerGroup.local(2, "engines_for_tests:BrokenEngine", env=NO_TOKEN)
    (log_dir,) = temp_root.iterdir()
    message = str(raised.value)
    assert f"the workers' logs are kept in {log_dir};" in message
    assert "RuntimeError: rank 0 of 2: no GPU for this rank" in message  # the log's tail
    logs = sorted(log_dir.glob("worker-*.log"))
    assert [p.name.split("-")[1] for p in logs] == ["0", "1"]  # every worker's log, not only the failed one
    assert "no GPU for this rank" in logs[0].read_text()


def test_a_worker_that_crashed_keeps_the_logs_and_the_error_names_its_file(temp_root: Path) -> None:
    group = WorkerGroup.local(2, "engines_for_tests:EchoEngine", env=NO_TOKEN)
    try:
        crashed = group.processes[1]
        crashed.kill()
        with pytest.raises(WorkerUnavailableError, match="exited with code -9; its log, kept: ") as raised:
            group.call_all("whoami")
        assert str(crashed.log_file) in str(raised.value)
    finally:
        group.shutdown()
    assert group.log_dir is not None and sorted(group.log_dir.iterdir()) == sorted(group.log_files)
    # Even the killed worker's log says what it was; the other's says it stopped.
    killed, stopped = crashed.log_file.read_text(), group.processes[0].log_file.read_text()
    assert f"distbatch worker {crashed.node} serving: pid {crashed.pid}, rank 1 of 2" in killed
    assert "engine engines_for_tests:EchoEngine" in killed and "stopped" not in killed
    assert f"distbatch worker {group.nodes[0]} stopped" in stopped


def test_a_given_log_dir_is_never_removed(tmp_path: Path) -> None:
    mine = tmp_path / "my-logs"
    with WorkerGroup.local(2, env=NO_TOKEN, log_dir=mine) as group:
        assert group.log_dir == mine
    assert sorted(mine.iterdir()) == sorted(group.log_files) and len(group.log_files) == 2


def test_distbatch_log_dir_sets_the_default(
    engine_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DISTBATCH_LOG_DIR", str(tmp_path / "job-logs"))
    with pytest.raises(WorkerUnavailableError) as raised:
        spawn_workers(
            1,
            args=["--engine", "chatty_engine:NoSuchEngine"],
            env={**NO_TOKEN, "PYTHONPATH": str(engine_dir)},
            startup_timeout=60,
        )
    logs = list((tmp_path / "job-logs").glob("worker-0-*.log"))
    assert len(logs) == 1 and str(logs[0]) in str(raised.value)
    assert "has no attribute 'NoSuchEngine'" in logs[0].read_text()


# --------------------------------------------------------------------------- import path


JOB = """
import os
from distbatch import WorkerGroup

with WorkerGroup.local(1, engine="myrl.engine:Engine", call_timeout=30) as group:
    print("RESULT", group.call_on(0, "where"), flush=True)
"""

MYRL_ENGINE = """
import os


class Engine:
    def where(self) -> list[str]:
        return [__file__, os.getcwd()]
"""


def test_engine_next_to_the_controller_script_imports_in_workers(tmp_path: Path) -> None:
    """Long (10-35 s): a controller script runs in a process of its own and starts workers that import
    its engine."""
    # `cd / && python /path/job.py` with package `myrl` next to job.py: the worker (cwd /) used to
    # fail with "No module named 'myrl'", reported only as an exit code.
    project = tmp_path / "project"
    (project / "myrl").mkdir(parents=True)
    (project / "myrl" / "__init__.py").write_text("")
    (project / "myrl" / "engine.py").write_text(MYRL_ENGINE)
    (project / "job.py").write_text(JOB)
    env = {**os.environ, **NO_TOKEN}
    env.pop("PYTHONPATH", None)  # only the script's own directory makes `myrl` importable
    result = subprocess.run(
        [sys.executable, str(project / "job.py")],
        cwd="/",
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULT")]
    assert line == f"RESULT {[str(project / 'myrl' / 'engine.py'), '/']}"


# --------------------------------------------------------------------------- the CLI itself


@pytest.fixture
def cli(tmp_path: Path) -> Iterator[Callable[..., tuple[subprocess.Popen[bytes], Path]]]:
    """Factory: `python -m rpc_server ARGS`, stdout piped, stderr to a file; stopped at teardown."""
    processes: list[subprocess.Popen[bytes]] = []

    def start(*args: str, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path]:
        stderr_path = tmp_path / f"cli-{len(processes)}.stderr"
        with stderr_path.open("wb") as stderr:
            process = subprocess.Popen(
                [sys.executable, "-m", "rpc_server", "--exit-with-parent", str(os.getpid()), *args],
                stdout=subprocess.PIPE,
                stderr=stderr,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **NO_TOKEN, **env},
            )
        processes.append(process)
        return process, stderr_path

    yield start
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=10)


def test_cli_address_is_the_only_stdout_line_whatever_the_engine_prints(
    cli: Callable[..., tuple[subprocess.Popen[bytes], Path]], engine_dir: Path
) -> None:
    # No PYTHONUNBUFFERED here: the worker must not depend on a launcher setting it.
    env = {"PYTHONPATH": str(engine_dir), "PYTHONUNBUFFERED": ""}
    process, stderr_path = cli("--port", "0", "--engine", "chatty_engine:Engine", env=env)
    node = read_first_line(process, 60.0)
    assert node is not None and ADDRESS.fullmatch(node), node
    response = HTTP.post(
        f"http://{node}/v1/call/chat",
        data=encode_call([200_000, "CLI-MARKER"], {}),
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    stderr = wait_for_text(stderr_path, "CLI-MARKER")  # line-buffered even when not a tty
    assert "loading model weights..." in stderr and "CLI-MARKER" in stderr
    process.send_signal(signal.SIGTERM)
    stdout, _ = process.communicate(timeout=10)
    assert process.returncode == 0
    assert stdout == b""  # nothing after the address line: engine output all went to stderr
