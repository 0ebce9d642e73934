"""`python -m distbatch.bench`: distbatch vs raw TCP, pickle-over-HTTP, base64-JSON and Ray, in one run.

Every number is a median over `--repeats` runs (min and max kept), and every
comparison is a ratio against a baseline measured in the same run on the same
machine. Results go to `<out>/results.json` and, with matplotlib, `<out>/bench.png`.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from distbatch import DistributedBatchMemory, ShardClient
from distbatch.bench import baselines
from distbatch.bench.workloads import WORKLOADS, make_columns, payload_bytes
from distbatch.launch import spawn_workers


def _stats(seconds: list[float], nbytes: int) -> dict[str, Any]:
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


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def check_columns(got: dict[str, Any], want: dict[str, list]) -> None:
    """Every gathered value equals what was put (the benchmark's checksum)."""
    for name, values in want.items():
        column = got[name]
        items = list(column.unbind(0)) if isinstance(column, torch.Tensor) else list(column)
        if len(items) != len(values) or not all(_same(g, w) for g, w in zip(items, values)):
            raise AssertionError(f"gathered field {name!r} differs from what was put")


def bench_distbatch(
    name: str, columns: dict[str, list], workers: int, repeats: int, bar: tqdm
) -> dict[str, Any]:
    """Put / gather throughput of distbatch with `workers` worker processes on loopback."""
    nbytes = payload_bytes(columns)
    local = DistributedBatchMemory.from_dict(columns)
    shares = local.chunk(workers)
    procs = spawn_workers(workers)
    client = ShardClient()
    out: dict[str, Any] = {}
    try:
        nodes = [p.node for p in procs]
        put_times: list[float] = []
        batch = DistributedBatchMemory()
        with ThreadPoolExecutor(workers) as pool:
            for r in range(repeats):
                seconds, parts = _timed(
                    lambda: list(pool.map(lambda sn: sn[0].to_remote(sn[1], client), zip(shares, nodes)))
                )
                put_times.append(seconds)
                batch = DistributedBatchMemory.concat(parts)
                if r < repeats - 1:
                    batch.clear()
                bar.update()
        out["put"] = _stats(put_times, nbytes)
        stored = sum(client.stats(n)["bytes"] for n in nodes)
        out["stored_bytes"] = stored
        meta = batch.meta
        if meta is None:
            raise RuntimeError("the benchmark batch is not REMOTE after the put")

        def fresh() -> DistributedBatchMemory:
            return DistributedBatchMemory.from_meta(meta, client)  # no cached columns

        gathered: dict[str, Any] = {}
        gather_times = []
        for _ in range(repeats):
            seconds, gathered = _timed(lambda: fresh().get_data())
            gather_times.append(seconds)
            bar.update()
        check_columns(gathered, columns)
        out["gather_all"] = _stats(gather_times, nbytes)

        field_bytes = sum(t.numel() * t.element_size() for t in columns["input_ids"])
        one = [_timed(lambda: fresh()["input_ids"])[0] for _ in range(repeats)]
        out["gather_one_field"] = _stats(one, field_bytes)
        chunk = fresh().chunk_balanced(4, group_size=WORKLOADS[name].group, length_field="input_ids")[0]
        chunk_bytes = chunk.meta.total_bytes() if chunk.meta is not None else 0
        dp = [
            _timed(lambda: DistributedBatchMemory.from_meta(chunk.meta, client).to_local())[0]
            for _ in range(repeats)
        ]
        out["gather_dp_chunk"] = _stats(dp, chunk_bytes)
        meta_json = len(batch.to_json())
        out["metadata"] = {
            "json_bytes": meta_json,
            "bytes_per_task": meta_json / len(batch),
            "bytes_per_shard": meta_json / (len(batch) * len(batch.fields)),
            "fraction_of_payload": meta_json / nbytes,
        }
        out["cleared_shards"] = batch.clear()
        out["left_bytes"] = sum(client.stats(n)["bytes"] for n in nodes)
    finally:
        client.close()
        for p in procs:
            p.stop()
    return out


def bench_baselines(
    name: str, seed: int, nbytes: int, repeats: int, use_ray: bool, bar: tqdm
) -> dict[str, Any]:
    command = [sys.executable, "-m", "distbatch.bench.baselines", "--workload", name, "--seed", str(seed)]
    server = subprocess.Popen([*command, "--raw-bytes", str(nbytes)], stdout=subprocess.PIPE, text=True)
    out: dict[str, Any] = {}
    try:
        if server.stdout is None:
            raise RuntimeError("baseline server has no stdout pipe")
        raw_node, http_node = server.stdout.readline().split()
        buffer = bytearray(nbytes)
        out["raw_tcp"] = _stats(
            [baselines.raw_fetch(raw_node, nbytes, buffer) for _ in range(repeats)], nbytes
        )
        bar.update()
        pickle_times, b64_times = [], []
        for _ in range(repeats):
            pickle_times.append(baselines.pickle_fetch(http_node)[0])
            b64_times.append(baselines.b64json_fetch(http_node)[0])
            bar.update()
        out["pickle_http"] = _stats(pickle_times, nbytes)
        out["base64_json"] = _stats(b64_times, nbytes)
    finally:
        server.terminate()
        server.wait()
    if use_ray and baselines.ray_available():
        out["ray_object_store"] = _stats(baselines.ray_roundtrip(name, seed, repeats), nbytes)
    bar.update()
    return out


def bench_pipeline(name: str, steps: int) -> dict[str, Any] | None:
    """Median step time of the main job, distributed vs centralised (needs the repo's examples/)."""
    example = Path(__file__).resolve().parents[2] / "examples" / "grpo_pipeline.py"
    if not example.exists():
        return None
    sys.path.insert(0, str(example.parent))
    import grpo_pipeline

    workload = WORKLOADS[name]
    argv = [
        "--prompts",
        str(max(workload.tasks // workload.group, 1)),
        "--n",
        str(workload.group),
        "--mean-len",
        str(workload.mean_len),
        "--max-len",
        str(workload.max_len),
        "--steps",
        str(steps),
    ]
    out = {}
    for mode, centralised in (("distributed", False), ("centralised", True)):
        report = grpo_pipeline.run_pipeline(
            grpo_pipeline.parse_args(argv), centralised=centralised, quiet=True
        )
        out[mode] = {
            "step_seconds": [s.seconds for s in report.steps],
            "median_s": statistics.median(s.seconds for s in report.steps),
            "controller_bytes": [s.controller_bytes for s in report.steps],
            "worker_bytes": [s.worker_bytes for s in report.steps],
        }
    return out


def ratios(result: dict[str, Any]) -> dict[str, float]:
    ours = result["distbatch"]["gather_all"]["gbps"]
    base = result["baselines"]
    out = {
        "gather_vs_raw_tcp": ours / base["raw_tcp"]["gbps"],
        "gather_vs_base64_json": ours / base["base64_json"]["gbps"],
        "gather_vs_pickle_http": ours / base["pickle_http"]["gbps"],
        "metadata_fraction": result["distbatch"]["metadata"]["fraction_of_payload"],
    }
    if "ray_object_store" in base:
        out["gather_vs_ray"] = ours / base["ray_object_store"]["gbps"]
    pipeline = result.get("pipeline")
    if pipeline:
        out["centralised_over_distributed_step"] = (
            pipeline["centralised"]["median_s"] / pipeline["distributed"]["median_s"]
        )
    return out


def plot(results: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = list(results["workloads"])
    series = [
        ("raw TCP (ceiling)", lambda r: r["baselines"]["raw_tcp"]),
        ("distbatch gather", lambda r: r["distbatch"]["gather_all"]),
        ("distbatch put", lambda r: r["distbatch"]["put"]),
        ("pickle / HTTP", lambda r: r["baselines"]["pickle_http"]),
        ("base64 JSON", lambda r: r["baselines"]["base64_json"]),
        ("Ray object store", lambda r: r["baselines"].get("ray_object_store")),
    ]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(series)
    for k, (label, pick) in enumerate(series):
        xs, ys, lo, hi = [], [], [], []
        for i, name in enumerate(names):
            stat = pick(results["workloads"][name])
            if stat is None:
                continue
            xs.append(i + k * width)
            ys.append(stat["gbps"])
            lo.append(stat["gbps"] - stat["gbps_range"][0])
            hi.append(stat["gbps_range"][1] - stat["gbps"])
        if xs:
            ax.bar(xs, ys, width, yerr=[lo, hi], label=label, capsize=2)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    ax.set_yscale("log")  # ratios between transports span two orders of magnitude
    ax.set_ylabel("GB/s, log scale (median, min-max)")
    ax.set_title(f"Moving one RL batch on loopback — {results['machine']['cpus']} cores")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workloads", default="small,grpo,long", help=f"comma list of {sorted(WORKLOADS)}")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--no-ray", action="store_true", help="skip Ray even if installed")
    parser.add_argument("--no-pipeline", action="store_true", help="skip the main job's step times")
    parser.add_argument("--pipeline-steps", type=int, default=3)
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    for n in names:
        if n not in WORKLOADS:
            parser.error(f"unknown workload {n!r}")
    import os

    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
        },
        "settings": vars(args) | {"out": str(args.out)},
        "workloads": {},
    }
    steps_per_workload = 2 * args.repeats + 2 + args.repeats + 2
    with tqdm(total=steps_per_workload * len(names), desc="bench", unit="step") as bar:
        for name in names:
            bar.set_postfix_str(name)
            columns = make_columns(WORKLOADS[name], args.seed)
            nbytes = payload_bytes(columns)
            result: dict[str, Any] = {"tasks": WORKLOADS[name].tasks, "payload_bytes": nbytes}
            result["distbatch"] = bench_distbatch(name, columns, args.workers, args.repeats, bar)
            del columns
            result["baselines"] = bench_baselines(name, args.seed, nbytes, args.repeats, not args.no_ray, bar)
            if not args.no_pipeline:
                result["pipeline"] = bench_pipeline(name, args.pipeline_steps)
            result["ratios"] = ratios(result)
            results["workloads"][name] = result
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    png = plot(results, args.out / "bench.png")
    print(summary(results))
    print(f"\nresults: {args.out / 'results.json'}" + (f", plot: {png}" if png else ""))
    return results


def summary(results: dict[str, Any]) -> str:
    lines = [
        f"machine: {results['machine']['cpus']} cores, Python {results['machine']['python']}, "
        f"torch {results['machine']['torch']}",
        f"{'workload':<8} {'payload':>9} {'raw TCP':>9} {'put':>8} {'gather':>8} {'1 field':>8} "
        f"{'dp chunk':>9} {'pickle':>8} {'b64json':>8} {'ray':>8}   gather/raw  gather/b64  meta",
    ]
    for name, r in results["workloads"].items():
        d, b, q = r["distbatch"], r["baselines"], r["ratios"]
        ray = b.get("ray_object_store")
        lines.append(
            f"{name:<8} {r['payload_bytes'] / 1e6:>7.0f}MB {b['raw_tcp']['gbps']:>8.2f}  "
            f"{d['put']['gbps']:>7.2f} {d['gather_all']['gbps']:>8.2f} {d['gather_one_field']['gbps']:>8.2f} "
            f"{d['gather_dp_chunk']['gbps']:>9.2f} {b['pickle_http']['gbps']:>8.2f} "
            f"{b['base64_json']['gbps']:>8.2f} "
            f"{(ray['gbps'] if ray else float('nan')):>8.2f}   {q['gather_vs_raw_tcp']:>9.2f}x "
            f"{q['gather_vs_base64_json']:>9.2f}x  {q['metadata_fraction']:.3%}"
        )
        p = r.get("pipeline")
        if p:
            lines.append(
                f"{'':<8} main job step: distributed {p['distributed']['median_s']:.2f}s, "
                f"centralised {p['centralised']['median_s']:.2f}s "
                f"({q['centralised_over_distributed_step']:.2f}x)"
            )
    lines.append("(GB/s, medians; ratios are distbatch gather-all over the baseline, same run)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
