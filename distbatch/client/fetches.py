"""Gathering shards: products and single keys from many nodes at once, in the order asked.

A product (task ids x fields from one node) is one request on the node's `ShardPath`; one a
worker refuses as too large (413 `response_too_large`) is fetched again in parts that should
fit, concurrently. Single keys are grouped into products per node first. Every answer is
checked to hold exactly what was asked for.
"""

from __future__ import annotations

import asyncio
from typing import Any

from distbatch import wire
from distbatch.client.planning import Product, key_products
from distbatch.client.responses import all_results
from distbatch.client.shard_paths import Progress, ShardPath
from distbatch.errors import RequestError, WireFormatError, WorkerUnavailableError
from distbatch.ids import ShardKey

SHOWN_TASKS = 8  # a lost gather names this many of the tasks it lost, then counts the rest


def gather_lost(
    error: WorkerUnavailableError, asked: int, tasks: list[str], fields: list[str]
) -> WorkerUnavailableError:
    """`error` (a worker a gather of `asked` tasks could not reach) said for the gather: that the
    worker died or cannot be reached, and which `tasks` and `fields` it held (what was lost)."""
    shown = ", ".join(tasks[:SHOWN_TASKS])
    if len(tasks) > SHOWN_TASKS:
        shown += f" (+{len(tasks) - SHOWN_TASKS} more)"
    why = error.detail  # the whole of it: a stall says how long and what that means
    out = WorkerUnavailableError(
        error.node,
        f"distbatch worker unreachable ({why}): it died, was stopped, or the network to it is down; "
        f"this gather of {asked} task(s) lost the {len(tasks)} it holds "
        f"(fields {', '.join(fields)}): {shown}",
    )
    out.reason = error.reason
    out.partial_results = getattr(error, "partial_results", None)
    return out


def _too_large_alone(node: str, task_id: str, fields: list[str], refused: RequestError) -> RequestError:
    limit = refused.payload.get("limit")
    what = (
        f"shard {task_id}/{fields[0]} alone is"
        if len(fields) == 1
        else f"task {task_id}'s fields {fields} together are"
    )
    return RequestError(
        node,
        413,
        refused.code,
        f"{what} over the worker's response limit"
        f" ({limit if limit is not None else 'unknown'} bytes); raise its --max-response-bytes",
        refused.payload,
    )


def _part_count(refused: RequestError, tasks: int) -> int:
    """Parts aimed at half the worker's limit each (sizes vary and the header adds a little), so
    one refusal usually costs one round of parts, not a cascade of halvings; halves at least."""
    limit, size = refused.payload.get("limit"), refused.payload.get("bytes")
    parts = 2
    if type(limit) is int and type(size) is int and limit > 1:
        parts = max(2, -(-size // (limit // 2)))
    return min(parts, tasks)


class Gatherer:
    """Fetches products and keys through one shard path, under one client's request bounds."""

    def __init__(self, path: ShardPath, max_bytes: int, max_keys: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.max_keys = max_keys

    async def product(
        self,
        node: str,
        task_ids: list[str],
        fields: list[str],
        progress: Progress | None = None,
        generations: list[int] | None = None,
    ) -> wire.Bundle:
        """One product from `node` in one request, or in parts if the response would be too
        large for the worker (`--max-response-bytes`); a single task's fields over the limit
        raise `RequestError`. `generations`: see `planning.Product`."""
        try:
            bundle = await self.path.fetch(node, task_ids, fields, progress, generations)
        except RequestError as exc:
            if exc.status != 413 or exc.code != "response_too_large":
                raise
            if len(task_ids) == 1:
                raise _too_large_alone(node, task_ids[0], fields, exc) from None
            parts = _part_count(exc, len(task_ids))
            bounds = [i * len(task_ids) // parts for i in range(parts + 1)]
            results = await asyncio.gather(
                *(
                    self.product(
                        node,
                        task_ids[a:b],
                        fields,
                        progress,
                        None if generations is None else generations[a:b],
                    )
                    for a, b in zip(bounds, bounds[1:])
                ),
                return_exceptions=True,
            )
            return wire.concat_bundles(all_results(results))
        if bundle.task_ids != task_ids or {wire.column_field(k) for k in bundle.columns} != set(fields):
            raise WireFormatError(f"{node}: response does not hold the shards asked for")
        return bundle

    async def products(self, requests: list[Product], progress: Progress | None = None) -> list[wire.Bundle]:
        """Products from their nodes concurrently, one bundle each, in order; all missing keys
        raised together."""
        results = await asyncio.gather(
            *(self.product(node, ids, fields, progress, gens) for node, ids, fields, gens in requests),
            return_exceptions=True,
        )
        return all_results(results)

    async def _node_keys(
        self, node: str, sizes: dict[ShardKey, int], progress: Progress | None
    ) -> dict[ShardKey, Any]:
        """Explicit keys from `node`, as a product per field set, split to the request bounds
        (by bytes too when the refs said how big their shards are)."""
        requests = key_products(node, sizes, self.max_bytes, self.max_keys)
        out: dict[ShardKey, Any] = {}
        for bundle in await self.products(requests, progress):
            out.update(wire.bundle_to_shards(bundle))
        return out

    async def keys(
        self,
        order: list[tuple[str, ShardKey]],
        per_node: dict[str, dict[ShardKey, int]],
        progress: Progress | None = None,
    ) -> list[Any]:
        """Single shards from every node concurrently, one value each, in `order`."""
        nodes = list(per_node)
        results = await asyncio.gather(
            *(self._node_keys(node, per_node[node], progress) for node in nodes), return_exceptions=True
        )
        try:
            found = dict(zip(nodes, all_results(results)))
        except WorkerUnavailableError as exc:
            if exc.node not in per_node:
                raise
            held = per_node[exc.node]
            tasks = list(dict.fromkeys(key.task_id for key in held))
            fields = sorted({key.field for key in held})
            asked = len({key.task_id for _, key in order})
            raise gather_lost(exc, asked, tasks, fields) from exc
        return [found[node][key] for node, key in order]
