"""`python -m bench.rss`: does a worker give memory back? Its RSS over cycles of put + clear.

Each cycle puts a batch of `--mib` MiB (16 ragged float32 tasks and a JSON field) on one
worker and clears it; the worker's resident set size is read from /proc (Linux) after each
put and each clear. The columnar store keeps a put's columns in the request body itself
(an anonymous mapping), so clearing them must unmap it: the end RSS should be back within
a few percent of the start once the recycled put bodies expire (a couple of seconds).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from distbatch import DistributedBatchMemory, ShardClient
from distbatch.launch import spawn_worker
from rpc_server.context import BODY_POOL_IDLE_SECONDS


def rss_mib(pid: int) -> float:
    """Resident set size of `pid` in MiB (Linux /proc)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def run(cycles: int = 10, mib: int = 1024, tasks: int = 16) -> dict[str, Any]:
    """RSS of a fresh worker at start, after each put and clear, and at the end."""
    worker = spawn_worker()
    try:
        with ShardClient() as client:
            time.sleep(0.5)
            pid = worker.process.pid
            start = rss_mib(pid)
            per_task = max(1, (mib << 20) // 4 // tasks)
            local = DistributedBatchMemory.from_dict(
                {"x": [torch.ones(per_task) for _ in range(tasks)], "uid": [f"u{i}" for i in range(tasks)]}
            )
            after_put, after_clear = [], []
            for _ in range(cycles):
                remote = local.to_remote(worker.node, client)
                after_put.append(rss_mib(pid))
                remote.clear()
                after_clear.append(rss_mib(pid))
            held = client.stats(worker.node)["held_bytes"]
            # Put bodies freed by a clear stay mapped for the next put for a moment
            # (rpc_server.context.BODY_POOL_IDLE_SECONDS), then go back.
            time.sleep(BODY_POOL_IDLE_SECONDS + 1.0)
            settled = rss_mib(pid)
        return {
            "cycles": cycles,
            "mib_per_put": mib,
            "start_mib": start,
            "after_put_mib": after_put,
            "after_clear_mib": after_clear,
            "settled_mib": settled,
            "end_over_start": settled / start,
            "held_bytes_after": held,
        }
    finally:
        worker.stop()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.rss", description=__doc__)
    parser.add_argument("--cycles", type=int, default=10)
    parser.add_argument("--mib", type=int, default=1024, help="MiB per put")
    args = parser.parse_args(argv)
    result = run(args.cycles, args.mib)
    for i, (up, down) in enumerate(zip(result["after_put_mib"], result["after_clear_mib"])):
        print(f"cycle {i}: after put {up:.0f} MiB, after clear {down:.0f} MiB")
    print(
        f"worker RSS: start {result['start_mib']:.0f} MiB, {result['settled_mib']:.0f} MiB "
        f"{BODY_POOL_IDLE_SECONDS + 1:.0f} s after the last clear "
        f"({result['end_over_start']:.3f}x the start); held bytes after the last clear: "
        f"{result['held_bytes_after']}"
    )
    return result


if __name__ == "__main__":
    main()
