"""`ServerConfig`: everything a worker server can be told (the CLI fills it from flags and env).

Its defaults are the worker command line's (`distbatch.launch.flags`), so a flag left out and
a config built in Python mean the same server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from distbatch.auth import token_from_env
from distbatch.launch.flags import (
    DEFAULT_MAX_JSON_BYTES,
    DEFAULT_MAX_KEYS_PER_REQUEST,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_STAGE_TTL,
)
from distbatch.protocol import DEFAULT_MAX_THREADS, DEFAULT_READ_TIMEOUT

__all__ = ["UNBOUND", "ServerConfig"]

UNBOUND = "unbound"  # `ServerConfig.node` until a server binds the app


@dataclass
class ServerConfig:
    """Everything a worker server can be told; the CLI fills it from flags and env."""

    max_bytes: int | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_json_bytes: int = DEFAULT_MAX_JSON_BYTES
    max_keys_per_request: int = DEFAULT_MAX_KEYS_PER_REQUEST
    token: str | None = field(default_factory=token_from_env)
    # This worker's address, set once a server binds the app (an engine is built after that).
    node: str = UNBOUND
    engine: str | None = None
    # Keyword arguments for the engine factory (JSON values; `--engine-kwargs`).
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    # Whether a client may choose and build the engine (`POST /v1/engine`): code it names runs here.
    accept_engine: bool = False
    # This worker's index in its group and the group's size, for the engine (`WorkerContext`).
    rank: int = 0
    world_size: int = 1
    # Delete tasks nobody put or fetched for this many seconds (None: never).
    max_idle_seconds: float | None = None
    # A fetch whose response would be larger is refused (413); clients split below it.
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    # A staged (multi-request) put not committed within this many seconds is dropped.
    stage_ttl: float = DEFAULT_STAGE_TTL
    # Requests served at once (one thread each); further connections wait to be accepted.
    max_threads: int = DEFAULT_MAX_THREADS
    # Seconds a connection may sit without sending a byte (idle keep-alive, stalled upload).
    read_timeout: float = DEFAULT_READ_TIMEOUT
    # Shared regions for same-host clients hold at most this many bytes (None: no own bound).
    shm_max_bytes: int | None = None
    # A durable worker's directory (`--data-dir`): every committed change is written there, and
    # a worker started on it recovers what it held. `sync_writes`: changes wait for the disk.
    data_dir: str | None = None
    sync_writes: bool = False
    # A served controller (`host:port`) a durable worker restarted at a new address tells so.
    controller: str | None = None
