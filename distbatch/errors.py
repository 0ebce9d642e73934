"""The exception hierarchy: catch `DistBatchError` for anything distbatch raises."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class DistBatchError(Exception):
    """Base class of every error distbatch raises on purpose."""


class WireFormatError(DistBatchError, ValueError):
    """A shard bundle could not be encoded or decoded (malformed or unsupported)."""


class InvalidIdError(DistBatchError, ValueError):
    """A task id or field name is outside the allowed alphabet or length."""


class BatchStatusError(DistBatchError):
    """An operation was asked of a batch in the wrong status (LOCAL / REMOTE / EMPTY)."""


class NodeError(DistBatchError):
    """An error that concerns one worker node; `node` names it (`host:port`).

    Raised by a group (or `ShardClient.call_many`) call, it carries `partial_results`: per
    worker, in order, the result of each call that completed (None for the others), so
    the caller can clear what those calls stored. None when the error is not from a call.
    """

    partial_results: list[Any] | None = None

    def __init__(self, node: str, message: str) -> None:
        super().__init__(f"{node}: {message}")
        self.node = node
        self.detail = message


class ShardNotFoundError(NodeError, KeyError):
    """Some requested shards are not stored on the node; `keys` lists them.

    `missing_by_node` maps each node to its missing keys (one node, or several when a gather
    over many nodes merges their answers into one error).
    """

    def __init__(self, node: str, keys: Iterable[tuple[str, str]], message: str = "") -> None:
        self.keys = [(k[0], k[1]) for k in keys]
        self.missing_by_node: dict[str, list[tuple[str, str]]] = {node: self.keys}
        shown = ", ".join(f"{t}/{f}" for t, f in self.keys[:10])
        more = f" (+{len(self.keys) - 10} more)" if len(self.keys) > 10 else ""
        super().__init__(
            node,
            message
            or f"{len(self.keys)} shard(s) not found: {shown}{more} (deleted by a clear, or never put there)",
        )

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class WorkerUnavailableError(NodeError, ConnectionError):
    """The node could not be reached or did not answer in time. `reason`, where the client knows
    it, says why in a few words ("connection refused", "timed out", ...); None otherwise."""

    reason: str | None = None


class CallTimeoutError(NodeError, TimeoutError):
    """An engine call gave no answer within its deadline (a group's `call_timeout`, the client's
    `timeout`). The worker may be alive and busy; the call is abandoned there (its result, if
    it ever has one, is dropped). `method` and `timeout` (seconds) say which call and deadline."""

    def __init__(self, node: str, method: str, timeout: float) -> None:
        super().__init__(
            node,
            f"engine call {method!r} gave no answer within its deadline of {timeout:g} s "
            "(call_timeout; raise it, or pass None for no deadline)",
        )
        self.method = method
        self.timeout = timeout


class AuthError(NodeError, PermissionError):
    """The node rejected our token (HTTP 401)."""


class CapacityError(NodeError):
    """The node is out of capacity (HTTP 507); nothing of the request was stored. One exception:
    a durable worker with `--sync` whose disk refused the put's record (the message says the
    durable log could not write) had applied the put in memory; it is not durable, and every
    later change is refused."""


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


class ShardsReplacedError(RequestError):
    """The batch's shards were replaced by a later put of the same task ids and fields (HTTP 409
    `shards_replaced`): the values this batch handle was made for are gone, and nothing was read
    or deleted. Use the batch the later put returned, or give each put its own task ids."""

    def __str__(self) -> str:
        return f"{self.node}: {self.message}"


class ClearError(DistBatchError):
    """Some shards could not be deleted (a worker down or not answering); nothing is hidden.

    `failed` maps node -> error, `undeleted` node -> shards that may still be there,
    `deleted` the count that did go and `deleted_by_node` node -> count per node that
    answered. Retrying the clear once the worker is back finishes the job (deleting is
    idempotent).
    """

    def __init__(
        self,
        failed: Mapping[str, NodeError],
        deleted: int,
        undeleted: Mapping[str, int],
        deleted_by_node: Mapping[str, int] | None = None,
    ) -> None:
        detail = "; ".join(
            f"{node}: {undeleted.get(node, '?')} shard(s) may remain ({err.detail})"
            for node, err in failed.items()
        )
        done = ""
        if deleted_by_node:
            done = "; deleted " + ", ".join(f"{node}: {count}" for node, count in deleted_by_node.items())
        super().__init__(f"could not delete shards on {len(failed)} node(s): {detail}{done}")
        self.failed = dict(failed)
        self.deleted = deleted
        self.undeleted = dict(undeleted)
        self.deleted_by_node = dict(deleted_by_node or {})


class ProtocolError(NodeError):
    """The node answered with something that is not a distbatch reply; `node` names it.

    For example a 2xx whose body is not JSON: the address most likely belongs
    to another kind of server (or a proxy answers in its place). Not retried,
    since asking the same peer again would get the same answer.
    """


def _names(names: Iterable[str], limit: int = 20) -> str:
    shown = sorted(names)
    more = f" (+{len(shown) - limit} more)" if len(shown) > limit else ""
    return (", ".join(repr(n) for n in shown[:limit]) or "none") + more


class InvalidArgumentError(DistBatchError, ValueError):
    """An argument was checked and refused (a batch size, a sampling config, a checkpoint...).

    Raised before anything changes. The controller's HTTP face answers it with 400 and
    `RemoteController` raises it again on the client, like the other validated errors.
    """


class InvalidTypeError(DistBatchError, TypeError):
    """An argument of the wrong type (a tensor where a list was wanted, a str where an int was).

    Also a `TypeError`, so `except TypeError` keeps working; raised before anything changes.
    """


class NotFoundError(DistBatchError, KeyError):
    """A name that is not there (a field of a batch, a key of a mapping); also a `KeyError`."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class OutOfRangeError(DistBatchError, IndexError):
    """A position past the end (a task index, a chunk number); also an `IndexError`."""


class StateError(DistBatchError, RuntimeError):
    """Called at the wrong time: a closed client, a loader iterated twice, an event loop that
    cannot be waited on from here; also a `RuntimeError`."""


class UnknownPartitionError(DistBatchError, KeyError):
    """No partition of that id (never put nor created, or cleared); `known` lists the partitions there are."""

    def __init__(self, partition_id: str, known: Iterable[str]) -> None:
        self.partition_id = partition_id
        self.known = sorted(known)
        super().__init__(f"unknown partition {partition_id!r}; known partitions: {_names(self.known)}")

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.partition_id, self.known)


class UnknownFieldError(DistBatchError, KeyError):
    """Fields that no producer has put into, nor declared for, the partition: they can never be ready.

    `fields` lists them, `known` the fields the partition has or expects.
    """

    def __init__(self, partition_id: str, fields: Iterable[str], known: Iterable[str]) -> None:
        self.partition_id = partition_id
        self.fields = list(fields)
        self.known = sorted(known)
        super().__init__(
            f"partition {partition_id!r} has no field {_names(self.fields)} (a typo?); "
            f"its fields: {_names(self.known)}. A field a later stage will put can be declared "
            "with create_partition(partition_id, expected_fields=[...])"
        )

    def __str__(self) -> str:
        return self.args[0]

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.partition_id, self.fields, self.known)


# Raised by the wire, the batch, the controller and the loader (moved here from their modules).


class MetaFormatError(DistBatchError, ValueError):
    """Serialized metadata is malformed (bad JSON, ids, nodes, dtypes or shapes)."""


class SchemaConflictError(DistBatchError, ValueError):
    """A put gives a field a dtype (or kind) other than the one the partition has."""


class ShardElsewhereError(DistBatchError, ValueError):
    """A put names a field a partition already has for a task, on another worker: a task's field
    lives on one worker, so the controller would lose track of the first shard (it would never
    be served again, nor deleted). Put it to the same worker, or clear the task first."""


class ClearInProgressError(DistBatchError):
    """A put named tasks whose clear is under way: their shards are being deleted right now."""


class ReplayUnavailableError(DistBatchError, RuntimeError):
    """`reset()` / `get_buffer()` on a loader whose batches live in its worker processes."""


class ShapeError(DistBatchError, ValueError):
    """Shapes that are malformed (negative dims, wrong counts, too many dimensions)."""


class ShmError(DistBatchError):
    """A region or a message over the Unix socket was refused (wrong seals, size, framing)."""


class HandshakeRefused(ShmError):
    """The worker turned the handshake down; `passing` when a later try may succeed (busy)."""

    def __init__(self, message: str, passing: bool) -> None:
        super().__init__(message)
        self.passing = passing


class SameHostFallback(DistBatchError):
    """This request cannot take the same-host path; send it over HTTP (the message says why)."""


class SameHostError(DistBatchError):
    """The same-host path failed where it should have worked, and `DISTBATCH_SHM_STRICT=1` asks
    for an error instead of the quiet fallback to HTTP (the test suite runs so)."""


class SameHostAnswerError(DistBatchError):
    """The worker answered with an error: `status` and `body` as an HTTP error would carry."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP-like status {status}")
        self.status = status
        self.body = body


class ResponseError(DistBatchError, ConnectionError):
    """The response was cut short, malformed, or of a kind this reader does not handle."""


class AnsweredError(DistBatchError):
    """The worker answered with an error status (carried as `error`), as opposed to not answering."""

    def __init__(self, error: NodeError) -> None:
        super().__init__(str(error))
        self.error = error



class ServerBindError(DistBatchError, OSError):
    """A server (a worker, a controller's HTTP face) could not listen on its address: the port
    is taken, or the host is not this machine's. An `OSError`, so `except OSError` catches it
    as it would the socket's own error; `errno` is the socket's."""
