"""How distbatch's costs grow with the task count: 1k to 100k tasks of 8 small fields.

Per size, each repeat times, on real workers on loopback:

- **put**: the LOCAL batch split over the workers, one `to_remote(node)` per worker
  concurrently, then `concat` into one REMOTE batch;
- **gather 1 field**: `remote["input_ids"]` of a fresh REMOTE batch (nothing cached);
- **chunk_balanced(8)** of the REMOTE batch (lengths from metadata, no data moved);
- **pickle round trip** of the REMOTE batch (metadata only);
- **clear**: `remote.clear()`, every shard deleted.

Small fields make the per-task and per-shard costs show, not the bytes: three short ragged
tensors (int32 / fp32 / bf16, 4-32 tokens), two small int64 vectors, two scalars and a JSON
value per task.
"""

from __future__ import annotations

import pickle
import statistics
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench.measure import check_columns, timed
from bench.workloads import column_bytes
from distbatch import DistributedBatchMemory, ShardClient
from distbatch.launch import spawn_workers

SIZES = (1_000, 3_000, 10_000, 30_000, 100_000)
OPS = ("put", "gather_one_field", "chunk_balanced", "pickle_roundtrip", "clear")
LABELS = {
    "put": "put",
    "gather_one_field": "gather 1 field",
    "chunk_balanced": "chunk_balanced(8)",
    "pickle_roundtrip": "pickle round trip",
    "clear": "clear",
}
FIELDS = 8


def make_scaling_columns(tasks: int, seed: int = 0) -> dict[str, Any]:
    """8 small fields per task, built column-wise (a split of one tensor, not a loop of randoms)."""
    gen = torch.Generator().manual_seed(seed + 3)
    lengths = torch.randint(4, 33, (tasks,), generator=gen).tolist()
    total = sum(lengths)
    return {
        "input_ids": list(
            torch.randint(0, 151_000, (total,), dtype=torch.int32, generator=gen).split(lengths)
        ),
        "logprobs": list((-torch.rand(total, generator=gen)).split(lengths)),
        "advantages": list(torch.randn(total, generator=gen).to(torch.bfloat16).split(lengths)),
        "position": torch.randint(0, 1 << 40, (tasks, 4), dtype=torch.int64, generator=gen),
        "versions": torch.randint(0, 1_000, (tasks, 2), dtype=torch.int64, generator=gen),
        "reward": torch.rand(tasks, generator=gen),
        "done": torch.rand(tasks, generator=gen) < 0.9,
        "info": [{"uid": f"prompt-{i // 8}", "turn": i % 3} for i in range(tasks)],
    }


def pickle_roundtrip(batch: DistributedBatchMemory) -> tuple[DistributedBatchMemory, int]:
    """A REMOTE batch through pickle (metadata only) and back; also the pickled size."""
    blob = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
    # Benchmark-only: bytes this very function pickled, in memory; what a batch passed to a
    # Ray task or a multiprocessing worker costs.
    return pickle.loads(blob), len(blob)  # noqa: S301


def _one_size(
    tasks: int,
    nodes: list[str],
    client: ShardClient,
    pool: ThreadPoolExecutor,
    repeats: int,
    seed: int,
    bar: tqdm,
) -> dict[str, Any]:
    """Every operation `repeats` times on a batch of `tasks` tasks; checked on the first repeat."""
    columns = make_scaling_columns(tasks, seed)
    shares = DistributedBatchMemory.from_dict(columns).chunk(len(nodes))

    def put() -> DistributedBatchMemory:
        parts = pool.map(lambda sn: sn[0].to_remote(sn[1], client), zip(shares, nodes))
        return DistributedBatchMemory.concat(list(parts))

    times: dict[str, list[float]] = {op: [] for op in OPS}
    pickled_bytes = meta_json_bytes = 0
    for r in range(repeats):
        seconds, remote = timed(put)
        times["put"].append(seconds)
        bar.update()
        meta = remote.meta
        if meta is None:
            raise RuntimeError("the scaling batch is not REMOTE after the put")
        fresh = DistributedBatchMemory.from_meta(meta, client)  # nothing cached
        seconds, column = timed(partial(fresh.__getitem__, "input_ids"))
        times["gather_one_field"].append(seconds)
        bar.update()
        if r == 0:
            check_columns({"input_ids": column}, {"input_ids": columns["input_ids"]})
        seconds, chunks = timed(partial(remote.chunk_balanced, 8))
        times["chunk_balanced"].append(seconds)
        bar.update()
        if sorted(t for c in chunks for t in c.task_ids) != sorted(remote.task_ids):
            raise AssertionError("chunk_balanced(8) lost or repeated tasks")
        seconds, (copy, pickled_bytes) = timed(partial(pickle_roundtrip, remote))
        times["pickle_roundtrip"].append(seconds)
        bar.update()
        if copy.task_ids != remote.task_ids or copy.meta is None:
            raise AssertionError("the pickled REMOTE batch came back different")
        meta_json_bytes = len(remote.to_json())
        seconds, deleted = timed(remote.clear)
        times["clear"].append(seconds)
        bar.update()
        if deleted != tasks * FIELDS:
            raise AssertionError(f"clear deleted {deleted} shards, expected {tasks * FIELDS}")
    return {
        "tasks": tasks,
        "payload_bytes": sum(column_bytes(c) for c in columns.values()),
        "pickled_bytes": pickled_bytes,
        "meta_json_bytes": meta_json_bytes,
        "seconds": times,
        "median_s": {op: statistics.median(t) for op, t in times.items()},
        "min_s": {op: min(t) for op, t in times.items()},
        "max_s": {op: max(t) for op, t in times.items()},
    }


def run_scaling(
    sizes: list[int], workers: int = 2, repeats: int = 3, seed: int = 0, progress: bool = True
) -> dict[str, Any]:
    """Seconds per operation (see the module doc) for each task count in `sizes`."""
    procs = spawn_workers(workers)
    client = ShardClient()
    rows: list[dict[str, Any]] = []
    try:
        nodes = [p.node for p in procs]
        bar = tqdm(total=len(sizes) * repeats * len(OPS), desc="scaling", unit="op", disable=not progress)
        with bar, ThreadPoolExecutor(workers) as pool:
            for tasks in sizes:
                bar.set_postfix_str(f"{tasks:,} tasks")
                rows.append(_one_size(tasks, nodes, client, pool, repeats, seed, bar))
        left = sum(client.stats(n)["shards"] for n in nodes)
    finally:
        client.close()
        for p in procs:
            p.stop()
    return {
        "fields": FIELDS,
        "workers": workers,
        "repeats": repeats,
        "ops": list(OPS),
        "rows": rows,
        "left_shards": left,
    }


def table(result: dict[str, Any]) -> str:
    """Median seconds per operation and size, with the per-task cost at the largest size."""
    head = f"{'tasks':>8} " + " ".join(f"{LABELS[op]:>17}" for op in OPS) + f" {'pickled':>9}"
    lines = [f"scaling: {result['fields']} small fields per task, {result['workers']} workers", head]
    for row in result["rows"]:
        cells = " ".join(f"{row['median_s'][op]:>16.4f}s" for op in OPS)
        lines.append(f"{row['tasks']:>8,} {cells} {row['pickled_bytes'] / 1e3:>7.0f}kB")
    if result["rows"]:
        last = result["rows"][-1]
        per_task = " ".join(f"{last['median_s'][op] / last['tasks'] * 1e6:>15.1f}us" for op in OPS)
        lines.append(f"{'per task':>8} {per_task}   (at {last['tasks']:,} tasks)")
    lines.append(
        f"(medians of {result['repeats']}; shards left on the workers after the run: {result['left_shards']})"
    )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> Path | None:
    """Log-log plot of seconds vs tasks per operation (median line, min-max band); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = result["rows"]
    tasks = [row["tasks"] for row in rows]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for op in result["ops"]:
        medians = [row["median_s"][op] for row in rows]
        ax.plot(tasks, medians, marker="o", label=LABELS[op])
        ax.fill_between(
            tasks, [row["min_s"][op] for row in rows], [row["max_s"][op] for row in rows], alpha=0.2
        )
    if len(tasks) > 1:  # a slope-1 guide through the slowest op's first point: linear growth
        start = max(rows[0]["median_s"].values())
        ax.plot(tasks, [start * t / tasks[0] for t in tasks], "k:", linewidth=1, label="linear (guide)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tasks in the batch")
    ax.set_ylabel("seconds (median, min-max)")
    ax.set_title(
        f"distbatch vs batch size: {result['fields']} small fields per task, {result['workers']} workers"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
