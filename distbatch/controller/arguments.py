"""The controller's argument checks: id lists, `get_meta` arguments, custom metadata, a put's
metadata. Refusals are `InvalidArgumentError`s raised before anything changes; the HTTP face
uses the same checks, so a `RemoteController` refuses exactly what a `Controller` refuses."""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from distbatch.batch.memory import BatchStatus, DistributedBatchMemory
from distbatch.batch.meta import BatchMeta
from distbatch.checks import check_int
from distbatch.errors import BatchStatusError, InvalidArgumentError
from distbatch.ids import validate_id, validate_node
from distbatch.wire.bundle import validate_ids
from distbatch.wire.container import ITEMSIZE

# Keyword arguments the controller itself gives the sampler.
RESERVED_SAMPLING_KEYS = frozenset({"partition", "partition_id", "task_name"})

# Per-task custom metadata (`Controller.set_custom_meta`): JSON bytes allowed per task.
MAX_CUSTOM_META_BYTES = 64 << 10


def check_get_meta_args(
    partition_id: str,
    task_name: str,
    fields: Sequence[str],
    batch_size: int,
    timeout: float | None,
    request_id: str | None,
    sampling_config: Mapping[str, Any],
) -> list[str]:
    """Refuse bad `get_meta` arguments before anything is looked at; returns the field list."""
    validate_id(partition_id, "partition_id")
    validate_id(task_name, "task_name")
    fields = id_list(fields, "fields", "field")
    if not fields:
        raise InvalidArgumentError("ask for at least one field")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be a positive int, got {batch_size!r}")
    reserved = sorted(RESERVED_SAMPLING_KEYS.intersection(sampling_config))
    if reserved:
        raise InvalidArgumentError(
            f"sampling config may not set {reserved}: the controller passes them itself"
        )
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or math.isnan(timeout)
        or timeout < 0
    ):
        raise InvalidArgumentError(
            f"timeout must be None or a non-negative number of seconds, got {timeout!r}"
        )
    if request_id is not None:
        validate_id(request_id, "request_id")
    return fields


def id_list(values: Any, name: str, what: str) -> list[str]:
    """`values` as a list of valid ids (`what`: "field" or "task_id"); one string is refused, as a
    caller who passed ``"x"`` for ``["x"]`` would otherwise get one id per character."""
    refuse_one_string(values, name, what)
    ids = list(names_iterable(values, name))
    validate_ids(ids, what)
    return ids


def refuse_one_string(values: Any, name: str, what: str) -> None:
    """InvalidArgumentError when a list of ids (`what`: "field" or "task_id") is one string."""
    if isinstance(values, (str, bytes)):
        noun = "field names" if what == "field" else "task ids"
        raise InvalidArgumentError(f"{name} must be a list of {noun}, not one string: {values!r}")


def names_iterable(value: Any, name: str) -> Iterable[Any]:
    """`value` if it is a list-like of names, else `InvalidArgumentError` (an int, a dict, None...)."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise InvalidArgumentError(f"{name} must be a list of names, got {type(value).__name__}")
    return value


def custom_meta_object(meta: Any, task_id: str) -> dict[str, Any]:
    """A JSON object of at most `MAX_CUSTOM_META_BYTES`, as a fresh copy; else InvalidArgumentError."""
    if not isinstance(meta, Mapping):
        raise InvalidArgumentError(f"custom_meta of task {task_id!r} must be an object, got {type(meta)}")
    try:
        text = json.dumps(dict(meta), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"custom_meta of task {task_id!r} is not JSON: {exc}") from None
    if len(text) > MAX_CUSTOM_META_BYTES:
        raise InvalidArgumentError(
            f"custom_meta of task {task_id!r} is {len(text)} bytes of JSON, over {MAX_CUSTOM_META_BYTES}"
        )
    copy = json.loads(text)
    if not all(isinstance(k, str) for k in meta):
        raise InvalidArgumentError(f"custom_meta of task {task_id!r} must have string keys")
    length = copy.get("total_lengths")
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 0):
        raise InvalidArgumentError(
            f"custom_meta total_lengths of task {task_id!r} must be a non-negative int, got {length!r}"
        )
    return copy


def checked_node(node: Any) -> str:
    """`node` as `validate_node` gives it, else `InvalidArgumentError` (a 400 over HTTP, where a bare
    ValueError would be a bug's 500)."""
    try:
        return validate_node(node)
    except ValueError as exc:
        raise InvalidArgumentError(str(exc)) from None


def refuse_local_batch(batch: DistributedBatchMemory) -> None:
    """A controller takes metadata only: a LOCAL batch (data in this process) is refused."""
    if batch.status is BatchStatus.LOCAL:
        raise BatchStatusError(
            "the controller holds metadata only: put a REMOTE batch (to_remote(node) a LOCAL one first)"
        )


def check_put_meta(meta: BatchMeta) -> None:
    """Refuse metadata that `BatchMeta.from_dict` would refuse (a hand-built one may be anything)."""
    validate_ids(meta.task_ids, "task_id")
    if len(set(meta.task_ids)) != len(meta.task_ids):
        raise InvalidArgumentError("the batch lists a task id twice")
    for node in meta.nodes:
        checked_node(node)
    for name, fm in meta.fields.items():
        validate_id(name, "field")
        if fm.dtype is not None and fm.dtype not in ITEMSIZE:
            raise InvalidArgumentError(f"field {name!r} has unknown dtype {fm.dtype!r}")
        if len(fm.nodes) != len(meta.task_ids) or len(fm.shapes) != len(meta.task_ids):
            raise InvalidArgumentError(f"field {name!r} does not have one node and one shape per task")
        nodes = np.asarray(fm.nodes)
        if nodes.dtype.kind not in "iu" or (
            len(nodes) and not 0 <= int(nodes.min()) <= int(nodes.max()) < len(meta.nodes)
        ):
            raise InvalidArgumentError(f"field {name!r} names a node the batch does not list")


# What `get_meta(max_staleness=k, stale=...)` does with ready tasks older than k policy versions.
STALE_POLICIES = ("wait", "drop")


def check_staleness(max_staleness: Any, stale: Any) -> int | None:
    """`get_meta`'s staleness arguments: `max_staleness` None or an int >= 0, `stale` one of
    `STALE_POLICIES`; returns `max_staleness`."""
    if stale not in STALE_POLICIES:
        raise InvalidArgumentError(f"stale must be one of {list(STALE_POLICIES)}, got {stale!r}")
    if max_staleness is None:
        return None
    return check_int(max_staleness, "max_staleness", 0)


def put_versions(version: Any, count: int) -> list[int] | None:
    """A put's policy versions, one per task: `version` None (none), an int >= 0 for the whole
    batch, or a sequence of `count` of them."""
    if version is None:
        return None
    if isinstance(version, (list, tuple, np.ndarray)):
        versions = [check_int(v, "a task's policy version", 0) for v in version]
        if len(versions) != count:
            raise InvalidArgumentError(f"version= gives {len(versions)} versions for {count} tasks")
        return versions
    return [check_int(version, "version", 0)] * count


def partial_field_set(partial: Any, fields: Collection[str]) -> frozenset[str]:
    """A put's partial fields: every one of `fields` for True, none for False, or those named
    (each must be one of `fields`)."""
    if partial is True:
        return frozenset(fields)
    if partial is False or partial is None:
        return frozenset()
    if isinstance(partial, str) or not isinstance(partial, Iterable):
        raise InvalidArgumentError("partial= must be True, False or a list of the put's fields")
    listed = list(partial)
    if not all(isinstance(p, str) for p in listed):
        raise InvalidArgumentError("partial= must list field names (strings)")
    named = frozenset(listed)
    unknown = sorted(named - set(fields))
    if unknown:
        raise InvalidArgumentError(f"partial= names {unknown[:5]}, which the put does not carry")
    return named
