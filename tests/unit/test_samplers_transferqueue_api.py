"""The sampler interface TransferQueue users port code against: names, signatures, defaults and call forms."""

from __future__ import annotations

import copy
import random
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from sampler_support import PID, TASK, r

from distbatch import errors
from distbatch.samplers import (
    GRPOGroupNSampler,
    RankAwareSampler,
    SeqlenBalancedSampler,
    SequentialSampler,
)

# --------------------------------------------------------------------------- TransferQueue compatibility


class MetaPartition:
    """A partition as TransferQueue's controller passes it: ``get_custom_meta`` only."""

    def __init__(self, meta: Mapping[int, dict]) -> None:
        self.meta = dict(meta)

    def get_custom_meta(self, indexes: Sequence[int]) -> dict[int, dict]:
        return {i: self.meta[i] for i in indexes if i in self.meta}


class StoredLengths(MetaPartition):
    """Our controller's partition: custom_meta and stored lengths (a missing field is refused)."""

    def sample_lengths(self, indexes: Sequence[int], field: str) -> list[int]:
        if field != "input_ids":
            raise errors.InvalidArgumentError(f"partition has no tensor field {field!r} for lengths")
        return [10 * (i + 1) for i in indexes]


def test_seqlen_custom_meta_wins_over_stored_lengths_and_missing_counts_one() -> None:
    part = StoredLengths({0: {"total_lengths": 100}, 1: {"total_lengths": 100}, 2: {"other": 1}})
    got = SeqlenBalancedSampler(1, 2)(r(4), 2, dp_rank=0, batch_index=0, partition=part)
    # custom_meta weights 100, 100, 1, 1 (stored lengths 10..40 would pair 0 with 3): one long per rank
    assert len(set(got[0]) & {0, 1}) == 1
    assert sorted(got[1]) == r(4)


def test_seqlen_without_lengths_splits_by_count_and_warns_once_per_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sampler = SeqlenBalancedSampler(1, 2, length_field="response")
    with caplog.at_level("WARNING", logger="distbatch.samplers"):
        # No partition: contiguous runs, rank r gets the r-th.
        assert sampler(r(4), 2, dp_rank=1, batch_index=0) == ([2, 3], r(4))
        assert sampler(r(8)[4:], 2, dp_rank=0, batch_index=1)[0] == [4, 5]
        # A partition without lengths for the field: every sample weighs 1 (still whole, equal counts).
        got, consumed = sampler(r(12)[8:], 2, dp_rank=0, batch_index=2, partition=StoredLengths({}))
        assert len(got) == 2 and sorted(consumed) == [8, 9, 10, 11]
        sampler(r(16)[12:], 2, dp_rank=0, batch_index=3, partition=StoredLengths({}))
    warnings = [rec.getMessage() for rec in caplog.records if rec.levelname == "WARNING"]
    assert len(warnings) == 2, warnings
    assert "no partition= was given" in warnings[0] and "no tensor field 'response'" in warnings[1]


def test_load_transferqueue_checkpoint_and_refuse_unknown_layouts() -> None:
    # What TransferQueue's save_checkpoint() returns: bare lists (rank-aware) and pairs (group samplers).
    theirs = {"_states": {PID: {TASK: {0: {0: [0, 1]}, 1: {0: ([2, 3], [2, 3])}}}}, "_balanced_cache": {}}
    sampler = RankAwareSampler()
    sampler.load_checkpoint(theirs)
    assert sampler.sample([], 2, 0, 0, TASK, PID) == ([0, 1], [0, 1])
    assert sampler.sample([], 2, 1, 0, TASK, PID) == ([2, 3], [2, 3])
    before = copy.deepcopy(sampler._states)
    for bad in ({"cache": [], "caches": []}, {"version": 1}, {"_states": {PID: 5}}):
        with pytest.raises(ValueError):
            sampler.load_checkpoint(bad)
        assert sampler._states == before  # refused whole, nothing changed
    sampler.load_state_dict({})  # the one way to empty it
    assert sampler._states == {}


def test_forget_indexes_drops_cleared_samples_from_a_siblings_consumed() -> None:
    sampler = SeqlenBalancedSampler(1, 2)
    portion0, consumed = sampler(r(4), 2, dp_rank=0, batch_index=0, lengths={i: 1 for i in range(4)})
    portion1 = sorted(set(consumed) - set(portion0))
    sampler.forget_indexes(PID, portion1[:1])  # a sample of rank 1's portion was cleared
    assert not sampler.has_cached_result(PID, TASK, {"dp_rank": 1, "batch_index": 0})
    sampled, consumed = sampler([], 2, dp_rank=0, batch_index=0)  # rank 0's TP peer: same batch
    assert sampled == portion0 and portion1[0] not in consumed  # a reused index is not re-consumed


def test_check_call_refuses_bad_arguments_without_sampling() -> None:
    inner = GRPOGroupNSampler(2)
    sampler = RankAwareSampler(inner)
    with pytest.raises(ValueError, match="a multiple of n_samples_per_prompt"):
        sampler.check_call(3, dp_rank=0, batch_index=0, partition_id=PID, task_name=TASK)
    with pytest.raises(ValueError, match="needs dp_rank"):
        sampler.check_call(2, partition_id=PID, task_name=TASK)
    sampler.check_call(2, dp_rank=0, batch_index=0, partition_id=PID, task_name=TASK)
    assert sampler._states == {} and inner._states == {}

    class Drawing(SequentialSampler):  # a ported sampler: sample() may have side effects
        def sample(
            self, ready_indexes: Sequence[int], batch_size: int, *a: Any, **k: Any
        ) -> tuple[list, list]:
            picked = random.sample(list(ready_indexes), batch_size)  # raises when too few
            return picked, picked

    Drawing().check_call(5)  # not probed: nothing raised
