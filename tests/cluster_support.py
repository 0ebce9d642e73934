"""What the tests on simulated hosts (`simcluster`) share: the environment a process in a host
runs with, per-run resource prefixes and the removal of what killed runs left, workers started in
a host, and scripts in a host spoken to by lines (tests/system/test_cluster*.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from distbatch.launch.local import log_tail, read_first_line
from distbatch.transport.shm import ENV_SWITCH
from simcluster import Cluster, down, leftovers, stop_namespaces, stop_process

REPO = Path(__file__).resolve().parents[1]
STEP_TIMEOUT = 120.0  # seconds for any one subprocess step


def cluster_env(pythonpath: Sequence[str | Path] = ()) -> dict[str, str]:
    """This process's environment for a process in a host: the repository (and `pythonpath`) on
    its import path, the same-host path on as in production, no proxy."""
    env = dict(os.environ)
    paths = [*map(str, pythonpath), str(REPO), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    # The root conftest turns the same-host path off; across hosts it is on, as in production,
    # and must decide by itself that a worker in another host is not on this one.
    env.pop(ENV_SWITCH, None)
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        env.pop(name, None)
    return env


def run_prefix(tag: str) -> str:
    """Unique per run: the test process's pid, within the prefix limit ("dt" + tag + pid)."""
    return f"dt{tag}{os.getpid()}"


def remove_stale() -> None:
    """Take down what earlier runs left when killed mid-test (their pid is gone)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    for tag, pid in set(re.findall(r"^dt([a-z])(\d+)h\d+", listing, re.MULTILINE)):
        if not Path(f"/proc/{pid}").exists():
            down(f"dt{tag}{pid}")


@contextlib.contextmanager
def fresh_cluster(hosts: int, rate: str, tag: str) -> Iterator[Cluster]:
    """`hosts` simulated hosts at `rate` under this run's prefix for `tag` (`run_prefix`), once
    whatever killed runs left is gone; after it, nothing it made is left (asserted)."""
    remove_stale()
    prefix = run_prefix(tag)
    with Cluster.up(hosts, rate=rate, prefix=prefix) as made:
        yield made
    assert leftovers(prefix) == []


def remove_stale_ray(stem: str) -> None:
    """Stop the processes in, then take down, the clusters `<stem><pid>` that earlier runs of a Ray
    test left when killed (their pid is gone): Ray's processes outlive their test."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    for pid in set(re.findall(rf"^{stem}(\d+)h\d+", listing, re.MULTILINE)):
        if not Path(f"/proc/{pid}").exists():
            stop_namespaces(re.findall(rf"^({stem}{pid}h\d+)", listing, re.MULTILINE))
            down(f"{stem}{pid}")


def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie counts as gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return "State:\tZ" not in status


class HostWorker:
    """A distbatch worker (`python -m rpc_server`) in one host, bound to its cluster address."""

    def __init__(
        self,
        cluster: Cluster,
        host: int,
        log: Path,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.log = log
        argv = [sys.executable, "-m", "rpc_server", "--host", cluster.address(host), "--port", "0",
                "--exit-with-parent", str(os.getpid()), "--log-level", "INFO", *args]  # fmt: skip
        with log.open("wb") as log_file:
            self.process = cluster.popen(
                host, argv, stdout=subprocess.PIPE, stderr=log_file, env=env or cluster_env(), cwd=REPO
            )
        try:
            node = read_first_line(self.process, timeout=60.0)
            if node is None or not node.startswith(cluster.address(host) + ":"):
                raise RuntimeError(f"the worker in host {host} did not start ({node!r}): {log_tail(log)}")
        except BaseException:
            self.stop()
            raise
        self.node = node

    def stop(self) -> None:
        stop_process(self.process)


class HostScript:
    """A Python script run in one host, spoken to by lines: commands on its stdin, one JSON object
    per answer on its stdout (read with a timeout, so a script that hangs fails the test instead
    of hanging it); its stderr goes to `log`."""

    def __init__(
        self, cluster: Cluster, host: int, script: Path, args: Sequence[str], log: Path, env: dict[str, str]
    ) -> None:
        self.log = log
        self._answers: queue.Queue[str | None] = queue.Queue()
        with log.open("wb") as log_file:
            self.process = cluster.popen(
                host, [sys.executable, str(script), *args],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file, text=True, env=env, cwd=REPO,
            )  # fmt: skip
        stdout = self.process.stdout
        if stdout is None:  # for type checkers: popen was given a pipe
            raise RuntimeError("no stdout pipe")
        threading.Thread(target=self._read, args=(stdout,), daemon=True).start()

    def _read(self, stdout: IO[str]) -> None:
        try:
            for line in stdout:
                self._answers.put(line)
        except ValueError:  # closed by stop()
            pass
        self._answers.put(None)

    def send(self, line: str) -> None:
        stdin = self.process.stdin
        if stdin is None:
            raise RuntimeError("no stdin pipe")
        stdin.write(line + "\n")
        stdin.flush()

    def answer(self, timeout: float = STEP_TIMEOUT) -> dict[str, Any]:
        """The script's next JSON line; AssertionError (with its log) if none comes in `timeout` s."""
        try:
            line = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no answer in {timeout:g} s; log:\n{log_tail(self.log)}") from None
        if line is None:
            code = self.process.wait(STEP_TIMEOUT)
            raise AssertionError(f"the script ended (exit {code}); log:\n{log_tail(self.log)}")
        return json.loads(line)

    def ask(self, line: str, timeout: float = STEP_TIMEOUT) -> dict[str, Any]:
        self.send(line)
        return self.answer(timeout)

    def stop(self) -> None:
        """Close its stdin (it ends by itself), and terminate it if it does not."""
        if self.process.stdin is not None and self.process.poll() is None:
            try:
                self.process.stdin.close()
                self.process.wait(STEP_TIMEOUT / 4)
            except (OSError, subprocess.TimeoutExpired):
                pass
        stop_process(self.process)
