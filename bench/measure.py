"""Timing and checking helpers every benchmark here shares (also used inside child processes)."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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


def percentiles(seconds: list[float]) -> dict[str, Any]:
    """Count, p50, p99, mean and max of `seconds`, in milliseconds (None for no sample)."""
    if not seconds:
        return {"count": 0, "p50_ms": None, "p99_ms": None, "mean_ms": None, "max_ms": None}
    ordered = sorted(seconds)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered) + 0.5)) - 1))] * 1e3

    return {
        "count": len(ordered),
        "p50_ms": rank(0.50),
        "p99_ms": rank(0.99),
        "mean_ms": sum(ordered) / len(ordered) * 1e3,
        "max_ms": ordered[-1] * 1e3,
    }


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call."""
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


@dataclass
class Stored:
    """What `stored_on_workers` leaves: the client, the workers' nodes, each put's seconds, and
    the REMOTE batch of the last put."""

    client: Any
    nodes: list[str]
    put_seconds: list[float]
    batch: Any


@contextlib.contextmanager
def stored_on_workers(columns: dict[str, Any], workers: int, repeats: int, bar: Any) -> Iterator[Stored]:
    """Start `workers` local workers and put `columns` on them `repeats` times (one share per
    worker, in parallel), timing each put and clearing all but the last; the workers and the
    client are stopped on exit. distbatch is imported here: child processes use this module too."""
    from distbatch import DistributedBatchMemory, ShardClient
    from distbatch.launch import spawn_workers

    shares = DistributedBatchMemory.from_dict(columns).chunk(workers)
    procs = spawn_workers(workers)
    client = ShardClient()
    try:
        nodes = [p.node for p in procs]
        put_seconds: list[float] = []
        batch = DistributedBatchMemory()
        with ThreadPoolExecutor(workers) as pool:
            for r in range(repeats):
                seconds, parts = timed(
                    lambda: list(pool.map(lambda sn: sn[0].to_remote(sn[1], client), zip(shares, nodes)))
                )
                put_seconds.append(seconds)
                batch = DistributedBatchMemory.concat(parts)
                if r < repeats - 1:
                    batch.clear()
                bar.update()
        if batch.meta is None:
            raise RuntimeError("the benchmark batch is not REMOTE after the put")
        yield Stored(client, nodes, put_seconds, batch)
    finally:
        client.close()
        for p in procs:
            p.stop()


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
