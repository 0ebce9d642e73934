"""Samplers refuse bad arguments with clear errors and never change what they were given."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from sampler_support import LEN_A, PID, TASK, r

from distbatch.samplers import (
    BaseSampler,
    GRPOGroupNSampler,
    RankAwareSampler,
    SeqlenBalancedSampler,
    SequentialSampler,
)

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


