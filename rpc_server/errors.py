"""Exceptions the worker turns into HTTP answers (kept free of heavy imports)."""

from __future__ import annotations

import traceback


class ApiError(Exception):
    """A refusal to answer with ``{"error": code, "message": ...}`` and HTTP-like `status`
    (over HTTP by the app's handler, over the same-host socket by its server)."""

    def __init__(self, status: int, code: str, message: str, **extra: object) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.extra = extra


class EngineLoadError(Exception):
    """The `--engine` spec could not be imported or instantiated."""


class UnknownMethodError(Exception):
    """No public engine method of that name."""


class EngineCallFailed(Exception):
    """The engine method raised; carries what to report."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(str(exc))
        self.exception_type = type(exc).__name__
        self.traceback = "".join(traceback.format_exception(exc))


class BadArgumentsError(Exception):
    """An engine call's arguments do not fit the method's signature (HTTP 400); it never ran."""


class ShuttingDownError(Exception):
    """The worker is shutting down: an engine call still queued, or arriving now, is not run (503)."""
