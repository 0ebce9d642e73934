"""Workers forked from a fork server (`python -m rpc_server.forkserver`) instead of started as new
interpreters: the same `python -m rpc_server` process, from about 0.05 CPU-seconds instead of
0.3 (what a new interpreter spends importing Flask, werkzeug and numpy).

`ForkServers` keeps one server per interpreter and start-up environment for this process,
started on first use; `ForkServers.start` hands back a `ForkedProcess`, which answers as much
of `subprocess.Popen` as the launcher uses (pid, stdout, poll, wait, send_signal, kill,
returncode). A worker's exit code comes from the server, which reaps it, through a pipe.

Only what a process takes once, at start-up, cannot differ between a fork and a new process:
the variables the interpreter and native libraries read when they load (`startup_environment`:
PYTHON*, LD_*, TORCH_*, PYTORCH_*, NPY_*, the locale, the thread-count and allocator variables
of OpenMP, MKL, OpenBLAS and glibc), and
what a child inherits from its parent (`inherited_attributes`: resource limits, priority, CPU
affinity). A worker whose environment or parent differs in them gets a server of its own,
started from this process as it is now. A worker runs the distbatch, rpc_server and Flask its
server imported (this process's, by this process's import path), whatever its own PYTHONPATH
adds; engines and everything else import from its own path. A server that dies (it exits only
with this process, so a crash) takes its workers with it within a second; they count as killed
from the moment it is gone.
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import IO

from distbatch.errors import WorkerUnavailableError

# Read by the interpreter or a native library when it loads, not later.
STARTUP_PREFIXES = (
    "PYTHON", "LD_", "OMP_", "MKL_", "OPENBLAS_", "GOMP_", "KMP_", "MALLOC_", "GLIBC_", "TORCH_",
    "PYTORCH_", "NPY_", "LANG", "LC_",
)
ANSWER_TIMEOUT = 60.0  # seconds a fork server may take to fork (it imports torch once)
# PYTHONPATH becomes the fork's `sys.path`; PYTHONUNBUFFERED is how every worker runs.
APPLIED_IN_THE_FORK = ("PYTHONPATH", "PYTHONUNBUFFERED")
RESOURCE_LIMITS = tuple(getattr(resource, n) for n in sorted(dir(resource)) if n.startswith("RLIMIT_"))
ENV_SPAWN = "DISTBATCH_SPAWN"  # "exec": start every worker as a new interpreter


def startup_environment(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The variables of `env` a process reads only when it starts, sorted."""
    return tuple(
        sorted(
            (k, v)
            for k, v in env.items()
            if k.startswith(STARTUP_PREFIXES) and k not in APPLIED_IN_THE_FORK
        )
    )


def inherited_attributes() -> tuple[object, ...]:
    """What a child inherits from this process besides its environment: every resource limit
    (open files, file size, ...), the scheduling priority and the CPU affinity."""
    limits = tuple(resource.getrlimit(limit) for limit in RESOURCE_LIMITS)
    return limits, os.getpriority(os.PRIO_PROCESS, 0), tuple(sorted(os.sched_getaffinity(0)))


def forking_allowed() -> bool:
    """Whether workers may be forked here (`DISTBATCH_SPAWN=exec` says no; Linux only)."""
    return sys.platform.startswith("linux") and os.environ.get(ENV_SPAWN, "").strip().lower() != "exec"


class ForkedProcess:
    """A worker the fork server started: Popen's answers, its exit code read from a pipe."""

    def __init__(self, pid: int, stdout: IO[bytes], exit_pipe: int) -> None:
        self.pid = pid
        self.stdout: IO[bytes] | None = stdout
        self.returncode: int | None = None
        self.args = ["python", "-m", "rpc_server"]
        self._exit_pipe = exit_pipe
        self._lock = threading.Lock()

    def _collect(self, timeout: float | None) -> int | None:
        # As Popen.poll: a poll while another thread waits answers at once.
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            return self.returncode
        try:
            if self.returncode is not None:
                return self.returncode
            poller = select.poll()  # not select(): descriptors past 1024 are common here
            poller.register(self._exit_pipe, select.POLLIN)
            if not poller.poll(None if timeout is None else int(timeout * 1000)):
                return None
            data = os.read(self._exit_pipe, 64)
            os.close(self._exit_pipe)
            # Nothing written: the server is gone (it only exits once this process closed its
            # socket, so this is a crash); the worker stops with it within a second (it watches
            # the server), and counts as killed from now.
            self.returncode = int(data) if data.strip() else -int(signal.SIGKILL)
            return self.returncode
        finally:
            self._lock.release()

    def poll(self) -> int | None:
        return self._collect(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._collect(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # not after it exited: its pid may belong to another process
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __del__(self) -> None:
        if self.returncode is None:
            try:
                os.close(self._exit_pipe)
            except OSError:
                pass


class _Server:
    """One fork server process and the socket to it."""

    def __init__(self, python: str, env: Mapping[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.process = subprocess.Popen(
                [python, "-m", "rpc_server.forkserver", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=dict(env),
            )
        self.sock = ours
        self.sock.settimeout(ANSWER_TIMEOUT)
        self.lock = threading.Lock()
        self.broken = False

    def start(self, argv: Sequence[str], env: Mapping[str, str], cwd: str, stderr: int) -> ForkedProcess:
        """Fork a worker with `argv` (`--exit-with-parent` naming this server added)."""
        argv = [*argv, "--exit-with-parent", str(self.process.pid)]
        request = json.dumps({"argv": argv, "env": dict(env), "cwd": cwd}).encode()
        out_r, out_w = os.pipe()
        exit_r, exit_w = os.pipe()
        try:
            with self.lock:
                try:
                    socket.send_fds(self.sock, [request], [out_w, stderr, exit_w])
                    answer = json.loads(self.sock.recv(4096) or b"{}")
                except BaseException:
                    # An answer may still come (or a request be half sent): this socket is out
                    # of step. Close it: the server exits, and a worker it forked follows.
                    self.broken = True
                    self.sock.close()
                    raise
        except BaseException:
            os.close(out_r)
            os.close(exit_r)
            raise
        finally:
            os.close(out_w)
            os.close(exit_w)
        if "pid" not in answer:
            os.close(out_r)
            os.close(exit_r)
            raise OSError(answer.get("error", "the fork server closed its socket"))
        return ForkedProcess(answer["pid"], os.fdopen(out_r, "rb", buffering=0), exit_r)

    def alive(self) -> bool:
        return not self.broken and self.process.poll() is None

    def close(self) -> None:
        self.sock.close()  # the server exits; its workers follow it
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class ForkServers:
    """This process's fork servers, one per interpreter, start-up environment and inherited
    attributes."""

    def __init__(self) -> None:
        self._servers: dict[tuple[object, ...], _Server] = {}
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        """In a fork of this process: its servers answer the parent, not us."""
        self._servers = {}
        self._lock = threading.Lock()

    def _server(self, python: str, env: Mapping[str, str]) -> _Server:
        key = (python, startup_environment(env), inherited_attributes())
        with self._lock:
            server = self._servers.get(key)
            if server is None or not server.alive():
                if server is not None:
                    server.close()
                server = self._servers[key] = _Server(python, env)
            return server

    def start(
        self, python: str, argv: Sequence[str], env: Mapping[str, str], stderr: int
    ) -> ForkedProcess:
        """Fork `python -m rpc_server ARGV` with environment `env`, stderr to the fd `stderr`; its
        `--exit-with-parent` names the server (which exits with this process)."""
        server = self._server(python, env)
        try:
            return server.start(argv, env, os.getcwd(), stderr)
        except OSError as exc:
            raise WorkerUnavailableError(
                f"{python} -m rpc_server.forkserver", f"could not fork a worker: {exc}"
            ) from exc

    def close(self) -> None:
        with self._lock:
            servers, self._servers = list(self._servers.values()), {}
        for server in servers:
            server.close()

