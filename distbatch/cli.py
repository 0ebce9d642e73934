"""`distbatch`: what a running set of workers holds, from a shell (as `ray status` is for Ray).

    distbatch status HOST:PORT [HOST:PORT ...] [--json]    shards, tasks, bytes, capacity, uptime,
                                                           engine, disk; a served controller: its partitions
    distbatch ls HOST:PORT [--after ID] [--limit N] [--all] [--json]   task ids and their fields
    distbatch show HOST:PORT ID [ID ...] [--json]             each field of these tasks: dtype, shape, bytes
    distbatch clear HOST:PORT (--tasks ID [ID ...] | --all --yes)      delete tasks
    distbatch worker [worker flags]                            the same as `python -m rpc_server`

The token comes from `DISTBATCH_TOKEN`, as for every client; `--timeout S` (seconds per worker,
default 10) goes before or after the sub-command. Exit status: 0, or 1 when a worker could not
be reached or refused (its row says why) or does not hold a task `show` or `clear --tasks`
names (it says which; `clear` deletes the others), or 2 for a bad command line.

`status` takes workers and served controllers (`serve_controller`) alike: a worker is a row of
the worker table; a controller (an address that has no worker stats but answers the controller's
summary) gets its own table, a row per partition: tasks, tasks with every field, what each
consumer (task name) consumed, the `get_meta` calls waiting in it, and its fields. Tables come
in the order the addresses were given (the worker table where the first worker was).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from distbatch.client.shard_client import ShardClient
from distbatch.errors import (
    AuthError,
    DistBatchError,
    NodeError,
    ProtocolError,
    RequestError,
    WorkerUnavailableError,
)
from distbatch.ids import validate_node
from distbatch.launch.flags import PROG_ENV
from distbatch.protocol import MAX_LIST_LIMIT

__all__ = ["main"]

PAGE = 1000
DEFAULT_TIMEOUT = 10.0


def _bytes(value: Any) -> str:
    """1536 -> '1.5 KiB'; None -> '-'."""
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _duration(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)):
        return "-"
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns aligned over the header and the full rows; a shorter row (a worker that could not
    be asked) keeps its first cells in the columns and lets its last one run on (never cut)."""
    full = [row for row in rows if len(row) == len(header)]
    widths = [max(len(str(c)) for c in column) for column in zip(header, *full)]

    def line(cells: Sequence[str]) -> str:
        aligned = [str(c).ljust(w) for c, w in zip(cells[:-1], widths)]
        return "  ".join([*aligned, str(cells[-1])]).rstrip()

    return "\n".join(line(row) for row in [header, *rows])


def _failure(exc: DistBatchError) -> tuple[str, str]:
    """What the status table says of a worker that could not be asked: a short label, and why
    (one line, without the address the row already names)."""
    if isinstance(exc, WorkerUnavailableError) and exc.reason:
        return "unreachable", exc.reason  # "connection refused", "timed out", ...
    if isinstance(exc, WorkerUnavailableError):
        label = "unreachable"
    elif isinstance(exc, AuthError):
        label = "refused"  # it answered: the token is wrong or missing
    elif isinstance(exc, (ProtocolError, RequestError)):
        label = "not a worker"  # it answered, but not as a worker does (e.g. a 404)
    else:
        label = "failed"
    said = exc.detail if isinstance(exc, NodeError) else str(exc)
    return label, " ".join(f"{type(exc).__name__}: {said}".split())  # one line, whatever the body held


def _ask(client: ShardClient, node: str) -> dict[str, Any]:
    """A worker's stats; or, for an address without them (a 404) that answers the controller's
    summary, that summary with ``"role": "controller"``. The worker's error if it is neither."""
    try:
        return client.stats(node)
    except RequestError as exc:
        if exc.status != 404:
            raise
        try:
            summary = client.request_json(node, "GET", "/v1/controller/summary")
        except DistBatchError:
            raise exc from None
        if not isinstance(summary, dict) or not isinstance(summary.get("partitions"), dict):
            raise exc from None
        return {"role": "controller", **summary}


def status(client: ShardClient, nodes: Sequence[str], as_json: bool) -> int:
    """One row per worker, one table per controller, in the order the addresses were given (the
    worker table where the first worker was); 1 if any address could not be asked."""
    results: dict[str, dict[str, Any]] = {}
    failed = False
    for node in nodes:
        try:
            results[node] = _ask(client, node)
        except DistBatchError as exc:
            label, why = _failure(exc)
            results[node] = {"error": why, "state": label}
            failed = True
    if as_json:
        print(json.dumps(results, indent=1))
        return int(failed)
    workers = {node: r for node, r in results.items() if r.get("role") != "controller"}
    sections = []
    for node, result in results.items():
        if result.get("role") == "controller":
            sections.append(_controller_table(node, result))
        elif node == next(iter(workers)):
            sections.append(_worker_table(workers))
    print("\n\n".join(sections))
    return int(failed)


def _counts(counts: Any) -> str:
    """``{"train": 4, "critic": 0}`` -> 'train=4 critic=0'; nothing -> '-'."""
    if not isinstance(counts, dict) or not counts:
        return "-"
    return " ".join(f"{name}={count:,}" for name, count in counts.items())


def _controller_table(node: str, summary: dict[str, Any]) -> str:
    """A controller's partitions: a line naming it, then a row per partition."""
    partitions: dict[str, dict[str, Any]] = summary["partitions"]
    title = (
        f"controller {node}: {len(partitions)} partition(s), "
        f"{summary.get('waiting_consumers', 0)} get_meta call(s) waiting"
    )
    if not partitions:
        return title
    header = ["partition", "tasks", "ready", "consumed", "waiting", "fields"]
    rows = []
    for pid, p in partitions.items():
        fields = {name: f.get("produced", 0) for name, f in (p.get("fields") or {}).items()}
        rows.append(
            [
                pid if p.get("exists", True) else f"{pid} (not created)",
                f"{p.get('tasks', 0):,}",
                f"{p.get('ready', 0):,}",
                _counts(p.get("consumed")),
                _counts(p.get("waiting")),
                _counts(fields),
            ]
        )
    return title + "\n" + _table(header, rows)


def _worker_table(results: dict[str, dict[str, Any]]) -> str:
    """A row per worker (or per address that could not be asked, saying why)."""
    header = ["worker", "shards", "tasks", "live", "held", "capacity", "shared", "uptime", "engine", "disk"]
    rows = []
    for node, r in results.items():
        if "error" in r:
            rows.append([node, f"{r['state']}: {r['error']}"])  # its last cell runs on, never cut
            continue
        rows.append(
            [
                node,
                f"{r.get('shards', 0):,}",
                f"{r.get('tasks', 0):,}",
                _bytes(r.get("live_bytes")),
                _bytes(r.get("held_bytes")),
                _bytes(r.get("capacity")),
                _bytes(r.get("shared_bytes")),
                _duration(r.get("uptime_seconds")),
                str(r.get("engine") or "-"),
                _disk(r.get("durable")),
            ]
        )
    return _table(header, rows)


def _disk(durable: Any) -> str:
    """A durable worker's log in a word (`--data-dir`): on disk, how far behind, or failed."""
    if not isinstance(durable, dict):
        return "-"  # shards in memory only
    if durable.get("failed"):
        return "failed"
    if durable.get("pending_records"):
        return f"{_bytes(durable.get('pending_bytes'))} behind"
    return "on disk"


def ls(client: ShardClient, node: str, after: str | None, limit: int, every: bool, as_json: bool) -> int:
    """Task ids and fields, a page at a time (`--all`: every page)."""
    tasks: list[list[Any]] = []
    total = 0
    following = after
    while True:
        page = client.list_tasks(node, following, limit)
        tasks += page["tasks"]
        total = page["total"]
        following = page["next"]
        if not every or following is None:
            break
    if as_json:
        print(json.dumps({"node": node, "total": total, "tasks": tasks, "next": following}, indent=1))
        return 0
    for task_id, fields in tasks:
        print(f"{task_id}\t{','.join(fields)}")
    more = f"; more after {following!r} (--after {following})" if following is not None else ""
    print(f"# {len(tasks)} of {total} task(s) on {node}{more}", file=sys.stderr)
    return 0


def _not_held(node: str, missing: Sequence[str]) -> None:
    shown = ", ".join(missing[:10]) + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else "")
    print(f"{node} holds no task {shown}", file=sys.stderr)


def show(client: ShardClient, node: str, tasks: Sequence[str], as_json: bool) -> int:
    """Each field of the named tasks: its dtype (or json), shape and bytes, read from the
    worker's own answer for those shards (one request per set of fields)."""
    fields_of, missing = client.task_fields(node, tasks)
    by_fields: dict[tuple[str, ...], list[str]] = {}
    for task, fields in fields_of.items():
        by_fields.setdefault(tuple(fields), []).append(task)
    bundles = client.fetch_products([(node, ids, list(fields)) for fields, ids in by_fields.items()])
    described: dict[str, list[dict[str, Any]]] = {}
    for bundle in bundles:
        described.update(describe_bundle(bundle))
    ordered = {task: described[task] for task in dict.fromkeys(tasks) if task in described}
    if as_json:
        print(json.dumps({"node": node, "tasks": ordered, "missing": missing}, indent=1))
    else:
        header = ["task", "field", "dtype", "shape", "bytes"]
        rows = [[task, r["field"], r["dtype"], _shape(r["shape"]), _bytes(r["bytes"])]
                for task, fields in ordered.items() for r in fields]  # fmt: skip
        if rows:
            print(_table(header, rows))
    if missing:
        _not_held(node, missing)
    return 1 if missing else 0


def describe_bundle(bundle: Any) -> dict[str, list[dict[str, Any]]]:
    """Per task of a fetched bundle, per field (in name order): dtype (`json` for a JSON value),
    shape (a list; None for JSON) and bytes as stored."""
    from distbatch import wire

    out: dict[str, list[dict[str, Any]]] = {task: [] for task in bundle.task_ids}
    for key, column in bundle.columns.items():
        field = wire.column_field(key)
        rows = range(len(bundle.task_ids)) if column.rows is None else column.rows.tolist()
        if column.dtype is None:
            sizes = [len(json.dumps(v, separators=(",", ":"))) for v in column.values or []]
            for i, size in zip(rows, sizes):
                out[bundle.task_ids[i]].append(_field_row(field, "json", None, size))
            continue
        shapes, nbytes = column.tensor_shapes, column.row_nbytes().tolist()
        for n, (i, size) in enumerate(zip(rows, nbytes)):
            shape = list(shapes.row(n))
            out[bundle.task_ids[i]].append(_field_row(field, column.dtype, shape, size))
    for fields in out.values():
        fields.sort(key=lambda r: r["field"])
    return out


def _shape(shape: list[int] | None) -> str:
    """`2x3` for a tensor's shape, `()` for a 0-d one, `-` for a JSON value."""
    return "-" if shape is None else "x".join(map(str, shape)) or "()"


def _field_row(field: str, dtype: str, shape: list[int] | None, nbytes: int) -> dict[str, Any]:
    return {"field": field, "dtype": dtype, "shape": shape, "bytes": nbytes}


def clear(client: ShardClient, node: str, tasks: Sequence[str] | None, everything: bool) -> int:
    """Delete the named tasks (saying which the worker does not hold), or every task the worker
    holds (a page at a time)."""
    deleted = freed = 0
    missing: list[str] = []
    if tasks:
        _, missing = client.task_fields(node, tasks)
        result = client.delete(node, task_ids=list(dict.fromkeys(tasks)))
        deleted, freed = result.deleted, result.bytes_freed
    elif everything:
        while True:
            page = client.list_tasks(node, None, PAGE)
            if not page["tasks"]:
                break
            result = client.delete(node, task_ids=[task_id for task_id, _ in page["tasks"]])
            deleted, freed = deleted + result.deleted, freed + result.bytes_freed
    print(f"deleted {deleted:,} shard(s), {_bytes(freed)} on {node}")
    if missing:
        _not_held(node, missing)
    return 1 if missing else 0


def worker(flags: Sequence[str]) -> int:
    """Become a worker: `python -m rpc_server` with these flags (its address on stdout)."""
    os.environ[PROG_ENV] = "distbatch worker"  # what its --help and usage errors call it
    os.execv(sys.executable, [sys.executable, "-m", "rpc_server", *flags])
    raise AssertionError("unreachable")


def _node(text: str) -> str:
    try:
        return validate_node(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _node_after_tasks(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`clear --tasks t0 t1 HOST:PORT`: --tasks took the address too; it is the worker's."""
    last = (args.tasks or [None])[-1]
    try:
        args.node = validate_node(last)
    except ValueError:
        parser.error("clear needs the worker's HOST:PORT, e.g. distbatch clear HOST:PORT --tasks t0 t1")
    args.tasks = args.tasks[:-1]
    if not args.tasks:
        parser.error("clear --tasks needs at least one task id")


def _timeout_flag(parser: argparse.ArgumentParser, default: object = DEFAULT_TIMEOUT) -> None:
    """`--timeout S`, before the sub-command or after it (a sub-command's own wins; given
    nowhere, the main parser's default stands: the sub-command's leaves it alone)."""
    parser.add_argument(
        "--timeout",
        type=float,
        default=default,
        metavar="S",
        help=f"seconds per worker (default: {DEFAULT_TIMEOUT:g})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="distbatch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _timeout_flag(parser)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser(
        "status",
        help="per worker: shards, tasks, bytes, capacity, uptime, engine, disk (--data-dir: on disk, how"
        " far behind, failed); per controller: its partitions",
    )
    p.add_argument("nodes", nargs="+", type=_node, metavar="HOST:PORT")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _timeout_flag(p, argparse.SUPPRESS)
    p = commands.add_parser("ls", help="the task ids a worker holds and their fields, in id order")
    _timeout_flag(p, argparse.SUPPRESS)
    p.add_argument("node", type=_node, metavar="HOST:PORT")
    p.add_argument("--after", help="start after this task id (the last one of the previous page)")
    p.add_argument("--limit", type=int, default=PAGE, help=f"tasks per page (default: {PAGE})")
    p.add_argument("--all", action="store_true", help="every page, not just the first")
    p.add_argument("--json", action="store_true")
    p = commands.add_parser("show", help="each field of some tasks: dtype, shape, bytes")
    _timeout_flag(p, argparse.SUPPRESS)
    p.add_argument("node", type=_node, metavar="HOST:PORT")
    p.add_argument("tasks", nargs="+", metavar="ID")
    p.add_argument("--json", action="store_true")
    p = commands.add_parser("clear", help="delete tasks from a worker")
    p.add_argument("node", nargs="?", type=_node, metavar="HOST:PORT")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--tasks", nargs="+", metavar="ID", help="these tasks (every field of each)")
    which.add_argument("--all", action="store_true", help="every task the worker holds (needs --yes)")
    p.add_argument("--yes", action="store_true", help="confirm --all")
    _timeout_flag(p, argparse.SUPPRESS)
    commands.add_parser(
        "worker", help="run a worker (python -m rpc_server; its flags follow)", add_help=False
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["worker"]:
        return worker(args_list[1:])  # every flag is the worker's, --help included
    parser = build_parser()
    args = parser.parse_args(args_list)
    if args.command == "clear" and args.node is None:
        _node_after_tasks(parser, args)
    if args.command == "clear" and args.all and not args.yes:
        parser.error("clear --all deletes every task on the worker: add --yes to confirm")
    if args.command == "ls" and not 1 <= args.limit <= MAX_LIST_LIMIT:
        parser.error(f"--limit must be 1 to {MAX_LIST_LIMIT}")
    with ShardClient(timeout=args.timeout, retries=1) as client:
        try:
            if args.command == "status":
                return status(client, args.nodes, args.json)
            if args.command == "ls":
                return ls(client, args.node, args.after, args.limit, args.all, args.json)
            if args.command == "show":
                return show(client, args.node, args.tasks, args.json)
            return clear(client, args.node, args.tasks, args.all)
        except DistBatchError as exc:
            print(f"distbatch {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1


if __name__ == "__main__":
    raise SystemExit(main())
