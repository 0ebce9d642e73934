"""What `tq.init` runs once, in the process that creates TransferQueue's controller: check
`backend.Distbatch`, then start distbatch workers (Ray actors, one per node unless told how
many) or check the given ones, and write their addresses into the config every other process
receives.

The workers this process started are kept in `STARTED`. TransferQueue's own `tq.close()` stops
only the storage it knows (and logs that it cannot close any other): `close_too` wraps it, once
TransferQueue is imported, so that it stops them too, quietly; `distbatch.transferqueue.close()`
does the same and says how many it stopped (interpreter exit, through the group's finaliser,
stops any left). That registry is process state because TransferQueue keeps its own the same
way (a module global per process); it holds nothing else.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from omegaconf import DictConfig, OmegaConf
from transfer_queue.storage.bootstrap.provider import StorageBootstrapProvider

from distbatch.launch.group import WorkerGroup
from distbatch.transferqueue.options import BACKEND_NAME, BackendOptions, plain_config


class StartedWorkers:
    """The worker groups this process started for TransferQueue, stopped together by `stop_all`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: list[WorkerGroup] = []

    def add(self, group: WorkerGroup) -> None:
        with self._lock:
            self._groups.append(group)

    def stop_all(self) -> int:
        """Stop every group; returns how many workers were stopped."""
        with self._lock:
            groups, self._groups = self._groups, []
        for group in groups:
            group.shutdown()
        return sum(len(g.nodes) for g in groups)


STARTED = StartedWorkers()


def close_too(interface: Any) -> None:
    """Make TransferQueue's `close` (`transfer_queue.interface.close`, re-exported as
    `transfer_queue.close`) stop the workers `tq.init` started here for Distbatch, instead of
    logging that it cannot close them. Idempotent."""
    import transfer_queue

    original = interface.close
    if getattr(original, "_distbatch_closes_too", False):
        return

    @functools.wraps(original)
    def close() -> None:
        storage = getattr(interface, "_TQ_STORAGE", None)
        if isinstance(storage, dict):
            storage.pop(BACKEND_NAME, None)  # ours: stopped below, not TransferQueue's to close
        try:
            original()
        finally:
            from distbatch.transferqueue import fast_schema

            fast_schema.uninstall()
            STARTED.stop_all()

    close._distbatch_closes_too = True  # type: ignore[attr-defined]
    interface.close = close
    if getattr(transfer_queue, "close", None) is original:
        transfer_queue.close = close


@StorageBootstrapProvider.register_provider(BACKEND_NAME)
def bootstrap(conf: DictConfig) -> dict[str, Any]:
    """TransferQueue's storage bootstrap for "Distbatch" (see the module's docstring)."""
    options = BackendOptions.from_config(plain_config(conf.backend.get(BACKEND_NAME)))
    if options.endpoints:
        group = WorkerGroup.connect(list(options.endpoints))  # checks that each one answers
        started = False
    else:
        group = _start_workers(options)
        STARTED.add(group)
        started = True
    decided = BackendOptions(**{**options.as_config(), "endpoints": tuple(group.nodes)})
    conf.backend[BACKEND_NAME] = OmegaConf.create(decided.as_config())
    return {"endpoints": list(group.nodes), "started": started}


def _start_workers(options: BackendOptions) -> WorkerGroup:
    import ray

    count = options.workers or max(1, sum(1 for node in ray.nodes() if node.get("Alive")))
    args = [] if options.capacity is None else ["--max-bytes", str(options.capacity)]
    env = None if options.token is None else {"DISTBATCH_TOKEN": options.token}
    return WorkerGroup.ray(count, args=args, env=env, placement="spread")
