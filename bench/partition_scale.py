"""A controller partition's bookkeeping at N tasks, in this process: bytes per task, a put's time
per task, a 16-task `get_meta` with every task ready, and the metadata of a 2,560-task answer.

`python -m bench.partition_scale [--tasks 16000 64000]`. No workers and no HTTP: the partition
alone (`distbatch.controller.partitions`), fed puts of 2,560 tasks of 8 ragged fields on two
nodes, as a GRPO step announces them. Bytes per task are what `tracemalloc` counts as still held
after the puts (ids included), so the figure compares layouts, not processes.
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc
from typing import Any

import numpy as np

from distbatch.batch.meta import BatchMeta, FieldMeta
from distbatch.controller.partitions import Partition
from distbatch.wire.shapes import RowShapes

FIELDS = [f"field{k}" for k in range(8)]
PUT = 2560  # tasks per put: one rollout share


def _announcement(task_ids: list[str], rng: np.random.Generator) -> BatchMeta:
    n = len(task_ids)
    nodes = (np.arange(n) % 2).astype(np.int32)
    return BatchMeta(
        task_ids,
        ["127.0.0.1:1", "127.0.0.1:2"],
        {
            name: FieldMeta("I64", nodes, RowShapes.ragged(rng.integers(1, 2000, n)), True, np.full(n, 7))
            for name in FIELDS
        },
    )


def measure(tasks: int, calls: int = 200) -> dict[str, Any]:
    """One partition of `tasks` tasks: its figures (see the module docstring)."""
    rng = np.random.default_rng(0)
    metas = [
        _announcement([f"task-{k + i:08d}" for i in range(min(PUT, tasks - k))], rng)
        for k in range(0, tasks, PUT)
    ]
    timed = Partition("p")  # timed untraced: tracing slows every allocation, numpy's too
    began = time.perf_counter()
    for meta in metas:
        timed.register(meta, timed.check_put(meta, 1))
    put_seconds = time.perf_counter() - began
    del timed
    tracemalloc.start()
    partition = Partition("p")
    for meta in metas:
        partition.register(meta, partition.check_put(meta, 1))
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    fields = FIELDS[:3]
    began = time.perf_counter()
    for _ in range(calls):  # what a consumer's get_meta does with the partition, under the lock
        taken = partition.ready("train", fields)[:16]
        partition.meta_for(taken, fields)
        partition.consume("train", taken)
    get_meta_seconds = (time.perf_counter() - began) / calls
    began = time.perf_counter()
    partition.meta_for(list(range(PUT)), FIELDS)
    answer_seconds = time.perf_counter() - began
    return {
        "tasks": tasks,
        "bytes_per_task": held / tasks,
        "put_us_per_task": put_seconds / tasks * 1e6,
        "get_meta_16_us": get_meta_seconds * 1e6,
        "meta_for_2560x8_ms": answer_seconds * 1e3,
        "consumed": partition.consumed_count("train"),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, nargs="+", default=[16_000, 64_000])
    parser.add_argument("--json", action="store_true", help="print one JSON object per size")
    args = parser.parse_args(argv)
    results = [measure(n) for n in args.tasks]
    for r in results:
        if args.json:
            print(json.dumps(r))
        else:
            print(
                f"{r['tasks']:>7,} tasks: {r['bytes_per_task']:,.0f} B/task, "
                f"put {r['put_us_per_task']:.1f} µs/task, get_meta of 16 {r['get_meta_16_us']:.0f} µs, "
                f"metadata of 2,560 x 8 {r['meta_for_2560x8_ms']:.2f} ms"
            )
    return results


if __name__ == "__main__":
    main()
