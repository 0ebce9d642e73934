"""Recycled receive buffers: big response bodies land in memory that is already mapped in.

The first write to a fresh buffer costs a page fault per 4 KiB page, and at loopback speeds
that is most of a gather's CPU time: measured here, `recv_into` a fresh 256 MiB buffer runs
at ~1 GB/s, into one already touched at ~3.6 GB/s. A gathered column's tensors are views
into its response buffer, so a buffer is free again only when the caller's last tensor over
it goes: each buffer is a numpy array whose finaliser hands its mapping back to the pool.

The pool keeps at most `max_idle_bytes` of idle mappings (the oldest are unmapped first),
each for at most `idle_seconds` when given (a daemon thread unmaps older ones, so a worker's
memory goes back soon after a clear); `max_idle_bytes=0` turns it off. Mappings are private,
so a forked child never shares one with its parent.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
import weakref
from collections import deque

import numpy as np

from distbatch.errors import InvalidArgumentError

# Bodies below this are plain `bytearray`s: malloc already reuses small blocks.
MIN_POOLED_BYTES = 1 << 20
# Mappings are sized in steps of this, so bodies of similar size share them.
GRANULE_BYTES = 1 << 20
DEFAULT_MAX_IDLE_BYTES = 256 << 20
ENV_MAX_IDLE = "DISTBATCH_RECV_POOL_BYTES"


def default_max_idle_bytes() -> int:
    """`DISTBATCH_RECV_POOL_BYTES` from the environment, else `DEFAULT_MAX_IDLE_BYTES`."""
    text = os.environ.get(ENV_MAX_IDLE, "").strip()
    if not text:
        return DEFAULT_MAX_IDLE_BYTES
    try:
        value = int(text)
    except ValueError:
        raise InvalidArgumentError(f"{ENV_MAX_IDLE} must be a whole number of bytes, got {text!r}") from None
    if value < 0:
        raise InvalidArgumentError(f"{ENV_MAX_IDLE} must be >= 0, got {value}")
    return value


class RecvPool:
    """Writable receive buffers of a requested size, recycled once nothing refers to them."""

    def __init__(
        self, max_idle_bytes: int = DEFAULT_MAX_IDLE_BYTES, idle_seconds: float | None = None
    ) -> None:
        if max_idle_bytes < 0 or (idle_seconds is not None and idle_seconds <= 0):
            raise InvalidArgumentError("max_idle_bytes must be >= 0 and idle_seconds > 0")
        self.max_idle_bytes = max_idle_bytes
        self.idle_seconds = idle_seconds
        self._idle: deque[tuple[float, mmap.mmap]] = deque()  # (when it went idle, mapping), oldest first
        self._expirer: threading.Thread | None = None
        self._idle_bytes = 0
        self._closed = False
        # Finalisers run wherever the last reference drops, this thread too, inside `take`.
        self._lock = threading.RLock()
        self.reused = 0  # buffers served from an idle mapping (for tests and benchmarks)

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def take(self, nbytes: int) -> bytearray | np.ndarray:
        """A writable buffer of exactly `nbytes` (contents undefined)."""
        if nbytes < MIN_POOLED_BYTES or self.max_idle_bytes == 0:
            return bytearray(nbytes)
        size = -(-nbytes // GRANULE_BYTES) * GRANULE_BYTES
        region = self._take_idle(size)
        if region is None:
            region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
        else:
            self.reused += 1
            if len(region) > size:  # the tail past this body: give its pages back, nothing uses them
                with contextlib.suppress(OSError):
                    region.madvise(mmap.MADV_DONTNEED, size, len(region) - size)
        buffer = np.frombuffer(region, dtype=np.uint8, count=nbytes)
        # Not at interpreter exit: live buffers must never be handed out again then.
        weakref.finalize(buffer, self._give_back, region).atexit = False
        return buffer

    def _take_idle(self, size: int) -> mmap.mmap | None:
        """The smallest idle mapping of at least `size` bytes and under twice that."""
        with self._lock:
            best = None
            for entry in list(self._idle):  # a collection inside this loop may give one back
                length = len(entry[1])
                if size <= length < 2 * size and (best is None or length < len(best[1])):
                    best = entry
            if best is None:
                return None
            self._idle.remove(best)
            self._idle_bytes -= len(best[1])
            return best[1]

    def _give_back(self, region: mmap.mmap) -> None:
        with self._lock:
            if self._closed or len(region) > self.max_idle_bytes:
                _unmap(region)
                return
            self._idle.append((time.monotonic(), region))
            self._idle_bytes += len(region)
            while self._idle_bytes > self.max_idle_bytes:
                self._drop_oldest()
            if self.idle_seconds is not None and self._expirer is None:
                self._expirer = threading.Thread(target=self._expire, name="recv-pool-expirer", daemon=True)
                self._expirer.start()

    def _drop_oldest(self) -> None:
        _, region = self._idle.popleft()
        self._idle_bytes -= len(region)
        _unmap(region)

    def _expire(self) -> None:
        """Unmap mappings idle for `idle_seconds`; the thread ends when none is left idle."""
        seconds = self.idle_seconds or 0.0
        while True:
            with self._lock:
                now = time.monotonic()
                while self._idle and now - self._idle[0][0] >= seconds:
                    self._drop_oldest()
                if not self._idle:
                    self._expirer = None
                    return
                wait = self._idle[0][0] + seconds - now
            time.sleep(wait)

    def clear(self) -> None:
        """Unmap every idle mapping now (buffers in use go when their last view does)."""
        with self._lock:
            while self._idle:
                self._drop_oldest()

    def close(self) -> None:
        """`clear`, and unmap buffers in use as they come back instead of keeping them."""
        with self._lock:
            self._closed = True
            self.clear()


def _unmap(region: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # still exported somewhere: it goes with its last view
        region.close()
