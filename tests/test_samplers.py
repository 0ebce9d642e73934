"""Samplers: exact scripted streams, validation, checkpoints, the cache bound, and a controller simulation."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distbatch import balance, samplers
from distbatch.samplers import (
    BaseSampler,
    GRPOGroupNSampler,
    RankAwareSampler,
    SeqlenBalancedSampler,
    SequentialSampler,
)

PID, TASK = "p", "t"

# --------------------------------------------------------------------------- helpers


class FakePartition:
    """Stands in for the controller's partition: lengths per index for one field, calls recorded."""

    def __init__(self, lengths: Mapping[int, int], field: str = "input_ids") -> None:
        self.lengths = dict(lengths)
        self.field = field
        self.calls: list[tuple[list[int], str]] = []

    def sample_lengths(self, indexes: Sequence[int], field: str) -> list[int]:
        self.calls.append((list(indexes), field))
        if field != self.field:
            raise ValueError(f"no tensor field {field!r}")
        return [self.lengths[i] for i in indexes]


class Stream:
    """A minimal controller: ready = produced - consumed (per task); feeds samplers keyword args."""

    def __init__(self, sampler: BaseSampler, batch_size: int, lengths: Mapping[int, int] | None = None):
        self.sampler = sampler
        self.batch_size = batch_size
        self.produced: set[int] = set()
        self.consumed: dict[str, set[int]] = {}
        self.partition = FakePartition(lengths or {})

    def ready(self, task: str = TASK) -> list[int]:
        return sorted(self.produced - self.consumed.get(task, set()))

    def call(self, **cfg: Any) -> tuple[list[int], list[int]]:
        task = cfg.pop("task_name", TASK)
        pid = cfg.pop("partition_id", PID)
        ready = self.ready(task)
        # As the controller (and TransferQueue's): a batch's worth ready, or an answer in the cache.
        if len(ready) < self.batch_size and not self.sampler.has_cached_result(pid, task, cfg):
            return [], []
        sampled, consumed = self.sampler(
            ready,
            self.batch_size,
            partition_id=pid,
            task_name=task,
            partition=self.partition,
            **cfg,
        )
        self.consumed.setdefault(task, set()).update(consumed)
        return sampled, consumed

    def run(self, script: Sequence[tuple[Any, ...]]) -> None:
        """Steps: ("produce", idx) | ("clear", idx) | (cfg, sampled, consumed) expected for a call."""
        for step in script:
            if step[0] == "produce":
                self.produced.update(step[1])
            elif step[0] == "clear":  # what Controller.clear_tasks does: forget tasks, drop the cache
                self.produced.difference_update(step[1])
                for seen in self.consumed.values():
                    seen.difference_update(step[1])
                self.sampler.clear_cache(PID)
            else:
                cfg, want_sampled, want_consumed = step
                got = self.call(**cfg)
                assert got == (want_sampled, want_consumed), f"step {step}: got {got}"


def r(i: int) -> list[int]:
    return list(range(i))


def json_safe(value: Any) -> bool:
    """Only str keys, lists, ints and strs (what the state_dict contract promises)."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and json_safe(v) for k, v in value.items())
    if isinstance(value, list):
        return all(json_safe(v) for v in value)
    return isinstance(value, (str, int)) and not isinstance(value, bool)


def roundtrip(sampler: BaseSampler, make: Callable[[], BaseSampler]) -> BaseSampler:
    state = sampler.state_dict()
    assert json_safe(state), state
    fresh = make()
    fresh.load_state_dict(json.loads(json.dumps(state)))
    assert fresh.state_dict() == state
    return fresh


# --------------------------------------------------------------------------- scripted streams

D = dict  # short for sampling configs in the tables

LEN_A = {0: 10, 1: 10, 2: 1, 3: 1, 4: 1, 5: 1, 6: 10, 7: 10}  # groups of 2: [20, 2, 2, 20]
LEN_ODD = dict(enumerate([2, 1, 1, 1, 1, 0, 0, 0, 3, 2, 2, 2]))  # groups of 4: [5, 1, 9]
LEN_C = dict(enumerate([3, 8, 1, 7, 2, 6]))  # groups of 1, three ranks: 9 / 9 / 9

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


# --------------------------------------------------------------------------- invalid input

INVALID_BUILD: list[tuple[str, Callable[[], Any]]] = [
    ("grpo-n-zero", lambda: GRPOGroupNSampler(0)),
    ("grpo-n-negative", lambda: GRPOGroupNSampler(-2)),
    ("grpo-n-float", lambda: GRPOGroupNSampler(2.0)),  # type: ignore[arg-type]
    ("grpo-n-bool", lambda: GRPOGroupNSampler(True)),
    ("grpo-n-str", lambda: GRPOGroupNSampler("2")),  # type: ignore[arg-type]
    ("grpo-bound-zero", lambda: GRPOGroupNSampler(2, max_cached_batches=0)),
    ("rank-bound-zero", lambda: RankAwareSampler(max_cached_batches=0)),
    ("rank-bound-float", lambda: RankAwareSampler(max_cached_batches=1.5)),  # type: ignore[arg-type]
    ("rank-inner-not-sampler", lambda: RankAwareSampler(object())),  # type: ignore[arg-type]
    ("rank-inner-rank-aware", lambda: RankAwareSampler(RankAwareSampler())),
    ("rank-inner-seqlen", lambda: RankAwareSampler(SeqlenBalancedSampler())),
    ("seqlen-dp-zero", lambda: SeqlenBalancedSampler(1, 0)),
    ("seqlen-dp-negative", lambda: SeqlenBalancedSampler(1, -1)),
    ("seqlen-n-zero", lambda: SeqlenBalancedSampler(0, 2)),
    ("seqlen-dp-float", lambda: SeqlenBalancedSampler(1, 2.5)),  # type: ignore[arg-type]
    ("seqlen-field-not-str", lambda: SeqlenBalancedSampler(1, 2, 3)),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("name, build", INVALID_BUILD, ids=[c[0] for c in INVALID_BUILD])
def test_invalid_construction(name: str, build: Callable[[], Any]) -> None:
    with pytest.raises(ValueError):
        build()


RANK = {"dp_rank": 0, "batch_index": 0}
INVALID_CALLS: list[tuple[str, Callable[[], BaseSampler], list[Any], Any, dict[str, Any], str]] = [
    # (id, sampler, ready, batch_size, kwargs, error text)
    ("seq-bs-negative", SequentialSampler, r(4), -1, {}, "batch_size"),
    ("seq-bs-float", SequentialSampler, r(4), 2.0, {}, "batch_size"),
    ("seq-bs-bool", SequentialSampler, r(4), True, {}, "batch_size"),
    ("seq-bs-str", SequentialSampler, r(4), "2", {}, "batch_size"),
    ("seq-bs-none", SequentialSampler, r(4), None, {}, "batch_size"),
    ("grpo-bs-not-multiple", lambda: GRPOGroupNSampler(3), r(9), 4, {}, "multiple"),
    ("grpo-n-conflict", lambda: GRPOGroupNSampler(2), r(4), 2, {"n_samples_per_prompt": 3}, "built with 2"),
    ("grpo-n-invalid-call", lambda: GRPOGroupNSampler(2), r(4), 2, {"n_samples_per_prompt": 0}, "positive"),
    ("grpo-dp-negative", lambda: GRPOGroupNSampler(2), r(4), 2, {"dp_rank": -1, "batch_index": 0}, "dp_rank"),
    ("grpo-dp-only", lambda: GRPOGroupNSampler(2), r(4), 2, {"dp_rank": 0}, "together"),
    ("grpo-bi-only", lambda: GRPOGroupNSampler(2), r(4), 2, {"batch_index": 0}, "together"),
    ("grpo-bi-negative", lambda: GRPOGroupNSampler(2), r(4), 2, {"dp_rank": 0, "batch_index": -1}, "batch"),
    ("grpo-ready-negative", lambda: GRPOGroupNSampler(2), [-2, -1], 2, {}, "non-negative"),
    ("grpo-ready-float", lambda: GRPOGroupNSampler(2), [0.0, 1.0], 2, {}, "non-negative"),
    ("grpo-partition-id-int", lambda: GRPOGroupNSampler(2), r(4), 2, {"partition_id": 3}, "partition_id"),
    ("rank-no-config", RankAwareSampler, r(4), 2, {}, "needs dp_rank"),
    ("rank-no-batch-index", RankAwareSampler, r(4), 2, {"dp_rank": 0}, "together"),
    ("rank-no-dp-rank", RankAwareSampler, r(4), 2, {"batch_index": 0}, "together"),
    ("rank-dp-negative", RankAwareSampler, r(4), 2, {"dp_rank": -1, "batch_index": 0}, "dp_rank"),
    ("rank-dp-str", RankAwareSampler, r(4), 2, {"dp_rank": "0", "batch_index": 0}, "dp_rank"),
    ("rank-dp-bool", RankAwareSampler, r(4), 2, {"dp_rank": False, "batch_index": 0}, "dp_rank"),
    ("rank-bi-float", RankAwareSampler, r(4), 2, {"dp_rank": 0, "batch_index": 0.0}, "batch_index"),
    ("rank-task-not-str", RankAwareSampler, r(4), 2, {**RANK, "task_name": None}, "task_name"),
    ("seqlen-no-rank", lambda: SeqlenBalancedSampler(1, 2), r(4), 1, {"lengths": LEN_A}, "needs dp_rank"),
    (
        "seqlen-rank-too-big",
        lambda: SeqlenBalancedSampler(1, 2),
        r(4),
        1,
        {**RANK, "dp_rank": 2},
        r"\[0, 2\)",
    ),
    (
        "seqlen-rank-negative",
        lambda: SeqlenBalancedSampler(1, 2),
        r(4),
        1,
        {**RANK, "dp_rank": -1},
        "dp_rank",
    ),
    ("seqlen-not-whole-groups", lambda: SeqlenBalancedSampler(4, 2), r(12), 3, RANK, "whole groups"),
    # 2 ranks x 6 = 3 groups of 4 would serve 8 and 4 tasks: refused, not split unevenly.
    ("seqlen-groups-per-rank", lambda: SeqlenBalancedSampler(4, 2), r(12), 6, RANK, "a multiple of"),
    ("seqlen-rank-would-be-empty", lambda: SeqlenBalancedSampler(4, 2), r(12), 2, RANK, "a multiple of"),
    (
        "seqlen-lengths-missing",
        lambda: SeqlenBalancedSampler(1, 2),
        r(4),
        1,
        {**RANK, "lengths": {0: 1}},
        "no entry",
    ),
    (
        "seqlen-lengths-list",
        lambda: SeqlenBalancedSampler(1, 2),
        r(4),
        1,
        {**RANK, "lengths": [1, 1]},
        "mapping",
    ),
    (
        "seqlen-length-negative",
        lambda: SeqlenBalancedSampler(1, 2),
        r(2),
        1,
        {**RANK, "lengths": {0: -1, 1: 1}},
        "greater than or equal to 0",
    ),
    (
        "seqlen-length-float",
        lambda: SeqlenBalancedSampler(1, 2),
        r(2),
        1,
        {**RANK, "lengths": {0: 1.5, 1: 1}},
        "int",
    ),
    (
        "seqlen-n-conflict",
        lambda: SeqlenBalancedSampler(2, 2),
        r(4),
        2,
        {**RANK, "n_samples_per_prompt": 1},
        "built with",
    ),
]


@pytest.mark.parametrize(
    "name, make, ready, batch_size, kwargs, match", INVALID_CALLS, ids=[c[0] for c in INVALID_CALLS]
)
def test_invalid_calls(
    name: str, make: Callable[[], BaseSampler], ready: list[Any], batch_size: Any, kwargs: dict, match: str
) -> None:
    sampler = make()
    before = copy.deepcopy(sampler._states)
    with pytest.raises(ValueError, match=match):
        sampler(ready, batch_size, **kwargs)
    assert sampler._states == before


@pytest.mark.parametrize(
    "config, match",
    [
        ({"dp_rank": -1, "batch_index": 0}, "dp_rank"),
        ({"dp_rank": 0}, "together"),
        ({"dp_rank": 0, "batch_index": "1"}, "batch_index"),
    ],
)
def test_has_cached_result_invalid_config_is_not_cached(config: dict[str, Any], match: str) -> None:
    # As TransferQueue's: never raises (sample() is where the config is refused, with this message).
    sampler = RankAwareSampler()
    sampler.sample(r(4), 2, 0, 0, TASK, PID)
    assert sampler.has_cached_result(PID, TASK, config) is False
    with pytest.raises(ValueError, match=match):
        sampler.sample(r(4), 2, task_name=TASK, partition_id=PID, **config)


# --------------------------------------------------------------------------- no mutation


@pytest.mark.parametrize(
    "make, batch_size",
    [
        (SequentialSampler, 2),
        (lambda: GRPOGroupNSampler(2), 2),
        (RankAwareSampler, 2),
        (lambda: SeqlenBalancedSampler(2, 2), 2),
    ],
)
def test_caller_inputs_are_not_mutated(make: Callable[[], BaseSampler], batch_size: int) -> None:
    sampler = make()
    ready = r(8)
    config = {"dp_rank": 0, "batch_index": 0, "lengths": dict(LEN_A), "extra": {"keep": [1]}}
    kwargs = {"partition_id": PID, "task_name": TASK, **config}
    saved_ready, saved_config, saved_kwargs = list(ready), copy.deepcopy(config), copy.deepcopy(kwargs)
    sampled, consumed = sampler(ready, batch_size, **kwargs)
    sampler.has_cached_result(PID, TASK, config)
    assert (ready, config, kwargs) == (saved_ready, saved_config, saved_kwargs)
    if isinstance(sampler, SequentialSampler):
        return
    # The caller mutating what it got does not reach the cache.
    first = list(sampled)
    sampled.append(99)
    consumed.clear()
    assert sampler([], batch_size, **kwargs)[0] == first


# --------------------------------------------------------------------------- checkpoint


CHECKPOINT_CASES: list[tuple[str, Callable[[], BaseSampler], int, int]] = [
    # (id, sampler, batch_size, group size of production)
    ("rank-aware", RankAwareSampler, 3, 1),
    ("rank-aware-grpo", lambda: RankAwareSampler(GRPOGroupNSampler(2)), 4, 2),
    ("grpo", lambda: GRPOGroupNSampler(3), 6, 3),
    ("seqlen", lambda: SeqlenBalancedSampler(2, 3), 4, 2),
]


def _checkpoint_calls(seed: int, dp: int) -> list[tuple[str, Any]]:
    """A fixed interleaving: produce, dp ranks and TP peers at several batch indexes (with prefetch)."""
    rng = random.Random(seed)
    calls: list[tuple[str, Any]] = []
    for _ in range(80):
        if rng.random() < 0.25:
            calls.append(("produce", rng.randint(1, 3)))
        else:
            calls.append(("call", (rng.randrange(dp), rng.randrange(6))))
    return calls


@pytest.mark.parametrize("name, make, batch_size, n", CHECKPOINT_CASES, ids=[c[0] for c in CHECKPOINT_CASES])
def test_state_dict_json_roundtrip_mid_stream(
    name: str, make: Callable[[], BaseSampler], batch_size: int, n: int
) -> None:
    dp = 3
    calls = _checkpoint_calls(7, dp)
    lengths = {i: (i * 37) % 11 + 1 for i in range(400)}

    def play(stream: Stream, steps: list[tuple[str, Any]], next_index: list[int]) -> list[Any]:
        out = []
        for kind, arg in steps:
            if kind == "produce":
                stream.produced.update(range(next_index[0], next_index[0] + arg * n))
                next_index[0] += arg * n
            else:
                out.append(stream.call(dp_rank=arg[0], batch_index=arg[1]))
        return out

    reference = Stream(make(), batch_size, lengths)
    ref_next = [0]
    play(reference, calls[:40], ref_next)
    assert reference.sampler._states, "the checkpoint should hold a non-empty cache"

    resumed = Stream(roundtrip(reference.sampler, make), batch_size, lengths)
    resumed.produced, resumed.consumed = set(reference.produced), copy.deepcopy(reference.consumed)
    res_next = list(ref_next)

    assert play(resumed, calls[40:], res_next) == play(reference, calls[40:], ref_next)
    assert resumed.sampler.state_dict() == reference.sampler.state_dict()


def test_state_dict_format_and_empty_load() -> None:
    sampler = SeqlenBalancedSampler(1, 2)
    sampler(r(2), 1, partition_id=PID, task_name=TASK, dp_rank=1, batch_index=5, lengths={0: 1, 1: 2})
    assert sampler.state_dict() == {
        "version": 1,
        "config": {"n_samples_per_prompt": 1, "dp_size": 2},
        "cache": [[PID, TASK, 0, 5, [1], [1]], [PID, TASK, 1, 5, [0], [0]]],
    }
    sampler.load_state_dict({})
    assert sampler._states == {}


def test_rank_aware_state_includes_inner() -> None:
    sampler = RankAwareSampler(GRPOGroupNSampler(2))
    sampler(r(4), 2, dp_rank=0, batch_index=0)
    state = sampler.state_dict()
    assert state["inner"] == {"version": 1, "config": {"n_samples_per_prompt": 2}, "cache": []}
    with pytest.raises(ValueError, match="saved with"):
        RankAwareSampler(GRPOGroupNSampler(3)).load_state_dict(state)


GOOD_ROW = [PID, TASK, 0, 0, [0, 1], [0, 1]]
BAD_STATES: list[tuple[str, Callable[[], BaseSampler], Any]] = [
    ("not-mapping", RankAwareSampler, [GOOD_ROW]),
    ("version", RankAwareSampler, {"version": 2, "cache": []}),
    ("cache-not-list", RankAwareSampler, {"version": 1, "cache": {}}),
    ("row-short", RankAwareSampler, {"cache": [GOOD_ROW[:5]]}),
    ("row-rank-negative", RankAwareSampler, {"cache": [[PID, TASK, -1, 0, [0], [0]]]}),
    ("row-rank-str", RankAwareSampler, {"cache": [[PID, TASK, "0", 0, [0], [0]]]}),
    ("row-pid-int", RankAwareSampler, {"cache": [[1, TASK, 0, 0, [0], [0]]]}),
    ("row-sampled-not-list", RankAwareSampler, {"cache": [[PID, TASK, 0, 0, 5, [0]]]}),
    ("row-sampled-str", RankAwareSampler, {"cache": [[PID, TASK, 0, 0, "01", [0]]]}),
    ("row-index-float", RankAwareSampler, {"cache": [[PID, TASK, 0, 0, [0.5], [0]]]}),
    ("row-duplicate", RankAwareSampler, {"cache": [GOOD_ROW, GOOD_ROW]}),
    (
        "config-mismatch",
        lambda: SeqlenBalancedSampler(2, 2),
        {"config": {"n_samples_per_prompt": 2, "dp_size": 4}},
    ),
    ("config-not-mapping", lambda: GRPOGroupNSampler(2), {"config": [1, 2]}),
    ("inner-invalid", RankAwareSampler, {"cache": [], "inner": {"version": 9}}),
]


@pytest.mark.parametrize("name, make, state", BAD_STATES, ids=[c[0] for c in BAD_STATES])
def test_load_state_dict_rejects_and_keeps_state(
    name: str, make: Callable[[], BaseSampler], state: Any
) -> None:
    sampler = make()
    kwargs = {"lengths": LEN_A} if isinstance(sampler, SeqlenBalancedSampler) else {}
    sampler(r(8), 2, partition_id=PID, task_name=TASK, dp_rank=1, batch_index=3, **kwargs)
    before = sampler.state_dict()
    with pytest.raises(ValueError):
        sampler.load_state_dict(state)
    assert sampler.state_dict() == before


# --------------------------------------------------------------------------- cache bound


def test_rank_aware_cache_bound_evicts_oldest_per_rank() -> None:
    sampler = RankAwareSampler(max_cached_batches=3)
    stream = Stream(sampler, 1)
    stream.produced.update(r(100))
    for bi in [4, 0, 1, 2]:  # insertion order, not batch index order, decides the oldest
        stream.call(dp_rank=0, batch_index=bi)
    stream.call(dp_rank=1, batch_index=0)
    assert list(sampler._states[PID][TASK][0]) == [0, 1, 2]
    assert list(sampler._states[PID][TASK][1]) == [0]
    assert not sampler.has_cached_result(PID, TASK, {"dp_rank": 0, "batch_index": 4})
    # A peer lagging past the bound gets a fresh batch (documented), not the evicted one.
    assert stream.call(dp_rank=0, batch_index=4) == ([5], [5])
    assert list(sampler._states[PID][TASK][0]) == [1, 2, 4]


def test_default_cache_bound_is_4096() -> None:
    sampler = RankAwareSampler()
    assert sampler.max_cached_batches == samplers.DEFAULT_MAX_CACHED_BATCHES == 4096
    ready = r(5000)
    for bi in range(4100):
        sampler(ready, 1, partition_id=PID, task_name=TASK, dp_rank=0, batch_index=bi)
    batches = sampler._states[PID][TASK][0]
    assert len(batches) == 4096 and next(iter(batches)) == 4


def test_seqlen_cache_bound_evicts_a_batch_for_all_ranks_together() -> None:
    sampler = SeqlenBalancedSampler(1, 2, max_cached_batches=2)
    stream = Stream(sampler, 1, {i: 1 for i in range(20)})
    stream.produced.update(r(20))
    for bi in range(3):
        stream.call(dp_rank=bi % 2, batch_index=bi)
    ranks = sampler._states[PID][TASK]
    assert list(ranks[0]) == list(ranks[1]) == [1, 2]


def test_load_state_dict_trims_to_bound() -> None:
    rows = [[PID, TASK, 0, bi, [bi], [bi]] for bi in range(5)]
    sampler = RankAwareSampler(max_cached_batches=2)
    sampler.load_state_dict({"version": 1, "config": {}, "cache": rows, "inner": {}})
    assert list(sampler._states[PID][TASK][0]) == [3, 4]


# --------------------------------------------------------------------------- controller simulation


def _make(kind: str, n: int, dp: int, rng: random.Random) -> tuple[Callable[[], BaseSampler], int]:
    """A sampler factory and a per-rank batch size for one simulated run."""
    if kind == "rank_aware":
        return (lambda: RankAwareSampler()), rng.randint(1, 4)
    if kind == "rank_aware_grpo":
        return (lambda: RankAwareSampler(GRPOGroupNSampler(n))), n * rng.randint(1, 2)
    if kind == "grpo":
        return (lambda: GRPOGroupNSampler(n)), n * rng.randint(1, 2)
    return (lambda: SeqlenBalancedSampler(n, dp)), n * rng.randint(1, 3)


def simulate(kind: str, seed: int, dp: int, tp: int, n: int, steps: int) -> None:
    """A long run of one partition and task: producers put whole groups, samples finish out of
    order, dp x tp peers ask in random interleavings (prefetching up to 2 batches ahead), and the
    sampler is sometimes checkpointed through JSON and restored. Checks the invariants."""
    rng = random.Random(seed)
    make, batch_size = _make(kind, n, dp, rng)
    sampler = make()
    grouped = kind != "rank_aware"
    partition = FakePartition({})
    lengths = partition.lengths
    pending: list[int] = []
    produced: set[int] = set()
    consumed: set[int] = set()
    next_index = 0
    peers = [(rank, peer) for rank in range(dp) for peer in range(tp)]
    received: dict[tuple[int, int], set[int]] = {p: set() for p in peers}
    results: dict[tuple[int, int], list[int]] = {}

    for _ in range(steps):
        action = rng.random()
        if action < 0.25:  # a put of k whole groups, on a block aligned to its size
            size = rng.randint(1, 3) * n
            start = -(-next_index // size) * size
            next_index = start + size
            for i in range(start, start + size):
                lengths[i] = rng.randint(1, 50)
            pending.extend(range(start, start + size))
        elif action < 0.45 and pending:  # some samples finish (in any order)
            rng.shuffle(pending)
            cut = rng.randint(1, len(pending))
            produced.update(pending[:cut])
            del pending[:cut]
        elif action < 0.48:
            sampler = roundtrip(sampler, make)
        else:
            rank, peer = rng.choice(peers)
            first_missing = min(set(range(len(received[(rank, peer)]) + 1)) - received[(rank, peer)])
            window = [b for b in range(first_missing, first_missing + 3) if b not in received[(rank, peer)]]
            bi = rng.choice(window)
            cached = sampler.has_cached_result(PID, TASK, {"dp_rank": rank, "batch_index": bi})
            ready = sorted(produced - consumed)
            sampled, newly = sampler(
                ready,
                batch_size,
                partition_id=PID,
                task_name=TASK,
                partition=partition,
                dp_rank=rank,
                batch_index=bi,
            )
            if not sampled:
                assert newly == [] and not cached
                continue
            assert set(newly) <= produced, "consumed something never produced"
            consumed.update(newly)
            assert set(sampled) <= consumed, "handed out something not marked consumed"
            key = (rank, bi)
            if key in results:
                assert cached and sampled == results[key], "TP peers of one rank got different samples"
            else:
                # Only SeqlenBalancedSampler caches a rank's portion before that rank asks.
                assert not cached or (kind == "seqlen" and newly == sampled)
                results[key] = sampled
            received[(rank, peer)].add(bi)
            if grouped:
                assert len(sampled) % n == 0
                for g in range(0, len(sampled), n):
                    assert sampled[g : g + n] == list(range(sampled[g], sampled[g] + n))
                    assert sampled[g] % n == 0, "a group must sit on an aligned block"
            if kind != "seqlen":
                assert len(sampled) == batch_size

    # Every (rank, batch) got samples disjoint from every other (rank, batch).
    everything = [i for batch in results.values() for i in batch]
    assert len(everything) == len(set(everything))
    if kind == "seqlen":
        by_batch: dict[int, list[list[int]]] = {}
        for (_, bi), batch in results.items():
            by_batch.setdefault(bi, []).append(batch)
        for portions in by_batch.values():
            if len(portions) == dp:
                assert sum(len(p) for p in portions) == batch_size * dp
                group_counts = [len(p) // n for p in portions]
                assert max(group_counts) - min(group_counts) <= 1


@pytest.mark.parametrize("kind", ["rank_aware", "rank_aware_grpo", "grpo", "seqlen"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    dp=st.integers(1, 4),
    tp=st.integers(1, 3),
    n=st.sampled_from([1, 2, 3, 4]),
)
def test_controller_simulation_property(kind: str, seed: int, dp: int, tp: int, n: int) -> None:
    simulate(kind, seed, dp, tp, n, steps=300)


def test_controller_simulation_long_run() -> None:
    for kind in ["rank_aware", "grpo", "seqlen"]:
        simulate(kind, seed=2024, dp=4, tp=3, n=4, steps=1500)


# --------------------------------------------------------------------------- with the real controller


def test_seqlen_sampler_through_controller() -> None:
    """Lengths come from the controller's metadata (shapes); no worker is contacted."""
    from distbatch.batch import DistributedBatchMemory
    from distbatch.batch.meta import BatchMeta, FieldMeta
    from distbatch.controller import Controller

    controller = Controller(SeqlenBalancedSampler(n_samples_per_prompt=2, dp_size=2))
    ids = [f"s{i}" for i in range(8)]
    shapes = [(LEN_A[i],) for i in range(8)]
    meta = BatchMeta(ids, ["127.0.0.1:1"], {"input_ids": FieldMeta("I64", [0] * 8, shapes)})
    controller.put("p", DistributedBatchMemory.from_meta(meta))

    def get(dp_rank: int, batch_index: int) -> list[str]:
        batch = controller.get_meta("p", "train", ["input_ids"], 4, dp_rank=dp_rank, batch_index=batch_index)
        return list(batch.task_ids) if len(batch) else []

    assert get(1, 0) == ["s0", "s1", "s4", "s5"]
    assert controller.consumption_status("p", "train") == {"tasks": 8, "consumed": 8}
    assert get(0, 0) == ["s2", "s3", "s6", "s7"]
    assert get(1, 0) == ["s0", "s1", "s4", "s5"]
    assert get(0, 1) == []


# --------------------------------------------------------------------------- forgetting cleared indexes


def test_forget_indexes_drops_only_entries_that_hand_out_cleared_samples() -> None:
    sampler = SeqlenBalancedSampler(n_samples_per_prompt=2, dp_size=2)
    lengths = {i: 10 * (i + 1) for i in range(8)}
    first, consumed = sampler.sample(
        list(range(8)), 2, partition_id="p", task_name="t", dp_rank=0, batch_index=0, lengths=lengths
    )
    assert sorted(consumed) == [0, 1, 2, 3]
    rank1 = sorted(set(consumed) - set(first))
    # Rank 0 trained on its portion and cleared it; rank 1 has not fetched yet.
    sampler.forget_indexes("p", first)
    assert not sampler.has_cached_result("p", "t", {"dp_rank": 0, "batch_index": 0})
    assert sampler.has_cached_result("p", "t", {"dp_rank": 1, "batch_index": 0})
    late, _ = sampler.sample([4, 5, 6, 7], 2, partition_id="p", task_name="t", dp_rank=1, batch_index=0)
    assert sorted(late) == rank1  # still delivered: the partial clear lost nothing


def test_rank_aware_forget_indexes_reaches_the_wrapped_sampler() -> None:
    sampler = RankAwareSampler(GRPOGroupNSampler(2))
    got, _ = sampler.sample([0, 1, 2, 3], 2, dp_rank=0, batch_index=0, task_name="t", partition_id="p")
    sampler.forget_indexes("p", got)
    assert not sampler.has_cached_result("p", "t", {"dp_rank": 0, "batch_index": 0})
    # The index is reused by a new task: a late peer must not get a stale answer.
    again, _ = sampler.sample([2, 3], 2, dp_rank=0, batch_index=0, task_name="t", partition_id="p")
    assert again == [2, 3]


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
            raise samplers.InvalidArgumentError(f"partition has no tensor field {field!r} for lengths")
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
