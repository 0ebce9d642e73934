"""`python -m bench`: distbatch vs raw TCP, pickle-over-HTTP, base64-JSON, Ray and TransferQueue, in one run.

Every number is a median over `--repeats` runs (min and max kept), and every
comparison is a ratio against a baseline measured in the same run on the same
machine. For the `--peers` workloads (grpo by default) the peers also move a dense
variant of the batch ([tasks, width] tensors, e.g. 5,120 x 1,536): Ray's object store
(its best case) and TransferQueue's SimpleStorage, next to distbatch on the same batch; where
a CUDA device is present, both batches are also put from and gathered to it, beside the
device's copy bandwidth to and from pinned memory (`bench.cuda`). The `scaling` workload
times put, one-field gather, clear, chunk_balanced(8) and a pickle round trip of a REMOTE
batch from 1k to 100k tasks (`--max-tasks` caps it). The
`multimodal` workload puts and gathers a GRPO batch whose n responses per prompt share a ~1 MB
image, shared (stored and moved once) vs n copies vs TransferQueue (`bench.shared_fields`). The
`control_plane` workload has 256 consumers in 4 groups poll `get_meta` on one served
controller while a producer streams tasks: calls/s, tasks/s, p50/p99, every task exactly once
per group (`bench.control_plane`; `--control-plane-*` size it). The `durable` workload puts and
gathers the grpo batch on a worker in memory, with `--data-dir` and with `--sync`, and times a
worker holding `--durable-recovery-gib` GiB coming back after SIGKILL, and gathers a batch half
spilled to disk past `--max-bytes` (`bench.durable`).

Results go to `<out>/results.json` and, with matplotlib, `<out>/bench.png` and
`<out>/scaling.png`; TransferQueue's child process logs to `<out>/transferqueue-<workload>.log`.
Run it from the repository root (`scripts/bench` does): `bench` is not an installed package.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench import (
    areal,
    baselines,
    control_plane,
    cuda,
    durable,
    rss,
    same_host,
    scaling,
    shared_fields,
    transferqueue,
)
from bench.measure import check_columns, stats, stored_on_workers, timed
from bench.workloads import WORKLOADS, column_bytes, make_columns, make_dense_columns, payload_bytes
from distbatch import DistributedBatchMemory
from distbatch.transport.shm import ENV_SWITCH

ROOT = Path(__file__).resolve().parents[1]
TQ_MIN_REPEATS = 5  # repeats of each TransferQueue row at least (see bench_peers)
SCALING = "scaling"
CONTROL_PLANE = "control_plane"
DURABLE = "durable"
MULTIMODAL = "multimodal"


@contextlib.contextmanager
def http_only() -> Iterator[None]:
    """Clients made and used inside take HTTP even to workers on this host (`DISTBATCH_SHM=0`):
    the transport figures (put, gather, vs raw TCP, TransferQueue) are the HTTP path's."""
    old = os.environ.get(ENV_SWITCH)
    os.environ[ENV_SWITCH] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV_SWITCH, None)
        else:
            os.environ[ENV_SWITCH] = old


def bench_distbatch(
    name: str, columns: dict[str, Any], workers: int, repeats: int, bar: tqdm
) -> dict[str, Any]:
    """Put / gather throughput of distbatch with `workers` worker processes on loopback."""
    nbytes = payload_bytes(columns)
    out: dict[str, Any] = {}
    with stored_on_workers(columns, workers, repeats, bar) as stored:
        client, nodes, batch, meta = stored.client, stored.nodes, stored.batch, stored.batch.meta
        out["put"] = stats(stored.put_seconds, nbytes)
        out["stored_bytes"] = sum(client.stats(n)["bytes"] for n in nodes)

        def fresh() -> DistributedBatchMemory:
            return DistributedBatchMemory.from_meta(meta, client)  # no cached columns

        gathered: dict[str, Any] = {}
        gather_times = []
        for _ in range(repeats):
            seconds, gathered = timed(lambda: fresh().get_data())
            gather_times.append(seconds)
            bar.update()
        check_columns(gathered, columns)
        out["gather_all"] = stats(gather_times, nbytes)

        field_bytes = column_bytes(columns["input_ids"])
        one = [timed(lambda: fresh()["input_ids"])[0] for _ in range(repeats)]
        out["gather_one_field"] = stats(one, field_bytes)
        chunk_meta = (
            fresh().chunk_balanced(4, group_size=WORKLOADS[name].group, length_field="input_ids")[0].meta
        )
        if chunk_meta is None:
            raise RuntimeError("a dp chunk of the REMOTE batch has no metadata")
        chunk_bytes = chunk_meta.total_bytes()
        dp = [
            timed(lambda: DistributedBatchMemory.from_meta(chunk_meta, client).to_local())[0]
            for _ in range(repeats)
        ]
        out["gather_dp_chunk"] = stats(dp, chunk_bytes)
        meta_json = len(batch.to_json())
        out["metadata"] = {
            "json_bytes": meta_json,
            "bytes_per_task": meta_json / len(batch),
            "bytes_per_shard": meta_json / (len(batch) * len(batch.fields)),
            "fraction_of_payload": meta_json / nbytes,
        }
        out["cleared_shards"] = batch.clear()
        out["left_bytes"] = sum(client.stats(n)["bytes"] for n in nodes)
    return out


def bench_baselines(name: str, seed: int, nbytes: int, repeats: int, bar: tqdm) -> dict[str, Any]:
    """Raw TCP, pickle over HTTP and base64 JSON, served by a child process (`bench.baselines`)."""
    command = [sys.executable, "-m", "bench.baselines", "--workload", name, "--seed", str(seed)]
    server = subprocess.Popen(
        [*command, "--raw-bytes", str(nbytes)], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    out: dict[str, Any] = {}
    try:
        if server.stdout is None:
            raise RuntimeError("baseline server has no stdout pipe")
        raw_node, http_node = server.stdout.readline().split()
        buffer = bytearray(nbytes)
        out["raw_tcp"] = stats(
            [baselines.raw_fetch(raw_node, nbytes, buffer) for _ in range(repeats)], nbytes
        )
        bar.update()
        pickle_times, b64_times = [], []
        for _ in range(repeats):
            pickle_times.append(baselines.pickle_fetch(http_node)[0])
            b64_times.append(baselines.b64json_fetch(http_node)[0])
            bar.update()
        out["pickle_http"] = stats(pickle_times, nbytes)
        out["base64_json"] = stats(b64_times, nbytes)
    finally:
        server.terminate()
        server.wait()
    return out


def bench_peers(
    name: str, seed: int, workers: int, repeats: int, use_tq: bool, timeout: float, out_dir: Path, bar: tqdm
) -> dict[str, Any]:
    """distbatch on the dense variant, then TransferQueue's SimpleStorage on the dense and ragged batch."""
    columns = make_dense_columns(WORKLOADS[name], seed)
    out: dict[str, Any] = {
        "dense_shape": list(WORKLOADS[name].dense_shape),
        "dense_payload_bytes": payload_bytes(columns),
    }
    bar.set_postfix_str(f"{name} dense")
    with http_only():
        out["distbatch_dense"] = bench_distbatch(name, columns, workers, repeats, bar)
    del columns
    bar.set_postfix_str(f"{name} TransferQueue")
    skip = transferqueue.available() if use_tq else "--no-tq"
    if skip:
        out["transferqueue"] = {"skipped": skip}
    else:
        log = out_dir / f"transferqueue-{name}.log"
        # At least 5: a get through TransferQueue now and then takes a full garbage collection
        # (its metadata decoding fills the old generation; docs/guide/transferqueue-backend.md),
        # and a median of 3 lands on whichever mode 2 of them hit.
        repeats = max(repeats, TQ_MIN_REPEATS)
        out["transferqueue"] = transferqueue.run(name, seed, repeats, workers, timeout, log)
        # The same API with distbatch as TransferQueue's storage backend, over HTTP and same host.
        for key, same in (("tq_distbatch_http", False), ("tq_distbatch_same_host", True)):
            bar.set_postfix_str(f"{name} TransferQueue on Distbatch ({key[13:]})")
            log = out_dir / f"{key}-{name}.log"
            out[key] = transferqueue.run(
                name, seed, repeats, workers, timeout, log, backend="Distbatch", same_host=same
            )
    bar.update()
    return out


def bench_pipeline(name: str, steps: int) -> dict[str, Any] | None:
    """Median step time of the traffic job, distributed vs centralised (needs the repo's examples/)."""
    example = ROOT / "examples" / "grpo_pipeline.py"
    if not example.exists():
        return None
    sys.path.insert(0, str(example.parent))
    grpo_pipeline = importlib.import_module("grpo_pipeline")  # examples/ is not a package

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
    out.update(peer_ratios(result))
    pipeline = result.get("pipeline")
    if pipeline:
        out["centralised_over_distributed_step"] = (
            pipeline["centralised"]["median_s"] / pipeline["distributed"]["median_s"]
        )
    return out


def _ok(stat: Any) -> bool:
    return isinstance(stat, dict) and "put" in stat and "get" in stat


def peer_ratios(result: dict[str, Any]) -> dict[str, float]:
    """distbatch GB/s over the peer's on the same batch (> 1: distbatch is faster)."""
    peers = result.get("peers")
    if not peers:
        return {}
    out: dict[str, float] = {}
    tq = peers.get("transferqueue", {})
    ragged, dense = result["distbatch"], peers["distbatch_dense"]
    for kind, ours in (("ragged", ragged), ("dense", dense)):
        theirs = tq.get(kind)
        if _ok(theirs):
            out[f"{kind}_put_vs_transferqueue"] = ours["put"]["gbps"] / theirs["put"]["gbps"]
            out[f"{kind}_gather_vs_transferqueue"] = ours["gather_all"]["gbps"] / theirs["get"]["gbps"]
    out.update(backend_ratios(tq, peers, ragged))
    if "ray_object_store" in result["baselines"]:
        out["ragged_gather_vs_ray"] = (
            ragged["gather_all"]["gbps"] / result["baselines"]["ray_object_store"]["gbps"]
        )
    if "ray_dense" in peers:
        out["dense_gather_vs_ray"] = dense["gather_all"]["gbps"] / peers["ray_dense"]["gbps"]
    return out


def plot(results: dict[str, Any], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = list(results["workloads"])
    if not names:
        return None
    series = [
        ("raw TCP (ceiling)", lambda r: r["baselines"]["raw_tcp"]),
        ("distbatch gather", lambda r: r["distbatch"]["gather_all"]),
        ("distbatch put", lambda r: r["distbatch"]["put"]),
        ("pickle / HTTP", lambda r: r["baselines"]["pickle_http"]),
        ("base64 JSON", lambda r: r["baselines"]["base64_json"]),
        ("Ray object store", lambda r: r["baselines"].get("ray_object_store")),
        ("TransferQueue get", lambda r: _tq_get(r, "ragged")),
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
    plt.close(fig)
    return path


def _tq_get(result: dict[str, Any], kind: str) -> dict[str, Any] | None:
    theirs = (result.get("peers") or {}).get("transferqueue", {}).get(kind)
    return theirs["get"] if _ok(theirs) else None


def _sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of task counts: {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"task counts must be >= 1: {text!r}")
    return sizes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    choices = [*sorted(WORKLOADS), SCALING, CONTROL_PLANE, MULTIMODAL, DURABLE]
    parser.add_argument(
        "--workloads",
        default="small,grpo,long,scaling,control_plane",
        help=f"comma list of {choices} (default: %(default)s)",
    )
    parser.add_argument("--workers", type=int, default=2, help="worker processes (and TransferQueue units)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--no-ray", action="store_true", help="skip Ray even if installed")
    parser.add_argument("--no-tq", action="store_true", help="skip TransferQueue even if installed")
    parser.add_argument("--no-areal", action="store_true", help="skip AReaL's RTensor rows even if installed")
    parser.add_argument("--no-pipeline", action="store_true", help="skip the traffic job's step times")
    parser.add_argument(
        "--no-rss", action="store_true", help="skip the peak-RSS row of producer, consumer and controller"
    )
    parser.add_argument("--pipeline-steps", type=int, default=3)
    parser.add_argument(
        "--peers",
        default="grpo",
        help="comma list of workloads that also run the dense variant and TransferQueue ('' for none; "
        "default: %(default)s)",
    )
    parser.add_argument(
        "--peer-timeout", type=float, default=900.0, help="seconds for TransferQueue's child process"
    )
    parser.add_argument(
        "--scaling-sizes",
        type=_sizes,
        default=list(scaling.SIZES),
        help="comma list of task counts for the scaling run (default: 1000,3000,10000,30000,100000)",
    )
    parser.add_argument(
        "--max-tasks", type=int, default=None, help="largest scaling size to run (smoke checks)"
    )
    parser.add_argument(
        "--multimodal-prompts",
        type=int,
        default=shared_fields.PROMPTS,
        help="prompts in the multimodal batch, 8 responses and ~1 MB of image each (%(default)s)",
    )
    parser.add_argument(
        "--durable-recovery-gib",
        type=float,
        default=4.0,
        help="GiB a durable worker holds when killed and recovered (0: no recovery row; %(default)s)",
    )
    _control_plane_args(parser)
    args = parser.parse_args(argv)
    args.names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    for n in args.names:
        if n not in choices:
            parser.error(f"unknown workload {n!r} (choose from {choices})")
    args.peer_names = {n.strip() for n in args.peers.split(",") if n.strip()}
    for n in args.peer_names:
        if n not in WORKLOADS:
            parser.error(f"unknown --peers workload {n!r}")
    if args.max_tasks is not None:
        args.scaling_sizes = [s for s in args.scaling_sizes if s <= args.max_tasks]
        if not args.scaling_sizes:
            parser.error(f"--max-tasks {args.max_tasks} is below every scaling size")
    if args.workers < 1 or args.repeats < 1:
        parser.error("--workers and --repeats must be >= 1")
    try:
        control_plane.scenario_of(args, "control_plane_")
    except ValueError as exc:
        parser.error(f"--control-plane-*: {exc}")
    return args


def _control_plane_args(parser: argparse.ArgumentParser) -> None:
    d = control_plane.Scenario()
    for name, default, what in (
        ("consumers", d.consumers, "consumer threads"),
        ("groups", d.groups, "consumer groups they split into"),
        ("tasks", d.tasks, "tasks the producer announces per run"),
        ("batch-size", d.batch_size, "tasks per get_meta"),
    ):
        parser.add_argument(
            f"--control-plane-{name}", type=int, default=default, help=f"{what} (%(default)s)"
        )
    parser.add_argument(
        "--control-plane-steps",
        type=control_plane.steps_list,
        default=list(control_plane.DEFAULT_STEPS),
        help="comma list of a consumer's seconds of work per batch, one run each (0: flat out; "
        "default: 0.5,0)",
    )


def backend_ratios(tq: dict[str, Any], peers: dict[str, Any], ragged: dict[str, Any]) -> dict[str, float]:
    """Distbatch as TransferQueue's backend over its SimpleStorage, same API and batch; and its
    get through TransferQueue over distbatch's own gather (the API's overhead on our path)."""
    out: dict[str, float] = {}
    for key in ("tq_distbatch_http", "tq_distbatch_same_host"):
        ours = peers.get(key, {})
        for kind in ("ragged", "strided", "dense"):
            if _ok(ours.get(kind)) and _ok(tq.get(kind)):
                for op in ("put", "get"):
                    out[f"{kind}_{key}_{op}_vs_simple"] = ours[kind][op]["gbps"] / tq[kind][op]["gbps"]
    http = peers.get("tq_distbatch_http", {}).get("ragged")
    if _ok(http):
        out["ragged_tq_distbatch_get_vs_direct"] = http["get"]["gbps"] / ragged["gather_all"]["gbps"]
    return out


def backend_summary(name: str, r: dict[str, Any]) -> str:
    """TransferQueue's API on SimpleStorage and on Distbatch, same batches (GB/s, medians)."""
    peers, q = r["peers"], r["ratios"]
    lines = [
        f"TransferQueue backends, {name} (kv_batch_put / kv_batch_get, GB/s; ratio over SimpleStorage):",
        f"  {'batch':<8} {'SimpleStorage put':>17} {'get':>6}   {'Distbatch HTTP put':>18} {'get':>6}"
        f" {'ratio':>11}   {'same host put':>13} {'get':>6} {'ratio':>11}",
    ]
    nan = float("nan")
    for kind in ("ragged", "strided", "dense"):
        cells = []
        for key in ("transferqueue", "tq_distbatch_http", "tq_distbatch_same_host"):
            stat = peers.get(key, {}).get(kind)
            cells += [stat["put"]["gbps"], stat["get"]["gbps"]] if _ok(stat) else [nan, nan]
        http, same = (
            "{:.1f}x/{:.1f}x".format(
                q.get(f"{kind}_{key}_put_vs_simple", nan), q.get(f"{kind}_{key}_get_vs_simple", nan)
            )
            for key in ("tq_distbatch_http", "tq_distbatch_same_host")
        )
        lines.append(
            f"  {kind:<8} {cells[0]:>17.3f} {cells[1]:>6.3f}   {cells[2]:>18.3f} {cells[3]:>6.3f}"
            f" {http:>11}   {cells[4]:>13.3f} {cells[5]:>6.3f} {same:>11}"
        )
    lines.append("  (strided: the ragged batch as strided nested tensors, TransferQueue's default layout)")
    if "ragged_tq_distbatch_get_vs_direct" in q:
        lines.append(
            f"  ragged get through TransferQueue over distbatch's own gather (HTTP): "
            f"{q['ragged_tq_distbatch_get_vs_direct']:.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    names = [n for n in args.names if n not in (SCALING, CONTROL_PLANE, MULTIMODAL, DURABLE)]
    settings = {k: v for k, v in vars(args).items() if k not in ("names", "peer_names")}
    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
        },
        "settings": settings | {"out": str(args.out)},
        "workloads": {},
    }
    use_ray = not args.no_ray and baselines.ray_available()
    args.out.mkdir(parents=True, exist_ok=True)
    r = args.repeats
    steps = {
        n: 2 * r + (r + 1) + use_ray + 1 + (2 * r + 1 + 4 * r + 1 if n in args.peer_names else 0)
        for n in names
    }
    with tqdm(total=sum(steps.values()), desc="bench", unit="step", disable=not names) as bar:
        for name in names:
            bar.set_postfix_str(name)
            peer = name in args.peer_names
            columns = make_columns(WORKLOADS[name], args.seed)
            nbytes = payload_bytes(columns)
            result: dict[str, Any] = {"tasks": WORKLOADS[name].tasks, "payload_bytes": nbytes}
            with http_only():
                result["distbatch"] = bench_distbatch(name, columns, args.workers, args.repeats, bar)
            del columns
            result["baselines"] = bench_baselines(name, args.seed, nbytes, args.repeats, bar)
            if peer:
                result["peers"] = bench_peers(
                    name,
                    args.seed,
                    args.workers,
                    args.repeats,
                    not args.no_tq,
                    args.peer_timeout,
                    args.out,
                    bar,
                )
            if use_ray:
                bar.set_postfix_str(f"{name} Ray")
                kinds = ("ragged", "dense") if peer else ("ragged",)
                ray_times = baselines.ray_roundtrips(name, args.seed, args.repeats, kinds)
                result["baselines"]["ray_object_store"] = stats(ray_times["ragged"], nbytes)
                if peer:
                    result["peers"]["ray_dense"] = stats(
                        ray_times["dense"], result["peers"]["dense_payload_bytes"]
                    )
                bar.update()
            if peer:
                bar.set_postfix_str(f"{name} same host")
                result["same_host"] = same_host.run(name, args.seed, args.workers, args.repeats, use_ray, bar)
                if not args.no_rss:
                    bar.set_postfix_str(f"{name} peak RSS")
                    result["rss"] = {
                        "http": rss.roles(name, args.workers),
                        "same_host": rss.roles(name, args.workers, shm=True),
                    }
                if not args.no_areal:
                    bar.set_postfix_str(f"{name} AReaL RTensor")
                    result["areal"] = areal.run(name, args.seed, args.repeats, args.peer_timeout, args.out)
                if cuda.default_device() is not None:  # the GPU rows, where there is a GPU
                    bar.set_postfix_str(f"{name} GPU")
                    result["cuda"] = cuda.run(name, args.workers, args.repeats)
                bar.update()
            if not args.no_pipeline:
                bar.set_postfix_str(f"{name} traffic job")
                result["pipeline"] = bench_pipeline(name, args.pipeline_steps)
            bar.update()
            result["ratios"] = ratios(result)
            results["workloads"][name] = result
    if SCALING in args.names:
        with http_only():
            results[SCALING] = scaling.run_scaling(args.scaling_sizes, args.workers, args.repeats, args.seed)
    if MULTIMODAL in args.names:
        with http_only():
            results[MULTIMODAL] = shared_fields.run(
                args.workers,
                args.repeats,
                args.seed,
                not args.no_tq,
                args.peer_timeout,
                args.out,
                args.multimodal_prompts,
            )
    if CONTROL_PLANE in args.names:
        scenario = control_plane.scenario_of(args, "control_plane_")
        results[CONTROL_PLANE] = control_plane.run_steps(scenario, args.control_plane_steps)
    if DURABLE in args.names:
        results[DURABLE] = durable.throughput("grpo", args.repeats)
        results[DURABLE]["spill"] = durable.spilled_gather("grpo", args.repeats)
        if args.durable_recovery_gib > 0:
            results[DURABLE]["recovery"] = durable.recovery(args.durable_recovery_gib, "grpo")
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    pngs = [plot(results, args.out / "bench.png")]
    if SCALING in results:
        pngs.append(scaling.plot(results[SCALING], args.out / "scaling.png"))
    print(summary(results))
    shown = ", ".join(str(p) for p in pngs if p)
    print(f"\nresults: {args.out / 'results.json'}" + (f", plots: {shown}" if shown else ""))
    return results


def summary(results: dict[str, Any]) -> str:
    lines = [
        f"machine: {results['machine']['cpus']} cores, Python {results['machine']['python']}, "
        f"torch {results['machine']['torch']}",
    ]
    if results["workloads"]:
        lines.append(
            f"{'workload':<8} {'payload':>9} {'raw TCP':>9} {'put':>8} {'gather':>8} {'1 field':>8} "
            f"{'dp chunk':>9} {'pickle':>8} {'b64json':>8} {'ray':>8}   gather/raw  gather/b64  meta"
        )
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
                f"{'':<8} traffic job step: distributed {p['distributed']['median_s']:.2f}s, "
                f"centralised {p['centralised']['median_s']:.2f}s "
                f"({q['centralised_over_distributed_step']:.2f}x)"
            )
    if results["workloads"]:
        lines.append(
            "(GB/s, medians; ratios are distbatch gather-all over the baseline, same run; distbatch"
            " over HTTP here, DISTBATCH_SHM=0; the traffic job runs as users do, same-host path on)"
        )
    for name, r in results["workloads"].items():
        if r.get("peers"):
            lines.append(peer_summary(name, r))
            lines.append(backend_summary(name, r))
        if r.get("same_host"):
            lines.append(same_host.table(name, r["same_host"]))
        if r.get("rss"):
            lines.append(rss.table(name, r["rss"]))
        if r.get("areal"):
            lines.append(areal.table(name, r["areal"]))
        if r.get("cuda"):
            lines.append(cuda.table(r["cuda"]))
    if SCALING in results:
        lines.append(scaling.table(results[SCALING]))
    if CONTROL_PLANE in results:
        lines.append(control_plane.table(results[CONTROL_PLANE]))
    if MULTIMODAL in results:
        lines.append(shared_fields.table(results[MULTIMODAL]))
    if DURABLE in results:
        lines.append(durable.table(results[DURABLE]))
    return "\n".join(lines)


def peer_summary(name: str, r: dict[str, Any]) -> str:
    """distbatch next to Ray and TransferQueue on the same ragged and dense batches."""
    peers, q = r["peers"], r["ratios"]
    tq = peers.get("transferqueue", {})
    tasks, width = peers["dense_shape"]
    lines = [
        f"peers, {name} (GB/s, medians; ratio = distbatch over the peer, > 1: distbatch faster):",
        f"  {'batch':<22} {'distbatch put':>13} {'get':>6} {'TQ put':>7} {'get':>6} {'Ray get':>8}"
        f"   {'put/TQ':>7} {'get/TQ':>7} {'get/Ray':>8}",
    ]
    rows = [
        (
            "ragged",
            f"ragged {tasks:,} x ~{WORKLOADS[name].mean_len:,}",
            r["distbatch"],
            r["baselines"].get("ray_object_store"),
        ),
        ("dense", f"dense {tasks:,} x {width:,}", peers["distbatch_dense"], peers.get("ray_dense")),
    ]
    nan = float("nan")
    for kind, label, ours, ray in rows:
        theirs = tq.get(kind)
        ok = _ok(theirs)
        lines.append(
            f"  {label:<22} {ours['put']['gbps']:>13.3f} {ours['gather_all']['gbps']:>6.3f} "
            f"{theirs['put']['gbps'] if ok else nan:>7.3f} {theirs['get']['gbps'] if ok else nan:>6.3f} "
            f"{ray['gbps'] if ray else nan:>8.3f}   {q.get(f'{kind}_put_vs_transferqueue', nan):>6.2f}x "
            f"{q.get(f'{kind}_gather_vs_transferqueue', nan):>6.2f}x "
            f"{q.get(f'{kind}_gather_vs_ray', nan):>7.2f}x"
        )
    for kind in ("skipped", "error"):
        if kind in tq:
            lines.append(f"  TransferQueue {kind}: {tq[kind]}")
    for kind in ("dense", "ragged"):
        if isinstance(tq.get(kind), dict) and "error" in tq[kind]:
            lines.append(f"  TransferQueue {kind} failed: {tq[kind]['error']}")
    if "version" in tq:
        lines.append(
            f"  (TransferQueue {tq['version']} {tq['backend']}, {tq['units']} storage units; "
            "its gets return dense fields as jagged nested tensors)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
