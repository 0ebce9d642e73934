"""Timing and checking helpers every benchmark here shares (also used inside child processes)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def stats(seconds: list[float], nbytes: int) -> dict[str, Any]:
    """Median, min and max of `seconds`, with throughput in GB/s of `nbytes`."""
    median = statistics.median(seconds)
    return {
        "bytes": nbytes,
        "seconds": seconds,
        "median_s": median,
        "min_s": min(seconds),
        "max_s": max(seconds),
        "gbps": nbytes / median / 1e9 if median > 0 else float("inf"),
        "gbps_range": [nbytes / max(seconds) / 1e9, nbytes / min(seconds) / 1e9],
    }


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call."""
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def items(column: Any) -> list[Any]:
    """Per-task values of a column: the rows of a (stacked or nested) tensor, or the list itself."""
    if isinstance(column, torch.Tensor):
        return list(column.unbind(0))
    return list(column)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def check_columns(got: Any, want: dict[str, Any]) -> None:
    """Every gathered value equals what was put (the benchmark's checksum)."""
    for name, values in want.items():
        column = got[name]
        if isinstance(values, torch.Tensor) and isinstance(column, torch.Tensor) and not column.is_nested:
            ok = same(column, values)
        else:
            got_items, want_items = items(column), items(values)
            ok = len(got_items) == len(want_items) and all(same(g, w) for g, w in zip(got_items, want_items))
        if not ok:
            raise AssertionError(f"gathered field {name!r} differs from what was put")
