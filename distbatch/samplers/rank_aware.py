"""`RankAwareSampler`: the same `dp_rank` and `batch_index` get the same samples."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from distbatch.checks import check_int
from distbatch.errors import InvalidArgumentError
from distbatch.samplers.base import (
    DEFAULT_MAX_CACHED_BATCHES,
    BaseSampler,
    _check_bound,
    _check_str,
    _index_list,
    _required_rank_key,
    probe_safe,
)
from distbatch.samplers.seqlen_balanced import SeqlenBalancedSampler
from distbatch.samplers.sequential import SequentialSampler


class RankAwareSampler(BaseSampler):
    """Same ``(partition_id, task_name, dp_rank, batch_index)`` -> same samples, for every TP/PP peer.

    The first call for a key lets the wrapped sampler (default
    `SequentialSampler`) choose from ``ready_indexes`` and caches its answer;
    later calls return the cached answer even after those samples have left
    ``ready_indexes``. Different dp ranks get disjoint samples because the
    first call reports them consumed. The wrapped sampler is called without
    ``dp_rank`` / ``batch_index``: it only selects, caching is done here.

    As in TransferQueue, a first call that cannot fill ``batch_size`` (an
    answer shorter than that) returns ``([], [])`` and caches nothing, and
    positional order is theirs: ``sample(ready, batch_size, dp_rank,
    batch_index, task_name, partition_id)``.
    """

    def __init__(
        self, sampler: BaseSampler | None = None, *, max_cached_batches: int = DEFAULT_MAX_CACHED_BATCHES
    ) -> None:
        super().__init__()
        if sampler is None:
            sampler = SequentialSampler()
        if not isinstance(sampler, BaseSampler):
            raise InvalidArgumentError(f"sampler must be a BaseSampler, got {type(sampler).__name__}")
        if isinstance(sampler, (RankAwareSampler, SeqlenBalancedSampler)):
            raise InvalidArgumentError(f"{type(sampler).__name__} is rank-aware already; use it directly")
        self.sampler = sampler
        self.max_cached_batches = _check_bound(max_cached_batches)

    @probe_safe
    def sample(
        self,
        ready_indexes: Sequence[int],
        batch_size: int,
        dp_rank: int | None = None,
        batch_index: int | None = None,
        task_name: str = "",
        partition_id: str = "",
        *args: Any,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        """The cached result for this rank and batch index, else a fresh full one (then cached)."""
        batch_size = check_int(batch_size, "batch_size", 0)
        key = _required_rank_key(dp_rank, batch_index, type(self).__name__)
        if batch_size == 0:
            return [], []
        partition_id = _check_str(partition_id, "partition_id")
        task_name = _check_str(task_name, "task_name")
        cached = self._cached(partition_id, task_name, *key, batch_size)
        if cached is not None:
            return cached
        if not ready_indexes:
            return [], []  # nothing to choose from: the wrapped sampler is not asked
        sampled, consumed = self.sampler.sample(
            ready_indexes, batch_size, partition_id=partition_id, task_name=task_name, **kwargs
        )
        if len(sampled) < batch_size:
            return [], []
        sampled = _index_list(sampled, "sampled")
        consumed = _index_list(consumed, "consumed")
        self._remember(partition_id, task_name, *key, sampled, consumed, batch_size)
        return sampled, consumed

    def check_call(self, batch_size: Any, **config: Any) -> None:
        """Check this sampler's arguments, then the wrapped sampler's (without the rank keys)."""
        super().check_call(batch_size, **config)
        inner = {k: v for k, v in config.items() if k not in ("dp_rank", "batch_index")}
        self.sampler.check_call(batch_size, **inner)

    def _entry(self, sampled: Sequence[int], consumed: Sequence[int]) -> Any:
        # TransferQueue's layout: the sampled list itself when nothing else is consumed.
        if list(sampled) == list(consumed):
            return list(sampled)
        return list(sampled), list(consumed)

    def clear_cache(self, partition_id: str) -> None:
        """Forget this partition here and in the wrapped sampler."""
        super().clear_cache(partition_id)
        self.sampler.clear_cache(partition_id)

    def forget_indexes(self, partition_id: str, indexes: Iterable[int]) -> None:
        """Drop cached results holding any of `indexes`, here and in the wrapped sampler."""
        gone = list(indexes)
        super().forget_indexes(partition_id, gone)
        self.sampler.forget_indexes(partition_id, gone)

    def state_dict(self) -> dict[str, Any]:
        """The cache plus the wrapped sampler's state under ``"inner"``."""
        state = super().state_dict()
        state["inner"] = self.sampler.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load the cache and the wrapped sampler's state; nothing changes if either is invalid."""
        states = self._parse_state(state)
        self.sampler.load_state_dict(state.get("inner", {}))
        self._states = states
        self._batch_sizes().clear()
