"""A threaded WSGI server for a Flask app: keep-alive, bounded threads, read timeouts, reserve threads.

Generic HTTP machinery the worker (`rpc_server.serve.WorkerServer`) and the controller's HTTP
face (`distbatch.controller.server`) share; it knows nothing of shards or engines. The bounds it
enforces are constructor arguments, so each server picks its own.

It is werkzeug's threaded server with our own request loop (`_TimedRequestHandler.run_wsgi`).
Werkzeug's answers `Connection: close` to every request and accepts only `bytes` from the
app; ours keeps HTTP/1.1 connections open between requests (the unread rest of a request
body is drained, or the connection closed when that rest is big) and sends any buffer the
app yields (`memoryview`s of stored segments) straight to the socket, without a copy.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import re
import select
import socket
import threading
import time
from collections.abc import Collection, Mapping
from typing import Any, Self, cast
from urllib.parse import unquote, urlsplit

from flask import Flask
from werkzeug.exceptions import InternalServerError
from werkzeug.serving import ThreadedWSGIServer, WSGIRequestHandler

from distbatch.errors import InvalidArgumentError, ServerBindError, StateError
from distbatch.protocol import DEFAULT_MAX_THREADS, DEFAULT_READ_TIMEOUT, SERVER_IDLE_SECONDS
from distbatch.serving.metrics import Values
from distbatch.serving.open_files import raise_open_file_limit
from distbatch.serving.parking import ParkedConnections
from distbatch.serving.turns import Turns
from distbatch.wire.container import byte_view

# How long a kept-alive connection may wait for its next request before the server closes it
# (clients stop reusing one sooner: `protocol.CLIENT_KEEPALIVE_SECONDS`).
DEFAULT_IDLE_TIMEOUT = SERVER_IDLE_SECONDS
# The WSGI environ key that tells an app this server sends any buffer the app yields (a
# `memoryview` too), not only the `bytes` PEP 3333 asks for.
SENDS_BUFFERS = "distbatch.sends_buffers"
# The WSGI environ key of a callable that gives back the request's turn (`request_turns`) early,
# for a request that will now wait rather than work (a long poll); calling it again does nothing.
GIVE_TURN_BACK = "distbatch.give_turn_back"
WILDCARD_HOSTS = {"0.0.0.0", "::", ""}


def format_node(host: str, port: int) -> str:
    """`host:port`, with IPv6 literals bracketed."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_port(port: object) -> int:
    """`port` if a server can listen on it: an int from 0 (any free port) to 65535, else
    `ValueError` naming it (the socket layer would take 70000 as 4464, modulo 65536)."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise InvalidArgumentError(
            f"port {port!r} is not a port to listen on: use 0 to 65535 (0 picks a free one)"
        )
    return port


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
# A connection closed with request bytes unread is reset, and the client may lose the response
# with it; so the server closes its write side and reads the rest, giving up once nothing has
# arrived for `LINGER_SECONDS`, or after `LINGER_MAX_SECONDS` or `LINGER_MAX_BYTES` (`_linger`).
LINGER_SECONDS = 2.0
LINGER_MAX_SECONDS = 10.0
LINGER_MAX_BYTES = 10 << 30
BUSY_RETRY_AFTER = 1
# An answered request whose body was not read whole keeps its connection when at most this
# much is left (read and dropped); with more left the connection is closed (`_linger`).
DRAIN_MAX_BYTES = 4 << 20
# A response's head goes out in one send with the first body chunk when that chunk is at most
# this big (and sockets have TCP_NODELAY): a small response is one segment, never a head held
# back by Nagle's algorithm until the client's delayed ACK (40 ms per request).
COALESCE_BYTES = 64 << 10
# After a response, a connection keeps its thread this long for its next request (a client's
# next call, a rank's next poll), then waits parked, without a thread (`ParkedConnections`);
# at once when a new request is waiting for a thread. Serving from a parked connection costs
# a hand-over (and, flat out, a queue behind every other parked one that became readable).
PARK_AFTER_SECONDS = 0.1
# Parked connections beyond this many (per server; at least `max_threads`, at most half the
# descriptors the process may open) are closed, the longest idle first: clients reconnect, and
# a flood of idle sockets cannot use up descriptors.
MAX_PARKED = 4096
# A request with turns (`request_turns`) is read whole before it waits for one when its body is
# at most this big (a poll's is a few hundred bytes); a bigger one, which every waiting thread
# would hold in memory, runs without a turn.
TURN_BODY_BYTES = 64 << 10
_NOT_PARKED = object()


def _parked_bound(max_threads: int) -> int:
    """How many idle connections a server parks (`MAX_PARKED`): never so many that they use up
    the descriptors the process may open, which would leave it unable to accept a connection
    (or open a file) until idle ones time out. The soft limit is lifted first (towards the hard
    one): every kept-alive client holds a descriptor, and 1024 is a common default."""
    return min(max(MAX_PARKED, max_threads), max(raise_open_file_limit() // 2, 1))


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
        with byte_view(data) as flat:
            for start in range(0, flat.nbytes, SEND_SLICE_BYTES):
                self._sock.sendall(flat[start : start + SEND_SLICE_BYTES])
            return flat.nbytes

    def fileno(self) -> int:
        return self._sock.fileno()


def _path_of(target: str) -> str:
    """The path of a request line's target, percent-decoded as the app's routing sees it ("" when
    it does not parse: refused, not served)."""
    try:
        return unquote(urlsplit(target).path)
    except ValueError:
        return ""


class _CountingReader(io.RawIOBase):
    """A connection's input stream that counts the body bytes read from it (`left`), so the
    handler knows how much of a request body the app left unread."""

    def __init__(self, stream: Any, length: int) -> None:
        self._stream = stream
        self.left = length
        self.broken = False  # a read failed (timed out, reset): the connection is done

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        with byte_view(buffer) as flat:
            if not self.left:
                return 0
            with flat[: self.left] as target:
                try:
                    n = self._stream.readinto(target) or 0
                except BaseException:
                    self.broken = True
                    raise
        self.left -= n
        return n

    def read(self, size: int = -1) -> bytes:
        size = self.left if size is None or size < 0 else min(size, self.left)
        try:
            data = self._stream.read(size) if size else b""
        except BaseException:
            self.broken = True
            raise
        self.left -= len(data)
        return data


def _framed_length(headers: Any) -> int | None:
    """The body length of a request framed by exactly one plain Content-Length (none: 0), else None.

    A Transfer-Encoding, a repeated Content-Length or one that is not ASCII digits leaves the
    framing ambiguous (two readers could disagree on where the body ends)."""
    if headers.get("Transfer-Encoding") is not None:
        return None
    values = headers.get_all("Content-Length") or []
    if not values:
        return 0  # RFC 9112, 6.3: no length and not chunked is an empty body
    text = values[0].strip()
    if len(values) > 1 or not (text.isascii() and text.isdigit()):
        return None
    return int(text)


class _TimedRequestHandler(WSGIRequestHandler):
    """Serves one connection: HTTP/1.1 keep-alive, a socket timeout, sends of any buffer.

    The timeout (`timeout`, set per server) covers each socket operation: a stalled
    upload or a peer that stops reading is closed after it; a request whose handler
    computes for minutes is not, since no socket operation happens meanwhile. Between
    requests a connection gives up its thread (it is parked, `ParkedConnections`) and is
    closed after `idle_timeout` without a request.
    """

    idle_timeout = DEFAULT_IDLE_TIMEOUT
    _turn: Turns | None = None
    _body_read: bytes | None = None  # a body read before its request waited for a turn

    def setup(self) -> None:
        super().setup()
        with contextlib.suppress(OSError):  # not TCP (a Unix socket): nothing to tune
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.wfile = _SlicedWriter(self.connection)
        server = self.server
        self.on_reserve = isinstance(server, _BoundedThreadingServer) and server.on_reserve(self.connection)
        if self.on_reserve:
            self.connection.settimeout(min(self.timeout or RESERVE_READ_TIMEOUT, RESERVE_READ_TIMEOUT))

    def handle(self) -> None:
        """Serve requests until the client closes or asks to close, or the connection idles (parked)."""
        try:
            self.close_connection = True
            self.handle_one_request()
            while not self.close_connection and self._next_request_arrives():
                self.handle_one_request()
        except OSError as exc:  # reset, timed out, or a socket a timeout left unreadable
            self.connection_dropped(exc)

    def _next_request_arrives(self) -> bool:
        """Whether another request starts on this connection now (False: it closes, or is parked
        until its next request begins, idle with no thread)."""
        server = self.server
        if not isinstance(server, _BoundedThreadingServer):
            return True
        if server.stopping:
            return False
        # Bytes the client sent ahead (pipelined) may already sit in the read buffer, where
        # the socket's readiness does not show them: peek without blocking first.
        self.connection.settimeout(0)
        try:
            ahead = cast(io.BufferedReader, self.rfile).peek(1)
        finally:
            self.connection.settimeout(self.timeout)
        if ahead or server.next_request_within(self.connection, PARK_AFTER_SECONDS):
            return True
        server.park_when_done(self.connection, self.client_address)
        return False

    def parse_request(self) -> bool:
        # A request with turns (`request_turns`) waits for one idle, so a crowd of them waits
        # instead of all competing for the interpreter; and it holds one only once it has
        # arrived whole, so a client that stops sending holds none. One that arrived whole with
        # its request line (a small request, one segment: the usual case) waits before its
        # headers are even parsed; any other is parsed and its small body read first.
        self._body_read = None
        turns = self._turns()
        if turns is not None and _arrived_whole(self.rfile, self.connection, self.timeout):
            return self._take_turn(turns) and super().parse_request()
        if not super().parse_request():
            return False
        if turns is None:
            return True
        length = _framed_length(self.headers)
        if length is None or length > TURN_BODY_BYTES:
            return True  # too big to hold while it waits (or not framed): runs without a turn
        if length:
            self._body_read = self.rfile.read(length)  # the read timeout bounds a stall
            if len(self._body_read) < length:  # the client closed: nothing to answer
                self.close_connection = True
                return False
        return self._take_turn(turns)

    def _turns(self) -> Turns | None:
        """The turns this request must wait for (None: it runs at once)."""
        server = self.server
        if not isinstance(server, _BoundedThreadingServer) or self.on_reserve:
            return None
        return server.turns_for(self.raw_requestline)

    def _take_turn(self, turns: Turns) -> bool:
        if not turns.take():  # False: the server is stopping
            self.close_connection = True
            return False
        self._turn = turns
        return True

    def handle_one_request(self) -> None:
        try:
            super().handle_one_request()
        finally:
            self._give_turn_back()

    def _give_turn_back(self) -> None:
        turns, self._turn = self._turn, None
        if turns is not None:
            turns.give_back()

    def run_wsgi(self) -> None:
        if self.on_reserve:
            self.close_connection = True  # one request per reserve connection
            if (self.command, _path_of(self.path)) not in getattr(self.server, "reserve_requests", ()):
                self._refuse_busy()
                return
        # `parse_request` (http.server) already answered `Expect: 100-continue`.
        self.environ = environ = self.make_environ()
        environ[SENDS_BUFFERS] = True
        environ[GIVE_TURN_BACK] = self._give_turn_back
        body: _CountingReader | None = None
        length = _framed_length(self.headers)
        if environ["wsgi.input"] is self.rfile and length is not None:
            stream = self.rfile if self._body_read is None else io.BytesIO(self._body_read)
            body = environ["wsgi.input"] = _CountingReader(stream, length)
        else:
            # Chunked, or framing that is not one plain Content-Length: where the body ends
            # is the app's business, so nothing more is read from this connection (no
            # request can be smuggled behind this one).
            self.close_connection = True
        response = _Response(self, environ, body)
        try:
            response.run(self.server.app)
        except (ConnectionError, TimeoutError) as exc:
            self.close_connection = True
            self.connection_dropped(exc, environ)
            return
        except Exception as exc:  # the app failed outside Flask's own error handling
            self.close_connection = True
            self.server.log("error", f"Error on request {self.command} {self.path}: {exc!r}")
            if not response.head_sent:  # else half sent: closing the connection is all that is left
                with contextlib.suppress(Exception):
                    _Response(self, environ, body).run(InternalServerError())
            return
        left = 0 if body is None else body.left
        if left and (response.body_stalled or body.broken):  # type: ignore[union-attr]
            self.close_connection = True
            return  # nothing to linger for: the client stopped sending
        if left and self.close_connection:
            self._linger()
        elif left and not _discard(body):  # type: ignore[arg-type]
            self.close_connection = True

    def _refuse_busy(self) -> None:
        """Answer 503 `busy` without running anything, then drain what the client still sends."""
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
            self._linger()

    def _linger(self) -> None:
        """Close the write side, then read and drop what the client still sends (bounded).

        Closing a socket with unread bytes resets the connection, and a client still
        sending its body could lose the response with it.
        """
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + LINGER_MAX_SECONDS
            dropped = 0
            scratch = bytearray(1 << 20)
            while dropped < LINGER_MAX_BYTES and (left := deadline - time.monotonic()) > 0:
                self.connection.settimeout(min(LINGER_SECONDS, left))
                if not (n := self.rfile.readinto(scratch)):
                    break
                dropped += n


_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length[ \t]*:[ \t]*([0-9]+)[ \t]*\r\n", re.IGNORECASE)


def _arrived_whole(rfile: Any, connection: socket.socket, timeout: float | None) -> bool:
    """Whether the rest of a request (after its request line) is already in `rfile`'s buffer:
    its head up to the blank line and a body of the Content-Length it names (none: empty).
    Looks without reading from the socket; unsure (odd framing, a repeated length) is False."""
    connection.settimeout(0)
    try:
        buffered = cast(io.BufferedReader, rfile).peek(1)
    except OSError:
        return False
    finally:
        connection.settimeout(timeout)
    if buffered.startswith(b"\r\n"):
        head_end = 2  # no headers at all
    elif (blank := buffered.find(b"\r\n\r\n")) >= 0:
        head_end = blank + 4
    else:
        return False
    head = b"\r\n" + buffered[:head_end]
    if b"transfer-encoding" in head.lower():
        return False
    lengths = _CONTENT_LENGTH.findall(head)
    if len(lengths) > 1:
        return False
    return len(buffered) - head_end >= (int(lengths[0]) if lengths else 0)


def _discard(body: _CountingReader) -> bool:
    """Read and drop the body bytes an answered request did not read, within
    `LINGER_MAX_SECONDS`; whether they all came (else the connection must close)."""
    deadline = time.monotonic() + LINGER_MAX_SECONDS
    scratch = bytearray(min(body.left, 1 << 20))
    with contextlib.suppress(OSError):
        while body.left and time.monotonic() < deadline and body.readinto(scratch):
            pass
    return not body.left and not body.broken


class _Response:
    """Runs the app for one request and writes its response, keeping the connection when it can.

    Werkzeug's own `run_wsgi` closes every connection and asserts `bytes`; this one sends
    each buffer the app yields as it is, chunked only when the app gave no length.
    """

    def __init__(self, handler: _TimedRequestHandler, environ: dict[str, Any], body: _CountingReader | None):
        self.handler = handler
        self.environ = environ
        self.body = body
        self.status: str | None = None
        self.headers: list[tuple[str, str]] = []
        self.head_sent = False
        self.chunked = False
        self.body_stalled = False

    def start_response(self, status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        if exc_info and self.head_sent:
            raise exc_info[1].with_traceback(exc_info[2])
        self.status, self.headers = status, headers
        return self.write

    def run(self, app: Any) -> None:
        chunks = app(self.environ, self.start_response)
        try:
            for chunk in chunks:
                self.write(chunk)
            if not self.head_sent:
                self.write(b"")
            if self.chunked:
                self.handler.wfile.write(b"0\r\n\r\n")
        finally:
            if hasattr(chunks, "close"):
                chunks.close()

    def write(self, data: Any) -> None:
        """Send one chunk of the body (the head first): a small one in the same send as what
        precedes it, a big one straight from its buffer."""
        wfile = self.handler.wfile
        before = b"" if self.head_sent else self._head()
        self.head_sent = True
        with byte_view(data) as flat:
            size = flat.nbytes
            framed = self.chunked and size
            if framed:
                before += b"%x\r\n" % size
            after = b"\r\n" if framed else b""
            if size <= COALESCE_BYTES:
                if before or size:
                    wfile.write(before + flat.tobytes() + after)
                return
            # A big chunk may wait for the client to read: that wait holds no turn (small ones
            # fit the socket's buffer and never wait, so the turn covers them at no risk).
            self.handler._give_turn_back()
            if before:
                wfile.write(before)
            wfile.write(flat)
            if after:
                wfile.write(after)

    def _head(self) -> bytes:
        """The status line and headers; decides whether the connection stays open."""
        handler = self.handler
        if self.status is None:
            raise StateError("the app wrote before start_response")
        code_text, _, reason = self.status.partition(" ")
        code = int(code_text)
        handler.log_request(code)
        names = {name.lower(): value for name, value in self.headers}
        left = 0 if self.body is None else self.body.left
        server = handler.server
        # 408: the body stalled for the read timeout, so this connection carries no more requests.
        self.body_stalled = code == 408
        if (
            left > DRAIN_MAX_BYTES
            or self.body_stalled
            or names.get("connection", "").lower() == "close"
            or (isinstance(server, _BoundedThreadingServer) and server.stopping)
        ):
            handler.close_connection = True
        lines = [
            f"{handler.protocol_version} {code} {reason}",
            f"Server: {handler.version_string()}",
            f"Date: {handler.date_time_string()}",
        ]
        lines += [f"{name}: {value}" for name, value in self.headers if name.lower() != "connection"]
        bodiless = self.environ["REQUEST_METHOD"] == "HEAD" or 100 <= code < 200 or code in (204, 304)
        if "content-length" not in names and not bodiless:
            if handler.request_version == "HTTP/1.0":
                handler.close_connection = True  # HTTP/1.0 has no chunks: the close ends the body
            else:
                self.chunked = True
                lines.append("Transfer-Encoding: chunked")
        if handler.close_connection:
            lines.append("Connection: close")
        elif handler.request_version == "HTTP/1.0":
            lines.append("Connection: keep-alive")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class _BindFailed(Exception):
    """Carries a bind's OSError past werkzeug (which would exit on it) to our constructor."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def _bind_error(host: str, port: int, error: OSError) -> ServerBindError:
    hint = ""
    if error.errno == errno.EADDRINUSE:
        hint = "; another process holds the port: stop it, pick another port, or pass port 0 for a free one"
    elif error.errno == errno.EADDRNOTAVAIL:
        hint = "; that host is not an address of this machine (0.0.0.0 listens on all of them)"
    where = format_node(host, port) if port else f"{host} (a free port)"
    return ServerBindError(error.errno, f"cannot listen on {where}: {error.strerror or error}{hint}")


class _BoundedThreadingServer(ThreadedWSGIServer):
    """A threaded WSGI server that runs at most `max_threads` connections at once, plus
    `reserve_threads` for the small `reserve_requests` (liveness probes and the like).

    A kept-alive connection gives its thread back while it waits for its next request
    (parked on one selector thread, `ParkedConnections`, until it is readable again, then
    served on a thread like a new connection), so idle clients never hold a thread and
    never lock out a new one.
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
            raise _bind_error(host, port, failed.error) from None
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

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def turns_for(self, request_line: bytes) -> Turns | None:
        """The turns a request of this request line takes (None: it runs at once)."""
        if not self._turns:
            return None
        parts = request_line.split()
        if len(parts) < 2:
            return None
        return self._turns.get((parts[0].decode("latin-1"), _path_of(parts[1].decode("latin-1"))))

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
            "RequestHandler", (_TimedRequestHandler,), {"timeout": read_timeout, "idle_timeout": idle_timeout}
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
