"""The request handler: serves one connection's requests, one after another, on a server thread.

Werkzeug's handler answers `Connection: close` to every request; this one keeps HTTP/1.1
connections open (draining, or lingering on, what the app left unread), gives the thread back
between requests (the connection is parked), makes requests wait for their turn, and on a
reserve thread serves only the server's reserve requests, refusing the rest as `busy`. How an
answer is written is `response`'s; the thread slots, parking and turns it asks for are the
server's, seen through `SlotServer` so that this module does not import the server.
"""

from __future__ import annotations

import contextlib
import io
import json
import socket
import time
from typing import Any, Protocol, cast, runtime_checkable

from werkzeug.exceptions import InternalServerError
from werkzeug.serving import WSGIRequestHandler

from distbatch.protocol import SERVER_IDLE_SECONDS
from distbatch.serving.response import Response
from distbatch.serving.sockets import (
    LINGER_MAX_BYTES,
    LINGER_MAX_SECONDS,
    LINGER_SECONDS,
    CountingReader,
    SlicedWriter,
    arrived_whole,
    discard_unread,
    framed_length,
    path_of,
)
from distbatch.serving.turns import Turns

# How long a kept-alive connection may wait for its next request before the server closes it
# (clients stop reusing one sooner: `protocol.CLIENT_KEEPALIVE_SECONDS`).
DEFAULT_IDLE_TIMEOUT = SERVER_IDLE_SECONDS
# The WSGI environ key that tells an app this server sends any buffer the app yields (a
# `memoryview` too), not only the `bytes` PEP 3333 asks for.
SENDS_BUFFERS = "distbatch.sends_buffers"
# The WSGI environ key of a callable that gives back the request's turn (`request_turns`) early,
# for a request that will now wait rather than work (a long poll); calling it again does nothing.
GIVE_TURN_BACK = "distbatch.give_turn_back"
# A reserve connection's socket timeout (bounded by the read timeout): what it serves is small,
# so one that dawdles is dropped soon instead of holding a reserve thread.
RESERVE_READ_TIMEOUT = 2.0
BUSY_RETRY_AFTER = 1
# After a response, a connection keeps its thread this long for its next request (a client's
# next call, a rank's next poll), then waits parked, without a thread (`ParkedConnections`);
# at once when a new request is waiting for a thread. Serving from a parked connection costs
# a hand-over (and, flat out, a queue behind every other parked one that became readable).
PARK_AFTER_SECONDS = 0.1
# A request with turns (`request_turns`) is read whole before it waits for one when its body is
# at most this big (a poll's is a few hundred bytes); a bigger one, which every waiting thread
# would hold in memory, runs without a turn.
TURN_BODY_BYTES = 64 << 10


@runtime_checkable
class SlotServer(Protocol):
    """What the handler uses of a server that bounds its threads (the one `server.HttpServer`
    runs): which slot a connection runs on, whether the server is stopping, parking a connection
    that idles, and the turns a request waits for. Another werkzeug server offers none of it, and its
    connections are served plainly (no reserve refusals, parking or turns)."""

    def is_stopping(self) -> bool: ...

    def on_reserve(self, connection: socket.socket) -> bool: ...

    def next_request_within(self, connection: socket.socket, seconds: float) -> bool: ...

    def park_when_done(self, connection: socket.socket, address: Any) -> None: ...

    def turns_for(self, request_line: bytes) -> Turns | None: ...


def _slot_server(server: object) -> SlotServer | None:
    """`server` if it bounds its threads (`SlotServer`), else None. Judged by its class, which
    the check caches: judging the instance would cost microseconds on every connection."""
    return cast(SlotServer, server) if issubclass(type(server), SlotServer) else None


class TimedRequestHandler(WSGIRequestHandler):
    """Serves one connection: HTTP/1.1 keep-alive, a socket timeout, sends of any buffer.

    The timeout (`timeout`, set per server) covers each socket operation: a stalled
    upload or a peer that stops reading is closed after it; a request whose handler
    computes for minutes is not, since no socket operation happens meanwhile. Between
    requests a connection gives up its thread (it is parked, `ParkedConnections`) and is
    closed after `idle_timeout` without a request.
    """

    idle_timeout = DEFAULT_IDLE_TIMEOUT
    slot_server: SlotServer | None = None  # the server, when it bounds its threads
    _turn: Turns | None = None
    _body_read: bytes | None = None  # a body read before its request waited for a turn

    def setup(self) -> None:
        super().setup()
        with contextlib.suppress(OSError):  # not TCP (a Unix socket): nothing to tune
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.wfile = SlicedWriter(self.connection)
        self.slot_server = slots = _slot_server(self.server)
        self.on_reserve = slots is not None and slots.on_reserve(self.connection)
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
        slots = self.slot_server
        if slots is None:
            return True
        if slots.is_stopping():
            return False
        # Bytes the client sent ahead (pipelined) may already sit in the read buffer, where
        # the socket's readiness does not show them: peek without blocking first.
        self.connection.settimeout(0)
        try:
            ahead = cast(io.BufferedReader, self.rfile).peek(1)
        finally:
            self.connection.settimeout(self.timeout)
        if ahead or slots.next_request_within(self.connection, PARK_AFTER_SECONDS):
            return True
        slots.park_when_done(self.connection, self.client_address)
        return False

    def server_stopping(self) -> bool:
        """Whether the server is stopping (a plain werkzeug server: never said)."""
        return self.slot_server is not None and self.slot_server.is_stopping()

    def parse_request(self) -> bool:
        # A request with turns (`request_turns`) waits for one idle, so a crowd of them waits
        # instead of all competing for the interpreter; and it holds one only once it has
        # arrived whole, so a client that stops sending holds none. One that arrived whole with
        # its request line (a small request, one segment: the usual case) waits before its
        # headers are even parsed; any other is parsed and its small body read first.
        self._body_read = None
        turns = self._turns()
        if turns is not None and arrived_whole(self.rfile, self.connection, self.timeout):
            return self._take_turn(turns) and super().parse_request()
        if not super().parse_request():
            return False
        if turns is None:
            return True
        length = framed_length(self.headers)
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
        if self.slot_server is None or self.on_reserve:
            return None
        return self.slot_server.turns_for(self.raw_requestline)

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
            self.give_turn_back()

    def give_turn_back(self) -> None:
        """Give the request's turn back, if it holds one (again: nothing)."""
        turns, self._turn = self._turn, None
        if turns is not None:
            turns.give_back()

    def run_wsgi(self) -> None:
        if self.on_reserve:
            self.close_connection = True  # one request per reserve connection
            if (self.command, path_of(self.path)) not in getattr(self.server, "reserve_requests", ()):
                self._refuse_busy()
                return
        # `parse_request` (http.server) already answered `Expect: 100-continue`.
        self.environ = environ = self.make_environ()
        environ[SENDS_BUFFERS] = True
        environ[GIVE_TURN_BACK] = self.give_turn_back
        body: CountingReader | None = None
        length = framed_length(self.headers)
        if environ["wsgi.input"] is self.rfile and length is not None:
            stream = self.rfile if self._body_read is None else io.BytesIO(self._body_read)
            body = environ["wsgi.input"] = CountingReader(stream, length)
        else:
            # Chunked, or framing that is not one plain Content-Length: where the body ends
            # is the app's business, so nothing more is read from this connection (no
            # request can be smuggled behind this one).
            self.close_connection = True
        response = Response(self, environ, body)
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
                    Response(self, environ, body).run(InternalServerError())
            return
        left = 0 if body is None else body.left
        if left and (response.body_stalled or body.broken):  # type: ignore[union-attr]
            self.close_connection = True
            return  # nothing to linger for: the client stopped sending
        if left and self.close_connection:
            self._linger()
        elif left and not discard_unread(body):  # type: ignore[arg-type]
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
