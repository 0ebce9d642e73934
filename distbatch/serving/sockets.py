"""The byte level of one server connection: a writer that sends in slices, a reader that counts
a request body, and what can be told of a request from its head and the bytes already buffered.

Apart from the request handler (`handler`) because none of this knows HTTP's flow (turns,
keep-alive, answers): it is the socket-facing part that each of them, and the response writer,
reads or writes through.
"""

from __future__ import annotations

import contextlib
import io
import re
import socket
import time
from typing import Any, cast
from urllib.parse import unquote, urlsplit

from distbatch.wire.container import byte_view

# Each socket send covers at most this much, so the read timeout bounds a stalled peer
# (no progress for that long), never the length of a big honest transfer.
SEND_SLICE_BYTES = 1 << 20
# A connection closed with request bytes unread is reset, and the client may lose the response
# with it; so the server closes its write side and reads the rest, giving up once nothing has
# arrived for `LINGER_SECONDS`, or after `LINGER_MAX_SECONDS` or `LINGER_MAX_BYTES` (the
# handler's `_linger`).
LINGER_SECONDS = 2.0
LINGER_MAX_SECONDS = 10.0
LINGER_MAX_BYTES = 10 << 30
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length[ \t]*:[ \t]*([0-9]+)[ \t]*\r\n", re.IGNORECASE)


class SlicedWriter(io.BufferedIOBase):
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


def path_of(target: str) -> str:
    """The path of a request line's target, percent-decoded as the app's routing sees it ("" when
    it does not parse: refused, not served)."""
    try:
        return unquote(urlsplit(target).path)
    except ValueError:
        return ""


class CountingReader(io.RawIOBase):
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


def framed_length(headers: Any) -> int | None:
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


def arrived_whole(rfile: Any, connection: socket.socket, timeout: float | None) -> bool:
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


def discard_unread(body: CountingReader) -> bool:
    """Read and drop the body bytes an answered request did not read, within
    `LINGER_MAX_SECONDS`; whether they all came (else the connection must close)."""
    deadline = time.monotonic() + LINGER_MAX_SECONDS
    scratch = bytearray(min(body.left, 1 << 20))
    with contextlib.suppress(OSError):
        while body.left and time.monotonic() < deadline and body.readinto(scratch):
            pass
    return not body.left and not body.broken
