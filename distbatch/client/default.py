"""The process-wide `ShardClient` batches, controllers and engines use unless given one."""

from __future__ import annotations

import threading

from distbatch.auth import token_from_env
from distbatch.client.shard_client import ShardClient


class _DefaultClient:
    """One lazily made client per process, replaceable (a holder object, not a module global).

    One it made itself carries the token `DISTBATCH_TOKEN` held then; when the variable changes
    (set after a first `AuthError`, say), the next use makes a new one with the new token. One
    given with `set` is used as it is."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._client: ShardClient | None = None
        self._own = False

    def get(self) -> ShardClient:
        with self._lock:
            stale = self._own and self._client is not None and self._client.token != token_from_env()
            if self._client is None or stale:
                # A stale one is not closed: another thread may still be using it.
                self._client, self._own = ShardClient(), True
            return self._client

    def set(self, client: ShardClient | None) -> None:
        with self._lock:
            self._client, self._own = client, False


_holder = _DefaultClient()


def default_client() -> ShardClient:
    """The process-wide `ShardClient` batches use (created on first use, fork-safe)."""
    return _holder.get()


def set_default_client(client: ShardClient | None) -> None:
    """Replace the process-wide client (e.g. one with a token or other limits); None resets."""
    _holder.set(client)
