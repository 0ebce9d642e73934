"""Sampler state: checkpoints round-trip (ours and TransferQueue's layout), the cache stays bounded,
cleared indexes are forgotten.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from typing import Any

import pytest
from sampler_support import LEN_A, PID, TASK, Stream, r, roundtrip

from distbatch import samplers
from distbatch.samplers import (
    BaseSampler,
    GRPOGroupNSampler,
    RankAwareSampler,
    SeqlenBalancedSampler,
)

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


