"""`ControllerAPI`: what every controller offers, in this process (`Controller`) or over HTTP
(`RemoteController`).

The data loader, the examples and user code take a `ControllerAPI`, so a rank reads batches the
same way whichever side of a process boundary the controller sits on. A second implementation is
a class that satisfies this protocol, not a copy of one of these method lists.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from distbatch.batch.memory import DistributedBatchMemory
    from distbatch.controller.results import ForgottenNode


@runtime_checkable
class ControllerAPI(Protocol):
    """Partitions of tasks, which fields each task has, and which consumer took which task."""

    process_local: bool
    """True when the controller lives in this process only: a copy sent to another process (a
    DataLoader worker) would be another controller, so such code must serve it over HTTP."""

    def put(
        self,
        partition_id: str,
        batch: DistributedBatchMemory,
        *,
        version: Any = None,
        partial: bool | Iterable[str] = False,
    ) -> int:
        """Record a REMOTE batch's tasks and fields in a partition, with the policy version that
        generated them (one for the batch or one per task); returns the task count. `partial`:
        the fields (True) or those named that are still being generated, so not produced yet."""
        ...

    def inflight(self, partition_id: str) -> DistributedBatchMemory:
        """The tasks with partial values (put with `partial=True`, not completed)."""
        ...

    def reissue(self, partition_id: str) -> DistributedBatchMemory:
        """After a restore: the tasks in flight at the checkpoint that still are, each once."""
        ...

    def set_policy_version(self, version: int) -> None:
        """The trainer's current policy version, which staleness is measured against."""
        ...

    def policy_version(self) -> int:
        """The trainer's current policy version, as last set."""
        ...

    def policy_versions(self, partition_id: str, task_ids: Iterable[str]) -> dict[str, int]:
        """The policy version each of `task_ids` was put with (those that have one)."""
        ...

    def create_partition(self, partition_id: str, expected_fields: Iterable[str] = ()) -> None:
        """Create an empty partition, optionally naming fields a later stage will put."""
        ...

    def get_meta(
        self,
        partition_id: str,
        task_name: str,
        fields: Sequence[str],
        batch_size: int,
        *,
        timeout: float | None = None,
        request_id: str | None = None,
        max_staleness: int | None = None,
        stale: str = "wait",
        **sampling_config: Any,
    ) -> DistributedBatchMemory:
        """A REMOTE batch of ready tasks not yet consumed by `task_name`, chosen by the sampler;
        with `max_staleness`, only tasks at most that many policy versions old (older ones
        wait, or are dropped with ``stale="drop"``)."""
        ...

    def production_status(self, partition_id: str, fields: Sequence[str] | None = None) -> dict[str, Any]:
        """How many tasks have each field, and how many have all of them."""
        ...

    def consumption_status(self, partition_id: str, task_name: str) -> dict[str, int]:
        """How many tasks `task_name` consumed, and how many are ready for it."""
        ...

    def all_consumed(self, partition_id: str, task_name: str) -> bool:
        """True once `task_name` consumed every task of the partition."""
        ...

    def reset_consumption(self, partition_id: str, task_name: str | None = None) -> None:
        """Forget what `task_name` (or every consumer) consumed in the partition."""
        ...

    def set_custom_meta(self, partition_id: str, custom_meta: Mapping[str, Mapping[str, Any]]) -> None:
        """Attach small JSON metadata to tasks (samplers may read it, e.g. lengths)."""
        ...

    def get_custom_meta(self, partition_id: str, task_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The custom metadata of the given tasks."""
        ...

    def clear_tasks(self, partition_id: str, task_ids: Iterable[str]) -> int:
        """Delete the tasks' shards on the workers, then forget the tasks."""
        ...

    def clear_partition(self, partition_id: str) -> int:
        """Delete the partition's shards on the workers, then forget the partition."""
        ...

    def forget_node(self, node: str) -> ForgottenNode:
        """Drop every task with a shard on a node gone for good (without contacting it)."""
        ...

    def move_node(self, old: str, new: str) -> int:
        """Tasks with shards on `old` now have them on `new` (a durable worker restarted)."""
        ...

    def partitions(self) -> list[str]:
        """The partition ids, in creation order."""
        ...

    def waiting_consumers(self) -> int:
        """How many `get_meta` calls are waiting for tasks right now."""
        ...

    def summary(self) -> dict[str, Any]:
        """Every partition at a glance: tasks, fields, consumption, waiting consumers."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The controller's bookkeeping as JSON-able data (a checkpoint)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the bookkeeping with a checkpoint's."""
        ...

    def save_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """Write `state_dict()` to a file atomically."""
        ...

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Load a file written by `save_checkpoint`."""
        ...
