"""The worker's same-host endpoint: a Unix socket that hands shared regions to local readers.

A client learns the socket's name and a secret from `GET /v1/shm` (behind the bearer token
when one is set) and only tries it when its host id (the kernel's boot id) matches the
worker's. The socket is abstract (no file; gone with the worker) and its name random; a
connection is served only if its peer runs as the worker's user (`SO_PEERCRED`) and its
first message carries the secret, and the token when one is set.

Requests are length-prefixed messages (`distbatch.transport.shm`): a JSON header, maybe bytes, maybe
descriptors. Nothing is unpickled or evaluated; every id and bound is checked as over HTTP.

- `fetch` (task ids x fields): the bundle's skeleton (`wire.build_bundle`): small columns
  inline, big tensor columns as runs in shared regions, whose descriptors ride along.
- `put` (one sealed memfd holding a bundle, maybe `stage`/`part`): the worker maps it and
  stores its columns as views of it, no copy; all or nothing, 507 over capacity, as over HTTP.

An answer the shared path cannot give (`SharedMemoryUnavailable`) says `fallback`, and the
client sends that request over HTTP instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any

from distbatch import wire
from distbatch.auth import same_secret
from distbatch.errors import ShmError
from distbatch.gc_pause import paused_gc
from distbatch.ids import validate_id
from distbatch.protocol import SERVER_IDLE_SECONDS
from distbatch.serving.open_files import raise_open_file_limit
from distbatch.transport.shm import (
    SharedRegion,
    abstract_address,
    close_all,
    host_id,
    json_payload,
    peer_credentials,
    recv_message,
    send_message,
    split_payload,
)
from distbatch.wire.container import Part
from rpc_server.checks import (
    ERROR_ANSWERS,
    answer_ids_as_count,
    check_field_count,
    check_put,
    check_response_size,
    generation_list,
    key_list,
    missing_shards,
)
from rpc_server.config import ServerConfig
from rpc_server.errors import ApiError, MissingShardsError, SharedMemoryUnavailable
from rpc_server.metrics import Metrics
from rpc_server.store.shard_store import ShardStore

__all__ = ["INLINE_BELOW_BYTES", "SharedMemoryService"]

logger = logging.getLogger("rpc_server")

# Columns smaller than this travel inline in the answer: mapping a region costs more.
INLINE_BELOW_BYTES = 64 << 10
# Same-host connections served at once (a thread each); more are told `busy` and closed.
MAX_CONNECTIONS = 128
# The first message (the hello) must come within this, and be this small.
HELLO_SECONDS = 10.0
MAX_HELLO_BYTES = 4096
# The worker's error answers, and a region that is not a sealed memfd of the stated size.
_ERRORS: dict[type[Exception], tuple[int, str]] = {**ERROR_ANSWERS, ShmError: (400, "bad_region")}


class SharedMemoryService:
    """The worker's Unix-socket listener and its connections (threads), for one app."""

    def __init__(self, store: ShardStore, config: ServerConfig, metrics: Metrics) -> None:
        self.store = store
        self.config = config
        self.metrics = metrics
        self.secret = secrets.token_hex(32)
        self.name = f"distbatch-{secrets.token_hex(16)}"
        # Each region holds two descriptors here (ours and the mapping's) and connections one
        # each: keep regions to a quarter of the open-file limit, so accept() never runs out.
        store.max_shared_regions = raise_open_file_limit() // 4
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._listener.bind(abstract_address(self.name))
        self._listener.listen(MAX_CONNECTIONS)
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        # A client on this host has shaken hands: one that reads through shared memory exists
        # (`GET /v1/shm` alone, which any client asks, is not enough).
        self.greeted = False
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept, name="shm-accept", daemon=True)
        self._acceptor.start()

    def describe(self) -> dict[str, Any]:
        """What `GET /v1/shm` tells a client: where to connect and what to show."""
        return {
            "available": True,
            "host_id": host_id(),
            "socket": self.name,
            "secret": self.secret,
            "pid": os.getpid(),
            "inline_below": INLINE_BELOW_BYTES,
        }

    def close(self) -> None:
        """Stop accepting and close every connection (their threads end)."""
        with self._lock:
            self._closed = True
            connections = list(self._connections)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._acceptor.join(timeout=5)

    # ------------------------------------------------------------------ connections

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                full = len(self._connections) >= MAX_CONNECTIONS
                if self._closed or full:
                    if full:
                        busy = ApiError(503, "busy", f"{MAX_CONNECTIONS} same-host connections already open")
                        with contextlib.suppress(OSError):
                            conn.settimeout(1.0)
                            self._reply_error(conn, busy)
                    conn.close()
                    continue
                self._connections.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="shm-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self._greet(conn):
                conn.settimeout(SERVER_IDLE_SECONDS)
                while self._answer(conn):
                    pass
        except (OSError, EOFError, ShmError):
            pass  # the client went away or broke framing: drop the connection
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _greet(self, conn: socket.socket) -> bool:
        """Check the peer and its hello; True if the connection may make requests."""
        conn.settimeout(HELLO_SECONDS)
        _, uid, _ = peer_credentials(conn)
        if uid != os.getuid():
            logger.warning(
                "same-host connection from uid %d refused: the worker runs as uid %d", uid, os.getuid()
            )
            return False
        payload, _ = recv_message(conn, MAX_HELLO_BYTES, 0)  # no descriptors: any would be refused
        header, _ = split_payload(payload)
        token = self.config.token
        if header.get("op") != "hello" or not same_secret(header.get("secret"), self.secret):
            self._reply_error(conn, ApiError(401, "unauthorized", "wrong or missing same-host secret"))
            return False
        if token is not None and not same_secret(header.get("token"), token):
            self._reply_error(conn, ApiError(401, "unauthorized", "missing or wrong bearer token"))
            return False
        send_message(conn, json_payload({"ok": True, "pid": os.getpid()}))
        self.greeted = True
        return True

    def _answer(self, conn: socket.socket) -> bool:
        """Serve one request; False once the client closed the connection."""
        limit = max(self.config.max_json_bytes, MAX_HELLO_BYTES)
        try:
            payload, fds = recv_message(conn, limit, 1)
        except EOFError:
            return False
        except TimeoutError:
            return False  # idle for SERVER_IDLE_SECONDS: the client reconnects when it needs to
        started = time.perf_counter()
        op = "unknown"
        try:
            header, _ = split_payload(payload)
            op = str(header.get("op"))[:16]
            if op == "fetch":
                close_all(fds)
                fds = []
                reply, parts, regions, served = self._fetch(header)
                send_message(conn, json_payload(reply, parts), [r.fd for r in regions])
                self._observe(op, 200, started, 0, served)
                return True
            if op == "put":
                if len(fds) != 1:
                    raise ApiError(
                        400, "bad_request", f"a same-host put carries one descriptor, not {len(fds)}"
                    )
                reply, size = self._put(header, fds.pop())  # from here the descriptor is _put's
                send_message(conn, json_payload(reply))
                self._observe(op, 200, started, size, 0)
                return True
            raise ApiError(400, "bad_request", f"unknown same-host operation {op!r}")
        except Exception as exc:
            close_all(fds)
            refusal = _refusal(exc, op)
            self._reply_error(conn, refusal)
            self._observe(op, refusal.status, started, 0, 0)
        return True

    def _reply_error(self, conn: socket.socket, exc: ApiError) -> None:
        send_message(
            conn, json_payload({"status": exc.status, "error": exc.code, "message": str(exc), **exc.extra})
        )

    def _observe(self, op: str, status: int, started: float, bytes_in: int, bytes_out: int) -> None:
        method = "PUT" if op == "put" else "POST"
        self.metrics.observe(f"unix:{op}", method, status, time.perf_counter() - started, bytes_in, bytes_out)

    # ------------------------------------------------------------------ operations

    def _fetch(self, header: dict[str, Any]) -> tuple[dict[str, Any], list[Part], list[SharedRegion], int]:
        """The answer to a fetch: header, skeleton parts, the regions its runs name, and the shard
        bytes it serves (inline or by reference)."""
        max_keys = self.config.max_keys_per_request
        task_ids = wire.validate_id_list(key_list(header.get("task_ids"), "task_ids", max_keys))
        fields = wire.validate_id_list(key_list(header.get("fields"), "fields", max_keys), "field")
        check_field_count(len(fields))
        generations = generation_list(header.get("generations"), len(task_ids))
        ids_as_count = answer_ids_as_count(header.get("answer_ids", True))
        bundle, regions = self.store.fetch_shared(task_ids, fields, INLINE_BELOW_BYTES, generations)
        with paused_gc():
            parts = wire.build_bundle(bundle, ids_as_count)
        # Only the inline part counts: the regions are handed over, not sent.
        check_response_size(bundle.shard_count(), wire.parts_size(parts), self.config.max_response_bytes)
        served = sum(c.nbytes for c in bundle.columns.values())
        return {"status": 200, "regions": [r.size for r in regions]}, parts, regions, served

    def _put(self, header: dict[str, Any], fd: int) -> tuple[dict[str, Any], int]:
        region = SharedRegion.adopt(fd)  # first: from here the descriptor closes with `region`
        stage = header.get("stage")
        part = header.get("part") or ""
        if stage is not None:
            validate_id(stage, "stage")
        if part:
            validate_id(part, "part")
        bundle = wire.parse_bundle(region.array.data)
        check_put(bundle, self.config.max_keys_per_request)
        if stage is not None:
            staged, nbytes = self.store.stage(stage, bundle, region.size, part, region)
            return {"status": 200, "staged": staged, "bytes": nbytes}, region.size
        receipt = self.store.put(bundle, region.size, region)
        answer = {
            "status": 200,
            "stored": receipt.stored,
            "bytes": receipt.bytes,
            "generation": receipt.generation,
        }
        return answer, region.size


def _refusal(exc: Exception, op: str) -> ApiError:
    """The answer to a request that raised `exc`. The worker's own refusals keep their status;
    anything else (out of memory or descriptors, or a bug) says "use HTTP", which may still
    serve the request."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, MissingShardsError):
        return missing_shards(exc)
    if isinstance(exc, SharedMemoryUnavailable):
        return ApiError(503, "shm_unavailable", str(exc), fallback=True)
    for kind, (status, code) in _ERRORS.items():
        if isinstance(exc, kind):
            return ApiError(status, code, str(exc))
    if not isinstance(exc, OSError):
        logger.exception("same-host %s failed", op)
    message = f"the same-host path failed: {type(exc).__name__}: {exc}"
    return ApiError(503, "shm_unavailable", message, fallback=True)
