"""The store's background sweeper: idle eviction and abandoned-stage expiry on a timer."""

from __future__ import annotations

import logging
import threading

from rpc_server.store.shard_store import ShardStore

logger = logging.getLogger("rpc_server")


class IdleSweeper:
    """A daemon thread that calls `store.evict_idle()` every `interval` seconds until `stop()`.

    For controllers that crash (or forget) and never clear: their shards would
    otherwise hold the worker's memory forever. Each sweep that evicts logs a WARNING.
    """

    def __init__(self, store: ShardStore, interval: float | None = None) -> None:
        if store.max_idle_seconds is None:
            raise ValueError("the store has no max_idle_seconds: nothing to sweep")
        self.store = store
        self.interval = interval if interval is not None else min(max(store.max_idle_seconds / 4, 0.05), 10.0)
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
