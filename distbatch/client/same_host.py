"""The client's same-host path: gathers and puts through a worker's Unix socket and shared regions.

`SameHostPaths` decides per node, once, whether the same-host path applies (the worker's host
id matches ours, neither side turned it off, the handshake succeeds) and keeps a small pool of
connections per node. Everything here blocks; `ShardClient` runs it in threads.

Gathers: the worker answers with a bundle whose big tensor columns are runs in shared regions
(sealed memfds whose descriptors come with the answer). Each answer maps its regions copy-on-
write, once each, and no mapping outlives the tensors over it: there is no cache to bound, and
a caller writing into a gathered tensor in place changes its own pages only, never what a
later gather returns. A column in one run is a view of the mapping (no copy); rows in several
runs are gathered into one buffer (one copy).

Puts: the bundle is written into a fresh sealed memfd (one copy, by the kernel) and handed to
the worker, which stores it as it is.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from distbatch import wire
from distbatch.client.planning import product_body
from distbatch.errors import (
    HandshakeRefused,
    SameHostAnswerError,
    SameHostError,
    SameHostFallback,
    ShmError,
    WireFormatError,
)
from distbatch.protocol import CLIENT_KEEPALIVE_SECONDS
from distbatch.serving.open_files import raise_open_file_limit
from distbatch.transport.gather import copy_runs
from distbatch.transport.shm import (
    ENV_SWITCH,
    abstract_address,
    close_all,
    disabled_reason,
    host_id,
    json_payload,
    map_for_reading,
    peer_credentials,
    recv_message,
    sealed_memfd,
    send_message,
    split_payload,
    strict,
)
from distbatch.wire.container import Buffer

__all__ = ["SameHostFallback", "SameHostChannel", "SameHostPaths"]

logger = logging.getLogger("distbatch")

# Bounds on what a worker's answer may hold (the worker bounds its inline part the same way).
MAX_ANSWER_BYTES = 1 << 30
MAX_ANSWER_REGIONS = 1 << 16
# Idle connections kept per node.
MAX_IDLE_CONNECTIONS = 4
# After a handshake that failed for a passing reason (the worker busy, a broken connection),
# HTTP is used for this long before the next try.
RETRY_HANDSHAKE_SECONDS = 5.0


class SameHostChannel:
    """Requests to one worker over its Unix socket (a few reused connections)."""

    def __init__(self, node: str, info: dict[str, Any], token: str | None, timeout: float) -> None:
        self.node = node
        self.name = str(info["socket"])
        self.secret = str(info["secret"])
        self.pid = int(info["pid"])
        self.token = token
        self.timeout = timeout
        self._lock = threading.Lock()
        self._idle: list[tuple[float, socket.socket]] = []
        self._closed = False

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(self.timeout)
            sock.connect(abstract_address(self.name))
            pid, uid, _ = peer_credentials(sock)
            if uid != os.getuid() or pid != self.pid:
                raise ShmError(
                    f"the socket is held by pid {pid} uid {uid}, not the worker (pid {self.pid}"
                    f" uid {os.getuid()})"
                )
            hello = {"op": "hello", "secret": self.secret}
            if self.token:
                hello["token"] = self.token
            send_message(sock, json_payload(hello))
            header, _, fds = _receive(sock)
            close_all(fds)
            if header.get("ok") is not True:
                passing = header.get("status") == 503
                raise HandshakeRefused(
                    f"the worker refused the handshake: {header.get('message', header)}", passing
                )
            return sock
        except BaseException:
            sock.close()
            raise

    def request(
        self, header: dict[str, Any], fds: Sequence[int] = ()
    ) -> tuple[dict[str, Any], memoryview, list[int]]:
        """Send one request, return (answer header, binary rest, descriptors). A connection the
        worker closed while idle is replaced once; `SameHostFallback` when the worker says to use HTTP
        for this request, `SameHostAnswerError` for any other error answer."""
        for attempt in range(2):
            reused, sock = self._take()
            try:
                send_message(sock, json_payload(header), fds)
                answer, rest, got = _receive(sock)
            except (OSError, EOFError, ShmError) as exc:
                sock.close()
                if reused and attempt == 0 and isinstance(exc, (ConnectionError, EOFError)):
                    continue  # the worker closed it for idleness: once more on a fresh one
                raise
            self._give_back(sock)
            status = answer.get("status")
            if status != 200:
                close_all(got)
                if answer.get("fallback") is True:
                    raise SameHostFallback(str(answer.get("message", "the worker cannot share this")))
                raise SameHostAnswerError(
                    int(status) if isinstance(status, int) else 500, json.dumps(answer).encode()
                )
            return answer, rest, got
        raise AssertionError("unreachable")

    def _take(self) -> tuple[bool, socket.socket]:
        now = time.monotonic()
        with self._lock:
            while self._idle:
                since, sock = self._idle.pop()
                if now - since < CLIENT_KEEPALIVE_SECONDS:
                    return True, sock
                sock.close()
        return False, self._connect()

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < MAX_IDLE_CONNECTIONS:
                self._idle.append((time.monotonic(), sock))
                return
        sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for _, sock in idle:
            sock.close()


def _receive(sock: socket.socket) -> tuple[dict[str, Any], memoryview, list[int]]:
    payload, fds = recv_message(sock, MAX_ANSWER_BYTES, MAX_ANSWER_REGIONS)
    try:
        header, rest = split_payload(payload)
    except ShmError:
        close_all(fds)
        raise
    return header, rest, fds


class SameHostPaths:
    """Per node: the same-host channel, or why there is none (logged once per node)."""

    def __init__(self, token: str | None, timeout: float, allocate: Callable[[int], Any]) -> None:
        self.token = token
        self.timeout = timeout
        self._allocate = allocate  # gather buffers (the client's receive pool)
        self._lock = threading.Lock()
        self._decided: dict[str, SameHostChannel | str] = {}
        self._retry_at: dict[str, float] = {}  # nodes whose last handshake failed for a passing reason
        self._logged: set[tuple[str, str]] = set()

    def decided(self, node: str) -> SameHostChannel | str | None:
        """The channel, the reason there is none, or None if not decided yet."""
        reason = disabled_reason()
        if reason is not None:
            self._log_once("*", f"client: {reason}", chosen=True)
            return reason
        retry = self._retry_at.get(node)
        if retry is not None and time.monotonic() >= retry:
            return None  # try the handshake again
        return self._decided.get(node)

    def open(self, node: str, info: Any) -> SameHostChannel | str:
        """Decide for `node` from its `GET /v1/shm` answer (None: the worker has no such endpoint)."""
        reason, chosen = self._refusal(info)
        choice: SameHostChannel | str
        passing = False
        if reason is None:
            channel = SameHostChannel(node, info, self.token, self.timeout)
            try:
                channel._give_back(channel._connect())
                raise_open_file_limit()
                choice = channel
            except (OSError, ShmError, EOFError) as exc:
                channel.close()
                choice = f"the handshake failed: {exc}"
                passing = not isinstance(exc, HandshakeRefused) or exc.passing
        else:
            choice = reason
        with self._lock:
            old = self._decided.get(node)
            self._decided[node] = choice
            if passing:
                self._retry_at[node] = time.monotonic() + RETRY_HANDSHAKE_SECONDS
            else:
                self._retry_at.pop(node, None)
        if isinstance(old, SameHostChannel) and old is not choice:
            old.close()
        if isinstance(choice, str):
            if not chosen:
                _raise_if_strict(node, choice)
            self._log_once(node, choice, chosen)
        else:
            logger.info("distbatch: node %s is on this host: gathers and puts use shared memory", node)
        return choice

    @staticmethod
    def _refusal(info: Any) -> tuple[str | None, bool]:
        """Why the worker's `GET /v1/shm` answer rules the path out (None: it does not), and
        whether that is a deployment's choice (another host, turned off) rather than a fault."""
        if info is None:
            return "the worker has no same-host endpoint (an older version)", True
        if not isinstance(info, dict):
            return "the worker's same-host answer is not an object", False
        if info.get("available") is not True:
            reason = str(info.get("reason", "the worker offers no same-host path"))
            return reason, ENV_SWITCH in reason
        ours = host_id()
        if not ours or info.get("host_id") != ours:
            return "the worker runs on another host (its host id differs from ours)", True
        if not all(isinstance(info.get(k), t) for k, t in (("socket", str), ("secret", str), ("pid", int))):
            return "the worker's same-host answer is malformed", False
        return None, False

    def forget(self, node: str, reason: str) -> None:
        """Drop the channel to `node` after a connection failure (decided afresh next time)."""
        with self._lock:
            old = self._decided.pop(node, None)
        if isinstance(old, SameHostChannel):
            old.close()
        self._log_once(node, f"{reason}; using HTTP until the next handshake")

    def fell_back(self, node: str, reason: str) -> None:
        """One request goes over HTTP instead (logged once per node and kind of reason; an error
        under `DISTBATCH_SHM_STRICT=1`). A connection that broke is not a fallback of this kind:
        the worker may be gone, and the HTTP request that follows says so."""
        _raise_if_strict(node, reason)
        self._log_once(node, f"{reason}; this request used HTTP")

    def _log_once(self, node: str, reason: str, chosen: bool = False) -> None:
        """Say once per node and kind of reason why HTTP is used: INFO when the deployment chose
        it (another host, `DISTBATCH_SHM=0`), WARNING when something failed."""
        key = (node, re.sub(r"\d+", "#", reason))  # one line per kind, whatever the numbers
        with self._lock:
            if key in self._logged:
                return
            self._logged.add(key)
        where = "for every node" if node == "*" else f"for node {node}"
        level = logging.INFO if chosen else logging.WARNING
        logger.log(level, "distbatch: same-host shared memory not used %s: %s", where, reason)

    def close(self) -> None:
        with self._lock:
            decided, self._decided = self._decided, {}
        for choice in decided.values():
            if isinstance(choice, SameHostChannel):
                choice.close()

    # ------------------------------------------------------------------ requests

    def fetch(
        self,
        channel: SameHostChannel,
        task_ids: list[str],
        fields: list[str],
        generations: list[int] | None = None,
    ) -> wire.Bundle:
        """One product from the worker as a bundle over its shared regions."""
        answer, rest, fds = channel.request({"op": "fetch", **product_body(task_ids, fields, generations)})
        try:
            sizes = answer.get("regions")
            if not isinstance(sizes, list) or len(sizes) != len(fds) or set(map(type, sizes)) - {int}:
                raise WireFormatError("the answer's regions do not match its descriptors")
            # Mapped for this answer only (see the module's docstring): copy-on-write, so writes
            # into a gathered tensor never reach another answer's view.
            regions = [
                np.frombuffer(map_for_reading(fd, size), dtype=np.uint8) for fd, size in zip(fds, sizes)
            ]
        finally:
            close_all(fds)
        return wire.parse_bundle(rest, RegionResolver(regions, self._allocate), asked=task_ids)

    def put(
        self, channel: SameHostChannel, parts: Sequence[Buffer], stage: str | None, part: str | None
    ) -> dict[str, Any]:
        """Store a bundle (its container parts) on the worker by handing it a sealed memfd."""
        try:
            fd, _ = sealed_memfd(parts, "distbatch-put")
        except OSError as exc:
            raise SameHostFallback(f"no shared region for the put: {exc}") from None
        header: dict[str, Any] = {"op": "put"}
        if stage is not None:
            header.update(stage=stage, part=part or "")
        try:
            answer, _, fds = channel.request(header, [fd])
        finally:
            os.close(fd)
        close_all(fds)
        return answer


def _raise_if_strict(node: str, reason: str) -> None:
    """Under `DISTBATCH_SHM_STRICT=1`, a same-host path lost to a failure is an error, not HTTP."""
    if strict():
        raise SameHostError(f"distbatch: the same-host path failed for node {node}: {reason}")


class RegionResolver:
    """Turns a column's runs into its bytes: one run is a view of the mapping (no copy); several
    are gathered into one buffer from the client's pool (one copy)."""

    def __init__(self, regions: list[np.ndarray], allocate: Callable[[int], Any]) -> None:
        self.regions = regions
        self.sizes = np.asarray([len(r) for r in regions], dtype=np.int64)
        self.allocate = allocate

    def __call__(self, runs: np.ndarray, nbytes: int) -> list[Buffer]:
        if not len(runs):
            return []
        slots, starts, lengths = runs[:, 0], runs[:, 1], runs[:, 2]
        if int(slots.max()) >= len(self.regions):
            raise WireFormatError("a run names a region the answer did not send")
        if bool(np.any(starts > self.sizes[slots] - lengths)):  # (no sum: forged values could wrap)
            raise WireFormatError("a run lies past the end of its region")
        if len(runs) == 1:
            region = self.regions[int(slots[0])]
            start = int(starts[0])
            return [region[start : start + int(lengths[0])].data]
        out = np.frombuffer(self.allocate(nbytes), dtype=np.uint8, count=nbytes)
        bases = np.fromiter((r.ctypes.data for r in self.regions), dtype=np.uint64, count=len(self.regions))
        sources = np.stack([bases[slots] + starts.astype(np.uint64), lengths.astype(np.uint64)], axis=1)
        if not copy_runs(out, sources):  # the kernel would not copy them for us: one slice each
            at = 0
            for slot, start, length in runs.tolist():
                out[at : at + length] = self.regions[slot][start : start + length]
                at += length
        return [out.data]
