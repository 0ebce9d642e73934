"""The controller over HTTP: a Flask app serving a `Controller`, and `RemoteController`.

Ranks in other processes (loader workers, other hosts) pull batches with the
same Python API as a local `Controller`. Both sides of the protocol live here.
Every error comes back as a JSON error response; no request can stop the server.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flask import Blueprint, Flask, Response, current_app, jsonify, request

from distbatch.atomic import write_json_atomically
from distbatch.auth import bearer_ok, token_from_env
from distbatch.batch import DistributedBatchMemory
from distbatch.client import ShardClient, default_client, validate_node
from distbatch.controller import ClearError, ClearInProgressError, Controller, SchemaConflictError
from distbatch.errors import BatchStatusError, RequestError, WorkerUnavailableError
from distbatch.rpc import decode_value, encode_value
from rpc_server.app import register_json_errors

logger = logging.getLogger("distbatch.controller")

MAX_WAIT_SECONDS = 300.0
MAX_BODY_BYTES = 256 << 20
_ROUTES = Blueprint("controller", __name__)


def _controller() -> Controller:
    return current_app.extensions["controller"]


def _body() -> dict[str, Any]:
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object (Content-Type: application/json)")
    return body


def _error(status: int, code: str, message: str, **extra: Any) -> Response:
    response = jsonify({"error": code, "message": message, **extra})
    response.status_code = status
    return response


@_ROUTES.get("/health")
def health() -> Response:
    return jsonify({"status": "ok", "role": "controller"})


@_ROUTES.post("/v1/controller/put")
def put() -> Response:
    body = _body()
    batch = decode_value(body.get("batch"), None)
    if not isinstance(batch, DistributedBatchMemory):
        raise ValueError("'batch' must be a tagged batch")
    return jsonify({"added": _controller().put(body["partition_id"], batch)})


@_ROUTES.post("/v1/controller/get_meta")
def get_meta() -> Response:
    body = _body()
    config = body.get("sampling_config") or {}
    if not isinstance(config, dict) or not all(isinstance(k, str) and k.isidentifier() for k in config):
        raise ValueError("'sampling_config' must map names to JSON values")
    timeout = body.get("timeout")
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout < 0):
        raise ValueError("'timeout' must be a non-negative number")
    batch = _controller().get_meta(
        body["partition_id"],
        body["task_name"],
        body["fields"],
        body["batch_size"],
        timeout=min(float(timeout), MAX_WAIT_SECONDS) if timeout else None,
        **config,
    )
    return jsonify({"batch": encode_value(batch)})


@_ROUTES.post("/v1/controller/production_status")
def production_status() -> Response:
    body = _body()
    return jsonify(_controller().production_status(body["partition_id"], body.get("fields")))


@_ROUTES.post("/v1/controller/consumption_status")
def consumption_status() -> Response:
    body = _body()
    return jsonify(_controller().consumption_status(body["partition_id"], body["task_name"]))


@_ROUTES.post("/v1/controller/reset_consumption")
def reset_consumption() -> Response:
    body = _body()
    _controller().reset_consumption(body["partition_id"], body.get("task_name"))
    return jsonify({"ok": True})


@_ROUTES.post("/v1/controller/clear_tasks")
def clear_tasks() -> Response:
    body = _body()
    if not isinstance(body.get("task_ids"), list):
        raise ValueError("'task_ids' must be a list")
    return jsonify({"deleted": _controller().clear_tasks(body["partition_id"], body["task_ids"])})


@_ROUTES.post("/v1/controller/clear_partition")
def clear_partition() -> Response:
    return jsonify({"deleted": _controller().clear_partition(_body()["partition_id"])})


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


_CONTROLLER_ERRORS: dict[type[BaseException], tuple[int, str]] = {
    SchemaConflictError: (409, "schema_conflict"),
    ClearInProgressError: (409, "clear_in_progress"),
    BatchStatusError: (400, "batch_status"),
    ValueError: (400, "bad_request"),
    TypeError: (400, "bad_request"),
}


def create_controller_app(controller: Controller, *, token: str | None = None) -> Flask:
    """A Flask app serving `controller`; `token` (default `$DISTBATCH_TOKEN`) guards all but /health."""
    app = Flask("distbatch.controller")
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    app.extensions["controller"] = controller
    required = token if token is not None else token_from_env()
    app.register_blueprint(_ROUTES)

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
            failed={n: e.detail for n, e in exc.failed.items()},
        )

    @app.errorhandler(KeyError)
    def _missing(exc: KeyError) -> Response:
        return _error(400, "bad_request", f"missing or unknown key: {exc}")

    register_json_errors(app, _CONTROLLER_ERRORS, _error, logger)

    return app


class ControllerServer:
    """A `Controller` served over HTTP from a background thread of this process."""

    def __init__(
        self, controller: Controller, host: str = "127.0.0.1", port: int = 0, *, token: str | None = None
    ) -> None:
        from rpc_server.serve import WorkerServer

        self.controller = controller
        self._server = WorkerServer(create_controller_app(controller, token=token), host, port)
        self.address = self._server.node
        self._server.start_background()

    def shutdown(self) -> None:
        self._server.shutdown()

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
        **sampling_config: Any,
    ) -> DistributedBatchMemory:
        if isinstance(fields, (str, bytes)):
            raise ValueError(f"fields must be a list of field names, not one string: {fields!r}")
        body = {
            "partition_id": partition_id,
            "task_name": task_name,
            "fields": list(fields),
            "batch_size": batch_size,
            "timeout": timeout,
            "sampling_config": sampling_config,
        }
        # The server waits at most MAX_WAIT_SECONDS (and refuses a bad timeout itself).
        wait = min(timeout, MAX_WAIT_SECONDS) if isinstance(timeout, (int, float)) and timeout > 0 else 0
        # Not retried once sent: a get_meta may consume samples.
        reply = self._post(
            "/v1/controller/get_meta", body, timeout=self.timeout + wait, idempotent=False, waits=wait > 0
        )
        return decode_value(reply["batch"], self._client)

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
    """The controller-side exception a 4xx answer stands for."""
    if exc.code == "schema_conflict":
        return SchemaConflictError(exc.detail)
    if exc.code == "clear_in_progress":
        return ClearInProgressError(exc.detail)
    if exc.code == "batch_status":
        return BatchStatusError(exc.detail)
    if exc.code == "clear_incomplete":
        failed = {n: WorkerUnavailableError(n, str(d)) for n, d in exc.payload.get("failed", {}).items()}
        return ClearError(failed, int(exc.payload.get("deleted", 0)), exc.payload.get("undeleted", {}))
    if exc.status == 401:
        return exc
    return ValueError(f"{exc.node}: {exc.detail}")


__all__ = [
    "ControllerServer",
    "RemoteController",
    "WorkerUnavailableError",
    "create_controller_app",
    "serve_controller",
]
