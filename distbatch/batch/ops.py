"""Which rows a rearrangement of a batch takes: an index, chunks, balanced chunks, a union.

Pure index arithmetic over task counts, task ids and lengths, the same for LOCAL and REMOTE
batches, so it is written once, apart from the batch object that applies the rows: to its
columns (LOCAL) or to its metadata and gathered cache (REMOTE).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from distbatch.batch.balance import balanced_group_partitions, karmarkar_karp
from distbatch.errors import InvalidArgumentError, InvalidTypeError, OutOfRangeError


def task_indices(key: Any, n: int) -> list[int]:
    """The task positions `batch[key]` selects, for a slice, index list or boolean mask over `n` tasks."""
    if isinstance(key, slice):
        return list(range(n))[key]
    if isinstance(key, torch.Tensor):
        key = key.tolist()
    if not isinstance(key, (range, list, tuple)):
        raise InvalidTypeError(f"cannot index a batch with {type(key).__name__}")
    items = list(key)
    if items and all(isinstance(v, bool) for v in items):
        if len(items) != n:
            raise OutOfRangeError(f"boolean mask has {len(items)} entries for {n} tasks")
        return [i for i, keep in enumerate(items) if keep]
    out = []
    for v in items:
        if not isinstance(v, int) or isinstance(v, bool):
            raise InvalidTypeError(f"batch indexes must be ints, got {v!r}")
        if not -n <= v < n:
            raise OutOfRangeError(f"task index {v} out of range for {n} tasks")
        out.append(v % n)
    if len(set(out)) != len(out):
        raise InvalidArgumentError("indexes repeat a task; a batch holds each task once")
    return out


def length_field(tensor_fields: Sequence[str], ragged: Sequence[str] = ()) -> str:
    """The field `lengths()` reads when none is named: input_ids, else the first ragged tensor
    field (`ragged`), else the first tensor field."""
    if "input_ids" in tensor_fields:
        return "input_ids"
    if ragged:
        return ragged[0]
    if not tensor_fields:
        raise InvalidArgumentError("no tensor field to take lengths from; pass length_field or lengths")
    return tensor_fields[0]


def check_lengths(values: Any, count: int, what: str = "lengths") -> np.ndarray:
    """Per-task lengths given as a tensor, array or list: `count` non-negative integers, as int64."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    array = np.asarray(values)
    if array.dtype.kind not in "iub" and not (array.size == 0 and array.dtype.kind == "f"):
        raise InvalidArgumentError(f"{what} must be integers (one length per task), got {array.dtype} values")
    if array.ndim != 1 or len(array) != count:
        raise InvalidArgumentError(
            f"{what} must hold one length per task: {count}, got shape {list(array.shape)}"
        )
    array = array.astype(np.int64)
    if count and int(array.min()) < 0:
        raise InvalidArgumentError(f"{what} must be non-negative, got {int(array.min())}")
    return array


def check_chunk_count(n: Any) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InvalidArgumentError(f"chunk count must be a positive int, got {n!r}")


def chunk_rows(count: int, n: int) -> list[np.ndarray]:
    """`n` contiguous runs of rows over `count` tasks, in order; sizes differ by at most one."""
    base, extra = divmod(count, n)
    out, start = [], 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        out.append(np.arange(start, start + size))
        start += size
    return out


def balanced_rows(lengths: Sequence[int] | np.ndarray, n: int, group_size: int) -> list[np.ndarray]:
    """The rows of `n` chunks with balanced total length, groups of `group_size` rows kept
    together, each chunk in ascending order and the chunks ordered by their first group."""
    group_lengths = np.asarray(lengths, dtype=np.int64).reshape(-1, group_size).sum(axis=1)
    parts = balanced_group_partitions(group_lengths.tolist(), n)
    parts.sort(key=lambda p: p[0] if p else len(group_lengths))
    offsets = np.arange(group_size)
    return [(np.asarray(part, dtype=np.int64)[:, None] * group_size + offsets).reshape(-1) for part in parts]


UNION_HINT = (
    "union adds the fields of the same tasks: build both batches with the same task_ids= (each "
    "batch made without them gets ids of its own), or use concat() to add tasks"
)


def union_rows(
    mine: list[str], theirs: list[str], verb: str = "union", hint: str = UNION_HINT
) -> np.ndarray | None:
    """Where each of `mine` is in `theirs` (None when both are in the same order); ValueError
    (`verb` needs the same task ids; `hint`) unless both hold the same task ids once each."""
    if mine == theirs:  # the usual case, checked in C
        return None
    if len(mine) != len(theirs) or set(mine) != set(theirs):
        missing = sorted(set(mine) - set(theirs))[:5]
        extra = sorted(set(theirs) - set(mine))[:5]
        raise InvalidArgumentError(
            f"{verb} needs the same task ids: missing in other {missing}, extra {extra}; {hint}"
        )
    position = dict(zip(theirs, range(len(theirs))))
    return np.fromiter(map(position.__getitem__, mine), dtype=np.int64, count=len(mine))


def micro_batch_rows(lengths: np.ndarray, max_tokens: int, count: int | None = None) -> list[np.ndarray]:
    """The rows of the fewest micro-batches whose token totals are each at most `max_tokens`,
    balanced by tokens (Karmarkar-Karp, counts free), each in ascending order; exactly `count`
    of them when given (an empty one where there are fewer tasks), or InvalidArgumentError
    when `count` cannot hold them under the budget. A task longer than the budget is refused,
    naming it: it fits no micro-batch."""
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise InvalidArgumentError(f"max_tokens must be a positive int, got {max_tokens!r}")
    if count is not None:
        check_chunk_count(count)
    if len(lengths) and int(lengths.max()) > max_tokens:
        task = int(np.argmax(lengths))
        raise InvalidArgumentError(
            f"task {task} has {int(lengths[task])} tokens, more than max_tokens={max_tokens}: raise the "
            "budget to at least the longest task"
        )
    first = count or max(1, -(-int(lengths.sum()) // max_tokens))
    for k in range(first, max(first, len(lengths)) + 1):
        parts = karmarkar_karp(lengths.tolist(), k, equal_size=False)
        if all(int(lengths[part].sum()) <= max_tokens for part in parts):
            return [np.asarray(part, dtype=np.int64) for part in parts]
        if count is not None:
            break
    raise InvalidArgumentError(
        f"{len(lengths)} tasks of {int(lengths.sum())} tokens do not fit {count} micro-batches of at most "
        f"{max_tokens} tokens: take the count from micro_batch_count() over every rank's batch"
    )
