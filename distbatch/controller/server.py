"""The controller over HTTP: a Flask app serving a `Controller`, and `RemoteController`.

Ranks in other processes (loader workers, other hosts) pull batches with the
same Python API as a local `Controller`. Both sides of the protocol live here.
Every error comes back as a JSON error response; no request can stop the server.

Validated bad input (the exception types in `VALIDATED`) answers 4xx with a
code that `RemoteController` turns back into the same exception type. Anything
else raised while serving a request is a bug: a logged 500 ``internal_error``,
which the client raises as `ServerError`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from flask import Blueprint, Flask, Response, current_app, jsonify, request

from distbatch.auth import bearer_ok, token_from_env
from distbatch.batch.calls import decode_value, encode_value
from distbatch.batch.memory import DistributedBatchMemory
from distbatch.controller.core import Controller
from distbatch.controller.http_errors import MAX_WAIT_SECONDS, VALIDATED
from distbatch.errors import (
    ClearError,
    InvalidArgumentError,
    UnknownFieldError,
    UnknownPartitionError,
)
from distbatch.serving.errors import error_response as _error
from distbatch.serving.errors import register_json_errors
from distbatch.serving.handler import GIVE_TURN_BACK
from distbatch.serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from distbatch.serving.metrics import Metrics, record_requests
from distbatch.serving.server import HttpServer, connection_gauges

logger = logging.getLogger("distbatch.controller")

MAX_BODY_BYTES = 256 << 20
# get_meta keywords that are not sampling config (a body's sampling_config may not set them).
_GET_META_KEYWORDS = frozenset(
    {
        "partition_id",
        "task_name",
        "fields",
        "batch_size",
        "timeout",
        "request_id",
        "partition",
        "max_staleness",
        "stale",
    }
)
_ROUTES = Blueprint("controller", __name__)
# get_meta calls served at once; more wait their turn, idle, once they have arrived
# (`HttpServer`'s request turns). A crowd of ranks polling flat out would otherwise keep hundreds
# of request threads runnable, and a producer's put, one of them, would get a sliver of the
# interpreter (its tasks are what the polls wait for). The controller's work is under one lock
# anyway: a few at once keep it busy. A long poll gives its turn back before it waits.
POLLS_AT_ONCE = 4
# Request threads: a thread per request under way (idle kept-alive connections hold none); every
# rank can have a poll waiting for its turn, or a long poll waiting for producers, at once.
MAX_THREADS = 1024
# What reserve threads answer when every normal thread is taken: liveness, and producers' puts.
RESERVE_REQUESTS = frozenset({("GET", "/health"), ("HEAD", "/health"), ("POST", "/v1/controller/put")})


def _controller() -> Controller:
    return current_app.extensions["controller"]


def _body() -> dict[str, Any]:
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        raise InvalidArgumentError("body must be a JSON object (Content-Type: application/json)")
    return body


def _required(body: Mapping[str, Any], key: str) -> Any:
    if key not in body:
        raise InvalidArgumentError(f"the body is missing {key!r}")
    return body[key]


@_ROUTES.get("/health")
def health() -> Response:
    return jsonify({"status": "ok", "role": "controller"})


@_ROUTES.get("/metrics")
def metrics() -> Response:
    """Prometheus exposition: the request metrics every distbatch app keeps, and the
    controller's partitions and waiting consumers."""
    controller = _controller()
    staleness = controller.staleness()
    text = current_app.extensions["metrics"].render(
        {
            "distbatch_controller_partitions": (
                "Partitions the controller holds.",
                len(controller.partitions()),
            ),
            "distbatch_controller_waiting_consumers": (
                "get_meta calls waiting for producers right now (starvation).",
                controller.waiting_consumers(),
            ),
            "distbatch_controller_policy_version": (
                "The trainer's policy version, as last set.",
                controller.policy_version(),
            ),
            **connection_gauges(current_app),
        },
        {"distbatch_controller_stale_dropped_total": ("Tasks dropped as stale.", staleness["dropped"])},
        {
            "distbatch_controller_served_tasks_total": (
                "Tasks handed out, by how many policy versions old they were.",
                "staleness",
                staleness["served"],
            )
        },
    )
    return Response(text, content_type=METRICS_CONTENT_TYPE)


@_ROUTES.post("/v1/controller/put")
def put() -> Response:
    body = _body()
    partition_id = _required(body, "partition_id")
    batch = decode_value(_required(body, "batch"), None)
    if not isinstance(batch, DistributedBatchMemory):
        raise InvalidArgumentError("'batch' must be a tagged batch")
    partial = body.get("partial", False)
    if not isinstance(partial, (bool, list)):
        raise InvalidArgumentError("'partial' must be true, false or a list of the put's fields")
    added = _controller().put(partition_id, batch, version=body.get("version"), partial=partial)
    return jsonify({"added": added})


@_ROUTES.post("/v1/controller/inflight")
def inflight() -> Response:
    return jsonify({"batch": encode_value(_controller().inflight(_required(_body(), "partition_id")))})


@_ROUTES.post("/v1/controller/reissue")
def reissue() -> Response:
    return jsonify({"batch": encode_value(_controller().reissue(_required(_body(), "partition_id")))})


@_ROUTES.post("/v1/controller/create_partition")
def create_partition() -> Response:
    body = _body()
    _controller().create_partition(_required(body, "partition_id"), body.get("expected_fields") or [])
    return jsonify({"ok": True})


@_ROUTES.post("/v1/controller/get_meta")
def get_meta() -> Response:
    body = _body()
    config = body.get("sampling_config") or {}
    if not isinstance(config, dict) or not all(isinstance(k, str) and k.isidentifier() for k in config):
        raise InvalidArgumentError("'sampling_config' must map names to JSON values")
    reserved = sorted(_GET_META_KEYWORDS.intersection(config))
    if reserved:
        raise InvalidArgumentError(f"'sampling_config' may not set {reserved}: they are get_meta's own")
    timeout = body.get("timeout")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0
    ):
        raise InvalidArgumentError("'timeout' must be a non-negative number")
    if timeout and (give_turn_back := request.environ.get(GIVE_TURN_BACK)) is not None:
        give_turn_back()  # a long poll waits for producers: no turn held while it sleeps
    batch = _controller().get_meta(
        _required(body, "partition_id"),
        _required(body, "task_name"),
        _required(body, "fields"),
        _required(body, "batch_size"),
        timeout=min(float(timeout), MAX_WAIT_SECONDS) if timeout else None,
        request_id=body.get("request_id"),
        max_staleness=body.get("max_staleness"),
        stale=body.get("stale", "wait"),
        **config,
    )
    return jsonify({"batch": encode_value(batch)})


@_ROUTES.get("/v1/controller/policy_version")
def policy_version() -> Response:
    return jsonify({"version": _controller().policy_version()})


@_ROUTES.post("/v1/controller/policy_version")
def set_policy_version() -> Response:
    _controller().set_policy_version(_required(_body(), "version"))
    return jsonify({"ok": True})


@_ROUTES.post("/v1/controller/policy_versions")
def policy_versions() -> Response:
    body = _body()
    task_ids = _required(body, "task_ids")
    if not isinstance(task_ids, list):
        raise InvalidArgumentError("'task_ids' must be a list")
    return jsonify({"versions": _controller().policy_versions(_required(body, "partition_id"), task_ids)})


@_ROUTES.post("/v1/controller/production_status")
def production_status() -> Response:
    body = _body()
    return jsonify(_controller().production_status(_required(body, "partition_id"), body.get("fields")))


@_ROUTES.post("/v1/controller/custom_meta")
def set_custom_meta() -> Response:
    body = _body()
    _controller().set_custom_meta(_required(body, "partition_id"), _required(body, "custom_meta"))
    return jsonify({"ok": True})


@_ROUTES.post("/v1/controller/get_custom_meta")
def get_custom_meta() -> Response:
    body = _body()
    return jsonify(
        {
            "custom_meta": _controller().get_custom_meta(
                _required(body, "partition_id"), _required(body, "task_ids")
            )
        }
    )


@_ROUTES.post("/v1/controller/consumption_status")
def consumption_status() -> Response:
    body = _body()
    return jsonify(
        _controller().consumption_status(_required(body, "partition_id"), _required(body, "task_name"))
    )


@_ROUTES.post("/v1/controller/reset_consumption")
def reset_consumption() -> Response:
    body = _body()
    _controller().reset_consumption(_required(body, "partition_id"), body.get("task_name"))
    return jsonify({"ok": True})


@_ROUTES.post("/v1/controller/clear_tasks")
def clear_tasks() -> Response:
    body = _body()
    task_ids = _required(body, "task_ids")
    if not isinstance(task_ids, list):
        raise InvalidArgumentError("'task_ids' must be a list")
    return jsonify({"deleted": _controller().clear_tasks(_required(body, "partition_id"), task_ids)})


@_ROUTES.post("/v1/controller/clear_partition")
def clear_partition() -> Response:
    return jsonify({"deleted": _controller().clear_partition(_required(_body(), "partition_id"))})


@_ROUTES.post("/v1/controller/forget_node")
def forget_node() -> Response:
    return jsonify(_controller().forget_node(_required(_body(), "node")).to_dict())


@_ROUTES.post("/v1/controller/move_node")
def move_node() -> Response:
    body = _body()
    return jsonify({"moved": _controller().move_node(_required(body, "old"), _required(body, "new"))})


@_ROUTES.get("/v1/controller/partitions")
def partitions() -> Response:
    return jsonify({"partitions": _controller().partitions()})


@_ROUTES.get("/v1/controller/waiting_consumers")
def waiting_consumers() -> Response:
    return jsonify({"waiting_consumers": _controller().waiting_consumers()})


@_ROUTES.get("/v1/controller/summary")
def summary() -> Response:
    """Every partition at a glance (read only; what `distbatch status` shows of a controller)."""
    return jsonify(_controller().summary())


@_ROUTES.get("/v1/controller/state")
def state() -> Response:
    return jsonify(_controller().state_dict())


@_ROUTES.post("/v1/controller/state")
def load_state() -> Response:
    _controller().load_state_dict(_body())
    return jsonify({"ok": True})


def create_controller_app(controller: Controller, *, token: str | None = None) -> Flask:
    """A Flask app serving `controller`; `token` (default `$DISTBATCH_TOKEN`) guards all but /health."""
    app = Flask("distbatch.controller")
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    app.extensions["controller"] = controller
    app.extensions["metrics"] = Metrics()
    required = token if token is not None else token_from_env()
    app.register_blueprint(_ROUTES)
    record_requests(app, app.extensions["metrics"])

    @app.before_request
    def _authenticate() -> Response | None:
        if required and request.endpoint != "controller.health":
            if not bearer_ok(request.headers.get("Authorization"), required):
                return _error(401, "unauthorized", "missing or wrong bearer token")
        return None

    @app.errorhandler(ClearError)
    def _clear_error(exc: ClearError) -> Response:
        # A 4xx, so the client neither retries it nor drops the payload: RemoteController
        # turns it back into a ClearError (a 5xx would arrive as a bare ServerError).
        return _error(
            424,
            "clear_incomplete",
            str(exc),
            deleted=exc.deleted,
            undeleted=exc.undeleted,
            deleted_by_node=exc.deleted_by_node,
            failed={n: e.detail for n, e in exc.failed.items()},
        )

    @app.errorhandler(UnknownPartitionError)
    def _unknown_partition(exc: UnknownPartitionError) -> Response:
        return _error(404, "unknown_partition", str(exc), partition_id=exc.partition_id, known=exc.known)

    @app.errorhandler(UnknownFieldError)
    def _unknown_field(exc: UnknownFieldError) -> Response:
        return _error(
            404, "unknown_field", str(exc), partition_id=exc.partition_id, fields=exc.fields, known=exc.known
        )

    plain = {t: v for t, v in VALIDATED.items() if t not in (UnknownPartitionError, UnknownFieldError)}
    register_json_errors(app, plain, _error, logger)

    return app


class ControllerServer:
    """A `Controller` served over HTTP from a background thread of this process."""

    def __init__(
        self, controller: Controller, host: str = "127.0.0.1", port: int = 0, *, token: str | None = None
    ) -> None:
        self.controller = controller
        self._server = HttpServer(
            create_controller_app(controller, token=token),
            host,
            port,
            max_threads=MAX_THREADS,
            reserve_requests=RESERVE_REQUESTS,
            request_turns={("POST", "/v1/controller/get_meta"): POLLS_AT_ONCE},
        )
        self.address = self._server.node
        self._token_required = token is not None or bool(token_from_env())
        self._running = True
        self._server.start_background()

    @property
    def running(self) -> bool:
        """True until `shutdown()`."""
        return self._running

    def shutdown(self) -> None:
        """Stop serving and close the socket; idempotent. The `Controller` object stays usable."""
        if self._running:
            self._running = False
            self._server.shutdown()

    def __repr__(self) -> str:
        state = "running" if self._running else "shut down"
        partitions = len(self.controller.partitions())
        token = "token required" if self._token_required else "no token"
        return f"ControllerServer({self.address}, {state}, {partitions} partition(s), {token})"

    def __enter__(self) -> ControllerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def serve_controller(
    controller: Controller, host: str = "127.0.0.1", port: int = 0, *, token: str | None = None
) -> ControllerServer:
    """Serve `controller` over HTTP (loopback by default); `.address` is its `host:port`.

    `port` is 0 (a free one, the default) to 65535; anything else is a `ValueError` naming it.
    """
    return ControllerServer(controller, host, port, token=token)


__all__ = ["ControllerServer", "create_controller_app", "serve_controller"]
