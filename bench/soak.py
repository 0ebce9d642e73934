"""`python -m bench.soak`: many client threads hammering real workers, every byte checked.

Starts `--workers` worker processes on loopback and runs `--clients` threads
that together do exactly `--ops` random operations:

- **put** a bundle of random-shape tensors (several dtypes, ragged, scalars,
  empty) and a JSON value per task, under fresh task ids, on a random worker;
  the stored byte count must equal the bytes of the values;
- **fetch** one to three earlier bundles (possibly on different workers) in
  one gather and compare each one's SHA-256 checksum with the one taken at put;
- **delete** an earlier bundle (by task ids or by exact keys); the count and
  bytes freed must match the bundle.

A bundle is checked out while one thread fetches or deletes it, so a fetch
never races a delete of the same bundle (which would be a legitimate 404).
At the end the sum of every worker's `/v1/stats` bytes (and shards) must equal
exactly those of the bundles still alive; then they are deleted and every
worker must be empty. Prints ops/s, p50/p99 latency per op type (the client
call only: building values and checksumming them is not counted) and the bytes
moved; `main(argv)` returns the same figures as a dict (and raises
`SoakError` listing every failure, if any).

By default all threads share one `ShardClient`: that is how the library is
meant to be used (one session, one connection pool, one loop thread per
process, as `default_client()` gives), and it is the harder case, since every
thread submits work to the same event loop and competes for the same pool.
`--client-per-thread` gives each thread its own client for comparison.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.measure import percentiles
from distbatch.client import ShardClient
from distbatch.client.results import Traffic
from distbatch.launch import WorkerProcess, spawn_workers

OP_TYPES = ("put", "fetch", "delete")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int8, torch.bool)


class SoakError(AssertionError):
    """The soak saw an error, a wrong byte or a wrong count; `result` holds the figures."""

    def __init__(self, failures: list[str], result: dict[str, Any]) -> None:
        shown = "\n  ".join(failures[:20])
        more = f"\n  ... and {len(failures) - 20} more" if len(failures) > 20 else ""
        super().__init__(f"soak failed ({len(failures)} problem(s)):\n  {shown}{more}")
        self.failures = failures
        self.result = result


# ---------------------------------------------------------------------- values and checksums


def value_nbytes(value: Any) -> int:
    """Bytes a worker stores for one shard: raw tensor bytes, or the UTF-8 JSON text."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def bundle_checksum(values: dict[tuple[str, str], Any]) -> str:
    """SHA-256 over every key, dtype, shape and byte of a bundle (key order does not matter)."""
    digest = hashlib.sha256()
    for key in sorted(values):
        value = values[key]
        digest.update(json.dumps(list(key)).encode())
        if isinstance(value, torch.Tensor):
            # A fresh buffer with unit stride: `.contiguous()` keeps a one-element view's stride
            # (torch calls it contiguous), which `.view(torch.uint8)` then refuses.
            flat = torch.empty(value.numel(), dtype=value.dtype).copy_(value.detach().cpu().reshape(-1))
            digest.update(f"T|{value.dtype}|{list(value.shape)}|".encode())
            digest.update(flat.view(torch.uint8).numpy().tobytes())
        else:
            digest.update(b"J|" + json.dumps(value, sort_keys=True).encode())
        digest.update(b"\x00")
    return digest.hexdigest()


# How often each edge a user meets turns up in the soak's random values (per tensor, per JSON
# value, per bundle). Every edge must go through every path (HTTP, same host, staged puts) without
# a fallback; the soak fails on a same-host request that fell back to HTTP.
EDGE_RATES = {
    "zero_dim": 0.05,  # a zero in one dimension, any position: (0,), (3, 0), (0, 2, 5), (2, 5, 0)
    "scalar": 0.08,  # a 0-dim tensor
    "strided": 0.10,  # non-contiguous: transposed, or every other element
    "empty_text": 0.10,  # "" in a JSON value
    "empty_bundle": 0.02,  # a put of no shards at all
}


def _random_shape(rng: random.Random, max_elems: int) -> list[int]:
    if rng.random() < EDGE_RATES["scalar"]:
        return []
    ndim = rng.choice((1, 1, 1, 2, 2, 3))
    budget = max(1, rng.randint(1, max_elems))
    shape = [rng.randint(1, max(1, int(budget ** (1 / ndim)))) for _ in range(ndim)]
    if rng.random() < EDGE_RATES["zero_dim"]:
        shape[rng.randrange(ndim)] = 0
    return shape


def _random_tensor(rng: random.Random, gen: torch.Generator, max_elems: int) -> torch.Tensor:
    dtype = rng.choice(_DTYPES)
    shape = _random_shape(rng, max_elems)
    strided = len(shape) >= 1 and rng.random() < EDGE_RATES["strided"]
    if strided:  # made bigger, then viewed without a copy: transposed, or every other row
        shape = shape[::-1] if len(shape) >= 2 else [shape[0] * 2]
    if dtype.is_floating_point:
        tensor = torch.randn(shape, generator=gen).to(dtype)
    elif dtype is torch.bool:
        tensor = torch.randint(0, 2, shape, generator=gen).bool()
    else:
        info = torch.iinfo(dtype)
        low, high = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
        tensor = torch.randint(low, high, shape, generator=gen, dtype=dtype)
    if strided:
        tensor = tensor.transpose(0, -1) if tensor.dim() >= 2 else tensor[::2]
    return tensor


def _random_text(rng: random.Random) -> str:
    if rng.random() < EDGE_RATES["empty_text"]:
        return ""
    return rng.choice(("é✓ text", "日本語", "emoji 🎲", 'tab\tand "quotes"', "plain"))


def make_bundle(rng: random.Random, prefix: str, max_elems: int) -> dict[tuple[str, str], Any]:
    """One to six fresh tasks, one to four tensor fields of random dtype and shape, one JSON field
    (or, at `EDGE_RATES["empty_bundle"]`, nothing at all)."""
    gen = torch.Generator().manual_seed(rng.getrandbits(62))
    if rng.random() < EDGE_RATES["empty_bundle"]:
        return {}
    tasks = [f"{prefix}-t{i}" for i in range(rng.randint(1, 6))]
    fields = [f"f{j}" for j in range(rng.randint(1, 4))]
    big = rng.random() < 0.05  # now and then a bundle large enough to be split and staged
    values: dict[tuple[str, str], Any] = {}
    for task_id in tasks:
        for name in fields:
            values[(task_id, name)] = _random_tensor(rng, gen, max_elems * (64 if big else 1))
        values[(task_id, "meta")] = {
            "uid": task_id,
            "reward": rng.random(),
            "tokens": [rng.randint(0, 50_000) for _ in range(rng.randint(0, 8))],
            "done": rng.random() < 0.5,
            "note": None if rng.random() < 0.5 else _random_text(rng),
            "text": _random_text(rng),
        }
    return values


# ---------------------------------------------------------------------- shared state


@dataclass
class Bundle:
    node: str
    keys: list[tuple[str, str]]
    sizes: dict[tuple[str, str], int]
    checksum: str
    nbytes: int

    @property
    def task_ids(self) -> list[str]:
        return sorted({t for t, _ in self.keys})


class _Pool:
    """Bundles alive on the workers; one being fetched or deleted is checked out (invisible)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[Bundle] = []
        self._out = 0

    def add(self, bundle: Bundle) -> None:
        with self._lock:
            self._free.append(bundle)

    def checkout(self, rng: random.Random, count: int) -> list[Bundle]:
        with self._lock:
            taken = []
            for _ in range(min(count, len(self._free))):
                i = rng.randrange(len(self._free))
                self._free[i], self._free[-1] = self._free[-1], self._free[i]
                taken.append(self._free.pop())
            self._out += len(taken)
            return taken

    def checkin(self, bundles: list[Bundle]) -> None:
        with self._lock:
            self._free.extend(bundles)
            self._out -= len(bundles)

    def forget(self, bundles: list[Bundle]) -> None:
        with self._lock:
            self._out -= len(bundles)

    def alive(self) -> tuple[list[Bundle], int]:
        """The bundles known alive, and how many are still checked out (0 once all threads ended)."""
        with self._lock:
            return list(self._free), self._out


@dataclass
class _ThreadLog:
    latencies: dict[str, list[float]] = field(default_factory=lambda: {op: [] for op in OP_TYPES})
    errors: list[str] = field(default_factory=list)
    bytes_put: int = 0
    bytes_fetched: int = 0
    bytes_deleted: int = 0
    staged_puts: int = 0


# ---------------------------------------------------------------------- the soak


def _worker_thread(
    index: int,
    ops: int,
    seed: int,
    nodes: list[str],
    client: ShardClient,
    pool: _Pool,
    log: _ThreadLog,
    deadline: float,
    max_elems: int,
) -> None:
    rng = random.Random(f"{seed}/{index}")
    for n in range(ops):
        if time.monotonic() > deadline:
            log.errors.append(f"thread {index}: deadline reached after {n} of {ops} ops")
            return
        roll = rng.random()
        op = "put" if roll < 0.45 else "fetch" if roll < 0.85 else "delete"
        taken = pool.checkout(rng, rng.randint(1, 3) if op == "fetch" else 1) if op != "put" else []
        if not taken:
            op = "put"
        try:
            if op == "put":
                elapsed = _put(rng, f"s{seed}-c{index}-b{n}", nodes, client, pool, log, max_elems)
            elif op == "fetch":
                elapsed = _fetch(client, taken, log)
            else:
                elapsed = _delete(rng, client, taken[0], log)
        except Exception as exc:  # recorded: the soak reports every failure at the end
            log.errors.append(f"thread {index} op {n} ({op}): {type(exc).__name__}: {exc}")
            if op == "fetch":
                pool.checkin(taken)
            elif op == "delete":
                pool.forget(taken)  # unknown whether it went: the final accounting will say
            continue
        log.latencies[op].append(elapsed)
        if op == "fetch":
            pool.checkin(taken)
        elif op == "delete":
            pool.forget(taken)


def _put(
    rng: random.Random,
    prefix: str,
    nodes: list[str],
    client: ShardClient,
    pool: _Pool,
    log: _ThreadLog,
    max_elems: int,
) -> float:
    values = make_bundle(rng, prefix, max_elems)
    node = rng.choice(nodes)
    sizes = {key: value_nbytes(v) for key, v in values.items()}
    nbytes = sum(sizes.values())
    checksum = bundle_checksum(values)
    started = time.perf_counter()
    result = client.put(node, values)
    elapsed = time.perf_counter() - started
    if result.stored != len(values) or result.bytes != nbytes:
        raise AssertionError(
            f"put on {node}: stored {result.stored} shards / {result.bytes} bytes, "
            f"expected {len(values)} / {nbytes}"
        )
    log.bytes_put += nbytes
    log.staged_puts += nbytes > client.max_bytes_per_request
    if values:  # an empty put stores nothing: nothing to fetch or delete later
        pool.add(Bundle(node, list(values), sizes, checksum, nbytes))
    return elapsed


def _fetch(client: ShardClient, bundles: list[Bundle], log: _ThreadLog) -> float:
    refs = [(b.node, t, f, b.sizes[(t, f)]) for b in bundles for t, f in b.keys]
    started = time.perf_counter()
    got = client.fetch(refs)
    elapsed = time.perf_counter() - started
    position = 0
    for bundle in bundles:
        values = dict(zip(bundle.keys, got[position : position + len(bundle.keys)]))
        position += len(bundle.keys)
        if bundle_checksum(values) != bundle.checksum:
            raise AssertionError(f"checksum mismatch for bundle {bundle.task_ids[0]}.. on {bundle.node}")
        log.bytes_fetched += bundle.nbytes
    return elapsed


def _delete(rng: random.Random, client: ShardClient, bundle: Bundle, log: _ThreadLog) -> float:
    started = time.perf_counter()
    if rng.random() < 0.5:
        result = client.delete(bundle.node, task_ids=bundle.task_ids)
    else:
        result = client.delete_many({bundle.node: bundle.keys})
    elapsed = time.perf_counter() - started
    if result.deleted != len(bundle.keys) or result.bytes_freed != bundle.nbytes:
        raise AssertionError(
            f"delete on {bundle.node}: {result.deleted} shards / {result.bytes_freed} bytes, "
            f"expected {len(bundle.keys)} / {bundle.nbytes}"
        )
    log.bytes_deleted += bundle.nbytes
    return elapsed


def _totals(client: ShardClient, nodes: list[str]) -> dict[str, int]:
    stats = [client.stats(node) for node in nodes]
    return {key: sum(int(s[key]) for s in stats) for key in ("bytes", "shards", "staged_bytes")}


def run_soak(
    nodes: Sequence[str],
    *,
    clients: int = 32,
    ops: int = 2000,
    seed: int = 0,
    max_seconds: float = 600.0,
    client_per_thread: bool = False,
    timeout: float = 30.0,
    max_bytes_per_request: int = 256 << 10,
    max_elems: int = 4096,
) -> dict[str, Any]:
    """Run the soak against running workers (which must hold nothing of it); returns the figures."""
    nodes = list(nodes)
    if clients < 1 or ops < 1 or not nodes:
        raise ValueError("need at least one client, one op and one node")

    def new_client() -> ShardClient:
        return ShardClient(timeout=timeout, max_bytes_per_request=max_bytes_per_request)

    shared = new_client()
    own = [new_client() for _ in range(clients)] if client_per_thread else []
    pool = _Pool()
    logs = [_ThreadLog() for _ in range(clients)]
    failures: list[str] = []
    try:
        before = _totals(shared, nodes)
        traffic_before = [c.traffic() for c in [shared, *own]]
        deadline = time.monotonic() + max_seconds
        threads = [
            threading.Thread(
                target=_worker_thread,
                args=(
                    i,
                    ops // clients + (i < ops % clients),
                    seed,
                    nodes,
                    own[i] if own else shared,
                    pool,
                    logs[i],
                    deadline,
                    max_elems,
                ),
                name=f"soak-{i}",
                daemon=True,
            )
            for i in range(clients)
        ]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:  # each op is bounded by the client timeout, so this ends
            thread.join(max(0.0, deadline - time.monotonic()) + 2 * timeout + 5)
            if thread.is_alive():
                failures.append(f"{thread.name} still running past the deadline")
        seconds = time.perf_counter() - started
        moved = sum((c.traffic() - t0 for c, t0 in zip([shared, *own], traffic_before)), Traffic())
        if moved.same_host_fallbacks:
            failures.append(
                f"{moved.same_host_fallbacks} same-host request(s) fell back to HTTP "
                "(the log says why, once per node and reason)"
            )

        for log in logs:
            failures.extend(log.errors)
        ops_done = sum(len(lat) for log in logs for lat in log.latencies.values())
        errors = sum(len(log.errors) for log in logs)

        alive, checked_out = pool.alive()
        if checked_out:
            failures.append(f"{checked_out} bundle(s) still checked out at the end")
        alive_bytes = sum(b.nbytes for b in alive)
        alive_shards = sum(len(b.keys) for b in alive)
        at_end = _totals(shared, nodes)
        if not failures:
            stored = at_end["bytes"] - before["bytes"]
            shards = at_end["shards"] - before["shards"]
            if (stored, shards) != (alive_bytes, alive_shards):
                failures.append(
                    f"workers hold {stored} bytes in {shards} shards; "
                    f"alive bundles are {alive_bytes} bytes in {alive_shards} shards"
                )
            if at_end["staged_bytes"]:
                failures.append(f"{at_end['staged_bytes']} staged bytes left on the workers")

        cleared = shared.delete_many(_keys_by_node(alive)) if alive else None
        left = _totals(shared, nodes)
        if alive and (cleared is None or cleared.bytes_freed != alive_bytes):
            failures.append(f"clearing the alive bundles freed {cleared} instead of {alive_bytes} bytes")
        if (left["bytes"], left["shards"]) != (before["bytes"], before["shards"]) and not errors:
            failures.append(f"after clearing, the workers hold {left} (before the soak: {before})")
    finally:
        shared.close()
        for c in own:
            c.close()

    per_op = {op: percentiles([s for log in logs for s in log.latencies[op]]) for op in OP_TYPES}
    return {
        "workers": len(nodes),
        "clients": clients,
        "client_per_thread": client_per_thread,
        "seed": seed,
        "ops_requested": ops,
        "ops_done": ops_done,
        "errors": errors,
        "seconds": seconds,
        "ops_per_s": ops_done / seconds if seconds > 0 else 0.0,
        "ops": per_op,
        "bytes_put": sum(log.bytes_put for log in logs),
        "bytes_fetched": sum(log.bytes_fetched for log in logs),
        "bytes_deleted": sum(log.bytes_deleted for log in logs),
        "staged_puts": sum(log.staged_puts for log in logs),
        "wire": {
            "requests": moved.requests,
            "bytes_sent": moved.bytes_sent,
            "bytes_received": moved.bytes_received,
            "same_host_requests": moved.same_host_requests,
            "same_host_bytes": moved.same_host_bytes,
            "same_host_fallbacks": moved.same_host_fallbacks,
        },
        "alive_bundles_at_end": len(alive),
        "alive_bytes_at_end": alive_bytes,
        "alive_shards_at_end": alive_shards,
        "stored_bytes_at_end": at_end["bytes"] - before["bytes"],
        "stored_shards_at_end": at_end["shards"] - before["shards"],
        "cleared_bytes": cleared.bytes_freed if cleared is not None else 0,
        "left_bytes": left["bytes"] - before["bytes"],
        "left_shards": left["shards"] - before["shards"],
        "failures": failures,
        "ok": not failures,
    }


def _keys_by_node(bundles: list[Bundle]) -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = {}
    for bundle in bundles:
        out.setdefault(bundle.node, []).extend(bundle.keys)
    return out


def format_report(result: dict[str, Any]) -> str:
    mib = 1 << 20
    lines = [
        f"soak: {result['workers']} workers, {result['clients']} client threads "
        f"({'one client each' if result['client_per_thread'] else 'one shared ShardClient'}), "
        f"seed {result['seed']}",
        f"  {result['ops_done']}/{result['ops_requested']} ops in {result['seconds']:.2f} s "
        f"= {result['ops_per_s']:.0f} ops/s, {result['errors']} error(s)",
    ]
    for op, s in result["ops"].items():
        if s["count"]:
            lines.append(
                f"  {op:<6} n={s['count']:<6} p50 {s['p50_ms']:7.2f} ms  p99 {s['p99_ms']:7.2f} ms  "
                f"max {s['max_ms']:7.2f} ms"
            )
    wire = result["wire"]
    lines += [
        f"  payload: put {result['bytes_put'] / mib:.1f} MiB ({result['staged_puts']} staged puts), "
        f"fetched+verified {result['bytes_fetched'] / mib:.1f} MiB, "
        f"deleted {result['bytes_deleted'] / mib:.1f} MiB",
        f"  wire: {wire['requests']} HTTP requests, sent {wire['bytes_sent'] / mib:.1f} MiB, "
        f"received {wire['bytes_received'] / mib:.1f} MiB; {wire['same_host_requests']} same-host "
        f"requests, {wire['same_host_bytes'] / mib:.1f} MiB, {wire['same_host_fallbacks']} fell back",
        f"  end: {result['alive_bundles_at_end']} bundles alive = {result['alive_bytes_at_end']} bytes; "
        f"workers held {result['stored_bytes_at_end']} bytes; after clearing {result['left_bytes']} bytes",
        "  OK" if result["ok"] else f"  FAILED: {len(result['failures'])} problem(s)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--clients", type=int, default=32, help="concurrent client threads")
    parser.add_argument("--ops", type=int, default=2000, help="operations in total, all threads together")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seconds", type=float, default=600.0, help="give up (and fail) after this")
    parser.add_argument("--client-per-thread", action="store_true", help="one ShardClient per thread")
    parser.add_argument("--timeout", type=float, default=30.0, help="the clients' per-call timeout")
    parser.add_argument(
        "--max-bytes-per-request",
        type=int,
        default=256 << 10,
        help="the clients' request split size (bigger bundles go as staged multi-request puts)",
    )
    parser.add_argument("--max-elems", type=int, default=4096, help="largest tensor, in elements")
    parser.add_argument("--json", action="store_true", help="also print the result as JSON")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be >= 1")

    workers: list[WorkerProcess] = spawn_workers(args.workers)
    try:
        result = run_soak(
            [w.node for w in workers],
            clients=args.clients,
            ops=args.ops,
            seed=args.seed,
            max_seconds=args.max_seconds,
            client_per_thread=args.client_per_thread,
            timeout=args.timeout,
            max_bytes_per_request=args.max_bytes_per_request,
            max_elems=args.max_elems,
        )
        result["workers_alive_at_end"] = sum(w.alive() for w in workers)
        if result["workers_alive_at_end"] != len(workers):
            result["failures"].append(f"only {result['workers_alive_at_end']} worker(s) alive at the end")
            result["ok"] = False
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            w.stop()
    print(format_report(result))
    if args.json:
        print(json.dumps(result, indent=2))
    if not result["ok"]:
        raise SoakError(result["failures"], result)
    return result


if __name__ == "__main__":
    try:
        main()
    except SoakError as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
