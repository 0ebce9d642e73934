"""`python -m bench.control_plane`: many consumers polling one served controller while a producer streams.

The control plane at scale (issue 25, point 5): `--consumers` threads (256 by default) in
`--groups` consumer groups (4 by default: 64 data-parallel ranks each, as four roles of an RL
step would be, say actor, critic, reference and reward) poll `get_meta` on one served
controller while one producer thread announces `--tasks` tasks, `--chunk` every
`--put-interval` seconds. Each group (a `task_name`) must get every task exactly once,
whichever of its ranks asks; the run checks that, and that nothing failed.

A consumer does what `StreamingDataset` does for one rank, less the gather: it asks for
`--batch-size` tasks with its `dp_rank` and `batch_index` (and the request id
`RemoteController` gives every call), works `--step-seconds` on each batch it gets (its
training step; ranks start at random points of their first step) and waits `--poll-interval`
after an empty answer. Only metadata moves: the producer announces REMOTE batches naming a
worker that is never contacted, so the figures are the controller's, not a data path's.

Two loads make the report (`run_steps`): steps of 0.5 s (each rank asks about twice a second:
the latency a paced job sees) and no step at all (every rank asks again at once: the most the
controller serves, where latency is queueing, about consumers / calls per second).

The controller is served by a child process (its own interpreter, as on a controller host;
`--in-process` serves it here). The consumers' `RemoteController`s share one `ShardClient`
(one event-loop thread and session, as ranks in one process share `default_client()`) that
allows one connection per consumer, so no consumer waits for a connection slot in the
client, as separate rank processes would not; `--client-per-consumer` gives each its own.

Reports get_meta calls/s, tasks delivered/s (all groups together), p50/p99 of get_meta as the
consumers timed it, the controller's own mean handling time (from its /metrics), and whether
every group got every task exactly once; `main(argv)` returns the same as a dict.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from bench.measure import percentiles
from distbatch import ShardClient
from distbatch.batch import DistributedBatchMemory
from distbatch.batch.meta import NODE_INDEX, BatchMeta, FieldMeta
from distbatch.controller import Controller
from distbatch.controller.remote import RemoteController
from distbatch.controller.server import ControllerServer, serve_controller
from distbatch.wire.shapes import RowShapes

ROOT = Path(__file__).resolve().parents[1]
FIELDS = ("input_ids", "reward")
# Where the announced shards "live": metadata only, nothing ever connects to it.
NOMINAL_NODE = "127.0.0.1:9"
GET_META_RULE = "/v1/controller/get_meta"
# The report's two loads: a training step of 0.5 s per batch, and none (flat out).
DEFAULT_STEPS = (0.5, 0.0)


class ControlPlaneError(AssertionError):
    """A run saw an error, a task delivered twice or never, or ran out of time."""

    def __init__(self, failures: list[str], result: dict[str, Any]) -> None:
        shown = "\n  ".join(failures[:20])
        super().__init__(f"control plane run failed ({len(failures)} problem(s)):\n  {shown}")
        self.failures = failures
        self.result = result


@dataclass(frozen=True)
class Scenario:
    """What one run does; `check()` refuses a scenario that could not deliver every task."""

    consumers: int = 256
    groups: int = 4
    tasks: int = 16_384
    batch_size: int = 16
    chunk: int = 256
    put_interval: float = 0.05
    poll_interval: float = 0.02
    step_seconds: float = 0.5
    max_seconds: float = 120.0
    # A run fails once no task has been delivered for this long (a stall), whatever its total
    # time; `max_seconds` is the backstop for a run that creeps.
    stall_seconds: float = 30.0
    client_per_consumer: bool = False

    def check(self) -> Scenario:
        """This scenario, or `ValueError` saying why it cannot run."""
        if min(self.consumers, self.groups, self.tasks, self.batch_size, self.chunk) < 1:
            raise ValueError("consumers, groups, tasks, batch size and chunk must be >= 1")
        if self.consumers % self.groups:
            raise ValueError(f"{self.consumers} consumers do not split into {self.groups} equal groups")
        if self.tasks % self.batch_size or self.tasks % self.chunk:
            # The sequential sampler serves only full batches: a tail would never be delivered.
            raise ValueError(f"tasks ({self.tasks}) must be a multiple of the batch size and the chunk")
        if min(self.put_interval, self.poll_interval, self.step_seconds) < 0 or not (
            self.max_seconds > 0 and self.stall_seconds > 0
        ):
            raise ValueError("intervals and steps must be >= 0, max_seconds and stall_seconds > 0")
        return self


@dataclass
class _ConsumerLog:
    """What one consumer saw: each get_meta's seconds, the task ids it was handed, its errors."""

    answered: list[float] = field(default_factory=list)
    empty: list[float] = field(default_factory=list)
    task_ids: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class _Progress:
    """Tasks delivered per group, shared by the consumers; a group's event is set once all came."""

    def __init__(self, groups: list[str], tasks: int) -> None:
        self._lock = threading.Lock()
        self._tasks = tasks
        self.delivered = dict.fromkeys(groups, 0)
        self.complete = {g: threading.Event() for g in groups}
        self.stop = threading.Event()  # an error, or the end: everyone stops

    def add(self, group: str, count: int) -> None:
        with self._lock:
            self.delivered[group] += count
            if self.delivered[group] >= self._tasks:
                self.complete[group].set()

    def total(self) -> int:
        with self._lock:
            return sum(self.delivered.values())

    def finished(self) -> bool:
        return all(e.is_set() for e in self.complete.values())


def announced_batch(task_ids: list[str], node: str = NOMINAL_NODE) -> DistributedBatchMemory:
    """A REMOTE batch of `task_ids` with a ragged int32 ``input_ids`` (64 to 511 tokens) and a
    float32 ``reward`` on `node`: metadata only, what a producer announces after its put."""
    n = len(task_ids)
    nodes = np.zeros(n, dtype=NODE_INDEX)
    lengths = [64 + (i * 7919) % 448 for i in range(n)]
    meta = BatchMeta(
        task_ids,
        [node],
        {
            "input_ids": FieldMeta("I32", nodes, RowShapes.ragged(lengths), ragged=True),
            "reward": FieldMeta("F32", nodes, RowShapes.uniform(n, ())),
        },
    )
    return DistributedBatchMemory.from_meta(meta)


def _consume(
    controller: RemoteController,
    partition: str,
    group: str,
    rank: int,
    scenario: Scenario,
    progress: _Progress,
    log: _ConsumerLog,
) -> None:
    """One rank of `group`: poll until the group has every task, an error, or the stop."""
    done = progress.complete[group]
    # Ranks do not all start at one instant: each starts somewhere within its first step.
    done.wait(random.Random(f"{group}-{rank}").uniform(0.0, scenario.step_seconds))
    batch_index = 0
    while not done.is_set() and not progress.stop.is_set():
        started = time.perf_counter()
        try:
            batch = controller.get_meta(
                partition, group, list(FIELDS), scenario.batch_size, dp_rank=rank, batch_index=batch_index
            )
        except Exception as exc:  # reported, never raised: the run says what failed
            log.errors.append(f"{group} rank {rank}: get_meta failed: {type(exc).__name__}: {exc}")
            progress.stop.set()
            return
        seconds = time.perf_counter() - started
        if len(batch):
            log.answered.append(seconds)
            log.task_ids.extend(batch.task_ids)
            progress.add(group, len(batch))
            batch_index += 1
            done.wait(scenario.step_seconds)  # the rank's training step on this batch
        else:
            log.empty.append(seconds)
            done.wait(scenario.poll_interval)


def _produce(
    controller: RemoteController,
    partition: str,
    task_ids: list[str],
    scenario: Scenario,
    progress: _Progress,
    put_seconds: list[float],
    errors: list[str],
) -> None:
    """Announce `task_ids`, `scenario.chunk` at a time, `put_interval` apart."""
    for start in range(0, len(task_ids), scenario.chunk):
        if progress.stop.is_set():
            return
        batch = announced_batch(task_ids[start : start + scenario.chunk])
        began = time.perf_counter()
        try:
            added = controller.put(partition, batch)
        except Exception as exc:  # reported, never raised
            errors.append(f"producer: put failed: {type(exc).__name__}: {exc}")
            progress.stop.set()
            return
        put_seconds.append(time.perf_counter() - began)
        if added != len(batch):
            errors.append(f"producer: put added {added} tasks, not {len(batch)}")
        progress.stop.wait(scenario.put_interval)


def _delivery(
    groups: list[str], logs: list[list[_ConsumerLog]], task_ids: list[str]
) -> tuple[dict[str, Any], list[str]]:
    """Per group: tasks handed out, duplicates, missing and unknown ones; and the failures."""
    wanted = set(task_ids)
    out: dict[str, Any] = {}
    failures: list[str] = []
    for group, group_logs in zip(groups, logs):
        seen = Counter(t for log in group_logs for t in log.task_ids)
        repeated = sorted(t for t, c in seen.items() if c > 1)
        missing = sorted(wanted.difference(seen))
        unknown = sorted(set(seen).difference(wanted))
        out[group] = {
            "delivered": sum(seen.values()),
            "distinct": len(seen),
            "duplicates": len(repeated),
            "missing": len(missing),
            "unknown": len(unknown),
            "consumers_served": sum(1 for log in group_logs if log.task_ids),
        }
        for what, ids in (("twice or more", repeated), ("never", missing), ("unknown tasks", unknown)):
            if ids:
                failures.append(f"group {group}: {len(ids)} task(s) delivered {what}, e.g. {ids[:3]}")
    return out, failures


def _server_totals(address: str) -> tuple[float, float]:
    """(get_meta requests, their summed seconds) from the served controller's /metrics."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
    with opener.open(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    found = {"count": 0.0, "sum": 0.0}
    for key in found:
        head = f'distbatch_request_seconds_{key}{{endpoint="{GET_META_RULE}"}}'
        for line in text.splitlines():
            if line.startswith(head):
                found[key] = float(line[len(head) :])
    return found["count"], found["sum"]


def _wait(progress: _Progress, deadline: float, stall_seconds: float, bar: tqdm) -> str | None:
    """Until every group has every task or a stop (None), no delivery for `stall_seconds`, or
    the deadline (what went wrong); the bar follows deliveries."""
    shown = 0
    last_delivery = time.monotonic()
    while not progress.finished() and not progress.stop.is_set():
        time.sleep(0.1)
        now, moment = progress.total(), time.monotonic()
        if now > shown:
            bar.update(now - shown)
            shown, last_delivery = now, moment
        elif moment - last_delivery > stall_seconds:
            return f"no task delivered for {stall_seconds} s ({shown} delivered)"
        if moment > deadline:
            return f"not every task delivered within the run's backstop ({shown} delivered)"
    return None


@dataclass
class _Run:
    """One run's moving parts: its partition, clients, threads and what they record."""

    address: str
    scenario: Scenario
    partition: str = field(default_factory=lambda: f"cp-{uuid.uuid4().hex[:8]}")
    clients: list[ShardClient] = field(default_factory=list)
    logs: list[list[_ConsumerLog]] = field(default_factory=list)
    put_seconds: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def groups(self) -> list[str]:
        return [f"group{g}" for g in range(self.scenario.groups)]

    def threads(self, admin: RemoteController, progress: _Progress) -> list[threading.Thread]:
        """The producer's thread, then every consumer's (not started)."""
        s = self.scenario
        per_group = s.consumers // s.groups
        self.logs = [[_ConsumerLog() for _ in range(per_group)] for _ in self.groups]
        shared = self.clients[1]  # clients[0] is the producer's
        task_ids = [f"{self.partition}-{i}" for i in range(s.tasks)]
        out = [
            threading.Thread(
                target=_produce,
                args=(admin, self.partition, task_ids, s, progress, self.put_seconds, self.errors),
                name="producer",
                daemon=True,
            )
        ]
        for g, group in enumerate(self.groups):
            for r in range(per_group):
                client = self.clients[2 + g * per_group + r] if s.client_per_consumer else shared
                args = (RemoteController(self.address, client=client), self.partition, group, r, s)
                out.append(
                    threading.Thread(
                        target=_consume,
                        args=(*args, progress, self.logs[g][r]),
                        name=f"consumer-{group}-{r}",
                        daemon=True,
                    )
                )
        return out


def run(address: str, scenario: Scenario, *, progress_bar: bool = True) -> dict[str, Any]:
    """Run `scenario` against the controller served at `address` (in a fresh partition, whose
    tasks are forgotten at the end); the figures, with ``ok`` False and ``failures`` if any."""
    scenario.check()
    job = _Run(address, scenario)
    # The producer's client (a process of its own, in a job), then the consumers' shared one.
    limit = scenario.consumers  # a connection per consumer
    job.clients.append(ShardClient(timeout=60.0))
    job.clients.append(ShardClient(timeout=60.0, max_connections=limit, max_connections_per_node=limit))
    if scenario.client_per_consumer:
        job.clients += [ShardClient(timeout=60.0) for _ in range(scenario.consumers)]
    progress = _Progress(job.groups, scenario.tasks)
    try:
        admin = RemoteController(address, client=job.clients[0])
        admin.create_partition(job.partition, FIELDS)  # consumers may poll before the first put
        server_before = _server_totals(address)
        producer, *consumers = job.threads(admin, progress)
        for thread in consumers:
            thread.start()
        started = time.perf_counter()
        producer.start()
        total = scenario.tasks * scenario.groups
        with tqdm(total=total, desc="control plane", unit="task", disable=not progress_bar) as bar:
            stalled = _wait(progress, time.monotonic() + scenario.max_seconds, scenario.stall_seconds, bar)
        seconds = time.perf_counter() - started
        if stalled is not None:
            job.errors.append(stalled)
        progress.stop.set()
        for thread in [producer, *consumers]:  # each call is bounded by the client's timeout
            thread.join(90.0)
            if thread.is_alive():
                job.errors.append(f"{thread.name} still running after the run")
        sent = sum(c.traffic().requests for c in job.clients)  # re-sends included
        consumed = {g: admin.consumption_status(job.partition, g)["consumed"] for g in job.groups}
        server_after = _server_totals(address)
        admin.forget_node(NOMINAL_NODE)  # nothing is stored there: drops the tasks, contacts nobody
    finally:
        for client in job.clients:
            client.close()
    calls = server_after[0] - server_before[0]
    server_ms = (server_after[1] - server_before[1]) / calls * 1e3 if calls else None
    result = _figures(job, seconds, consumed, server_ms)
    result["requests_sent"] = sent
    return result


def _figures(job: _Run, seconds: float, consumed: dict[str, int], server_ms: float | None) -> dict[str, Any]:
    """The run's figures from its logs; every failure listed."""
    s = job.scenario
    flat = [log for group_logs in job.logs for log in group_logs]
    task_ids = [f"{job.partition}-{i}" for i in range(s.tasks)]
    delivery, failures = _delivery(job.groups, job.logs, task_ids)
    failures = [*job.errors, *(e for log in flat for e in log.errors), *failures]
    for group, count in consumed.items():
        if count != s.tasks:
            failures.append(f"the controller says {group} consumed {count} of {s.tasks} tasks")
    answered = [t for log in flat for t in log.answered]
    empty = [t for log in flat for t in log.empty]
    calls = len(answered) + len(empty)
    delivered = sum(len(log.task_ids) for log in flat)
    return {
        "scenario": asdict(s),
        "consumers_per_group": s.consumers // s.groups,
        "seconds": seconds,
        "get_meta_calls": calls,
        "answered_calls": len(answered),
        "empty_calls": len(empty),
        "errors": len(job.errors) + sum(len(log.errors) for log in flat),
        "calls_per_s": calls / seconds if seconds > 0 else 0.0,
        "tasks_delivered": delivered,
        "tasks_per_s": delivered / seconds if seconds > 0 else 0.0,
        "get_meta": percentiles([*answered, *empty]),
        "get_meta_answered": percentiles(answered),
        "get_meta_empty": percentiles(empty),
        "put": percentiles(job.put_seconds),
        "server_get_meta_mean_ms": server_ms,
        "delivery": delivery,
        "consumed": consumed,
        "failures": failures,
        "ok": not failures,
    }


class ServedController:
    """A `Controller` served by a child process (`python -m bench.control_plane --serve`), or,
    with `in_process`, by this one; a context manager that stops it."""

    def __init__(self, in_process: bool = False) -> None:
        self._child: subprocess.Popen[str] | None = None
        self._server: ControllerServer | None = None
        if in_process:
            self._server = serve_controller(Controller())
            self.address = self._server.address
            return
        self._child = subprocess.Popen(
            [sys.executable, "-m", "bench.control_plane", "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        line = self._child.stdout.readline() if self._child.stdout is not None else ""
        if not line.strip():
            self.close()
            raise RuntimeError("the controller's child process printed no address")
        self.address = line.strip()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
        if self._child is not None:
            if self._child.stdin is not None:
                self._child.stdin.close()  # the child serves until its stdin closes
            try:
                self._child.wait(10)
            except subprocess.TimeoutExpired:
                self._child.kill()
                self._child.wait()

    def __enter__(self) -> ServedController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve_until_stdin_closes() -> None:
    # Each run ends with forget_node on the nominal worker, which the controller logs as lost tasks.
    logging.getLogger("distbatch.controller").setLevel(logging.ERROR)
    with serve_controller(Controller()) as server:
        print(server.address, flush=True)
        sys.stdin.read()


def run_steps(
    scenario: Scenario,
    steps: Sequence[float] = DEFAULT_STEPS,
    *,
    in_process: bool = False,
    progress_bar: bool = True,
) -> dict[str, Any]:
    """`scenario` once per step length in `steps`, on one served controller; raises
    `ControlPlaneError` (after every run) if any run failed."""
    runs = []
    with ServedController(in_process) as served:
        for step in steps:
            runs.append(run(served.address, replace(scenario, step_seconds=step), progress_bar=progress_bar))
    result = {"served": "this process" if in_process else "a child process", "runs": runs}
    failures = [f"steps of {r['scenario']['step_seconds']:g} s: {f}" for r in runs for f in r["failures"]]
    if failures:
        raise ControlPlaneError(failures, result)
    return result


def _load(step: float) -> str:
    return f"steps of {step:g} s" if step else "flat out"


def table(result: dict[str, Any]) -> str:
    """Each run of `run_steps` in a line: throughput, latency, errors, exactly once per group."""
    runs = result["runs"]
    if not runs:
        return "control plane: no run"
    s = runs[0]["scenario"]
    sharing = "a ShardClient each" if s["client_per_consumer"] else "one shared ShardClient"
    per_group, put_ms, poll_ms = (
        runs[0]["consumers_per_group"],
        s["put_interval"] * 1e3,
        s["poll_interval"] * 1e3,
    )
    lines = [
        f"control plane: {s['consumers']} consumers in {s['groups']} groups of {per_group} ({sharing}), "
        f"{s['tasks']:,} tasks per run in puts of {s['chunk']} every {put_ms:g} ms, "
        f"batches of {s['batch_size']}, empty polls {poll_ms:g} ms apart; controller in {result['served']}",
        f"  {'load':<18} {'calls/s':>8} {'tasks/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
        f"{'server ms':>9} {'put p50/p99':>12} {'answered/empty':>15} {'errors':>6}  once per group",
    ]
    for r in runs:
        p = r["get_meta"]
        once = all(d["duplicates"] == d["missing"] == d["unknown"] == 0 for d in r["delivery"].values())
        server = r["server_get_meta_mean_ms"]
        load = _load(r["scenario"]["step_seconds"])
        put = r["put"]
        put_ms = f"{put['p50_ms'] or 0:.1f}/{put['p99_ms'] or 0:.1f}"
        lines.append(
            f"  {load:<18} {r['calls_per_s']:>8,.0f} {r['tasks_per_s']:>8,.0f} "
            f"{p['p50_ms'] or 0:>8.2f} {p['p99_ms'] or 0:>8.2f} {p['max_ms'] or 0:>8.2f} "
            f"{server if server is not None else float('nan'):>9.2f} {put_ms:>12} "
            f"{r['answered_calls']:>8,}/{r['empty_calls']:<6,} {r['errors']:>6}  {'yes' if once else 'NO'}"
        )
    lines.append(
        "  (get_meta as the consumers timed it, empty polls included; server ms: the controller's own "
        "mean handling time; put: the producer's announcements, ms; tasks/s: all groups together)"
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.control_plane",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = Scenario()
    parser.add_argument("--consumers", type=int, default=d.consumers)
    parser.add_argument("--groups", type=int, default=d.groups, help="consumer groups (task names)")
    parser.add_argument("--tasks", type=int, default=d.tasks, help="tasks the producer announces per run")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="tasks per get_meta")
    parser.add_argument("--chunk", type=int, default=d.chunk, help="tasks per put")
    parser.add_argument("--put-interval", type=float, default=d.put_interval, help="seconds between puts")
    parser.add_argument(
        "--poll-interval", type=float, default=d.poll_interval, help="a consumer's wait after an empty poll"
    )
    parser.add_argument(
        "--steps",
        type=steps_list,
        default=list(DEFAULT_STEPS),
        help="comma list of a consumer's seconds of work per batch, one run each (0: flat out; "
        "default: %(default)s)",
    )
    parser.add_argument("--max-seconds", type=float, default=d.max_seconds, help="a run fails after this")
    stall_help = "a run fails after this long with no delivery"
    parser.add_argument("--stall-seconds", type=float, default=d.stall_seconds, help=stall_help)
    parser.add_argument("--client-per-consumer", action="store_true", help="a ShardClient per consumer")
    parser.add_argument("--in-process", action="store_true", help="serve the controller in this process")
    parser.add_argument("--json", action="store_true", help="also print the result as JSON")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        args.scenario = scenario_of(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def steps_list(text: str) -> list[float]:
    """A comma list of step lengths in seconds (>= 0), for argparse."""
    try:
        steps = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of seconds: {text!r}") from None
    if not steps or min(steps) < 0:
        raise argparse.ArgumentTypeError(f"steps must be seconds >= 0: {text!r}")
    return steps


def scenario_of(args: argparse.Namespace, prefix: str = "") -> Scenario:
    """The scenario `args` describe (attributes named with `prefix`, as `bench/__main__` has them)."""

    def arg(name: str, default: Any) -> Any:
        return getattr(args, prefix + name, default)

    d = Scenario()
    return Scenario(
        consumers=arg("consumers", d.consumers),
        groups=arg("groups", d.groups),
        tasks=arg("tasks", d.tasks),
        batch_size=arg("batch_size", d.batch_size),
        chunk=arg("chunk", d.chunk),
        put_interval=arg("put_interval", d.put_interval),
        poll_interval=arg("poll_interval", d.poll_interval),
        max_seconds=arg("max_seconds", d.max_seconds),
        stall_seconds=arg("stall_seconds", d.stall_seconds),
        client_per_consumer=arg("client_per_consumer", d.client_per_consumer),
    ).check()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.serve:
        _serve_until_stdin_closes()
        return {}
    try:
        result = run_steps(args.scenario, args.steps, in_process=args.in_process)
    except ControlPlaneError as exc:
        print(table(exc.result))
        raise
    print(table(result))
    if args.json:
        print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    try:
        main()
    except ControlPlaneError as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
