"""The controller over HTTP: a Flask app serving a `Controller`, and `RemoteController`.

Ranks in other processes (loader workers, other hosts) pull batches with the
same Python API as a local `Controller`. Both sides of the protocol live here.
Every error comes back as a JSON error response; no request can stop the server.

Validated bad input (the exception types in `_VALIDATED`) answers 4xx with a
code that `RemoteController` turns back into the same exception type. Anything
else raised while serving a request is a bug: a logged 500 ``internal_error``,
which the client raises as `ServerError`.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flask import Blueprint, Flask, Response, current_app, jsonify, request

from distbatch.atomic import write_json_atomically
from distbatch.auth import bearer_ok, token_from_env
from distbatch.batch.memory import DistributedBatchMemory
from distbatch.calls import decode_value, encode_value
from distbatch.client.shard_client import ShardClient, default_client
from distbatch.controller.arguments import refuse_one_string
from distbatch.controller.core import Controller
from distbatch.errors import (
    BatchStatusError,
    ClearError,
    ClearInProgressError,
    DistBatchError,
    InvalidArgumentError,
    InvalidIdError,
    MetaFormatError,
    RequestError,
    SchemaConflictError,
    UnknownFieldError,
    UnknownPartitionError,
    WireFormatError,
    WorkerUnavailableError,
)
from distbatch.ids import validate_id, validate_node
from distbatch.serving.errors import error_response as _error
from distbatch.serving.errors import register_json_errors
from distbatch.serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from distbatch.serving.metrics import Metrics, record_requests
from distbatch.serving.server import HttpServer

logger = logging.getLogger("distbatch.controller")

MAX_WAIT_SECONDS = 300.0
MAX_BODY_BYTES = 256 << 20
# RemoteController.get_meta: pause before re-sending a request whose reply was lost (doubles, capped).
GET_META_BACKOFF = 0.05
GET_META_BACKOFF_MAX = 1.0
# get_meta keywords that are not sampling config (a body's sampling_config may not set them).
_GET_META_KEYWORDS = frozenset(
    {"partition_id", "task_name", "fields", "batch_size", "timeout", "request_id", "partition"}
)
_ROUTES = Blueprint("controller", __name__)


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
        }
    )
    return Response(text, content_type=METRICS_CONTENT_TYPE)


@_ROUTES.post("/v1/controller/put")
def put() -> Response:
    body = _body()
    partition_id = _required(body, "partition_id")
    batch = decode_value(_required(body, "batch"), None)
    if not isinstance(batch, DistributedBatchMemory):
        raise InvalidArgumentError("'batch' must be a tagged batch")
    return jsonify({"added": _controller().put(partition_id, batch)})


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
    batch = _controller().get_meta(
        _required(body, "partition_id"),
        _required(body, "task_name"),
        _required(body, "fields"),
        _required(body, "batch_size"),
        timeout=min(float(timeout), MAX_WAIT_SECONDS) if timeout else None,
        request_id=body.get("request_id"),
        **config,
    )
    return jsonify({"batch": encode_value(batch)})


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


@_ROUTES.get("/v1/controller/partitions")
def partitions() -> Response:
    return jsonify({"partitions": _controller().partitions()})


@_ROUTES.get("/v1/controller/waiting_consumers")
def waiting_consumers() -> Response:
    return jsonify({"waiting_consumers": _controller().waiting_consumers()})


@_ROUTES.get("/v1/controller/state")
def state() -> Response:
    return jsonify(_controller().state_dict())


@_ROUTES.post("/v1/controller/state")
def load_state() -> Response:
    _controller().load_state_dict(_body())
    return jsonify({"ok": True})


# Validated bad input: (status, code) per exception type. Exactly these answer 4xx (plus
# ClearError, 424, and werkzeug's own); RemoteController raises the same type again from the code.
# A plain ValueError / TypeError / KeyError is a bug: 500.
_VALIDATED: dict[type[DistBatchError], tuple[int, str]] = {
    SchemaConflictError: (409, "schema_conflict"),
    ClearInProgressError: (409, "clear_in_progress"),
    UnknownPartitionError: (404, "unknown_partition"),
    UnknownFieldError: (404, "unknown_field"),
    BatchStatusError: (400, "batch_status"),
    InvalidIdError: (400, "invalid_id"),
    MetaFormatError: (400, "bad_metadata"),
    WireFormatError: (400, "bad_container"),
    InvalidArgumentError: (400, "bad_request"),
}
_BY_CODE = {code: exc_type for exc_type, (_, code) in _VALIDATED.items()}


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

    plain = {t: v for t, v in _VALIDATED.items() if t not in (UnknownPartitionError, UnknownFieldError)}
    register_json_errors(app, plain, _error, logger)

    return app


class ControllerServer:
    """A `Controller` served over HTTP from a background thread of this process."""

    def __init__(
        self, controller: Controller, host: str = "127.0.0.1", port: int = 0, *, token: str | None = None
    ) -> None:
        self.controller = controller
        self._server = HttpServer(create_controller_app(controller, token=token), host, port)
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
    """Serve `controller` over HTTP (loopback by default); `.address` is its `host:port`."""
    return ControllerServer(controller, host, port, token=token)


class RemoteController:
    """The `Controller` API over HTTP, for ranks in other processes or hosts.

    Safe to use from forked DataLoader workers (the client restarts its
    connection pool after a fork).
    """

    process_local = False
    """Every copy talks to the same served controller, so it may cross into other processes."""

    def __init__(self, address: str, *, client: ShardClient | None = None, timeout: float = 60.0) -> None:
        self.address = validate_node(address)
        self._client = client
        self.timeout = timeout

    @property
    def client(self) -> ShardClient:
        return self._client or default_client()

    def _post(
        self,
        path: str,
        body: Any,
        *,
        timeout: float | None = None,
        idempotent: bool = True,
        waits: bool = False,
    ) -> Any:
        try:
            return self.client.request_json(
                self.address,
                "POST",
                path,
                body,
                timeout=timeout or self.timeout,
                idempotent=idempotent,
                waits=waits,
            )
        except RequestError as exc:
            raise _local_error(exc) from None

    def put(self, partition_id: str, batch: DistributedBatchMemory) -> int:
        return self._post("/v1/controller/put", {"partition_id": partition_id, "batch": encode_value(batch)})[
            "added"
        ]

    def get_meta(
        self,
        partition_id: str,
        task_name: str,
        fields: Sequence[str],
        batch_size: int,
        *,
        timeout: float | None = None,
        request_id: str | None = None,
        **sampling_config: Any,
    ) -> DistributedBatchMemory:
        """`Controller.get_meta` over HTTP, delivered at least once.

        The call carries a request id (a new one unless `request_id` is given)
        and is sent again with it after a connection error or a lost reply,
        within this controller's timeout (plus the wait) and the client's
        ``retries``: the controller answers a repeated id with the tasks it
        handed out the first time, so none is lost or consumed twice. Pass your
        own `request_id` to re-ask yourself after this raises.
        """
        refuse_one_string(fields, "fields", "field")
        request_id = uuid.uuid4().hex if request_id is None else validate_id(request_id, "request_id")
        # The server waits at most MAX_WAIT_SECONDS (and refuses a bad timeout itself).
        wait = min(timeout, MAX_WAIT_SECONDS) if isinstance(timeout, (int, float)) and timeout > 0 else 0
        start = time.monotonic()
        deadline = start + self.timeout + wait
        retries = getattr(self.client, "retries", 3)
        attempt = 0
        while True:
            now = time.monotonic()
            body = {
                "partition_id": partition_id,
                "task_name": task_name,
                "fields": list(fields),
                "batch_size": batch_size,
                # A re-sent request waits only for what is left of the caller's wait.
                "timeout": timeout if attempt == 0 or not wait else max(start + wait - now, 1e-3),
                "request_id": request_id,
                "sampling_config": sampling_config,
            }
            try:
                # Not retried by the client once sent: the loop here re-sends with the same id.
                reply = self._post(
                    "/v1/controller/get_meta",
                    body,
                    timeout=deadline - now,
                    idempotent=False,
                    waits=wait > 0,
                )
                return decode_value(reply["batch"], self._client)
            except WorkerUnavailableError as exc:
                attempt += 1
                delay = min(GET_META_BACKOFF * 2 ** (attempt - 1), GET_META_BACKOFF_MAX)
                if attempt > retries or time.monotonic() + delay >= deadline:
                    raise
                logger.warning(
                    "get_meta %s of partition %r: %s; asking again with the same request id",
                    request_id,
                    partition_id,
                    exc.detail,
                )
                time.sleep(delay)

    def create_partition(self, partition_id: str, expected_fields: Iterable[str] = ()) -> None:
        """Create the partition (if new) and declare fields it will get; see `Controller.create_partition`."""
        refuse_one_string(expected_fields, "expected_fields", "field")
        if isinstance(expected_fields, Iterable) and not isinstance(expected_fields, Mapping):
            expected_fields = list(expected_fields)  # else sent as is, for the controller to refuse
        self._post(
            "/v1/controller/create_partition",
            {"partition_id": partition_id, "expected_fields": expected_fields},
        )

    def _get(self, path: str) -> Any:
        try:
            return self.client.request_json(self.address, "GET", path, timeout=self.timeout)
        except RequestError as exc:
            raise _local_error(exc) from None

    def partitions(self) -> list[str]:
        return self._get("/v1/controller/partitions")["partitions"]

    def waiting_consumers(self) -> int:
        """How many `get_meta` calls the served controller has waiting for producers."""
        return self._get("/v1/controller/waiting_consumers")["waiting_consumers"]

    def production_status(self, partition_id: str, fields: Sequence[str] | None = None) -> dict[str, Any]:
        body = {"partition_id": partition_id, "fields": None if fields is None else list(fields)}
        return self._post("/v1/controller/production_status", body)

    def consumption_status(self, partition_id: str, task_name: str) -> dict[str, int]:
        return self._post(
            "/v1/controller/consumption_status", {"partition_id": partition_id, "task_name": task_name}
        )

    def set_custom_meta(self, partition_id: str, custom_meta: Mapping[str, Mapping[str, Any]]) -> None:
        """See `Controller.set_custom_meta`."""
        if not isinstance(custom_meta, Mapping):
            raise InvalidArgumentError(f"custom_meta must map task ids to objects, got {type(custom_meta)}")
        values = {t: dict(m) if isinstance(m, Mapping) else m for t, m in custom_meta.items()}
        body = {"partition_id": partition_id, "custom_meta": values}  # the server validates the values
        self._post("/v1/controller/custom_meta", body)

    def get_custom_meta(self, partition_id: str, task_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """See `Controller.get_custom_meta`."""
        refuse_one_string(task_ids, "task_ids", "task_id")
        body = {"partition_id": partition_id, "task_ids": list(task_ids)}
        return self._post("/v1/controller/get_custom_meta", body)["custom_meta"]

    def all_consumed(self, partition_id: str, task_name: str) -> bool:
        status = self.consumption_status(partition_id, task_name)
        return status["tasks"] > 0 and status["consumed"] >= status["tasks"]

    def reset_consumption(self, partition_id: str, task_name: str | None = None) -> None:
        self._post("/v1/controller/reset_consumption", {"partition_id": partition_id, "task_name": task_name})

    def clear_tasks(self, partition_id: str, task_ids: Iterable[str]) -> int:
        body = {"partition_id": partition_id, "task_ids": list(task_ids)}
        return self._post("/v1/controller/clear_tasks", body)["deleted"]

    def clear_partition(self, partition_id: str) -> int:
        return self._post("/v1/controller/clear_partition", {"partition_id": partition_id})["deleted"]

    def state_dict(self) -> dict[str, Any]:
        return self._get("/v1/controller/state")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._post("/v1/controller/state", dict(state), idempotent=True)

    def save_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """Fetch the controller's state and write it here, atomically."""
        return write_json_atomically(path, self.state_dict())

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        with open(path) as handle:
            self.load_state_dict(json.load(handle))

    def __repr__(self) -> str:
        return f"RemoteController({self.address!r})"


def _local_error(exc: RequestError) -> Exception:
    """The controller-side exception a 4xx answer stands for (the RequestError itself if none)."""
    payload = exc.payload
    if exc.code == "unknown_partition":
        return UnknownPartitionError(str(payload.get("partition_id", "?")), payload.get("known") or [])
    if exc.code == "unknown_field":
        return UnknownFieldError(
            str(payload.get("partition_id", "?")), payload.get("fields") or [], payload.get("known") or []
        )
    if exc.code == "clear_incomplete":
        failed = {n: WorkerUnavailableError(n, str(d)) for n, d in payload.get("failed", {}).items()}
        return ClearError(
            failed,
            int(payload.get("deleted", 0)),
            payload.get("undeleted", {}),
            payload.get("deleted_by_node", {}),
        )
    exc_type = _BY_CODE.get(exc.code)
    if exc_type is not None:
        return exc_type(exc.message)
    return exc


__all__ = [
    "ControllerServer",
    "RemoteController",
    "WorkerUnavailableError",
    "create_controller_app",
    "serve_controller",
]
