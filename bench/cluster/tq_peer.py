"""TransferQueue's own SimpleStorage backend moving the grpo batch on the simulated cluster: the
peer measure next to bench/cluster/job.py's distributed data step, same batch, same links.

The Ray cluster of bench/cluster/ray_peer.py runs inside the namespaces of `simcluster`: the Ray
head on host 0 (one CPU) with this bench's controller, which calls `transfer_queue.init`; a
raylet on each of hosts 1..N with a producer and a consumer actor (pinned by the custom
resource `host<i>`) and one `SimpleStorageUnit`. TransferQueue 0.1.11 takes no placement for
its controller actor (`interface.init`: a name and a namespace, `num_cpus=1` from its
decorator): Ray puts it on the caller's node, host 0, while that has a CPU free. Its units it
places itself (`get_node_round_robin_scheduling_strategies`: hard node affinity, round robin
over the sorted ids of the alive nodes that have `backend.SimpleStorage.required_node_resource`);
the worker hosts alone get that resource (`tqunit`), and N units over N such nodes is one per
worker host. Where each landed is checked (the run stops otherwise) and reported. Per repeat:

1. each producer generates its share of the batch with examples/grpo_pipeline.py's
   `RolloutEngine.generate` (prompts i::N, as bench/cluster/job.py's rollout workers);
2. timed, the **put**: every producer `kv_batch_put`s its share at once, one key per task, the
   ragged fields as jagged nested tensors (TransferQueue's form for them); TransferQueue routes
   each task to the unit `global_index % N` (indexes handed out in order by its controller), so
   about (N-1)/N of every share crosses its host's link;
3. the controller balances the tasks with distbatch's own `chunk_balanced` rows (by
   `input_ids` length, groups of n kept together), as bench/cluster/ray_peer.py does:
   consumer i gets the tasks train worker i gets in the distbatch data step;
4. timed, the **get**: every consumer `kv_batch_get`s its chunk's keys at once (from every
   unit); the get phase is the slowest consumer's, the put phase the slowest producer's;
5. each chunk's digests are checked against distbatch's own chunk, then `kv_clear`.

Next to it: the link lower bound of the distbatch data step as bench/cluster/ray_peer.py
computes it (the bytes the busiest NIC must carry one way over the rate), and the bytes that
crossed each host's NIC in each phase (its namespace's `eth0` counters, so headers included):
what TransferQueue's placement moved. Medians over `--repeats`.

    python -m bench.cluster.tq_peer --hosts 2,4,8 --rate 100mbit --repeats 3 --out /tmp/cluster-tq \\
        [--distbatch /tmp/cluster-bench/cluster.json]

`--distbatch` reads bench.cluster.job's results (same hosts and rate) and adds the ratios of
TransferQueue's get and put+get to distbatch's data step. Needs root, `ip` and `tc`
(`simcluster`), Ray and transferqueue. Processes are stopped by the pids in each host's
namespace (`simcluster.stop_namespaces`), never by name.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.cluster import run_role
from bench.cluster.ray_peer import (
    RAGGED_FIELDS,
    TASK_FIELDS,
    Consumer,
    Producer,
    add_cluster_args,
    add_distbatch,
    balance,
    batch_flags,
    chunk_digests,
    drive,
    expected_digests,
    generate,
    link_bytes,
    make_actors,
    run_controller,
)
from bench.cluster.ray_peer import unavailable as ray_unavailable

PARTITION = "grpo"
UNIT_RESOURCE = "tqunit"  # worker hosts only: where TransferQueue may place its storage units
# Logical CPUs per node, not cores: TransferQueue's controller and units each ask for one. A
# worker host holds a unit, a producer and a consumer; one spare, so a controller placed there
# (reported as an error) does not leave the units waiting forever.
HEAD_CPUS = 1
WORKER_CPUS = 4
NIC = "eth0"  # a host's end of its link, inside its namespace (simcluster.hosts.NS_IFNAME)
WARM_UP_TOKENS = 20_000


# ----------------------------------------------------------------------------- pure parts


def task_key(step: int, producer: int, row: int) -> str:
    """The TransferQueue key of producer `producer`'s task `row` in repeat `step`."""
    return f"{step}-{producer}-{row}"


def chunk_keys(step: int, local_rows: Sequence[Sequence[np.ndarray]], consumer: int) -> list[str]:
    """Consumer `consumer`'s keys, in the order its chunk is assembled (producer 0's tasks
    first, as bench/cluster/ray_peer.py's pieces): local_rows[producer][consumer] (`split_rows`)."""
    return [
        task_key(step, p, int(r)) for p, per_consumer in enumerate(local_rows) for r in per_consumer[consumer]
    ]


def rows_bytes(fields: dict[str, np.ndarray], offsets: np.ndarray, rows: np.ndarray) -> int:
    """The field bytes of these rows of a share (as `piece_bytes` of the rows cut out, without
    cutting them): the distbatch data step's bytes for a host pair."""
    rows = np.asarray(rows, dtype=np.int64)
    tokens = int((offsets[rows + 1] - offsets[rows]).sum())
    ragged = sum(tokens * fields[f].itemsize for f in RAGGED_FIELDS)
    return ragged + sum(len(rows) * fields[f].itemsize for f in TASK_FIELDS)


def nic_bytes(net_dev: str, nic: str = NIC) -> dict[str, int]:
    """A NIC's bytes received and sent so far, from /proc/net/dev's text."""
    for line in net_dev.splitlines():
        name, sep, counters = line.partition(":")
        if sep and name.strip() == nic:
            values = counters.split()
            return {"received": int(values[0]), "sent": int(values[8])}
    raise ValueError(f"no interface {nic!r} in /proc/net/dev")


def nic_delta(after: Sequence[dict[str, int]], before: Sequence[dict[str, int]]) -> list[dict[str, int]]:
    """Per host, the bytes between two readings of `nic_bytes`."""
    return [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]


def packed(value: Any) -> tuple[np.ndarray, np.ndarray]:
    """A field as TransferQueue returns it (a jagged nested tensor for a ragged field, a dense
    [tasks] tensor for a scalar one) as numpy (values, lengths per task)."""
    if getattr(value, "is_nested", False):
        offsets = value.offsets().numpy().astype(np.int64)
        values = value.values().numpy()[offsets[0] : offsets[-1]]
        return values, np.diff(offsets)
    values = value.numpy()
    return values, np.ones(len(values), dtype=np.int64)


def placed_hosts(ips: Sequence[str]) -> list[int]:
    """The cluster hosts of these addresses (host i is simcluster's SUBNET.{i+1})."""
    from simcluster import SUBNET

    out = []
    for ip in ips:
        prefix, _, last = ip.rpartition(".")
        if prefix != SUBNET:
            raise ValueError(f"{ip} is not a cluster address ({SUBNET}.x)")
        out.append(int(last) - 1)
    return out


def busiest(moved: Sequence[dict[str, int]]) -> int:
    """The most bytes one NIC carried in one direction."""
    return max((max(m["received"], m["sent"]) for m in moved), default=0)


# ----------------------------------------------------------------------------- the actors


class TQClient:
    """What both actors do: join TransferQueue (its client, in this process) and read their
    host's NIC counters."""

    def connect(self) -> str:
        """`transfer_queue.init()`: a client of the controller the driver started."""
        import transfer_queue as tq

        tq.init()
        return str(tq.__version__)

    def nic(self) -> dict[str, int]:
        return nic_bytes(Path("/proc/self/net/dev").read_text())


class TQProducer(Producer, TQClient):
    """A rollout host: generates its share (`Producer.generate`) and puts it into
    TransferQueue, one key per task."""

    def put(self, step: int, producer: int) -> dict[str, Any]:
        """`kv_batch_put` the whole share (built before the clock: numpy to tensors is no copy
        for the values); the seconds the put took and the bytes."""
        import torch
        import transfer_queue as tq
        from tensordict import TensorDict

        offsets = torch.from_numpy(self.offsets)
        columns: dict[str, Any] = {
            f: torch.nested.nested_tensor_from_jagged(torch.from_numpy(self.fields[f]), offsets=offsets)
            for f in RAGGED_FIELDS
        }
        columns.update({f: torch.from_numpy(self.fields[f]) for f in TASK_FIELDS})
        tasks = len(self.offsets) - 1
        fields = TensorDict(columns, batch_size=[tasks])
        keys = [task_key(step, producer, row) for row in range(tasks)]
        started = time.perf_counter()
        tq.kv_batch_put(keys=keys, partition_id=PARTITION, fields=fields)
        seconds = time.perf_counter() - started
        return {"seconds": seconds, "bytes": rows_bytes(self.fields, self.offsets, np.arange(tasks))}

    def pair_bytes(self, rows_per_consumer: list[np.ndarray]) -> list[int]:
        """The bytes of each consumer's rows of this share."""
        return [rows_bytes(self.fields, self.offsets, rows) for rows in rows_per_consumer]


class TQConsumer(Consumer, TQClient):
    """A train host: gets its chunk's keys, from every unit, with one `kv_batch_get`."""

    def get(self, keys: list[str], check: bool = True) -> dict[str, Any]:
        """The seconds `kv_batch_get` took, the tasks and bytes, and with `check` a digest of
        each field of the chunk."""
        import transfer_queue as tq

        started = time.perf_counter()
        got = tq.kv_batch_get(keys=keys, partition_id=PARTITION)
        seconds = time.perf_counter() - started
        fields = {f: packed(got[f]) for f in (*RAGGED_FIELDS, *TASK_FIELDS)}
        out: dict[str, Any] = {
            "seconds": seconds,
            "tasks": len(keys),
            "bytes": sum(int(values.nbytes) for values, _ in fields.values()),
        }
        if check:
            lengths = fields[RAGGED_FIELDS[0]][1]
            out["digests"] = chunk_digests({f: values for f, (values, _) in fields.items()}, lengths)
        return out


# ----------------------------------------------------------------------------- controller (host 0)


def start_transferqueue(workers: int) -> dict[str, Any]:
    """`transfer_queue.init` with SimpleStorage, one unit per worker host; where its controller
    and units landed (hosts, unit order as TransferQueue routes: key `global_index % N`).
    Raises if that is not the controller on host 0 and one unit on each worker host."""
    import transfer_queue as tq
    from omegaconf import OmegaConf

    options = {"num_data_storage_units": workers, "required_node_resource": UNIT_RESOURCE}
    backend = {"storage_backend": "SimpleStorage", "SimpleStorage": options}
    conf = tq.init(OmegaConf.create({"backend": backend}))
    if conf is None:
        raise RuntimeError("a TransferQueue controller was already running in this Ray cluster")
    controller = placed_hosts([conf.controller.zmq_info.ip])[0]
    units = placed_hosts([info.ip for info in conf.backend.SimpleStorage.zmq_info.values()])
    placement = {"controller": controller, "units": units, "version": str(tq.__version__)}
    if controller != 0 or sorted(units) != list(range(1, workers + 1)):
        raise RuntimeError(f"TransferQueue is not placed as this bench needs: {placement}")
    return placement


def host_nics(producers: list[Any]) -> list[dict[str, int]]:
    """Every host's NIC counters now: host 0's (this process's namespace), then each worker
    host's (its producer reads them)."""
    import ray

    return [TQClient().nic(), *ray.get([p.nic.remote() for p in producers])]


def one_repeat(
    args: argparse.Namespace, producers: list[Any], consumers: list[Any], step: int
) -> dict[str, Any]:
    """Generate; time the puts; balance; time the gets; check; clear."""
    import ray
    import transfer_queue as tq

    from bench.cluster.job import cpu_busy_seconds

    hosts = len(producers)
    lengths = generate(args, producers, step)
    nics = [host_nics(producers)]
    cpu0, t0 = cpu_busy_seconds(), time.perf_counter()
    puts = ray.get([p.put.remote(step, i) for i, p in enumerate(producers)])
    put_wall, put_cpu = time.perf_counter() - t0, cpu_busy_seconds() - cpu0
    nics.append(host_nics(producers))
    local_rows = balance(args, lengths)
    pair = ray.get([p.pair_bytes.remote(rows) for p, rows in zip(producers, local_rows)])
    keys = [chunk_keys(step, local_rows, i) for i in range(hosts)]
    nics.append(host_nics(producers))
    cpu0, t0 = cpu_busy_seconds(), time.perf_counter()
    gets = ray.get([c.get.remote(keys[i], args.check) for i, c in enumerate(consumers)])
    get_wall, get_cpu = time.perf_counter() - t0, cpu_busy_seconds() - cpu0
    nics.append(host_nics(producers))
    tq.kv_clear(keys=[k for chunk in keys for k in chunk], partition_id=PARTITION)
    ray.get([p.clear.remote() for p in producers])
    out: dict[str, Any] = {
        "puts": [float(p["seconds"]) for p in puts],
        "put_wall": put_wall,
        "put_cpu": put_cpu / max(put_wall, 1e-9) / (os.cpu_count() or 1),
        "put_bytes": [int(p["bytes"]) for p in puts],
        "gets": [float(g["seconds"]) for g in gets],
        "get_wall": get_wall,
        "get_cpu": get_cpu / max(get_wall, 1e-9) / (os.cpu_count() or 1),
        "tasks": [int(g["tasks"]) for g in gets],
        "bytes": [int(g["bytes"]) for g in gets],
        "link": link_bytes(pair),
        "put_moved": nic_delta(nics[1], nics[0]),
        "get_moved": nic_delta(nics[3], nics[2]),
        "keys_left": len(tq.kv_list(partition_id=PARTITION).get(PARTITION, {})),
    }
    if args.check:
        out["equal"] = [g["digests"] for g in gets] == expected_digests(args, hosts, step)
    return out


def warm_up(producers: list[Any], consumers: list[Any]) -> None:
    """A small share from every producer, got whole by every consumer, so every client has
    connected to every unit before the clock runs."""
    import ray
    import transfer_queue as tq

    step = -1
    ray.get([p.generate.remote([0], 1, WARM_UP_TOKENS, 4 * WARM_UP_TOKENS, 0, 0) for p in producers])
    ray.get([p.put.remote(step, i) for i, p in enumerate(producers)])
    keys = [task_key(step, i, 0) for i in range(len(producers))]
    ray.get([c.get.remote(keys, False) for c in consumers])
    tq.kv_clear(keys=keys, partition_id=PARTITION)
    ray.get([p.clear.remote() for p in producers])


def controller_main(args: argparse.Namespace) -> int:
    """Run on host 0: join the Ray cluster, start TransferQueue, time the repeats, print one
    JSON line."""
    import ray
    import transfer_queue as tq

    ray.init(
        address=args.address, _node_ip_address=args.node_ip, log_to_driver=False, configure_logging=False
    )
    try:
        placement = start_transferqueue(args.workers)
        try:
            producers, consumers = make_actors(args.workers, TQProducer, TQConsumer)
            ray.get([a.connect.remote() for a in (*producers, *consumers)])
            warm_up(producers, consumers)
            repeats = [one_repeat(args, producers, consumers, step) for step in range(args.repeats)]
        finally:
            tq.close()
    finally:
        ray.shutdown()
    print(json.dumps({"placement": placement, "repeats": repeats}))
    return 0


# ----------------------------------------------------------------------------- driver (root)


def run_hosts(hosts: int, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """One cluster of `hosts` worker hosts (+ host 0), TransferQueue's measures."""
    from simcluster import rate_bits

    flags = [*batch_flags(args), *([] if args.check else ["--no-check"])]
    raw, links, stopped = run_controller(
        hosts, args, log_dir, "bench.cluster.tq_peer", flags, head_cpus=HEAD_CPUS, worker_cpus=WORKER_CPUS,
        resources={UNIT_RESOURCE: 1},
    )  # fmt: skip
    result = summarise(hosts, raw["repeats"], rate_bits(args.rate))
    result["placement"] = raw["placement"]
    result["links"] = links  # the whole run, warm-up included; host 0: the head's and TQ controller's
    result["stopped_pids"] = stopped
    return result


def summarise(hosts: int, repeats: list[dict[str, Any]], rate: int) -> dict[str, Any]:
    """Medians, the distbatch data step's link bound and what TransferQueue's phases moved,
    from the controller's repeats."""
    put = [max(r["puts"]) for r in repeats]
    get = [max(r["gets"]) for r in repeats]
    bound_bytes = statistics.median(max(r["link"]["in"], r["link"]["out"]) for r in repeats)
    bound = bound_bytes * 8 / rate
    put_moved = statistics.median(busiest(r["put_moved"]) for r in repeats)
    get_moved = statistics.median(busiest(r["get_moved"]) for r in repeats)
    out: dict[str, Any] = {
        "hosts": hosts,
        "rate_bits": rate,
        "batch_bytes": statistics.median(r["link"]["total"] for r in repeats),
        "busiest_link_bytes": bound_bytes,
        "bound_s": bound,
        "tq_put_s": statistics.median(put),
        "tq_get_s": statistics.median(get),
        "tq_put_get_s": statistics.median(p + g for p, g in zip(put, get)),
        "tq_put_seconds": put,
        "tq_get_seconds": get,
        "tq_put_wall_s": statistics.median(r["put_wall"] for r in repeats),
        "tq_get_wall_s": statistics.median(r["get_wall"] for r in repeats),
        "put_cpu": statistics.median(r["put_cpu"] for r in repeats),  # busy cores / all cores
        "get_cpu": statistics.median(r["get_cpu"] for r in repeats),
        "put_busiest_nic_bytes": put_moved,
        "get_busiest_nic_bytes": get_moved,
        "put_moved_s": put_moved * 8 / rate,  # those bytes at the rate: what this placement costs
        "get_moved_s": get_moved * 8 / rate,
        "put_moved": repeats[len(repeats) // 2]["put_moved"],  # per host, one repeat
        "get_moved": repeats[len(repeats) // 2]["get_moved"],
        "tasks": repeats[0]["tasks"],
        "keys_left": max(r["keys_left"] for r in repeats),
    }
    if "equal" in repeats[0]:
        out["equal"] = all(r["equal"] for r in repeats)
    return out


def compare(results: list[dict[str, Any]], path: Path) -> None:
    """bench.cluster.job's distributed data step next to TransferQueue's get and put+get."""
    add_distbatch(results, path, ("tq_get", "tq_put_get"))


def report(results: list[dict[str, Any]]) -> list[str]:
    """The table a person reads."""
    lines = [
        f"{'hosts':>5} {'MB':>6} {'put':>7} {'get':>7} {'put+get':>8} {'bound':>7} {'put MB':>7} "
        f"{'get MB':>7} {'cpu p/g':>8} {'distbatch':>10} {'get/db':>7} {'p+g/db':>7}"
    ]
    for r in results:
        db = r.get("distbatch_data_s")
        ratios = [r.get("tq_get_over_distbatch_data"), r.get("tq_put_get_over_distbatch_data")]
        cpu = f"{r['put_cpu']:.0%}/{r['get_cpu']:.0%}"
        lines.append(
            f"{r['hosts']:>5} {r['batch_bytes'] / 1e6:>6.1f} {r['tq_put_s']:>6.2f}s {r['tq_get_s']:>6.2f}s "
            f"{r['tq_put_get_s']:>7.2f}s {r['bound_s']:>6.2f}s {r['put_busiest_nic_bytes'] / 1e6:>7.1f} "
            f"{r['get_busiest_nic_bytes'] / 1e6:>7.1f} {cpu:>8} "
            f"{(f'{db:.2f}s' if db else '-'):>10} "
            + " ".join(f"{(f'{x:.2f}x' if x else '-'):>7}" for x in ratios)
        )
    return lines


def markdown_table(results: list[dict[str, Any]]) -> str:
    """The table for the guide."""
    lines = [
        "| hosts | put | get | put + get | busiest NIC, put / get | distbatch link bound | distbatch "
        "data step | get / distbatch | put + get / distbatch |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        db = r.get("distbatch_data_s")
        ratios = [r.get("tq_get_over_distbatch_data"), r.get("tq_put_get_over_distbatch_data")]
        lines.append(
            f"| {r['hosts']} | {r['tq_put_s']:.2f} s | {r['tq_get_s']:.2f} s | {r['tq_put_get_s']:.2f} s | "
            f"{r['put_busiest_nic_bytes'] / 1e6:.1f} / {r['get_busiest_nic_bytes'] / 1e6:.1f} MB | "
            f"{r['bound_s']:.2f} s | {f'{db:.2f} s' if db else '-'} | "
            + " | ".join(f"{x:.2f}×" if x else "-" for x in ratios)
            + " |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.cluster.tq_peer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_cluster_args(parser, prefix="dbt", out="bench-cluster-tq")
    parser.add_argument(
        "--no-check", dest="check", action="store_false", help="skip checking each chunk against distbatch's"
    )
    return parser.parse_args(argv)


def unavailable() -> str | None:
    """Why this bench cannot run here (no simulated cluster, no Ray, no transferqueue), or None."""
    from bench.transferqueue import available

    return ray_unavailable() or available()


def driver_main(args: argparse.Namespace, progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Every host count in turn (one cluster, Ray and TransferQueue each, torn down after)."""
    results = drive(args, "cluster_tq", unavailable(), run_hosts, compare, report, progress)
    (Path(args.out) / "cluster_tq.md").write_text(markdown_table(results) + "\n")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    return run_role(parse_args(argv), controller_main, driver_main)


if __name__ == "__main__":
    raise SystemExit(main())
