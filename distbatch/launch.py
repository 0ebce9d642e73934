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

    def kill(self) -> None:
        """SIGKILL at once (for failure tests)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __repr__(self) -> str:
        return f"WorkerProcess(node={self.node!r}, pid={self.pid})"


def spawn_worker(
    *,
    host: str = "127.0.0.1",
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    startup_timeout: float = 60.0,
    python: str = sys.executable,
) -> WorkerProcess:
    """Start one worker on a free port and return once it has printed its address."""
    command = [python, "-m", "rpc_server", "--host", host, "--port", "0", *args]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    stdout = process.stdout
    if stdout is None:  # cannot happen with stdout=PIPE; keeps type checkers honest
        raise RuntimeError("worker stdout is not a pipe")
    deadline = time.monotonic() + startup_timeout
    line = b""
    with selectors.DefaultSelector() as selector:
        selector.register(stdout, selectors.EVENT_READ)
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or process.poll() is not None:
                break
            if selector.select(timeout=min(remaining, 0.5)):
                chunk = os.read(stdout.fileno(), 256)
                if not chunk:
                    break
                line += chunk
    node = line.decode(errors="replace").strip()
    if not line.endswith(b"\n") or not node:
        exit_code = process.poll()
        WorkerProcess(process, "?").stop()
        status = "did not print an address" if exit_code is None else f"exited with {exit_code}"
        raise WorkerUnavailableError(" ".join(command), f"worker {status} within {startup_timeout}s")
    return WorkerProcess(process, node)
