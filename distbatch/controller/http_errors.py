"""Which validated refusal answers which HTTP status and code, read both ways: the controller's
server answers an exception with its code, and `RemoteController` raises the same type again.

Exactly these answer 4xx (plus `ClearError`, 424, and werkzeug's own); a plain `ValueError`,
`TypeError` or `KeyError` raised while serving is a bug: a logged 500 ``internal_error``.
"""

from __future__ import annotations

from distbatch.errors import (
    BatchStatusError,
    ClearInProgressError,
    DistBatchError,
    InvalidArgumentError,
    InvalidIdError,
    MetaFormatError,
    SchemaConflictError,
    ShardElsewhereError,
    UnknownFieldError,
    UnknownPartitionError,
    WireFormatError,
)

MAX_WAIT_SECONDS = 300.0
"""The longest a served `get_meta` waits for producers in one request (longer waits re-ask)."""

VALIDATED: dict[type[DistBatchError], tuple[int, str]] = {
    SchemaConflictError: (409, "schema_conflict"),
    ClearInProgressError: (409, "clear_in_progress"),
    ShardElsewhereError: (409, "shard_elsewhere"),
    UnknownPartitionError: (404, "unknown_partition"),
    UnknownFieldError: (404, "unknown_field"),
    BatchStatusError: (400, "batch_status"),
    InvalidIdError: (400, "invalid_id"),
    MetaFormatError: (400, "bad_metadata"),
    WireFormatError: (400, "bad_container"),
    InvalidArgumentError: (400, "bad_request"),
}
BY_CODE = {code: exc_type for exc_type, (_, code) in VALIDATED.items()}
