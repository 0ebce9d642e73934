"""What the simulated network itself allows: plain TCP moving given bytes between hosts.

The cluster bench's baseline for a data step: the same bytes between the same pairs of hosts
(receiver, sender, bytes), every receiver pulling from all its senders at once over one plain
socket each, as distbatch's gather does with one request per worker. No framing, no copies
beyond the kernel's: how close TCP over these `tbf` links comes to the link lower bound (it
does not reach it: flows sharing a shaped link do not split it evenly, and the slowest flow
decides), so distbatch's figure can be read against the network's, not only against arithmetic.

One node per host (`python -m bench.cluster.tcp --bind ADDR`): it listens on ADDR (port 0),
prints its port, reads its plan (one JSON line: `[[address, port, nbytes], ...]` to pull), waits
for a line "go", pulls everything, prints the seconds it took, and serves its peers until stdin
closes. A request is 8 bytes (big-endian length); the answer is that many bytes.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from simcluster import stop_process

ROOT = Path(__file__).resolve().parents[2]  # the repo root (this is bench/cluster/tcp.py)
REQUEST = struct.Struct(">Q")
SEND_BLOCK = 1 << 20  # bytes handed to the kernel per send
START_TIMEOUT = 60.0


def _serve(listener: socket.socket, block: memoryview) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=_answer, args=(conn, block), daemon=True).start()


def _answer(conn: socket.socket, block: memoryview) -> None:
    with conn:
        wanted = REQUEST.unpack(_read_exactly(conn, REQUEST.size))[0]
        while wanted > 0:
            sent = conn.send(block[: min(wanted, len(block))])
            wanted -= sent


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = conn.recv(n - len(data))
        if not more:
            raise ConnectionError("peer closed early")
        data += more
    return data


def _pull(address: str, port: int, nbytes: int, sink: bytearray) -> None:
    with socket.create_connection((address, port), timeout=120) as conn:
        conn.sendall(REQUEST.pack(nbytes))
        view = memoryview(sink)
        got = 0
        while got < nbytes:
            n = conn.recv_into(view[: min(len(view), nbytes - got)])
            if n == 0:
                raise ConnectionError(f"{address}:{port} closed after {got} of {nbytes} bytes")
            got += n


def node_main(bind: str) -> int:
    """One host's node (see the module's docstring)."""
    listener = socket.create_server((bind, 0), backlog=128)
    block = memoryview(bytearray(SEND_BLOCK))
    threading.Thread(target=_serve, args=(listener, block), daemon=True).start()
    print(listener.getsockname()[1], flush=True)
    plan = json.loads(sys.stdin.readline())
    if sys.stdin.readline().strip() != "go":
        return 1
    started = time.perf_counter()
    pulls = [
        threading.Thread(target=_pull, args=(address, port, nbytes, bytearray(SEND_BLOCK)))
        for address, port, nbytes in plan
    ]
    for pull in pulls:
        pull.start()
    for pull in pulls:
        pull.join()
    print(json.dumps({"seconds": time.perf_counter() - started}), flush=True)
    sys.stdin.read()  # serve until the driver closes stdin
    listener.close()
    return 0


def all_to_all(cluster: Any, hosts: Sequence[int], pairs: Sequence[tuple[str, str, int]]) -> float:
    """Seconds until every receiver has pulled its bytes (`pairs`: receiver address, sender
    address, bytes) over plain TCP, all at once, between `hosts` of `cluster`."""
    nodes: dict[str, subprocess.Popen[str]] = {}
    try:
        for host in hosts:
            address = cluster.address(host)
            nodes[address] = cluster.popen(
                host,
                [sys.executable, "-m", "bench.cluster.tcp", "--bind", address],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=ROOT,
            )
        ports = {address: int(_line(node)) for address, node in nodes.items()}
        for address, node in nodes.items():
            plan = [[src, ports[src], n] for to, src, n in pairs if to == address and n > 0]
            _send(node, json.dumps(plan))
        for node in nodes.values():
            _send(node, "go")
        return max(json.loads(_line(node))["seconds"] for node in nodes.values())
    finally:
        for node in nodes.values():
            stop_process(node)


def _send(node: subprocess.Popen[str], line: str) -> None:
    if node.stdin is None:
        raise RuntimeError("node has no stdin")
    node.stdin.write(line + "\n")
    node.stdin.flush()


def _line(node: subprocess.Popen[str]) -> str:
    if node.stdout is None:
        raise RuntimeError("node has no stdout")
    line = node.stdout.readline()
    if not line:
        raise RuntimeError(f"a TCP node exited ({node.poll()}) before answering")
    return line.strip()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.cluster.tcp",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--bind", required=True, help="this host's address")
    return node_main(parser.parse_args(argv).bind)


if __name__ == "__main__":
    raise SystemExit(main())
