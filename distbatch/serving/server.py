"""A threaded WSGI server for a Flask app: keep-alive, bounded threads, read timeouts, reserve threads.

Generic HTTP machinery the worker (`rpc_server.serve.WorkerServer`) and the controller's HTTP
face (`distbatch.controller.server`) share; it knows nothing of shards or engines. The bounds it
enforces are constructor arguments, so each server picks its own.

It is werkzeug's threaded server with our own request loop (`handler.TimedRequestHandler`).
Werkzeug's answers `Connection: close` to every request and accepts only `bytes` from the
app; ours keeps HTTP/1.1 connections open between requests (the unread rest of a request
body is drained, or the connection closed when that rest is big) and sends any buffer the
app yields (`memoryview`s of stored segments) straight to the socket, without a copy
(`response`). This module holds the server: its thread slots (normal and reserve), the
parking of idle connections and the turns, and `HttpServer`, which binds one.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Collection, Mapping
from typing import Any, Self

from flask import Flask
from werkzeug.serving import ThreadedWSGIServer, WSGIRequestHandler

from distbatch.errors import InvalidArgumentError
from distbatch.protocol import DEFAULT_MAX_THREADS, DEFAULT_READ_TIMEOUT
from distbatch.serving.addresses import advertised_host, bind_error, check_port, format_node
from distbatch.serving.handler import DEFAULT_IDLE_TIMEOUT, TimedRequestHandler
from distbatch.serving.metrics import Values
from distbatch.serving.open_files import raise_open_file_limit
from distbatch.serving.parking import ParkedConnections
from distbatch.serving.sockets import path_of
from distbatch.serving.turns import Turns

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
# Parked connections beyond this many (per server; at least `max_threads`, at most half the
# descriptors the process may open) are closed, the longest idle first: clients reconnect, and
# a flood of idle sockets cannot use up descriptors.
MAX_PARKED = 4096
_NOT_PARKED = object()


def _parked_bound(max_threads: int) -> int:
    """How many idle connections a server parks (`MAX_PARKED`): never so many that they use up
    the descriptors the process may open, which would leave it unable to accept a connection
    (or open a file) until idle ones time out. The soft limit is lifted first (towards the hard
    one): every kept-alive client holds a descriptor, and 1024 is a common default."""
    return min(max(MAX_PARKED, max_threads), max(raise_open_file_limit() // 2, 1))


class _BindFailed(Exception):
    """Carries a bind's OSError past werkzeug (which would exit on it) to our constructor."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class _BoundedThreadingServer(ThreadedWSGIServer):
    """A threaded WSGI server that runs at most `max_threads` connections at once, plus
    `reserve_threads` for the small `reserve_requests` (liveness probes and the like).

    A kept-alive connection gives its thread back while it waits for its next request
    (parked on one selector thread, `ParkedConnections`, until it is readable again, then
    served on a thread like a new connection), so idle clients never hold a thread and
    never lock out a new one.
    When every normal thread has been busy for `RESERVE_GRACE_SECONDS`, the next
    connection goes to a free reserve thread (see `TimedRequestHandler.run_wsgi`);
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
        request_turns: Mapping[tuple[str, str], int],
    ) -> None:
        self.max_threads = max_threads
        self.reserve_threads = reserve_threads
        self.reserve_requests = frozenset(reserve_requests)
        self._turns = {kind: Turns(count) for kind, count in request_turns.items()}
        self._busy = 0
        self._reserve_busy = 0
        # Every normal thread stayed busy past the grace: reserve threads are used at once
        # until a normal one frees.
        self._saturated = False
        self._on_reserve: set[socket.socket] = set()
        self._slots_changed = threading.Condition()
        self._stopping = threading.Event()
        # Connections whose handler asked to be parked once its thread lets go (-> address).
        self._to_park: dict[socket.socket, Any] = {}
        # Readable while a connection waits for a thread: connections idling on theirs park now.
        self._slot_wanted, self._slot_wanted_sender = socket.socketpair()
        self._slot_wanted.setblocking(False)
        self._waiting_for_slots = 0
        self.request_queue_size = max(ACCEPT_BACKLOG, max_threads)
        idle_timeout = getattr(handler, "idle_timeout", DEFAULT_IDLE_TIMEOUT)
        self._parked = ParkedConnections(self._resume, idle_timeout, _parked_bound(max_threads))
        try:
            super().__init__(host, port, app, handler)
        except _BindFailed as failed:
            self._close_helpers()
            raise bind_error(host, port, failed.error) from None
        except BaseException:  # nothing will close the parking thread later
            self._close_helpers()
            raise

    def _close_helpers(self) -> None:
        for turns in self._turns.values():
            turns.close()
        self._parked.close()
        self._slot_wanted.close()
        self._slot_wanted_sender.close()

    def server_bind(self) -> None:
        # Werkzeug answers an OSError here by printing and calling sys.exit(1), which would end
        # the trainer that asked for a server; anything else it lets through.
        try:
            super().server_bind()
        except OSError as exc:
            raise _BindFailed(exc) from None

    def server_activate(self) -> None:
        try:
            super().server_activate()
        except OSError as exc:
            raise _BindFailed(exc) from None

    def _take_slot(self) -> bool:
        """Wait for a thread slot (called with a connection pending); True if a reserve one."""
        with self._slots_changed:
            if self._busy < self.max_threads:
                self._busy += 1
                return False
            self._want_slot(True)
            try:
                return self._wait_for_slot()
            finally:
                self._want_slot(False)

    def _wait_for_slot(self) -> bool:
        """`_take_slot` once every normal thread is taken (caller holds the lock)."""
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

    def _want_slot(self, wanted: bool) -> None:
        """Count a connection waiting for a thread in or out; `_slot_wanted` is readable while
        any waits (caller holds the lock)."""
        self._waiting_for_slots += 1 if wanted else -1
        with contextlib.suppress(OSError):
            if wanted and self._waiting_for_slots == 1:
                self._slot_wanted_sender.send(b"w")
            elif not wanted and not self._waiting_for_slots:
                self._slot_wanted.recv(16)

    def next_request_within(self, connection: socket.socket, seconds: float) -> bool:
        """Whether `connection`'s next request begins within `seconds`, unless another connection
        wants a thread first (False: park it)."""
        poller = select.poll()
        try:
            poller.register(connection, select.POLLIN)
            poller.register(self._slot_wanted, select.POLLIN)
        except (ValueError, OSError):  # closed: the server is shutting down
            return False
        ready = {fd for fd, _ in poller.poll(seconds * 1000)}
        return connection.fileno() in ready

    def _release_slot(self, reserve: bool) -> None:
        with self._slots_changed:
            if reserve:
                self._reserve_busy -= 1
            else:
                self._busy -= 1
                self._saturated = False
            self._slots_changed.notify_all()

    def is_stopping(self) -> bool:
        return self._stopping.is_set()

    def turns_for(self, request_line: bytes) -> Turns | None:
        """The turns a request of this request line takes (None: it runs at once)."""
        if not self._turns:
            return None
        parts = request_line.split()
        if len(parts) < 2:
            return None
        return self._turns.get((parts[0].decode("latin-1"), path_of(parts[1].decode("latin-1"))))

    def park_when_done(self, connection: socket.socket, address: Any) -> None:
        """Park `connection` once its thread is done with it (`shutdown_request`), instead of closing it."""
        with self._slots_changed:
            self._to_park[connection] = address

    def _resume(self, connection: socket.socket, address: Any) -> None:
        """Serve a parked connection's next request on a thread, as `serve_forever` does a new one."""
        try:
            reserve = self._take_slot()
        except OSError:  # stopping
            with contextlib.suppress(OSError):
                connection.close()
            return
        self._mark_reserve(connection, reserve)
        try:
            self.process_request(connection, address)
        except Exception:  # no thread could start: as socketserver does for a new connection
            self.handle_error(connection, address)
            self.shutdown_request(connection)

    def connection_counts(self) -> tuple[int, int]:
        """(connections a thread is serving a request on, kept-alive ones waiting for their next)."""
        with self._slots_changed:
            return self._busy + self._reserve_busy, self._parked.count()

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
        self._mark_reserve(connection, reserve)
        return connection, address

    def _mark_reserve(self, connection: socket.socket, reserve: bool) -> None:
        """Note that `connection` runs on a reserve slot (`on_reserve`), when it does."""
        if reserve:
            with self._slots_changed:
                self._on_reserve.add(connection)

    def shutdown_request(self, request: Any) -> None:
        # socketserver calls this exactly once per time a thread served the connection (or
        # failed to start), whichever way it ended: the slot is given back, and the connection
        # closed, or parked when its handler asked for that (`park_when_done`).
        # Which slot to give back is read before the connection is parked: once parked, it may
        # be resumed onto another slot (a reserve one) before this thread gets further.
        with self._slots_changed:
            address = self._to_park.pop(request, _NOT_PARKED)
            reserve = request in self._on_reserve
            self._on_reserve.discard(request)
        self._release_slot(reserve)
        if address is not _NOT_PARKED and not self._stopping.is_set():
            self._parked.park(request, address)
        else:
            super().shutdown_request(request)

    def shutdown(self) -> None:
        self._stopping.set()
        for turns in self._turns.values():
            turns.close()  # requests waiting for a turn end
        self._parked.close()  # idle connections close
        super().shutdown()

    def server_close(self) -> None:
        self._stopping.set()
        super().server_close()
        self._close_helpers()


def connection_gauges(app: Flask) -> Values:
    """The metrics gauges of the connections the server of `app` holds (none before it serves):
    what a test or an operator waits on instead of counting threads against a clock."""
    counts = app.extensions.get("connections")
    if counts is None:
        return {}
    active, idle = counts()
    return {
        "distbatch_connections_active": ("Connections a server thread is serving a request on.", active),
        "distbatch_connections_idle": ("Kept-alive connections waiting for their next request.", idle),
    }


class HttpServer:
    """A threaded WSGI server around a Flask app, bound at construction on `port` (0 to 65535, 0
    for a free one; anything else is a `ValueError`).

    At most `max_threads` connections are served at once (more wait to be accepted);
    one that moves no byte for `read_timeout` seconds within a request is closed, and
    one kept alive is closed after `idle_timeout` seconds without a request (sooner
    when a new connection needs its thread).
    `reserve_threads` more answer the `reserve_requests` (method, path) while all of
    those are busy and refuse anything else with 503 `busy`, so a busy server never
    looks dead to a liveness probe. `request_turns` maps (method, path) to how many such
    requests' apps run at once; more wait for a turn, idle, once they have arrived (the turn is
    given back before the response is sent, or earlier by the app, `GIVE_TURN_BACK`), so a
    flood of one kind (polls) leaves the interpreter to the others.

    The app may register `extensions["on_bound"](node)` to learn its address (what it raises,
    the constructor raises, with the socket closed) and `extensions["on_close"]()` to release
    resources at shutdown.
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
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        request_turns: Mapping[tuple[str, str], int] | None = None,
    ) -> None:
        check_port(port)
        if not max_threads >= 1 or not read_timeout > 0 or reserve_threads < 0 or not idle_timeout > 0:
            raise InvalidArgumentError(
                "max_threads must be >= 1, read_timeout and idle_timeout > 0, reserve_threads >= 0"
            )
        if request_turns and min(request_turns.values()) < 1:
            raise InvalidArgumentError("request_turns must allow at least 1 request of each kind at once")
        self.max_threads = max_threads
        self.read_timeout = read_timeout
        # Werkzeug logs every request at INFO; keep the hot path quiet.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        # A class per server: werkzeug sets attributes on the handler class it is given.
        handler = type(
            "RequestHandler", (TimedRequestHandler,), {"timeout": read_timeout, "idle_timeout": idle_timeout}
        )
        self._server = _BoundedThreadingServer(
            host, port, app, handler, max_threads, reserve_threads, reserve_requests, request_turns or {}
        )
        self.node = format_node(advertised_host(host), self._server.server_port)
        app.extensions["connections"] = self._server.connection_counts  # see `connection_gauges`
        on_bound = app.extensions.get("on_bound")
        if on_bound is not None:
            try:
                on_bound(self.node)
            except BaseException:
                self._server.server_close()  # nobody will serve or close it
                raise
        self._on_close = app.extensions.get("on_close")
        self._thread: threading.Thread | None = None

    def connections(self) -> tuple[int, int]:
        """(connections a thread is serving a request on, kept-alive ones waiting parked for their next)."""
        return self._server.connection_counts()

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
