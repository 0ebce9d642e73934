"""What a worker's views share: the per-app `ServerState`, and `state()` to reach it.

Its own module so that the views (`routes`, `engine`) and the app factory (`app`) all import
it, instead of the views importing the factory that registers them (an import circle).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from flask import current_app

from distbatch.transport.recv_pool import RecvPool
from rpc_server.announce import ControllerNotice
from rpc_server.config import ServerConfig
from rpc_server.metrics import Metrics
from rpc_server.store.shard_store import ShardStore
from rpc_server.store.sweeper import IdleSweeper

if TYPE_CHECKING:
    from rpc_server.shm_server import SharedMemoryService

__all__ = ["ServerState", "state"]

BODY_POOL_BYTES = 512 << 20
BODY_POOL_IDLE_SECONDS = 2.0


class HostedEngine(Protocol):
    """What the views need of the engine host (`rpc_server.engine.EngineHost` is one). Named
    here, not imported: the engine host imports this module, so this one names no class of it."""

    name: str

    def method(self, name: str) -> Any: ...

    def call(self, name: str, body: Any, call_id: str | None = None) -> dict[str, Any]: ...

    def abandon(self, call_ids: list[str]) -> dict[str, int]: ...

    def shutdown(self) -> None: ...


@dataclass
class ServerState:
    """What the views share: hangs off `app.extensions`, never a module global."""

    config: ServerConfig
    store: ShardStore
    metrics: Metrics
    engine: HostedEngine | None = None
    engine_lock: threading.Lock = field(default_factory=threading.Lock)  # held while one is built
    sweeper: IdleSweeper | None = None
    # Put bodies land here (`routes._receive_body`): a mapping freed by a clear is reused by
    # the next put within BODY_POOL_IDLE_SECONDS (no page faults), then unmapped.
    body_pool: RecvPool = field(
        default_factory=lambda: RecvPool(BODY_POOL_BYTES, idle_seconds=BODY_POOL_IDLE_SECONDS)
    )

    # A durable worker restarted on its directory: the addresses it was served at before (oldest first).
    previous_nodes: list[str] = field(default_factory=list)
    # ... and, with --controller, telling the served controller so (`announce`).
    controller_notice: ControllerNotice | None = None
    started: float = field(default_factory=time.monotonic)  # for `uptime_seconds` in /v1/stats
    # The same-host endpoint, started by the first client that asks for it (`shared_memory`).
    shm: SharedMemoryService | None = None
    shm_refused: str | None = None
    _shm_lock: threading.Lock = field(default_factory=threading.Lock)

    def serves_same_host_readers(self) -> bool:
        """Whether a client on this host has connected through shared memory."""
        return self.shm is not None and self.shm.greeted

    def shared_memory(self) -> dict[str, Any]:
        """What `GET /v1/shm` answers: how to reach the same-host endpoint (started on first
        use), or why there is none."""
        from distbatch.transport.shm import disabled_reason
        from rpc_server.shm_server import SharedMemoryService

        with self._shm_lock:
            if self.shm is None and self.shm_refused is None:
                self.shm_refused = disabled_reason()
                if self.shm_refused is None:
                    try:
                        self.shm = SharedMemoryService(self.store, self.config, self.metrics)
                    except OSError as exc:
                        self.shm_refused = f"the worker could not open its Unix socket: {exc}"
            if self.shm is None:
                return {"available": False, "reason": f"worker: {self.shm_refused}"}
            return self.shm.describe()

    def close(self) -> None:
        """Stop what the app started (called once the server stopped serving)."""
        with self._shm_lock:
            if self.shm is not None:
                self.shm.close()
                self.shm = None
            self.shm_refused = "the worker is shutting down"
        if self.sweeper is not None:
            self.sweeper.stop()
        if self.engine is not None:
            self.engine.shutdown()
        self.store.close()
        self.body_pool.close()


def state() -> ServerState:
    """The state of the app serving the current request."""
    return current_app.extensions["distbatch"]
