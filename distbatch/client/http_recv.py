"""One HTTP/1.1 request whose response body the kernel copies straight into its final buffer.

aiohttp hands a response body over as `bytes` chunks (the kernel copies into each, and we
copy each into the buffer the body is decoded from): two copies of every byte, and at
loopback speeds the second one and the per-chunk Python work were a third of a gather's
time. Here an `asyncio.BufferedProtocol` offers the socket a view of the preallocated
body buffer (`recv_into`), as the raw-socket baseline does: one copy. Only what the
client's data fetches need: a request with a body, a response with a Content-Length,
one request per connection. Anything else raises
`ResponseError`, which the caller treats as a broken connection.

`until_stalled` is the progress watchdog of both directions: a fetch here is judged by the bytes
it receives, an upload (`distbatch.client.transport`) by the bytes the worker acknowledges.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from distbatch.errors import InvalidArgumentError, ResponseError
from distbatch.transport.gather import GatherWrite
from distbatch.wire.container import parts_size

T = TypeVar("T")

MAX_HEAD_BYTES = 64 << 10
PAST_THE_BODY_BYTES = 256  # where bytes after a complete body land (see `get_buffer`)
# A stalled transfer is noticed within this share of the stall timeout past it.
STALL_CHECKS_PER_TIMEOUT = 4


class StalledTransfer(TimeoutError):
    """No byte moved for the stall timeout (none of the response arrived, or none of an upload
    went out): the worker stopped or its link is down (no reset ever arrives then), while a slow
    transfer that still moves is never cut. `moved`: the bytes that did, before it stalled;
    `delivered`: an upload the worker had acknowledged whole before no answer came."""

    def __init__(self, seconds: float, moved: int, sending: bool = False, delivered: bool = False) -> None:
        if delivered:  # an upload the worker has whole: it may have stored it
            super().__init__(
                f"no answer for {seconds:g} s after the worker acknowledged all {moved} bytes of the "
                "request (stalled; it may have stored it)"
            )
        elif sending:
            super().__init__(f"no data went out for {seconds:g} s after {moved} bytes were sent (stalled)")
        else:
            super().__init__(f"no data for {seconds:g} s after {moved} bytes (stalled)")
        self.seconds, self.moved, self.sending, self.delivered = seconds, moved, sending, delivered


async def until_stalled(
    work: Awaitable[T],
    position: Callable[[], int | None],
    stall_timeout: float,
    sending: bool = False,
    cut: Callable[[], None] | None = None,
) -> T:
    """`work`'s result, unless `position()` (bytes moved so far) stays the same for
    `stall_timeout` seconds: then `work` is cancelled (closing its connection) and
    `StalledTransfer` raised. Progress restarts the clock, so a slow transfer is judged by
    whether it moves, never by how long it takes; the caller bounds the total. A position of
    None means the transfer has not begun (a connection being made, bounded by its own
    timeout): the clock does not run. `cut()`, when
    given, runs first whenever `work` is given up (stalled, or our caller cancelled): to drop
    what it still has queued, which must not reach the worker once the link comes back."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work)
    check = stall_timeout / STALL_CHECKS_PER_TIMEOUT
    last, moved_at = position(), loop.time()
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=check)
            if done:
                return task.result()
            now = position()
            if now is None or now != last:
                last, moved_at = now, loop.time()
            elif loop.time() - moved_at >= stall_timeout:
                break
    finally:
        if not task.done():  # a stall, or our caller gave up
            if cut is not None:
                cut()
            task.cancel()
    await asyncio.wait({task})  # let it close its connection
    if not task.cancelled() and task.exception() is None:
        return task.result()  # it finished as it was cancelled
    raise StalledTransfer(stall_timeout, last or 0, sending)


class _BodyProtocol(asyncio.BufferedProtocol):
    """Reads a response head into a scratch buffer, then the body into one buffer of its size."""

    def __init__(self, max_body: int, allocate: Callable[[int], Any]) -> None:
        self.max_body = max_body
        self.allocate = allocate
        self.head = bytearray(MAX_HEAD_BYTES)
        self.head_len = 0
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body: Any = None
        self.view: memoryview | None = None
        self.received = 0
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None
        self._past_the_body = bytearray(PAST_THE_BODY_BYTES)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.view is None:
            return memoryview(self.head)[self.head_len :]
        if self.received < len(self.view):
            return self.view[self.received :]
        # The body is complete (or empty), yet the loop asks again: uvloop does, before it sees
        # the caller close the connection, and it calls an empty buffer a fatal error. Whatever
        # lands here is past the body: `buffer_updated` ignores it once the response is done.
        return memoryview(self._past_the_body)

    def buffer_updated(self, nbytes: int) -> None:
        if self.done.done():
            return
        if self.view is not None:
            self.received += nbytes
            if self.received == len(self.view):
                self._finish()
            return
        self.head_len += nbytes
        end = self.head.find(b"\r\n\r\n", 0, self.head_len)
        if end < 0:
            if self.head_len == len(self.head):
                self._fail(ResponseError(f"response head over {MAX_HEAD_BYTES} bytes"))
            return
        try:
            self._parse_head(bytes(self.head[:end]))
        except ResponseError as exc:
            self._fail(exc)
            return
        extra = self.head_len - (end + 4)
        length = int(self.headers["content-length"])
        self.body = self.allocate(length)
        self.view = memoryview(self.body)
        if extra > length:
            self._fail(ResponseError("response longer than its Content-Length"))
            return
        self.view[:extra] = self.head[end + 4 : self.head_len]
        self.received = extra
        self.head = bytearray()  # no longer needed
        if self.received == length:
            self._finish()

    def _parse_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ResponseError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        self.status = int(parts[1])
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                self.headers[name.strip().lower()] = value.strip()
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            raise ResponseError("chunked responses are not read here")
        length = self.headers.get("content-length", "")
        if not length.isdigit():
            raise ResponseError("response without a Content-Length")
        if int(length) > self.max_body:
            raise ResponseError(f"response of {length} bytes is over the {self.max_body}-byte bound")

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc)
        if self.transport is not None:
            self.transport.abort()

    def eof_received(self) -> bool:
        self._fail(ResponseError(f"connection closed after {self.received} body bytes"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self._fail(exc if isinstance(exc, ConnectionError) else ResponseError("connection lost"))


async def request_into_buffer(
    host: str,
    port: int,
    method: str,
    path: str,
    headers: Mapping[str, str],
    body: bytes,
    max_body: int,
    connect_timeout: asyncio.Timeout | None = None,
    allocate: Callable[[int], Any] = bytearray,
    stall_timeout: float | None = None,
) -> tuple[int, dict[str, str], Any]:
    """Send one request and read its response: (status, lower-case headers, body).

    The body lands in `allocate(length)`, a writable buffer (a `bytearray` by default).

    Connection errors surface as `OSError` / `ConnectionError` (`ResponseError` for a
    broken or unexpected response); the caller bounds the whole with `asyncio.timeout`,
    and `connect_timeout` (an unentered `asyncio.timeout`) bounds the connect alone. With
    `stall_timeout`, `StalledTransfer` when no byte arrives for that long (judging progress, not
    the total time: a slow link that keeps moving is never cut).
    """
    head = _head(method, path, host, port, headers, len(body))
    loop = asyncio.get_running_loop()
    if connect_timeout is None:
        connect_timeout = asyncio.timeout(None)
    async with connect_timeout:
        transport, protocol = await loop.create_connection(
            lambda: _BodyProtocol(max_body, allocate), host, port
        )
    try:
        transport.write(head + body)
        await _done_or_stalled(protocol, stall_timeout)  # the clock starts once the request is sent
        return protocol.status, protocol.headers, protocol.body
    finally:
        transport.close()


def _head(method: str, path: str, host: str, port: int, headers: Mapping[str, str], length: int) -> bytes:
    for name, value in headers.items():
        if any(c in f"{name}{value}" for c in "\r\n"):
            raise InvalidArgumentError(f"header {name!r} holds a line break")
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", f"Content-Length: {length}"]
    # The framing is ours: a Host or Content-Length among `headers` would say it twice (a
    # server must then treat the length as ambiguous: RFC 9112).
    lines += [f"{name}: {value}" for name, value in headers.items() if name.lower() not in _FRAMING]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


_FRAMING = frozenset({"host", "content-length", "transfer-encoding"})


def unacknowledged(transport: Any) -> int:
    """Bytes the kernel holds for `transport`'s socket that the peer has not acknowledged yet
    (Linux's SIOCOUTQ); 0 where that cannot be read."""
    sock = transport.get_extra_info("socket")
    if sock is None or not sys.platform.startswith("linux"):
        return 0
    import fcntl
    import termios

    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
    except (OSError, ValueError):
        return 0


class Upload(Protocol):
    """A request body going out, as the stall watchdog follows it."""

    delivered: bool  # every byte written and acknowledged by the peer

    def acknowledged(self) -> int | None:
        """Bytes that moved so far (None: not started)."""
        ...

    def cut(self) -> None:
        """Close the connection at once, with a reset."""
        ...


async def until_upload_stalled(work: Awaitable[T], upload: Upload, stall_timeout: float) -> T:
    """`until_stalled` for a request with a body: progress is `upload.acknowledged()`, a stall
    cuts the connection (`upload.cut`), and one after the worker had every byte is said so
    (`delivered`: it may have stored it), not "nothing went out"."""
    try:
        return await until_stalled(work, upload.acknowledged, stall_timeout, sending=True, cut=upload.cut)
    except StalledTransfer as stalled:
        if not upload.delivered:
            raise
        raise StalledTransfer(stalled.seconds, stalled.moved, sending=True, delivered=True) from None


class GatheredUpload:
    """A request (head and body parts) written straight to a connection's socket with gathering
    writes (`distbatch.transport.gather`): a ragged column's per-task tensors leave from where
    they lie, never joined. Waits for room through a descriptor of its own (a `dup`: the
    transport owns, and may close, the one it has), so the event loop's transport is never
    written behind its back while it holds bytes: it holds none, this writes everything."""

    def __init__(self, transport: asyncio.Transport, parts: Sequence[Any], answer: _BodyProtocol) -> None:
        self.transport = transport
        self.body = GatherWrite(parts)
        self.answer = answer  # the response: its bytes count as progress too
        self.delivered = False

    async def send(self, until: asyncio.Future[Any] | None = None) -> None:
        """Write the whole request, or stop once `until` is done (the worker answered early)."""
        loop = asyncio.get_running_loop()
        sock = self.transport.get_extra_info("socket")
        fd = os.dup(sock.fileno())
        try:
            while not self.body.done and not (until is not None and until.done()):
                try:
                    self.body.write(fd)
                except BlockingIOError:
                    await _writable(loop, fd, until)
        finally:
            os.close(fd)

    def acknowledged(self) -> int:
        """Bytes of the request the peer has acknowledged plus those of its answer received: for
        the stall watchdog."""
        answered = self.answer.head_len + self.answer.received
        if self.transport.is_closing():
            return self.body.sent + answered
        unacked = unacknowledged(self.transport)
        self.delivered = self.body.done and unacked == 0
        return self.body.sent - unacked + answered

    def cut(self) -> None:
        reset(self.transport)


def reset(transport: asyncio.BaseTransport) -> None:
    """Close a connection at once, with a reset: what the event loop and the kernel still queue
    is dropped, so an upload given up on never completes later (a link that comes back would
    otherwise deliver it, and the worker store a put its caller was told failed)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()  # type: ignore[attr-defined]


async def _writable(loop: asyncio.AbstractEventLoop, fd: int, until: asyncio.Future[Any] | None) -> None:
    """Until `fd` has room to write, or `until` is done."""
    ready: asyncio.Future[None] = loop.create_future()

    def wake(*_: Any) -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_writer(fd, wake)
    if until is not None:
        until.add_done_callback(wake)
    try:
        await ready
    finally:
        loop.remove_writer(fd)
        if until is not None:
            until.remove_done_callback(wake)


async def request_with_parts(
    host: str,
    port: int,
    method: str,
    path: str,
    headers: Mapping[str, str],
    parts: Sequence[Any],
    max_body: int,
    connect_timeout: asyncio.Timeout | None = None,
    stall_timeout: float | None = None,
) -> tuple[int, dict[str, str], Any]:
    """Send one request whose body is `parts` (buffers and `wire.Pieces`) with gathering writes,
    and read its response: (status, lower-case headers, body). Errors as `request_into_buffer`.

    With `stall_timeout`, `StalledTransfer` once nothing moved for that long: neither a byte of
    the request acknowledged by the worker nor one of its answer (a slow link that keeps moving
    is never cut); `delivered` when the worker had acknowledged all of the request. A worker that
    answers before it has read the body (a refusal) is heard at once, and sending stops. Any way
    out but an answer resets the connection, so a request given up on is never completed later.
    """
    loop = asyncio.get_running_loop()
    async with connect_timeout or asyncio.timeout(None):
        transport, protocol = await loop.create_connection(
            lambda: _BodyProtocol(max_body, bytearray), host, port
        )
    answered = False
    try:
        length = parts_size(parts)
        upload = GatheredUpload(
            transport, [_head(method, path, host, port, headers, length), *parts], protocol
        )

        async def exchange() -> None:
            try:
                await upload.send(until=protocol.done)
            except OSError:
                if not (protocol.done.done() and protocol.done.exception() is None):
                    raise  # no answer came with the broken connection
            await protocol.done

        if stall_timeout is None:
            await exchange()
        else:
            await until_upload_stalled(exchange(), upload, stall_timeout)
        answered = True
        return protocol.status, protocol.headers, protocol.body
    finally:
        if answered:
            transport.close()
        else:
            reset(transport)


async def _done_or_stalled(protocol: _BodyProtocol, stall_timeout: float | None) -> None:
    """Wait for the response; `StalledTransfer` once nothing arrived for `stall_timeout`."""
    if stall_timeout is None:
        await protocol.done
        return
    try:
        await until_stalled(
            asyncio.shield(protocol.done), lambda: protocol.head_len + protocol.received, stall_timeout
        )
    except StalledTransfer as exc:
        protocol._fail(exc)  # aborts the connection
        protocol.done.result()  # raises it
