"""The jobs run on simulated hosts (`simcluster`: network namespaces on a bridge, tbf-shaped NICs;
root only). Each module is a `python -m` entry point, run from the repo root:

- `job` (`python -m bench.cluster.job`, `scripts/bench cluster`): the traffic job across the hosts,
  distributed vs centralised, against the link bound and plain TCP;
- `tcp` (`python -m bench.cluster.tcp --bind ADDR`, started by `job` in each host): plain TCP
  moving the same bytes between the same hosts;
- `ray_peer` (`python -m bench.cluster.ray_peer`): Ray's object store moving the same chunks;
- `tq_peer` (`python -m bench.cluster.tq_peer`): TransferQueue's SimpleStorage moving them.

A bench runs as the driver (as root, outside the cluster: it brings the hosts up, starts what
runs in them and takes them down) and, in host 0, as the controller (`run_role`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def run_role(
    args: argparse.Namespace,
    controller: Callable[[argparse.Namespace], int],
    driver: Callable[[argparse.Namespace], object],
) -> int:
    """A cluster bench's command line: the driver (as root, outside the cluster), or with role
    `controller` the part the driver starts in host 0; the exit status."""
    if args.role == "controller":
        return controller(args)
    driver(args)
    return 0
