"""The exception hierarchy: catch `DistBatchError` for anything distbatch raises."""

from __future__ import annotations

from collections.abc import Iterable


class DistBatchError(Exception):
    """Base class of every error distbatch raises on purpose."""


class WireFormatError(DistBatchError, ValueError):
    """A shard bundle could not be encoded or decoded (malformed or unsupported)."""


class InvalidIdError(DistBatchError, ValueError):
    """A task id or field name is outside the allowed alphabet or length."""


class BatchStatusError(DistBatchError):
    """An operation was asked of a batch in the wrong status (LOCAL / REMOTE / EMPTY)."""


class NodeError(DistBatchError):
    """An error that concerns one worker node; `node` names it (`host:port`)."""

    def __init__(self, node: str, message: str) -> None:
        super().__init__(f"{node}: {message}")
        self.node = node
        self.detail = message


class ShardNotFoundError(NodeError, KeyError):
    """Some requested shards are not stored on the node; `keys` lists them."""

    def __init__(self, node: str, keys: Iterable[tuple[str, str]], message: str = "") -> None:
        self.keys = [tuple(k) for k in keys]
        shown = ", ".join(f"{t}/{f}" for t, f in self.keys[:10])
        more = f" (+{len(self.keys) - 10} more)" if len(self.keys) > 10 else ""
        super().__init__(node, message or f"{len(self.keys)} shard(s) not found: {shown}{more}")

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class WorkerUnavailableError(NodeError, ConnectionError):
    """The node could not be reached or did not answer in time."""


class AuthError(NodeError, PermissionError):
    """The node rejected our token (HTTP 401)."""


class CapacityError(NodeError):
    """The node is out of capacity (HTTP 507); nothing of the request was stored."""


class ServerError(NodeError):
    """The node answered 5xx (other than 507), after every retry where retrying is safe."""

    def __init__(self, node: str, status: int, code: str, message: str) -> None:
        super().__init__(node, f"HTTP {status} {code}: {message}")
        self.status = status
        self.code = code


class EngineError(NodeError):
    """An engine method raised on the worker; the worker stays up.

    `exception_type` and `remote_traceback` tell what happened there.
    """

    def __init__(self, node: str, exception_type: str, message: str, remote_traceback: str = "") -> None:
        super().__init__(node, f"engine raised {exception_type}: {message}")
        self.exception_type = exception_type
        self.remote_traceback = remote_traceback


class RequestError(NodeError, ValueError):
    """The node rejected the request as invalid (another 4xx); `status` and `code` say why."""

    def __init__(self, node: str, status: int, code: str, message: str, payload: dict | None = None) -> None:
        super().__init__(node, f"HTTP {status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.payload = payload or {}
