"""This test process's child processes, read from /proc: tests check that a failed or refused
start leaves none behind (imported by every tier; Linux only).

Workers forked from a fork server (`distbatch.launch.forkserver`) are the server's children, not
ours: they count as ours, and the server itself, which lives as long as this process, does not.
"""

from __future__ import annotations

import os
from pathlib import Path

FORK_SERVER = b"rpc_server.forkserver"


def _processes(zombies: bool) -> dict[int, int]:
    """pid -> parent pid of every process (`zombies`: those not waited for too)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        if zombies or fields[0] not in ("Z", "X"):
            parents[int(entry)] = int(fields[1])
    return parents


def parent_of(pid: int) -> int:
    """The parent pid of a running process."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def is_fork_server(pid: int) -> bool:
    """Whether `pid` is a fork server (`python -m rpc_server.forkserver`)."""
    try:
        return FORK_SERVER in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def children(zombies: bool = True) -> set[int]:
    """Pids of this process's child processes, and of the workers its fork servers forked;
    `zombies`: count our own children that exited and were not waited for too.

    A forked worker that exited is a zombie of its server until the server reaps it, which it
    does right after it has told us the exit code (so its pid cannot be reused while we may still
    signal it): once we know it exited, it is not ours to wait for, and does not count."""
    parents = _processes(zombies)
    direct = {pid for pid, parent in parents.items() if parent == os.getpid()}
    servers = {pid for pid in direct if is_fork_server(pid)}
    living = parents if not zombies else _processes(zombies=False)
    forked = {pid for pid, parent in living.items() if parent in servers}
    return (direct - servers) | forked
