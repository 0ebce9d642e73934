"""A REMOTE batch's state: where its shards are, the client that reaches them, what it gathered.

Owns `RemoteColumns` (metadata, client, cache) and its rearrangements: taking rows, selecting
fields, unions and concatenation move metadata and whatever is already cached, never a byte
on the workers. Separate from the batch object, which checks the arguments and picks the
LOCAL or REMOTE path, and from `gather`, which fetches what the cache lacks.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from distbatch.batch.columns import Column, concat_columns, pack_column, take_column
from distbatch.batch.gather import Gathered
from distbatch.batch.meta import BatchMeta, pick
from distbatch.client.planning import DeleteProduct
from distbatch.client.shard_client import ShardClient
from distbatch.errors import InvalidArgumentError


class FieldCache:
    """The fields a REMOTE batch has gathered: per field a column, or a `Gathered` not yet split
    into per-task views (what `packed` and `afetch` leave; `column` splits it once).

    `lock` guards the entries. Blocking reads hold it while they gather, so threads that want
    the same field gather it once; it is reentrant because that gather stores under it too.
    """

    def __init__(self, entries: Mapping[str, Column | Gathered] | None = None) -> None:
        self.entries: dict[str, Column | Gathered] = dict(entries or {})
        self.lock = threading.RLock()

    def missing(self, names: Sequence[str]) -> list[str]:
        return [name for name in names if name not in self.entries]

    def store(self, gathered: Mapping[str, Column | Gathered]) -> None:
        """Keep what a gather brought; a field another thread stored first stays as it is."""
        with self.lock:
            for name, value in gathered.items():
                self.entries.setdefault(name, value)

    def column(self, name: str) -> Column:
        """A cached field as a column, splitting a gathered one into per-task views once."""
        with self.lock:
            value = self.entries[name]
            if isinstance(value, Gathered):
                value = self.entries[name] = value.column()
            return value

    def columns(self, names: Sequence[str]) -> dict[str, Column]:
        """The cached fields `names` as columns."""
        with self.lock:
            return {name: self.column(name) for name in names}

    def packed(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """`packed()` of a cached field: straight from the gathered buffer when not split yet."""
        value = self.entries[name]
        if isinstance(value, Gathered):
            return value.packed(name)
        return pack_column(name, value)

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()

    def select(self, keep: Collection[str]) -> FieldCache:
        """A cache of the entries in `keep` (shared: entries are replaced, never changed)."""
        return FieldCache({name: value for name, value in self.entries.items() if name in keep})

    def without(self, drop: Collection[str]) -> dict[str, Column | Gathered]:
        return {name: value for name, value in self.entries.items() if name not in drop}

    def taken(self, rows: np.ndarray | None) -> dict[str, Column | Gathered]:
        """The entries at batch `rows` (None: all rows, as they are)."""
        with self.lock:
            if rows is None:
                return dict(self.entries)
            columns = {name: self.column(name) for name in list(self.entries)}
            return {name: take_column(col, rows) for name, col in columns.items()}

    @staticmethod
    def concat(caches: Sequence[FieldCache], names: Sequence[str]) -> FieldCache:
        """The cache of concatenated batches: a field only where every batch has it cached."""
        out: dict[str, Column | Gathered] = {}
        for name in names:
            columns = []
            for cache in caches:
                with cache.lock:
                    if name in cache.entries:
                        columns.append(cache.column(name))
            if len(columns) == len(caches):
                out[name] = concat_columns(name, columns)
        return FieldCache(out)


class RemoteColumns:
    """Where a REMOTE batch's shards live (`meta`), the client that reaches them (None: the
    process-wide one) and the fields gathered so far (`cache`)."""

    def __init__(self, meta: BatchMeta, client: ShardClient | None, cache: FieldCache | None = None) -> None:
        self.meta = meta
        self.client = client
        self.cache = cache if cache is not None else FieldCache()

    def take(self, rows: np.ndarray) -> RemoteColumns:
        return RemoteColumns(self.meta.take(rows), self.client, FieldCache(self.cache.taken(rows)))

    def select(self, names: list[str]) -> RemoteColumns:
        return RemoteColumns(self.meta.select_fields(names), self.client, self.cache.select(names))

    def union(self, other: RemoteColumns, rows: np.ndarray | None, order: Sequence[str]) -> RemoteColumns:
        """These fields and `other`'s (which win a clash, taken at `rows` unless aligned: None)."""
        parts = [(self.meta, None), (other.meta, rows)]
        meta = BatchMeta.merge(list(self.meta.task_ids), parts, order)
        cache = FieldCache({**self.cache.without(other.meta.fields), **other.cache.taken(rows)})
        return RemoteColumns(meta, self.client or other.client, cache)

    @staticmethod
    def concat(parts: Sequence[RemoteColumns], names: Sequence[str]) -> RemoteColumns:
        """The tasks of `parts` one after another, their fields `names` (checked to be the same)."""
        metas = [part.meta for part in parts]
        for name in names:
            dtypes = {m.fields[name].dtype for m in metas}
            if len(dtypes) > 1:
                raise InvalidArgumentError(f"field {name!r} has different dtypes across batches: {dtypes}")
        meta = BatchMeta.concat([m.select_fields(names) for m in metas])
        return RemoteColumns(meta, parts[0].client, FieldCache.concat([p.cache for p in parts], names))

    def row(self, index: int, fetched: Mapping[str, Any]) -> dict[str, Any]:
        """Task `index`'s values, field by field: from `fetched` (gathered for this row alone)
        where it has the field, else from the cache."""
        with self.cache.lock:
            cached = {f: self.cache.column(f)[index] for f in self.meta.fields if f not in fetched}
        return {f: fetched[f] if f in fetched else cached[f] for f in self.meta.fields}

    def delete_plan(self) -> dict[str, list[DeleteProduct]]:
        """Per node, the (task ids, fields, generations) products that delete every shard the
        batch names (and no value a later put of the same keys stored)."""
        meta = self.meta
        return {
            node: [
                (pick(meta.task_ids, rows), names, meta.fields[names[0]].generations_at(rows))
                for rows, names in products
            ]
            for node, products in meta.plan(list(meta.fields)).items()
        }
