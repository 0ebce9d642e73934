"""The process-wide `ShardClient` batches, controllers and engines use unless given one."""

from __future__ import annotations

import threading

from distbatch.client.shard_client import ShardClient


class _DefaultClient:
    """One lazily made client per process, replaceable (a holder object, not a module global)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._client: ShardClient | None = None

    def get(self) -> ShardClient:
        with self._lock:
            if self._client is None:
                self._client = ShardClient()
            return self._client

    def set(self, client: ShardClient | None) -> None:
        with self._lock:
            self._client = client


_holder = _DefaultClient()


def default_client() -> ShardClient:
    """The process-wide `ShardClient` batches use (created on first use, fork-safe)."""
    return _holder.get()


def set_default_client(client: ShardClient | None) -> None:
    """Replace the process-wide client (e.g. one with a token or other limits); None resets."""
    _holder.set(client)
