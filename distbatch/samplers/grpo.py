"""`GRPOGroupNSampler`: whole groups of n responses per prompt, never split."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from distbatch.checks import check_int
from distbatch.errors import InvalidArgumentError
from distbatch.samplers.base import (
    DEFAULT_MAX_CACHED_BATCHES,
    BaseSampler,
    _check_bound,
    _check_str,
    _complete_groups,
    _rank_key,
    probe_safe,
)


class GRPOGroupNSampler(BaseSampler):
    """Whole GRPO groups only: the n responses of a prompt are sampled together or not at all.

    Group k is the aligned block ``[k*n, (k+1)*n)`` (see the module docstring);
    it is complete when all n indexes are ready. A call takes the first
    ``batch_size // n`` complete groups by index (oldest policy version first where the
    controller's partition keeps versions), or nothing. With ``dp_rank``
    and ``batch_index`` in the sampling config the result is cached per rank
    (like `RankAwareSampler`); without them nothing is cached.
    """

    def __init__(
        self, n_samples_per_prompt: int = 1, *, max_cached_batches: int = DEFAULT_MAX_CACHED_BATCHES
    ) -> None:
        super().__init__()
        self.n_samples_per_prompt = check_int(n_samples_per_prompt, "n_samples_per_prompt", 1)
        self.max_cached_batches = _check_bound(max_cached_batches)

    def _config(self) -> dict[str, int]:
        return {"n_samples_per_prompt": self.n_samples_per_prompt}

    def _check_n(self, n_samples_per_prompt: Any) -> int:
        """A per-call n (TransferQueue's older API passed it in the config) must match ours."""
        n = self.n_samples_per_prompt
        if (
            n_samples_per_prompt is not None
            and check_int(n_samples_per_prompt, "n_samples_per_prompt", 1) != n
        ):
            raise InvalidArgumentError(
                f"n_samples_per_prompt={n_samples_per_prompt!r} but this sampler was built with {n}"
            )
        return n

    def _select(self, ready_indexes: Sequence[int], n_groups: int, partition: Any = None) -> list[int] | None:
        """Sample indexes of the first `n_groups` complete groups (oldest policy version first,
        where `partition` keeps versions), or None."""
        n = self.n_samples_per_prompt
        groups = _complete_groups(ready_indexes, n, n_groups, partition)
        if groups is None:
            return None
        return [g * n + j for g in groups for j in range(n)]

    @probe_safe
    def sample(
        self,
        ready_indexes: Sequence[int],
        batch_size: int,
        task_name: str = "",
        partition_id: str = "",
        *args: Any,
        dp_rank: int | None = None,
        batch_index: int | None = None,
        n_samples_per_prompt: int | None = None,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        """`batch_size // n` complete groups (batch_size must be a multiple of n), or ([], [])."""
        batch_size = check_int(batch_size, "batch_size", 0)
        n = self._check_n(n_samples_per_prompt)
        if batch_size % n:
            raise InvalidArgumentError(
                f"batch_size ({batch_size}) must be a multiple of n_samples_per_prompt ({n})"
            )
        if batch_size == 0:
            return [], []
        partition_id = _check_str(partition_id, "partition_id")
        task_name = _check_str(task_name, "task_name")
        key = _rank_key(dp_rank, batch_index)
        if key is not None:
            cached = self._cached(partition_id, task_name, *key, batch_size)
            if cached is not None:
                return cached
        sampled = self._select(ready_indexes, batch_size // n, kwargs.get("partition"))
        if sampled is None:
            return [], []
        if key is not None:
            self._remember(partition_id, task_name, *key, sampled, sampled, batch_size)
        return sampled, list(sampled)
