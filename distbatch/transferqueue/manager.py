"""The storage manager TransferQueue builds in every process that puts or gets: our data path.

A put of a TensorDict is one bundle to this process's home worker (on its host when there is
one, so the same-host path applies): every field a column, never a request per sample. Where
each sample's field went travels as TransferQueue's per-sample backend metadata, which its
controller hands back with every *BatchMeta*: the worker's slot, its place in
`backend.Distbatch.endpoints` (so a checkpoint restored onto new workers, at new addresses,
still finds its data); a get is then one product fetch per worker, straight from the workers
that hold the data, and a clear deletes by TransferQueue's global indexes on those workers.

Put generations are not used here: TransferQueue's controller decides which global index holds
which sample, and reuses an index only after clearing it, as it does with its own storage.

A worker that dies (or cannot be reached) mid-put or mid-get fails the call with a
`WorkerUnavailableError` naming it and saying what that means for the call (the client's own
error is its `__cause__`). A put is one bundle to one worker, committed there at once, and
TransferQueue's controller hears of its fields only after that: a put whose worker dies leaves
no field of it anywhere, and the samples read as before it; keys and samples TransferQueue
registered for the put alone are released again (`rollback`), unless the dead worker is the one
that could say whether they held anything.

With `data_dir` (durable workers), a worker that cannot be reached may have been started again on
its directory, at a new address: before failing a call, the manager reads where that worker's
directory says it serves now (``<data_dir>/node``: this host, or a filesystem the hosts share),
and if that is a new address, makes it the slot's endpoint in this process and sends the call
there once more. Samples name workers by slot, so every sample it held is found there.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig
from tensordict import TensorDict
from transfer_queue.metadata import BatchMeta as TQBatchMeta
from transfer_queue.storage.managers.base import StorageManager, StorageManagerFactory

from distbatch import wire
from distbatch.batch.gather import fetch, plan_fetch
from distbatch.batch.memory import DistributedBatchMemory
from distbatch.batch.meta import BatchMeta, FieldMeta
from distbatch.client.results import DeleteResult
from distbatch.client.shard_client import ShardClient
from distbatch.errors import (
    ClearError,
    InvalidArgumentError,
    NodeError,
    NotFoundError,
    WorkerUnavailableError,
)
from distbatch.gc_pause import freeze_long_lived
from distbatch.launch.flags import served_at, worker_data_dir
from distbatch.transferqueue import fast_schema
from distbatch.transferqueue.checkpoint import CHECKPOINT_DIR, load_shards, save_shards
from distbatch.transferqueue.layout import (
    columns_of,
    field_schema,
    location,
    location_slot,
    task_ids,
    tensordict_of,
    value_types,
)
from distbatch.transferqueue.options import BACKEND_NAME, FAILED_PUT, BackendOptions, plain_config
from distbatch.twins import AWAITED
from distbatch.wire.shapes import RowShapes

logger = logging.getLogger("distbatch.transferqueue")

# A gather never shows a progress bar here: TransferQueue's callers are programs, not people.
NO_PROGRESS_BAR = 1 << 62


def local_addresses() -> set[str]:
    """The addresses this host answers on (loopback and its hostname's), to find a home worker."""
    names = {"127.0.0.1", "localhost", "::1"}
    try:
        names.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    return names


def home_worker(endpoints: Sequence[str], here: set[str], pid: int) -> str:
    """The worker this process puts to: one on its host (spread over them by process id), else
    any (by process id), so puts from many processes spread over the workers."""
    local = [e for e in endpoints if e.rsplit(":", 1)[0].strip("[]") in here]
    pool = local or list(endpoints)
    return pool[pid % len(pool)]


@StorageManagerFactory.register(BACKEND_NAME)
class DistbatchStorageManager(StorageManager):
    """TransferQueue's *StorageManager* over distbatch workers (see the module's docstring)."""

    def __init__(self, controller_info: Any, config: DictConfig, zmq_context: Any = None) -> None:
        options = BackendOptions.from_config(plain_config(config))
        if not options.endpoints:
            raise InvalidArgumentError(
                "backend.Distbatch has no endpoints: tq.init starts the workers and writes them there; "
                "import distbatch.transferqueue before tq.init (it registers the bootstrap)"
            )
        super().__init__(controller_info, config, zmq_context)
        self.options = options
        self.client = ShardClient(token=options.token, timeout=options.timeout, same_host=options.same_host)
        self.here = local_addresses()  # once: a lookup on the event loop during a fault could hang
        self.home = home_worker(options.endpoints, self.here, os.getpid())
        self.slot = options.endpoints.index(self.home)
        self._followed: dict[str, int] = {}  # addresses of restarted workers -> their slots
        if options.fast_schema:
            fast_schema.install()
        if options.freeze_gc:
            freeze_long_lived()

    # ------------------------------------------------------------------ put

    async def put_data(
        self, data: TensorDict, metadata: TQBatchMeta, data_parser: Callable[[Any], Any] | None = None
    ) -> None:
        """Store `data` (one row per sample of `metadata`) on the home worker as one bundle, then
        tell TransferQueue's controller the fields, shapes and where they went.

        A put that is refused or fails records none of its fields, and still tells the controller
        about its samples (with no field): TransferQueue's controller sizes a partition's tables
        only when told, so samples allocated for the put (`get_meta(mode="insert")`) would
        otherwise make the partition impossible to clear."""
        if data_parser is not None:
            raise NotImplementedError("backend Distbatch does not take a data_parser")
        size = len(metadata.global_indexes)
        if size == 0 or not len(data.keys()):
            return
        try:
            where, moved = await self._store(data, metadata)
        except Exception as error:
            await self._announce_without_fields(metadata)
            setattr(error, FAILED_PUT, metadata)  # what `rollback` releases, where the put allocated it
            raise
        await self.notify_data_update(
            metadata.partition_ids[0], list(metadata.global_indexes), field_schema(data), where
        )
        # The caller's metadata learns the locations too (TransferQueue hands it back from `put`):
        # `get_data(client.put(...))` then reads what was put, as with SimpleStorage.
        backend_meta = getattr(metadata, "_custom_backend_meta", None)
        if isinstance(backend_meta, list) and len(backend_meta) == size:
            entry = where[metadata.global_indexes[0]]
            for sample in backend_meta:
                sample.update(entry)
        if moved:  # the same fields, put before from another process's home: drop those copies
            await self.client.adelete_products_each(
                {node: [(task_ids(gis), names)] for node, (gis, names) in moved.items()}
            )

    async def _store(
        self, data: TensorDict, metadata: TQBatchMeta
    ) -> tuple[dict[int, dict[str, Any]], dict[str, tuple[list[int], list[str]]]]:
        """The put's bundle committed on the home worker: each sample's locations, and the copies
        of its fields an earlier put left elsewhere (see `_moved_fields`)."""
        size, global_indexes = len(metadata.global_indexes), list(metadata.global_indexes)
        partition = metadata.partition_ids[0]
        if data.batch_size[0] != size:
            raise InvalidArgumentError(f"{data.batch_size[0]} rows of data for {size} samples")
        columns, types = columns_of(data)
        batch = DistributedBatchMemory.from_dict(columns, task_ids=task_ids(global_indexes))
        # Where this put goes, fixed for the whole put: puts run concurrently, and another one
        # failing may move the process's home meanwhile.
        home, slot = self.home, self.slot
        bundle, _ = batch.export_bundle(home)
        try:
            try:
                await self.client.aput_bundle(home, bundle)
            except WorkerUnavailableError as exc:
                if not await self._follow_restart(exc.node):
                    raise
                home = self.options.endpoints[slot]  # the same worker, started again elsewhere
                await self.client.aput_bundle(home, bundle)
        except WorkerUnavailableError as exc:
            what = f"put of {size} sample(s) to partition {partition!r}"
            outcome = f"{what} failed; none of its fields was recorded"
            if self._move_home(away_from=home):  # later puts go to a worker that may answer
                outcome += f"; this process's next puts go to {self.home}"
            raise _unreachable(exc, outcome) from exc
        # Every sample's fields are on one slot: one dict for all (serialised at once, never changed).
        entry = {name: location(slot, types.get(name)) for name in batch.fields}
        moved = _moved_fields(metadata, list(batch.fields), slot, self.options.endpoints)
        return dict.fromkeys(global_indexes, entry), moved

    async def _announce_without_fields(self, metadata: TQBatchMeta) -> None:
        """Tell the controller of a failed put's samples with no field (see `put_data`); a
        controller that cannot be told either leaves the put's own error to be raised."""
        try:
            await self.notify_data_update(metadata.partition_ids[0], list(metadata.global_indexes), {}, None)
        except Exception:  # the put's error says what went wrong; this one would hide it
            logger.warning("TransferQueue's controller was not told of a failed put's samples", exc_info=True)

    async def _follow_restart(self, node: str) -> bool:
        """Whether the worker that was at `node` serves elsewhere now: started again on its data
        directory, whose ``node`` file names a newer address (and `node` among the earlier
        ones), where a worker of the same rank answers. Then that address is its slot's endpoint
        in this process (the home too, if it was `node`). True also if this process followed it
        already; False without `data_dir`, or if the directory names no newer address (it may
        still be starting) or its worker is not the slot's."""
        if self.options.data_dir is None:
            return False
        if node in self._followed:
            return True
        endpoints = list(self.options.endpoints)
        if node not in endpoints:
            return False
        slot = endpoints.index(node)
        known = served_at(worker_data_dir(self.options.data_dir, slot))
        if node not in known[:-1]:
            return False
        new = known[-1]
        try:
            health = await self.client.ahealth(new)
        except NodeError:
            return False
        if health.get("rank") != slot or self.options.endpoints[slot] != node:
            return self.options.endpoints[slot] != node  # not ours; or a concurrent call followed it
        endpoints[slot] = new
        self.options = replace(self.options, endpoints=tuple(endpoints))
        self._followed[node] = slot
        if self.home == node:
            self.home = new
        logger.warning("distbatch worker %d: %s restarted on its data directory at %s", slot, node, new)
        return True

    async def _again_where_followed(
        self, nodes: list[str], results: list[Any], call: Callable[[str], Any]
    ) -> None:
        """Call `call` once more on each node whose result says it was unreachable and that was
        started again elsewhere (`_follow_restart`); its new address and result replace the old."""
        again: dict[int, str] = {}
        for at, (node, result) in enumerate(zip(nodes, results)):
            if not isinstance(result, WorkerUnavailableError):
                continue
            slot = (
                self.options.endpoints.index(node)
                if node in self.options.endpoints
                else self._followed.get(node)
            )
            if slot is not None and await self._follow_restart(node):
                again[at] = self.options.endpoints[slot]
        answers = await asyncio.gather(*(call(node) for node in again.values()), return_exceptions=True)
        for at, node, answer in zip(again, again.values(), answers):
            nodes[at], results[at] = node, answer

    def _move_home(self, away_from: str) -> bool:
        """Make another worker this process's home (one on its host if there is one), after
        `away_from` went unanswered: else every later put would wait on a dead worker. True when
        the home is another worker now (moved here or by a concurrent put), False when there is
        no other."""
        if self.home != away_from:  # a concurrent put that failed there moved it already
            return True
        others = [e for e in self.options.endpoints if e != away_from]
        if not others:
            return False
        self.home = home_worker(others, self.here, os.getpid())
        self.slot = self.options.endpoints.index(self.home)
        return True

    async def samples_holding_fields(self, global_indexes: Sequence[int]) -> set[int]:
        """Which of these samples some worker holds a field of (asked of every worker at once); a
        worker that cannot be asked counts as holding them all, so nothing it may hold is taken
        for empty."""
        if not global_indexes:
            return set()
        by_task = dict(zip(task_ids(list(global_indexes)), global_indexes))
        endpoints = list(self.options.endpoints)
        answers = list(
            await asyncio.gather(
                *(self.client.atask_fields(node, list(by_task)) for node in endpoints), return_exceptions=True
            )
        )
        await self._again_where_followed(
            endpoints, answers, lambda node: self.client.atask_fields(node, list(by_task))
        )
        held: set[int] = set()
        for node, answer in zip(endpoints, answers):
            if isinstance(answer, NodeError):
                logger.warning("could not ask %s which samples it holds: %s", node, answer)
                return set(global_indexes)
            if isinstance(answer, BaseException):
                raise answer
            held.update(by_task[task] for task in answer[0])
        return held

    # ------------------------------------------------------------------ get

    async def get_data(self, metadata: TQBatchMeta) -> TensorDict:
        """Every field of `metadata`'s samples, gathered from the workers that hold them (one
        product per worker and put), in TransferQueue's layout."""
        names = list(metadata.field_names)
        size = len(metadata.global_indexes)
        if size == 0 or not names:
            return TensorDict({}, batch_size=size)
        try:
            try:
                gathered = await self._gather(metadata, names)
            except WorkerUnavailableError as exc:
                if not await self._follow_restart(exc.node):
                    raise
                gathered = await self._gather(metadata, names)  # from where it serves now
        except WorkerUnavailableError as exc:
            partitions = sorted(set(metadata.partition_ids))
            label = "partition" if len(partitions) == 1 else "partitions"
            what = f"get of {size} sample(s) from {label} {', '.join(map(repr, partitions))}"
            raise _unreachable(exc, f"{what} failed: the data that worker holds cannot be read") from exc
        if gathered is None:  # nothing to gather (plan_fetch says so only for no names)
            return TensorDict({}, batch_size=size)
        return tensordict_of(gathered, names, size, value_types(_locations(metadata), names))

    async def _gather(self, metadata: TQBatchMeta, names: list[str]) -> Any:
        """The fields `names` of `metadata`'s samples, from the workers the slots name now."""
        meta = _batch_meta(metadata, names, self.options.endpoints)
        plan = plan_fetch(meta, names, self.client)
        return None if plan is None else await fetch(AWAITED, self.client, plan, NO_PROGRESS_BAR)

    # ------------------------------------------------------------------ clear

    async def clear_data(self, metadata: TQBatchMeta) -> None:
        """Delete every field of `metadata`'s samples wherever it is (idempotent)."""
        global_indexes = list(metadata.global_indexes)
        if not global_indexes:
            return
        nodes = sorted(_nodes_holding(metadata, self.options.endpoints) or set(self.options.endpoints))
        ids = task_ids(global_indexes)
        results = await asyncio.gather(
            *(self.client.adelete(node, task_ids=ids) for node in nodes), return_exceptions=True
        )
        results = list(results)
        await self._again_where_followed(nodes, results, lambda node: self.client.adelete(node, task_ids=ids))
        outcome = dict(zip(nodes, results))
        failed = {node: r for node, r in outcome.items() if isinstance(r, NodeError)}
        errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, NodeError)]
        if errors:
            raise errors[0]
        if failed:
            deleted = {node: r.deleted for node, r in outcome.items() if isinstance(r, DeleteResult)}
            raise ClearError(failed, sum(deleted.values()), {}, deleted_by_node=deleted)

    # ------------------------------------------------------------------ checkpoints

    async def save_checkpoint(self, checkpoint_dir: str) -> None:
        """`tq.save_checkpoint`: every sample the workers hold, written under `checkpoint_dir`."""
        directory = Path(checkpoint_dir) / CHECKPOINT_DIR
        await asyncio.to_thread(save_shards, self.client, self.options.endpoints, directory)

    async def load_checkpoint(self, checkpoint_dir: str) -> None:
        """`tq.load_checkpoint`: the saved samples back on the workers in their slots."""
        directory = Path(checkpoint_dir) / CHECKPOINT_DIR
        await asyncio.to_thread(load_shards, self.client, self.options.endpoints, directory)

    def close(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
        super().close()


def _unreachable(error: WorkerUnavailableError, outcome: str) -> WorkerUnavailableError:
    """`error` said for a TransferQueue user: the worker (`error.node`), that it is unreachable and
    why, and `outcome`, what that did to their call (raise it `from error`, which keeps the detail)."""
    why = error.reason or error.detail
    out = WorkerUnavailableError(
        error.node,
        f"distbatch worker unreachable ({why}): it died, was stopped, or the network to it is down; "
        f"TransferQueue's {outcome}",
    )
    out.reason = error.reason
    out.partial_results = error.partial_results
    return out


def _slot(entry: Any) -> int:
    slot = location_slot(entry)
    return -1 if slot is None else slot


def _slots(locations: list[dict[str, Any]], name: str) -> np.ndarray:
    """Each sample's worker slot for field `name` (-1: none): C-level passes when every location
    is a plain slot (the usual case), one step per sample otherwise."""
    entries = list(map(dict.get, locations, itertools.repeat(name, len(locations))))
    if set(map(type, entries)) <= {int}:
        return np.fromiter(entries, dtype=np.int64, count=len(entries))
    return np.fromiter(map(_slot, entries), dtype=np.int64, count=len(entries))


def _locations(metadata: TQBatchMeta) -> list[dict[str, Any]]:
    return list(getattr(metadata, "_custom_backend_meta", None) or [{} for _ in metadata.global_indexes])


def _batch_meta(metadata: TQBatchMeta, names: list[str], endpoints: Sequence[str]) -> BatchMeta:
    """Our metadata for TransferQueue's samples: per field, the worker each sample's value is on
    (its backend metadata: a slot in `endpoints`) and the dtype; shapes are not needed to gather
    (each answer carries its own), so every sample counts as one element for planning."""
    locations = _locations(metadata)
    n = len(locations)
    fields: dict[str, FieldMeta] = {}
    for name in names:
        slots = _slots(locations, name)
        if (slots < 0).any():
            gi = metadata.global_indexes[int(np.flatnonzero(slots < 0)[0])]
            raise NotFoundError(f"sample {gi} has no Distbatch location for field {name!r}")
        node_index = (slots % len(endpoints)).astype(np.int32)
        schema = metadata.field_schema.get(name, {})
        dtype = (
            None
            if schema.get("is_non_tensor") or schema.get("dtype") is None
            else wire.dtype_name(schema["dtype"])
        )
        fields[name] = FieldMeta(dtype, node_index, RowShapes.uniform(n, ()), False)
    return BatchMeta(task_ids(list(metadata.global_indexes)), list(endpoints), fields)


def _nodes_holding(metadata: TQBatchMeta, endpoints: Sequence[str]) -> set[str]:
    slots = {_slot(entry) for where in _locations(metadata) for entry in where.values()} - {-1}
    return {endpoints[slot % len(endpoints)] for slot in slots}


def _moved_fields(
    metadata: TQBatchMeta, fields: list[str], home: int, endpoints: Sequence[str]
) -> dict[str, tuple[list[int], list[str]]]:
    """Fields this put replaces that an earlier put left on another worker: per worker, the
    samples and fields to delete there."""
    out: dict[str, tuple[list[int], list[str]]] = {}
    locations = _locations(metadata)
    if not any(locations):  # new samples (the usual put): nothing stored anywhere yet
        return out
    for gi, where in zip(metadata.global_indexes, locations):
        for name in fields:
            slot = _slot(where.get(name))
            if slot >= 0 and slot % len(endpoints) != home:
                gis, names = out.setdefault(endpoints[slot % len(endpoints)], ([], []))
                if not gis or gis[-1] != gi:
                    gis.append(gi)
                if name not in names:
                    names.append(name)
    return out
