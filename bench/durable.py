"""A durable worker (`--data-dir`) against a worker in memory: put and gather throughput of the
GRPO batch, and how long a worker holding N GiB takes to come back after SIGKILL.

`python -m bench.durable [--repeats 5] [--recovery-gib 4] [--cold]`. Three workers, one after
the other, each alone: in memory, `--data-dir` (written behind the put), `--data-dir --sync`.
Each repeat puts the whole batch on the worker, gathers it, and clears it (a delete record for
the durable ones); *durable* is the put's time until its record is on disk (write-behind: the
put, then polling `/v1/stats` until nothing is pending). Recovery: a write-behind worker is
filled with N GiB of GRPO batches, killed with SIGKILL once its log is on disk, and started
again on its directory; the figure is the start until it serves (its address printed: the log
is replayed before), and the bytes it holds are checked. Spill: a worker whose `--max-bytes`
holds one batch gathers a batch of which half was spilled to disk, against the same gather all
in memory. `--cold` drops the page cache first (root only), so the log is read from the disk,
not from memory.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.measure import check_columns, stats, timed
from bench.workloads import WORKLOADS, make_columns, payload_bytes

MODES = {"memory": [], "write-behind": ["--data-dir"], "sync": ["--data-dir", "--sync"]}


def _stats(node: str) -> dict[str, Any]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
    with opener.open(f"http://{node}/v1/stats", timeout=30) as response:
        return json.loads(response.read())


def _until_durable(node: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while (_stats(node).get("durable") or {}).get("pending_records"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{node}: its log did not catch up within {timeout} s")
        time.sleep(0.005)


def _worker_args(mode: str, directory: Path) -> list[str]:
    args: list[str] = []
    for flag in MODES[mode]:
        args.append(flag)
        if flag == "--data-dir":
            args.append(str(directory))
    return args


def throughput(workload: str = "grpo", repeats: int = 5) -> dict[str, Any]:
    """Per mode: put, durable and gather figures (`measure.stats`), and ratios to memory."""
    from distbatch import DistributedBatchMemory, ShardClient
    from distbatch.launch import spawn_workers

    columns = make_columns(WORKLOADS[workload], 0)
    nbytes = payload_bytes(columns)
    out: dict[str, Any] = {"workload": workload, "bytes": nbytes, "modes": {}}
    bar = tqdm(total=len(MODES) * repeats, desc="durable: put / gather", unit="put")
    for mode in MODES:
        with tempfile.TemporaryDirectory(prefix="distbatch-durable-") as tmp:
            (worker,) = spawn_workers(1, args=_worker_args(mode, Path(tmp)), env={"DISTBATCH_TOKEN": ""})
            try:
                with ShardClient() as client:
                    batch = DistributedBatchMemory.from_dict(columns)
                    put, durable, gather = [], [], []
                    for _ in range(repeats):
                        began = time.perf_counter()
                        remote = batch.to_remote(worker.node, client)
                        put.append(time.perf_counter() - began)
                        if mode != "memory":
                            _until_durable(worker.node)
                        durable.append(time.perf_counter() - began)
                        seconds, got = timed(remote.get_data)
                        gather.append(seconds)
                        check_columns(got, columns)
                        remote.clear()
                        bar.update()
                    if mode != "memory":
                        _until_durable(worker.node)
                    log = _stats(worker.node).get("durable")
            finally:
                worker.stop()
        out["modes"][mode] = {
            "put": stats(put, nbytes),
            "durable": stats(durable, nbytes),
            "gather": stats(gather, nbytes),
            "log": log,
        }
    bar.close()
    memory = out["modes"]["memory"]
    for figures in out["modes"].values():
        for key in ("put", "durable", "gather"):
            figures[f"{key}_ratio"] = figures[key]["gbps"] / memory[key]["gbps"]
    return out


def recovery(gib: float = 4.0, workload: str = "grpo", cold: bool = False) -> dict[str, Any]:
    """Fill a write-behind worker with `gib` GiB, SIGKILL it, start it again on its directory:
    seconds until it serves, and what it holds."""
    from distbatch import DistributedBatchMemory, ShardClient
    from distbatch.launch import spawn_workers

    columns = make_columns(WORKLOADS[workload], 0)
    per_put = payload_bytes(columns)
    puts = max(1, round(gib * (1 << 30) / per_put))
    with tempfile.TemporaryDirectory(prefix="distbatch-durable-") as tmp:
        args = _worker_args("write-behind", Path(tmp))
        (first,) = spawn_workers(1, args=args, env={"DISTBATCH_TOKEN": ""})
        try:
            with ShardClient() as client:
                for _ in tqdm(range(puts), desc=f"durable: filling {gib:g} GiB", unit="put"):
                    DistributedBatchMemory.from_dict(columns).to_remote(first.node, client)  # new ids each
            began = time.perf_counter()
            _until_durable(first.node)
            drained = time.perf_counter() - began
            held = _stats(first.node)["bytes"]
            disk = _stats(first.node)["durable"]["disk_bytes"]
        finally:
            first.kill()
        if cold:
            _drop_page_cache()
        seconds, workers = timed(
            lambda: spawn_workers(1, args=args, env={"DISTBATCH_TOKEN": ""}, startup_timeout=900)
        )
        (second,) = workers
        try:
            recovered = _stats(second.node)
        finally:
            second.stop()
    if recovered["bytes"] != held:
        raise RuntimeError(f"recovered {recovered['bytes']} bytes, the worker held {held}")
    return {
        "puts": puts,
        "bytes": held,
        "disk_bytes": disk,
        "drain_after_last_put_s": drained,
        "recovery_s": seconds,
        "recovery_gbps": held / seconds / 1e9,
        "cold": cold,
    }


def _drop_page_cache() -> bool:
    """Write dirty pages out and drop the page cache (root only); whether it was dropped."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def spilled_gather(workload: str = "grpo", repeats: int = 5, cold: bool = False) -> dict[str, Any]:
    """A worker with `--data-dir` and `--max-bytes` 1.25 batches: the batch is put in two halves and
    gathered (all in memory: the baseline); then half a batch more is put, which spills the
    coldest half to disk, and the batch is gathered again (half read back from the record
    files). `cold`: the page cache is dropped before each such gather (root), so the half comes
    from the disk itself."""
    from distbatch import DistributedBatchMemory, ShardClient
    from distbatch.launch import spawn_workers

    columns = make_columns(WORKLOADS[workload], 0)
    nbytes = payload_bytes(columns)
    with tempfile.TemporaryDirectory(prefix="distbatch-durable-") as tmp:
        args = [*_worker_args("write-behind", Path(tmp)), "--max-bytes", str(nbytes * 5 // 4)]
        (worker,) = spawn_workers(1, args=args, env={"DISTBATCH_TOKEN": ""})
        try:
            with ShardClient() as client:
                batch = DistributedBatchMemory.from_dict(columns)
                half = len(batch) // 2
                handle = DistributedBatchMemory.concat(
                    [batch[:half].to_remote(worker.node, client), batch[half:].to_remote(worker.node, client)]
                )
                text = handle.to_json()
                in_memory, spilled = [], []
                bar = tqdm(total=2 * repeats, desc="durable: gather, half spilled", unit="gather")
                for _ in range(repeats):
                    seconds, got = timed(DistributedBatchMemory.from_json(text, client).get_data)
                    check_columns(got, columns)
                    in_memory.append(seconds)
                    bar.update()
                filler = DistributedBatchMemory.from_dict(make_columns(WORKLOADS[workload], 1))
                filler[: len(filler) // 2].to_remote(worker.node, client)  # past memory: the coldest go
                _until_durable(worker.node)
                before = _stats(worker.node)
                dropped = False
                for _ in range(repeats):
                    if cold:
                        dropped = _drop_page_cache()
                    seconds, got = timed(DistributedBatchMemory.from_json(text, client).get_data)
                    check_columns(got, columns)
                    spilled.append(seconds)
                    bar.update()
                bar.close()
                after = _stats(worker.node)
        finally:
            worker.stop()
    result = {
        "bytes": nbytes,
        "spilled_bytes": before["on_disk_bytes"],
        "read_back_bytes": after["read_back_bytes_total"] - before["read_back_bytes_total"],
        "in_memory": stats(in_memory, nbytes),
        "half_spilled": stats(spilled, nbytes),
        "cold": dropped,
    }
    result["ratio"] = result["half_spilled"]["gbps"] / result["in_memory"]["gbps"]
    return result


def table(result: dict[str, Any]) -> str:
    lines = [
        f"durable worker, {result['workload']} batch ({result['bytes'] / 1e6:.1f} MB), medians:",
        f"  {'mode':14s} {'put GB/s':>9s} {'durable GB/s':>13s} {'gather GB/s':>12s} {'put/mem':>8s}"
        f" {'durable/mem':>12s} {'gather/mem':>11s}",
    ]
    for mode, f in result["modes"].items():
        lines.append(
            f"  {mode:14s} {f['put']['gbps']:9.2f} {f['durable']['gbps']:13.2f} {f['gather']['gbps']:12.2f}"
            f" {f['put_ratio']:7.2f}x {f['durable_ratio']:11.2f}x {f['gather_ratio']:10.2f}x"
        )
    rec = result.get("recovery")
    if rec:
        lines.append(
            f"  recovery: {rec['bytes'] / 2**30:.2f} GiB ({rec['puts']} puts,"
            f" {rec['disk_bytes'] / 2**30:.2f} GiB on disk) back in {rec['recovery_s']:.2f} s"
            f" ({rec['recovery_gbps']:.2f} GB/s"
            f"{', page cache dropped' if rec['cold'] else ', log in the page cache'}); the log caught up"
            f" {rec['drain_after_last_put_s']:.2f} s after the last put"
        )
    spill = result.get("spill")
    if spill:
        lines.append(
            f"  gather with {spill['spilled_bytes'] / spill['bytes']:.0%} of the batch spilled"
            f" ({'page cache dropped' if spill['cold'] else 'in the page cache'}):"
            f" {spill['half_spilled']['gbps']:.2f} GB/s, {spill['ratio']:.2f}x all in memory"
            f" ({spill['in_memory']['gbps']:.2f} GB/s); {spill['read_back_bytes'] / 1e6:.0f} MB read back"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="grpo", choices=sorted(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--recovery-gib", type=float, default=4.0, help="0 skips the recovery row")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before recovery (root)")
    parser.add_argument("--result", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args(argv)
    result = throughput(args.workload, args.repeats)
    result["spill"] = spilled_gather(args.workload, args.repeats, args.cold)
    if args.recovery_gib > 0:
        result["recovery"] = recovery(args.recovery_gib, args.workload, args.cold)
    print(table(result))
    if args.result is not None:
        args.result.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
