"""Bind a worker app to a socket and serve it (used by the CLI and by in-process hosts).

The HTTP machinery (bounded threads, read timeouts, reserve threads) is the library's generic
`distbatch.serving.server.HttpServer`; this module only fills in the worker's bounds and the
requests its reserve threads answer.
"""

from __future__ import annotations

from flask import Flask

from distbatch.protocol import DEFAULT_MAX_THREADS, DEFAULT_READ_TIMEOUT
from distbatch.serving.addresses import WILDCARD_HOSTS, advertised_host, format_node
from distbatch.serving.server import HEALTH_REQUESTS, RESERVE_THREADS, HttpServer
from rpc_server.config import ServerConfig

__all__ = [
    "RESERVE_REQUESTS",
    "RESERVE_THREADS",
    "WILDCARD_HOSTS",
    "WorkerServer",
    "advertised_host",
    "format_node",
]

# What a worker's reserve threads serve while every normal thread is busy: liveness probes, and
# abandon notices (a client giving up on a call must be heard even while calls hold every thread).
RESERVE_REQUESTS = HEALTH_REQUESTS | {("POST", "/v1/calls/abandon")}


def _app_config(app: Flask) -> ServerConfig | None:
    """The worker `ServerConfig` an app carries (None for other apps)."""
    config = getattr(app.extensions.get("distbatch"), "config", None)
    return config if isinstance(config, ServerConfig) else None


class WorkerServer(HttpServer):
    """An `HttpServer` for a worker app, bound at construction (port 0 allowed).

    `max_threads` and `read_timeout` come from the app's `ServerConfig` when it has one,
    else the defaults; keyword arguments override both. Reserve threads answer
    `GET /health` and abandon notices while all normal threads are busy, so a busy
    worker never looks dead.
    """

    def __init__(
        self,
        app: Flask,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_threads: int | None = None,
        read_timeout: float | None = None,
        reserve_threads: int = RESERVE_THREADS,
    ) -> None:
        config = _app_config(app)
        if max_threads is None:
            max_threads = config.max_threads if config is not None else DEFAULT_MAX_THREADS
        if read_timeout is None:
            read_timeout = config.read_timeout if config is not None else DEFAULT_READ_TIMEOUT
        super().__init__(
            app,
            host,
            port,
            max_threads=max_threads,
            read_timeout=read_timeout,
            reserve_threads=reserve_threads,
            reserve_requests=RESERVE_REQUESTS,
        )
