"""The worker's Flask app factory: config, auth, JSON errors, metrics hooks."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flask import Flask, Response, current_app, g, jsonify, request
from werkzeug.exceptions import HTTPException

from distbatch.auth import bearer_ok, token_from_env
from distbatch.errors import InvalidIdError, WireFormatError
from distbatch.meta import MetaFormatError
from rpc_server.errors import BadArgumentsError, EngineCallFailed, ShuttingDownError, UnknownMethodError
from rpc_server.metrics import Metrics
from rpc_server.store import (
    IdleSweeper,
    MissingShardsError,
    ShardStore,
    StoreCapacityError,
    UnknownStageError,
)

if TYPE_CHECKING:
    from rpc_server.engine import EngineHost

logger = logging.getLogger("rpc_server")

DEFAULT_MAX_REQUEST_BYTES = 1 << 30
DEFAULT_MAX_JSON_BYTES = 64 << 20
DEFAULT_MAX_KEYS_PER_REQUEST = 200_000
DEFAULT_MAX_RESPONSE_BYTES = 1 << 30
DEFAULT_STAGE_TTL = 600.0
DEFAULT_MAX_THREADS = 256
DEFAULT_READ_TIMEOUT = 60.0


@dataclass
class ServerConfig:
    """Everything a worker server can be told; the CLI fills it from flags and env."""

    max_bytes: int | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_json_bytes: int = DEFAULT_MAX_JSON_BYTES
    max_keys_per_request: int = DEFAULT_MAX_KEYS_PER_REQUEST
    token: str | None = field(default_factory=token_from_env)
    node: str = "unbound"
    engine: str | None = None
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


@dataclass
class ServerState:
    """What the views share: hangs off `app.extensions`, never a module global."""

    config: ServerConfig
    store: ShardStore
    metrics: Metrics
    engine: EngineHost | None = None
    sweeper: IdleSweeper | None = None

    def close(self) -> None:
        """Stop what the app started (called once the server stopped serving)."""
        if self.sweeper is not None:
            self.sweeper.stop()
        if self.engine is not None:
            self.engine.shutdown()
        self.store.close()


class ApiError(Exception):
    """An error a view raises to answer with `{"error": code, "message": ...}`."""

    def __init__(self, status: int, code: str, message: str, **extra: object) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.extra = extra


def state() -> ServerState:
    return current_app.extensions["distbatch"]


def error_response(status: int, code: str, message: str, **extra: object) -> Response:
    response = jsonify({"error": code, "message": message, **extra})
    response.status_code = status
    return response


def create_app(config: ServerConfig | None = None, *, store: ShardStore | None = None) -> Flask:
    """Build a worker app. State lives on the app, so several can share a process."""
    from rpc_server.routes import data_routes

    config = config or ServerConfig()
    app = Flask("rpc_server")
    # "/v1//stats" is an unknown route (a JSON 404), not an HTML 308 redirect to "/v1/stats".
    app.url_map.merge_slashes = False
    # One byte of slack: `routes._read_body` enforces the exact bound and must be able
    # to see that a chunked body (no Content-Length) runs past it.
    app.json.sort_keys = False  # keep field order as the engine returned it  # type: ignore[attr-defined]
    app.config["MAX_CONTENT_LENGTH"] = config.max_request_bytes + 1
    server_state = ServerState(
        config=config,
        store=store
        if store is not None
        else ShardStore(
            config.max_bytes, stage_ttl=config.stage_ttl, max_idle_seconds=config.max_idle_seconds
        ),
        metrics=Metrics(),
    )
    if config.engine:
        from rpc_server.engine import EngineHost, WorkerContext, load_engine  # imports torch

        context = WorkerContext(server_state.store, config)
        server_state.engine = EngineHost(load_engine(config.engine, context), context)
    if server_state.store.max_idle_seconds is not None:
        server_state.sweeper = IdleSweeper(server_state.store).start()
    app.extensions["distbatch"] = server_state
    app.extensions["on_bound"] = lambda node: setattr(config, "node", node)
    app.extensions["on_close"] = server_state.close
    app.register_blueprint(data_routes)
    app.before_request(_start_and_authenticate)
    app.after_request(_record_metrics)
    _register_error_handlers(app)
    return app


def _start_and_authenticate() -> Response | None:
    g.started = time.perf_counter()
    token = state().config.token
    if token is None or request.endpoint == "data.health":
        return None
    if not bearer_ok(request.headers.get("Authorization"), token):
        return error_response(401, "unauthorized", "missing or wrong bearer token")
    return None


def _record_metrics(response: Response) -> Response:
    started = g.get("started")
    if started is not None:
        rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
        state().metrics.observe(
            rule,
            request.method,
            response.status_code,
            time.perf_counter() - started,
            request.content_length or 0,
            response.content_length or 0,
        )
    return response


def register_json_errors(
    app: Flask,
    table: Mapping[type[BaseException], tuple[int, str]],
    respond: Callable[..., Response],
    log: logging.Logger,
) -> None:
    """Answer each exception type in `table` with `respond(status, code, message)`.

    Also turns werkzeug's HTTP errors (404, 405, 413, ...) into the same JSON
    shape, and anything unexpected into a logged 500, so no request ever gets
    an HTML page or a dropped connection. Shared by the worker and the controller.
    """
    for exc_type, (status, code) in table.items():
        app.register_error_handler(exc_type, lambda exc, s=status, c=code: respond(s, c, str(exc)))

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> Response:
        code = (exc.name or "error").lower().replace(" ", "_")
        return respond(exc.code or 500, code, exc.description or code)

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return respond(500, "internal_error", f"{type(exc).__name__}: {exc}")


_WORKER_ERRORS: dict[type[BaseException], tuple[int, str]] = {
    WireFormatError: (400, "bad_container"),
    MetaFormatError: (400, "bad_metadata"),
    InvalidIdError: (400, "invalid_id"),
    BadArgumentsError: (400, "bad_arguments"),
    UnknownMethodError: (404, "unknown_method"),
    UnknownStageError: (404, "unknown_stage"),
    StoreCapacityError: (507, "insufficient_storage"),
    ShuttingDownError: (503, "shutting_down"),
}


def _register_error_handlers(app: Flask) -> None:
    @app.errorhandler(ApiError)
    def _api_error(exc: ApiError) -> Response:
        return error_response(exc.status, exc.code, str(exc), **exc.extra)

    @app.errorhandler(EngineCallFailed)
    def _engine_failed(exc: EngineCallFailed) -> Response:
        return error_response(
            500, "engine_error", str(exc), exception=exc.exception_type, traceback=exc.traceback
        )

    @app.errorhandler(MissingShardsError)
    def _missing_error(exc: MissingShardsError) -> Response:
        return error_response(404, "shards_not_found", str(exc), missing=[list(k) for k in exc.keys])

    register_json_errors(app, _WORKER_ERRORS, error_response, logger)
