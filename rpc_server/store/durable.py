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
import resource
import shutil
import threading
import time
import zlib
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from distbatch.atomic import write_text_atomically
from distbatch.errors import WireFormatError
from distbatch.launch.flags import NODE_FILE, served_at
from distbatch.wire.bundle import Bundle, build_bundle, parse_bundle
from distbatch.wire.container import build_container, byte_view, parse_container
from rpc_server.errors import DurableLogError

logger = logging.getLogger(__name__)

RECORD_KEY = "distbatch_durable"
RECORD_VERSION = 1
LOG_DIR = "log"
DROPPED_DIR = "dropped"
LOCK_FILE = "lock"
SNAPSHOT_DIR = "snapshot"
_SNAPSHOT_NAME = re.compile(r"^\d{16}$")
_NAME = re.compile(r"^(\d{16})-(\d{1,6})-(\d{1,6})\.safetensors$")

# The record's CRC field in the container header: a JSON string inside a JSON string.
_NO_CRC = "0000000000"
_CRC_FIELD = rb"\"crc32\":\"%s\""
_CRC_PATTERN = re.compile(rb'\\"crc32\\":\\"(\d{10})\\"')

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
    paths: list[Path] = field(default_factory=list)  # its files, once read back
    snapshot: bool = False  # read from the snapshot the log continues (not a log record)


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
    snapshot_seq: int = 0  # the record the newest snapshot stands for (0: none)
    compactions: int = 0  # snapshots written by this process


class DurableLog:
    """Writes records behind the store, in order, each durable (fsynced, renamed) before the next
    is acknowledged as such; `wait(seq)` blocks until record `seq` is durable."""

    def __init__(self, directory: Path, max_lag_bytes: int = DEFAULT_MAX_LAG_BYTES) -> None:
        """Take `directory` (locked: one worker a directory), read its log back (`recovered`: the
        records to replay, the damaged tail set aside) and start the writer after them."""
        self.directory = Path(directory)
        self.log_dir = self.directory / LOG_DIR
        _make_dir(self.log_dir)
        # One worker a directory: a second would interleave its records with ours, and must not
        # even read the log (it would set aside the files being written).
        self._lock_fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise DurableLogError(f"another worker uses {self.directory} (it holds {LOCK_FILE})") from None
        try:
            self.recovered = read_log(self.directory, set_aside=True)
        except BaseException:
            os.close(self._lock_fd)
            raise
        next_seq = self.recovered.last_seq + 1
        self.max_lag_bytes = max_lag_bytes
        self._next_seq = next_seq
        self._queue: deque[Record] = deque()
        self._pending_bytes = 0
        self._durable_seq = next_seq - 1
        self._written_records = 0
        self._written_bytes = 0
        self._disk_bytes = self.recovered.disk_bytes
        self._snapshot_seq = self.recovered.snapshot_seq
        self._compactions = 0
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
            self._refuse_if_unwritable()
            seq = self._next_seq
            self._next_seq += 1
            self._queue.append(Record(seq, kind, generation, list(bundles), delete, nbytes, time.monotonic()))
            self._pending_bytes += nbytes
            self._cond.notify_all()
        return seq

    def check(self) -> None:
        """`DurableLogError` if a change could not be recorded now (the writer failed, or closed):
        asked before the store applies one."""
        with self._cond:
            self._refuse_if_unwritable()

    def _refuse_if_unwritable(self) -> None:
        """(Caller holds `_cond`.)"""
        if self._failed is not None:
            raise DurableLogError(f"the durable log in {self.directory} cannot write: {self._failed}")
        if self._closed:
            raise DurableLogError("the durable log is closed")

    @property
    def durable_seq(self) -> int:
        """The number of the last record on disk (0: none)."""
        with self._cond:
            return self._durable_seq

    @property
    def next_seq(self) -> int:
        """The number the next record queued will have (the store asks under its lock, which
        every `append` is made under)."""
        with self._cond:
            return self._next_seq

    @property
    def last_queued(self) -> int:
        """The number of the last record queued (0: none)."""
        with self._cond:
            return self._next_seq - 1

    def set_aside(self, records: Sequence[Record]) -> None:
        """Move the log's last records (`recovered`'s tail, which replay could not apply) out of
        it, before anything new is queued: new records then follow the last kept one."""
        if not records:
            return
        paths = [path for record in records for path in record.paths]
        with self._cond:
            if self._queue or self._next_seq != records[-1].seq + 1:
                raise DurableLogError("only the recovered log's tail can be set aside, before any change")
            self._next_seq = records[0].seq
            self._durable_seq = self._next_seq - 1
            self._disk_bytes -= sum(path.stat().st_size for path in paths)
        _set_aside(self.log_dir, self.directory / DROPPED_DIR, [path.name for path in paths])

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
                snapshot_seq=self._snapshot_seq,
                compactions=self._compactions,
            )

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (up to `timeout` seconds), then stop the writer."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():  # records still being written: the directory stays ours
            logger.error(
                "durable log %s: %d record(s) still unwritten after %.0f s; the directory stays locked",
                self.directory,
                len(self._queue),
                timeout,
            )
            return
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
            except BaseException as exc:  # a full or failing disk, or anything: said; the store serves on
                logger.error("durable log: writing record %d failed: %s", batch[0].seq, exc, exc_info=True)
                with self._cond:
                    # What is queued will never be written: let go of the bodies it holds.
                    unwritten = len(self._queue)
                    self._queue.clear()
                    self._pending_bytes = 0
                    self._failed = f"{type(exc).__name__}: {exc} ({unwritten} record(s) not written)"
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
        n = len(parts)
        return sum(_write_file(self.log_dir, record_name(record.seq, k, n), p) for k, p in enumerate(parts))

    # ------------------------------------------------------------------ compaction

    def write_snapshot(self, seq: int, puts: Sequence[tuple[int, Bundle]]) -> bool:
        """Write `puts` ((generation, bundle) each, in replay order: `snapshot.snapshot_bundles`)
        as the snapshot of the store after record `seq`, then drop the log records it replaces
        and the older snapshot. Crash-safe at every step: the snapshot is written in a hidden
        directory, fsynced, and renamed into place (until then recovery ignores it and replays
        the whole log); records up to `seq` are deleted only after, and a recovery finding some
        left deletes them. False if the newest snapshot already stands for `seq` (nothing
        changed since). Raises `OSError` (the log and the older snapshot are kept)."""
        root = self.directory / SNAPSHOT_DIR
        with self._cond:
            if seq <= self._snapshot_seq:
                return False
        _make_dir(root)
        name = f"{seq:016d}"
        hidden = root / f".{name}.tmp"
        shutil.rmtree(hidden, ignore_errors=True)
        hidden.mkdir()
        written = 0
        try:
            for i, (generation, bundle) in enumerate(puts, 1):
                record = Record(i, "put", generation)
                written += _write_file(hidden, record_name(i, 0, 1), _put_parts(record, 0, 1, bundle))
            _fsync_dir(hidden)
        except BaseException:  # a full disk: what the half snapshot took goes back to the log
            shutil.rmtree(hidden, ignore_errors=True)
            raise
        os.replace(hidden, root / name)
        _fsync_dir(root)
        # The snapshot stands for records 1..seq: once they are all written (none is written after
        # its file is deleted), they and the older snapshot go.
        self.wait(seq)
        freed = _remove_superseded(self.directory, seq)
        with self._cond:
            self._snapshot_seq = seq
            self._compactions += 1
            self._disk_bytes += written - freed
        return True


def record_name(seq: int, k: int, n: int) -> str:
    """The file name of part `k` of the `n` parts of record `seq`."""
    return f"{seq:016d}-{k}-{n}.safetensors"


def map_record(path: Path) -> Bundle:
    """A put record's bundle, its columns views of the file mapped read-only and not read in
    (pages come from the disk as they are touched, and the kernel may drop them again: a
    spilled shard's home). Holds one descriptor while a view lives. Raises `OSError`,
    `WireFormatError`."""
    return parse_bundle(_mapped(path, populate=False))


def swap_node(directory: Path, node: str) -> list[str]:
    """Add the address this worker serves `directory` at to ``DIR/node`` (every address it was
    served at, oldest first); the earlier ones, other than `node`: a controller may know any of
    them (a worker restarted twice before it was told)."""
    path = Path(directory) / NODE_FILE
    known = served_at(directory)
    earlier = [n for n in dict.fromkeys(known) if n != node]
    write_text_atomically(path, "".join(f"{n}\n" for n in [*earlier, node]))
    return earlier


def _metadata(record: Record, k: int, n: int) -> dict[str, str]:
    info: dict[str, Any] = {
        "version": RECORD_VERSION,
        "seq": record.seq,
        "part": k,
        "parts": n,
        "kind": record.kind,
        "generation": record.generation,
        "crc32": _NO_CRC,
    }
    if record.delete is not None:
        info["delete"] = record.delete
    return {RECORD_KEY: json.dumps(info, separators=(",", ":"))}


def _with_crc(parts: list[Any]) -> list[Any]:
    """The file's parts, the header's CRC placeholder replaced by the CRC32 of every byte of the
    file as it reads with the placeholder (header and data: a damaged id or JSON value counts)."""
    header = bytes(parts[0])
    crc = 0
    for part in [header, *parts[1:]]:
        crc = zlib.crc32(byte_view(part), crc)
    filled = header.replace(_CRC_FIELD % _NO_CRC.encode(), _CRC_FIELD % b"%010d" % crc, 1)
    if len(filled) != len(header) or filled == header and crc != int(_NO_CRC):
        raise WireFormatError("a durable record's header has no CRC placeholder")
    return [filled, *parts[1:]]


def _put_parts(record: Record, k: int, n: int, bundle: Bundle) -> list[Any]:
    metadata = _metadata(record, k, n)
    sizes = {key: c.json_sizes.tolist() for key, c in bundle.columns.items() if c.json_sizes is not None}
    if sizes:  # a snapshot's JSON values keep the sizes they were accounted at
        info = json.loads(metadata[RECORD_KEY])
        info["json_sizes"] = sizes
        metadata[RECORD_KEY] = json.dumps(info, separators=(",", ":"))
    return _with_crc(build_bundle(bundle, extra_metadata=metadata))


def _delete_parts(record: Record) -> list[Any]:
    return _with_crc(build_container([], _metadata(record, 0, 1)))


def _file_crc(data: memoryview) -> tuple[int, int] | None:
    """(CRC the header names, CRC of the file with the placeholder back), None if no CRC field."""
    header_end = 8 + int.from_bytes(data[:8], "little")
    header = bytes(data[:header_end])
    found = _CRC_PATTERN.search(header)
    if found is None:
        return None
    blank = header[: found.start(1)] + _NO_CRC.encode() + header[found.end(1) :]
    return int(found.group(1)), zlib.crc32(data[header_end:], zlib.crc32(blank))


def _write_file(directory: Path, name: str, parts: Sequence[Any]) -> int:
    """`parts` as file `name` in `directory`: written hidden, fsynced, renamed; the bytes written.
    A file that cannot be written whole is deleted (a full disk gets back what it took)."""
    hidden = directory / f".{name}.tmp"
    total = 0
    fd = os.open(hidden, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for part in parts:
            view = byte_view(part)
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
            total += len(view)
        os.fsync(fd)
    except BaseException:
        _remove_quietly(hidden)
        raise
    finally:
        os.close(fd)
    os.replace(hidden, directory / name)
    return total


def _remove_superseded(directory: Path, seq: int) -> int:
    """Delete the log records up to `seq` and every snapshot but the one of `seq` (the snapshot of
    `seq` is on disk); the bytes freed."""
    freed = 0
    log_dir = directory / LOG_DIR
    for path in log_dir.iterdir() if log_dir.is_dir() else ():
        match = _NAME.match(path.name)
        if match is not None and int(match.group(1)) <= seq:
            freed += path.stat().st_size
            path.unlink()
    _fsync_dir(log_dir)
    root = directory / SNAPSHOT_DIR
    for old in root.iterdir():
        if old.name != f"{seq:016d}":
            freed += _tree_bytes(old) if _SNAPSHOT_NAME.match(old.name) else 0
            shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(root)
    return freed


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def _remove_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _make_dir(path: Path) -> None:
    """`path` and its missing parents, each new one fsynced into its parent (so a record
    acknowledged in a fresh directory survives a power loss)."""
    missing = []
    at = path
    while not at.exists():
        missing.append(at)
        at = at.parent
    for new in reversed(missing):
        try:
            new.mkdir()
        except FileExistsError:
            pass
        _fsync_dir(new.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- reading back


@dataclass
class Recovered:
    """What `read_log` found: the records to replay, in order (the snapshot's first), and what
    it set aside."""

    records: list[Record]
    dropped: list[str]
    last_seq: int
    disk_bytes: int
    snapshot_seq: int = 0


def read_log(directory: Path, set_aside: bool = False) -> Recovered:
    """The durable records of `directory`: the newest snapshot's (see `DurableLog.write_snapshot`),
    then the log's after it, in order, up to the first that is not whole: a torn (hidden) file,
    a record missing a part or a number, a file that does not parse or whose CRC does not match.
    It and every later record (which may build on it: an append, a delete) are `dropped`; with
    `set_aside` (the log's owner only: see `DurableLog`), moved to ``dropped/<time>/``, and what
    a compaction left behind (records the snapshot replaces, a snapshot half written or
    replaced) is deleted. A file that cannot be read (an I/O error), a record of a newer format,
    or a damaged snapshot raises: nothing is set aside for a reason that is not the file's, and
    a snapshot is all that is left of the records it replaced."""
    directory = Path(directory)
    snapshot_seq, snapshot_files = _newest_snapshot(directory)
    log_dir = directory / LOG_DIR
    dropped: list[str] = []
    groups: dict[int, dict[int, tuple[int, Path]]] = {}
    for path in sorted(log_dir.iterdir()) if log_dir.is_dir() else []:
        match = _NAME.match(path.name)
        if match is None:
            dropped.append(path.name)  # a .tmp file a crash left, or a stranger
            continue
        seq, k, n = (int(g) for g in match.groups())
        if seq <= snapshot_seq:
            continue  # the snapshot holds what it did
        groups.setdefault(seq, {})[k] = (n, path)
    # Every file is mapped and checked (CRC) on a few threads (zlib lets the GIL go), then the
    # records are taken in order up to the first that is not whole.
    ordered = [(i, 0, 1, path) for i, path in enumerate(snapshot_files, 1)]
    ordered += [(seq, k, n, path) for seq in sorted(groups) for k, (n, path) in sorted(groups[seq].items())]
    may_map = len(ordered) <= mappable_files()
    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
        checked = dict(
            zip((path for *_, path in ordered), pool.map(lambda e: _check_file(e, may_map), ordered))
        )
    records: list[Record] = []
    for i, path in enumerate(snapshot_files, 1):
        record = _record_of(i, {0: (1, path)}, checked)
        if record is None or record.kind != "put":
            raise DurableLogError(
                f"the snapshot {path.parent} is damaged ({path.name}): it cannot be replayed"
            )
        record.snapshot = True
        records.append(record)
    disk_bytes = sum(path.stat().st_size for path in snapshot_files)
    last_seq = snapshot_seq
    broken = False
    for seq in sorted(groups):
        parts = groups[seq]
        record = None
        # After a snapshot, the record that follows it; without one, any number (the log's
        # head may be gone); then no gaps.
        follows = seq == last_seq + 1 or (not snapshot_seq and not records)
        if not broken and follows:
            record = _record_of(seq, parts, checked)
        if record is None:
            broken = True
            dropped.extend(path.name for _, path in parts.values())
            continue
        records.append(record)
        disk_bytes += sum(path.stat().st_size for _, path in parts.values())
        last_seq = seq
    if set_aside:
        # Only now, the newest snapshot read whole: what a compaction left behind (the records
        # it replaces, an older snapshot, one half written) goes as a finished compaction's does.
        if (directory / SNAPSHOT_DIR).is_dir():
            _remove_superseded(directory, snapshot_seq)
        if dropped:
            _set_aside(log_dir, directory / DROPPED_DIR, dropped)
            logger.warning(
                "durable log %s: set %d file(s) aside in %s/: %s",
                log_dir,
                len(dropped),
                DROPPED_DIR,
                dropped[:5],
            )
    return Recovered(records, dropped, last_seq, disk_bytes, snapshot_seq)


def _newest_snapshot(directory: Path) -> tuple[int, list[Path]]:
    """(the record the newest whole snapshot stands for, its files in order); (0, []) if none."""
    root = directory / SNAPSHOT_DIR
    if not root.is_dir():
        return 0, []
    whole = sorted(path for path in root.iterdir() if _SNAPSHOT_NAME.match(path.name))
    if not whole:
        return 0, []
    files = sorted(whole[-1].iterdir())
    expected = [record_name(i, 0, 1) for i in range(1, len(files) + 1)]
    if [path.name for path in files] != expected:
        raise DurableLogError(f"the snapshot {whole[-1]} is damaged: its files are not 1..{len(files)}")
    return int(whole[-1].name), files


def mappable_files() -> int:
    """How many record files recovery may map: each mapping holds a descriptor, so a share of
    the open-file limit (raised to its hard limit first) and of the kernel's mapping limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    limit = 1 << 20 if soft == resource.RLIM_INFINITY else soft
    return min(limit // 4, 16384)


def _check_file(entry: tuple[int, int, int, Path], may_map: bool) -> tuple[dict[str, Any], memoryview] | None:
    """A record file (mapped when `may_map`: the store then keeps views of the page cache) with
    its header and CRC checked; None if it is not whole. An I/O error raises."""
    seq, k, n, path = entry
    data = _mapped(path) if may_map else memoryview(path.read_bytes())
    try:
        container = parse_container(data)
        info = json.loads(container.metadata.get(RECORD_KEY, "null"))
        if not isinstance(info, dict):
            return None
        if isinstance(info.get("version"), int) and info["version"] > RECORD_VERSION:
            raise DurableLogError(
                f"{path} was written by a newer distbatch (record version {info['version']}):"
                " upgrade to read it"
            )
        if info.get("version") != RECORD_VERSION or (info["seq"], info["part"], info["parts"]) != (seq, k, n):
            return None
        crc = _file_crc(data)
        if crc is None or crc[0] != crc[1] or info.get("kind") not in ("put", "delete"):
            return None
        if not isinstance(info.get("generation"), int) or isinstance(info["generation"], bool):
            return None
        return info, data
    except (WireFormatError, ValueError, KeyError, TypeError):
        return None


def _mapped(path: Path, populate: bool = True) -> memoryview:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if not size:
            return memoryview(b"")
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        mapped = mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ)
        return memoryview(mapped)


def _record_of(seq: int, parts: dict[int, tuple[int, Path]], checked: dict[Path, Any]) -> Record | None:
    """The record of one sequence number, or None if a part is missing or damaged."""
    counts = {n for n, _ in parts.values()}
    if len(counts) != 1 or set(parts) != set(range(counts.pop())):
        return None
    record: Record | None = None
    for k in sorted(parts):
        found = checked.get(parts[k][1])
        if found is None:
            return None
        info, data = found
        if record is None:
            record = Record(seq, info["kind"], info["generation"], delete=info.get("delete"))
        record.paths.append(parts[k][1])
        if info["kind"] != "delete":
            try:
                bundle = parse_bundle(data)
                for key, sizes in (info.get("json_sizes") or {}).items():
                    column = bundle.columns[key]
                    if column.dtype is not None or len(sizes) != column.count:
                        return None
                    column.json_sizes = np.asarray(sizes, dtype=np.int64)
            except (WireFormatError, KeyError, TypeError, ValueError):
                return None
            record.bundles.append(bundle)
    return record


def _set_aside(log_dir: Path, dropped_dir: Path, names: list[str]) -> None:
    """Move `names` out of the log into a folder of their own under `dropped_dir` (a later
    recovery's files never clash with these)."""
    aside = dropped_dir / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{time.monotonic_ns()}"
    _make_dir(aside)
    for name in names:
        try:
            os.replace(log_dir / name, aside / name)
        except FileNotFoundError:
            pass
    _fsync_dir(aside)
    _fsync_dir(log_dir)
