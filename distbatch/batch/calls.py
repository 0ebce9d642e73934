"""Engine-call envelopes: how arguments and results of `/v1/call/<method>` travel.

Every argument and result is a tagged value, so nothing in user data is ever
mistaken for a batch: ``{"json": <value>}`` or ``{"batch": <batch JSON object>}``.
A REMOTE batch travels as its metadata; LOCAL batches are refused (push them
with `to_remote` first: the controller must not ship data by accident).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from distbatch.errors import BatchStatusError, WireFormatError
from distbatch.wire.json_values import check_json

if TYPE_CHECKING:
    from distbatch.batch.memory import DistributedBatchMemory
    from distbatch.client.shard_client import ShardClient

# The batch (and with it torch) is imported when a batch travels, not before: a worker whose
# engine calls carry JSON only never loads torch (`rpc_server.engine`).
BATCH_MODULE = "distbatch.batch.memory"


def loaded_batch_class() -> type[DistributedBatchMemory] | None:
    """`DistributedBatchMemory` if this process has imported it; None while no value can be one.

    Another thread may be importing it right now: its module is then in `sys.modules` before
    the class is defined, and until the class exists no value can be one either.
    """
    return getattr(sys.modules.get(BATCH_MODULE), "DistributedBatchMemory", None)


def encode_value(value: Any) -> dict[str, Any]:
    """Tag one argument / result for the wire."""
    batch_class = loaded_batch_class()
    if batch_class is not None and isinstance(value, batch_class):
        from distbatch.batch.states import BatchStatus

        status = value.status
        if status is BatchStatus.LOCAL:
            raise BatchStatusError(
                "cannot pass a LOCAL batch to an engine call: to_remote(node) it first so only "
                "metadata crosses the controller"
            )
        if status is BatchStatus.EMPTY:  # its fields travel (zero tasks): an engine can read them
            return {"batch": value.schema_meta().to_dict() if value.fields else None}
        return {"batch": value.meta.to_dict()}  # type: ignore[union-attr]
    return {"json": check_json(value)}


def decode_value(tagged: Any, client: ShardClient | None = None) -> Any:
    """Inverse of `encode_value`; batches come back REMOTE, bound to `client`."""
    if not isinstance(tagged, dict) or len(tagged) != 1:
        raise WireFormatError('a call value must be {"json": ...} or {"batch": ...}')
    ((tag, payload),) = tagged.items()
    if tag == "json":
        return payload
    if tag == "batch":
        from distbatch.batch.memory import DistributedBatchMemory
        from distbatch.batch.meta import BatchMeta

        if payload is None:
            return DistributedBatchMemory()
        return DistributedBatchMemory.from_meta(BatchMeta.from_dict(payload), client)
    raise WireFormatError(f"unknown call value tag {tag!r}")


def encode_call(args: Sequence[Any], kwargs: Mapping[str, Any]) -> bytes:
    body = {
        "args": [encode_value(a) for a in args],
        "kwargs": {str(k): encode_value(v) for k, v in kwargs.items()},
    }
    return json.dumps(body, separators=(",", ":")).encode()


def decode_call(body: Any, client: ShardClient | None = None) -> tuple[list[Any], dict[str, Any]]:
    if not isinstance(body, dict) or set(body) - {"args", "kwargs"}:
        raise WireFormatError('call body must be {"args": [...], "kwargs": {...}}')
    args, kwargs = body.get("args", []), body.get("kwargs", {})
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise WireFormatError("'args' must be a list and 'kwargs' an object")
    for name in kwargs:
        if not name.isidentifier() or name.startswith("_"):
            raise WireFormatError(f"invalid keyword argument name {name!r}")
    return [decode_value(a, client) for a in args], {k: decode_value(v, client) for k, v in kwargs.items()}
