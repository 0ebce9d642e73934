"""Ray's own cross-node object transfer of the grpo batch on the simulated cluster: the peer
measure next to bench/cluster/job.py's distributed data step, same batch, same links.

A multi-node Ray cluster runs inside the namespaces of `simcluster`: the head (GCS, no
CPUs) on host 0 with the controller, a raylet on each of hosts 1..N with a producer and a
consumer actor (pinned by a custom resource `host<i>`). Per repeat:

1. each producer generates its share of the batch with examples/grpo_pipeline.py's
   `RolloutEngine.generate` (prompts i::N, as bench/cluster/job.py's rollout workers) and keeps
   every field packed: one numpy array of values per field plus the offsets (cu_seqlens);
2. the controller balances the tasks with distbatch's own `chunk_balanced` rows (by
   `input_ids` length, groups of n kept together), so consumer i gets the same tasks, and each
   host pair the same bytes, as train worker i in the distbatch data step;
3. the producers put the data into their node's object store, each object a dict of packed
   numpy arrays (values per field, offsets), in one of two layouts (`--layout`):
   - `packed` (default, Ray's best case): once the batch is balanced, each producer cuts,
     packs and `ray.put`s one object per consumer, before the clock starts (a distbatch
     gather cuts the rows at the source inside its timed phase);
   - `groups`: one object per GRPO group of n, put as generated (the balance is not known
     yet), so a consumer gets its chunk as the objects of its groups;
4. timed: every consumer `ray.get`s its chunk's objects (from every worker host, its own
   included) at once; the get phase is the slowest consumer's `ray.get`, and the
   controller's wall time around all of it is reported too.

Next to it, the link lower bound as bench/cluster/job.py computes it: the bytes the busiest NIC
must carry one way over the rate. Medians over `--repeats`.

    python -m bench.cluster.ray_peer --hosts 2,4 --rate 100mbit --out /tmp/cluster-ray \\
        [--distbatch /tmp/cluster-bench/cluster.json]

`--distbatch` reads bench.cluster.job's results (same hosts and rate) and adds the ratio of
Ray's get to distbatch's data step. Needs root, `ip` and `tc` (`simcluster`) and Ray. Ray's
processes are stopped by the pids found in each host's namespace (`simcluster.stop_namespaces`),
never by name: `ray stop` would kill every Ray process on this machine, other clusters' included.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from bench.cluster import run_role
from simcluster import namespace_pids, stop_namespaces

ROOT = Path(__file__).resolve().parents[2]  # the repo root (this is bench/cluster/ray_peer.py)
HEAD_PORT = 6379  # the GCS port inside host 0's namespace (ours alone)
OBJECT_STORE_BYTES = 300_000_000  # per node
RAGGED_FIELDS = ("input_ids", "logprobs", "loss_mask")  # one row per token
TASK_FIELDS = ("advantages",)  # one value per task
LAYOUTS = ("packed", "groups")
RAY_START_TIMEOUT = 120.0
CONTROLLER_TIMEOUT = 1800.0
WARM_UP_TOKENS = 20_000  # a piece of ~180 kB: Ray puts it in the object store (100 kB and up)


# ----------------------------------------------------------------------------- the actors


def take_ragged(values: np.ndarray, offsets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows `rows` of a packed ragged column (values, N+1 offsets), packed again."""
    starts = offsets[rows].astype(np.int64)
    lengths = offsets[rows + 1].astype(np.int64) - starts
    new_offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_offsets[1:])
    index = np.repeat(starts - new_offsets[:-1], lengths) + np.arange(int(new_offsets[-1]))
    return values[index], new_offsets


def piece_bytes(piece: dict[str, np.ndarray]) -> int:
    """The bytes of a piece's fields (offsets left out, as the distbatch link bound leaves out
    its metadata)."""
    return sum(int(piece[f].nbytes) for f in (*RAGGED_FIELDS, *TASK_FIELDS))


class Producer:
    """A rollout host: generates its share of the grpo batch and puts it into its node's object
    store, in one of `LAYOUTS`."""

    def __init__(self) -> None:
        self.fields: dict[str, np.ndarray] = {}
        self.offsets = np.zeros(1, dtype=np.int64)
        self.n = 1
        self.layout = "packed"
        self.groups: list[tuple[Any, int]] = []  # layout "groups": (ref, bytes) per group
        self.refs: list[Any] = []

    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def generate(
        self,
        prompts: list[int],
        n: int,
        mean_len: int,
        max_len: int,
        step: int,
        seed: int,
        layout: str = "packed",
    ) -> Any:
        """Generate (RolloutEngine.generate, advantages as compute_advantages does) and, for the
        "groups" layout, put one object per group of `n` at once; returns each task's
        `input_ids` length, what the controller balances by."""
        from bench.cluster.job import grpo_pipeline

        engine = grpo_pipeline().RolloutEngine()
        batch = engine.generate(prompts, n=n, mean_len=mean_len, max_len=max_len, step=step, seed=seed)
        advantages = engine.compute_advantages(batch.select_fields(["rewards", "uid"]))["advantages"]
        self.fields = {}
        for field in RAGGED_FIELDS:
            values, offsets = batch.packed(field)
            self.fields[field] = values.numpy()
        self.offsets = offsets.numpy().astype(np.int64)  # the same for every ragged field
        self.fields["advantages"] = advantages.numpy()
        self.n, self.layout = n, layout
        if layout == "groups":
            self.groups = [self._put(np.arange(g, g + n)) for g in range(0, len(self.offsets) - 1, n)]
        return np.diff(self.offsets)

    def _put(self, rows: np.ndarray) -> tuple[Any, int]:
        """`ray.put` these rows packed (values per field, offsets); the ref is held here until
        `clear`. (ref, field bytes)."""
        import ray

        piece: dict[str, np.ndarray] = {}
        for field in RAGGED_FIELDS:
            piece[field], piece["offsets"] = take_ragged(self.fields[field], self.offsets, rows)
        for field in TASK_FIELDS:
            piece[field] = self.fields[field][rows]
        ref = ray.put(piece)
        self.refs.append(ref)
        return ref, piece_bytes(piece)

    def put_pieces(self, rows_per_consumer: list[np.ndarray]) -> list[list[tuple[Any, int]]]:
        """Each consumer's objects from this share, in row order: "packed", one object cut and
        put now; "groups", the objects of its groups, put when generated. (ref, bytes) each."""
        if self.layout == "groups":
            return [
                [self.groups[g] for g in np.unique(np.asarray(rows) // self.n)] for rows in rows_per_consumer
            ]
        return [[self._put(np.asarray(rows, dtype=np.int64))] for rows in rows_per_consumer]

    def clear(self) -> None:
        self.refs.clear()
        self.groups = []
        self.fields = {}


class Consumer:
    """A train host: gets its chunk's objects, from every producer host, with one `ray.get`."""

    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def receive(self, refs: list[Any], check: bool = False) -> dict[str, Any]:
        """Get every piece (a list of refs: Ray does not resolve them before the call); the
        seconds `ray.get` took, the tasks and bytes, and with `check` a digest of each field
        of the assembled chunk."""
        import ray

        started = time.perf_counter()
        pieces = ray.get(refs)
        seconds = time.perf_counter() - started
        out: dict[str, Any] = {
            "seconds": seconds,
            "tasks": sum(len(p["offsets"]) - 1 for p in pieces),
            "bytes": sum(piece_bytes(p) for p in pieces),
        }
        if check:
            out["digests"] = chunk_digests(
                {f: np.concatenate([p[f] for p in pieces]) for f in (*RAGGED_FIELDS, *TASK_FIELDS)},
                np.concatenate([np.diff(p["offsets"]) for p in pieces]),
            )
        return out


def chunk_digests(fields: dict[str, np.ndarray], lengths: np.ndarray) -> dict[str, str]:
    """sha256 of each field's packed values and of the task lengths, to compare chunks."""
    out = {
        name: hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest()
        for name, values in fields.items()
    }
    out["lengths"] = hashlib.sha256(np.asarray(lengths, dtype=np.int64).tobytes()).hexdigest()
    return out


# ----------------------------------------------------------------------------- controller (host 0)


def split_rows(chunks: Sequence[np.ndarray], counts: Sequence[int]) -> list[list[np.ndarray]]:
    """Balanced chunks' global rows (producer 0's tasks first) as each producer's local rows per
    consumer: out[producer][consumer]."""
    bounds = np.concatenate([[0], np.cumsum(counts)])
    return [
        [rows[(rows >= bounds[p]) & (rows < bounds[p + 1])] - bounds[p] for rows in chunks]
        for p in range(len(counts))
    ]


def link_bytes(pair: Sequence[Sequence[int]]) -> dict[str, int]:
    """From pair[producer][consumer] bytes (producer p and consumer p on one host): the busiest
    NIC's bytes each way, all bytes and the bytes that stay on their host (as
    bench.cluster.job.busiest_link_bytes)."""
    hosts = len(pair)
    ingress = [sum(pair[p][c] for p in range(hosts) if p != c) for c in range(hosts)]
    egress = [sum(pair[p][c] for c in range(hosts) if c != p) for p in range(hosts)]
    return {
        "in": max(ingress, default=0),
        "out": max(egress, default=0),
        "total": sum(map(sum, pair)),
        "local": sum(pair[h][h] for h in range(hosts)),
    }


def expected_digests(args: argparse.Namespace, hosts: int, step: int) -> list[dict[str, str]]:
    """Each consumer's chunk digests computed with distbatch alone, in this process: the batch
    generated as bench.cluster.job's rollout workers do, `chunk_balanced` as its data step."""
    from bench.cluster.job import grpo_pipeline
    from distbatch import DistributedBatchMemory

    example = grpo_pipeline()
    engine = example.RolloutEngine()
    prompts = list(range(args.prompts))
    batch = DistributedBatchMemory.concat(
        [
            engine.generate(prompts[i::hosts], n=args.n, mean_len=args.mean_len, max_len=args.max_len,
                            step=step, seed=args.seed)
            for i in range(hosts)
        ]
    )  # fmt: skip
    advantages = engine.compute_advantages(batch.select_fields(["rewards", "uid"]))
    batch.union_(DistributedBatchMemory.from_dict(advantages, task_ids=batch.task_ids))
    chunks = batch.select_fields(example.TRAIN_FIELDS).chunk_balanced(
        hosts, group_size=args.n, length_field="input_ids"
    )
    out = []
    for chunk in chunks:
        fields = {f: chunk.packed(f)[0].numpy() for f in RAGGED_FIELDS}
        fields.update({f: chunk[f].numpy() for f in TASK_FIELDS})
        out.append(chunk_digests(fields, np.asarray(chunk.lengths("input_ids"))))
    return out


def generate(args: argparse.Namespace, producers: list[Any], step: int, **options: Any) -> list[np.ndarray]:
    """Every producer generates its share of repeat `step`'s batch (prompts i::N, as
    bench.cluster.job's rollout workers; `options` go to `Producer.generate`); each share's
    `input_ids` lengths."""
    import ray

    hosts = len(producers)
    prompts = list(range(args.prompts))
    job = dict(n=args.n, mean_len=args.mean_len, max_len=args.max_len, step=step, seed=args.seed, **options)
    return list(ray.get([p.generate.remote(prompts[i::hosts], **job) for i, p in enumerate(producers)]))


def balance(args: argparse.Namespace, lengths: list[np.ndarray]) -> list[list[np.ndarray]]:
    """distbatch's `chunk_balanced` rows over every share (by `input_ids` length, groups of n
    kept together), one chunk per producer's host, as each producer's local rows per consumer:
    out[producer][consumer] (`split_rows`)."""
    from distbatch.batch.ops import balanced_rows

    chunks = balanced_rows(np.concatenate(lengths), len(lengths), args.n)
    return split_rows(chunks, [len(x) for x in lengths])


def one_repeat(
    args: argparse.Namespace, producers: list[Any], consumers: list[Any], step: int
) -> dict[str, Any]:
    """Generate, balance, put; then time every consumer's get."""
    import ray

    from bench.cluster.job import cpu_busy_seconds

    hosts = len(producers)
    local_rows = balance(args, generate(args, producers, step, layout=args.layout))
    puts = ray.get([p.put_pieces.remote(rows) for p, rows in zip(producers, local_rows)])
    pair = [[sum(nbytes for _, nbytes in objects) for objects in per_consumer] for per_consumer in puts]
    refs = [[ref for p in range(hosts) for ref, _ in puts[p][i]] for i in range(hosts)]
    cpu0, t0 = cpu_busy_seconds(), time.perf_counter()
    received = ray.get([c.receive.remote(refs[i], args.check) for i, c in enumerate(consumers)])
    wall = time.perf_counter() - t0
    cpu = (cpu_busy_seconds() - cpu0) / max(wall, 1e-9) / (os.cpu_count() or 1)
    objects = [len(r) for r in refs]
    del puts, refs
    ray.get([p.clear.remote() for p in producers])
    out: dict[str, Any] = {
        "objects": objects,
        "wall": wall,
        "cpu": cpu,
        "gets": [float(r["seconds"]) for r in received],
        "tasks": [int(r["tasks"]) for r in received],
        "bytes": [int(r["bytes"]) for r in received],
        "link": link_bytes(pair),
    }
    if args.check:
        out["equal"] = [r["digests"] for r in received] == expected_digests(args, hosts, step)
    return out


def make_actors(
    hosts: int, producer: type = Producer, consumer: type = Consumer
) -> tuple[list[Any], list[Any]]:
    """A `producer` and a `consumer` on each worker host, checked to be on distinct nodes."""
    import ray

    def place(cls: type, host: int) -> Any:
        actor: Any = ray.remote(cls)
        return actor.options(num_cpus=1, resources={f"host{host}": 1}).remote()

    producers = [place(producer, h) for h in range(1, hosts + 1)]
    consumers = [place(consumer, h) for h in range(1, hosts + 1)]
    nodes = ray.get([a.node_id.remote() for a in (*producers, *consumers)])
    if nodes[:hosts] != nodes[hosts:] or len(set(nodes[:hosts])) != hosts:
        raise RuntimeError(f"actors are not one producer and one consumer per host: {nodes}")
    return producers, consumers


def warm_up(producers: list[Any], consumers: list[Any]) -> None:
    """One small piece from every producer to every consumer, so every object manager pair has
    connected before the clock runs (Ray's best case)."""
    import ray

    rows = [np.zeros(1, dtype=np.int64)] * len(consumers)  # ~20k tokens: over Ray's inline limit
    ray.get([p.generate.remote([0], 1, WARM_UP_TOKENS, 4 * WARM_UP_TOKENS, 0, 0) for p in producers])
    puts = ray.get([p.put_pieces.remote(rows) for p in producers])
    refs = [[ref for put in puts for ref, _ in put[i]] for i in range(len(consumers))]
    ray.get([c.receive.remote(r) for c, r in zip(consumers, refs)])
    ray.get([p.clear.remote() for p in producers])


def controller_main(args: argparse.Namespace) -> int:
    """Run on host 0: join the Ray cluster, time the repeats, print one JSON line."""
    import ray

    ray.init(
        address=args.address, _node_ip_address=args.node_ip, log_to_driver=False, configure_logging=False
    )
    try:
        producers, consumers = make_actors(args.workers)
        warm_up(producers, consumers)
        repeats = [one_repeat(args, producers, consumers, step) for step in range(args.repeats)]
    finally:
        ray.shutdown()
    print(json.dumps({"repeats": repeats}))
    return 0


# ----------------------------------------------------------------------------- driver (root)


def ray_env() -> dict[str, str]:
    """The environment of every Ray process and the controller: bench.cluster.job's (the repo
    and examples/ importable, no proxy), no usage stats, token auth with a fresh token kept in
    the environment (no ~/.ray/auth_token), no inherited cluster address."""
    from bench.cluster.job import worker_env

    env = worker_env()
    env.pop("RAY_ADDRESS", None)
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    return env


def ray_binary() -> str:
    """The `ray` CLI of this interpreter's environment."""
    beside = Path(sys.executable).with_name("ray")
    return str(beside) if beside.exists() else "ray"


def start_ray(
    cluster: Any,
    workers: int,
    temp_dir: Path,
    env: dict[str, str],
    head_cpus: int = 0,
    worker_cpus: int = 2,
    resources: dict[str, int] | None = None,
) -> str:
    """`ray start` the head in host 0 (`head_cpus`, none by default: the controller's host) and a
    raylet in each of hosts 1..`workers` (`worker_cpus`, resource `host<i>`: 2, plus
    `resources`); the head's address. Raises with the command's output when one fails (the
    caller stops what started)."""
    common = ["--object-store-memory", str(OBJECT_STORE_BYTES), "--disable-usage-stats"]
    head = f"{cluster.address(0)}:{HEAD_PORT}"
    commands = [
        [ray_binary(), "start", "--head", "--node-ip-address", cluster.address(0), "--port", str(HEAD_PORT),
         "--num-cpus", str(head_cpus), "--include-dashboard=false", "--temp-dir", str(temp_dir), *common]
    ] + [
        [ray_binary(), "start", "--address", head, "--node-ip-address", cluster.address(h),
         "--num-cpus", str(worker_cpus), "--resources", json.dumps({f"host{h}": 2, **(resources or {})}),
         *common]
        for h in range(1, workers + 1)
    ]  # fmt: skip
    for host, argv in enumerate(commands):
        done = cluster.run(
            host, argv, env=env, capture_output=True, text=True, timeout=RAY_START_TIMEOUT, cwd=ROOT
        )
        if done.returncode != 0:
            raise RuntimeError(f"`ray start` failed in host {host}: {(done.stdout + done.stderr)[-4000:]}")
    return head


def keep_logs(temp_dir: Path, to: Path) -> None:
    """Copy the Ray session's logs (best effort) before the temp dir goes."""
    for logs in temp_dir.glob("session_*/logs"):
        shutil.copytree(logs, to / logs.parent.name, dirs_exist_ok=True, ignore_dangling_symlinks=True)


def run_controller(
    hosts: int,
    args: argparse.Namespace,
    log_dir: Path,
    module: str,
    flags: list[str],
    **ray_nodes: Any,
) -> tuple[dict[str, Any], list[dict[str, int]], list[int]]:
    """One cluster of `hosts` worker hosts (+ host 0: the Ray head and the controller): Ray
    started (`ray_nodes` go to `start_ray`), `python -m <module> controller <flags>` run in
    host 0; its JSON line, each host's link counters over the run (host 0: the head's) and the
    pids stopped after. Ray stopped and the cluster down on the way out, whatever happens."""
    from simcluster import Cluster

    env = ray_env()
    temp_dir = ray_temp_dir(args.prefix)
    stopped: list[int] = []
    with Cluster.up(hosts + 1, rate=args.rate, prefix=args.prefix) as cluster, ExitStack() as stack:
        stack.callback(shutil.rmtree, temp_dir, ignore_errors=True)
        stack.callback(_stop_or_raise, [cluster.namespace(h) for h in range(hosts + 1)], stopped)
        head = start_ray(cluster, hosts, temp_dir, env, **ray_nodes)
        argv = [sys.executable, "-m", module, "controller", "--address", head,
                "--node-ip", cluster.address(0), "--workers", str(hosts), *flags]  # fmt: skip
        before = [cluster.link_stats(h) for h in range(hosts + 1)]
        done = cluster.run(
            0, argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=CONTROLLER_TIMEOUT
        )
        after = [cluster.link_stats(h) for h in range(hosts + 1)]
        if done.returncode != 0:
            keep_logs(temp_dir, log_dir / f"ray-{hosts}")
            raise RuntimeError(
                f"the controller failed on {hosts} hosts (Ray logs in {log_dir}): {done.stderr[-4000:]}"
            )
    raw = json.loads(done.stdout.strip().splitlines()[-1])
    return raw, [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)], stopped


def run_hosts(hosts: int, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """One cluster of `hosts` worker hosts, Ray's measures (`run_controller`)."""
    from simcluster import rate_bits

    raw, links, stopped = run_controller(hosts, args, log_dir, "bench.cluster.ray_peer", job_flags(args))
    result = summarise(hosts, raw["repeats"], rate_bits(args.rate), args.layout)
    result["links"] = links  # host 0: the head's
    result["stopped_pids"] = stopped
    return result


def ray_temp_dir(prefix: str) -> Path:
    """Ray's root temp dir for this run: its own (not /tmp/ray, which other clusters share), and
    short, since Ray's Unix socket paths live under it."""
    return Path(f"/tmp/{prefix}ray{os.getpid()}")


def _stop_or_raise(namespaces: list[str], stopped: list[int]) -> None:
    """Stop every process in `namespaces`, recording their pids in `stopped`; raise if any stays."""
    stopped.extend(p for ns in namespaces for p in namespace_pids(ns))
    left = stop_namespaces(namespaces)
    if left:
        raise RuntimeError(f"processes still running in {namespaces} after SIGKILL: {left}")


def job_flags(args: argparse.Namespace) -> list[str]:
    return [*batch_flags(args), f"--layout={args.layout}", *(["--check"] if args.check else [])]


def batch_flags(args: argparse.Namespace) -> list[str]:
    """The batch and the repeats (`add_cluster_args`) as the controller's flags."""
    return [f"--prompts={args.prompts}", f"--n={args.n}", f"--mean-len={args.mean_len}",
            f"--max-len={args.max_len}", f"--seed={args.seed}", f"--repeats={args.repeats}"]  # fmt: skip


def summarise(hosts: int, repeats: list[dict[str, Any]], rate: int, layout: str = "packed") -> dict[str, Any]:
    """Medians, the link bound and Ray's time over it, from the controller's repeats."""
    busiest = statistics.median(max(r["link"]["in"], r["link"]["out"]) for r in repeats)
    get_s = statistics.median(max(r["gets"]) for r in repeats)
    bound = busiest * 8 / rate
    out: dict[str, Any] = {
        "hosts": hosts,
        "layout": layout,
        "rate_bits": rate,
        "batch_bytes": statistics.median(r["link"]["total"] for r in repeats),
        "busiest_link_bytes": busiest,
        "ray_get_s": get_s,
        "ray_get_seconds": [max(r["gets"]) for r in repeats],
        "ray_gets": [sorted(round(g, 3) for g in r["gets"]) for r in repeats],
        "ray_wall_s": statistics.median(r["wall"] for r in repeats),
        "ray_cpu": statistics.median(r["cpu"] for r in repeats),
        "ray_bound_s": bound,
        "ray_get_over_bound": get_s / bound if bound > 0 else None,
        "tasks": repeats[0]["tasks"],
        "objects": repeats[0]["objects"],  # each consumer's, in one ray.get
    }
    if "equal" in repeats[0]:
        out["equal"] = all(r["equal"] for r in repeats)
    return out


def add_distbatch(
    results: list[dict[str, Any]], path: Path, measures: Sequence[str] = ("ray_get", "ray_wall")
) -> None:
    """Put bench.cluster.job's distributed data step (same hosts) next to each result, and the
    ratio of each of `measures` (`<measure>_s` in the result) to it."""
    theirs = {r["hosts"]: r for r in json.loads(path.read_text())["results"]}
    for r in results:
        d = theirs.get(r["hosts"])
        if d is None or d["rate_bits"] != r["rate_bits"]:
            continue
        r["distbatch_data_s"] = d["data_distributed_s"]
        r["distbatch_gather_s"] = statistics.median(max(g) for g in d["data_distributed_gathers"])
        for measure in measures:
            r[f"{measure}_over_distbatch_data"] = r[f"{measure}_s"] / d["data_distributed_s"]


def report(results: list[dict[str, Any]]) -> list[str]:
    """The table a person reads."""
    lines = [
        f"{'hosts':>5} {'layout':>7} {'objs':>5} {'MB':>6} {'ray get':>8} {'wall':>7} {'bound':>7} "
        f"{'x bound':>8} {'cpu':>5} {'distbatch':>10} {'ray/db':>7}"
    ]
    for r in results:
        db = r.get("distbatch_data_s")
        ratio = r.get("ray_get_over_distbatch_data")
        over = r["ray_get_over_bound"] or float("nan")
        lines.append(
            f"{r['hosts']:>5} {r['layout']:>7} {max(r['objects']):>5} {r['batch_bytes'] / 1e6:>6.1f} "
            f"{r['ray_get_s']:>7.2f}s {r['ray_wall_s']:>6.2f}s {r['ray_bound_s']:>6.2f}s {over:>7.2f}x "
            f"{r['ray_cpu']:>5.0%} "
            f"{(f'{db:.2f}s' if db else '-'):>10} {(f'{ratio:.2f}x' if ratio else '-'):>7}"
        )
    return lines


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.cluster.ray_peer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_cluster_args(parser, prefix="dbr", out="bench-cluster-ray")
    parser.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="packed",
        help="packed: each producer cuts, packs and puts one object per consumer once the batch is "
        "balanced (Ray's best case, not timed); groups: one object per group of n, put as generated",
    )
    parser.add_argument("--check", action="store_true", help="check every chunk against distbatch's own")
    return parser.parse_args(argv)


def add_cluster_args(parser: argparse.ArgumentParser, prefix: str, out: str) -> None:
    """The options the Ray-in-namespaces benches share: the role, hosts, rate, batch, repeats,
    names, results, the distbatch results to compare with, and the controller's own."""
    from bench.cluster.job import add_batch_args

    parser.add_argument(
        "role", nargs="?", choices=["driver", "controller"], default="driver", help=argparse.SUPPRESS
    )
    parser.add_argument("--hosts", default="2,4", help="comma list of worker-host counts")
    parser.add_argument("--rate", default="100mbit", help="every host's NIC, each way (tc units)")
    add_batch_args(parser)
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per host count")
    parser.add_argument("--prefix", default=prefix, help="names of the cluster's namespaces and links")
    parser.add_argument("--out", default=out, help="results directory")
    parser.add_argument("--distbatch", type=Path, help="bench.cluster.job's cluster.json to compare with")
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--node-ip", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, help=argparse.SUPPRESS)


def unavailable() -> str | None:
    """Why this bench cannot run here (no simulated cluster, no Ray), or None."""
    import importlib.util

    from simcluster import check

    problem = check()
    if problem is None and importlib.util.find_spec("ray") is None:
        problem = "ray is not installed"
    return problem


def driver_main(args: argparse.Namespace, progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Every host count in turn (one cluster and one Ray cluster each, torn down after)."""
    return drive(args, "cluster_ray", unavailable(), run_hosts, add_distbatch, report, progress)


def drive(
    args: argparse.Namespace,
    name: str,
    problem: str | None,
    run: Callable[[int, argparse.Namespace, Path], dict[str, Any]],
    compare: Callable[[list[dict[str, Any]], Path], None],
    table: Callable[[list[dict[str, Any]]], list[str]],
    progress: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """A bench's driver: `run` each host count in turn, `compare` with `--distbatch`, print its
    `table` as it goes and at the end; the results in `<out>/<name>.json`. Exits with `problem`
    if this machine cannot run it."""
    if problem is not None:
        raise SystemExit(f"cannot run {name} here: {problem}")
    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    results = []
    for hosts in [int(h) for h in args.hosts.split(",")]:
        progress(f"{hosts} host(s) at {args.rate} ...")
        results.append(run(hosts, args, out / "logs"))
        if args.distbatch:
            compare(results[-1:], args.distbatch)
        progress(table(results)[-1])
    (out / f"{name}.json").write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1)
    )
    for line in table(results):
        print(line)
    print(f"results: {out / f'{name}.json'}")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    return run_role(parse_args(argv), controller_main, driver_main)


if __name__ == "__main__":
    raise SystemExit(main())
