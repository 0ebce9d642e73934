"""`SequentialSampler`: the first ready samples, in order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from distbatch.checks import check_int
from distbatch.samplers.base import BaseSampler, _index_list, oldest_first, probe_safe


class SequentialSampler(BaseSampler):
    """The first `batch_size` ready indexes, in the order given (oldest policy version first where
    the controller's partition keeps versions); nothing cached.

    As in TransferQueue, fewer than `batch_size` ready means all of them: the
    controller only asks once at least `batch_size` are ready (see the module
    docstring), so this matters to direct callers only.
    """

    @probe_safe
    def sample(
        self, ready_indexes: Sequence[int], batch_size: int, *args: Any, **kwargs: Any
    ) -> tuple[list[int], list[int]]:
        """(the first batch_size ready indexes, the same); batch_size 0 gives ([], [])."""
        batch_size = check_int(batch_size, "batch_size", 0)
        ordered = oldest_first(ready_indexes, kwargs.get("partition"))
        sampled = _index_list(ordered[:batch_size], "ready_indexes")
        return sampled, list(sampled)
