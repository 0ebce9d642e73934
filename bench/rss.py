"""`python -m bench.rss`: does a worker give memory back? Its RSS over cycles of put + clear.

Each cycle puts a batch of `--mib` MiB (16 ragged float32 tasks and a JSON field) on one
worker and clears it; the worker's resident set size is read from /proc (Linux) after each
put and each clear. The columnar store keeps a put's columns in the request body itself
(an anonymous mapping), so clearing them must unmap it: the end RSS should be back within
a few percent of the start once the recycled put bodies expire (a couple of seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import time
from pathlib import Path
from typing import Any

import torch

from distbatch import DistributedBatchMemory, ShardClient
from distbatch.launch import spawn_worker
from distbatch.transport.shm import ENV_SWITCH
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


# ----------------------------------------------------------------------------- the roles

ROLES = ("producer", "consumer", "controller")
# The controller's row registers this many steps of the workload (each its batch's metadata under
# fresh task ids), so that what it holds (18 MiB for grpo) dwarfs what the allocator keeps or
# reuses from the warm-up (up to a MiB either way: one step's 1.1 MiB measured 0.4x to 1.9x).
CONTROLLER_STEPS = 16


def peak_since_reset() -> float:
    """This process's RSS now (MiB), after resetting its peak RSS (Linux: /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    return rss_mib(os.getpid())


def peak_mib() -> float:
    """This process's peak RSS since the last reset, MiB (VmHWM)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def role_main(role: str, workload: str, nodes: list[str], meta_path: Path, shm: bool) -> dict[str, Any]:
    """One role of an RL step in this process, its peak RSS over what it started with, and the
    bytes it must hold: a producer its batch (built, then put on `nodes`), a consumer the batch
    it gathers, the controller the metadata of `CONTROLLER_STEPS` such batches (registered, one
    put each, then handed out in one answer: its state and that answer, both pickled; counted
    from the announcements' arrival). Each role first does its work once on a few tasks, so what
    is counted is a step's, not the process's first use of its modules and threads."""
    if not shm:
        os.environ[ENV_SWITCH] = "0"
    from bench.workloads import WORKLOADS, make_columns, payload_bytes
    from distbatch import Controller, DistributedBatchMemory, ShardClient
    from distbatch.controller.partitions import FEW_ROWS

    if role != "controller":
        # A first put and gather of a few tasks import what the data path uses (aiohttp, the
        # client's loop thread): modules and threads, not the data, as for the controller below.
        with ShardClient() as client:
            first = DistributedBatchMemory.from_dict(make_columns(WORKLOADS["tiny"], 1)).to_remote(
                nodes[0], client
            )
            first.get_data()
            first.clear()
        del first
    start = peak_since_reset()
    if role == "producer":
        columns = make_columns(WORKLOADS[workload], 0)
        must_hold = payload_bytes(columns)
        built = peak_mib() - start  # the batch as the producer made it: its tensors, one object each
        with ShardClient() as client:
            shares = DistributedBatchMemory.from_dict(columns).chunk(len(nodes))
            parts = [share.to_remote(node, client) for share, node in zip(shares, nodes)]
        meta_path.write_text(DistributedBatchMemory.concat(parts).to_json())
    elif role == "consumer":
        with ShardClient() as client:
            got = DistributedBatchMemory.from_json(meta_path.read_text(), client).get_data()
        must_hold = payload_bytes(got)
    else:
        announced = json.loads(meta_path.read_text())
        ids = announced["meta"]["task_ids"]
        steps = []
        for step in range(CONTROLLER_STEPS):  # the same shards' metadata under each step's ids
            announced["meta"]["task_ids"] = [f"s{step}-{t}" for t in ids]
            steps.append(DistributedBatchMemory.from_json(json.dumps(announced)))
        batch = steps[0]
        # A first put and get_meta of a few hundred tasks import what they use (numpy.ma, for one):
        # modules, not the controller's data.
        warm, few = Controller(), min(len(batch), 2 * FEW_ROWS)
        warm.put("warm", batch[:few])
        warm.get_meta("warm", "train", list(batch.fields), few)
        del warm
        start = peak_since_reset()  # from the announcements' arrival: what the controller adds to them
        controller = Controller()
        for step_batch in steps:
            controller.put("rss", step_batch)
        total = len(batch) * CONTROLLER_STEPS
        handed = controller.get_meta("rss", "train", list(batch.fields), total)
        if len(handed) != total:
            raise RuntimeError(f"the controller handed out {len(handed)} of {total} tasks")
    grown = max(peak_mib() - start, 0.0) * (1 << 20)
    if role == "controller":  # measured after the peak: building the state takes memory of its own
        # Its state (every task's metadata), and the answer it built (the handed-out batch's).
        state = pickle.dumps(controller.state_dict(), protocol=pickle.HIGHEST_PROTOCOL)
        must_hold = len(state) + len(pickle.dumps(handed.meta, protocol=pickle.HIGHEST_PROTOCOL))
    if role != "producer":
        built = 0.0
    return {
        "role": role,
        "start_mib": start,
        "grown_bytes": grown,
        "must_hold_bytes": must_hold,
        "built_bytes": built * (1 << 20),
        "ratio": grown / must_hold if must_hold else float("nan"),
    }


def roles(workload: str = "grpo", workers: int = 2, shm: bool = False) -> dict[str, Any]:
    """Each role in a process of its own, one after the other, against `workers` local workers."""
    import json
    import subprocess
    import sys
    import tempfile

    from distbatch.launch import spawn_workers

    out: dict[str, Any] = {}
    procs = spawn_workers(workers)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            meta = Path(tmp) / "meta.json"
            for role in ROLES:
                argv = [
                    sys.executable,
                    "-m",
                    "bench.rss",
                    "--role",
                    role,
                    "--workload",
                    workload,
                    "--nodes",
                    ",".join(p.node for p in procs),
                    "--meta",
                    str(meta),
                ]
                done = subprocess.run(
                    [*argv, *(["--shm"] if shm else [])],
                    capture_output=True,
                    text=True,
                    timeout=300,
                    check=False,
                )
                if done.returncode:
                    raise RuntimeError(f"bench.rss {role} failed: {done.stderr[-2000:]}")
                out[role] = json.loads(done.stdout.strip().splitlines()[-1])
            with ShardClient() as client:
                DistributedBatchMemory.from_json(meta.read_text(), client).clear()
    finally:
        for p in procs:
            p.stop()
    return out


def table(name: str, result: dict[str, Any]) -> str:
    """The peak-RSS rows of the summary: per path and role, growth over what it must hold."""
    lines = [
        f"peak RSS, {name} (each role its own process; growth of its peak RSS over the bytes it must hold):",
        f"  {'path':<10} {'role':<11} {'grew MiB':>9} {'holds MiB':>10} {'ratio':>7}   note",
    ]
    for path, entries in result.items():
        for role, e in entries.items():
            note = ""
            if role == "producer":
                note = f"the batch as built took {e['built_bytes'] / 2**20:.1f} MiB; the put added the rest"
            elif role == "controller":
                note = f"holds: its pickled state and answer ({CONTROLLER_STEPS} steps of tasks)"
            lines.append(
                f"  {path:<10} {role:<11} {e['grown_bytes'] / 2**20:>9.1f}"
                f" {e['must_hold_bytes'] / 2**20:>10.1f} {e['ratio']:>6.2f}x   {note}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.rss", description=__doc__)
    parser.add_argument("--cycles", type=int, default=10)
    parser.add_argument("--mib", type=int, default=1024, help="MiB per put")
    parser.add_argument("--role", choices=ROLES, help="run one role of the roles row (see `roles`)")
    parser.add_argument("--roles", action="store_true", help="the roles row: producer, consumer, controller")
    parser.add_argument("--workload", default="grpo")
    parser.add_argument("--nodes", default="")
    parser.add_argument("--meta", type=Path)
    parser.add_argument("--shm", action="store_true", help="roles: the same-host path on")
    args = parser.parse_args(argv)
    if args.role:
        import json

        result = role_main(args.role, args.workload, args.nodes.split(","), args.meta, args.shm)
        print(json.dumps(result))
        return result
    if args.roles:
        result = roles(args.workload, shm=args.shm)
        for role, entry in result.items():
            print(
                f"{role}: peak RSS grew {entry['grown_bytes'] / 2**20:.1f} MiB for "
                f"{entry['must_hold_bytes'] / 2**20:.1f} MiB it must hold ({entry['ratio']:.2f}x)"
            )
        return result
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
