"""Request checks and error answers both faces of the worker share: its HTTP routes and its
same-host socket (`rpc_server.shm_server`). Free of Flask, so the socket server needs no request
context; a refusal is an `ApiError`, which each face turns into its own answer."""

from __future__ import annotations

from typing import Any

import numpy as np

from distbatch import wire
from distbatch.errors import InvalidIdError, MetaFormatError, WireFormatError
from rpc_server.errors import (
    ApiError,
    AppendMismatchError,
    BadArgumentsError,
    DurableLogError,
    MissingShardsError,
    ReplacedShardsError,
    SharedValueError,
    ShuttingDownError,
    StoreCapacityError,
    UnknownMethodError,
    UnknownStageError,
)

# Fields (columns) one put or fetch may name: the work per request is per field and task,
# so both are bounded (tasks by --max-keys-per-request).
MAX_FIELDS_PER_REQUEST = 4096

# Generations are JSON integers; JSON carries integers exactly up to this.
JSON_INT_BOUND = 1 << 53

# Exceptions that are the client's doing (or the worker's state), by HTTP status and error code.
ERROR_ANSWERS: dict[type[Exception], tuple[int, str]] = {
    WireFormatError: (400, "bad_container"),
    MetaFormatError: (400, "bad_metadata"),
    InvalidIdError: (400, "invalid_id"),
    BadArgumentsError: (400, "bad_arguments"),
    AppendMismatchError: (400, "bad_append"),
    SharedValueError: (400, "bad_alias"),
    UnknownMethodError: (404, "unknown_method"),
    UnknownStageError: (404, "unknown_stage"),
    ReplacedShardsError: (409, "shards_replaced"),
    StoreCapacityError: (507, "insufficient_storage"),
    DurableLogError: (507, "durable_log_failed"),
    ShuttingDownError: (503, "shutting_down"),
}


def missing_shards(exc: MissingShardsError) -> ApiError:
    """The 404 answer to a fetch of shards the worker does not hold (which, and how many)."""
    return ApiError(
        404, "shards_not_found", str(exc), missing=[list(k) for k in exc.keys], missing_count=exc.count
    )


def key_list(value: Any, name: str, limit: int) -> list[Any]:
    """`value` if it is a list of at most `limit` entries (400 / 413 otherwise)."""
    if not isinstance(value, list):
        raise ApiError(400, "bad_request", f"'{name}' must be a list")
    if len(value) > limit:
        raise ApiError(413, "too_many_keys", f"{len(value)} entries in '{name}', limit {limit}")
    return value


def check_field_count(count: int) -> None:
    if count > MAX_FIELDS_PER_REQUEST:
        raise ApiError(
            413, "too_many_fields", f"{count} fields in one request, limit {MAX_FIELDS_PER_REQUEST}"
        )


def check_put(bundle: wire.Bundle, max_keys: int) -> None:
    """A put names at most `MAX_FIELDS_PER_REQUEST` fields and `max_keys` tasks (413 otherwise)."""
    check_field_count(len(bundle.columns))
    if len(bundle.task_ids) > max_keys:
        raise ApiError(413, "too_many_keys", f"{len(bundle.task_ids)} tasks in one request, limit {max_keys}")


def check_response_size(keys: int, size: int, limit: int) -> None:
    """413 when an answer of `keys` shards would hold more than `limit` bytes."""
    if size > limit:
        raise ApiError(
            413,
            "response_too_large",
            f"a response of {keys} shard(s) would hold {size} bytes, over the limit of {limit} bytes"
            " (--max-response-bytes); ask for fewer keys per request",
            limit=limit,
            bytes=size,
        )


def answer_ids_as_count(value: Any) -> bool:
    """A fetch's `answer_ids` (default true): false asks for the number of task ids in the
    answer instead of the ids the request just named. 400 unless a bool."""
    if type(value) is not bool:
        raise ApiError(400, "bad_request", f"'answer_ids' must be true or false, got {value!r}")
    return not value


def generation_list(value: Any, count: int) -> np.ndarray | None:
    """A request's `generations` (per task: the put its values came from, 0 for any) as an
    array, None when absent; one whole number stands for every task (the usual case: the
    values of one put). 400 unless `count` whole numbers, or one, from 0 to 2**53."""
    if value is None:
        return None
    if type(value) is int and 0 <= value < JSON_INT_BOUND:
        return np.full(count, value, dtype=np.int64)
    if (
        not isinstance(value, list)
        or len(value) != count
        or not all(type(g) is int and 0 <= g < JSON_INT_BOUND for g in value)
    ):
        raise ApiError(
            400,
            "bad_request",
            f"'generations' must be {count} whole numbers (one per task), or one for all, 0 to 2**53",
        )
    return np.asarray(value, dtype=np.int64)
