"""Staged puts: bundles held under a stage id until a commit stores them at once.

A put split over several requests is staged part by part, then committed. Staged bytes are
reserved against capacity (so a commit cannot overflow), a stage untouched for `ttl` seconds is
dropped with its reservation, and how a stage ended is remembered for `ttl` seconds: a retried
commit answers the same, and a late part of an aborted stage is refused. Separate from the
store's data: a stage holds bundles, not segments, until the store applies them. Nothing here
locks: the store calls it with its lock held.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from distbatch.transport.shm import SharedRegion
from distbatch.wire.bundle import Bundle

logger = logging.getLogger("rpc_server")


class StagedPart(NamedTuple):
    """One staged request: its bundle, its body's size, and the shared region holding the body if any."""

    bundle: Bundle
    body_size: int
    region: SharedRegion | None


class _Stage:
    __slots__ = ("touched", "parts", "nbytes")

    def __init__(self, touched: float) -> None:
        self.touched = touched
        self.parts: dict[str, StagedPart] = {}  # by part name
        self.nbytes = 0


class StageBook:
    """The open stages by id, the bytes they reserve, and how recent stages ended."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._stages: dict[str, _Stage] = {}
        self.staged_bytes = 0
        # Stages that ended within `ttl`, oldest first: when, and what a commit stored (None:
        # aborted; a part of it that arrives late, the client having given up on it while it was
        # still on the wire, is refused instead of opening the stage again).
        self._ended: dict[str, tuple[float, tuple[int, int, int] | None]] = {}

    def __bool__(self) -> bool:
        """Whether any stage is open."""
        return bool(self._stages)

    @staticmethod
    def part_key(bundle: Bundle, part: str) -> str:
        """The name a staged request is held under: `part`, or (unnamed) one made of what it
        holds, so a re-sent request replaces itself."""
        return part or f"#{hash((tuple(bundle.task_ids), tuple(bundle.columns)))}"

    def replaced_bytes(self, stage_id: str, key: str) -> int:
        """The bytes staging part `key` again would release (0 for a new part)."""
        stage = self._stages.get(stage_id)
        if stage is None or key not in stage.parts:
            return 0
        return stage.parts[key].bundle.nbytes()

    def hold(self, stage_id: str, key: str, part: StagedPart, delta: int, now: float) -> None:
        """Hold `part` as part `key` of stage `stage_id` (opened if new), `delta` more bytes reserved."""
        stage = self._stages.get(stage_id) or _Stage(now)
        stage.parts[key] = part
        stage.nbytes += delta
        stage.touched = now
        self._stages[stage_id] = stage
        self.staged_bytes += delta

    def reserved(self, stage_id: str) -> int:
        """The bytes stage `stage_id` reserves (0 for none)."""
        stage = self._stages.get(stage_id)
        return 0 if stage is None else stage.nbytes

    def parts(self, stage_id: str) -> list[StagedPart] | None:
        """Stage `stage_id`'s parts, left open (None if there is no such stage)."""
        stage = self._stages.get(stage_id)
        return None if stage is None else list(stage.parts.values())

    def take(self, stage_id: str) -> list[StagedPart] | None:
        """Close stage `stage_id`, releasing its reservation: its parts, or None if there is none."""
        stage = self._stages.pop(stage_id, None)
        if stage is None:
            return None
        self.staged_bytes -= stage.nbytes
        return list(stage.parts.values())

    def record_abort(self, stage_id: str, now: float) -> None:
        self._record_end(stage_id, now, None)

    def record_commit(self, stage_id: str, now: float, result: tuple[int, int, int]) -> None:
        self._record_end(stage_id, now, result)

    def _record_end(self, stage_id: str, now: float, result: tuple[int, int, int] | None) -> None:
        self._ended.pop(stage_id, None)  # re-inserted: the dict stays oldest first
        self._ended[stage_id] = (now, result)

    def aborted(self, stage_id: str) -> bool:
        """Whether `stage_id` was aborted within `ttl`."""
        ended = self._ended.get(stage_id)
        return ended is not None and ended[1] is None

    def committed(self, stage_id: str) -> tuple[int, int, int] | None:
        """What committing `stage_id` stored, if it was committed within `ttl`."""
        ended = self._ended.get(stage_id)
        return None if ended is None else ended[1]

    def expire(self, now: float) -> tuple[int, int]:
        """Drop stages untouched for `ttl` and forget older ends; returns (stages, bytes) dropped."""
        dropped = released = 0
        for stage_id, stage in list(self._stages.items()):
            if now - stage.touched > self.ttl:
                del self._stages[stage_id]
                self.staged_bytes -= stage.nbytes
                dropped += 1
                released += stage.nbytes
        while self._ended:  # oldest first: stop at the first one still remembered
            stage_id, (ended, _) = next(iter(self._ended.items()))
            if now - ended <= self.ttl:
                break
            del self._ended[stage_id]
        if dropped:  # a client staged part of a put and never committed or aborted it
            logger.warning(
                "dropped %d staged put(s), %d bytes, not committed within %gs (a client died mid-put?)",
                dropped,
                released,
                self.ttl,
            )
        return dropped, released
