"""The processes in the hosts: stopping one started there, stopping every process in some hosts'
namespaces (found by pid, never by name), and reading a namespace's TCP table from outside it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

STOP_GRACE = 5.0  # seconds between SIGTERM and SIGKILL in `stop_namespaces`


def stop_process(process: subprocess.Popen[Any], grace: float = 10.0) -> None:
    """Terminate `process` (kill it if it does not go within `grace` seconds) and close its pipes:
    for what benches and tests start in the cluster's hosts."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(grace)
    for stream in (process.stdin, process.stdout, process.stderr):
        if stream is not None:
            stream.close()


def namespace_pids(namespace: str) -> list[int]:
    """The processes in a network namespace (`ip netns pids`)."""
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=30)
    return [int(p) for p in listed.stdout.split()]


def stop_namespaces(namespaces: Sequence[str], grace: float = STOP_GRACE) -> list[int]:
    """Stop every process in `namespaces`: SIGTERM, then SIGKILL to those left after `grace`
    seconds; returns the pids still there after that (empty: all gone). By pid, never by name:
    what runs in other namespaces (other clusters' processes of the same program) is left alone."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        pids = [p for ns in namespaces for p in namespace_pids(ns)]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            time.sleep(0.2)
            pids = [p for ns in namespaces for p in namespace_pids(ns)]
        if not pids:
            return []
    return [p for ns in namespaces for p in namespace_pids(ns)]


def established_tcp(pid: int) -> list[tuple[str, str]]:
    """The established TCP (IPv4) connections of the network namespace process `pid` is in, as
    (local "a.b.c.d:port", remote "a.b.c.d:port"): /proc/<pid>/net/tcp is that namespace's table,
    read from anywhere without entering it."""
    out = []
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) > 3 and parts[3] == "01":  # TCP_ESTABLISHED
            out.append((_proc_address(parts[1]), _proc_address(parts[2])))
    return out


def _proc_address(field: str) -> str:
    """/proc/net/tcp's "0100007F:1F90" (little-endian IPv4, hex port) as "127.0.0.1:8080"."""
    address, port = field.split(":")
    octets = [str(int(address[i : i + 2], 16)) for i in range(6, -1, -2)]
    return f"{'.'.join(octets)}:{int(port, 16)}"
