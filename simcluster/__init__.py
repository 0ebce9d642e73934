"""A simulated cluster on one Linux machine: each host a network namespace, joined by a bridge,
each host's NIC a `tbf` qdisc of a chosen rate both ways, so cross-host traffic is real traffic
at a real rate, and a process in one host never shares memory or a Unix socket with another.

Plain process and network plumbing (`ip`, `tc`, /proc), standard library only: it imports
neither the library (`distbatch`) nor the benchmarks (`bench`), which run their jobs on it; the
tests' simulated-host modules use it too. Lives at the repo root, outside the installed package.
Needs root, `ip` (iproute2) and `tc`; `check()` says whether this machine allows it and why not.

- `simcluster.hosts`: the hosts and their network. `Cluster` (`Cluster.up(n, rate, prefix)` as a
  context manager, a host's address, namespace and link counters, running commands in a host),
  `check`, `leftovers` and `down` (by name: idempotent, cleans up after a crash);
- `simcluster.processes`: the processes in them. `stop_process`, `stop_namespaces` (every
  process in some namespaces, by pid, never by name), `namespace_pids`, `established_tcp`;
- `simcluster.__main__`: the command line.

    python -m simcluster check
    python -m simcluster up 2 --rate 200mbit [--prefix dbc]
    python -m simcluster run 1 -- python -m rpc_server --host 10.77.0.2
    python -m simcluster down [--prefix dbc]

(`scripts/cluster` runs it with the repo's interpreter.)
"""

from simcluster.hosts import (
    DEFAULT_PREFIX,
    DEFAULT_RATE,
    SUBNET,
    Cluster,
    ClusterError,
    check,
    down,
    leftovers,
    rate_bits,
)
from simcluster.processes import established_tcp, namespace_pids, stop_namespaces, stop_process

__all__ = [
    "DEFAULT_PREFIX",
    "DEFAULT_RATE",
    "SUBNET",
    "Cluster",
    "ClusterError",
    "check",
    "down",
    "established_tcp",
    "leftovers",
    "namespace_pids",
    "rate_bits",
    "stop_namespaces",
    "stop_process",
]
