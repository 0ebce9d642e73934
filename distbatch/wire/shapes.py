"""Per-task shapes of one field, held as numpy arrays instead of one tuple per task.

Three layouts, the most compact that fits is always used:

- **uniform**: every task has the same shape (a fixed-shape field: rewards, a padded batch);
- **ragged**: every task has at least one dimension, the same trailing dimensions, and its
  own first dimension (sequences: `input_ids`, `logprobs`); held as one int64 length per task;
- **general**: anything else (different ranks, different trailing dimensions); held as an
  int64 `(n, max_rank)` table of dimensions and one rank per task.

Everything here is numpy only (no torch), so the worker's store and the wire use it too;
every operation is vectorised over tasks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from distbatch.errors import ShapeError

MAX_DIMS = 64
# The most elements one task's shape may span (zero dims counted as 1), checked in float64:
# under int64's limit with room to spare for rounding, and far past any real tensor.
MAX_SPAN = float(2**62)
MAX_INDEX = 2**63 - 1  # the most elements (zero dims counted as 1) a tensor may span


def _as_index_array(values: Any, what: str) -> np.ndarray:
    array = np.asarray(values)
    if array.dtype.kind not in "iu":
        if array.size == 0:
            return np.zeros(array.shape, dtype=np.int64)
        raise ShapeError(f"{what} must be integers")
    array = array.astype(np.int64, copy=False)
    if array.size and int(array.min()) < 0:
        raise ShapeError(f"{what} must be non-negative")
    return array


class RowShapes:
    """The shape of one field for each of `n` tasks (see the module docstring for layouts)."""

    __slots__ = ("n", "shape", "tail", "lengths", "ranks", "dims")

    def __init__(
        self,
        n: int,
        *,
        shape: tuple[int, ...] | None = None,
        tail: tuple[int, ...] | None = None,
        lengths: np.ndarray | None = None,
        ranks: np.ndarray | None = None,
        dims: np.ndarray | None = None,
    ) -> None:
        self.n = n
        self.shape = shape  # uniform
        self.tail = tail  # ragged: trailing dims, with `lengths`
        self.lengths = lengths
        self.ranks = ranks  # general: rank per task, with `dims` (n, max_rank), zero padded
        self.dims = dims

    # ------------------------------------------------------------------ constructors

    @classmethod
    def uniform(cls, n: int, shape: Sequence[int]) -> RowShapes:
        shape = tuple(int(d) for d in shape)
        if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
            raise ShapeError(f"bad shape {shape}")
        if math.prod(max(d, 1) for d in (n, *shape)) > MAX_INDEX:  # torch's own limit, exactly
            raise ShapeError(f"{n} tasks of shape {shape} span too many elements")
        return cls(n, shape=shape)

    @classmethod
    def ragged(cls, lengths: Any, tail: Sequence[int] = ()) -> RowShapes:
        """First dimension per task (`lengths`), the same trailing dims for all."""
        lengths = _as_index_array(lengths, "lengths").reshape(-1)
        tail = tuple(int(d) for d in tail)
        if len(tail) + 1 > MAX_DIMS or any(d < 0 for d in tail):
            raise ShapeError(f"bad trailing shape {tail}")
        total = float(lengths.sum(dtype=np.float64)) if len(lengths) else 0.0
        if max(total, 1.0) * math.prod(max(d, 1) for d in tail) >= MAX_SPAN:
            raise ShapeError("the tasks' shapes span too many elements")
        return cls(len(lengths), tail=tail, lengths=lengths).normalized()

    @classmethod
    def general(cls, ranks: Any, dims: Any) -> RowShapes:
        ranks = _as_index_array(ranks, "ranks").reshape(-1)
        dims = _as_index_array(dims, "dims")
        if dims.ndim != 2 or dims.shape[0] != len(ranks):
            raise ShapeError("dims must be an (n, max_rank) table, one row per task")
        if len(ranks) and int(ranks.max(initial=0)) > dims.shape[1]:
            raise ShapeError("a rank is larger than the dims table is wide")
        if dims.shape[1] > MAX_DIMS:
            raise ShapeError(f"more than {MAX_DIMS} dimensions")
        # Dims past a task's rank must be zero, so equal shapes have equal tables.
        if dims.size and np.any(dims[np.arange(dims.shape[1])[None, :] >= ranks[:, None]]):
            raise ShapeError("dims past a task's rank must be 0")
        # A product past int64 would wrap around (element counts, torch strides): refused.
        if dims.size and float(np.maximum(dims, 1).prod(axis=1, dtype=np.float64).max()) >= MAX_SPAN:
            raise ShapeError("a task's shape spans too many elements")
        return cls(len(ranks), ranks=ranks, dims=dims).normalized()

    @classmethod
    def from_list(cls, shapes: Sequence[Sequence[int]]) -> RowShapes:
        """From one shape per task (the slow, general entry point: one step per task)."""
        n = len(shapes)
        if n == 0:
            return cls.uniform(0, ())
        rank_set = set(map(len, shapes))
        if len(rank_set) == 1:  # one rank: one numpy conversion, then vectorised
            rank = rank_set.pop()
            if rank == 0:
                return cls.uniform(n, ())
            table = np.array(shapes, dtype=np.int64).reshape(n, rank)
            if bool((table == table[0]).all()):
                return cls.uniform(n, tuple(int(d) for d in table[0]))
            if bool((table[:, 1:] == table[0, 1:]).all()):
                return cls.ragged(table[:, 0], tuple(int(d) for d in table[0, 1:]))
            return cls.general(np.full(n, rank, dtype=np.int64), table)
        ranks = np.fromiter((len(s) for s in shapes), dtype=np.int64, count=n)
        width = int(ranks.max())
        if width > MAX_DIMS:
            raise ShapeError(f"more than {MAX_DIMS} dimensions")
        dims = np.zeros((n, width), dtype=np.int64)
        for i, s in enumerate(shapes):
            if len(s):
                dims[i, : len(s)] = s
        return cls.general(ranks, dims)

    # ------------------------------------------------------------------ layout

    @property
    def kind(self) -> str:
        if self.shape is not None:
            return "uniform"
        return "ragged" if self.lengths is not None else "general"

    def normalized(self) -> RowShapes:
        """The most compact layout for the same shapes."""
        n = self.n
        if self.shape is not None:
            return self
        if self.lengths is not None:
            if n == 0 or bool(np.all(self.lengths == self.lengths[0])):
                # Zero tasks keep the trailing dims (an empty batch keeps its schema).
                first = int(self.lengths[0]) if n else 0
                return RowShapes(n, shape=(first, *(self.tail or ())))
            return self
        ranks, dims = self._tables()
        if n == 0:
            return RowShapes(0, shape=())
        if bool(np.all(ranks == ranks[0])) and bool(np.all(dims == dims[0])):
            return RowShapes(n, shape=tuple(int(d) for d in dims[0, : int(ranks[0])]))
        rank = int(ranks[0])
        if rank >= 1 and bool(np.all(ranks == rank)) and bool(np.all(dims[:, 1:rank] == dims[0, 1:rank])):
            return RowShapes(
                n, tail=tuple(int(d) for d in dims[0, 1:rank]), lengths=np.ascontiguousarray(dims[:, 0])
            )
        return self

    def general_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """(ranks, dims) for any layout."""
        n = self.n
        if self.shape is not None:
            width = len(self.shape)
            return np.full(n, width, dtype=np.int64), np.tile(np.asarray(self.shape, dtype=np.int64), (n, 1))
        if self.lengths is not None:
            tail = self.tail or ()
            width = 1 + len(tail)
            dims = np.empty((n, width), dtype=np.int64)
            dims[:, 0] = self.lengths
            if width > 1:
                dims[:, 1:] = tail
            return np.full(n, width, dtype=np.int64), dims
        return self._tables()

    def _tables(self) -> tuple[np.ndarray, np.ndarray]:
        """(ranks, dims) of a general layout, which the constructors always set together."""
        if self.ranks is None or self.dims is None:
            raise ShapeError(f"{self!r} is not a general layout")
        return self.ranks, self.dims

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return iter(self.tolist())

    def row(self, i: int) -> tuple[int, ...]:
        if self.shape is not None:
            return self.shape
        if self.lengths is not None:
            return (int(self.lengths[i]), *(self.tail or ()))
        ranks, dims = self._tables()
        return tuple(int(d) for d in dims[i, : int(ranks[i])])

    def tolist(self) -> list[tuple[int, ...]]:
        if self.shape is not None:
            return [self.shape] * self.n
        if self.lengths is not None:
            tail = tuple(self.tail or ())
            return [(length, *tail) for length in self.lengths.tolist()]
        ranks, dims = self._tables()
        return [tuple(row[:rank]) for row, rank in zip(dims.tolist(), ranks.tolist())]

    def counts(self) -> np.ndarray:
        """Elements per task (int64)."""
        if self.shape is not None:
            return np.full(self.n, math.prod(self.shape), dtype=np.int64)
        if self.lengths is not None:
            return self.lengths * math.prod(self.tail or ())
        ranks, dims = self._tables()
        width = dims.shape[1]
        masked = np.where(np.arange(width)[None, :] < ranks[:, None], dims, 1)
        return masked.prod(axis=1, dtype=np.int64) if width else np.ones(self.n, dtype=np.int64)

    def first_dims(self) -> np.ndarray:
        """Each task's first dimension (1 for a 0-d value): its length, for balancing."""
        if self.shape is not None:
            return np.full(self.n, self.shape[0] if self.shape else 1, dtype=np.int64)
        if self.lengths is not None:
            return self.lengths
        ranks, dims = self._tables()
        if dims.shape[1] == 0:
            return np.ones(self.n, dtype=np.int64)
        return np.where(ranks > 0, dims[:, 0], 1)

    def packable(self) -> tuple[int, ...] | None:
        """The trailing dims if the values concatenate along dim 0 (every task rank >= 1, same tail)."""
        if self.shape is not None:
            return self.shape[1:] if self.shape else None
        if self.lengths is not None:
            return tuple(self.tail or ())
        return None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RowShapes) or other.n != self.n:
            return NotImplemented if not isinstance(other, RowShapes) else False
        if self.n == 0:  # zero tasks have no shapes to differ in
            return True
        a, b = self.normalized(), other.normalized()
        if a.kind != b.kind:
            return False
        if a.shape is not None:
            return a.shape == b.shape
        if a.lengths is not None and b.lengths is not None:  # same kind: both are ragged
            return a.tail == b.tail and bool(np.array_equal(a.lengths, b.lengths))
        ra, da = a.general_tables()
        rb, db = b.general_tables()
        width = max(da.shape[1], db.shape[1])
        da = np.pad(da, ((0, 0), (0, width - da.shape[1])))
        db = np.pad(db, ((0, 0), (0, width - db.shape[1])))
        return bool(np.array_equal(ra, rb)) and bool(np.array_equal(da, db))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        if self.shape is not None:
            return f"RowShapes(n={self.n}, uniform={self.shape})"
        if self.lengths is not None:
            return f"RowShapes(n={self.n}, ragged, tail={self.tail})"
        return f"RowShapes(n={self.n}, general)"

    # ------------------------------------------------------------------ derivation

    def take(self, rows: Any) -> RowShapes:
        """The shapes of the tasks at `rows` (an int array or a slice)."""
        if isinstance(rows, slice):
            n = len(range(*rows.indices(self.n)))
        else:
            rows = np.asarray(rows, dtype=np.int64)
            n = len(rows)
        if self.shape is not None:
            return RowShapes(n, shape=self.shape)
        if self.lengths is not None:
            return RowShapes(n, tail=self.tail, lengths=self.lengths[rows]).normalized()
        ranks, dims = self._tables()
        return RowShapes(n, ranks=ranks[rows], dims=dims[rows]).normalized()

    @staticmethod
    def concat(parts: Sequence[RowShapes]) -> RowShapes:
        """The shapes of `parts`' tasks one after another."""
        if parts and not any(p.n for p in parts):
            return parts[0]
        parts = [p for p in parts if p.n]
        if not parts:
            return RowShapes(0, shape=())
        n = sum(p.n for p in parts)
        if all(p.shape is not None for p in parts) and len({p.shape for p in parts}) == 1:
            return RowShapes(n, shape=parts[0].shape)
        tails = {p.packable() for p in parts}
        if len(tails) == 1 and None not in tails:
            lengths = np.concatenate([p.first_dims() for p in parts])
            return RowShapes(n, tail=next(iter(tails)), lengths=lengths).normalized()
        tables = [p.general_tables() for p in parts]
        width = max(d.shape[1] for _, d in tables)
        ranks = np.concatenate([r for r, _ in tables])
        dims = np.concatenate([np.pad(d, ((0, 0), (0, width - d.shape[1]))) for _, d in tables])
        return RowShapes(n, ranks=ranks, dims=dims).normalized()

    # ------------------------------------------------------------------ JSON (batch metadata)

    def to_json(self) -> Any:
        """Compact JSON: `{"uniform": dims}`, `{"tail": dims, "lengths": [...]}` or a flat
        `[rank, dims..., rank, dims...]` list."""
        if self.shape is not None:
            return {"uniform": list(self.shape)}
        if self.lengths is not None:
            return {"tail": list(self.tail or ()), "lengths": self.lengths.tolist()}
        ranks, dims = self.general_tables()
        width = dims.shape[1]
        flat = np.concatenate([ranks[:, None], dims], axis=1)
        keep = np.arange(width + 1)[None, :] <= ranks[:, None]
        return flat[keep].tolist()

    @classmethod
    def from_json(cls, data: Any, n: int) -> RowShapes:
        """Inverse of `to_json` for `n` tasks; `ShapeError` on anything malformed."""
        if isinstance(data, dict) and set(data) == {"uniform"}:
            dims = data["uniform"]
            if not isinstance(dims, list) or not all(_is_count(d) for d in dims):
                raise ShapeError(f"bad uniform shape {dims!r}")
            return cls.uniform(n, dims)
        if isinstance(data, dict) and set(data) == {"tail", "lengths"}:
            tail, lengths = data["tail"], data["lengths"]
            if not isinstance(tail, list) or not all(_is_count(d) for d in tail):
                raise ShapeError(f"bad trailing shape {tail!r}")
            if not isinstance(lengths, list) or len(lengths) != n:
                raise ShapeError(f"lengths must list {n} counts")
            array = np.asarray(lengths) if lengths else np.zeros(0, dtype=np.int64)
            if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
                raise ShapeError("lengths must be non-negative integers")
            return cls.ragged(array, tail)
        if isinstance(data, list):
            return cls._from_flat(data, n)
        raise ShapeError("shapes must be a flat list or a uniform / tail+lengths object")

    @classmethod
    def _from_flat(cls, flat: list[Any], n: int) -> RowShapes:
        array = np.asarray(flat) if flat else np.zeros(0, dtype=np.int64)
        bad = array.size and (array.dtype.kind not in "iu" or array.min() < 0)
        if array.ndim != 1 or bad:
            raise ShapeError("shapes must be a flat list of non-negative integers")
        array = array.astype(np.int64, copy=False)
        # Walk rank by rank: positions of each task's rank entry (a short loop over ranks
        # would be per task; this is one pass in Python only over the rank positions).
        positions = np.empty(n, dtype=np.int64)
        pos = 0
        total = len(array)
        for i in range(n):
            if pos >= total:
                raise ShapeError("shapes are truncated")
            positions[i] = pos
            rank = int(array[pos])
            if rank > MAX_DIMS:
                raise ShapeError(f"bad rank {rank} in shapes")
            pos += 1 + rank
        if pos != total:
            raise ShapeError("shapes are truncated or hold more entries than there are tasks")
        ranks = array[positions] if n else np.zeros(0, dtype=np.int64)
        width = int(ranks.max(initial=0))
        dims = np.zeros((n, width), dtype=np.int64)
        if width:
            cols = np.arange(width)[None, :]
            mask = cols < ranks[:, None]
            dims[mask] = array[(positions[:, None] + 1 + cols)[mask]]
        return cls.general(ranks, dims)


def unique_ints(values: np.ndarray) -> np.ndarray:
    """The distinct values of an integer array, ascending: a sort and a compare.

    numpy 2's `np.unique` hashes first, which costs several times more on the index arrays
    the store and the wire check (tens of ms for 50k rows, on every delete).
    """
    ordered = np.sort(values, kind="stable")
    if len(ordered) < 2:
        return ordered
    keep = np.empty(len(ordered), dtype=bool)
    keep[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered[keep]


def exclusive_cumsum(values: np.ndarray) -> np.ndarray:
    """Where each of `values` starts when they are laid one after another (int64, from 0)."""
    out = np.zeros(len(values), dtype=np.int64)
    if len(values) > 1:
        np.cumsum(values[:-1], out=out[1:])
    return out


def ragged_positions(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """`starts[i] + 0 .. lengths[i] - 1` for every i, one after another: the index that gathers
    (or scatters) ragged runs in one pass, no step per run."""
    offsets = np.repeat(np.asarray(starts, dtype=np.int64) - exclusive_cumsum(lengths), lengths)
    return offsets + np.arange(len(offsets), dtype=np.int64)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
