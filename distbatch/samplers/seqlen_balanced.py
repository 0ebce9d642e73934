"""`SeqlenBalancedSampler`: GRPO groups balanced over data-parallel ranks by sequence length."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from distbatch.batch.balance import balanced_group_partitions
from distbatch.checks import check_int
from distbatch.errors import InvalidArgumentError
from distbatch.samplers.base import (
    DEFAULT_MAX_CACHED_BATCHES,
    LengthSource,
    _check_str,
    _required_rank_key,
    probe_safe,
)
from distbatch.samplers.grpo import GRPOGroupNSampler

logger = logging.getLogger("distbatch.samplers")


class SeqlenBalancedSampler(GRPOGroupNSampler):
    """Whole groups for all dp ranks at once, split so every rank gets about the same token count.

    On the first call for ``(partition_id, task_name, batch_index)``, from
    whichever rank comes first, it takes ``batch_size * dp_size`` samples as
    complete groups and splits the groups over the ranks with Karmarkar–Karp
    (`balanced_group_partitions`) on per-group total length: every rank's
    portion holds ``batch_size // n`` groups. Every rank's portion is cached, and the
    first caller reports **all** selected samples consumed at once, so no
    sample can land in two batches. Later calls (other ranks, TP peers)
    return their cached portion with ``consumed`` equal to it.

    Lengths, first found wins:

    1. a ``lengths`` mapping of index to length in the sampling config
       (standalone use; every selected index must be in it);
    2. per-sample ``custom_meta`` ``total_lengths`` from
       ``partition.get_custom_meta(indexes)``, TransferQueue's way (a sample
       without one counts as length 1, as there);
    3. ``partition.sample_lengths(indexes, length_field)``: the first dimension
       of ``length_field`` as stored (our controller's partitions offer it);
    4. none of these: an equal split by count, with a warning. Without a
       partition, rank r gets the r-th run of ``batch_size`` selected samples;
       with one, every sample weighs 1 in the balancing. Both are what
       TransferQueue does (it warns only in the first case).

    ``batch_size`` is the per-rank size and must be a multiple of
    ``n_samples_per_prompt`` (whole groups per rank): anything else is an
    `InvalidArgumentError`, since a rank would otherwise get more or fewer
    tasks than it asked for. ``batch_size=0`` gives ``([], [])``. All ranks'
    entries of a batch index are inserted (and so evicted) together.
    """

    def __init__(
        self,
        n_samples_per_prompt: int = 1,
        dp_size: int = 1,
        length_field: str = "input_ids",
        *,
        max_cached_batches: int = DEFAULT_MAX_CACHED_BATCHES,
    ) -> None:
        super().__init__(n_samples_per_prompt, max_cached_batches=max_cached_batches)
        self.dp_size = check_int(dp_size, "dp_size", 1)
        self.length_field = _check_str(length_field, "length_field")

    def _config(self) -> dict[str, int]:
        return {"n_samples_per_prompt": self.n_samples_per_prompt, "dp_size": self.dp_size}

    def _lengths(self, indexes: list[int], partition: Any, lengths: Any) -> list[int] | None:
        """Per-sample lengths of `indexes` (see the class docstring for the order), or None."""
        if lengths is not None:
            if not isinstance(lengths, Mapping):
                raise InvalidArgumentError(
                    f"lengths must be a mapping of sample index to length, got {type(lengths)}"
                )
            missing = [i for i in indexes if i not in lengths]
            if missing:
                raise InvalidArgumentError(f"lengths has no entry for sample indexes {missing[:5]}")
            return [check_int(lengths[i], "sample length", 0) for i in indexes]
        if partition is None:
            self._no_lengths("no partition", "no partition= was given")
            return None
        get_custom_meta = getattr(partition, "get_custom_meta", None)
        if callable(get_custom_meta):
            meta = get_custom_meta(indexes) or {}
            found = [(meta.get(i) or {}).get("total_lengths") for i in indexes]
            if any(v is not None for v in found):
                return [1 if v is None else check_int(v, "total_lengths", 0) for v in found]
        sample_lengths = getattr(partition, "sample_lengths", None)
        if not callable(sample_lengths):
            self._no_lengths("no lengths", "no sample has custom_meta total_lengths")
            return [1] * len(indexes)
        try:
            values = list(sample_lengths(indexes, self.length_field))
        except InvalidArgumentError as exc:
            self._no_lengths("no lengths", f"no sample has custom_meta total_lengths, and {exc}")
            return [1] * len(indexes)
        if len(values) != len(indexes):
            raise InvalidArgumentError(
                f"sample_lengths gave {len(values)} lengths for {len(indexes)} indexes"
            )
        return [check_int(v, "sample length", 0) for v in values]

    def _no_lengths(self, kind: str, why: str) -> None:
        """Log that this batch is split by count: a warning the first time for each kind of
        reason, then at debug level (a training loop would repeat it every step)."""
        warned = self.__dict__.setdefault("_warned", set())
        level = logging.DEBUG if kind in warned else logging.WARNING
        warned.add(kind)
        logger.log(level, "SeqlenBalancedSampler: %s; splitting by count, without balancing lengths", why)

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
        partition: LengthSource | None = None,
        lengths: Mapping[int, int] | None = None,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        """This rank's balanced portion of batch `batch_index`; consumed = the whole batch on first call."""
        batch_size = check_int(batch_size, "batch_size", 0)
        n = self._check_n(n_samples_per_prompt)
        total = batch_size * self.dp_size
        if batch_size % n:
            # Not whole groups per rank: n=4, dp=2, batch_size=6 would serve 8 and 4 tasks.
            raise InvalidArgumentError(
                f"batch_size ({batch_size}, per rank) must be a multiple of n_samples_per_prompt ({n}): "
                "every rank gets whole groups"
            )
        partition_id = _check_str(partition_id, "partition_id")
        task_name = _check_str(task_name, "task_name")
        rank, index = _required_rank_key(dp_rank, batch_index, type(self).__name__)
        if rank >= self.dp_size:
            raise InvalidArgumentError(f"dp_rank {rank} is not in [0, {self.dp_size})")
        if batch_size == 0:
            return [], []
        cached = self._cached(partition_id, task_name, rank, index, batch_size)
        if cached is not None:
            return cached
        selected = self._select(ready_indexes, total // n, partition)
        if selected is None:
            return [], []
        per_sample = self._lengths(selected, partition, lengths)
        if per_sample is None:  # no partition: contiguous runs, as TransferQueue
            portions = [selected[r * batch_size : (r + 1) * batch_size] for r in range(self.dp_size)]
        else:
            group_lengths = [sum(per_sample[g * n : (g + 1) * n]) for g in range(total // n)]
            parts = balanced_group_partitions(group_lengths, self.dp_size)
            portions = [[selected[g * n + j] for g in part for j in range(n)] for part in parts]
        for r, portion in enumerate(portions):
            self._remember(partition_id, task_name, r, index, portion, portion, batch_size)
        return list(portions[rank]), list(selected)
