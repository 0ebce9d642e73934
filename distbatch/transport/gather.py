"""Gathering writes: a body's parts handed to the kernel as one array of (address, length) rows.

A ragged column's per-task tensors (`wire.Pieces`) go straight from where they lie into a socket
or a memfd: no `cat` into fresh memory first, and no Python object per task (the rows are a numpy
array of `struct iovec`; one `writev` takes up to `IOV_MAX` of them, through ctypes, which
releases the GIL). Plain buffers in the same body become one row each.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from distbatch.wire.container import Part, Pieces, byte_view

IOV_MAX = 1024
MAX_CALL_BYTES = 1 << 30  # process_vm_readv copies less than 2 GiB a call

_libc = ctypes.CDLL(None, use_errno=True)
_writev = _libc.writev
_writev.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
_writev.restype = ctypes.c_ssize_t
_vm_readv = getattr(_libc, "process_vm_readv", None)
if _vm_readv is not None:
    _vm_readv.argtypes = (
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_ulong,
    )
    _vm_readv.restype = ctypes.c_ssize_t


def iovecs(parts: Sequence[Part]) -> tuple[np.ndarray, list[Any]]:
    """The rows of `parts` in order, empty ones left out, and the objects that own their memory."""
    rows: list[np.ndarray] = []
    keep: list[Any] = []
    for part in parts:
        if isinstance(part, Pieces):
            rows.append(part.iov)
        else:
            view = byte_view(part)
            if not view.nbytes:
                continue
            array = np.frombuffer(view, dtype=np.uint8)  # read-only buffers too: only read here
            rows.append(np.array([[array.ctypes.data, array.nbytes]], dtype=np.uint64))
            part = view  # what the address points into: a strided buffer's flat copy, not the buffer
        keep.append(part)
    iov = np.concatenate(rows) if rows else np.zeros((0, 2), dtype=np.uint64)
    return np.ascontiguousarray(iov[iov[:, 1] > 0]), keep


def past(iov: np.ndarray, nbytes: int) -> np.ndarray:
    """The rows of `iov` after its first `nbytes` bytes: rows covered whole dropped, the row a
    short transfer stopped inside moved on (a copy: `iov` is left as it is)."""
    ends = np.cumsum(iov[:, 1], dtype=np.uint64)
    whole = int(np.searchsorted(ends, nbytes, side="right"))
    rest = iov[whole:].copy()
    into = nbytes - (int(ends[whole - 1]) if whole else 0)
    if into and len(rest):
        rest[0, 0] += np.uint64(into)
        rest[0, 1] -= np.uint64(into)
    return rest


class GatherWrite:
    """A body's parts written with `writev`, resuming where a short or refused write stopped.

    `write(fd)` makes one call; on a non-blocking socket it raises `BlockingIOError` when the
    socket is full (wait until it is writable, then call again). `sent` counts the bytes out.
    """

    def __init__(self, parts: Sequence[Part]) -> None:
        self.iov, self._keep = iovecs(parts)
        self.size = int(self.iov[:, 1].sum())
        self.sent = 0
        self._pending = self.iov  # the rows not yet written, the first one perhaps in part

    @property
    def done(self) -> bool:
        return self.sent >= self.size

    def write(self, fd: int) -> int:
        """One `writev` of the next rows (at most `IOV_MAX`); the bytes it wrote."""
        if self.done:
            return 0
        batch = self._pending[:IOV_MAX]
        written = _writev(fd, batch.ctypes.data, len(batch))
        if written < 0:
            code = ctypes.get_errno()
            if code in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise BlockingIOError(code, os.strerror(code))
            if code == errno.EINTR:
                return 0
            raise OSError(code, os.strerror(code))
        self.sent += written
        self._pending = past(self._pending, written)
        return written

    def write_all(self, fd: int) -> int:
        """Write everything to a blocking descriptor (a memfd, a file); the bytes written."""
        while not self.done:
            self.write(fd)
        return self.sent


def copy_runs(out: np.ndarray, sources: np.ndarray) -> bool:
    """Copy the byte runs `sources` ((n, 2) uint64: address and length, in this process's
    memory) one after another into `out` (uint8, their total length), with `process_vm_readv` on
    this very process: the kernel walks both arrays, `IOV_MAX` runs a call, no step per run here.
    False where the kernel refuses it (no such call, or a sandbox that forbids it): copy another
    way."""
    if _vm_readv is None:
        return False
    sources = np.ascontiguousarray(sources, dtype=np.uint64)
    lengths = sources[:, 1]
    dest = np.empty_like(sources)
    dest[:, 0] = np.uint64(out.ctypes.data) + np.cumsum(lengths, dtype=np.uint64) - lengths
    dest[:, 1] = lengths
    pid = os.getpid()
    first = True
    pending_src, pending_dst = sources, dest
    while len(pending_src):
        # At most IOV_MAX runs and about MAX_CALL_BYTES a call (the kernel copies under 2 GiB a
        # call); a run longer than that goes alone and resumes where the kernel stopped.
        ends = np.cumsum(pending_src[:IOV_MAX, 1], dtype=np.uint64)
        count = max(1, int(np.searchsorted(ends, MAX_CALL_BYTES, side="right")))
        remote, local = pending_src[:count], pending_dst[:count]
        done = _vm_readv(pid, local.ctypes.data, count, remote.ctypes.data, count, 0)
        if done < 0:
            code = ctypes.get_errno()
            if first and code in (errno.EPERM, errno.ENOSYS, errno.EACCES):
                return False
            raise OSError(code, os.strerror(code))
        if done == 0 and int(remote[:, 1].sum()):
            raise OSError(errno.EFAULT, "process_vm_readv copied nothing")
        first = False
        pending_src, pending_dst = past(pending_src, done), past(pending_dst, done)
    return True
