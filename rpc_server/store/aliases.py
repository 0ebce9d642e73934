"""Shared values: a put's tasks that share another task's value (a GRPO group's prompt or image)
point at that value's row instead of storing a copy (`RawColumn.alias`).

Checked before anything changes, then applied after the put's columns: each sharing task's
index entry names the same segment row as the task it shares, and the row counts how many tasks
it is the value of (`Segment.refs`), so deleting any one task's value (a clear of a slice, of a
chunk) is exact, and the bytes go with the last. Nothing here locks: the store calls it with
its lock held.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from distbatch.ids import ShardKey
from distbatch.wire.bundle import LAYER_MARK, Bundle, column_field
from rpc_server.errors import MissingShardsError, SharedValueError
from rpc_server.store.columns import MAX_MISSING_LISTED
from rpc_server.store.index import ShardIndex


def check_aliases(index: ShardIndex, bundles: Sequence[Bundle]) -> None:
    """Every shared value must exist once `bundles` (a put, or a staged put's parts, whose
    columns are all applied before any shared value) are: the task shared is covered by the same
    field's column in one of them, or holds the field already; it does not itself share a value;
    no task is both given a value and made to share one. `MissingShardsError` names the tasks
    that would share nothing, `SharedValueError` the rest; nothing changes."""
    if not any(c.alias is not None for b in bundles for c in b.columns.values()):
        return  # the usual put: nothing shared, nothing to look at per task
    covered: dict[str, set[str]] = {}
    for bundle in bundles:
        for key, column in bundle.columns.items():
            rows = range(len(bundle.task_ids)) if column.rows is None else column.rows.tolist()
            covered.setdefault(column_field(key), set()).update(bundle.task_ids[i] for i in rows)
    missing: list[ShardKey] = []
    count = 0
    for bundle in bundles:
        for key, column in bundle.columns.items():
            if column.alias is None or not len(column.alias):
                continue
            if LAYER_MARK in key or column.append is not None:
                raise SharedValueError(f"field {key!r}: a column that appends cannot share values")
            sources = column.alias_of or []
            members = {bundle.task_ids[i] for i in column.alias.tolist()}
            if not members.isdisjoint(sources):
                raise SharedValueError(f"field {key!r}: a task shares the value of a task that shares one")
            here = covered[key]
            if not members.isdisjoint(here):
                raise SharedValueError(f"field {key!r}: a task is given a value and made to share one")
            unknown = [t for t in dict.fromkeys(sources) if t not in here]
            held = index.locate(key, index.rows.lookup(unknown)) >= 0 if unknown else np.zeros(0, bool)
            absent = [t for t, ok in zip(unknown, held.tolist()) if not ok]
            count += len(absent)
            missing += [ShardKey(t, key) for t in absent[: max(MAX_MISSING_LISTED - len(missing), 0)]]
    if missing:
        raise MissingShardsError(missing, count)
