"""The traffic job across simulated hosts: distributed (peer to peer) vs centralised (through the
controller's host), against what the links allow and what plain TCP achieves on them.

Host 0 runs the controller; hosts 1..N each run a rollout worker and a train worker
(`--layout colocated`, as verl's hybrid engine places them), or the train workers get hosts
N+1..2N of their own (`--layout disaggregated`, as AReaL's decoupled rollout does). Workers are
distbatch workers started inside their host's namespace and joined with `WorkerGroup.connect`.
Every host's NIC is a `tbf` of rate R each way (`simcluster`), R low enough that the links,
not this machine's cores, bound a step; the CPU use of each phase is reported to show which did.

Two measures per N, medians over `--repeats`:
- **data step**: the rollout batch is on the rollout workers; each train worker gathers its
  balanced chunk. Distributed: straight from the rollout workers. Centralised: the controller
  relays every chunk, in pieces, pulls of some overlapping pushes of others (both directions
  of its link busy: its best case), then the train workers read what was pushed to them.
- **traffic job step**: examples/grpo_pipeline.py's step (rollout, advantages, balance, train;
  its centralised mode pulls the whole batch, then pushes the chunks).

Next to each data step: the link lower bound, the bytes the busiest NIC must carry (from the
batch's metadata; centralised, every byte crosses the controller's NIC in and out) over R; and
plain TCP's time moving the same bytes between the same hosts (bench/cluster/tcp.py).

    python -m bench.cluster.job --hosts 1,2,4,8 --rate 100mbit --out /tmp/cluster-bench

needs root, `ip` and `tc` (`python -m simcluster check` says whether this machine can).
Results go to `<out>/cluster.json` and, with matplotlib, `<out>/cluster.png`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from bench.cluster import run_role
from simcluster import established_tcp, stop_process

ROOT = Path(__file__).resolve().parents[2]  # the repo root (this is bench/cluster/job.py)
EXAMPLES = ROOT / "examples"
TRAIN_ENGINE = "bench.cluster.job:ClusterTrainEngine"
ROLLOUT_ENGINE = "grpo_pipeline:RolloutEngine"
WORKER_START_TIMEOUT = 120.0
CONTROLLER_TIMEOUT = 1800.0


# ----------------------------------------------------------------------------- the train engine


def grpo_pipeline() -> Any:
    """examples/grpo_pipeline.py, the traffic job (examples/ is not a package)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module("grpo_pipeline")


def _train_engine_base() -> type:
    return grpo_pipeline().TrainEngine


class ClusterTrainEngine(_train_engine_base()):  # type: ignore[misc]
    """The traffic job's train engine, plus `receive`: gather a chunk (every field at once), no
    compute, so a data step times the data alone."""

    def receive(self, batch: Any) -> dict[str, float]:
        started = time.perf_counter()
        local = batch.to_local()  # every field in one gather: one product per holding worker
        return {"tasks": len(local), "seconds": time.perf_counter() - started}


# ----------------------------------------------------------------------------- link bounds


def host_of(node: str) -> str:
    """The address part of "host:port"."""
    return node.rsplit(":", 1)[0].strip("[]")


def bytes_by_host(chunk: Any) -> dict[str, int]:
    """Bytes of a REMOTE chunk's tensor fields, by the host holding them."""
    meta = chunk.meta
    if meta is None:
        return {}
    out: dict[str, int] = {}
    for fm in meta.fields.values():
        if fm.dtype is None:
            continue
        per_node = np.bincount(fm.nodes, weights=fm.row_nbytes(), minlength=len(meta.nodes))
        for node, nbytes in zip(meta.nodes, per_node.tolist()):
            out[host_of(node)] = out.get(host_of(node), 0) + int(nbytes)
    return out


def pair_bytes(chunks: Sequence[Any], receivers: Sequence[str]) -> dict[tuple[str, str], int]:
    """Bytes each (receiving host, holding host) pair moves when receiver i gathers chunk i peer
    to peer (a pair of one host: bytes that stay on it)."""
    pairs: dict[tuple[str, str], int] = {}
    for chunk, receiver in zip(chunks, receivers):
        to = host_of(receiver)
        for source, nbytes in bytes_by_host(chunk).items():
            pairs[to, source] = pairs.get((to, source), 0) + nbytes
    return pairs


def busiest_link_bytes(chunks: Sequence[Any], receivers: Sequence[str]) -> dict[str, int]:
    """Bytes each host's NIC must carry each way when receiver i gathers chunk i peer to peer:
    {"in": busiest ingress, "out": busiest egress, "total": all bytes, "local": bytes that
    stay on their host}."""
    ingress: dict[str, int] = {}
    egress: dict[str, int] = {}
    total = local = 0
    for (to, source), nbytes in pair_bytes(chunks, receivers).items():
        total += nbytes
        if source == to:
            local += nbytes
            continue
        ingress[to] = ingress.get(to, 0) + nbytes
        egress[source] = egress.get(source, 0) + nbytes
    return {
        "in": max(ingress.values(), default=0),
        "out": max(egress.values(), default=0),
        "total": total,
        "local": local,
    }


# ----------------------------------------------------------------------------- CPU use


def cpu_busy_seconds() -> float:
    """Seconds of CPU this machine spent busy (all cores, all namespaces): /proc/stat."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    ticks = [int(v) for v in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@contextmanager
def timed_with_cpu(out: dict[str, list[float]], name: str) -> Iterator[None]:
    """Append the block's wall seconds to out[name] and its CPU use (busy cores / all cores)
    to out[name + "_cpu"]."""
    cpu0, t0 = cpu_busy_seconds(), time.perf_counter()
    yield
    wall = time.perf_counter() - t0
    out.setdefault(name, []).append(wall)
    out.setdefault(name + "_cpu", []).append(
        (cpu_busy_seconds() - cpu0) / max(wall, 1e-9) / (os.cpu_count() or 1)
    )


# ----------------------------------------------------------------------------- controller (host 0)


def pipeline_args(args: argparse.Namespace) -> argparse.Namespace:
    """examples/grpo_pipeline.py's arguments for this run's batch."""
    example = grpo_pipeline()

    return example.parse_args(
        [
            f"--prompts={args.prompts}",
            f"--n={args.n}",
            f"--mean-len={args.mean_len}",
            f"--max-len={args.max_len}",
            f"--seed={args.seed}",
        ]
    )


def rollout_batch(rollout: Any, job: argparse.Namespace, step: int) -> Any:
    """A step's rollout batch (REMOTE, on the rollout workers) with its advantages."""
    from distbatch import DistributedBatchMemory

    prompts = list(range(job.prompts))
    per_worker = [prompts[i :: len(rollout)] for i in range(len(rollout))]
    produced = rollout.call(
        "generate", per_worker, n=job.n, mean_len=job.mean_len, max_len=job.max_len, step=step, seed=job.seed
    )
    batch = DistributedBatchMemory.concat(produced)
    batch.union_(rollout.call_on(0, "compute_advantages", batch.select_fields(["rewards", "uid"])))
    return batch


RELAY_PIECES = 64  # pieces a centralised step moves, all chunks together
RELAY_THREADS = 8  # pieces in flight: some being pulled while others are pushed


def centralised_data_step(chunks: Sequence[Any], train: Any) -> list[Any]:
    """The controller relays every chunk to its train worker, in pieces pulled and pushed by
    a pool of threads, so pulls of some pieces overlap pushes of others (both directions of the
    controller's link busy: the centralised design at its best); then the train workers read
    what was pushed to them."""
    from distbatch import DistributedBatchMemory

    per_chunk = max(1, -(-RELAY_PIECES // max(len(chunks), 1)))
    pieces = [(piece, node) for chunk, node in zip(chunks, train.nodes) for piece in chunk.chunk(per_chunk)]

    def relay(pair: tuple[Any, str]) -> tuple[str, Any]:
        piece, node = pair
        return node, piece.to_local().to_remote(node)

    with ThreadPoolExecutor(max_workers=RELAY_THREADS) as pool:
        relayed = list(pool.map(relay, pieces))
    pushed = [DistributedBatchMemory.concat([p for n, p in relayed if n == node]) for node in train.nodes]
    train.call("receive", pushed)
    return pushed


def data_steps(args: argparse.Namespace, rollout: Any, train: Any) -> dict[str, Any]:
    """Distributed and centralised data steps, `args.repeats` each, on fresh rollout batches."""
    example = grpo_pipeline()

    job = pipeline_args(args)
    times: dict[str, list[float]] = {}
    links: list[dict[str, int]] = []
    gathers: list[list[float]] = []  # each train worker's gather, seconds, per repeat
    pairs: list[list[list[Any]]] = []  # per repeat: [receiving host, holding host, bytes] across hosts
    for step in range(args.repeats):
        batch = rollout_batch(rollout, job, step)
        chunks = batch.select_fields(example.TRAIN_FIELDS).chunk_balanced(
            len(train), group_size=job.n, length_field="input_ids"
        )
        links.append(busiest_link_bytes(chunks, train.nodes))
        crossing = [[to, src, n] for (to, src), n in pair_bytes(chunks, train.nodes).items() if to != src]
        pairs.append(crossing)
        with timed_with_cpu(times, "distributed"):
            received = train.call("receive", chunks)
        gathers.append(sorted(round(float(r["seconds"]), 3) for r in received))
        with timed_with_cpu(times, "centralised"):
            pushed = centralised_data_step(chunks, train)
        for done in pushed:
            done.clear()
        batch.clear()
    return {"times": times, "links": links, "gathers": gathers, "pairs": pairs}


def main_job_steps(args: argparse.Namespace, rollout: Any, train: Any) -> dict[str, list[float]]:
    """examples/grpo_pipeline.py's whole step, distributed and centralised, `args.steps` each."""
    example = grpo_pipeline()

    job = pipeline_args(args)
    times: dict[str, list[float]] = {}
    for step in range(args.steps):
        for mode, centralised in (("distributed", False), ("centralised", True)):
            with timed_with_cpu(times, mode):
                example.run_step(step, job, rollout, train, centralised)
    return times


def controller_main(args: argparse.Namespace) -> int:
    """Run on host 0: join the workers, time the steps, print one JSON line."""
    sys.path.insert(0, str(EXAMPLES))
    from distbatch import WorkerGroup

    rollout = WorkerGroup.connect(args.rollout.split(","), engine=ROLLOUT_ENGINE)
    train = WorkerGroup.connect(args.train.split(","), engine=TRAIN_ENGINE)
    result = {
        "data": data_steps(args, rollout, train),
        "main_job": main_job_steps(args, rollout, train) if args.steps else {},
        "shards_left": sum(s["shards"] for g in (rollout, train) for s in g.stats()),
    }
    print(json.dumps(result))
    return 0


# ----------------------------------------------------------------------------- driver (root)


class ConnectionCount:
    """The most TCP connections open at once during a block, sampled from the worker hosts'
    tables every `period` seconds: between workers (each counted once, though both its ends
    are seen) and to the controller. What should hold: a count bounded by the pairs of workers
    (a gather is one request per worker it reads; a client keeps at most its per-node limit to
    any one worker), whatever the batch size or the number of steps."""

    def __init__(self, pids: list[int], controller: str, period: float = 0.02) -> None:
        self.pids, self.controller, self.period = pids, controller, period
        self.most_between_workers = self.most_to_controller = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.period):
            sockets = [c for pid in self.pids for c in established_tcp(pid)]
            to_controller = sum(1 for _, remote in sockets if host_of(remote) == self.controller)
            # A connection between workers is in both ends' tables, or in one when it closes
            # between the two reads: counted once by its pair of endpoints either way.
            between = len({tuple(sorted(c)) for c in sockets if host_of(c[1]) != self.controller})
            self.most_between_workers = max(self.most_between_workers, between)
            self.most_to_controller = max(self.most_to_controller, to_controller)

    def __enter__(self) -> ConnectionCount:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def worker_env() -> dict[str, str]:
    """The workers' and controller's environment: the repo and examples/ importable, no proxy,
    the same-host path left to decide by itself (each host is its own)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(EXAMPLES), env.get("PYTHONPATH", "")) if p)
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        env.pop(name, None)
    env.pop("DISTBATCH_SAME_HOST", None)
    return env


def start_worker(cluster: Any, host: int, stack: ExitStack, log_dir: Path, pids: dict[int, int]) -> str:
    """A worker that accepts an engine, in `host`, on its address; its node once it listens."""
    from distbatch.launch.local import log_tail, read_first_line

    log = log_dir / f"h{host}-{len(list(log_dir.iterdir()))}.log"
    argv = [sys.executable, "-m", "rpc_server", "--host", cluster.address(host), "--port", "0",
            "--accept-engine", "--exit-with-parent", str(os.getpid())]  # fmt: skip
    with log.open("wb") as log_file:
        process = cluster.popen(
            host, argv, stdout=subprocess.PIPE, stderr=log_file, env=worker_env(), cwd=ROOT
        )
    stack.callback(stop_process, process)
    pids.setdefault(host, process.pid)  # `ip netns exec` execs: this is the worker, in the host
    node = read_first_line(process, timeout=WORKER_START_TIMEOUT)
    if node is None:
        raise RuntimeError(f"worker on host {host} did not start: {log_tail(log)}")
    return node


def run_hosts(hosts: int, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """One cluster of `hosts` worker hosts (+ the controller's), its measures."""
    from bench.cluster.tcp import all_to_all
    from simcluster import Cluster, rate_bits

    rollout_hosts = range(1, hosts + 1)
    train_hosts = rollout_hosts if args.layout == "colocated" else range(hosts + 1, 2 * hosts + 1)
    machines = 1 + len(set(rollout_hosts) | set(train_hosts))
    with Cluster.up(machines, rate=args.rate, prefix=args.prefix) as cluster, ExitStack() as stack:
        pids: dict[int, int] = {}  # a worker per host: where its namespace's TCP table is read
        rollout = [start_worker(cluster, h, stack, log_dir, pids) for h in rollout_hosts]
        train = [start_worker(cluster, h, stack, log_dir, pids) for h in train_hosts]
        argv = [sys.executable, "-m", "bench.cluster.job", "controller", "--rollout", ",".join(rollout),
                "--train", ",".join(train), *job_flags(args)]  # fmt: skip
        before = [cluster.link_stats(h) for h in range(machines)]
        with ConnectionCount(list(pids.values()), cluster.address(0)) as connections:
            done = cluster.run(
                0,
                argv,
                capture_output=True,
                text=True,
                env=worker_env(),
                cwd=ROOT,
                timeout=CONTROLLER_TIMEOUT,
            )
        after = [cluster.link_stats(h) for h in range(machines)]
        if done.returncode != 0:
            raise RuntimeError(f"the controller failed on {hosts} hosts: {done.stderr[-4000:]}")
        raw = json.loads(done.stdout.strip().splitlines()[-1])
        # The network's own figure: plain TCP moving each repeat's bytes between the same hosts.
        raw["data"]["times"]["tcp"] = [
            all_to_all(cluster, range(1, machines), [tuple(p) for p in pairs]) if pairs else 0.0
            for pairs in raw["data"]["pairs"]
        ]
    result = summarise(hosts, raw, rate_bits(args.rate))
    result["layout"] = args.layout
    result["max_worker_connections"] = connections.most_between_workers
    result["max_controller_connections"] = connections.most_to_controller
    result["links"] = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]  # host 0: the controller's
    return result


def job_flags(args: argparse.Namespace) -> list[str]:
    return [f"--prompts={args.prompts}", f"--n={args.n}", f"--mean-len={args.mean_len}",
            f"--max-len={args.max_len}", f"--seed={args.seed}", f"--repeats={args.repeats}",
            f"--steps={args.steps}"]  # fmt: skip


def summarise(hosts: int, raw: dict[str, Any], rate: int) -> dict[str, Any]:
    """Medians, link bounds and ratios of one cluster's raw measures."""
    data = raw["data"]
    links = data["links"]
    busiest = statistics.median(max(link["in"], link["out"]) for link in links)
    total = statistics.median(link["total"] for link in links)
    out: dict[str, Any] = {
        "hosts": hosts,
        "rate_bits": rate,
        "batch_bytes": total,
        "shards_left": raw["shards_left"],
        "data_distributed_gathers": data["gathers"],
    }
    bounds = {"distributed": busiest * 8 / rate, "centralised": total * 8 / rate}
    for mode in ("distributed", "centralised"):
        seconds = data["times"][mode]
        out[f"data_{mode}_s"] = statistics.median(seconds)
        out[f"data_{mode}_seconds"] = seconds
        out[f"data_{mode}_cpu"] = statistics.median(data["times"][mode + "_cpu"])
        out[f"data_{mode}_bound_s"] = bounds[mode]
    out["data_tcp_s"] = statistics.median(data["times"]["tcp"])
    if out["data_tcp_s"] > 0:
        out["data_distributed_over_tcp"] = out["data_distributed_s"] / out["data_tcp_s"]
    out["data_centralised_over_distributed"] = out["data_centralised_s"] / out["data_distributed_s"]
    if bounds["distributed"] > 0:
        out["data_distributed_over_bound"] = out["data_distributed_s"] / bounds["distributed"]
    out["data_centralised_over_bound"] = out["data_centralised_s"] / bounds["centralised"]
    if raw["main_job"]:
        for mode in ("distributed", "centralised"):
            out[f"main_job_{mode}_s"] = statistics.median(raw["main_job"][mode])
            out[f"main_job_{mode}_cpu"] = statistics.median(raw["main_job"][mode + "_cpu"])
        out["main_job_centralised_over_distributed"] = (
            out["main_job_centralised_s"] / out["main_job_distributed_s"]
        )
    return out


def plot(results: list[dict[str, Any]], path: Path) -> Path | None:
    """Step time against hosts: the data step (both modes, their link bounds, plain TCP) and,
    when measured, the traffic job's step (None without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    hosts = [r["hosts"] for r in results]
    job = all("main_job_distributed_s" in r for r in results)
    fig, axes = plt.subplots(1, 2 if job else 1, figsize=(11 if job else 6.4, 4.2), squeeze=False)
    data_ax = axes[0][0]
    for mode, color in (("distributed", "tab:blue"), ("centralised", "tab:red")):
        data_ax.plot(hosts, [r[f"data_{mode}_s"] for r in results], "o-", color=color, label=mode)
        bounds = [r[f"data_{mode}_bound_s"] for r in results]
        data_ax.plot(hosts, bounds, ":", color=color, label=f"{mode}: link bound")
    data_ax.plot(
        hosts, [r["data_tcp_s"] for r in results], "s--", color="tab:gray", label="plain TCP, same bytes"
    )
    rate, size = results[0]["rate_bits"] / 1e6, results[0]["batch_bytes"] / 1e6
    data_ax.set_title(f"Data step: train workers gather {size:.0f} MB ({rate:g} Mbit/s NICs)")
    data_ax.set_ylabel("seconds")
    if job:
        job_ax = axes[0][1]
        for mode, color in (("distributed", "tab:blue"), ("centralised", "tab:red")):
            job_ax.plot(hosts, [r[f"main_job_{mode}_s"] for r in results], "o-", color=color, label=mode)
        job_ax.set_title("Traffic job step: rollout, advantages, balance, train")
    layout = results[0].get("layout", "colocated")
    xlabel = (
        "hosts (a rollout and a train worker each)"
        if layout == "colocated"
        else "rollout hosts (+ as many train hosts)"
    )
    for ax in axes[0]:
        ax.set_xlabel(xlabel)
        ax.set_xticks(hosts)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def report(results: list[dict[str, Any]]) -> list[str]:
    """The table a person reads: per host count, the data step both ways with the link bound
    and plain TCP's time for the same bytes, the CPU use, then the traffic job's step."""
    lines = [
        f"{'hosts':>5} {'distributed':>12} {'TCP':>7} {'bound':>7} {'x bound':>8} {'centralised':>12} "
        f"{'bound':>7} {'speed-up':>9} {'cpu d/c':>9} {'job d':>7} {'job c':>7} {'job x':>6}"
    ]
    nan = float("nan")
    for r in results:
        over = r.get("data_distributed_over_bound")
        lines.append(
            f"{r['hosts']:>5} {r['data_distributed_s']:>11.2f}s {r['data_tcp_s']:>6.2f}s "
            f"{r['data_distributed_bound_s']:>6.2f}s {(f'{over:.2f}x' if over else '-'):>8} "
            f"{r['data_centralised_s']:>11.2f}s {r['data_centralised_bound_s']:>6.2f}s "
            f"{r['data_centralised_over_distributed']:>8.1f}x "
            f"{r['data_distributed_cpu']:>4.0%}/{r['data_centralised_cpu']:<4.0%}"
            f"{r.get('main_job_distributed_s', nan):>7.2f}s {r.get('main_job_centralised_s', nan):>6.2f}s "
            f"{r.get('main_job_centralised_over_distributed', nan):>5.1f}x"
        )
    return lines


def markdown_table(results: list[dict[str, Any]]) -> str:
    """The results as the guide and README show them (tests check those match the saved run)."""
    rows = [
        "| hosts | data step, distributed | plain TCP, same bytes | link bound | centralised | "
        "speed-up | whole step, distributed / centralised |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        job = (
            f"{r['main_job_distributed_s']:.2f} / {r['main_job_centralised_s']:.2f} s "
            f"({r['main_job_centralised_over_distributed']:.1f}×)"
            if "main_job_distributed_s" in r
            else "—"
        )
        rows.append(
            f"| {r['hosts']} | {r['data_distributed_s']:.2f} s | {r['data_tcp_s']:.2f} s | "
            f"{r['data_distributed_bound_s']:.2f} s | {r['data_centralised_s']:.2f} s | "
            f"{r['data_centralised_over_distributed']:.1f}× | {job} |"
        )
    return "\n".join(rows)


def add_batch_args(parser: argparse.ArgumentParser) -> None:
    """The batch's shape (examples/grpo_pipeline.py's knobs), shared by the cluster benches."""
    parser.add_argument("--prompts", type=int, default=640, help="prompts per step (x n tasks)")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt")
    parser.add_argument("--mean-len", type=int, default=1024)
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.cluster.job",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "role", nargs="?", choices=["driver", "controller"], default="driver", help=argparse.SUPPRESS
    )
    parser.add_argument("--hosts", default="1,2,4,8", help="comma list of worker-host counts")
    parser.add_argument("--rate", default="100mbit", help="every host's NIC, each way (tc units)")
    add_batch_args(parser)
    parser.add_argument("--repeats", type=int, default=3, help="data steps per mode")
    parser.add_argument("--steps", type=int, default=2, help="traffic job steps per mode (0: none)")
    parser.add_argument(
        "--layout",
        choices=["colocated", "disaggregated"],
        default="colocated",
        help="train workers on the rollout hosts (verl's hybrid engine) or on hosts of their own (AReaL's)",
    )
    parser.add_argument("--prefix", default="dbj", help="names of the cluster's namespaces and links")
    parser.add_argument("--out", default="bench-cluster", help="results directory")
    parser.add_argument("--rollout", help=argparse.SUPPRESS)
    parser.add_argument("--train", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def driver_main(args: argparse.Namespace, progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Every host count in turn (one cluster each, torn down after), then the table and plot."""
    from simcluster import check

    problem = check()
    if problem is not None:
        raise SystemExit(f"bench.cluster.job: {problem}")
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    results = []
    for hosts in [int(h) for h in args.hosts.split(",")]:
        progress(f"{hosts} host(s) at {args.rate} ...")
        results.append(run_hosts(hosts, args, out / "logs"))
        progress(report(results)[-1])
    (out / "cluster.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    png = plot(results, out / "cluster.png")
    for line in report(results):
        print(line)
    print(f"results: {out / 'cluster.json'}" + (f", plot: {png}" if png else ""))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    return run_role(parse_args(argv), controller_main, driver_main)


if __name__ == "__main__":
    raise SystemExit(main())
