"""Deleting shards: by task ids (all fields or some), by keys, by products, on many nodes at once.

Every delete is `POST /v1/shards/delete` naming at most the client's key bound per request,
and idempotent (what is not there counts zero). Keys are sent as (task ids x fields) products,
far smaller than key pairs. Across nodes, either each node's outcome is reported (cleanup that
must say which nodes could not be cleared) or the failures are raised together.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable, Sequence
from typing import Any

from distbatch.client.planning import DeleteProduct, tasks_by_fields
from distbatch.client.responses import merge_errors
from distbatch.client.results import DeleteResult
from distbatch.client.transport import HttpTransport
from distbatch.errors import InvalidArgumentError, InvalidIdError, NodeError
from distbatch.ids import ShardKey, validate_id, validate_key
from distbatch.wire.bundle import validate_ids

Outcomes = dict[str, DeleteResult | NodeError]
"""Per node, what its deletes freed or why they failed."""


def check_delete_args(
    task_ids: Iterable[str] | None, keys: Iterable[Any] | None, fields: Iterable[str] | None
) -> tuple[list[str] | None, list[ShardKey] | None, list[str] | None]:
    """`delete`'s arguments checked: exactly one of task ids (with fields, maybe) or keys."""
    if (task_ids is None) == (keys is None):
        raise InvalidArgumentError("give exactly one of task_ids or keys")
    if fields is not None and task_ids is None:
        raise InvalidArgumentError("fields goes with task_ids")
    for name, ids in (("task_ids", task_ids), ("fields", fields)):
        if isinstance(ids, str):
            raise InvalidIdError(f"{name} must be a list of ids, not one string")
    checked_fields = None if fields is None else [validate_id(f, "field") for f in fields]
    if task_ids is not None:
        ids = list(task_ids)
        validate_ids(ids, "task_id")
        return ids, None, checked_fields
    return None, [validate_key(k) for k in keys or ()], None


async def _each_node(deletes: dict[str, Coroutine[Any, Any, DeleteResult]]) -> Outcomes:
    """Run one delete per node concurrently; each node's result or `NodeError`, by node."""
    results = await asyncio.gather(*deletes.values(), return_exceptions=True)
    out: Outcomes = {}
    for node, result in zip(deletes, results):
        if isinstance(result, (NodeError, DeleteResult)):
            out[node] = result
        else:
            raise result  # not a node's answer: a bug or a cancellation
    return out


class Deleter:
    """Sends deletes through one transport, at most `max_keys` tasks or keys per request."""

    def __init__(self, transport: HttpTransport, max_keys: int) -> None:
        self.transport = transport
        self.max_keys = max_keys

    async def delete(
        self,
        node: str,
        *,
        task_ids: Sequence[str] | None = None,
        keys: Sequence[ShardKey] | None = None,
        fields: Sequence[str] | None = None,
        generations: list[int] | None = None,
    ) -> DeleteResult:
        """All fields of `task_ids` (only `fields` of them, if given), or exactly `keys`.
        With `generations` (and `fields`), values a later put replaced are refused, not deleted."""
        step = self.max_keys  # for task ids a task count: the worker deletes a product at once
        if task_ids is not None:
            named = {} if fields is None else {"fields": list(fields)}
            bodies: list[dict[str, Any]] = [
                {"task_ids": list(task_ids[i : i + step]), **named} for i in range(0, len(task_ids), step)
            ]
            if generations is not None:
                for i, body in enumerate(bodies):
                    body["generations"] = generations[i * step : (i + 1) * step]
        elif keys is not None:
            items = list(keys)
            bodies = [{"keys": items[i : i + step]} for i in range(0, len(items), step)]
        else:
            raise InvalidArgumentError("give exactly one of task_ids or keys")
        total = DeleteResult(0, 0)
        for body in bodies:
            reply = await self.transport.request(node, "POST", "/v1/shards/delete", json_body=body)
            total += DeleteResult(reply["deleted"], reply["bytes_freed"])
        return total

    async def products(self, node: str, products: Iterable[DeleteProduct]) -> DeleteResult:
        """Each `(task_ids, fields, generations)` product on `node`, one after the other."""
        total = DeleteResult(0, 0)
        for task_ids, fields, generations in products:
            total += await self.delete(node, task_ids=task_ids, fields=fields, generations=generations)
        return total

    async def keys_each(self, keys_by_node: dict[str, list[ShardKey]]) -> Outcomes:
        """Exactly the given keys, sent as products; nodes concurrently, each node's outcome."""
        return await _each_node(
            {
                node: self.products(
                    node, [(ids, list(fields), None) for fields, ids in tasks_by_fields(keys).items()]
                )
                for node, keys in keys_by_node.items()
            }
        )

    async def keys_all(self, keys_by_node: dict[str, list[ShardKey]]) -> DeleteResult:
        """`keys_each`, summed; failures raised (all missing keys merged)."""
        total = DeleteResult(0, 0)
        errors: list[BaseException] = []
        for outcome in (await self.keys_each(keys_by_node)).values():
            if isinstance(outcome, DeleteResult):
                total += outcome
            else:
                errors.append(outcome)
        if errors:
            raise merge_errors(errors)
        return total

    async def products_each(self, plan: dict[str, list[DeleteProduct]]) -> Outcomes:
        """`(task_ids, fields, generations)` products per node, nodes concurrently; each node's outcome."""
        return await _each_node({node: self.products(node, products) for node, products in plan.items()})
