"""`python -m rpc_server.forkserver FD`: start workers by forking a process that has already
imported what a worker imports, instead of starting a new interpreter for each.

A new `python -m rpc_server` spends about 0.3 CPU-seconds importing Flask, werkzeug, numpy and
the rest before it serves; a fork of this process, which imported them once, about 0.05
(16 workers up in 0.45 s instead of 2.3-3.3 s on 2 cores). The launcher
(`distbatch.launch.local`) starts one per process and asks it over the Unix socket FD
(SOCK_SEQPACKET: one message per request) for each worker: a JSON object (the worker's
arguments, environment and working directory) with three file descriptors (its stdout, its
stderr, and a pipe for its exit code); the answer is `{"pid": N}`.

This process starts no thread of its own (forking a threaded process is unsafe; numpy's BLAS
pool re-forms itself after a fork) and imports no engine: an engine, and whatever reads the
environment when it is imported, loads in the worker, under the worker's environment. Once
it has forked one worker with an engine, it imports torch before the next: engines use it, and
it takes a new worker about a CPU-second to import (a process that starts one engine worker in
its life, a Ray actor, never pays for it here). What torch reads when it loads (the
thread-count variables) is part of the start-up environment its launcher keys servers by.

It reaps the workers and writes each one's exit code to its pipe, and exits once the launcher
closes the socket (it exited or died): the workers, started with `--exit-with-parent` naming
this process, then stop too.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import selectors
import signal
import socket
import sys
import traceback
from typing import Any

MAX_REQUEST = 1 << 20  # a worker's arguments and environment
FDS_PER_REQUEST = 3  # stdout, stderr, exit-code pipe


def _preload() -> None:
    """Import what `python -m rpc_server` imports (none of it reads the environment at import)."""
    import rpc_server.__main__  # noqa: F401


def _worker_path(cwd: str, env: dict[str, str], base: list[str]) -> list[str]:
    """`sys.path` as `python -m rpc_server` started in `cwd` with `env` would have it: the
    directory first, then PYTHONPATH's entries, then the interpreter's own."""
    entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [cwd, *entries, *base]


def _run_worker(request: dict[str, Any], stdout: int, stderr: int, base_path: list[str]) -> int:
    """In the forked child: become `python -m rpc_server ARGS` and run it; returns its exit code."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    for fd in {devnull, stdout, stderr} - {0, 1, 2}:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:] = _worker_path(request["cwd"], request["env"], base_path)
    importlib.invalidate_caches()  # directories may have gained modules since this process began
    if "numpy" in sys.modules:  # its global generator would be the same in every worker
        sys.modules["numpy"].random.seed()
    from rpc_server import __main__ as worker

    sys.argv = [worker.__file__, *request["argv"]]
    try:
        worker.main(list(request["argv"]))
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001  (a worker's crash is reported, as the interpreter would)
        traceback.print_exc()
        return 1
    return 0


class ForkServer:
    """The serving loop: requests on the socket, exit codes on SIGCHLD."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.exit_pipes: dict[int, int] = {}  # worker pid -> the write end of its exit-code pipe
        self.engine_workers = 0
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)
        # The interpreter's own path, less what the launcher's PYTHONPATH put there.
        ours = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
        self.base_path = [p for p in sys.path[1:] if os.path.abspath(p) not in ours]
        self.selector = selectors.DefaultSelector()
        self.sigint = signal.getsignal(signal.SIGINT)  # what a worker gets: ignored under nohup
        self.torch_failed = False

    def serve(self) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the launcher, which stops its workers
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        with self.selector:
            self.selector.register(self.sock, selectors.EVENT_READ)
            self.selector.register(self.wake_r, selectors.EVENT_READ)
            while True:
                for key, _ in self.selector.select():
                    if key.fileobj is self.sock and not self._answer():
                        return
                self._reap()

    def _answer(self) -> bool:
        """Serve one request; False once the launcher closed the socket."""
        try:
            data, fds, _, _ = socket.recv_fds(self.sock, MAX_REQUEST, FDS_PER_REQUEST)
        except InterruptedError:
            return True
        if not data:
            for fd in fds:
                os.close(fd)
            return False
        try:
            request = json.loads(data)
            if len(fds) != FDS_PER_REQUEST:
                raise ValueError(f"{len(fds)} file descriptors, expected {FDS_PER_REQUEST}")
            if "--engine" in request["argv"]:
                if self.engine_workers:
                    self._load_torch()
                self.engine_workers += 1
            answer: dict[str, Any] = {"pid": self._fork(request, *fds)}
        except Exception as exc:  # noqa: BLE001  (the launcher raises it)
            for fd in fds:
                os.close(fd)
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        self.sock.send(json.dumps(answer).encode())
        return True

    def _load_torch(self) -> None:
        """Import torch here once, so engine workers fork with it loaded (not where it is missing
        or fails to load: then each worker meets that itself)."""
        if "torch" not in sys.modules and not self.torch_failed:
            try:
                import torch  # noqa: F401
            except Exception:  # noqa: BLE001
                self.torch_failed = True

    def _fork(self, request: dict[str, Any], stdout: int, stderr: int, exit_pipe: int) -> int:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.set_wakeup_fd(-1)
                for signum in (signal.SIGCHLD, signal.SIGTERM):
                    signal.signal(signum, signal.SIG_DFL)
                signal.signal(signal.SIGINT, self.sigint)
                self.selector.close()
                self.sock.close()
                for fd in (self.wake_r, self.wake_w, exit_pipe, *self.exit_pipes.values()):
                    os.close(fd)
                code = _run_worker(request, stdout, stderr, self.base_path)
            except BaseException:  # noqa: BLE001  (before the worker ran: say why in its log)
                traceback.print_exc()
            finally:
                atexit._run_exitfuncs()  # as an interpreter's exit would (the worker's own end skips it)
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream.flush()
                    except (OSError, ValueError, AttributeError):
                        pass
                os._exit(code)
        os.close(stdout)
        os.close(stderr)
        self.exit_pipes[pid] = exit_pipe
        return pid

    def _reap(self) -> None:
        """Drain the wakeup pipe, then write the exit code of every worker that exited, before
        reaping it: until the launcher has read the code, the pid is not free for reuse, so a
        signal the launcher sends meanwhile cannot reach another process."""
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                exited = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if exited is None:
                return
            pid = exited.si_pid
            code = exited.si_status if exited.si_code == os.CLD_EXITED else -exited.si_status
            pipe = self.exit_pipes.pop(pid, None)
            if pipe is not None:
                try:
                    os.write(pipe, f"{code}\n".encode())
                except OSError:  # the launcher stopped listening to this worker
                    pass
                os.close(pipe)
            os.waitpid(pid, 0)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        raise SystemExit("usage: python -m rpc_server.forkserver FD (started by distbatch's launcher)")
    sock = socket.socket(fileno=int(args[0]))
    _preload()
    ForkServer(sock).serve()
    os._exit(0)  # the workers watch this process: they stop once it is gone


if __name__ == "__main__":
    main()
