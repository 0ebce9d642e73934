"""`Turns`: at most N holders at once, the rest served strictly in arrival order.

`threading.Semaphore` lets a newcomer take a freed slot ahead of threads already waiting, and a
waiter that wakes to check for shutdown loses its place; under a flood of requests some then
wait for seconds while others pass. Here a freed turn is handed to the longest waiter directly,
and waiters sleep until handed one or until `close()`: hundreds of them cost no wake-ups.
"""

from __future__ import annotations

import threading
from collections import deque

from distbatch.errors import InvalidArgumentError


class _Waiter:
    __slots__ = ("wake", "granted")

    def __init__(self) -> None:
        self.wake = threading.Lock()
        self.wake.acquire()
        self.granted = False


class Turns:
    """N turns, handed out first come, first served, until closed."""

    def __init__(self, count: int) -> None:
        if count < 1:
            raise InvalidArgumentError("a Turns needs at least 1 turn")
        self._free = count
        self._closed = False
        self._lock = threading.Lock()
        self._waiting: deque[_Waiter] = deque()

    def take(self) -> bool:
        """Wait for a turn (True), or until `close()` (False: no turn held)."""
        with self._lock:
            if self._closed:
                return False
            if self._free and not self._waiting:
                self._free -= 1
                return True
            waiter = _Waiter()
            self._waiting.append(waiter)
        waiter.wake.acquire()
        return waiter.granted

    def give_back(self) -> None:
        """Hand the turn to the longest waiter, or free it."""
        with self._lock:
            if self._waiting:
                waiter = self._waiting.popleft()
                waiter.granted = True
                waiter.wake.release()
            else:
                self._free += 1

    def close(self) -> None:
        """Send every waiter away without a turn; later `take`s fail at once."""
        with self._lock:
            self._closed = True
            waiting, self._waiting = self._waiting, deque()
        for waiter in waiting:
            waiter.wake.release()

    def waiting(self) -> int:
        """How many wait for a turn now."""
        with self._lock:
            return len(self._waiting)
