"""What `tq.init` runs once, in the process that creates TransferQueue's controller: check
`backend.Distbatch`, then start distbatch workers (Ray actors, one per node unless told how
many) or check the given ones, and write their addresses into the config every other process
receives.

The workers this process started are kept in `STARTED`. TransferQueue's own `tq.close()` stops
only the storage it knows (and logs that it cannot close any other): `hook_interface` wraps it,
once TransferQueue is imported, so that it stops them too, quietly; `distbatch.transferqueue.close()`
does the same and says how many it stopped (interpreter exit, through the group's finaliser,
stops any left). That registry is process state because TransferQueue keeps its own the same
way (a module global per process); it holds nothing else.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
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
# TransferQueue's controller actor, as `tq.init` names it.
CONTROLLER_NAME, CONTROLLER_NAMESPACE = "TransferQueueController", "transfer_queue"
CONTROLLER_GONE_TIMEOUT = 30.0
logger = logging.getLogger("distbatch.transferqueue")


def hook_interface(interface: Any) -> None:
    """Make TransferQueue's module functions treat Distbatch as they treat its own in-memory
    storage (idempotent; `transfer_queue.close` and `.save_checkpoint` are re-exports, replaced
    too):

    - `close` stops the workers `tq.init` started here for Distbatch, instead of logging that it
      cannot close them;
    - `save_checkpoint(include_storage=False)` saves the storage anyway, with TransferQueue's own
      warning, as it does for SimpleStorage: the workers hold the data in memory, and a
      checkpoint without it would restore samples that have none;
    - a kv put, or a `put` without metadata, that our storage failed releases the keys and
      samples it registered for the put (`rollback`).
    """
    from transfer_queue.client import AsyncTransferQueueClient as Client

    from distbatch.transferqueue import rollback

    _wrap(interface, "close", _closing_ours_too)
    _wrap(interface, "save_checkpoint", _keeping_our_storage)
    _wrap(interface, "async_kv_put", rollback.releasing_keys)
    _wrap(interface, "async_kv_batch_put", rollback.releasing_keys)
    if not getattr(Client.async_put, "_distbatch_hooked", False):  # the sync client's too
        async_put = rollback.releasing_samples(Client.async_put)
        async_put._distbatch_hooked = True  # type: ignore[attr-defined]
        Client.async_put = async_put
    discard_a_session_begun_without_us(interface)


def discard_a_session_begun_without_us(interface: Any) -> bool:
    """A `tq.init` for Distbatch that ran here before the backend was registered failed with
    TransferQueue's `Unknown manager_type: Distbatch`, yet left its controller and config behind:
    the next `tq.init` would attach to them and return, and the first put say `Storage manager
    not initialized`. Such a session (this process made it: it holds TransferQueue's storage
    table, without our entry) is shut down here, with a warning, so that the next `tq.init`
    starts afresh. True if one was."""
    controller = getattr(interface, "_TQ_CONTROLLER", None)
    storage = getattr(interface, "_TQ_STORAGE", None)
    if controller is None or not isinstance(storage, dict) or BACKEND_NAME in storage:
        return False
    import ray

    try:
        conf = ray.get(controller.get_config.remote(), timeout=30)
        backend = OmegaConf.select(conf, "backend.storage_backend") if conf is not None else None
    except Exception:  # an actor already gone: nothing to keep
        backend = BACKEND_NAME
    if backend != BACKEND_NAME:
        return False
    logger.warning(
        "a TransferQueue session for %s began in this process before distbatch.transferqueue was "
        "imported, so it has no storage; it is shut down: call tq.init again (and import "
        "distbatch.transferqueue before the first tq.init)",
        BACKEND_NAME,
    )
    client = getattr(interface, "_TQ_CLIENT", None)
    if client is not None and hasattr(client, "close"):
        client.close()
    ray.kill(controller)
    interface._TQ_CONTROLLER = interface._TQ_STORAGE = interface._TQ_CLIENT = None
    deadline = time.monotonic() + CONTROLLER_GONE_TIMEOUT
    while time.monotonic() < deadline:  # until its name is free: the next tq.init must not find it
        try:
            ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
        except ValueError:
            break
        time.sleep(0.05)
    return True


def _wrap(interface: Any, name: str, make: Callable[[Any, Callable[..., Any]], Callable[..., Any]]) -> None:
    import transfer_queue

    original = getattr(interface, name)
    if getattr(original, "_distbatch_hooked", False):
        return
    wrapped = functools.wraps(original)(make(interface, original))
    wrapped._distbatch_hooked = True  # type: ignore[attr-defined]
    setattr(interface, name, wrapped)
    if getattr(transfer_queue, name, None) is original:
        setattr(transfer_queue, name, wrapped)


def _closing_ours_too(interface: Any, original: Callable[..., Any]) -> Callable[..., Any]:
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

    return close


def _keeping_our_storage(interface: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    def save_checkpoint(checkpoint_dir: Any, *, include_storage: bool = True, **kwargs: Any) -> None:
        from distbatch.transferqueue.manager import DistbatchStorageManager

        manager = getattr(getattr(interface, "_TQ_CLIENT", None), "storage_manager", None)
        if not include_storage and isinstance(manager, DistbatchStorageManager):
            logger.warning(
                "include_storage=False has no effect for Distbatch: its workers hold the data in "
                "memory, which a restart would lose. Forcing include_storage=True."
            )
            include_storage = True
        original(checkpoint_dir, include_storage=include_storage, **kwargs)

    return save_checkpoint


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
    args = options.worker_args()
    env = None if options.token is None else {"DISTBATCH_TOKEN": options.token}
    return WorkerGroup.ray(count, args=args, env=env, placement="spread")
