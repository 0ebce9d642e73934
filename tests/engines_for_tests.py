"""Engines hosted by test workers: `--engine engines_for_tests:<name>` with this directory on PYTHONPATH.

Imported by worker processes only (and by tests for constants); keep it free of test-only imports.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch

from distbatch import DistributedBatchMemory


class EchoEngine:
    """The general-purpose test engine: echoes, columns, batches, JSON, errors, slow calls."""

    def __init__(self, context: Any = None) -> None:
        self.context = context
        self.counts: dict[str, int] = {}
        self.attribute = "not callable"  # a public non-method: must not be callable over HTTP

    # -------------------------------------------------------------- identity

    def whoami(self) -> dict[str, Any]:
        node = self.context.node if self.context is not None else None
        return {"node": node, "pid": os.getpid(), "thread": threading.current_thread().name}

    def echo(self, value: Any = None, **kwargs: Any) -> dict[str, Any]:
        node = self.context.node if self.context is not None else None
        return {"node": node, "value": value, "kwargs": kwargs}

    def environ(self, name: str) -> str | None:
        """An environment variable as the engine's process sees it (launcher env settings)."""
        return os.environ.get(name)

    def store_shards(self) -> int:
        """How many shards the hosting worker's store holds (via the WorkerContext)."""
        return self.context.store.stats().shards

    # -------------------------------------------------------------- batches in and out

    def columns(self, batch: DistributedBatchMemory, scale: float = 1.0) -> dict[str, Any]:
        """Per-task columns computed from the batch's `x` field: a tensor, a list and a ragged list."""
        x = batch["x"]  # gathers `x` from whichever workers hold it
        n = len(batch)
        return {
            "y": x.float() * scale,
            "tag": [f"tag-{t}" for t in batch.task_ids],
            "ragged": [torch.arange(i + 1, dtype=torch.int64) for i in range(n)],
        }

    def make_batch(self, n: int, prefix: str) -> DistributedBatchMemory:
        """A LOCAL batch with new task ids: stored on this worker, returned REMOTE."""
        return DistributedBatchMemory.from_dict(
            {"z": torch.arange(n, dtype=torch.float32) * 10, "name": [f"{prefix}/{i}" for i in range(n)]},
            task_ids=[f"{prefix}-{i}" for i in range(n)],
        )

    def passthrough(self, batch: DistributedBatchMemory) -> DistributedBatchMemory:
        return batch

    def describe(self, batch: DistributedBatchMemory) -> dict[str, Any]:
        """Plain JSON about a batch argument (touches no data)."""
        return {
            "status": batch.status.value,
            "len": len(batch),
            "task_ids": batch.task_ids,
            "fields": batch.fields,
            "nodes": list(batch.meta.nodes) if batch.meta is not None else [],
        }

    def total(self, batch: DistributedBatchMemory, field: str = "x") -> float:
        """Gathers one column (from peers) and reduces it to plain JSON."""
        return float(batch[field].float().sum())

    def json_value(self, kind: str) -> Any:
        values = {
            "dict": {"a": 1, "b": 2.5, "c": "text", "d": True, "e": None},
            "list": [1, "two", 3.0, None, [4]],
            "str": "hello",
            "none": None,
            "lists": {"a": [1, 2], "b": [3, 4]},  # looks like columns, but no batch argument
        }
        return values[kind]

    # -------------------------------------------------------------- failures and counting

    def fail(self, message: str) -> None:
        raise ValueError(message)

    def bump(self, key: str, fail: bool = False) -> int:
        """Count invocations per key; optionally fail after counting."""
        self.counts[key] = self.counts.get(key, 0) + 1
        if fail:
            raise RuntimeError(f"bump {key} failed after counting")
        return self.counts[key]

    def bump_and_drop(self, key: str) -> None:
        """Count, then escape the engine's error reporting: the worker drops the connection."""
        self.counts[key] = self.counts.get(key, 0) + 1
        raise SystemExit(3)

    def count(self, key: str) -> int:
        return self.counts.get(key, 0)

    def count_all(self) -> int:
        """Invocations counted so far, all keys together."""
        return sum(self.counts.values())

    def bad_result(self) -> Any:
        return object()

    # -------------------------------------------------------------- timing

    def slow(self, seconds: float, label: str = "") -> dict[str, Any]:
        """Sleep on the engine thread; report when it ran (time.time(), comparable across processes)."""
        start = time.time()
        self.counts[f"slow:{label}"] = self.counts.get(f"slow:{label}", 0) + 1
        time.sleep(seconds)
        return {"label": label, "start": start, "end": time.time(), "thread": threading.current_thread().name}

    def _private(self) -> str:
        return "private"


def make_echo_engine(context: Any) -> EchoEngine:
    """A factory function (not a class) that takes the WorkerContext as `context=`."""
    if context is None or not hasattr(context, "store") or not isinstance(context.node, str):
        raise TypeError("make_echo_engine needs a WorkerContext")
    return EchoEngine(context)


class PlainEngine:
    """An engine class whose factory takes no context."""

    def slow(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def pid(self) -> int:
        return os.getpid()
