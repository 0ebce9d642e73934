"""Spilling: a durable worker past its memory bound moves its coldest shards to disk.

A durable worker's log already holds every committed put's bytes in a record file, so moving a
buffer to disk writes nothing: its tensor segments are repointed at the same bytes in that file,
mapped read-only and not read in, and the memory they were in goes (`SegmentTable.spill`). The
page cache then holds what is read, and the kernel may drop it again; a fetch of a spilled shard
reads it back from the file, and is counted. Buffers used longest ago go first; only a buffer
whose record is on disk can go (the store waits for the log before it needs to). JSON values,
resolved appends' own memory and compacted copies stay in memory (they are not a record's bytes
as they are).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from distbatch.errors import WireFormatError
from rpc_server.store.columns import Picked
from rpc_server.store.durable import DurableLog, map_record, mappable_files, record_name
from rpc_server.store.segments import SegmentTable

logger = logging.getLogger(__name__)


class Spiller:
    """Frees memory by spilling buffers to their record files, and counts what is read back.

    Each spilled buffer keeps its file mapped (one descriptor): at most `max_files` at once
    (default: a share of the open-file limit), past that nothing more is spilled."""

    def __init__(self, log: DurableLog, max_files: int | None = None) -> None:
        self._log = log
        self.max_files = mappable_files() if max_files is None else max_files
        self.read_back_shards = 0
        self.read_back_bytes = 0

    def free(self, segments: SegmentTable, need: int) -> int:
        """Spill the coldest buffers whose records are on disk until `need` bytes of memory are
        free (or none is left); the bytes freed. Caller holds the store lock."""
        freed = 0
        for buffer in segments.spill_candidates(self._log.durable_seq):
            if freed >= need or segments.disk_buffers >= self.max_files:
                break
            if buffer.record is None:
                continue
            path = self._log.log_dir / record_name(*buffer.record)
            try:
                columns = map_record(path).columns
            except (OSError, WireFormatError) as exc:
                logger.warning("cannot spill to %s (kept in memory): %s", path, exc)
                buffer.record = None
                continue
            moved = segments.spill(buffer, columns)
            if not moved:
                logger.warning("%s does not hold what the store holds (kept in memory)", path)
                buffer.record = None
            freed += moved
        return freed

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
