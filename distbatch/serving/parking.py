"""Idle kept-alive connections, waiting for their next request without a thread.

A thread-per-connection server that keeps every idle kept-alive connection on its thread runs
out of threads when many clients each keep one (256 ranks polling one controller), and then
must close idle connections to serve new ones, which the clients reopen at once.
`ParkedConnections` holds idle connections in one selector on one thread instead: a connection
that becomes readable (its next request, or the client closing it) goes back to the server
(`resume`) to be served on a thread again; one idle for `idle_timeout` is closed, the longest
idle first once more than `max_parked` wait, and every one at `close()`.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from distbatch.errors import InvalidArgumentError

# How long `close()` waits for the parking thread to close what it holds.
CLOSE_JOIN_SECONDS = 5.0


def _close(connection: socket.socket) -> None:
    with contextlib.suppress(OSError):
        connection.close()


def _peer_closed(connection: socket.socket) -> bool | None:
    """Whether a readable connection's peer closed it or it failed (True), sent bytes (False), or
    nothing is there after all (None: keep it parked)."""
    try:
        return not connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return True


class ParkedConnections:
    """Idle connections on one selector thread until their next request, timeout or close.

    `resume(connection, address)` is called on the parking thread for a connection whose next
    request has begun to arrive; it should hand it to a serving thread (it may wait for one)
    and closes it itself if it cannot.
    """

    def __init__(
        self, resume: Callable[[socket.socket, Any], None], idle_timeout: float, max_parked: int
    ) -> None:
        if not idle_timeout > 0 or max_parked < 1:
            raise InvalidArgumentError("idle_timeout must be > 0 and max_parked >= 1")
        self._resume = resume
        self._idle_timeout = idle_timeout
        self._max_parked = max_parked
        self._lock = threading.Lock()
        self._arriving: list[tuple[socket.socket, Any]] = []  # parked by other threads, not yet selected
        self._closing = False
        # Owned by the parking thread: connection -> (address, when it idles out), oldest first.
        self._waiting: dict[socket.socket, tuple[Any, float]] = {}
        self._selector = selectors.DefaultSelector()
        self._wake_receiver, self._wake_sender = socket.socketpair()
        self._wake_receiver.setblocking(False)
        self._wake_sender.setblocking(False)
        self._selector.register(self._wake_receiver, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="http-parked-connections", daemon=True)
        self._thread.start()

    def park(self, connection: socket.socket, address: Any) -> None:
        """Hold `connection` (no request under way on it, nothing of one read) until it is readable."""
        with self._lock:
            if self._closing:
                _close(connection)
                return
            self._arriving.append((connection, address))
        self._wake()

    def count(self) -> int:
        """How many connections are parked now."""
        with self._lock:
            return len(self._waiting) + len(self._arriving)

    def close(self) -> None:
        """Close every parked connection and stop the parking thread; later parks close at once."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._wake()
        if self._thread is not threading.current_thread():
            self._thread.join(CLOSE_JOIN_SECONDS)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake is pending anyway) or closed
            self._wake_sender.send(b"w")

    def _run(self) -> None:
        try:
            while self._take_arrivals():
                for key, _ in self._selector.select(self._next_timeout()):
                    if key.fileobj is self._wake_receiver:
                        with contextlib.suppress(OSError):
                            self._wake_receiver.recv(4096)
                    else:
                        self._ready(key.fileobj)  # type: ignore[arg-type]
                self._expire(time.monotonic())
        finally:
            with self._lock:
                self._closing = True
                arriving, self._arriving = self._arriving, []
            for connection in [*self._waiting, *(c for c, _ in arriving)]:
                _close(connection)
            self._waiting.clear()
            self._selector.close()
            self._wake_receiver.close()
            self._wake_sender.close()

    def _take_arrivals(self) -> bool:
        """Select on newly parked connections; False once closing."""
        with self._lock:
            if self._closing:
                return False
            arriving, self._arriving = self._arriving, []
        idles_out = time.monotonic() + self._idle_timeout
        for connection, address in arriving:
            try:
                self._selector.register(connection, selectors.EVENT_READ)
            except (ValueError, OSError):  # closed meanwhile
                _close(connection)
                continue
            self._waiting[connection] = (address, idles_out)
        while len(self._waiting) > self._max_parked:
            self._drop(next(iter(self._waiting)))
        return True

    def _next_timeout(self) -> float | None:
        if not self._waiting:
            return None
        _, idles_out = next(iter(self._waiting.values()))  # the oldest idles out first
        return max(idles_out - time.monotonic(), 0.0)

    def _ready(self, connection: socket.socket) -> None:
        closed = _peer_closed(connection)
        if closed is None:
            return
        address, _ = self._waiting.pop(connection)
        self._selector.unregister(connection)
        if closed:
            _close(connection)
        else:
            self._resume(connection, address)

    def _expire(self, now: float) -> None:
        for connection, (_, idles_out) in list(self._waiting.items()):
            if idles_out > now:
                break
            self._drop(connection)

    def _drop(self, connection: socket.socket) -> None:
        del self._waiting[connection]
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(connection)
        _close(connection)
