"""Extending a batch's tensor fields along dim 0: a partial rollout grows chunk by chunk.

A REMOTE batch sends only the new rows, each to the worker that holds the task's value, which
appends them there (`rpc_server.store.appends`): the prefix never travels again. Each request
names the generation of the value it extends, so an extend through a stale handle (or a retry
of one that already landed) is refused instead of applied twice. A LOCAL batch concatenates in
place of the worker. Either way the result is a new batch; the extended fields are ragged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from distbatch.batch.columns import Column, column_shapes, export_bundle, pack_column, schema_of, take_column
from distbatch.batch.meta import BatchMeta, FieldMeta, pick
from distbatch.batch.ragged import RaggedViews
from distbatch.batch.remote import RemoteColumns
from distbatch.client.default import default_client
from distbatch.client.results import PutResult
from distbatch.errors import InvalidArgumentError
from distbatch.twins import Twin
from distbatch.wire.shapes import RowShapes, exclusive_cumsum, ragged_positions


def local_field_meta(name: str, col: Column) -> FieldMeta:
    """A LOCAL column's dtype and per-task shapes."""
    fm = schema_of({name: col})[name]
    shapes = column_shapes(col)
    return FieldMeta(fm.dtype, np.zeros(len(shapes), dtype=np.int32), shapes, fm.ragged)


def check_extension(name: str, held: FieldMeta, tails: FieldMeta) -> tuple[int, ...]:
    """The trailing dims both share; `InvalidArgumentError` (nothing sent) unless `tails` can
    extend `held`: tensors of one dtype, at least one dimension, the same trailing dims."""
    if held.dtype is None or tails.dtype is None:
        raise InvalidArgumentError(
            f"field {name!r}: only tensor fields can be extended (JSON values are replaced)"
        )
    if held.dtype != tails.dtype:
        raise InvalidArgumentError(
            f"field {name!r} is {held.dtype}; the rows to extend it with are {tails.dtype}"
        )
    tail, extra = held.shapes.packable(), tails.shapes.packable()
    if tail is None or extra is None or (len(held.shapes) and len(tails.shapes) and tail != extra):
        raise InvalidArgumentError(
            f"field {name!r}: values extend along dim 0, so both the held values and the new rows need "
            f"at least one dimension and the same trailing dims (held {_tails(held)}, new {_tails(tails)})"
        )
    return tail if len(held.shapes) else extra


def _tails(fm: FieldMeta) -> str:
    tail = fm.shapes.packable()
    return "mixed" if tail is None else str(list(tail))


def extended_meta(name: str, held: FieldMeta, tails: FieldMeta, tail: tuple[int, ...]) -> FieldMeta:
    """`held` grown by `tails` (same tasks, same nodes): ragged, its lengths added."""
    lengths = held.shapes.first_dims() + tails.shapes.first_dims()
    return FieldMeta(held.dtype, held.nodes, RowShapes.ragged(lengths, tail), True, held.generations)


async def extend_remote(
    twin: Twin, remote: RemoteColumns, tails: Mapping[str, Column], tail_meta: Mapping[str, FieldMeta]
) -> RemoteColumns:
    """Append `tails` (per field, one row per task of `remote`) on the workers holding the values;
    the batch over the grown values, under the generations the appends stored."""
    meta = remote.meta
    names = list(tails)
    grown = {
        name: extended_meta(
            name,
            meta.fields[name],
            tail_meta[name],
            check_extension(name, meta.fields[name], tail_meta[name]),
        )
        for name in names
    }
    puts: list[tuple[str, np.ndarray, list[str]]] = []
    bundles = []
    for node, products in meta.plan(names).items():
        for rows, fields in products:
            columns = {f: take_column(tails[f], rows) for f in fields}
            # Each task's own rows, even where one tensor object is several tasks' rows.
            bundle, _ = export_bundle(pick(meta.task_ids, rows), columns, node, same_tensors=False)
            for f in fields:
                known = meta.fields[f].generations
                bundle.columns[f].append = np.zeros(len(rows), np.int64) if known is None else known[rows]
            puts.append((node, rows, fields))
            bundles.append((node, bundle))
    client = remote.client or default_client()
    results: list[PutResult] = await twin.call(client.put_bundles, client.aput_bundles, bundles)
    for (_, rows, fields), result in zip(puts, results):
        for f in fields:
            fm = grown[f]
            if fm.generations is None:
                fm.generations = np.zeros(len(meta.task_ids), dtype=np.int64)
            else:
                fm.generations = fm.generations.copy()
            fm.generations[rows] = result.generation
    out = BatchMeta(list(meta.task_ids), list(meta.nodes), {**meta.fields, **grown})
    return RemoteColumns(out, remote.client, remote.cache.select(set(meta.fields) - set(names)))


def extend_local(
    held: Mapping[str, Column], tails: Mapping[str, Column], metas: Sequence[tuple[str, FieldMeta, FieldMeta]]
) -> dict[str, Column]:
    """LOCAL columns grown by `tails`: per field, every task's value followed by its new rows,
    built with two scatters over the packed values (no step per task)."""
    out = dict(held)
    for name, held_meta, tail_meta in metas:
        tail = check_extension(name, held_meta, tail_meta)
        old, _ = pack_column(name, held[name])
        new, _ = pack_column(name, tails[name])
        old_lengths, new_lengths = held_meta.shapes.first_dims(), tail_meta.shapes.first_dims()
        lengths = old_lengths + new_lengths
        starts = exclusive_cumsum(lengths)
        like = old if len(old_lengths) else new
        values = torch.empty((int(lengths.sum()), *tail), dtype=like.dtype, device=like.device)
        values[torch.from_numpy(ragged_positions(starts, old_lengths))] = old.reshape(-1, *tail)
        values[torch.from_numpy(ragged_positions(starts + old_lengths, new_lengths))] = new.reshape(-1, *tail)
        out[name] = RaggedViews.of(values, lengths)
    return out
