"""The worker's Flask app factory: config, auth, JSON errors, metrics hooks."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from flask import Flask, Response, request

from distbatch.auth import bearer_ok
from distbatch.serving.errors import error_response, register_json_errors
from distbatch.serving.metrics import record_requests
from rpc_server.announce import ControllerNotice
from rpc_server.checks import ERROR_ANSWERS, missing_shards
from rpc_server.config import UNBOUND, ServerConfig
from rpc_server.context import ServerState, state
from rpc_server.errors import ApiError, EngineCallFailed, MissingShardsError
from rpc_server.metrics import Metrics
from rpc_server.routes import data_routes
from rpc_server.store.durable import DurableLog, swap_node
from rpc_server.store.shard_store import ShardStore
from rpc_server.store.sweeper import IdleSweeper

# Names that lived here before `config`, `context` and `distbatch.serving.errors` took them;
# kept importable from this module for existing code.
__all__ = [
    "ApiError",
    "ServerConfig",
    "ServerState",
    "create_app",
    "error_response",
    "register_json_errors",
    "state",
]

logger = logging.getLogger("rpc_server")


def create_app(config: ServerConfig | None = None, *, store: ShardStore | None = None) -> Flask:
    """Build a worker app. State lives on the app, so several can share a process.

    The engine `config` names is built once its node is known, so that its `WorkerContext.node`
    is valid in its constructor: at once if `config.node` is set, else when a server binds the
    app (`WorkerServer(app, ...)`, which raises what building it raised).
    """
    config = config or ServerConfig()
    app = Flask("rpc_server")
    # "/v1//stats" is an unknown route (a JSON 404), not an HTML 308 redirect to "/v1/stats".
    app.url_map.merge_slashes = False
    # One byte of slack: `routes._read_body` enforces the exact bound and must be able
    # to see that a chunked body (no Content-Length) runs past it.
    # Keep field order as the engine returned it (Flask's default provider has `sort_keys`).
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.config["MAX_CONTENT_LENGTH"] = config.max_request_bytes + 1
    server_state = ServerState(
        config=config, store=store if store is not None else _new_store(config), metrics=Metrics()
    )
    if config.engine and config.node != UNBOUND:
        _host_engine(server_state)
    if server_state.store.max_idle_seconds is not None:
        server_state.sweeper = IdleSweeper(server_state.store).start()
    app.extensions["distbatch"] = server_state
    app.extensions["on_bound"] = lambda node: _bound(server_state, node)
    app.extensions["on_close"] = server_state.close
    app.register_blueprint(data_routes)
    record_requests(app, server_state.metrics)
    app.before_request(_authenticate)
    _register_error_handlers(app)
    return app


def _new_store(config: ServerConfig) -> ShardStore:
    """The store `config` asks for; a durable one recovers what its directory's log holds first."""
    log = None if config.data_dir is None else DurableLog(Path(config.data_dir))
    store = ShardStore(
        config.max_bytes,
        stage_ttl=config.stage_ttl,
        max_idle_seconds=config.max_idle_seconds,
        max_shared_bytes=config.shm_max_bytes,
        log=log,
        sync=config.sync_writes,
    )
    if log is not None:
        began = time.monotonic()
        puts, deletes = store.recover(log.recovered.records)
        # The store keeps what it needs of them; the rest (deleted values' mapped files, which a
        # compaction would delete) goes now.
        log.recovered.records = []
        logger.info(
            "recovered %d put(s) and %d delete(s) from %s in %.2f s: %d shard(s), %d byte(s)",
            puts,
            deletes,
            config.data_dir,
            time.monotonic() - began,
            len(store),
            store.stats().bytes,
        )
    return store


def _host_engine(server_state: ServerState) -> None:
    from rpc_server.engine import host_engine  # imports torch

    server_state.engine = host_engine(
        server_state.store, server_state.config, server_state.serves_same_host_readers
    )


def _bound(server_state: ServerState, node: str) -> None:
    """A server bound the app at `node`: now the engine can be built."""
    server_state.config.node = node
    if server_state.config.data_dir is not None:
        previous = swap_node(Path(server_state.config.data_dir), node)
        server_state.previous_nodes = previous
        if previous and server_state.config.controller is not None:
            server_state.controller_notice = ControllerNotice(
                server_state.config.controller, server_state.config.token, previous, node
            ).start()
        elif previous:
            logger.warning(
                "this worker's data directory %s was served at %s: tell whoever holds its tasks"
                " (Controller.move_node(old, %r) for each, DistributedBatchMemory.moved; or start"
                " it with --controller)",
                server_state.config.data_dir,
                ", ".join(previous),
                node,
            )
    if server_state.config.engine and server_state.engine is None:
        _host_engine(server_state)


def _authenticate() -> Response | None:
    token = state().config.token
    if token is None or request.endpoint == "data.health":
        return None
    if not bearer_ok(request.headers.get("Authorization"), token):
        return error_response(401, "unauthorized", "missing or wrong bearer token")
    return None


def _register_error_handlers(app: Flask) -> None:
    @app.errorhandler(ApiError)
    def _api_error(exc: ApiError) -> Response:
        return error_response(exc.status, exc.code, str(exc), **exc.extra)

    @app.errorhandler(EngineCallFailed)
    def _engine_failed(exc: EngineCallFailed) -> Response:
        # The caller gets the traceback too, but the worker's log is where an operator looks.
        method = request.path.rsplit("/", 1)[-1]
        what = (
            "the engine's constructor"
            if request.endpoint == "data.start_engine"
            else f"engine call {method!r}"
        )
        logger.warning("%s raised %s: %s\n%s", what, exc.exception_type, exc, exc.traceback)
        return error_response(
            500, "engine_error", str(exc), exception=exc.exception_type, traceback=exc.traceback
        )

    @app.errorhandler(MissingShardsError)
    def _missing_error(exc: MissingShardsError) -> Response:
        return _api_error(missing_shards(exc))

    register_json_errors(app, ERROR_ANSWERS, error_response, logger)
