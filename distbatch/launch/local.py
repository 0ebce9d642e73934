"""Start `python -m rpc_server` processes on this machine and stop them reliably.

A worker's stdout carries one line, its address; everything else it writes (an engine's
prints and logs, in any amount) goes to its stderr, which is a per-worker log file here:
never a pipe nobody reads, so output can never block a worker. The workers started together
log into one directory (`WorkerLogs`), which goes away with them when they all stopped cleanly.
"""

from __future__ import annotations

import os
import selectors
import signal
import site
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from distbatch.errors import InvalidArgumentError, WorkerUnavailableError
from distbatch.ids import validate_node
from distbatch.launch.flags import check_rank
from distbatch.launch.forkserver import ForkedProcess, ForkServers, forking_allowed

# One set of fork servers per process, as multiprocessing keeps one forkserver: every launcher
# in the process forks its workers from them (see `distbatch.launch.forkserver`).
FORK_SERVERS = ForkServers()

LOG_TAIL_LINES = 20  # lines of a worker's log quoted when it fails to start
LOG_DIR_PREFIX = "distbatch-workers-"


class WorkerLogs:
    """The directory the workers started together log into, one file per worker.

    A directory this module made (`owned`: a new temporary one) is removed once every worker
    logging into it stopped cleanly (exit code 0), so runs leave nothing behind; once one
    failed (exited by itself, crashed, was killed, never started) it stays, logs and all, and
    errors name it. A directory the caller named (`log_dir=`, `$DISTBATCH_LOG_DIR`) is never
    removed. Several owners may share one directory (Ray actors on one node, `shared_name`):
    each removes only the files of its own workers, and the directory once it is empty.
    """

    def __init__(self, path: Path, owned: bool) -> None:
        self.path = path
        self.owned = owned
        self.failed = False
        self._files: list[Path] = []
        self._running = 0
        self._lock = threading.Lock()

    @classmethod
    def open(
        cls, log_dir: str | os.PathLike[str] | None = None, shared_name: str | None = None
    ) -> WorkerLogs:
        """`log_dir` (made if missing), else `$DISTBATCH_LOG_DIR`; else, owned, `shared_name` in the
        temporary directory (made if missing) or a new `distbatch-workers-*` one there."""
        given = log_dir if log_dir is not None else os.environ.get("DISTBATCH_LOG_DIR") or None
        if given is not None:
            path = Path(given)
            path.mkdir(parents=True, exist_ok=True)
            return cls(path, owned=False)
        if shared_name is not None:
            path = Path(tempfile.gettempdir()) / shared_name
            path.mkdir(mode=0o700, exist_ok=True)
            return cls(path, owned=True)
        return cls(Path(tempfile.mkdtemp(prefix=LOG_DIR_PREFIX)), owned=True)

    def started(self, log_file: Path | None) -> None:
        """A worker logging to `log_file` started."""
        with self._lock:
            if log_file is not None:
                self._files.append(log_file)
            self._running += 1

    def keep(self) -> None:
        """Keep the logs whatever happens next (a start failed)."""
        with self._lock:
            self.failed = True

    def stopped(self, clean: bool) -> None:
        """One of the workers exited (`clean`: with code 0); after the last, remove what was ours
        if every one exited cleanly."""
        with self._lock:
            self.failed = self.failed or not clean
            self._running -= 1
            if self._running > 0 or self.failed or not self.owned:
                return
            files, self._files = self._files, []
        for file in files:
            file.unlink(missing_ok=True)
        try:
            self.path.rmdir()
        except OSError:  # not empty (another owner's logs, a file someone added) or gone already
            pass

    def __repr__(self) -> str:
        return f"WorkerLogs({str(self.path)!r}, owned={self.owned}, failed={self.failed})"


class WorkerProcess:
    """One spawned worker: its process, the `host:port` it printed on start and its log file.

    `log_file` holds everything the worker wrote besides its address (None if not known);
    `logs`, if given, is told when the worker stopped (see `WorkerLogs`).
    """

    def __init__(
        self,
        process: subprocess.Popen[bytes] | ForkedProcess,
        node: str,
        log_file: Path | None = None,
        logs: WorkerLogs | None = None,
    ) -> None:
        self.process = process
        self.node = node
        self.log_file = log_file
        self.logs = logs
        self._reported = False
        if logs is not None:
            logs.started(log_file)

    def _report_exit(self, meant: bool = False) -> None:
        """Tell `logs`, once, how the process exited (call once it has; `meant`: as the caller
        wanted, so a kill is not a failure whose logs must be kept)."""
        if self.logs is not None and not self._reported:
            self._reported = True
            self.logs.stopped(clean=meant or self.process.returncode == 0)

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
        self._report_exit()

    def terminate(self) -> None:
        """Send SIGTERM without waiting (see `stop`)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def kill(self, meant: bool = False) -> None:
        """SIGKILL at once (for failure tests). `meant`: the kill is the point (a drill, such as
        the main job's `--kill-rollout`), not a failure: the group's logs need not be kept for it."""
        alive = self.process.poll() is None
        if alive:
            self.process.kill()
            self.process.wait()
        self._report_exit(meant=meant and alive)

    def __repr__(self) -> str:
        return f"WorkerProcess(node={self.node!r}, pid={self.pid})"


def _read_address(process: subprocess.Popen[bytes] | ForkedProcess, deadline: float) -> str | None:
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


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a log file ('' if it is empty or unreadable)."""
    try:
        with path.open("rb") as log:
            size = log.seek(0, os.SEEK_END)
            log.seek(max(0, size - 64 * 1024))
            data = log.read()
    except OSError:
        return ""
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


def _is_within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def controller_import_path() -> list[str]:
    """This process's `sys.path`, made absolute ('' is the cwd), less the interpreter's own dirs.

    Workers get it through PYTHONPATH, as multiprocessing's spawn hands `sys.path` to its
    children, so an engine module importable here (next to the script, from the cwd, or via
    `sys.path` edits) is importable in the workers too, whatever their cwd. The standard library
    and site-packages are left out: a worker's interpreter (maybe another `python`) has its own.
    """
    own = {
        os.path.abspath(d)
        for d in [
            *(sysconfig.get_path(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")),
            *site.getsitepackages(),
            site.getusersitepackages(),
        ]
        if d
    }
    paths: list[str] = []
    for entry in sys.path:
        if not isinstance(entry, str):
            continue
        path = os.path.abspath(entry or os.curdir)
        if path in paths or not os.path.exists(path) or any(_is_within(path, d) for d in own):
            continue
        paths.append(path)
    return paths


def _worker_env(extra: Mapping[str, str], import_path: Sequence[str]) -> dict[str, str]:
    """The environment of one worker: ours, unbuffered output, `extra`, and our import path.

    PYTHONPATH: entries `extra` gives first (the caller asked for them), then this process's
    import path, then any PYTHONPATH we inherited, without repeats.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
    entries = [
        *extra.get("PYTHONPATH", "").split(os.pathsep),
        *import_path,
        *os.environ.get("PYTHONPATH", "").split(os.pathsep),
    ]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(e for e in entries if e))
    return env


def _start(
    command: list[str], rank: int, logs: WorkerLogs, env: Mapping[str, str], forked: bool
) -> WorkerProcess:
    """Start one worker (`forked`: from a fork server, else as a new process): stdout a pipe for
    its address line, stderr its log file `worker-<rank>-<pid>.log`."""
    fd, starting = tempfile.mkstemp(prefix=f"worker-{rank}-", suffix=".starting", dir=logs.path)
    process: subprocess.Popen[bytes] | ForkedProcess
    try:
        with open(fd, "wb") as log:
            if forked:
                python, _, _, *args = command  # python -m rpc_server ARGS: the server runs the module
                process = FORK_SERVERS.start(python, args, env, log.fileno())
            else:
                process = subprocess.Popen(
                    command, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, env=env
                )
    except BaseException:
        os.unlink(starting)
        raise
    log_file = logs.path / f"worker-{rank}-{process.pid}.log"
    suffix = 1
    while log_file.exists():  # a pid reused since an earlier run that logged here
        log_file = logs.path / f"worker-{rank}-{process.pid}-{suffix}.log"
        suffix += 1
    os.rename(starting, log_file)  # the worker keeps writing to it: renaming moves no data
    return WorkerProcess(process, "?", log_file, logs)


def _stop_all(workers: Sequence[WorkerProcess]) -> None:
    for worker in workers:
        worker.terminate()  # all at once: each takes a moment to exit
    for worker in workers:
        worker.stop()


def _start_failure(
    worker: WorkerProcess, rank: int, line: str | None, code: int | None, timeout: float
) -> str:
    """Why worker `rank` gave no address, with the tail of its log (call once it is stopped).

    `code` is its exit code if it exited by itself (negative: killed by that signal).
    """
    if line is not None:
        status = f"printed {line!r} instead of its address"
    elif code is not None:
        status = f"exited with code {code} before printing its address"
    else:
        status = f"printed no address within {timeout}s"
    kept = f"; the workers' logs are kept in {worker.logs.path}" if worker.logs is not None else ""
    tail = log_tail(worker.log_file) if worker.log_file is not None else ""
    where = f"its log {worker.log_file}" if worker.log_file is not None else "no log"
    return f"worker {rank} {status}{kept}; {where}" + (f" ends with:\n{tail}" if tail else " is empty")


def _given_port(args: Sequence[str]) -> str | None:
    """The value of the last `--port` in worker flags `args` (the one argparse keeps), if any."""
    port = None
    for flag, value in zip(args, [*args[1:], None]):
        if flag == "--port" and value is not None:
            port = value
        elif flag.startswith("--port="):
            port = flag.partition("=")[2]
    return port


def spawn_workers(
    count: int,
    *,
    host: str = "127.0.0.1",
    args: Sequence[str] = (),
    env: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
    startup_timeout: float = 60.0,
    exit_with_parent: bool = True,
    python: str = sys.executable,
    log_dir: str | os.PathLike[str] | WorkerLogs | None = None,
    first_rank: int = 0,
    world_size: int | None = None,
    fork: bool | None = None,
) -> list[WorkerProcess]:
    """Start `count` workers on free ports (in parallel); return once all printed their address.

    Worker i runs with `--rank first_rank + i --world-size world_size` (default `count`): its
    engine's `WorkerContext.rank` and `world_size`; `args` come after, so flags there win (a
    `--port` other than 0 only for one worker: `ValueError` for more). `env`
    adds variables to every worker, or one mapping per worker (e.g. CUDA_VISIBLE_DEVICES).
    Workers import with this process's import path (see `controller_import_path`) ahead of any
    PYTHONPATH they inherit. Each worker's output goes to `worker-<rank>-<pid>.log` in one
    directory for all of them (`WorkerProcess.logs`, see `WorkerLogs`): `log_dir` if given
    (never removed), else `$DISTBATCH_LOG_DIR` if set (never removed), else a new temporary
    directory, removed once every worker stopped cleanly. With `exit_with_parent` a worker
    exits by itself when this process dies, even by SIGKILL, so no worker is orphaned. Workers
    are forked from this process's fork server (`distbatch.launch.forkserver`: a sixth of the CPU
    of a new interpreter) where they can be: this interpreter, `exit_with_parent`, and not
    `DISTBATCH_SPAWN=exec`; `fork=False` starts new interpreters anyway. If any
    worker fails to start, all are stopped and `WorkerUnavailableError` raised, quoting the end
    of the failed worker's log and naming the directory, which is kept.
    """
    if count < 1:
        raise InvalidArgumentError(f"worker count must be >= 1, got {count}")
    world_size = count if world_size is None else world_size
    check_rank(first_rank, world_size, "first_rank")
    check_rank(first_rank + count - 1, world_size, "the last worker's rank")
    port = _given_port(args)
    if count > 1 and port not in (None, "0"):
        raise InvalidArgumentError(
            f"{count} workers cannot all listen on port {port}: leave --port out, and each picks a free one"
        )
    envs = list(env) if isinstance(env, Sequence) else [env or {}] * count
    if len(envs) != count:
        raise InvalidArgumentError(f"{len(envs)} env mappings for {count} workers")
    logs = log_dir if isinstance(log_dir, WorkerLogs) else WorkerLogs.open(log_dir)
    base = [python, "-m", "rpc_server", "--host", host, "--port", "0"]
    ranks = range(first_rank, first_rank + count)
    import_path = controller_import_path()
    worker_envs = [_worker_env(extra, import_path) for extra in envs]
    # Forked from a fork server where it is the same interpreter, and the workers stop with this
    # process (they stop with the server, which stops with us); else each a new interpreter.
    forked = fork is not False and exit_with_parent and python == sys.executable and forking_allowed()
    # A forked worker's --exit-with-parent names its fork server (added by `FORK_SERVERS.start`).
    own = ["--exit-with-parent", str(os.getpid())] if exit_with_parent and not forked else []
    commands = [[*base, "--rank", str(r), "--world-size", str(world_size), *args, *own] for r in ranks]
    workers: list[WorkerProcess] = []
    try:
        for rank, command, worker_env in zip(ranks, commands, worker_envs):
            workers.append(_start(command, rank, logs, worker_env, forked))
        deadline = time.monotonic() + startup_timeout
        for rank, command, worker in zip(ranks, commands, workers):
            line = _read_address(worker.process, deadline)
            try:
                worker.node = validate_node(line)
            except ValueError:
                try:  # no address: most likely it is exiting, so wait a moment for its code
                    code: int | None = worker.process.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    code = None
                logs.keep()
                _stop_all(workers)
                message = _start_failure(worker, rank, line, code, startup_timeout)
                raise WorkerUnavailableError(" ".join(command), message) from None
            if worker.process.stdout is not None:
                worker.process.stdout.close()  # the address is all a worker writes there
    except BaseException:
        logs.keep()
        _stop_all(workers)  # idempotent: stopping a stopped worker does nothing
        raise
    return workers


def spawn_worker(
    *,
    host: str = "127.0.0.1",
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    startup_timeout: float = 60.0,
    exit_with_parent: bool = True,
    python: str = sys.executable,
    log_dir: str | os.PathLike[str] | WorkerLogs | None = None,
    rank: int = 0,
    world_size: int = 1,
    fork: bool | None = None,
) -> WorkerProcess:
    """Start one worker on a free port and return once it has printed its address (see
    `spawn_workers`; `rank` and `world_size` are its place in a group started elsewhere)."""
    return spawn_workers(
        1,
        host=host,
        args=args,
        env=env,
        startup_timeout=startup_timeout,
        exit_with_parent=exit_with_parent,
        python=python,
        log_dir=log_dir,
        first_rank=rank,
        world_size=world_size,
        fork=fork,
    )[0]
