"""`python -m simcluster check | up N [--rate R] | run HOST -- cmd ... | down` (`--prefix P` on each).

`up` leaves the hosts up until `down`; `run` execs the command in the host's namespace (same pid,
the host's `DISTBATCH_HOST_ID` in its environment); `down` removes by name whatever a cluster with
the prefix left, and is safe to repeat. Exits 1 with the reason when it cannot.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

from simcluster.hosts import (
    DEFAULT_PREFIX,
    DEFAULT_RATE,
    Cluster,
    ClusterError,
    check,
    check_prefix,
    down,
    namespaces,
)


def _host_index(prefix: str, host: str) -> int:
    """A host given as its index ("1") or its namespace name ("dbch1")."""
    match = re.fullmatch(rf"(?:{re.escape(prefix)}h)?(\d+)", host)
    if match is None:
        raise ValueError(f"invalid host {host!r}: an index or a name like {prefix}h0")
    return int(match.group(1))


def parser() -> argparse.ArgumentParser:
    """The command line's parser (the command `run` runs, after "--", is not its business)."""
    out = argparse.ArgumentParser(
        prog="python -m simcluster",
        description="Simulate a cluster on this machine: hosts are network namespaces on one bridge, "
        "each with a NIC of a given rate (tbf). Needs root.",
    )
    commands = out.add_subparsers(dest="command", required=True)
    up_parser = commands.add_parser("up", help="set up N hosts (left up until `down`)")
    up_parser.add_argument("hosts", type=int, help="how many hosts")
    up_parser.add_argument(
        "--rate", default=DEFAULT_RATE, help=f"each NIC's rate, each way (default: {DEFAULT_RATE})"
    )
    run_parser = commands.add_parser("run", help="run a command in a host: run HOST [--prefix P] -- cmd ...")
    run_parser.add_argument("host", help="the host's index or namespace name")
    commands.add_parser("down", help="remove every namespace and link with the prefix (idempotent)")
    commands.add_parser("check", help="say whether this machine can simulate a cluster")
    for sub in commands.choices.values():
        sub.add_argument(
            "--prefix", default=DEFAULT_PREFIX, help=f"resource name prefix (default: {DEFAULT_PREFIX})"
        )
    return out


def _check() -> int:
    reason = check()
    print("ok: this machine can simulate a cluster" if reason is None else f"cannot: {reason}")
    return 0 if reason is None else 1


def _down(prefix: str) -> int:
    removed = down(prefix)
    print(f"removed {len(removed)}: {', '.join(removed)}" if removed else "nothing to remove")
    return 0


def _up(hosts: int, rate: str, prefix: str) -> int:
    cluster = Cluster.up(hosts, rate, prefix)
    for host in range(cluster.hosts):
        print(f"{cluster.namespace(host)} {cluster.address(host)} DISTBATCH_HOST_ID={cluster.host_id(host)}")
    print(f"rate {rate} each way per host; `down --prefix {prefix}` removes it")
    return 0


def _run(host: str, prefix: str, command: list[str]) -> int:
    """Exec `command` in the host: does not return."""
    index = _host_index(prefix, host)
    namespace = f"{prefix}h{index}"
    if namespace not in namespaces():
        raise ClusterError(f"no host {namespace}: bring the cluster up first")
    cluster = Cluster.attach(index + 1, prefix=prefix)
    os.execvpe("ip", cluster.command(index, command), cluster.environment(index))
    return 127  # not reached: exec replaced this process


def main(argv: Sequence[str] | None = None) -> int:
    args_parser = parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first "--" is the command `run` runs, options included.
    split = argv.index("--") if "--" in argv else len(argv)
    args = args_parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    if args.command == "run" and not command:
        args_parser.error("run: no command given (run HOST -- cmd ...)")
    try:
        check_prefix(args.prefix)
        if args.command == "check":
            return _check()
        if args.command == "down":
            return _down(args.prefix)
        if args.command == "up":
            return _up(args.hosts, args.rate, args.prefix)
        return _run(args.host, args.prefix, command)
    except (ClusterError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
