"""Same-host puts and gathers (shared memory) next to Ray's same-node put/get and a memcpy.

For one workload's ragged batch and its dense variant, in one run on one machine:

- `memcpy`: one copy of the batch's bytes between two buffers already mapped in (the ceiling
  for anything that copies once);
- `put`: distbatch `to_remote` to workers on this host (each chunk written once into a sealed
  memfd the worker adopts), and Ray's `ray.put` of the same dict of tensors from the driver;
- `gather`: a fresh REMOTE batch's `get_data()` (every field, from every worker), and Ray's
  `ray.get` of the same batch put by an actor on this node;
- `gather+read`: the same, then one pass over every byte (a sum per tensor), since a mapped
  region's pages are faulted in on first touch: what a trainer pays before it has used the data;
- `region`: writing the batch's bytes into fresh sealed memfds, one share per worker at once,
  from one contiguous buffer: what the kernel charges any put through a new region for its
  pages (allocated and zeroed; a sealed region can never be reused). The put's limit.

Run alone: `python -m bench.same_host [--workload grpo] [--repeats 5]`; `python -m bench`
runs it for its `--peers` workloads.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from tqdm import tqdm

from bench.measure import check_columns, stats, stored_on_workers, timed
from bench.workloads import WORKLOADS, make_columns, make_dense_columns, payload_bytes
from distbatch import DistributedBatchMemory
from distbatch.transport.shm import disabled_reason, sealed_memfd

KINDS = ("ragged", "dense")


def read_every_byte(columns: dict[str, Any]) -> float:
    """Touch every tensor byte once (a sum per tensor); returns the checksum."""
    total = 0.0
    for column in columns.values():
        for value in column if isinstance(column, list) else [column]:
            if isinstance(value, torch.Tensor):
                total += float(value.reshape(-1).view(torch.uint8).sum()) if value.numel() else 0.0
    return total


def memcpy_seconds(nbytes: int, repeats: int) -> list[float]:
    """One copy of `nbytes` between two buffers whose pages are already mapped in."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    return [timed(lambda: dst.copy_(src))[0] for _ in range(repeats)]


def fresh_region_seconds(nbytes: int, workers: int, repeats: int) -> list[float]:
    """Writing `nbytes` into fresh sealed memfds, one share per worker, all at once (threads)."""
    share = torch.ones(nbytes // workers, dtype=torch.uint8).numpy().data

    def write_one(_: int) -> None:
        fd, _size = sealed_memfd([share])
        os.close(fd)

    with ThreadPoolExecutor(workers) as pool:
        return [timed(lambda: list(pool.map(write_one, range(workers))))[0] for _ in range(repeats)]


def bench_ours(columns: dict[str, Any], workers: int, repeats: int, bar: tqdm) -> dict[str, Any]:
    """Same-host put, gather and gather+read of `columns` with `workers` local workers."""
    nbytes = payload_bytes(columns)
    with stored_on_workers(columns, workers, repeats, bar) as stored:
        client, nodes, batch = stored.client, stored.nodes, stored.batch
        meta = batch.meta
        before = client.traffic()
        gather, read, gathered = [], [], {}
        for _ in range(repeats):
            started = time.perf_counter()
            gathered = DistributedBatchMemory.from_meta(meta, client).get_data()
            gather.append(time.perf_counter() - started)
            read_every_byte(gathered)
            read.append(time.perf_counter() - started)
            bar.update()
        used = client.traffic() - before
        check_columns(gathered, columns)
        out = {
            "put": stats(stored.put_seconds, nbytes),
            "gather": stats(gather, nbytes),
            "gather_read": stats(read, nbytes),
            "same_host_requests": used.same_host_requests,
            "http_bytes": used.total,
            "same_host_bytes": used.same_host_bytes,
            "shared_regions": sum(client.stats(n)["shared_regions"] for n in nodes),
        }
        batch.clear()
    return out


def bench_ray(make: Callable[[], dict[str, Any]], repeats: int) -> dict[str, Any]:
    """Ray same-node: driver `ray.put` of the batch, and `ray.get` (+ read) of one an actor put."""
    import ray

    from distbatch.launch.ray_actors import init_local_ray

    columns = make()
    nbytes = payload_bytes(columns)
    init_local_ray(num_cpus=2, ignore_reinit_error=True)
    try:

        @ray.remote
        class Producer:
            def __init__(self) -> None:
                self.columns = make()

            def put(self) -> Any:
                return [ray.put(self.columns)]

        puts = []
        for _ in range(repeats):
            seconds, ref = timed(lambda: ray.put(columns))
            puts.append(seconds)
            del ref
        producer = Producer.remote()  # type: ignore[attr-defined]
        gets, reads = [], []
        for _ in range(repeats):
            (ref,) = ray.get(producer.put.remote())
            started = time.perf_counter()
            got = ray.get(ref)
            gets.append(time.perf_counter() - started)
            read_every_byte(got)
            reads.append(time.perf_counter() - started)
            del got, ref
        ray.kill(producer)
        return {
            "put": stats(puts, nbytes),
            "gather": stats(gets, nbytes),
            "gather_read": stats(reads, nbytes),
        }
    finally:
        ray.shutdown()


def run(
    workload: str, seed: int, workers: int, repeats: int, use_ray: bool, bar: tqdm | None = None
) -> dict[str, Any]:
    """Both kinds of batch: memcpy, ours and (with `use_ray`) Ray, plus the ratios the issue sets."""
    reason = disabled_reason()
    if reason is not None:
        return {"skipped": reason}
    own_bar = bar is None
    bar = bar or tqdm(total=len(KINDS) * 2 * repeats, desc="same-host", unit="step")
    out: dict[str, Any] = {}
    try:
        for kind in KINDS:
            make = (
                (lambda: make_dense_columns(WORKLOADS[workload], seed))
                if kind == "dense"
                else (lambda: make_columns(WORKLOADS[workload], seed))
            )
            columns = make()
            nbytes = payload_bytes(columns)
            bar.set_postfix_str(f"same-host {kind}")
            entry: dict[str, Any] = {"payload_bytes": nbytes}
            entry["memcpy"] = stats(memcpy_seconds(nbytes, repeats), nbytes)
            entry["region"] = stats(fresh_region_seconds(nbytes, workers, repeats), nbytes)
            entry["distbatch"] = bench_ours(columns, workers, repeats, bar)
            del columns
            if use_ray:
                bar.set_postfix_str(f"same-host {kind} Ray")
                entry["ray"] = bench_ray(make, repeats)
            entry["ratios"] = same_host_ratios(entry)
            out[kind] = entry
    finally:
        if own_bar:
            bar.close()
    return out


def same_host_ratios(entry: dict[str, Any]) -> dict[str, float]:
    ours, copy = entry["distbatch"], entry["memcpy"]["gbps"]
    out = {
        "gather_vs_memcpy": ours["gather"]["gbps"] / copy,
        "gather_read_vs_memcpy": ours["gather_read"]["gbps"] / copy,
        "put_vs_memcpy": ours["put"]["gbps"] / copy,
        "put_vs_region": ours["put"]["gbps"] / entry["region"]["gbps"],
        "region_vs_memcpy": entry["region"]["gbps"] / copy,
    }
    ray = entry.get("ray")
    if ray:
        out["gather_vs_ray"] = ours["gather"]["gbps"] / ray["gather"]["gbps"]
        out["gather_read_vs_ray_read"] = ours["gather_read"]["gbps"] / ray["gather_read"]["gbps"]
        out["put_vs_ray"] = ours["put"]["gbps"] / ray["put"]["gbps"]
    return out


def table(name: str, result: dict[str, Any]) -> str:
    """The same-host rows of the summary (GiB/s: the issue's anchors are in GiB/s)."""
    if "skipped" in result:
        return f"same host, {name}: skipped ({result['skipped']})"
    gib = 1e9 / (1 << 30)
    lines = [
        f"same host, {name} (GiB/s, medians; ours over Ray / memcpy / a fresh region in the same run):",
        f"  {'batch':<8} {'memcpy':>7} {'region':>7} {'put':>7} {'Ray put':>8} {'gather':>8}"
        f" {'Ray get':>8} {'+read':>7} {'Ray+read':>9}   {'put/Ray':>8} {'get/Ray':>8} {'get/memcpy':>10}"
        f" {'put/memcpy':>10} {'put/region':>10}",
    ]
    nan = float("nan")
    for kind, entry in result.items():
        ours, ray, q = entry["distbatch"], entry.get("ray") or {}, entry["ratios"]

        def g(stat: dict[str, Any] | None) -> float:
            return stat["gbps"] * gib if stat else nan

        lines.append(
            f"  {kind:<8} {g(entry['memcpy']):>7.2f} {g(entry.get('region')):>7.2f} {g(ours['put']):>7.2f}"
            f" {g(ray.get('put')):>8.2f} {g(ours['gather']):>8.2f}"
            f" {g(ray.get('gather')):>8.2f} {g(ours['gather_read']):>7.2f}"
            f" {g(ray.get('gather_read')):>9.2f}   {q.get('put_vs_ray', nan):>7.2f}x"
            f" {q.get('gather_vs_ray', nan):>7.2f}x {q['gather_vs_memcpy']:>9.2f}x"
            f" {q['put_vs_memcpy']:>9.2f}x"
            f" {q.get('put_vs_region', nan):>9.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.same_host", description=__doc__)
    parser.add_argument("--workload", default="grpo", choices=sorted(WORKLOADS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-ray", action="store_true")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    from bench.baselines import ray_available

    result = run(args.workload, args.seed, args.workers, args.repeats, not args.no_ray and ray_available())
    print(table(args.workload, result))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)
    return result


if __name__ == "__main__":
    main()
