"""Every exception the worker raises on purpose, under `WorkerError` (kept free of heavy imports).

The store's, the engine host's and the views' refusals all live here, so each face of the worker
(HTTP routes, the same-host socket) maps them to answers in one table (`rpc_server.checks`)."""

from __future__ import annotations

import traceback
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distbatch.ids import ShardKey


class WorkerError(Exception):
    """Base class of every error the worker raises on purpose; each face (HTTP routes, the
    same-host socket) turns one into its answer."""


class ApiError(WorkerError):
    """A refusal to answer with ``{"error": code, "message": ...}`` and HTTP-like `status`
    (over HTTP by the app's handler, over the same-host socket by its server)."""

    def __init__(self, status: int, code: str, message: str, **extra: object) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.extra = extra


class EngineLoadError(WorkerError):
    """The `--engine` spec could not be imported or instantiated."""


class UnknownMethodError(WorkerError):
    """No public engine method of that name."""


class EngineCallFailed(WorkerError):
    """The engine method raised; carries what to report."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(str(exc))
        self.exception_type = type(exc).__name__
        self.traceback = "".join(traceback.format_exception(exc))


class BadArgumentsError(WorkerError):
    """An engine call's arguments do not fit the method's signature (HTTP 400); it never ran."""


class ShuttingDownError(WorkerError):
    """The worker is shutting down: an engine call still queued, or arriving now, is not run (503)."""


class StoreCapacityError(WorkerError):
    """The put would exceed the store's capacity; nothing was stored."""


class DurableLogError(WorkerError):
    """A durable worker's log could not write (a full or failing disk): changes are refused,
    since none could survive a restart; what the store holds stays readable."""


class UnknownStageError(WorkerError):
    """A commit or abort named a stage that does not exist (never staged, or expired)."""


class SharedMemoryUnavailable(WorkerError):
    """A same-host request cannot be served from shared memory (over `--shm-max-bytes`, or the
    kernel refused a region); the client falls back to HTTP for it."""


class MissingShardsError(WorkerError):
    """Some requested keys are not stored; `keys` lists them (the first `MAX_MISSING_LISTED`
    when there are more: `count` says how many)."""

    def __init__(self, keys: list[ShardKey], count: int | None = None) -> None:
        self.count = len(keys) if count is None else count
        more = f", the first {len(keys)} listed" if self.count > len(keys) else ""
        super().__init__(f"{self.count} shard(s) not found{more}")
        self.keys = keys


class ReplacedShardsError(WorkerError):
    """A read or delete named shards a later put has replaced (same task ids, same fields):
    the batch handle asking was made for the earlier values, which are gone. Nothing was read
    or deleted."""

    def __init__(self, replaced: list[tuple[str, str, int, int]], count: int, what: str) -> None:
        self.replaced, self.count = replaced, count
        shown = ", ".join(f"{t}/{f}" for t, f, _, _ in replaced[:5])
        more = f" (+{count - 5} more)" if count > 5 else ""
        super().__init__(
            f"{count} shard(s) were replaced by a later put of the same task ids: {shown}{more}; "
            f"the values this batch was made for are gone, so nothing was {what}. Use the batch "
            f"from the later put, or give each put its own task ids"
        )


class AppendMismatchError(WorkerError):
    """An append's values cannot extend the stored ones (another dtype, other trailing dims,
    a 0-d value, a JSON field); nothing was stored."""


class SharedValueError(WorkerError):
    """A put's shared values cannot be stored as asked (a task sharing a value that itself
    shares one, a task both given a value and sharing one); nothing was stored."""


class UnstorableResultError(WorkerError):
    """Our own account of why an engine's result cannot be stored or sent (reported as `kind`)."""

    def __init__(self, message: str, kind: type[Exception] = TypeError) -> None:
        super().__init__(message)
        self.kind = kind
