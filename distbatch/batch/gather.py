"""Gathering a REMOTE batch's fields: fetching them through the client, in task order.

Owns the read path: a `FetchPlan`'s requests sent through the client (with a progress bar
for a big blocking gather), the responses put in batch order as one `Gathered` per field
(zero-copy when they already are in order), and joins into the client's recycled receive
buffers. Separate from the batch, which decides what to gather and keeps what was gathered:
this module turns the workers' responses into columns.
"""

from __future__ import annotations

import itertools
import operator
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from distbatch import wire
from distbatch.batch.columns import Column, pack_rows
from distbatch.batch.meta import BatchMeta, pick
from distbatch.batch.ragged import RaggedViews
from distbatch.client.fetches import gather_lost
from distbatch.client.planning import Product, cut_points
from distbatch.client.shard_client import ShardClient
from distbatch.errors import InvalidArgumentError, WireFormatError, WorkerUnavailableError
from distbatch.gc_pause import paused_gc
from distbatch.twins import Twin
from distbatch.wire.shapes import RowShapes

Allocate = Callable[[int], Any]


def reorder(items: list[Any], order: np.ndarray) -> list[Any]:
    """`items` placed so that item k lands at position order[k]."""
    if len(items) <= 1:
        return list(items)
    return list(operator.itemgetter(*np.argsort(order, kind="stable").tolist())(items))


def join(tensors: Sequence[torch.Tensor], allocate: Allocate | None) -> torch.Tensor:
    """One flat tensor of `tensors` (the tensor itself when there is one): joined into a buffer
    from `allocate` (the client's recycled receive buffers) when given, else into fresh memory."""
    if len(tensors) == 1:
        return tensors[0]
    if not tensors:
        return torch.empty(0)
    total = sum(t.numel() for t in tensors)
    nbytes = total * tensors[0].element_size()
    if allocate is None or not nbytes:
        return torch.cat(list(tensors))
    out = torch.frombuffer(allocate(nbytes), dtype=tensors[0].dtype, count=total)
    return torch.cat(list(tensors), out=out)


class Gathered:
    """One field gathered from the workers, in task order: JSON values, or the flat tensors of
    every task's elements (one per response, in order) plus their shapes: the columnar form
    both views come from. A ragged column's per-task views point into the responses, so
    several responses are never joined just to be split again."""

    __slots__ = ("pieces", "piece_shapes", "shapes", "json", "allocate", "ragged")

    def __init__(
        self,
        pieces: list[torch.Tensor],
        piece_shapes: list[RowShapes],
        json: list[Any] | None = None,
        allocate: Allocate | None = None,
    ) -> None:
        self.pieces, self.piece_shapes, self.json = pieces, piece_shapes, json
        self.shapes = RowShapes.concat(piece_shapes) if json is None else None
        # Where joined responses go (the client's recycled receive buffers, already mapped in,
        # so the one copy a join costs is not also a page fault per 4 KiB).
        self.allocate = allocate
        self.ragged = False  # the field's kind: a list of per-task views even when shapes agree

    @staticmethod
    def assemble(
        name: str,
        n: int,
        pieces: list[tuple[np.ndarray, wire.RawColumn]],
        allocate: Allocate | None = None,
        ragged: bool = False,
    ) -> Gathered:
        """Put the responses' columns (each covering some batch rows) in batch order.

        Responses that cover the batch in order are used as they are (zero-copy); rows
        interleaved across nodes cost one gather. `ragged` is the field's kind (its metadata's).
        """
        gathered = Gathered._assemble(name, n, pieces, allocate)
        gathered.ragged = ragged
        return gathered

    @staticmethod
    def _assemble(
        name: str, n: int, pieces: list[tuple[np.ndarray, wire.RawColumn]], allocate: Allocate | None
    ) -> Gathered:
        order = np.concatenate([rows for rows, _ in pieces]) if pieces else np.zeros(0, dtype=np.int64)
        in_order = bool(np.array_equal(order, np.arange(n)))
        if pieces[0][1].dtype is None:
            values = [v for _, column in pieces for v in column.values or []]
            return Gathered([], [], values if in_order else reorder(values, order))
        dtypes = {column.dtype for _, column in pieces}
        if len(dtypes) > 1:
            raise WireFormatError(
                f"field {name!r} came back with different dtypes {sorted(map(str, dtypes))}"
            )
        flats = [wire.column_tensor(column).reshape(-1) for _, column in pieces]
        piece_shapes = [column.tensor_shapes for _, column in pieces]
        if in_order:
            return Gathered(flats, piece_shapes, allocate=allocate)
        # Rows interleaved across responses: each row is copied once, from its response straight
        # to its place (not joined first and reordered after: two copies of every byte).
        shapes = RowShapes.concat(piece_shapes)
        back = np.argsort(order, kind="stable")
        if shapes.shape is not None:  # equal rows: one index_copy_ per response
            width = int(np.prod(shapes.shape))
            if not width:  # rows of no elements
                return Gathered([flats[0].new_empty(0)], [shapes.take(back)])
            total = n * width
            nbytes = total * flats[0].element_size()
            out = (
                torch.frombuffer(allocate(nbytes), dtype=flats[0].dtype, count=total)
                if allocate is not None and nbytes
                else torch.empty(total, dtype=flats[0].dtype)
            ).view(-1, width)
            for (rows, _), piece in zip(pieces, flats):
                if len(rows):
                    out.index_copy_(0, torch.from_numpy(rows), piece.view(-1, width))
            return Gathered([out.reshape(-1)], [shapes.take(back)])
        views = list(
            itertools.chain.from_iterable(
                torch.split(piece, ps.counts().tolist()) for piece, ps in zip(flats, piece_shapes)
            )
        )
        flat = join(reorder(views, order), allocate) if views else join(flats, allocate)
        return Gathered([flat], [shapes.take(back)])

    def flat(self) -> torch.Tensor:
        """Every task's elements in one tensor (joins several responses: one copy)."""
        return join(self.pieces, self.allocate)

    def column(self) -> Column:
        """The column as `batch[field]` gives it: stacked for a fixed-shape field, a list of
        per-task views for a ragged one (`RaggedViews` when they are views of one response)."""
        if self.json is not None:
            return list(self.json)
        shapes = self.tensor_shapes
        if shapes.shape is not None and not self.ragged:
            return self.flat().view(shapes.n, *shapes.shape)
        tail = shapes.packable()
        if len(self.pieces) == 1 and tail is not None:  # views of one buffer, which packed() reuses
            lengths = shapes.first_dims()
            return RaggedViews.of(self.pieces[0].reshape(int(lengths.sum()), *tail), lengths)
        with paused_gc():  # one tensor per task: no collection passes over them mid-build
            return [
                view
                for piece, shapes in zip(self.pieces, self.piece_shapes)
                for view in wire.split_rows(piece, shapes)
            ]

    def packed(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self.json is not None:
            raise InvalidArgumentError(f"field {name!r} holds JSON values; packed() needs a tensor field")
        return pack_rows(name, self.flat(), self.tensor_shapes)

    @property
    def tensor_shapes(self) -> RowShapes:
        """Every task's shape (a JSON field has none)."""
        if self.shapes is None:
            raise InvalidArgumentError("a JSON field has no shapes")
        return self.shapes


# ----------------------------------------------------------------------------- fetching


@dataclass(frozen=True)
class FetchPlan:
    """What gathering `names` of the batch `meta` describes asks the workers: one
    `(node, task_ids, fields)` request per node and field set (cut to the client's bounds),
    and the batch rows each request covers."""

    meta: BatchMeta
    names: list[str]
    requests: list[Product]
    placed: list[np.ndarray]


def plan_fetch(meta: BatchMeta, names: Sequence[str], client: ShardClient) -> FetchPlan | None:
    """The requests that gather `names` (per node and field set, cut to the client's bounds)
    and the batch rows each covers; None when there is nothing to fetch."""
    if not names:
        return None
    requests: list[Product] = []
    placed: list[np.ndarray] = []  # the batch rows each request covers
    for node, products in meta.plan(list(names)).items():
        max_bytes = client.request_bytes_bound(node)
        for rows, fields in products:
            per_task = sum(meta.fields[f].row_nbytes()[rows] for f in fields)
            cuts = cut_points(per_task, max_bytes, client.max_keys_per_request)
            for a, b in zip(cuts, cuts[1:]):
                chunk = rows[a:b]
                gens = meta.fields[fields[0]].generations_at(chunk)
                requests.append((node, pick(meta.task_ids, chunk), fields, gens))
                placed.append(chunk)
    return FetchPlan(meta, list(names), requests, placed)


async def fetch(
    twin: Twin, client: ShardClient, plan: FetchPlan, progress_min_bytes: int
) -> dict[str, Gathered]:
    """Every field `plan` names, nodes concurrently, each one `Gathered` in task order.

    The blocking form shows a progress bar for a gather of `progress_min_bytes` or more that
    a person watches; the awaited form never shows one.
    """
    bar = progress_bar(plan, progress_min_bytes) if twin.blocking else None
    try:
        bundles = await twin.call(
            client._fetch_planned,  # noqa: SLF001 (the batch's own plan, from checked metadata)
            client._afetch_planned,  # noqa: SLF001
            plan.requests,
            progress=bar.update if bar is not None else None,
        )
    except WorkerUnavailableError as exc:
        raise lost_to(exc, plan) from exc
    finally:
        if bar is not None:
            bar.close()
    return assemble(plan, bundles, client.receive_buffer)


def lost_to(error: WorkerUnavailableError, plan: FetchPlan) -> WorkerUnavailableError:
    """`error` (a worker the gather could not reach) said for the gather: which of the batch's
    tasks and fields that worker held (what the gather lost)."""
    held = [(ids, fields) for node, ids, fields, _ in plan.requests if node == error.node]
    tasks = [t for ids, _ in held for t in ids]
    fields = sorted({f for _, names in held for f in names})
    return gather_lost(error, len(plan.meta), tasks, fields)


def progress_bar(plan: FetchPlan, min_bytes: int) -> Any:
    """A tqdm bar for a big gather when a person is watching (stderr is a terminal), else None."""
    meta = plan.meta
    total = meta.select_fields(plan.names).total_bytes()
    if total < min_bytes or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=f"gather {len(meta)} tasks")


def assemble(plan: FetchPlan, bundles: list[wire.Bundle], allocate: Allocate | None) -> dict[str, Gathered]:
    """The responses to `plan`'s requests as one `Gathered` per field, in batch order."""
    pieces: dict[str, list[tuple[np.ndarray, wire.RawColumn]]] = {name: [] for name in plan.names}
    for (node, _, fields, _), rows, bundle in zip(plan.requests, plan.placed, bundles):
        for name in fields:
            column = bundle.columns.get(name)
            if column is None or column.rows is not None:
                raise WireFormatError(
                    f"{node}: field {name!r} came back in several dtypes; the batch's metadata "
                    f"says {plan.meta.fields[name].dtype}"
                )
            pieces[name].append((rows, column))
    n = len(plan.meta)
    return {
        name: Gathered.assemble(name, n, pieces[name], allocate, plan.meta.fields[name].ragged)
        for name in plan.names
    }
