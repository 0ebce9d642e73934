"""The store's background threads: the stage sweeper, and the idle sweeper a worker may run.

The stage sweeper expires abandoned stages while any exist (so a client killed mid-put cannot
make every later put fail with 507); the idle sweeper evicts tasks nobody touched for a while
(for controllers that crash and never clear). Separate from the store so that its data
structures stay free of thread management.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

logger = logging.getLogger("rpc_server")


def sweep_interval(seconds: float) -> float:
    """How often to sweep for things kept `seconds`: a quarter of it, within [0.05, 10]."""
    return min(max(seconds / 4, 0.05), 10.0)


class StageSweeper:
    """A daemon thread that runs `expire` every `interval` seconds while `has_stages()`.

    Started by the store (lock held) each time it stages; it exits once no stage is left, and
    for good at `close`. `lock` is the store's: whether to start a sweeper and whether to exit
    are decided under it, so a stage is never left without one.
    """

    def __init__(
        self,
        lock: threading.Lock,
        interval: float,
        expire: Callable[[], object],
        has_stages: Callable[[], bool],
    ) -> None:
        self._lock = lock
        self._interval = interval
        self._expire = expire
        self._has_stages = has_stages
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    def ensure_running(self) -> None:
        """Start the sweeper thread unless it runs (the caller holds the lock, and just staged)."""
        if self._thread is None and not self._closed.is_set():
            self._thread = threading.Thread(target=self._run, name="stage-sweeper", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._closed.wait(self._interval):
            self._expire()
            with self._lock:  # the same lock `ensure_running` is called under
                if not self._has_stages():
                    self._thread = None
                    return
        with self._lock:
            self._thread = None

    def close(self) -> None:
        """Stop the sweeper for good; waits for a running one to exit."""
        self._closed.set()
        with self._lock:
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)


class Evicting(Protocol):
    """What the idle sweeper needs of a store (`ShardStore` is one): it names no store class, so
    the store, which starts sweepers, and the sweepers import one way only."""

    max_idle_seconds: float | None

    def evict_idle(self) -> tuple[int, int]: ...


class IdleSweeper:
    """A daemon thread that calls `store.evict_idle()` every `interval` seconds until `stop()`.

    For controllers that crash (or forget) and never clear: their shards would
    otherwise hold the worker's memory forever. Each sweep that evicts logs a WARNING.
    """

    def __init__(self, store: Evicting, interval: float | None = None) -> None:
        if store.max_idle_seconds is None:
            raise ValueError("the store has no max_idle_seconds: nothing to sweep")
        self.store = store
        self.interval = interval if interval is not None else sweep_interval(store.max_idle_seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="idle-sweeper", daemon=True)

    def start(self) -> IdleSweeper:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sweep()

    def sweep(self) -> tuple[int, int]:
        count, freed = self.store.evict_idle()
        if count:
            logger.warning(
                "evicted %d shard(s), %d bytes idle for over %gs (for crashed controllers that never clear)",
                count,
                freed,
                self.store.max_idle_seconds,
            )
        return count, freed

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
