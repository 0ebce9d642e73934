"""Hold the cyclic garbage collector off during bulk loops, without taking GC control from the application.

Building thousands of small objects (one per shard in a bundle) triggers collections
that traverse every live tensor; that doubled decode time for bundles of small shards.
The loops create no reference cycles, so nothing is leaked by postponing collection.

Trainers often manage the collector themselves (`gc.disable()` and a manual
`gc.collect()` every N steps), from any thread, at any time. So the pause never calls
`gc.disable()` / `gc.enable()`: it raises the generation-0 threshold (no automatic
collection starts while the pause holds) and, when the last overlapping pause ends, puts
the threshold back only if it still holds the pause's value. Whatever the application
did meanwhile — disable the collector, set thresholds of its own — stays as it set it.

`freeze_long_lived` is the other half, for a process whose imports dwarf its work (a
TransferQueue client: torch, Ray and TransferQueue): once, everything alive goes where no
collection walks it again.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

# No automatic collection can start below this many net allocations.
PAUSED_THRESHOLD0 = 1 << 30


class GcPause:
    """Reference-counted pauses of automatic collection (one per process: the collector is one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._saved: tuple[int, ...] | None = None
        self._ours: tuple[int, ...] | None = None

    def _enter(self) -> None:
        with self._lock:
            self._active += 1
            if self._active > 1:
                return
            current = gc.get_threshold()
            if current[0] == 0:
                return  # automatic collection is already off (threshold 0): nothing to pause
            self._saved = current
            gc.set_threshold(PAUSED_THRESHOLD0, *current[1:])
            self._ours = gc.get_threshold()

    def _exit(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active > 0:
                return
            saved, ours = self._saved, self._ours
            self._saved = self._ours = None
            if saved is not None and gc.get_threshold() == ours:
                gc.set_threshold(*saved)  # the application left our value alone: restore its own

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No automatic collection inside the block (pauses may overlap across threads)."""
        self._enter()
        try:
            yield
        finally:
            self._exit()


# The collector is process-wide, so its pause bookkeeping is too: one object, shared.
_PROCESS_GC_PAUSE = GcPause()


def paused_gc() -> contextlib.AbstractContextManager[None]:
    """Postpone automatic garbage collection for the block; see the module docstring."""
    return _PROCESS_GC_PAUSE.paused()


def freeze_long_lived() -> bool:
    """Collect once, then move every object alive (a process's imports and set-up: torch, Ray,
    TransferQueue, millions of objects) into the permanent generation (`gc.freeze()`), where no
    collection walks them again. Full collections then cost what the running job allocates, not
    what the process imported: a ragged 5,120-sample `kv_batch_put` through TransferQueue spent
    more than half its time in them. Nothing is done (False) where something is frozen already:
    the application manages it. Objects frozen here are never collected, so call it once the
    long-lived state exists, not in a loop.
    """
    if gc.get_freeze_count():
        return False
    gc.collect()
    gc.freeze()
    return True
