"""Same-host shared memory: sealed memfd regions, and the Unix-socket messages that hand them over.

A *region* is a memfd (an anonymous in-memory file: no name in any filesystem, so nothing to
guess and nothing left behind by a crash, and not counted against a container's `/dev/shm`)
written once and then sealed: no process, its creator included, can write, shrink or grow it
again. So a reader can map it without trusting the writer afterwards (its bytes never change)
and without risking SIGBUS (it can never become shorter than a mapping of it). Readers map it
copy-on-write: a tensor over it may be written in place, which changes only the reader's
private copy of the touched pages.

File descriptors travel with `SCM_RIGHTS` over a Unix socket (`send_message` /
`recv_message`): the only way into a region is to be handed one.

Both the worker (`rpc_server.shm_server`) and the client (`distbatch.client.same_host`) use this
module; it knows nothing about bundles or stores.
"""

from __future__ import annotations

import array
import errno
import fcntl
import json
import mmap
import os
import socket
import struct
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from distbatch.errors import ShmError
from distbatch.transport.gather import GatherWrite
from distbatch.wire.container import Part, byte_view

__all__ = [
    "ENV_HOST_ID",
    "ENV_STRICT",
    "ENV_SWITCH",
    "SharedRegion",
    "ShmError",
    "disabled_reason",
    "host_id",
    "recv_message",
    "send_message",
]

ENV_SWITCH = "DISTBATCH_SHM"
# DISTBATCH_SHM_STRICT=1: a same-host request that falls back to HTTP because something failed
# (not because the deployment chose HTTP) raises `SameHostError` instead. The test suite runs so,
# so that a fast path quietly lost is a failing test, not a log line.
ENV_STRICT = "DISTBATCH_SHM_STRICT"
ENV_HOST_ID = "DISTBATCH_HOST_ID"
NET_NAMESPACE_PATH = "/proc/self/ns/net"
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
# Seals a region must carry before anyone maps it: its bytes and its size are final.
REQUIRED_SEALS = (
    getattr(fcntl, "F_SEAL_WRITE", 0) | getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0)
)
# Linux refuses more than 253 descriptors in one message (SCM_MAX_FD).
MAX_FDS_PER_MESSAGE = 250
# A message's head: payload bytes, then how many descriptors travel with it.
_HEAD = struct.Struct("<QI")
_IOV_MAX = 1024
# Rows inside a region start on this boundary, so any dtype's view of them is aligned.
REGION_ALIGNMENT = 64


def disabled_reason() -> str | None:
    """Why this process cannot use the same-host path, or None when it can."""
    switch = os.environ.get(ENV_SWITCH, "").strip().lower()
    if switch in ("0", "false", "off", "no"):
        return f"{ENV_SWITCH}={os.environ[ENV_SWITCH]} turns it off"
    if not sys.platform.startswith("linux"):
        return f"memfd and SCM_RIGHTS need Linux, this is {sys.platform}"
    if not hasattr(os, "memfd_create") or not REQUIRED_SEALS or not hasattr(socket, "send_fds"):
        return "this Python has no memfd_create, file seals or send_fds"
    return None


def strict() -> bool:
    """Whether a failed same-host request raises instead of falling back to HTTP (`ENV_STRICT`)."""
    return os.environ.get(ENV_STRICT, "").strip().lower() in ("1", "true", "on", "yes")


def host_id() -> str:
    """What decides "same host" for the shared-memory path: the kernel's boot id (every process of
    one boot shares it, containers included) and this process's network namespace, since the
    worker's socket is an abstract Unix socket, which only its own network namespace can reach
    (pods on one Kubernetes node share the boot id, not the namespace); or `DISTBATCH_HOST_ID`
    where set."""
    override = os.environ.get(ENV_HOST_ID, "").strip()
    if override:
        return override
    try:
        with open(BOOT_ID_PATH, encoding="ascii") as handle:
            boot = handle.read().strip()
    except OSError:
        return ""
    try:
        namespace = os.readlink(NET_NAMESPACE_PATH)  # "net:[4026531833]"
    except OSError:
        return boot
    return f"{boot}/{namespace}"


def sealed_memfd(parts: Sequence[Part], name: str = "distbatch") -> tuple[int, int]:
    """A new memfd holding `parts` one after another, sealed; returns (descriptor, size).

    The bytes go in with gathering writes (`gather`: the kernel copies them once, per-task
    tensors straight from where they lie; no mapping, so sealing against writes succeeds at
    once). The caller owns the descriptor.
    """
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        size = GatherWrite(parts).write_all(fd)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd, size


def _write_all(write: Callable[[list[memoryview]], int], views: list[memoryview]) -> int:
    """Every view through `write` (a gathering write: `writev`, `sendmsg`), at most `_IOV_MAX`
    views a call, resuming after short writes; the bytes written."""
    total = 0
    pending = [v for v in views if v.nbytes]
    while pending:
        written = write(pending[:_IOV_MAX])
        total += written
        while pending and written >= pending[0].nbytes:
            written -= pending[0].nbytes
            pending.pop(0)
        if written:
            pending[0] = pending[0][written:]
    return total


def checked_size(fd: int) -> int:
    """The size of a region handed to us; `ShmError` unless it is a sealed memfd."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        code = errno.errorcode.get(exc.errno, exc.errno) if exc.errno is not None else exc
        raise ShmError(f"not a sealable memfd ({code})") from None
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise ShmError("the region is not sealed against writing, shrinking and growing")
    return os.fstat(fd).st_size


class SharedRegion:
    """A sealed memfd and this process's read-only mapping of it (`array`, uint8).

    The descriptor is closed when the object goes (a finaliser): whoever may still send it
    to a reader holds the object. The mapping lives while any view of `array` does.
    """

    __slots__ = ("fd", "size", "array", "__weakref__")

    def __init__(self, fd: int, size: int) -> None:
        """Map `fd` (of `size` bytes) and own it: it is closed with this object. If mapping
        fails, nothing is owned (the caller still has to close `fd`)."""
        if size:
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            self.array = np.frombuffer(mapping, dtype=np.uint8)
        else:
            self.array = np.empty(0, dtype=np.uint8)
        self.fd = fd
        self.size = size
        weakref.finalize(self, os.close, fd)  # only once the mapping exists: one owner, one close

    @classmethod
    def from_parts(cls, parts: Sequence[Part]) -> SharedRegion:
        """A new region holding `parts` back to back."""
        fd, size = sealed_memfd(parts)
        return cls._owning(fd, size)

    @classmethod
    def adopt(cls, fd: int) -> SharedRegion:
        """Take over a descriptor received from a peer (closed here if it is refused)."""
        try:
            size = checked_size(fd)
        except BaseException:
            os.close(fd)
            raise
        return cls._owning(fd, size)

    @classmethod
    def _owning(cls, fd: int, size: int) -> SharedRegion:
        try:
            return cls(fd, size)
        except BaseException:
            os.close(fd)  # the mapping failed, so no finaliser owns `fd`
            raise

    def offset_of(self, data: np.ndarray) -> int | None:
        """Where `data` starts inside this region, or None if it is not a view of it."""
        if not self.size:
            return None
        if not data.size:
            return 0  # no bytes: anywhere will do
        start = data.__array_interface__["data"][0] - self.array.__array_interface__["data"][0]
        if 0 <= start and start + data.nbytes <= self.size:
            return start
        return None


def aligned_offsets(sizes: Sequence[int]) -> tuple[list[int], list[int]]:
    """Offsets of buffers of `sizes` packed on `REGION_ALIGNMENT`, and the padding before each."""
    offsets, pads = [], []
    at = 0
    for size in sizes:
        pad = -at % REGION_ALIGNMENT
        at += pad
        offsets.append(at)
        pads.append(pad)
        at += size
    return offsets, pads


def map_for_reading(fd: int, size: int) -> mmap.mmap:
    """Map a received region copy-on-write: reads share the region's pages, writes stay private.

    `size` is what the sender says the region holds; a region smaller than that, or not
    sealed, is refused, so no access through the mapping can ever fault (SIGBUS).
    """
    actual = checked_size(fd)
    if not 0 < size <= actual:
        raise ShmError(f"region holds {actual} bytes, the reply said {size}")
    try:
        return mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    except (OSError, ValueError, OverflowError) as exc:
        raise ShmError(f"cannot map a region of {size} bytes: {exc}") from None


# --------------------------------------------------------------------------- messages


def send_message(sock: socket.socket, payload: Sequence[Part], fds: Sequence[int] = ()) -> None:
    """Send one message: a head, the payload's buffers, and `fds` with `SCM_RIGHTS`.

    The head and the payload go out in one gathering `sendmsg` (more only after a short send),
    the first `MAX_FDS_PER_MESSAGE` descriptors with its first byte; any more follow in
    one-byte messages of their own (Linux caps descriptors per message).
    """
    views = [byte_view(p) for p in payload]
    head = _HEAD.pack(sum(v.nbytes for v in views), len(fds))
    first = list(fds[:MAX_FDS_PER_MESSAGE])
    ancillary = [[(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", first))]] if first else []

    def send(batch: list[memoryview]) -> int:
        return sock.sendmsg(batch, ancillary.pop() if ancillary else [])  # descriptors once

    _write_all(send, [memoryview(head), *views])
    for start in range(MAX_FDS_PER_MESSAGE, len(fds), MAX_FDS_PER_MESSAGE):
        batch = array.array("i", fds[start : start + MAX_FDS_PER_MESSAGE])
        sock.sendmsg([b"\0"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, batch)])


def recv_message(sock: socket.socket, max_bytes: int, max_fds: int) -> tuple[bytearray, list[int]]:
    """Receive one `send_message` message: (payload, descriptors). The caller owns the
    descriptors. `ShmError` for a message over the bounds or descriptors lost in transit;
    `ConnectionError` when the peer closed (at a message boundary: `EOFError`)."""
    fds: list[int] = []
    try:
        head = bytearray()
        while len(head) < _HEAD.size:
            chunk, more = _recvmsg(sock, _HEAD.size - len(head), MAX_FDS_PER_MESSAGE)
            fds += more
            if not chunk:
                if head or fds:
                    raise ConnectionError("the peer closed mid-message")
                raise EOFError
            head += chunk
        size, count = _HEAD.unpack(head)
        if size > max_bytes or count > max_fds:
            raise ShmError(f"message of {size} bytes and {count} descriptors is over the bounds")
        payload = bytearray(size)
        with memoryview(payload) as view:
            got = 0
            while got < size:
                n = sock.recv_into(view[got:])
                if not n:
                    raise ConnectionError("the peer closed mid-message")
                got += n
        while len(fds) < count:
            chunk, more = _recvmsg(sock, 1, MAX_FDS_PER_MESSAGE)
            if not chunk:
                raise ConnectionError("the peer closed mid-message")
            fds += more
        if len(fds) != count:
            raise ShmError(f"expected {count} descriptors, received {len(fds)}")
        return payload, fds
    except BaseException:
        close_all(fds)
        raise


def _recvmsg(sock: socket.socket, size: int, max_fds: int) -> tuple[bytes, list[int]]:
    data, ancillary, flags, _ = sock.recvmsg(
        size, socket.CMSG_SPACE(max_fds * 4), getattr(socket, "MSG_CMSG_CLOEXEC", 0)
    )
    fds: list[int] = []
    for level, kind, body in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            received = array.array("i")
            received.frombytes(body[: len(body) - len(body) % received.itemsize])
            fds += received.tolist()
    if flags & socket.MSG_CTRUNC:
        close_all(fds)
        raise ShmError("descriptors were cut off in transit")
    return data, fds


def close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def abstract_address(name: str) -> str:
    """The socket address of an abstract Unix socket name (Linux: no file, gone with its owner)."""
    return "\0" + name


def json_payload(header: dict[str, Any], body: Sequence[Part] = ()) -> list[Part]:
    """A message payload: a JSON header (length-prefixed), then binary parts."""
    text = json.dumps(header, separators=(",", ":")).encode()
    return [struct.pack("<I", len(text)), text, *body]


def split_payload(payload: bytearray) -> tuple[dict[str, Any], memoryview]:
    """A `json_payload` message back as (header, the binary rest); `ShmError` if malformed."""
    view = memoryview(payload)
    if len(view) < 4:
        raise ShmError("message too short")
    (length,) = struct.unpack_from("<I", view)
    if 4 + length > len(view):
        raise ShmError("message header runs past its end")
    try:
        header = json.loads(bytes(view[4 : 4 + length]))
    except (ValueError, RecursionError):
        raise ShmError("message header is not JSON") from None
    if not isinstance(header, dict):
        raise ShmError("message header must be a JSON object")
    return header, view[4 + length :]
