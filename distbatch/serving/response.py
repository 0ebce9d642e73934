"""The response writer: runs the app for one request and writes what it answers, head and body,
deciding whether the connection stays open for the next request.

Apart from the request handler (`handler`), which decides when a request runs (turns, parking,
refusals), because this decides only how its answer goes out: the head coalesced with a small
body, a big body sent from its own buffer, chunks when the app gave no length. It sees the
handler through `Responder`, so it imports nothing above `sockets`.
"""

from __future__ import annotations

import io
from typing import Any, Protocol

from distbatch.errors import StateError
from distbatch.serving.sockets import CountingReader
from distbatch.wire.container import byte_view

# An answered request whose body was not read whole keeps its connection when at most this
# much is left (read and dropped); with more left the connection is closed (the handler's
# `_linger`).
DRAIN_MAX_BYTES = 4 << 20
# A response's head goes out in one send with the first body chunk when that chunk is at most
# this big (and sockets have TCP_NODELAY): a small response is one segment, never a head held
# back by Nagle's algorithm until the client's delayed ACK (40 ms per request).
COALESCE_BYTES = 64 << 10


class Responder(Protocol):
    """What a `Response` uses of the request handler it answers for
    (`handler.TimedRequestHandler`): its output stream, the request's HTTP version, whether the
    connection closes after this request, and the request's turn."""

    close_connection: bool

    @property
    def wfile(self) -> io.BufferedIOBase: ...

    @property
    def request_version(self) -> str: ...

    @property
    def protocol_version(self) -> str: ...

    def log_request(self, code: int | str = ..., size: int | str = ...) -> None: ...

    def version_string(self) -> str: ...

    def date_time_string(self) -> str: ...

    def give_turn_back(self) -> None:
        """Give the request's turn back, if it holds one (again: nothing)."""

    def server_stopping(self) -> bool:
        """Whether the server is stopping (then no connection is kept)."""


class Response:
    """Runs the app for one request and writes its response, keeping the connection when it can.

    Werkzeug's own `run_wsgi` closes every connection and asserts `bytes`; this one sends
    each buffer the app yields as it is, chunked only when the app gave no length.
    """

    def __init__(self, handler: Responder, environ: dict[str, Any], body: CountingReader | None):
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
            self.handler.give_turn_back()
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
        # 408: the body stalled for the read timeout, so this connection carries no more requests.
        self.body_stalled = code == 408
        if (
            left > DRAIN_MAX_BYTES
            or self.body_stalled
            or names.get("connection", "").lower() == "close"
            or handler.server_stopping()
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
