"""JSON error answers for a Flask app: `{"error": CODE, "message": ..., **extra}` with a status.

Shared by the worker's app (`rpc_server.app`) and the controller's (`distbatch.controller.server`),
so both speak the same error shape, which `ShardClient` turns back into exceptions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TypeVar

from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import HTTPException

__all__ = ["error_response", "register_json_errors"]


def error_response(status: int, code: str, message: str, **extra: object) -> Response:
    """A JSON error response: `{"error": code, "message": message, **extra}` with `status`."""
    response = jsonify({"error": code, "message": message, **extra})
    response.status_code = status
    return response


E = TypeVar("E", bound=Exception)


def register_json_errors(
    app: Flask,
    table: Mapping[type[E], tuple[int, str]],
    respond: Callable[..., Response],
    log: logging.Logger,
) -> None:
    """Answer each exception type in `table` with `respond(status, code, message)`.

    Also turns werkzeug's HTTP errors (404, 405, 413, ...) into the same JSON
    shape, and anything unexpected into a logged 500, so no request ever gets
    an HTML page or a dropped connection.
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
