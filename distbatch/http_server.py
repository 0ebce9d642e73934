"""A threaded WSGI server for a Flask app: bounded threads, read timeouts, reserve threads.

Generic HTTP machinery the worker (`rpc_server.serve.WorkerServer`) and the controller's HTTP
face (`distbatch.controller_http`) share; it knows nothing of shards or engines. The bounds it
enforces are constructor arguments, so each server picks its own.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import socket
import threading
import time
from collections.abc import Collection
from typing import Any, Self
from urllib.parse import urlsplit

from flask import Flask
from werkzeug.serving import ThreadedWSGIServer, WSGIRequestHandler

DEFAULT_MAX_THREADS = 256
DEFAULT_READ_TIMEOUT = 60.0
WILDCARD_HOSTS = {"0.0.0.0", "::", ""}


def format_node(host: str, port: int) -> str:
    """`host:port`, with IPv6 literals bracketed."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def advertised_host(bind_host: str) -> str:
    """The host peers should dial: the bind host, or this machine's address for a wildcard."""
    if bind_host not in WILDCARD_HOSTS:
        return bind_host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


# Each socket send covers at most this much, so the read timeout bounds a stalled peer
# (no progress for that long), never the length of a big honest transfer.
SEND_SLICE_BYTES = 1 << 20
# Connections the kernel may hold ready to accept while every thread is busy.
ACCEPT_BACKLOG = 1024
# How often a serve loop waiting for a free thread checks whether it was asked to stop.
SLOT_POLL_SECONDS = 0.05
# Extra threads for when every normal one is busy: slow requests (queued engine calls), stalled
# uploads or a crowd of peers must not leave a liveness probe unanswered (the client would
# declare a live server dead). A reserve thread serves only the server's `reserve_requests` (method, path) and
# answers anything else with a quick 503 `busy` (nothing run), which the client retries.
RESERVE_THREADS = 4
HEALTH_REQUESTS = frozenset({("GET", "/health"), ("HEAD", "/health")})
# How long every normal thread must stay busy before a waiting connection goes to a reserve
# thread: a brief burst still waits for a normal thread instead of being refused.
RESERVE_GRACE_SECONDS = 0.05
# A reserve connection's socket timeout (bounded by the read timeout): what it serves is small,
# so one that dawdles is dropped soon instead of holding a reserve thread.
RESERVE_READ_TIMEOUT = 2.0
# Seconds a refused connection's unread body is drained before closing (see `_refuse_busy`).
BUSY_LINGER_SECONDS = 2.0
BUSY_RETRY_AFTER = 1


class _SlicedWriter(io.BufferedIOBase):
    """A request handler's `wfile`: sends each write in slices of `SEND_SLICE_BYTES`.

    `socket.sendall` applies the socket timeout to the whole call, so one big
    response would have to finish within the read timeout; per slice, only a
    peer that stops reading for that long is cut off.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        with memoryview(data) as view, view.cast("B") as flat:
            for start in range(0, flat.nbytes, SEND_SLICE_BYTES):
                self._sock.sendall(flat[start : start + SEND_SLICE_BYTES])
            return flat.nbytes

    def fileno(self) -> int:
        return self._sock.fileno()


def _path_of(target: str) -> str:
    """The path of a request line's target ("" when it does not parse: refused, not served)."""
    try:
        return urlsplit(target).path
    except ValueError:
        return ""


class _TimedRequestHandler(WSGIRequestHandler):
    """Werkzeug's handler with a socket timeout (`timeout`, set per server) and sliced sends.

    The timeout covers each socket operation: an idle connection, a stalled
    upload or a peer that stops reading is closed after it; a request whose
    handler computes for minutes is not, since no socket operation happens meanwhile.
    """

    def setup(self) -> None:
        super().setup()
        self.wfile = _SlicedWriter(self.connection)
        server = self.server
        self.on_reserve = isinstance(server, _BoundedThreadingServer) and server.on_reserve(self.connection)
        if self.on_reserve:
            self.connection.settimeout(min(self.timeout or RESERVE_READ_TIMEOUT, RESERVE_READ_TIMEOUT))

    def run_wsgi(self) -> None:
        if self.on_reserve:
            self.close_connection = True  # one request per reserve connection
            if (self.command, _path_of(self.path)) not in getattr(self.server, "reserve_requests", ()):
                self._refuse_busy()
                return
        super().run_wsgi()

    def _refuse_busy(self) -> None:
        """Answer 503 `busy` without running anything, then drain what the client still sends.

        Closing a socket with unread bytes resets the connection, and a client still
        sending its body could lose the 503 with it; so the write side is closed and the
        rest read and dropped until the client closes, for at most `BUSY_LINGER_SECONDS`.
        """
        threads = getattr(self.server, "max_threads", "all")
        body = json.dumps(
            {
                "error": "busy",
                "message": f"all {threads} request threads of this server are busy (max_threads);"
                " nothing was run, retry later",
                "retry_after": BUSY_RETRY_AFTER,
            }
        ).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: {BUSY_RETRY_AFTER}\r\nConnection: close\r\n\r\n"
        ).encode()
        with contextlib.suppress(OSError):  # the client went away: nothing to tell it
            self.wfile.write(head + body)
            self.connection.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + BUSY_LINGER_SECONDS
            while (left := deadline - time.monotonic()) > 0:
                self.connection.settimeout(left)
                if not self.connection.recv(1 << 16):
                    break


class _BoundedThreadingServer(ThreadedWSGIServer):
    """A threaded WSGI server that runs at most `max_threads` connections at once, plus
    `reserve_threads` for the small `reserve_requests` (liveness probes and the like).

    When every normal thread has been busy for `RESERVE_GRACE_SECONDS`, the next
    connection goes to a free reserve thread (see `_TimedRequestHandler.run_wsgi`);
    with those busy too the serve loop stops accepting, so new connections wait in
    the kernel's accept backlog. It still notices a `shutdown()` within `SLOT_POLL_SECONDS`.
    """

    def __init__(
        self,
        host: str,
        port: int,
        app: Flask,
        handler: type[WSGIRequestHandler],
        max_threads: int,
        reserve_threads: int,
        reserve_requests: Collection[tuple[str, str]],
    ) -> None:
        self.max_threads = max_threads
        self.reserve_threads = reserve_threads
        self.reserve_requests = frozenset(reserve_requests)
        self._busy = 0
        self._reserve_busy = 0
        # Every normal thread stayed busy past the grace: reserve threads are used at once
        # until a normal one frees.
        self._saturated = False
        self._on_reserve: set[socket.socket] = set()
        self._slots_changed = threading.Condition()
        self._stopping = threading.Event()
        self.request_queue_size = max(ACCEPT_BACKLOG, max_threads)
        super().__init__(host, port, app, handler)

    def _take_slot(self) -> bool:
        """Wait for a thread slot (called with a connection pending); True if a reserve one."""
        with self._slots_changed:
            grace_ends = time.monotonic() + RESERVE_GRACE_SECONDS
            while True:
                if self._busy < self.max_threads:
                    self._busy += 1
                    return False
                now = time.monotonic()
                if self._reserve_busy < self.reserve_threads and (self._saturated or now >= grace_ends):
                    self._reserve_busy += 1
                    self._saturated = True
                    return True
                if self._stopping.is_set():
                    raise OSError("server is shutting down")  # socketserver skips this round
                wait = SLOT_POLL_SECONDS if self._saturated or now >= grace_ends else grace_ends - now
                self._slots_changed.wait(min(wait, SLOT_POLL_SECONDS))

    def _release_slot(self, reserve: bool) -> None:
        with self._slots_changed:
            if reserve:
                self._reserve_busy -= 1
            else:
                self._busy -= 1
                self._saturated = False
            self._slots_changed.notify_all()

    def on_reserve(self, connection: socket.socket) -> bool:
        """Whether this accepted connection runs on a reserve thread."""
        with self._slots_changed:
            return connection in self._on_reserve

    def get_request(self) -> tuple[socket.socket, Any]:
        # A slot first, then the connection: while none is free, connections stay queued.
        reserve = self._take_slot()
        try:
            connection, address = super().get_request()
        except BaseException:
            self._release_slot(reserve)
            raise
        if reserve:
            with self._slots_changed:
                self._on_reserve.add(connection)
        return connection, address

    def shutdown_request(self, request: Any) -> None:
        # socketserver calls this exactly once per accepted connection, whichever way it ends.
        try:
            super().shutdown_request(request)
        finally:
            with self._slots_changed:
                reserve = request in self._on_reserve
                self._on_reserve.discard(request)
            self._release_slot(reserve)

    def shutdown(self) -> None:
        self._stopping.set()
        super().shutdown()


class HttpServer:
    """A threaded WSGI server around a Flask app, bound at construction (port 0 allowed).

    At most `max_threads` requests are served at once (more connections wait to be
    accepted); a connection that moves no byte for `read_timeout` seconds is closed.
    `reserve_threads` more answer the `reserve_requests` (method, path) while all of
    those are busy and refuse anything else with 503 `busy`, so a busy server never
    looks dead to a liveness probe.

    The app may register `extensions["on_bound"](node)` to learn its address
    and `extensions["on_close"]()` to release resources at shutdown.
    """

    def __init__(
        self,
        app: Flask,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_threads: int = DEFAULT_MAX_THREADS,
        read_timeout: float = DEFAULT_READ_TIMEOUT,
        reserve_threads: int = RESERVE_THREADS,
        reserve_requests: Collection[tuple[str, str]] = HEALTH_REQUESTS,
    ) -> None:
        if not max_threads >= 1 or not read_timeout > 0 or reserve_threads < 0:
            raise ValueError("max_threads must be >= 1, read_timeout > 0 and reserve_threads >= 0")
        self.max_threads = max_threads
        self.read_timeout = read_timeout
        # Werkzeug logs every request at INFO; keep the hot path quiet.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        # A class per server: werkzeug sets attributes on the handler class it is given.
        handler = type("RequestHandler", (_TimedRequestHandler,), {"timeout": read_timeout})
        self._server = _BoundedThreadingServer(
            host, port, app, handler, max_threads, reserve_threads, reserve_requests
        )
        self.node = format_node(advertised_host(host), self._server.server_port)
        on_bound = app.extensions.get("on_bound")
        if on_bound is not None:
            on_bound(self.node)
        self._on_close = app.extensions.get("on_close")
        self._thread: threading.Thread | None = None

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def stop_serving(self) -> None:
        """Make `serve_forever` return; call from a thread other than the one serving."""
        self._server.shutdown()

    def start_background(self) -> Self:
        """Serve on a daemon thread (for hosting a server inside another process)."""
        self._thread = threading.Thread(target=self.serve_forever, name="http-server", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        """Stop serving (if serving in the background), close the socket, run the app's `on_close`."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()
        if self._on_close is not None:
            self._on_close()
