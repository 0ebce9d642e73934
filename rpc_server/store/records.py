"""What crosses the store's edge besides bundles: a put's receipt, the stats, single shards in.

Separate from the store's machinery so that callers (the engine host, the routes, tests) name
these plain values without reaching into segments or indexes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from distbatch.wire.bundle import Bundle, RawColumn
from distbatch.wire.container import RawTensor, parts_size
from distbatch.wire.shapes import RowShapes
from rpc_server.errors import ReplacedShardsError


@dataclass(frozen=True, slots=True)
class StoreStats:
    shards: int
    tasks: int
    bytes: int
    capacity: int | None
    staged_bytes: int = 0
    evicted_shards: int = 0
    evicted_bytes: int = 0
    held_bytes: int = 0
    segments: int = 0
    shared_bytes: int = 0
    shared_regions: int = 0
    on_disk_bytes: int = 0
    spilled_bytes: int = 0
    read_back_shards: int = 0
    read_back_bytes: int = 0

    @property
    def memory_bytes(self) -> int:
        """Live bytes held in memory (what capacity counts): those not spilled to disk."""
        return self.bytes - self.on_disk_bytes

    def as_dict(self) -> dict[str, int | None]:
        return {
            "staged_bytes": self.staged_bytes,
            "evicted_shards": self.evicted_shards,
            "evicted_bytes": self.evicted_bytes,
            "shards": self.shards,
            "tasks": self.tasks,
            "bytes": self.bytes,
            "live_bytes": self.bytes,
            "held_bytes": self.held_bytes,
            "segments": self.segments,
            "shared_bytes": self.shared_bytes,
            "shared_regions": self.shared_regions,
            "memory_bytes": self.memory_bytes,
            "on_disk_bytes": self.on_disk_bytes,
            "spilled_bytes_total": self.spilled_bytes,
            "read_back_shards_total": self.read_back_shards,
            "read_back_bytes_total": self.read_back_bytes,
            "capacity": self.capacity,
            "free": None if self.capacity is None else self.capacity - self.memory_bytes - self.staged_bytes,
        }


# A 409 for replaced shards lists at most this many (and says how many there are).
MAX_REPLACED_LISTED = 100


class ReplacedValues:
    """Values a later put replaced, gathered field by field, for one `ReplacedShardsError`."""

    def __init__(self) -> None:
        self.listed: list[tuple[str, str, int, int]] = []
        self.count = 0

    def add(
        self, task_ids: Sequence[str], name: str, at: np.ndarray, stored: np.ndarray, asked: np.ndarray
    ) -> None:
        """Field `name` of the tasks at positions `at` holds `stored`, not the `asked` generation."""
        self.count += len(at)
        room = max(MAX_REPLACED_LISTED - len(self.listed), 0)
        for i, held in zip(at[:room].tolist(), stored[:room].tolist()):
            self.listed.append((task_ids[i], name, held, int(asked[i])))

    def raise_if_any(self, what: str) -> None:
        if self.count:
            raise ReplacedShardsError(self.listed, self.count, what)


class PutReceipt(NamedTuple):
    """What one put stored: counts, its segments by id (not the data, so holding a receipt
    holds no memory; `delete_put` deletes the rows still in those segments), and the put's
    generation, which its values carry: a batch handle names it so that a later put of the
    same keys is told apart."""

    stored: int
    bytes: int
    segments: tuple[tuple[str, int], ...]
    generation: int = 0


def bundle_from_raw(shards: Mapping[Any, Any]) -> Bundle:
    """`{(task_id, field): RawTensor | JSON value}` as a bundle (no torch; one step per shard).

    For callers that hold single shards (tests, tools); the data path uses bundles.
    """
    task_index: dict[str, int] = {}
    by_field: dict[str, list[tuple[int, Any]]] = {}
    for (task_id, field), value in shards.items():
        row = task_index.setdefault(task_id, len(task_index))
        by_field.setdefault(field, []).append((row, value))
    columns: dict[str, RawColumn] = {}
    for field, items in by_field.items():
        rows = np.asarray([r for r, _ in items], dtype=np.int64)
        column = _raw_column(field, [v for _, v in items])
        if not np.array_equal(rows, np.arange(len(task_index))):
            column.rows = rows
        columns[field] = column
    return Bundle(list(task_index), columns)


def _raw_column(field: str, values: list[Any]) -> RawColumn:
    """One field's single values as a column: a tensor column if every value is a `RawTensor`."""
    if not all(isinstance(v, RawTensor) for v in values):
        return RawColumn(None, values=values)
    dtypes = {v.dtype for v in values}
    if len(dtypes) > 1:
        raise ValueError(f"field {field!r} mixes dtypes {sorted(dtypes)}")
    parts = [v.data for v in values]
    return RawColumn(
        values[0].dtype, RowShapes.from_list([v.shape for v in values]), parts, parts_size(parts)
    )
