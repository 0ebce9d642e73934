"""Cutting work into requests: which tasks and fields each request to a node names.

Pure functions over numpy columns and ids, no I/O: a put's bundle cut to the request bounds,
explicit shard keys grouped into (task ids x fields) products, refs grouped by node. The
batch uses `cut_points` too, to cut its gathers the same way.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from distbatch import wire
from distbatch.errors import InvalidArgumentError
from distbatch.ids import ShardKey, ShardRef, validate_key, validate_node

Product = tuple[str, list[str], list[str], list[int] | None]
"""`(node, task_ids, fields, generations)`: every field of every task named, from one node; with
`generations` (per task, the put its values came from), values a later put replaced are refused."""

ProductRequest = tuple[str, Sequence[str], Sequence[str]] | tuple[str, Sequence[str], Sequence[str], Any]
"""What callers pass: `(node, task_ids, fields)`, or with generations as a fourth element."""


def cut_points(per_task: np.ndarray, max_bytes: int, max_tasks: int) -> list[int]:
    """Task indexes cutting `per_task` bytes into runs under `max_bytes` and `max_tasks` each
    (a task over `max_bytes` alone gets a run of its own); first 0, last len(per_task)."""
    n = len(per_task)
    cuts = [0]
    totals = np.cumsum(per_task)
    while cuts[-1] < n:
        start = cuts[-1]
        base = int(totals[start - 1]) if start else 0
        end = int(np.searchsorted(totals, base + max_bytes, side="right"))
        cuts.append(min(max(end, start + 1), start + max_tasks, n))
    return cuts


def slice_bundle(bundle: wire.Bundle, start: int, stop: int) -> wire.Bundle:
    """Tasks `start:stop` of a bundle (byte views, no copies)."""
    columns: dict[str, wire.RawColumn] = {}
    for name, column in bundle.columns.items():
        if column.rows is None:
            lo, hi, rows = start, stop, None
        else:
            lo, hi = (int(i) for i in np.searchsorted(column.rows, [start, stop]))
            if not np.all(np.diff(column.rows) > 0):
                raise InvalidArgumentError("a partial column's rows must be ascending to be split")
            rows = column.rows[lo:hi] - start
        sliced = wire.slice_aliases(column, wire.slice_column(column, lo, hi, rows), start, stop)
        if hi == lo and not (sliced.alias is not None and len(sliced.alias)):
            continue
        columns[name] = sliced
    return wire.Bundle(bundle.task_ids[start:stop], columns)


def task_bytes(bundle: wire.Bundle) -> np.ndarray:
    """Each task's bytes over all of a bundle's columns."""
    per_task = np.zeros(len(bundle.task_ids), dtype=np.int64)
    for column in bundle.columns.values():
        if column.rows is None:
            per_task += column.row_nbytes()
        else:
            np.add.at(per_task, column.rows, column.row_nbytes())
    return per_task


def split_bundle(bundle: wire.Bundle, max_bytes: int | None, max_tasks: int) -> list[wire.Bundle]:
    """Cut a bundle into bundles of consecutive tasks, each under the bounds (`max_bytes`
    None: the task bound only, for a put that has no body to bound)."""
    n = len(bundle.task_ids)
    if n <= 1:
        return [bundle]
    if max_bytes is not None:
        cuts = cut_points(task_bytes(bundle), max_bytes, max_tasks)
    else:
        cuts = [*range(0, n, max_tasks), n]
    if len(cuts) == 2:
        return [bundle]
    return [slice_bundle(bundle, a, b) for a, b in zip(cuts, cuts[1:])]


def tasks_by_fields(keys: Iterable[tuple[str, str]]) -> dict[tuple[str, ...], list[str]]:
    """Shard keys as products: the tasks (in first-seen order) that share each set of fields."""
    fields_of: dict[str, list[str]] = {}
    for task_id, field in keys:
        fields_of.setdefault(task_id, []).append(field)
    products: dict[tuple[str, ...], list[str]] = {}
    for task_id, fields in fields_of.items():
        products.setdefault(tuple(dict.fromkeys(fields)), []).append(task_id)
    return products


def key_products(node: str, sizes: dict[ShardKey, int], max_bytes: int, max_keys: int) -> list[Product]:
    """Fetch requests for explicit keys on `node`: a product per field set, cut to the request
    bounds (by bytes too when the sizes are known; 0 for unknown)."""
    requests: list[Product] = []
    for fields, task_ids in tasks_by_fields(sizes).items():
        per_task = np.asarray([sum(sizes[ShardKey(t, f)] for f in fields) for t in task_ids], dtype=np.int64)
        cuts = cut_points(per_task, max_bytes, max(1, max_keys // len(fields)))
        requests += [(node, task_ids[a:b], list(fields), None) for a, b in zip(cuts, cuts[1:])]
    return requests


def plan_refs(refs: Iterable[Any]) -> tuple[list[tuple[str, ShardKey]], dict[str, dict[ShardKey, int]]]:
    """Checked refs as (node, key) in the order asked, and each node's keys with their sizes."""
    order: list[tuple[str, ShardKey]] = []
    per_node: dict[str, dict[ShardKey, int]] = defaultdict(dict)
    nodes: dict[str, str] = {}  # validate each distinct node once, not once per shard
    for ref in refs:
        if type(ref) is not ShardRef:
            ref = ShardRef(*ref)
        node = nodes.get(ref.node) if isinstance(ref.node, str) else None
        if node is None:
            node = nodes[ref.node] = validate_node(ref.node)
        key = validate_key((ref.task_id, ref.field))
        order.append((node, key))
        per_node[node][key] = ref.nbytes or 0
    return order, dict(per_node)


def product_body(task_ids: list[str], fields: list[str], generations: list[int] | None) -> dict[str, Any]:
    """A fetch request naming a product (and the generations it was made for, if known: one
    number when every task's is the same, the usual product of one put). The answer gives the
    number of its task ids, not the ids again (`answer_ids: false`): they are these."""
    body: dict[str, Any] = {"task_ids": task_ids, "fields": fields, "answer_ids": False}
    if generations is not None:
        same = bool(generations) and min(generations) == max(generations)
        body["generations"] = generations[0] if same else generations
    return body


def _generations(value: Any, count: int) -> list[int] | None:
    """Per-task generations as a list of `count` ints (None stays None)."""
    if value is None:
        return None
    out = np.asarray(value, dtype=np.int64).reshape(-1).tolist()
    if len(out) != count:
        raise InvalidArgumentError(f"{len(out)} generations for {count} tasks")
    return out


def check_products(requests: Iterable[ProductRequest]) -> list[Product]:
    """`(node, task_ids, fields[, generations])` requests with every id checked."""
    out: list[Product] = []
    for node, ids, fields, *rest in requests:
        task_ids = wire.validate_id_list(list(ids))
        generations = _generations(rest[0] if rest else None, len(task_ids))
        out.append((validate_node(node), task_ids, wire.validate_id_list(list(fields), "field"), generations))
    return out


DeleteProduct = tuple[list[str], list[str], list[int] | None]
"""`(task_ids, fields, generations)`: one product to delete on a node (generations as for `Product`)."""


def check_product_plan(
    plan: Mapping[
        str, Iterable[tuple[Sequence[str], Sequence[str]] | tuple[Sequence[str], Sequence[str], Any]]
    ],
) -> dict[str, list[DeleteProduct]]:
    """Per node, `(task_ids, fields[, generations])` products with every id checked."""
    out: dict[str, list[DeleteProduct]] = {}
    for node, products in plan.items():
        checked = out[validate_node(node)] = []
        for ids, fields, *rest in products:
            task_ids = wire.validate_id_list(list(ids))
            generations = _generations(rest[0] if rest else None, len(task_ids))
            checked.append((task_ids, wire.validate_id_list(list(fields), "field"), generations))
    return out
