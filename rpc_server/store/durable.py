"""A durable worker's log: every committed change of the store, as files in its data directory.

Each change the store commits (a put, a staged put's commit, a delete, an idle eviction) becomes
a *record*, numbered in commit order, and a writer thread writes it behind the request: the put
is answered once the store holds it, and the record reaches the disk a moment later (with
`sync`, the put waits for that). A put's record is its bundle as it arrived, in the wire's own
layout, which is a safetensors container: ``safetensors.safe_open`` reads it, its
``__metadata__`` says what it is (`RECORD_KEY`: sequence number, kind, the put's generation, a
CRC32 of its data). A delete's record is a container with metadata only.

Files are ``log/<seq>-<k>-<n>.safetensors`` (a staged put's commit is one record of n parts,
one file each). Each is written as a hidden ``.tmp`` file, fsynced, then renamed, and the
directory fsynced after a batch of renames; records are renamed in order. So after a crash the
log is a prefix of what was committed, less at most the records still being written; `read_log`
drops a ``.tmp`` file, a record missing a part, or one whose data does not match its CRC, and
every record after the first one it drops (a later change may build on it: an append, a delete),
moving them to ``dropped/`` and saying so. Replaying the records in order, with their
generations, rebuilds the store as it was (see `ShardStore.recover`).

How far the disk is behind is reported (`LogStats`: records and bytes not yet durable, the age of
the oldest) and bounded: past `max_lag_bytes` written behind, the next change waits for the
writer (`wait_for_room`), so a slow disk slows puts down instead of filling memory.
"""

from __future__ import annotations

import fcntl
import json
import logging
import mmap
import os
import re
import threading
import time
import zlib
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distbatch.atomic import write_text_atomically
from distbatch.errors import WireFormatError
from distbatch.wire.bundle import Bundle, build_bundle, parse_bundle
from distbatch.wire.container import build_container, byte_view, parse_container
from rpc_server.errors import DurableLogError

logger = logging.getLogger(__name__)

RECORD_KEY = "distbatch_durable"
RECORD_VERSION = 1
LOG_DIR = "log"
DROPPED_DIR = "dropped"
LOCK_FILE = "lock"
NODE_FILE = "node"
_NAME = re.compile(r"^(\d{16})-(\d{1,6})-(\d{1,6})\.safetensors$")

# Written behind the store by default at most this many bytes; then changes wait for the disk.
DEFAULT_MAX_LAG_BYTES = 1 << 30


@dataclass
class Record:
    """One committed change: a put (`bundles`: one, or a commit's parts, all of `generation`) or
    a delete (`delete`: ``{"tasks": [...], "fields": [...] | None}`` for every named field of
    those tasks (None: all of them), or ``{"keys": {field: [task ids]}}``)."""

    seq: int
    kind: str
    generation: int = 0
    bundles: list[Bundle] = field(default_factory=list)
    delete: dict[str, Any] | None = None
    nbytes: int = 0
    queued_at: float = 0.0


@dataclass
class LogStats:
    """How the log stands: what is written behind (not durable yet) and what the disk holds."""

    pending_records: int
    pending_bytes: int
    lag_seconds: float
    durable_seq: int
    written_records: int
    written_bytes: int
    disk_bytes: int
    failed: str | None


class DurableLog:
    """Writes records behind the store, in order, each durable (fsynced, renamed) before the next
    is acknowledged as such; `wait(seq)` blocks until record `seq` is durable."""

    def __init__(
        self, directory: Path, next_seq: int = 1, max_lag_bytes: int = DEFAULT_MAX_LAG_BYTES
    ) -> None:
        self.directory = Path(directory)
        self.log_dir = self.directory / LOG_DIR
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # One worker a directory: a second would interleave its records with ours.
        self._lock_fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise DurableLogError(f"another worker uses {self.directory} (it holds {LOCK_FILE})") from None
        self.max_lag_bytes = max_lag_bytes
        self._next_seq = next_seq
        self._queue: deque[Record] = deque()
        self._pending_bytes = 0
        self._durable_seq = next_seq - 1
        self._written_records = 0
        self._written_bytes = 0
        self._disk_bytes = sum(p.stat().st_size for p in self.log_dir.glob("*.safetensors"))
        self._failed: str | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="durable-log", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the store's side

    def append(
        self,
        kind: str,
        generation: int = 0,
        bundles: Sequence[Bundle] = (),
        delete: dict[str, Any] | None = None,
    ) -> int:
        """Queue a committed change (the store calls this under its lock, so records are in
        commit order); its sequence number. The bundles' buffers must not change afterwards
        (the store's never do: a put's bytes are kept as they arrived)."""
        nbytes = sum(b.nbytes() for b in bundles)
        with self._cond:
            if self._failed is not None:
                raise DurableLogError(f"the durable log in {self.directory} cannot write: {self._failed}")
            if self._closed:
                raise DurableLogError("the durable log is closed")
            seq = self._next_seq
            self._next_seq += 1
            self._queue.append(Record(seq, kind, generation, list(bundles), delete, nbytes, time.monotonic()))
            self._pending_bytes += nbytes
            self._cond.notify_all()
        return seq

    def wait(self, seq: int, timeout: float | None = None) -> bool:
        """Block until record `seq` is durable (True), the timeout passes or the writer failed (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._durable_seq < seq and self._failed is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return self._durable_seq >= seq

    def wait_for_room(self) -> None:
        """Block while more than `max_lag_bytes` are written behind (outside the store's lock)."""
        with self._cond:
            while self._pending_bytes > self.max_lag_bytes and self._failed is None and not self._closed:
                self._cond.wait(1.0)

    def stats(self) -> LogStats:
        with self._cond:
            oldest = self._queue[0].queued_at if self._queue else None
            return LogStats(
                pending_records=len(self._queue),
                pending_bytes=self._pending_bytes,
                lag_seconds=0.0 if oldest is None else time.monotonic() - oldest,
                durable_seq=self._durable_seq,
                written_records=self._written_records,
                written_bytes=self._written_bytes,
                disk_bytes=self._disk_bytes,
                failed=self._failed,
            )

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (up to `timeout` seconds), then stop the writer."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        os.close(self._lock_fd)  # the directory is free for the next worker

    # ------------------------------------------------------------------ the writer

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                batch = list(self._queue)
            try:
                written = [self._write(record) for record in batch]
                _fsync_dir(self.log_dir)
            except OSError as exc:  # a full or failing disk: said, counted; the store keeps serving
                logger.error("durable log: writing record %d failed: %s", batch[0].seq, exc)
                with self._cond:
                    self._failed = f"{type(exc).__name__}: {exc}"
                    self._cond.notify_all()
                return
            with self._cond:
                for record, size in zip(batch, written):
                    self._queue.popleft()
                    self._pending_bytes -= record.nbytes
                    self._durable_seq = record.seq
                    self._written_records += 1
                    self._written_bytes += size
                    self._disk_bytes += size
                self._cond.notify_all()

    def _write(self, record: Record) -> int:
        """Write one record's files (hidden, fsynced, renamed); the bytes written."""
        if record.kind == "delete":
            parts: list[Sequence[Any]] = [_delete_parts(record)]
        else:
            n = len(record.bundles)
            parts = [_put_parts(record, k, n, bundle) for k, bundle in enumerate(record.bundles)]
        total = 0
        n = len(parts)
        for k, file_parts in enumerate(parts):
            name = f"{record.seq:016d}-{k}-{n}.safetensors"
            hidden = self.log_dir / f".{name}.tmp"
            fd = os.open(hidden, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for part in file_parts:
                    view = byte_view(part)
                    done = 0
                    while done < len(view):
                        done += os.write(fd, view[done:])
                    total += len(view)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(hidden, self.log_dir / name)
        return total


def swap_node(directory: Path, node: str) -> str | None:
    """Write the address this worker serves `directory` at (``DIR/node``); the one written
    before, if another worker (this directory's previous life) served it elsewhere."""
    path = Path(directory) / NODE_FILE
    try:
        previous: str | None = path.read_text().strip() or None
    except FileNotFoundError:
        previous = None
    write_text_atomically(path, node + "\n")
    return previous if previous != node else None


def _metadata(record: Record, k: int, n: int, crc: int) -> dict[str, str]:
    info: dict[str, Any] = {
        "version": RECORD_VERSION,
        "seq": record.seq,
        "part": k,
        "parts": n,
        "kind": record.kind,
        "generation": record.generation,
        "crc32": crc,
    }
    if record.delete is not None:
        info["delete"] = record.delete
    return {RECORD_KEY: json.dumps(info, separators=(",", ":"))}


def _crc(parts: Sequence[Any]) -> int:
    crc = 0
    for part in parts:
        crc = zlib.crc32(byte_view(part), crc)
    return crc


def _put_parts(record: Record, k: int, n: int, bundle: Bundle) -> list[Any]:
    data = build_bundle(bundle)[1:]  # the header names the CRC of what follows it
    return build_bundle(bundle, extra_metadata=_metadata(record, k, n, _crc(data)))


def _delete_parts(record: Record) -> list[Any]:
    return build_container([], _metadata(record, 0, 1, 0))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- reading back


@dataclass
class Recovered:
    """What `read_log` found: the records to replay, in order, and what it dropped."""

    records: list[Record]
    dropped: list[str]
    last_seq: int
    disk_bytes: int


def read_log(directory: Path) -> Recovered:
    """The durable records of `directory`'s log, in order: a torn (hidden) file, an incomplete
    record, a file that does not parse or whose data fails its CRC, and every record after the
    first such, are moved to ``dropped/`` (a later record may build on a dropped one)."""
    log_dir = Path(directory) / LOG_DIR
    if not log_dir.is_dir():
        return Recovered([], [], 0, 0)
    dropped: list[str] = []
    groups: dict[int, dict[int, tuple[int, Path]]] = {}
    for path in sorted(log_dir.iterdir()):
        match = _NAME.match(path.name)
        if match is None:
            dropped.append(path.name)  # a .tmp file a crash left, or a stranger
            continue
        seq, k, n = (int(g) for g in match.groups())
        groups.setdefault(seq, {})[k] = (n, path)
    # Every file is mapped and checked (CRC) on a few threads (zlib lets the GIL go), then the
    # records are taken in order up to the first that is not whole.
    ordered = [(seq, k, n, path) for seq in sorted(groups) for k, (n, path) in sorted(groups[seq].items())]
    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
        checked = dict(zip(((seq, k) for seq, k, _, _ in ordered), pool.map(_check_file, ordered)))
    records: list[Record] = []
    good = True
    disk_bytes = 0
    last_seq = 0
    for seq in sorted(groups):
        parts = groups[seq]
        record = _record_of(seq, parts, checked) if good else None
        if record is None:
            good = False
            dropped.extend(path.name for _, path in parts.values())
            continue
        records.append(record)
        disk_bytes += sum(path.stat().st_size for _, path in parts.values())
        last_seq = seq
    if dropped:
        _set_aside(log_dir, Path(directory) / DROPPED_DIR, dropped)
        logger.warning(
            "durable log %s: set %d file(s) aside in %s/: %s", log_dir, len(dropped), DROPPED_DIR, dropped[:5]
        )
    return Recovered(records, dropped, max(last_seq, max(groups, default=0)), disk_bytes)


def _check_file(entry: tuple[int, int, int, Path]) -> tuple[dict[str, Any], memoryview] | None:
    """A record file mapped (not read: the store keeps views of the page cache) with its header
    checked and its data's CRC matched; None if it is not whole."""
    seq, k, n, path = entry
    try:
        data = _mapped(path)
        container = parse_container(data)
        info = json.loads(container.metadata.get(RECORD_KEY, "null"))
        if not isinstance(info, dict) or info.get("version") != RECORD_VERSION:
            return None
        if (info.get("seq"), info.get("part"), info.get("parts")) != (seq, k, n):
            return None
        if info["kind"] != "delete":
            body = data[8 + int.from_bytes(data[:8], "little") :]
            if zlib.crc32(body) != info["crc32"]:
                return None
        return info, data
    except (OSError, WireFormatError, ValueError, KeyError, TypeError):
        return None


def _mapped(path: Path) -> memoryview:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if not size:
            return memoryview(b"")
        return memoryview(
            mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
        )


def _record_of(
    seq: int, parts: dict[int, tuple[int, Path]], checked: dict[tuple[int, int], Any]
) -> Record | None:
    """The record of one sequence number, or None if a part is missing or damaged."""
    counts = {n for n, _ in parts.values()}
    if len(counts) != 1 or set(parts) != set(range(counts.pop())):
        return None
    record: Record | None = None
    for k in sorted(parts):
        found = checked.get((seq, k))
        if found is None:
            return None
        info, data = found
        if record is None:
            record = Record(seq, info["kind"], int(info["generation"]), delete=info.get("delete"))
        if info["kind"] != "delete":
            try:
                record.bundles.append(parse_bundle(data))
            except WireFormatError:
                return None
    return record


def _set_aside(log_dir: Path, dropped_dir: Path, names: list[str]) -> None:
    dropped_dir.mkdir(exist_ok=True)
    for name in names:
        try:
            os.replace(log_dir / name, dropped_dir / name)
        except OSError:
            pass
    _fsync_dir(log_dir)
