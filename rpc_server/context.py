"""What a worker's views share: the per-app `ServerState`, `state()` to reach it, and `ApiError`.

Its own module so that the views (`routes`, `engine`) and the app factory (`app`) all import
it, instead of the views importing the factory that registers them (an import circle).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flask import current_app

from distbatch.recv_pool import RecvPool
from rpc_server.config import ServerConfig
from rpc_server.metrics import Metrics
from rpc_server.store import IdleSweeper, ShardStore

if TYPE_CHECKING:
    from rpc_server.engine import EngineHost

__all__ = ["ApiError", "ServerState", "state"]

BODY_POOL_BYTES = 512 << 20
BODY_POOL_IDLE_SECONDS = 2.0


@dataclass
class ServerState:
    """What the views share: hangs off `app.extensions`, never a module global."""

    config: ServerConfig
    store: ShardStore
    metrics: Metrics
    engine: EngineHost | None = None
    sweeper: IdleSweeper | None = None
    # Put bodies land here (`routes._receive_body`): a mapping freed by a clear is reused by
    # the next put within BODY_POOL_IDLE_SECONDS (no page faults), then unmapped.
    body_pool: RecvPool = field(
        default_factory=lambda: RecvPool(BODY_POOL_BYTES, idle_seconds=BODY_POOL_IDLE_SECONDS)
    )

    def close(self) -> None:
        """Stop what the app started (called once the server stopped serving)."""
        if self.sweeper is not None:
            self.sweeper.stop()
        if self.engine is not None:
            self.engine.shutdown()
        self.store.close()
        self.body_pool.close()


class ApiError(Exception):
    """An error a view raises to answer with `{"error": code, "message": ...}`."""

    def __init__(self, status: int, code: str, message: str, **extra: object) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.extra = extra


def state() -> ServerState:
    """The state of the app serving the current request."""
    return current_app.extensions["distbatch"]
