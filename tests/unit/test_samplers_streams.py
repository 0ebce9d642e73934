"""Samplers over scripted streams: which tasks each rank and consumer gets as samples arrive, batch by
batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sampler_support import LEN_A, LEN_C, LEN_ODD, PID, TASK, FakePartition, Stream, r

from distbatch import samplers
from distbatch.batch import balance
from distbatch.samplers import (
    BaseSampler,
    GRPOGroupNSampler,
    RankAwareSampler,
    SeqlenBalancedSampler,
    SequentialSampler,
)

# --------------------------------------------------------------------------- scripted streams

D = dict  # short for sampling configs in the tables


SCRIPTS: list[tuple[str, Callable[[], BaseSampler], int, dict[int, int] | None, list[tuple[Any, ...]]]] = [
    # ---- SequentialSampler
    (
        "sequential-in-order-then-too-few",
        SequentialSampler,
        4,
        None,
        [("produce", r(6)), (D(), [0, 1, 2, 3], [0, 1, 2, 3]), (D(), [], []), ("produce", [6, 7])]
        + [(D(), [4, 5, 6, 7], [4, 5, 6, 7]), (D(), [], [])],
    ),
    (
        "sequential-ignores-rank-config",
        SequentialSampler,
        2,
        None,
        [("produce", r(4)), (D(dp_rank=0, batch_index=0), [0, 1], [0, 1])]
        + [(D(dp_rank=0, batch_index=0), [2, 3], [2, 3])],
    ),
    # ---- GRPOGroupNSampler
    (
        "grpo-aligned-groups-only",
        lambda: GRPOGroupNSampler(3),
        6,
        None,
        # groups: 0={0,1,2} 1={3,4,5} 2={6,7,8} 3={9,10,11}; only 1 and 3 complete
        [("produce", [0, 1, 3, 4, 5, 6, 7, 9, 10, 11]), (D(), [3, 4, 5, 9, 10, 11], [3, 4, 5, 9, 10, 11])]
        + [(D(), [], []), ("produce", [2, 8]), (D(), r(3) + [6, 7, 8], r(3) + [6, 7, 8])],
    ),
    (
        "grpo-unaligned-run-is-not-a-group",
        lambda: GRPOGroupNSampler(3),
        3,
        None,
        # 1,2,3 are consecutive but straddle groups 0 and 1
        [("produce", [1, 2, 3, 4, 5, 7]), (D(), [3, 4, 5], [3, 4, 5]), (D(), [], [])],
    ),
    (
        "grpo-too-few-groups",
        lambda: GRPOGroupNSampler(2),
        4,
        None,
        [("produce", [0, 1, 2]), (D(), [], []), ("produce", [3]), (D(), [0, 1, 2, 3], [0, 1, 2, 3])],
    ),
    (
        "grpo-rank-aware-dp1-first-and-tp-peers",
        lambda: GRPOGroupNSampler(2),
        4,
        None,
        [("produce", r(12))]
        + [(D(dp_rank=1, batch_index=0), [0, 1, 2, 3], [0, 1, 2, 3])]
        + [(D(dp_rank=0, batch_index=0), [4, 5, 6, 7], [4, 5, 6, 7])]
        + [(D(dp_rank=1, batch_index=0), [0, 1, 2, 3], [0, 1, 2, 3])]  # TP peer of dp1
        + [(D(dp_rank=0, batch_index=1), [8, 9, 10, 11], [8, 9, 10, 11])]  # prefetch
        + [(D(dp_rank=0, batch_index=0), [4, 5, 6, 7], [4, 5, 6, 7])]  # late TP peer of dp0
        + [(D(dp_rank=1, batch_index=1), [], [])],  # nothing left, nothing cached
    ),
    (
        "grpo-clear-and-index-reuse",
        lambda: GRPOGroupNSampler(2),
        2,
        None,
        [("produce", r(6))]
        + [(D(dp_rank=0, batch_index=0), [0, 1], [0, 1]), (D(dp_rank=1, batch_index=0), [2, 3], [2, 3])]
        + [("clear", r(6)), ("produce", r(4))]  # a new step reuses indexes 0..3
        + [(D(dp_rank=1, batch_index=0), [0, 1], [0, 1])]  # fresh, not the stale [2, 3]
        + [(D(dp_rank=0, batch_index=0), [2, 3], [2, 3]), (D(dp_rank=1, batch_index=0), [0, 1], [0, 1])],
    ),
    (
        "grpo-task-and-partition-separate",
        lambda: GRPOGroupNSampler(2),
        2,
        None,
        [("produce", r(4))]
        + [(D(dp_rank=0, batch_index=0), [0, 1], [0, 1])]
        + [(D(dp_rank=0, batch_index=0, task_name="other"), [0, 1], [0, 1])]
        + [(D(dp_rank=0, batch_index=0, partition_id="q"), [2, 3], [2, 3])],
    ),
    # ---- RankAwareSampler
    (
        "rank-aware-dp1-before-dp0-tp-peers-any-order",
        RankAwareSampler,
        2,
        None,
        [("produce", r(8))]
        + [(D(dp_rank=1, batch_index=0), [0, 1], [0, 1])]
        + [(D(dp_rank=0, batch_index=0), [2, 3], [2, 3])]
        + [(D(dp_rank=0, batch_index=0), [2, 3], [2, 3])]
        + [(D(dp_rank=1, batch_index=0), [0, 1], [0, 1])]
        + [(D(dp_rank=1, batch_index=1), [4, 5], [4, 5])],
    ),
    (
        "rank-aware-prefetch-ahead",
        RankAwareSampler,
        2,
        None,
        [("produce", r(6))]
        + [(D(dp_rank=0, batch_index=1), [0, 1], [0, 1])]  # peer A prefetches batch 1 first
        + [(D(dp_rank=0, batch_index=0), [2, 3], [2, 3])]
        + [(D(dp_rank=1, batch_index=0), [4, 5], [4, 5])]
        + [(D(dp_rank=0, batch_index=0), [2, 3], [2, 3])]  # peer B, in order
        + [(D(dp_rank=0, batch_index=1), [0, 1], [0, 1])],
    ),
    (
        "rank-aware-too-few-is-not-cached",
        RankAwareSampler,
        3,
        None,
        [("produce", [0, 1]), (D(dp_rank=0, batch_index=0), [], []), ("produce", [2])]
        + [(D(dp_rank=0, batch_index=0), [0, 1, 2], [0, 1, 2])],
    ),
    (
        "rank-aware-wraps-grpo",
        lambda: RankAwareSampler(GRPOGroupNSampler(2)),
        2,
        None,
        [("produce", [1, 2, 3, 4, 5])]
        + [(D(dp_rank=0, batch_index=0), [2, 3], [2, 3]), (D(dp_rank=1, batch_index=0), [4, 5], [4, 5])]
        + [(D(dp_rank=0, batch_index=0), [2, 3], [2, 3])],
    ),
    (
        "rank-aware-clear-and-index-reuse",
        RankAwareSampler,
        2,
        None,
        [("produce", r(4)), (D(dp_rank=0, batch_index=0), [0, 1], [0, 1])]
        + [(D(dp_rank=1, batch_index=0), [2, 3], [2, 3])]
        + [("clear", r(4)), ("produce", r(2))]
        + [(D(dp_rank=1, batch_index=0), [0, 1], [0, 1]), (D(dp_rank=0, batch_index=0), [], [])],
    ),
    # ---- SeqlenBalancedSampler
    (
        "seqlen-dp1-first-gets-its-portion-and-consumes-all",
        lambda: SeqlenBalancedSampler(2, 2),
        4,
        LEN_A,
        [("produce", r(8))]
        + [(D(dp_rank=1, batch_index=0), [0, 1, 4, 5], r(8))]
        + [(D(dp_rank=0, batch_index=0), [2, 3, 6, 7], [2, 3, 6, 7])]
        + [(D(dp_rank=1, batch_index=0), [0, 1, 4, 5], [0, 1, 4, 5])]  # TP peer of dp1
        + [(D(dp_rank=0, batch_index=1), [], [])],
    ),
    (
        "seqlen-groups-of-4-two-ranks",
        lambda: SeqlenBalancedSampler(4, 2),
        4,  # 2 ranks x 4 = 8 samples = 2 groups of 4: one group per rank
        LEN_ODD,
        [("produce", r(12))]
        + [(D(dp_rank=0, batch_index=0), [0, 1, 2, 3], r(8))]
        + [(D(dp_rank=1, batch_index=0), [4, 5, 6, 7], [4, 5, 6, 7])],
    ),
    (
        "seqlen-three-ranks",
        lambda: SeqlenBalancedSampler(1, 3),
        2,
        LEN_C,
        [("produce", r(6))]
        + [(D(dp_rank=2, batch_index=0), [1, 2], r(6))]
        + [(D(dp_rank=0, batch_index=0), [0, 5], [0, 5]), (D(dp_rank=1, batch_index=0), [3, 4], [3, 4])],
    ),
    (
        "seqlen-prefetch-and-too-few",
        lambda: SeqlenBalancedSampler(2, 2),
        2,
        LEN_A,
        [("produce", [0, 1, 2, 3, 4, 6, 7])]  # group {4,5} incomplete
        + [(D(dp_rank=0, batch_index=1), [0, 1], [0, 1, 2, 3])]  # prefetch batch 1 first
        + [(D(dp_rank=1, batch_index=0), [], [])]  # one complete group left, two needed
        + [("produce", [5]), (D(dp_rank=1, batch_index=0), [4, 5], [4, 5, 6, 7])]
        + [(D(dp_rank=1, batch_index=1), [2, 3], [2, 3]), (D(dp_rank=0, batch_index=0), [6, 7], [6, 7])],
    ),
    (
        "seqlen-clear-and-index-reuse",
        lambda: SeqlenBalancedSampler(1, 2),
        1,
        LEN_A,
        [("produce", r(4)), (D(dp_rank=0, batch_index=0), [1], [0, 1])]
        + [("clear", r(4)), ("produce", [2, 3])]
        + [(D(dp_rank=1, batch_index=0), [2], [2, 3]), (D(dp_rank=0, batch_index=0), [3], [3])],
    ),
]


@pytest.mark.parametrize("name, make, batch_size, lengths, script", SCRIPTS, ids=[s[0] for s in SCRIPTS])
def test_scripted_stream(
    name: str,
    make: Callable[[], BaseSampler],
    batch_size: int,
    lengths: dict[int, int] | None,
    script: list[tuple[Any, ...]],
) -> None:
    Stream(make(), batch_size, lengths).run(script)


def test_grpo_without_rank_caches_nothing() -> None:
    sampler = GRPOGroupNSampler(2)
    assert sampler(r(4), 2, partition_id=PID, task_name=TASK) == ([0, 1], [0, 1])
    assert sampler(r(4), 2, partition_id=PID, task_name=TASK) == ([0, 1], [0, 1])
    assert sampler._states == {}
    assert sampler.state_dict()["cache"] == []


def test_grpo_accepts_matching_per_call_n() -> None:
    assert GRPOGroupNSampler(2)(r(4), 4, n_samples_per_prompt=2) == (r(4), r(4))


def test_rank_aware_positional_order_matches_transferqueue() -> None:
    sampler = RankAwareSampler()
    # (ready_indexes, batch_size, dp_rank, batch_index, task_name, partition_id)
    assert sampler.sample(r(4), 2, 0, 0, TASK, PID) == ([0, 1], [0, 1])
    assert sampler.sample([2, 3], 2, 0, 0, TASK, PID) == ([0, 1], [0, 1])
    assert sampler._states == {PID: {TASK: {0: {0: [0, 1]}}}}  # their layout: the sampled list


def test_seqlen_lengths_from_partition_for_selected_only() -> None:
    sampler = SeqlenBalancedSampler(2, 2, length_field="response")
    part = FakePartition(LEN_A, field="response")
    got = sampler(r(10), 2, partition_id=PID, task_name=TASK, partition=part, dp_rank=0, batch_index=0)
    assert got == ([0, 1], [0, 1, 2, 3])
    assert part.calls == [([0, 1, 2, 3], "response")]


def test_seqlen_lengths_mapping_wins_over_partition() -> None:
    sampler = SeqlenBalancedSampler(1, 2)
    part = FakePartition({0: 1, 1: 1})
    got = sampler(r(2), 1, dp_rank=0, batch_index=0, partition=part, lengths={0: 5, 1: 7})
    assert got == ([1], [0, 1])  # with the partition's equal lengths rank 0 would get [0]
    assert part.calls == []


def test_seqlen_partition_error_propagates() -> None:
    sampler = SeqlenBalancedSampler(1, 2, length_field="missing")
    with pytest.raises(ValueError, match="no tensor field"):
        sampler(r(2), 1, dp_rank=0, batch_index=0, partition=FakePartition({0: 1, 1: 1}))


def test_seqlen_is_a_grpo_sampler() -> None:
    sampler = SeqlenBalancedSampler()
    assert isinstance(sampler, GRPOGroupNSampler) and isinstance(sampler, BaseSampler)
    assert (sampler.n_samples_per_prompt, sampler.dp_size, sampler.length_field) == (1, 1, "input_ids")


def test_has_cached_result() -> None:
    sampler = RankAwareSampler()
    assert not sampler.has_cached_result(PID, TASK, {"dp_rank": 0, "batch_index": 0})
    sampler(r(4), 2, partition_id=PID, task_name=TASK, dp_rank=0, batch_index=0)
    assert sampler.has_cached_result(PID, TASK, {"dp_rank": 0, "batch_index": 0})
    assert not sampler.has_cached_result(PID, TASK, {"dp_rank": 1, "batch_index": 0})
    assert not sampler.has_cached_result(PID, "other", {"dp_rank": 0, "batch_index": 0})
    assert not sampler.has_cached_result(PID, TASK, {})
    assert not sampler.has_cached_result(PID, TASK, None)
    sampler.clear_cache(PID)
    assert not sampler.has_cached_result(PID, TASK, {"dp_rank": 0, "batch_index": 0})
    sampler.clear_cache("never-seen")  # no error


def test_seqlen_caches_every_rank_on_first_call() -> None:
    sampler = SeqlenBalancedSampler(1, 3)
    sampler(r(6), 2, partition_id=PID, task_name=TASK, dp_rank=1, batch_index=4, lengths=LEN_C)
    for rank in range(3):
        assert sampler.has_cached_result(PID, TASK, {"dp_rank": rank, "batch_index": 4})
    assert not sampler.has_cached_result(PID, TASK, {"dp_rank": 0, "batch_index": 3})


def test_reexports_balance_functions() -> None:
    assert samplers.karmarkar_karp is balance.karmarkar_karp
    assert samplers.get_seqlen_balanced_partitions is balance.get_seqlen_balanced_partitions
    for name in ["BaseSampler", "SequentialSampler", "GRPOGroupNSampler", "RankAwareSampler"]:
        assert name in samplers.__all__
    assert {"SeqlenBalancedSampler", "karmarkar_karp", "get_seqlen_balanced_partitions"} <= set(
        samplers.__all__
    )


def test_base_sampler_is_abstract_and_call_delegates() -> None:
    with pytest.raises(TypeError):
        BaseSampler()  # type: ignore[abstract]

    class Custom(BaseSampler):  # a TransferQueue-style custom sampler, ported by import only
        def sample(self, ready_indexes, batch_size, *args, **kwargs):  # type: ignore[no-untyped-def]
            picked = list(reversed(ready_indexes))[:batch_size]
            return picked, picked

    custom = Custom()
    assert custom(r(5), 2, partition_id=PID, task_name=TASK, partition=None) == ([4, 3], [4, 3])
    assert custom._states == {}
    assert custom.state_dict() == {"version": 1, "config": {}, "cache": []}
    assert RankAwareSampler(custom)(r(5), 2, dp_rank=0, batch_index=0) == ([4, 3], [4, 3])


def test_nonstandard_states_layout_is_a_clear_error() -> None:
    sampler = SequentialSampler()
    sampler._states["p"] = {"t": {0: {0: "not a pair"}}}  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="override state_dict"):
        sampler.state_dict()


