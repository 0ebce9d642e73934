"""`StreamingDataset` / `StreamingDataLoader`: torch loaders that pull one rank's batches from a controller.

A training rank does not receive its data from the trainer script: it asks
the controller (a `Controller` in this process, or a `RemoteController` in
another one) for the next batch of ready samples, gathers the tensors straight
from the workers that hold them, and yields micro-batches.

Two modes:

- **streaming** (``should_check_consumption_status=False``, the default): an
  infinite stream. When no batch is ready the iterator sleeps
  ``poll_interval`` seconds and asks again, so samples put later are picked
  up; the caller decides when a step has had enough.
- **finite** (``should_check_consumption_status=True``): the iterator ends
  once the controller reports every task of the partition consumed by
  ``task_name`` and one more request comes back empty. Tasks the sampler never
  serves (a tail smaller than ``batch_size``, an incomplete GRPO group) keep
  the partition unfinished; ``max_empty_polls`` bounds that wait.

**Delivery.** Nothing handed out is skipped. Each batch index is asked with a
``request_id`` made once for it; when getting the batch or gathering its data
fails with a connection error, a timeout or a server error (5xx), the
dataset waits a little and asks again with the same id (and the same
``batch_index``), up to ``fetch_retries`` times, and the controller answers
with the same tasks. After that, or on any other error, the error is raised;
iterating again re-asks that same batch first. The controller remembers
answers for a bounded time (`Controller` ``request_ttl``, 10 minutes by default).

**Mistakes.** A field the partition has never had nor declared is an
`UnknownFieldError` at once. An unknown partition is an
`UnknownPartitionError` at once in finite mode; in streaming mode it counts
as an empty poll (a consumer may start before its producer), with one
warning naming the partitions there are.

**Batch indexes.** Each fetched batch gets a ``batch_index`` that goes to the
sampler with ``dp_rank``; with `RankAwareSampler` (or a group sampler given
both) every TP/PP peer of one dp rank that asks for the same index gets the
same samples, so peers iterating in lock-step see identical data. Indexes
restart at 0 on `step()`.

**Replay buffer.** Every fetched batch is kept (LOCAL) until `step()`.
`reset()` rewinds to the start of the buffer: the same batches again, without
asking the controller. In an endless stream the buffer grows until `step()`,
so call `step()` at every training step.

**Loader workers.** With ``num_workers = W > 0``, worker ``w`` fetches batch
indexes ``w, w + W, w + 2W, ...``, so no two workers ask for the same index
and TP peers with the same ``W`` still line up index by index. The controller
must be a `RemoteController`: a `Controller` object would be copied into each
worker process, where nothing it records is seen by anyone else (a clear
`ValueError` says so). Each worker keeps its own buffer, which lives in that
worker's process: `reset()` and `get_buffer()` therefore need
``num_workers=0``; `step()` works between passes (each pass starts its workers
from the loader's current state).
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch.utils.data

from distbatch.batch.memory import BatchStatus, DistributedBatchMemory
from distbatch.checks import check_int
from distbatch.controller.api import ControllerAPI
from distbatch.controller.arguments import check_staleness
from distbatch.errors import (
    InvalidArgumentError,
    InvalidTypeError,
    ReplayUnavailableError,
    ServerError,
    UnknownPartitionError,
)
from distbatch.ids import validate_id

__all__ = [
    "FetchBatchFn",
    "ProcessBatchFn",
    "ReplayUnavailableError",
    "StreamingDataLoader",
    "StreamingDataset",
    "fetch_batch",
    "split_micro_batches",
]

logger = logging.getLogger("distbatch.dataloader")

#: fetch_batch_fn(controller, partition_id, task_name, fields, batch_size, *, dp_rank, batch_index,
#: request_id, **sampling_config) -> DistributedBatchMemory (EMPTY, or None, when nothing is ready)
FetchBatchFn = Callable[..., DistributedBatchMemory | None]
#: process_batch_fn(local_batch, micro_batch_size=...) -> iterable of micro-batches (anything)
ProcessBatchFn = Callable[..., Iterable[Any]]

# Names the dataset passes itself (or get_meta / the controller takes): not allowed in sampling_config.
_RESERVED_CONFIG_KEYS = frozenset(
    {
        "partition_id",
        "task_name",
        "fields",
        "batch_size",
        "timeout",
        "dp_rank",
        "batch_index",
        "partition",
        "request_id",
        "max_staleness",
        "stale",
    }
)
# Errors worth asking again for (the same tasks): the network, a timeout, a server's 5xx;
# not a refused token (AuthError is a PermissionError, an OSError).
_TRANSIENT = (OSError, ServerError)
_NOT_TRANSIENT = (PermissionError,)
FETCH_BACKOFF = 0.1
FETCH_BACKOFF_MAX = 2.0


_LOCAL_CONTROLLER_IN_WORKERS = (
    "a local Controller cannot serve DataLoader worker processes: each worker would get its own copy, "
    "so consumption it records and tasks put later are seen by nobody else. Serve it "
    "(distbatch.serve_controller) and pass distbatch.RemoteController(server.address), "
    "or use num_workers=0"
)


# ----------------------------------------------------------------------------- default functions


def _process_local(controller: ControllerAPI) -> bool:
    """Whether a copy of `controller` in a loader worker would be another controller. Objects
    written before `ControllerAPI` had `process_local` are taken as shareable, as they were."""
    return bool(getattr(controller, "process_local", False))


def fetch_batch(
    controller: ControllerAPI,
    partition_id: str,
    task_name: str,
    fields: Sequence[str],
    batch_size: int,
    *,
    dp_rank: int,
    batch_index: int,
    request_id: str | None = None,
    **sampling_config: Any,
) -> DistributedBatchMemory:
    """The default `fetch_batch_fn`: ask the controller for a batch and gather it (LOCAL, or EMPTY).

    `request_id` goes to `get_meta`, so asking again after a failed gather gets the same tasks.
    """
    batch = controller.get_meta(
        partition_id,
        task_name,
        list(fields),
        batch_size,
        dp_rank=dp_rank,
        batch_index=batch_index,
        request_id=request_id,
        **sampling_config,
    )
    return batch.to_local()


def split_micro_batches(
    batch: DistributedBatchMemory, micro_batch_size: int | None = None
) -> list[DistributedBatchMemory]:
    """The default `process_batch_fn`: consecutive micro-batches of `micro_batch_size`, tail kept.

    Slicing keeps every task's data with its task id, also in a short tail.
    ``None`` yields the whole batch as one micro-batch.
    """
    n = len(batch)
    if n == 0:
        return []
    if micro_batch_size is None or micro_batch_size >= n:
        return [batch]
    return [batch[start : start + micro_batch_size] for start in range(0, n, micro_batch_size)]


# ----------------------------------------------------------------------------- validation


def _token_budget(
    max_tokens: Any, micro_batches: Any, micro_batch_size: Any, process_batch_fn: Any
) -> tuple[int | None, int | None]:
    """`max_tokens` and `micro_batches`, checked: a budget excludes a task count per micro-batch
    and a `process_batch_fn` (each is a way of cutting a batch), and a count needs a budget."""
    if max_tokens is None:
        if micro_batches is not None:
            raise InvalidArgumentError("micro_batches= needs max_tokens= (the token budget it divides)")
        return None, None
    if micro_batch_size is not None or process_batch_fn is not None:
        raise InvalidArgumentError(
            "max_tokens= cuts batches by tokens: pass it without micro_batch_size= or process_batch_fn="
        )
    count = None if micro_batches is None else check_int(micro_batches, "micro_batches", 1)
    return check_int(max_tokens, "max_tokens", 1), count


def _fields(value: Any) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidArgumentError(f"fields must be a list of field names, got {value!r}")
    names = tuple(value)
    if not names:
        raise InvalidArgumentError("fields must name at least one field")
    for name in names:
        validate_id(name, "field")
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"fields repeat a name: {list(names)}")
    return names


def _sampling_config(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(f"sampling_config must be a mapping, got {type(value).__name__}")
    config = dict(value)  # our own copy: the caller's mapping is never mutated nor tracked
    for key in config:
        if not isinstance(key, str) or not key.isidentifier():
            raise InvalidArgumentError(f"sampling_config keys must be identifiers, got {key!r}")
    reserved = sorted(_RESERVED_CONFIG_KEYS.intersection(config))
    if reserved:
        raise InvalidArgumentError(
            f"sampling_config must not set {reserved}: the dataset passes these itself "
            "(dp_rank is an argument of StreamingDataset, batch_index counts fetched batches)"
        )
    return config


def _poll_interval(value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise InvalidArgumentError(f"poll_interval must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


# ----------------------------------------------------------------------------- dataset


def _check_hooks(
    controller: Any, fetch_batch_fn: Any, process_batch_fn: Any, should_check_consumption_status: Any
) -> None:
    """The controller and hooks a dataset is given can do what it will ask of them."""
    if controller is None:
        raise InvalidArgumentError("controller is required (a Controller or a RemoteController)")
    if fetch_batch_fn is None and not callable(getattr(controller, "get_meta", None)):
        raise InvalidArgumentError(
            f"controller {controller!r} has no get_meta(); pass a controller or fetch_batch_fn"
        )
    if not isinstance(should_check_consumption_status, bool):
        raise InvalidArgumentError(
            f"should_check_consumption_status must be a bool, got {should_check_consumption_status!r}"
        )
    if should_check_consumption_status and not callable(getattr(controller, "all_consumed", None)):
        raise InvalidArgumentError(f"finite mode needs controller.all_consumed(); {controller!r} has none")
    if fetch_batch_fn is not None and not callable(fetch_batch_fn):
        raise InvalidArgumentError(f"fetch_batch_fn must be callable, got {fetch_batch_fn!r}")
    if process_batch_fn is not None and not callable(process_batch_fn):
        raise InvalidArgumentError(f"process_batch_fn must be callable, got {process_batch_fn!r}")


class StreamingDataset(torch.utils.data.IterableDataset):
    """Yields one dp rank's micro-batches, pulled batch by batch from a controller.

    Args:
        controller: a `Controller` (this process only) or a `RemoteController`.
        partition_id: the partition to read; `step()` moves to another.
        task_name: the consumer's name; the controller tracks consumption per name.
        fields: the fields to fetch (a task is ready once it has all of them).
        batch_size: tasks per fetched batch (per dp rank; the sampler decides exactly).
        micro_batch_size: tasks per yielded micro-batch; None yields whole batches.
        dp_rank: this rank's data-parallel index, passed to the sampler.
        fetch_batch_fn: replaces `fetch_batch`; called as ``fn(controller,
            partition_id, task_name, fields, batch_size, dp_rank=...,
            batch_index=..., request_id=..., **sampling_config)``, returns a
            batch (EMPTY or None when nothing is ready; a REMOTE one is
            gathered here). Pass `request_id` on to ``get_meta``: a re-ask after
            a failure then gets the same tasks (see "Delivery").
        process_batch_fn: replaces `split_micro_batches`; called as
            ``fn(local_batch, micro_batch_size=...)``, returns an iterable of
            whatever the training step consumes.
        should_check_consumption_status: False = endless stream, True = finite (see module doc).
        poll_interval: seconds to sleep when no batch is ready.
        sampling_config: extra keyword arguments for the sampler (copied, never mutated).
        max_empty_polls: end the iteration after this many empty polls in a row
            (both modes); None waits forever.
        fetch_retries: how many times a batch whose fetch failed with a
            transient error is asked again (same tasks) before the error is raised.
        max_staleness: only tasks at most this many policy versions older than the
            controller's `policy_version()` (`Controller.get_meta`); passed to `fetch_batch_fn`
            only when set.
        stale: what happens to older ready tasks: ``"wait"`` (they stay) or ``"drop"``.
        max_tokens: cut each batch into micro-batches of at most this many tokens
            (`DistributedBatchMemory.split_micro_batches`, balanced by tokens) instead of
            `micro_batch_size` tasks; `micro_batches` fixes their count, the same on every
            rank (gradient accumulation in step), or the fewest that fit when None.
    """

    def __init__(
        self,
        controller: ControllerAPI,
        partition_id: str,
        task_name: str,
        fields: Sequence[str],
        batch_size: int,
        micro_batch_size: int | None = None,
        dp_rank: int = 0,
        fetch_batch_fn: FetchBatchFn | None = None,
        process_batch_fn: ProcessBatchFn | None = None,
        should_check_consumption_status: bool = False,
        poll_interval: float = 1.0,
        sampling_config: Mapping[str, Any] | None = None,
        max_empty_polls: int | None = None,
        fetch_retries: int = 3,
        max_staleness: int | None = None,
        stale: str = "wait",
        max_tokens: int | None = None,
        micro_batches: int | None = None,
    ) -> None:
        super().__init__()
        _check_hooks(controller, fetch_batch_fn, process_batch_fn, should_check_consumption_status)
        self.controller = controller
        self._partition_id = validate_id(partition_id, "partition_id")
        self.task_name = validate_id(task_name, "task_name")
        self.fields = _fields(fields)
        self.batch_size = check_int(batch_size, "batch_size", 1)
        self.micro_batch_size = (
            None if micro_batch_size is None else check_int(micro_batch_size, "micro_batch_size", 1)
        )
        self.dp_rank = check_int(dp_rank, "dp_rank", 0)
        self.fetch_batch_fn: FetchBatchFn = fetch_batch_fn or fetch_batch
        self.process_batch_fn: ProcessBatchFn = process_batch_fn or split_micro_batches
        self.should_check_consumption_status = should_check_consumption_status
        self.poll_interval = _poll_interval(poll_interval)
        self._sampling_config = _sampling_config(sampling_config)
        self.max_empty_polls = (
            None if max_empty_polls is None else check_int(max_empty_polls, "max_empty_polls", 1)
        )
        self.fetch_retries = check_int(fetch_retries, "fetch_retries", 0)
        self.max_staleness = check_staleness(max_staleness, stale)
        self.stale = stale
        self.max_tokens, self.micro_batches = _token_budget(
            max_tokens, micro_batches, micro_batch_size, process_batch_fn
        )
        # (partition_id, batch_index, request_id) of the batch being fetched, until it is buffered:
        # a re-ask after a failure (also in a later iteration) reuses the id and gets the same tasks.
        self._pending: tuple[str, int, str] | None = None
        self._warned_partition: str | None = None
        self._buffer: list[DistributedBatchMemory] = []
        self._buffer_pid = os.getpid()  # the process whose fetches the buffer holds
        self._position = 0  # buffer index of the batch being yielded
        self._micro = 0  # micro-batches of that batch already yielded
        self._generation = 0  # bumped by reset() / step(): a live iterator drops its current batch

    def _freshness(self) -> dict[str, Any]:
        """`get_meta`'s staleness arguments, when this dataset sets them."""
        return (
            {} if self.max_staleness is None else {"max_staleness": self.max_staleness, "stale": self.stale}
        )

    def _micro_batches(self, batch: DistributedBatchMemory) -> Iterable[Any]:
        if self.max_tokens is not None:
            return batch.split_micro_batches(self.max_tokens, count=self.micro_batches)
        return self.process_batch_fn(batch, micro_batch_size=self.micro_batch_size)

    # ------------------------------------------------------------------ state

    @property
    def partition_id(self) -> str:
        return self._partition_id

    @property
    def sampling_config(self) -> dict[str, Any]:
        """A copy of the extra sampler arguments."""
        return dict(self._sampling_config)

    @property
    def batch_index(self) -> int:
        """Batches fetched (in this process) since the last `step()`."""
        return len(self._buffer)

    def reset(self) -> None:
        """Replay from the start of the buffer: the same batches again, no new fetch until it runs out."""
        self._position = 0
        self._micro = 0
        self._generation += 1

    def step(self, partition_id: str) -> None:
        """Move on to `partition_id` (the next training step): drop the buffer, batch indexes restart."""
        self._partition_id = validate_id(partition_id, "partition_id")
        self._pending = None
        self._buffer = []
        self._buffer_pid = os.getpid()
        self._position = 0
        self._micro = 0
        self._generation += 1

    def get_buffer(self) -> list[DistributedBatchMemory]:
        """The batches fetched since the last `step()`, oldest first (a new list, same batches)."""
        return list(self._buffer)

    # ------------------------------------------------------------------ iteration

    def _worker_slot(self) -> tuple[int, int]:
        """(worker id, worker count) of the loader worker running this, (0, 1) in the main process."""
        info = torch.utils.data.get_worker_info()
        if info is None:
            return 0, 1
        if _process_local(self.controller):
            raise InvalidArgumentError(_LOCAL_CONTROLLER_IN_WORKERS)
        if self._buffer and self._buffer_pid != os.getpid():
            raise InvalidArgumentError(
                "this StreamingDataset already holds batches fetched in another process; "
                "call step() before iterating it in loader workers"
            )
        return info.id, info.num_workers

    def _request_id(self, batch_index: int) -> str:
        """The request id of `batch_index`: the pending one if this batch was asked before."""
        pending = self._pending
        if pending is not None and pending[:2] == (self._partition_id, batch_index):
            return pending[2]
        request_id = uuid.uuid4().hex
        self._pending = (self._partition_id, batch_index, request_id)
        return request_id

    def _fetch(self, batch_index: int) -> DistributedBatchMemory | None:
        """One batch for `batch_index`, LOCAL, or None when nothing is ready.

        A transient failure asks again for the same tasks (same request id), at most
        `fetch_retries` times; then, or on another error, the error is raised.
        """
        request_id = self._request_id(batch_index)
        failures = 0
        while True:
            try:
                return self._fetch_once(batch_index, request_id)
            except _TRANSIENT as exc:
                if isinstance(exc, _NOT_TRANSIENT):
                    raise
                failures += 1
                if failures > self.fetch_retries:
                    logger.error(
                        "partition %r, task %r, dp rank %d, batch %d: fetch failed %d times, giving up "
                        "(iterating again asks for the same tasks): %s",
                        self._partition_id,
                        self.task_name,
                        self.dp_rank,
                        batch_index,
                        failures,
                        exc,
                    )
                    raise
                logger.warning(
                    "partition %r, task %r, dp rank %d, batch %d: fetch failed (%s), asking again",
                    self._partition_id,
                    self.task_name,
                    self.dp_rank,
                    batch_index,
                    exc,
                )
                time.sleep(min(FETCH_BACKOFF * 2 ** (failures - 1), FETCH_BACKOFF_MAX))

    def _poll(self, batch_index: int) -> DistributedBatchMemory | None:
        """`_fetch`, where streaming mode takes an unknown partition for one not produced yet."""
        try:
            return self._fetch(batch_index)
        except UnknownPartitionError as exc:
            if self.should_check_consumption_status:
                raise
            if self._warned_partition != self._partition_id:
                self._warned_partition = self._partition_id
                logger.warning("%s; waiting for a producer to create it", exc)
            return None

    def _fetch_once(self, batch_index: int, request_id: str) -> DistributedBatchMemory | None:
        batch = self.fetch_batch_fn(
            self.controller,
            self._partition_id,
            self.task_name,
            list(self.fields),
            self.batch_size,
            dp_rank=self.dp_rank,
            batch_index=batch_index,
            request_id=request_id,
            **self._freshness(),
            **self._sampling_config,
        )
        if batch is None:
            return None
        if not isinstance(batch, DistributedBatchMemory):
            raise InvalidTypeError(
                f"fetch_batch_fn must return a DistributedBatchMemory, got {type(batch).__name__}"
            )
        if batch.status is BatchStatus.EMPTY:
            return None
        return batch.to_local()  # the buffer replays without touching the workers

    def __iter__(self) -> Iterator[Any]:
        worker_id, num_workers = self._worker_slot()
        empty_polls = 0
        while True:
            generation = self._generation
            if self._position < len(self._buffer):
                micro_batches = list(self._micro_batches(self._buffer[self._position]))
                while self._micro < len(micro_batches):
                    item = micro_batches[self._micro]
                    self._micro += 1
                    yield item
                    if self._generation != generation:  # reset() / step() while we were suspended
                        break
                else:
                    self._position += 1
                    self._micro = 0
                continue
            batch_index = worker_id + len(self._buffer) * num_workers
            batch = self._poll(batch_index)
            if batch is None and self.should_check_consumption_status:
                if self.controller.all_consumed(self._partition_id, self.task_name):
                    # Done unless a TP peer took this index's samples between our fetch and the
                    # status check: the sampler's cache then hands them to us on a second ask.
                    batch = self._poll(batch_index)
                    if batch is None:
                        return
            if batch is not None:
                self._buffer.append(batch)
                self._pending = None  # delivered: the next index gets a new request id
                empty_polls = 0
                continue
            empty_polls += 1
            if self.max_empty_polls is not None and empty_polls >= self.max_empty_polls:
                logger.info(
                    "partition %r, task %r, dp rank %d: no batch after %d polls, ending the iteration",
                    self._partition_id,
                    self.task_name,
                    self.dp_rank,
                    empty_polls,
                )
                return
            time.sleep(self.poll_interval)

    def __repr__(self) -> str:
        mode = "finite" if self.should_check_consumption_status else "streaming"
        return (
            f"StreamingDataset(partition_id={self._partition_id!r}, task_name={self.task_name!r}, "
            f"dp_rank={self.dp_rank}, batch_size={self.batch_size}, "
            f"micro_batch_size={self.micro_batch_size}, mode={mode}, buffered={len(self._buffer)})"
        )


# ----------------------------------------------------------------------------- loader


class StreamingDataLoader(torch.utils.data.DataLoader):
    """A `torch.utils.data.DataLoader` over a `StreamingDataset` (``batch_size=None``: it batches).

    Other DataLoader arguments (``num_workers``, ``pin_memory``,
    ``collate_fn``, ``persistent_workers``...) pass through. `reset()`,
    `step()` and `get_buffer()` act on the dataset; with worker processes,
    see the module docstring for what each can do.
    """

    def __init__(self, dataset: StreamingDataset, **kwargs: Any) -> None:
        if not isinstance(dataset, StreamingDataset):
            raise InvalidArgumentError(
                f"StreamingDataLoader needs a StreamingDataset, got {type(dataset).__name__}"
            )
        if kwargs.get("batch_size") is not None:
            raise InvalidArgumentError(
                "StreamingDataLoader batches in the dataset (batch_size / micro_batch_size there); "
                f"got batch_size={kwargs['batch_size']!r}"
            )
        for name in ("shuffle", "sampler", "batch_sampler", "drop_last"):
            if kwargs.get(name):
                raise InvalidArgumentError(f"{name}= does not apply to a streaming dataset")
        kwargs.pop("batch_size", None)
        num_workers = kwargs.get("num_workers", 0)
        if isinstance(num_workers, int) and num_workers > 0 and _process_local(dataset.controller):
            raise InvalidArgumentError(_LOCAL_CONTROLLER_IN_WORKERS)
        super().__init__(dataset, batch_size=None, **kwargs)

    def _check_in_process(self, action: str) -> None:
        if self.num_workers > 0:
            raise ReplayUnavailableError(
                f"cannot {action} with num_workers={self.num_workers}: each loader worker keeps its "
                "fetched batches in its own process; use num_workers=0 for replay"
            )

    def reset(self) -> None:
        """Replay the buffered batches on the next pass (needs ``num_workers=0``)."""
        self._check_in_process("reset()")
        self.dataset.reset()  # type: ignore[attr-defined]

    def step(self, partition_id: str) -> None:
        """Move to `partition_id`; persistent workers are shut down so the next pass starts fresh."""
        self.dataset.step(partition_id)  # type: ignore[attr-defined]
        iterator = getattr(self, "_iterator", None)
        if iterator is not None:  # persistent workers still hold the old state
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if callable(shutdown):
                shutdown()
            self._iterator = None

    def get_buffer(self) -> list[DistributedBatchMemory]:
        """The dataset's buffered batches (needs ``num_workers=0``)."""
        self._check_in_process("get_buffer()")
        return self.dataset.get_buffer()  # type: ignore[attr-defined]
