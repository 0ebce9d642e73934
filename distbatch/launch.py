"""Start `python -m rpc_server` processes on this machine and stop them reliably."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from distbatch.errors import WorkerUnavailableError


class WorkerProcess:
    """One spawned worker: its process and the `host:port` it printed on start."""

    def __init__(self, process: subprocess.Popen[bytes], node: str) -> None:
        self.process = process
        self.node = node

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout`."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()

    def terminate(self) -> None:
        """Send SIGTERM without waiting (see `stop`)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL at once (for failure tests)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __repr__(self) -> str:
        return f"WorkerProcess(node={self.node!r}, pid={self.pid})"


def _read_address(process: subprocess.Popen[bytes], deadline: float) -> str | None:
    """The first stdout line of a starting worker, or None if it exits or the deadline passes."""
    stdout = process.stdout
    if stdout is None:
        return None
    line = b""
    with selectors.DefaultSelector() as selector:
        selector.register(stdout, selectors.EVENT_READ)
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if selector.select(timeout=min(remaining, 0.5)):
                chunk = os.read(stdout.fileno(), 256)
                if not chunk:
                    return None
                line += chunk
            elif process.poll() is not None:
                return None
    return line.decode(errors="replace").strip() or None


def read_first_line(process: subprocess.Popen[bytes], timeout: float) -> str | None:
    """The first complete stdout line of `process` (stripped), or None if it exits or times out."""
    return _read_address(process, time.monotonic() + timeout)


def spawn_workers(
    count: int,
    *,
    host: str = "127.0.0.1",
    args: Sequence[str] = (),
    env: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
    startup_timeout: float = 60.0,
    exit_with_parent: bool = True,
    python: str = sys.executable,
) -> list[WorkerProcess]:
    """Start `count` workers on free ports (in parallel); return once all printed their address.

    `env` adds variables to every worker, or one mapping per worker (e.g.
    CUDA_VISIBLE_DEVICES). With `exit_with_parent` a worker exits by itself
    when this process dies, even by SIGKILL, so no worker is ever orphaned.
    If any worker fails to start, all are stopped and `WorkerUnavailableError` raised.
    """
    if count < 1:
        raise ValueError(f"worker count must be >= 1, got {count}")
    envs = list(env) if isinstance(env, Sequence) else [env or {}] * count
    if len(envs) != count:
        raise ValueError(f"{len(envs)} env mappings for {count} workers")
    command = [python, "-m", "rpc_server", "--host", host, "--port", "0", *args]
    if exit_with_parent:
        command += ["--exit-with-parent", str(os.getpid())]
    processes = [
        subprocess.Popen(
            command, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env={**os.environ, **extra}
        )
        for extra in envs
    ]
    deadline = time.monotonic() + startup_timeout
    workers: list[WorkerProcess] = []
    failure: str | None = None
    for process in processes:
        node = _read_address(process, deadline)
        if node is None:
            try:  # it closed its stdout without an address: most likely exiting, so get its code
                code = process.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                code = None
            status = "did not print an address" if code is None else f"exited with code {code}"
            failure = failure or f"worker {status} within {startup_timeout}s"
            node = "?"
        workers.append(WorkerProcess(process, node))
    if failure is not None:
        for worker in workers:
            worker.stop()
        raise WorkerUnavailableError(" ".join(command), failure)
    return workers


def spawn_worker(
    *,
    host: str = "127.0.0.1",
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    startup_timeout: float = 60.0,
    exit_with_parent: bool = True,
    python: str = sys.executable,
) -> WorkerProcess:
    """Start one worker on a free port and return once it has printed its address."""
    return spawn_workers(
        1,
        host=host,
        args=args,
        env=env,
        startup_timeout=startup_timeout,
        exit_with_parent=exit_with_parent,
        python=python,
    )[0]
