"""`python -m bench.cuda`: a GPU batch's put and gather against the host-device copy limit.

A trainer's batch lives on the GPU. For one workload's ragged batch and its dense variant, on
one machine, in one run:

- `d2h` / `h2d`: copies of the batch's bytes between device memory and pinned host memory, one
  buffer each way (the link's limit: nothing that crosses it goes faster);
- `put`: the columns on the device, `to_remote` to workers on this host, one share per worker at
  once (each column copied to the host once, through the pinned ring of
  `distbatch.wire.host_copy`, then stored), until every worker holds it; over `d2h`;
- `gather`: `packed(field, device=...)` of every tensor field of a fresh REMOTE batch, until the
  values are on the device (each column gathered into one buffer, then copied up once); over
  `h2d`.

Without a CUDA device it measures nothing and says so. `--device cpu` runs the same steps with
CPU tensors and plain memory as the "link" (what the tests run: a check of the steps, not a
measurement). Run alone: `python -m bench.cuda [--workload grpo] [--repeats 5]`; `python -m
bench` runs it for its `--peers` workloads when a device is present.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from tqdm import tqdm

from bench.measure import stats, stored_on_workers
from bench.workloads import WORKLOADS, make_columns, make_dense_columns, payload_bytes
from distbatch import DistributedBatchMemory

KINDS = ("ragged", "dense")


def default_device() -> torch.device | None:
    """The first CUDA device, or None when there is none."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def on_device(columns: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The columns with every tensor (alone or in a list) on `device`; JSON values as they are."""
    moved: dict[str, Any] = {}
    for name, column in columns.items():
        if isinstance(column, torch.Tensor):
            moved[name] = column.to(device)
        else:
            moved[name] = [v.to(device) if isinstance(v, torch.Tensor) else v for v in column]
    synchronize(device)
    return moved


def link_seconds(nbytes: int, device: torch.device, repeats: int) -> dict[str, list[float]]:
    """Seconds per copy of `nbytes` from the device to pinned host memory and back (with
    `device` a CPU: between two buffers of host memory)."""
    pinned = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host.fill_(1)
    dev.copy_(host)  # both touched once: page faults are not the link's
    synchronize(device)
    out: dict[str, list[float]] = {"d2h": [], "h2d": []}
    for _ in range(repeats):
        for name, (dst, src) in (("d2h", (host, dev)), ("h2d", (dev, host))):
            synchronize(device)
            started = time.perf_counter()
            dst.copy_(src, non_blocking=pinned)
            synchronize(device)
            out[name].append(time.perf_counter() - started)
    return out


def tensor_fields(columns: dict[str, Any]) -> list[str]:
    return [
        name
        for name, column in columns.items()
        if isinstance(column, torch.Tensor) or (column and isinstance(column[0], torch.Tensor))
    ]


def host_values(column: Any) -> torch.Tensor:
    """A CPU column's values laid end to end, as `packed` gives them."""
    if isinstance(column, torch.Tensor):
        return column.reshape(-1) if column.dim() <= 1 else column.reshape(-1, *column.shape[2:])
    return torch.cat([v.reshape(-1) if v.dim() == 0 else v for v in column])


def bench_kind(columns: dict[str, Any], device: torch.device, workers: int, repeats: int) -> dict[str, Any]:
    """Put and gather of `columns` (CPU tensors, moved to `device` first) with local workers."""
    fields = tensor_fields(columns)
    gather: list[float] = []
    # A put from the device returns once its bytes are on the host (the pinned ring waits for
    # each chunk), so the put's time needs no synchronize of its own.
    with stored_on_workers(on_device(columns, device), workers, repeats, tqdm(disable=True)) as stored:
        meta = stored.batch.meta
        if meta is None:
            raise RuntimeError("the benchmark batch is not REMOTE after the put")
        got: dict[str, torch.Tensor] = {}
        for _ in range(repeats):
            fresh = DistributedBatchMemory.from_meta(meta, stored.client)
            started = time.perf_counter()
            got = {name: fresh.packed(name, device=device)[0] for name in fields}
            synchronize(device)
            gather.append(time.perf_counter() - started)
        for name in fields:  # the checksum: what came up is what went in
            if not torch.equal(got[name].cpu(), host_values(columns[name])):
                raise AssertionError(f"field {name!r} came back different")
        stored.batch.clear()
    tensor_bytes = sum(payload_bytes({name: columns[name]}) for name in fields)
    return {
        "put": stats(stored.put_seconds, payload_bytes(columns)),
        "gather": stats(gather, tensor_bytes),
        "fields": fields,
    }


def run(
    workload: str = "grpo", workers: int = 2, repeats: int = 5, device: torch.device | str | None = None
) -> dict[str, Any]:
    """Every row for `workload` (see the module docstring); `{"skipped": why}` without a device."""
    chosen = torch.device(device) if device is not None else default_device()
    if chosen is None:
        return {"skipped": "no CUDA device: nothing measured (--device cpu checks the steps)"}
    w = WORKLOADS[workload]
    result: dict[str, Any] = {"device": str(chosen), "workload": workload, "kinds": {}}
    if chosen.type == "cuda":
        result["device_name"] = torch.cuda.get_device_name(chosen)
    for kind in KINDS:
        columns = make_columns(w, 0) if kind == "ragged" else make_dense_columns(w, 0)
        entry = bench_kind(columns, chosen, workers, repeats)
        link = link_seconds(entry["put"]["bytes"], chosen, repeats)
        entry["d2h"] = stats(link["d2h"], entry["put"]["bytes"])
        entry["h2d"] = stats(link["h2d"], entry["put"]["bytes"])
        entry["put_over_d2h"] = entry["put"]["gbps"] / entry["d2h"]["gbps"]
        entry["gather_over_h2d"] = entry["gather"]["gbps"] / entry["h2d"]["gbps"]
        result["kinds"][kind] = entry
    return result


def table(result: dict[str, Any]) -> str:
    """The GPU rows of the summary (GB/s, medians), each beside its limit."""
    if "skipped" in result:
        return f"GPU rows: {result['skipped']}"
    device = result.get("device_name", result["device"])
    lines = [
        f"GPU, {result['workload']} on {device} (GB/s, medians; put over device-to-pinned-host, "
        "gather over pinned-host-to-device, same run):",
        f"  {'batch':<8} {'d2h':>7} {'put':>7} {'put/d2h':>8} {'h2d':>7} {'gather':>7} {'gather/h2d':>10}",
    ]
    for kind, e in result["kinds"].items():
        lines.append(
            f"  {kind:<8} {e['d2h']['gbps']:>7.2f} {e['put']['gbps']:>7.2f} {e['put_over_d2h']:>7.2f}x"
            f" {e['h2d']['gbps']:>7.2f} {e['gather']['gbps']:>7.2f} {e['gather_over_h2d']:>9.2f}x"
        )
    if result["device"] == "cpu":
        lines.append("  (--device cpu: the steps checked, the figures mean nothing)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.cuda", description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="grpo", choices=sorted(WORKLOADS))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--device", default=None, help="cuda, cuda:1, or cpu (a dry run); default: cuda:0 if there is one"
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON too")
    args = parser.parse_args(argv)
    result = run(args.workload, args.workers, args.repeats, args.device)
    print(table(result))
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
