"""Engines hosted by test workers: `--engine engines_for_tests:<name>` with this directory on PYTHONPATH.

Imported by worker processes only (and by tests for constants); keep it free of test-only imports.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any

import distbatch

if TYPE_CHECKING:
    import torch

    from distbatch import DistributedBatchMemory


class _OnFirstUse:
    """A module imported on first attribute access: a worker whose test calls only JSON methods
    never loads torch (the engine host does not either), so it starts in a fraction of the time
    (the suite starts dozens of these workers)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        import importlib

        return getattr(importlib.import_module(self._name), attribute)


if not TYPE_CHECKING:
    torch = _OnFirstUse("torch")

# What a test passes to start workers hosting these engines: this directory on their import path.
ENGINES_ENV = {
    "PYTHONPATH": os.pathsep.join(
        p for p in [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")] if p
    )
}
ECHO = "engines_for_tests:make_echo_engine"


class EchoEngine:
    """The general-purpose test engine: echoes, columns, batches, JSON, errors, slow calls."""

    def __init__(self, context: Any = None, **config: Any) -> None:
        self.context = context
        self.counts: dict[str, int] = {}
        self.attribute = "not callable"  # a public non-method: must not be callable over HTTP
        self.config = config  # the group's engine_kwargs
        # What the context said in the constructor (node, rank and world size must be valid here).
        self.at_init = {name: getattr(context, name, None) for name in ("node", "rank", "world_size")}

    # -------------------------------------------------------------- identity

    def whoami(self) -> dict[str, Any]:
        node = self.context.node if self.context is not None else None
        return {"node": node, "pid": os.getpid(), "thread": threading.current_thread().name}

    def echo(self, value: Any = None, **kwargs: Any) -> dict[str, Any]:
        node = self.context.node if self.context is not None else None
        return {"node": node, "value": value, "kwargs": kwargs}

    def loaded(self, names: list[str]) -> dict[str, bool]:
        """Whether the worker's process has imported each module in `names`."""
        import sys

        return {name: name in sys.modules for name in names}

    def environ(self, name: str) -> str | None:
        """An environment variable as the engine's process sees it (launcher env settings)."""
        return os.environ.get(name)

    def identity(self) -> dict[str, Any]:
        """What the constructor got: the context's node, rank and world size, and the engine_kwargs."""
        return {**self.at_init, "config": self.config}

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
        return distbatch.DistributedBatchMemory.from_dict(
            {"z": torch.arange(n, dtype=torch.float32) * 10, "name": [f"{prefix}/{i}" for i in range(n)]},
            task_ids=[f"{prefix}-{i}" for i in range(n)],
        )

    def repack(self, batch: DistributedBatchMemory, field: str = "x") -> DistributedBatchMemory:
        """A LOCAL batch whose columns come from `batch.packed(field)`: `rows`, each task's slice of
        the packed values (views into them), and `length`, from `cu_seqlens`; stored here, returned
        REMOTE (tests/test_packed.py)."""
        values, cu = batch.packed(field)
        bounds = cu.tolist()
        rows = [values[start:stop] for start, stop in zip(bounds, bounds[1:])]
        return distbatch.DistributedBatchMemory.from_dict(
            {"rows": rows, "length": (cu[1:] - cu[:-1]).to(torch.int64)}, task_ids=batch.task_ids
        )

    def nested_result(self, batch: DistributedBatchMemory, field: str = "x", kind: str = "twice") -> Any:
        """TransferQueue-style engine code: `field` as a jagged nested tensor in, a nested column out.

        `twice`: nested arithmetic (`twice`) and the tasks' lengths from its offsets (`length`);
        `strided` / `dim2`: a strided nested tensor, or a jagged one ragged in dim 2, as `other`
        (tasks of shape (1, L_i)). Tests: tests/integration/test_nested.py."""
        nt = batch.nested(field)
        if kind == "twice":
            return {"twice": nt * 2, "length": torch.diff(nt.offsets())}
        rows = [t.unsqueeze(0) for t in nt.unbind()]  # (1, L_i): ragged in dim 2
        layout = torch.strided if kind == "strided" else torch.jagged
        return {"other": torch.nested.nested_tensor(rows, layout=layout)}

    def split_views(self, batch: DistributedBatchMemory) -> DistributedBatchMemory:
        """A LOCAL batch whose `views` column is `split` views of one tensor this engine keeps
        (task i: i + 1 values counting on from the previous task's), to scribble on later."""
        lengths = [i + 1 for i in range(len(batch))]
        self._kept = torch.arange(sum(lengths), dtype=torch.int32)
        return distbatch.DistributedBatchMemory.from_dict(
            {"views": list(self._kept.split(lengths))}, task_ids=batch.task_ids
        )

    def scribble(self) -> bool:
        """Overwrite the tensor `split_views` returned views of (after its result was stored)."""
        self._kept.fill_(-1)
        return True

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

    def packed_rows(self, batch: DistributedBatchMemory, field: str = "x") -> dict[str, Any]:
        """An engine's natural code on any chunk (an empty one too): pack a field, look at a column."""
        values, offsets = batch.packed(field)
        column = batch[field]
        return {
            "fields": batch.fields,
            "rows": int(values.shape[0]),
            "offsets": offsets.tolist(),
            "dtype": str(values.dtype),
            "column": type(column).__name__,
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


def make_echo_engine(context: Any, **config: Any) -> EchoEngine:
    """A factory function (not a class) that takes the WorkerContext as `context=`, and any
    engine_kwargs."""
    if context is None or not hasattr(context, "store") or not isinstance(context.node, str):
        raise TypeError("make_echo_engine needs a WorkerContext")
    return EchoEngine(context, **config)


class BrokenEngine:
    """An engine whose constructor raises (a worker whose engine fails to start)."""

    def __init__(self, context: Any, reason: str = "no GPU for this rank") -> None:
        raise RuntimeError(f"rank {context.rank} of {context.world_size}: {reason}")


class StrictEngine:
    """An engine class that takes one named keyword argument and no context."""

    def __init__(self, model: str) -> None:
        self.model = model

    def which(self) -> str:
        return self.model


class PlainEngine:
    """An engine class whose factory takes no context."""

    def slow(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def pid(self) -> int:
        return os.getpid()


class ResultShapesEngine:
    """Returns results of every shape an engine might get wrong (tests/test_engine_errors.py)."""

    def __init__(self) -> None:
        self.calls = 0

    def too_long(self, batch: DistributedBatchMemory) -> dict[str, Any]:
        """`y` has one row too many, `tag` is right."""
        return {"y": torch.zeros(len(batch) + 1), "tag": [str(i) for i in range(len(batch))]}

    def bare_tensor(self, batch: DistributedBatchMemory | None = None) -> torch.Tensor:
        return torch.zeros(3)

    def columns_without_batch(self) -> dict[str, Any]:
        return {"y": torch.zeros(3)}

    def tensor_in_json(self) -> dict[str, Any]:
        return {"metrics": {"loss": torch.tensor(0.5)}}

    def metrics_lists(self, batch: DistributedBatchMemory) -> dict[str, Any]:
        """Lists whose lengths are not the task count: plain JSON, as before."""
        return {"losses": [0.5] * (len(batch) + 1)}

    def columns(self, batch: DistributedBatchMemory) -> dict[str, Any]:
        """Columns with one entry per input task, whatever their number (zero included)."""
        x = batch["x"] if len(batch) else torch.zeros(0)
        return {"y": x.float() * 2, "tag": [f"tag-{t}" for t in batch.task_ids]}

    def unstorable(self, batch: DistributedBatchMemory, kind: str, as_batch: bool = False) -> Any:
        """A column `bad` the wire cannot carry, as a dict of columns or a LOCAL batch."""
        n = len(batch)
        dense = torch.arange(n * 2, dtype=torch.float32).reshape(n, 2)
        if kind == "sparse_coo":
            bad: Any = dense.to_sparse()
        elif kind == "sparse_csr":
            bad = dense.to_sparse_csr()
        elif kind == "nested_complex32":  # nested tensors are columns; this dtype is not
            rows = [torch.zeros(i + 1, dtype=torch.complex32) for i in range(n)]
            bad = torch.nested.nested_tensor(rows, layout=torch.jagged)
        elif kind == "meta":
            bad = torch.empty(n, 2, device="meta")
        elif kind == "quantized":
            bad = torch.quantize_per_tensor(dense, 0.1, 0, torch.qint8)
        elif kind == "ragged_sparse":
            bad = [torch.zeros(i + 1).to_sparse() for i in range(n)]
        else:
            raise ValueError(kind)
        columns = {"good": dense, "bad": bad}
        if as_batch:
            return distbatch.DistributedBatchMemory.from_dict(columns, task_ids=batch.task_ids)
        return columns

    def big(self, batch: DistributedBatchMemory, width: int) -> dict[str, Any]:
        return {"y": torch.zeros(len(batch), width)}

    def two(self, a: int, b: int = 1) -> int:
        self.calls += 1
        return a + b

    def type_error_inside(self, value: Any) -> Any:
        self.calls += 1
        return value + "text"  # TypeError for a number: the engine's own bug, not a bad call

    def count(self) -> int:
        return self.calls

    def slow(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


class ReliabilityEngine:
    """For abandoned and partly failed calls: per-task columns after a delay chosen per task id."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        # Loaded at start, as by an engine module that imports the batch at its top: the
        # reliability tests time calls (abandons, deaths mid-call), not a first call's import.
        self.batch_class = distbatch.DistributedBatchMemory

    def mark(
        self,
        batch: DistributedBatchMemory,
        delays: dict[str, float] | None = None,
        fail_for: list[str] | None = None,
    ) -> dict[str, Any]:
        """Sleep the longest delay of the batch's tasks, fail if one is in `fail_for`, else
        return a column `mark` (stored on this worker under the batch's task ids)."""
        ids = batch.task_ids
        for task_id in ids:
            self.counts[task_id] = self.counts.get(task_id, 0) + 1
        time.sleep(max([(delays or {}).get(t, 0.0) for t in ids], default=0.0))
        if any(t in (fail_for or []) for t in ids):
            raise RuntimeError(f"mark failed for {ids}")
        return {"mark": [f"m-{t}" for t in ids]}

    def ran(self, task_id: str) -> int:
        """How many times `mark` started for this task id."""
        return self.counts.get(task_id, 0)

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def takes_timeout(self, timeout: float, value: str = "") -> dict[str, Any]:
        """An engine method with a keyword named `timeout`: it must reach the engine."""
        return {"timeout": timeout, "value": value}
