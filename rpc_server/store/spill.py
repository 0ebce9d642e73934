"""Spilling: a durable worker past its memory bound moves its coldest shards to disk.

A durable worker's log already holds every committed put's bytes in a record file, so moving such
a buffer to disk writes nothing: its tensor segments are repointed at the same bytes in that
file, mapped read-only and not read in, and the memory they were in goes
(`SegmentTable.spill`). Memory no record holds as it is (a value an append extended, a copy made
when deletes compacted a buffer, a buffer whose record a log compaction replaced) is written to
a file of its own under ``DIR/spill/`` first, mapped, and unlinked at once (the mapping keeps it;
nothing is left behind by a crash). The page cache then holds what is read, and the kernel may
drop it again; a fetch of a spilled shard reads it back from the file, and is counted. Buffers
used longest ago go first; a buffer whose record is not on disk yet waits (the store waits for
the log before it needs to). JSON values stay in memory.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from distbatch.errors import WireFormatError
from distbatch.wire.container import byte_view
from rpc_server.store.columns import Picked
from rpc_server.store.durable import DurableLog, map_record, mappable_files
from rpc_server.store.segments import Buffer, SegmentTable

logger = logging.getLogger(__name__)

SPILL_DIR = "spill"


class Spiller:
    """Frees memory by spilling buffers to files, and counts what is read back.

    Each spilled buffer keeps its file mapped (one descriptor): at most `max_files` at once
    (default: a share of the open-file limit), past that nothing more is spilled."""

    def __init__(self, log: DurableLog, max_files: int | None = None) -> None:
        self._log = log
        self.max_files = mappable_files() if max_files is None else max_files
        self.read_back_shards = 0
        self.read_back_bytes = 0
        self.written_bytes = 0  # spilled by writing a file of their own (no record held them)
        self.directory = log.directory / SPILL_DIR
        self.directory.mkdir(exist_ok=True)
        for stale in self.directory.iterdir():  # a crash between writing one and unlinking it
            stale.unlink(missing_ok=True)

    def free(self, segments: SegmentTable, need: int) -> int:
        """Spill the coldest buffers until `need` bytes of memory are free (or none is left);
        the bytes freed. Caller holds the store lock."""
        freed = 0
        for buffer in segments.spill_candidates(self._log.durable_seq):
            if freed >= need or segments.disk_buffers >= self.max_files:
                break
            homes = self._in_record(buffer, segments) if buffer.record is not None else None
            if homes is None:
                homes = self._written(buffer, segments)
            freed += segments.spill(buffer, homes)
        return freed

    def _in_record(self, buffer: Buffer, segments: SegmentTable) -> dict[int, np.ndarray] | None:
        """The buffer's tensor segments in its record file (None: the file is gone, as after a log
        compaction, or does not hold them as they are; the buffer then forgets it)."""
        if buffer.record is None:
            return None
        path = buffer.record[1]
        try:
            columns = map_record(path).columns
        except (OSError, WireFormatError) as exc:
            logger.info("cannot spill to %s, written instead: %s", path, exc)
            buffer.record = None
            return None
        homes = {}
        for seg_id in buffer.members:
            seg = segments.segments[seg_id]
            column = columns.get(buffer.keys.get(seg_id, ""))
            if seg.dtype is None:
                continue
            home = None
            if column is not None and column.dtype is not None:
                home = np.frombuffer(column.single_buffer(), dtype=np.uint8)
            if home is None or seg.data is None or home.nbytes != seg.data.nbytes:
                buffer.record = None  # not mapped and parsed again at every put past the bound
                return None
            homes[seg_id] = home
        return homes

    def _written(self, buffer: Buffer, segments: SegmentTable) -> dict[int, np.ndarray]:
        """The buffer's tensor segments written to a file of their own, mapped (empty: nothing to
        write, or the disk refused: the buffer stays in memory)."""
        moving = [
            segments.segments[s] for s in sorted(buffer.members) if segments.segments[s].dtype is not None
        ]
        sizes = [seg.bytes_array.nbytes for seg in moving]
        if not moving or not sum(sizes):
            return {}
        try:
            mapped = _write_and_map(self.directory, [seg.bytes_array for seg in moving])
        except OSError as exc:
            logger.warning(
                "cannot spill %d bytes to %s (kept in memory): %s", sum(sizes), self.directory, exc
            )
            return {}
        self.written_bytes += sum(sizes)
        starts = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        array = np.frombuffer(mapped, dtype=np.uint8)
        return {seg.id: array[starts[k] : starts[k + 1]] for k, seg in enumerate(moving)}

    def note_fetch(self, segments: SegmentTable, picked: Sequence[Picked]) -> None:
        """A fetch picked these rows: their buffers were used now; rows of spilled segments are
        read back from disk (counted). One step per segment used, not per row."""
        now = segments.tick()
        for found in picked:
            for seg_id, seg in found.used.items():
                seg.buffer.last_used = now
                if seg.buffer.on_disk:
                    rows = found.positions if len(found.used) == 1 else found.positions[found.segs == seg_id]
                    self.read_back_shards += len(rows)
                    self.read_back_bytes += int(seg.sizes[rows].sum())


def _write_and_map(directory: Path, arrays: Sequence[np.ndarray]) -> memoryview:
    """`arrays` one after another in a new file in `directory`, mapped read-only; the file is
    unlinked at once (the mapping keeps its pages; nothing stays on disk after the process)."""
    fd, name = tempfile.mkstemp(dir=directory, prefix="spill-")
    try:
        os.unlink(name)
        with os.fdopen(fd, "wb", closefd=False) as out:
            for array in arrays:
                out.write(byte_view(array.data))
        size = os.fstat(fd).st_size
        return memoryview(mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
    finally:
        os.close(fd)
