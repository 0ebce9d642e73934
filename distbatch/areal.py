"""distbatch as AReaL's RTensor backend: `distbatch.areal.install()` in every AReaL process.

AReaL (1.0.4) moves each tensor between its controller and engines as an `RTensor`: an engine
`store`s its results' tensors and hands on shard ids; whoever needs the data `fetch`es them;
the controller `delete`s them at the end of a step. Its backend is chosen per process with
`areal.infra.rpc.rtensor.set_backend`. `install()` sets `DistbatchRTensorBackend` there:

- `store(tensor)` puts the tensor on a distbatch worker (one named by `worker=`, or one this
  process starts for itself on first use, on `host`): binary, any dtype as it is (bfloat16
  stays bfloat16), through shared memory when the worker is on this host;
- `fetch(shards)` gathers them straight from the workers that hold them, every worker at once,
  many shards per request, within the client's connection and request-size bounds;
- `delete(node_addr, shard_ids)` deletes them on their workers.

A shard id is `distbatch://<worker host:port>/<task id>`, so any process can fetch it without
knowing which AReaL node made it. AReaL's engine workers are separate processes: each needs
`install()` before its first RTensor (in the module that names your engine or workflow, or for
Ray workers `runtime_env={"worker_process_setup_hook": "distbatch.areal.install"}`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from distbatch import wire
from distbatch.client.fetches import gather_lost
from distbatch.client.shard_client import ShardClient
from distbatch.errors import InvalidArgumentError, InvalidIdError, StateError, WorkerUnavailableError
from distbatch.ids import KEY_SEPARATOR, ShardKey, validate_id, validate_node
from distbatch.launch.flags import byte_size

if TYPE_CHECKING:
    import torch

    from distbatch.launch.local import WorkerProcess

SHARD_PREFIX = "distbatch://"
FIELD = "tensor"  # the one field of each stored tensor's task
SUPPORTED_VERSIONS = ("1.0.4",)


def shard_id(node: str, task_id: str) -> str:
    """The RTensor shard id of the tensor stored as task `task_id` on worker `node`."""
    return f"{SHARD_PREFIX}{node}{KEY_SEPARATOR}{task_id}"


def _where(values: Iterable[Any]) -> list[tuple[str, str]]:
    """`(worker, task id)` of many shard ids: each distinct worker checked once; the task ids are
    checked by the fetch, all at once (`parse_shard_id` checks one id whole)."""
    nodes: dict[str, str] = {}
    out = []
    for value in values:
        if not (isinstance(value, str) and value.startswith(SHARD_PREFIX)):
            parse_shard_id(value)  # raises, saying what is wrong
        node, _, task_id = value[len(SHARD_PREFIX) :].rpartition(KEY_SEPARATOR)
        if node not in nodes:
            nodes[node] = parse_shard_id(value)[0]
        out.append((nodes[node], task_id))
    return out


def parse_shard_id(value: Any) -> tuple[str, str]:
    """`(worker, task id)` of one of our shard ids; `InvalidArgumentError` for anything else
    (an id AReaL's own HTTP or Ray backend made, say: each process must use the same backend)."""
    if isinstance(value, str) and value.startswith(SHARD_PREFIX):
        node, _, task_id = value[len(SHARD_PREFIX) :].rpartition(KEY_SEPARATOR)
        try:
            return validate_node(node), validate_id(task_id, "task id")
        except (InvalidArgumentError, InvalidIdError):
            pass
    raise InvalidArgumentError(
        f"RTensor shard id {value!r} was not made by distbatch (expected "
        f"'{SHARD_PREFIX}host:port/task-id'): every AReaL process must install the same backend "
        "(distbatch.areal.install()) before it stores or fetches an RTensor"
    )


class _Pending:
    """One thread's stores not yet sent (inside `DistbatchRTensorBackend.batched`)."""

    def __init__(self) -> None:
        self.depth = 0
        self.shards: dict[tuple[str, str], Any] = {}


class DistbatchRTensorBackend:
    """AReaL's `RTensorBackend` protocol over distbatch workers.

    Args:
        worker: the worker that keeps this process's tensors (`host:port`). None: this process
            starts its own on first `store` (it exits with this process; `close()` stops it).
        host: where a worker this process starts listens. Loopback by default; on several
            hosts give an address the others reach (AReaL's `gethostip()`), and a token.
        capacity: bytes that worker may hold (`"32G"`, `"512M"` or a number); a put past it is
            refused (507) naming `--max-bytes`.
        client: the `ShardClient` to use; None makes one from `token`, `timeout`, `same_host`.
        token: the workers' bearer token (default `DISTBATCH_TOKEN`).
        timeout: seconds one request may take, retries included.
        same_host: reach workers on this host through shared memory (False: HTTP only).
    """

    def __init__(
        self,
        worker: str | None = None,
        *,
        host: str = "127.0.0.1",
        capacity: int | str | None = None,
        client: ShardClient | None = None,
        token: str | None = None,
        timeout: float = 60.0,
        same_host: bool = True,
    ) -> None:
        self._worker = validate_node(worker) if worker is not None else None
        self._host = host
        self._capacity = None if capacity is None else byte_size(str(capacity))
        self._token = token
        self._own_client = client is None
        self.client = client or ShardClient(token=token, timeout=timeout, same_host=same_host)
        self._started: WorkerProcess | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._pending = threading.local()
        # Task ids: random per backend (so no two processes collide), then counted (uuid4 for
        # each tensor was a quarter of a remotize: one os.urandom call each).
        self._id_prefix = uuid.uuid4().hex
        self._stored = itertools.count()

    @property
    def worker(self) -> str:
        """The worker this process stores on (started here on first use if none was given)."""
        known = self._worker
        if known is not None:  # every store asks: no lock once it is known
            return known
        with self._lock:
            if self._closed:
                raise StateError("this DistbatchRTensorBackend is closed: install a new one")
            if self._worker is None:
                self._started = self._start_worker()
                self._worker = self._started.node
            return self._worker

    def _start_worker(self) -> WorkerProcess:
        from distbatch.launch.local import spawn_worker

        args = [] if self._capacity is None else ["--max-bytes", str(self._capacity)]
        env = {} if self._token is None else {"DISTBATCH_TOKEN": self._token}
        return spawn_worker(host=self._host, args=args, env=env)

    def _pending_here(self) -> _Pending:
        pending = getattr(self._pending, "value", None)
        if pending is None:
            pending = self._pending.value = _Pending()
        return pending

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """Stores in this thread inside the block reach the worker as one put, when the outermost
        block ends (and none if it raises). `install()` wraps AReaL's `RTensor.remotize` in it: a
        result of thousands of tensors is one request instead of one each (0.9 ms a tensor)."""
        pending = self._pending_here()
        pending.depth += 1
        finished = False
        try:
            yield
            finished = True
        finally:
            pending.depth -= 1
            if pending.depth == 0:
                shards, pending.shards = pending.shards, {}
                if finished and shards:
                    self.client.put(self.worker, shards)

    def store(self, tensor: torch.Tensor) -> str:
        """Put `tensor` on this process's worker (inside `batched`, when the block ends); its
        shard id."""
        node, task_id = self.worker, f"{self._id_prefix}.{next(self._stored)}"
        pending = self._pending_here()
        if pending.depth:
            pending.shards[(task_id, FIELD)] = tensor
        else:
            self.client.put(node, {(task_id, FIELD): tensor})
        return shard_id(node, task_id)

    def fetch(self, shards: Sequence[Any]) -> list[torch.Tensor]:
        """The tensors of `shards` (AReaL's `TensorShardInfo`s), in their order, every worker at
        once, each worker's as one product (its tasks x our one field: the columnar path, no
        per-shard request planning). A shard deleted or never stored raises
        `ShardNotFoundError` naming each; a worker that cannot be reached, which tasks it lost."""
        wanted = _where(shard.shard_id for shard in shards)
        tasks: dict[str, dict[str, None]] = {}
        for node, task_id in wanted:
            tasks.setdefault(node, {})[task_id] = None  # a shard asked twice is fetched once
        nodes = list(tasks)
        try:
            bundles = self.client.fetch_products([(node, list(tasks[node]), [FIELD]) for node in nodes])
        except WorkerUnavailableError as exc:
            if exc.node not in tasks:
                raise
            raise gather_lost(exc, len(wanted), list(tasks[exc.node]), [FIELD]) from exc
        found = {node: wire.bundle_to_shards(bundle) for node, bundle in zip(nodes, bundles)}
        return [found[node][ShardKey(task_id, FIELD)] for node, task_id in wanted]

    async def delete(self, node_addr: str, shard_ids: Iterable[Any]) -> None:
        """Delete `shard_ids` from the workers that hold them (`node_addr`, AReaL's address of the
        node that stored them, is not needed: each id names its worker). Ids already gone count
        nothing; an unreachable worker raises."""
        tasks: dict[str, list[str]] = defaultdict(list)
        for node, task_id in _where(shard_ids):
            tasks[node].append(task_id)
        if tasks:
            await asyncio.gather(
                *(self.client.adelete(node, task_ids=task_ids) for node, task_ids in tasks.items())
            )

    def close(self) -> None:
        """Stop the worker this backend started (its tensors go with it) and its own client; a
        store afterwards raises `StateError`."""
        with self._lock:
            started, self._started = self._started, None
            self._worker, self._closed = None, True
        if started is not None:
            started.stop()
        if self._own_client:
            self.client.close()


def _check_version() -> None:
    import importlib.metadata

    try:
        version = importlib.metadata.version("areal")
    except importlib.metadata.PackageNotFoundError:
        return  # a source checkout without metadata: the protocol is checked by use
    if version not in SUPPORTED_VERSIONS:
        raise ImportError(
            f"distbatch.areal supports AReaL {', '.join(SUPPORTED_VERSIONS)}, this is {version}: "
            "its RTensor backend API may change between releases; install a supported one"
        )


def install(worker: str | None = None, **options: Any) -> DistbatchRTensorBackend:
    """Make distbatch this process's RTensor backend (AReaL's `set_backend`) and return it.

    `worker` and `options` are `DistbatchRTensorBackend`'s. Call it once in each AReaL process,
    before its first RTensor; with no arguments it also serves as Ray's
    `worker_process_setup_hook`."""
    _check_version()
    from areal.infra.rpc import rtensor

    backend = DistbatchRTensorBackend(worker, **options)
    _batch_remotize(rtensor)
    rtensor.set_backend(backend)
    return backend


def _batch_remotize(rtensor: ModuleType) -> None:
    """Wrap AReaL's `RTensor.remotize` (once per process) so that, while our backend is the one
    set, one call's tensors are stored as one put (`DistbatchRTensorBackend.batched`)."""
    cls = rtensor.RTensor
    if getattr(cls.remotize, "__wrapped_by_distbatch__", False):
        return
    original: Callable[..., Any] = cls.remotize

    @functools.wraps(original)
    def remotize(obj: Any, node_addr: str) -> Any:
        backend = rtensor.get_backend()
        if not isinstance(backend, DistbatchRTensorBackend):
            return original(obj, node_addr=node_addr)
        with backend.batched():
            return original(obj, node_addr=node_addr)

    remotize.__wrapped_by_distbatch__ = True  # type: ignore[attr-defined]
    cls.remotize = staticmethod(remotize)
