"""Differential tests: our samplers and balancing against TransferQueue 0.1.11's, on the same inputs.

`scripts/test` installs `transferqueue` from the package registry (the `tq` extra) and sets
DISTBATCH_REQUIRE_TQ=1, so a broken install fails here instead of skipping. Hypothesis drives
both implementations with the same ready lists, arrival orders, batch sizes, group sizes, dp
sizes, ranks, batch indexes and lengths, through the same controller loop (a sampler is asked
only once a batch is ready, or when it has the answer cached, as both controllers do).

Results must agree, except for the deliberate differences listed in the guide
(docs/guide/from-transferqueue.md); each of those has its own test below (`test_difference_*`)
showing what their sampler does and why ours does otherwise.
"""

from __future__ import annotations

import importlib
import os
import random
import subprocess
import sys
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from distbatch import DistributedBatchMemory
from distbatch.batch.balance import balanced_group_partitions
from distbatch.batch.balance import get_seqlen_balanced_partitions as our_partitions
from distbatch.batch.balance import karmarkar_karp as our_kk
from distbatch.controller import Controller
from distbatch.errors import InvalidArgumentError
from distbatch.launch import WorkerProcess
from distbatch.samplers import (
    GRPOGroupNSampler,
    RankAwareSampler,
    SeqlenBalancedSampler,
    SequentialSampler,
)


def _import_tq() -> Any:
    """TransferQueue's sampler package: skipped when absent, unless it is required."""
    if os.environ.get("DISTBATCH_REQUIRE_TQ") == "1":
        return importlib.import_module("transfer_queue.sampler")
    return pytest.importorskip("transfer_queue.sampler")


tq = _import_tq()
from transfer_queue.sampler import seqlen_balanced_sampler as tq_seqlen  # noqa: E402

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- the shared loop


class World:
    """One controller's view: produced samples, what each task consumed, the sampler.

    `ask` is the loop both controllers run: a sampler sees the ready list only when it holds
    `batch_size` samples or the sampler has this rank's answer cached; what it reports
    consumed leaves that task's ready list.
    """

    def __init__(self, sampler: Any, partition: Any = None) -> None:
        self.sampler = sampler
        self.partition = partition
        self.produced: list[int] = []  # in arrival order
        self.consumed: dict[tuple[str, str], set[int]] = {}

    def ready(self, pid: str, task: str) -> list[int]:
        seen = self.consumed.get((pid, task), set())
        return [i for i in self.produced if i not in seen]

    def ask(self, batch_size: int, pid: str = "p", task: str = "t", **config: Any) -> tuple[list, list]:
        ready = self.ready(pid, task)
        if len(ready) < batch_size and not self.sampler.has_cached_result(pid, task, config):
            return [], []
        kwargs = dict(config)
        if self.partition is not None:
            kwargs["partition"] = self.partition
        sampled, consumed = self.sampler.sample(ready, batch_size, task_name=task, partition_id=pid, **kwargs)
        self.consumed.setdefault((pid, task), set()).update(consumed)
        return list(sampled), list(consumed)


class CustomMeta:
    """A partition as TransferQueue's controller passes it: ``get_custom_meta`` per index."""

    def __init__(self, lengths: dict[int, int]) -> None:
        self.lengths = lengths

    def get_custom_meta(self, indexes: Sequence[int]) -> dict[int, dict]:
        return {i: {"total_lengths": self.lengths[i]} for i in indexes if i in self.lengths}


def mixes_prompts(sampled: Sequence[int], n: int) -> bool:
    """Whether some n-run of `sampled` holds samples of two prompts (aligned blocks of n)."""
    runs = [sampled[k : k + n] for k in range(0, len(sampled), n)]
    return any(len({i // n for i in run}) > 1 for run in runs)


def first_complete_groups(ready: Sequence[int], n: int, count: int) -> list[int]:
    have = set(ready)
    groups = sorted({i // n for i in have if all(g in have for g in range(i // n * n, i // n * n + n))})
    return [g * n + j for g in groups[:count] for j in range(n)] if len(groups) >= count else []


def without_empty(tree: Any) -> Any:
    """A nested dict with its empty dicts dropped (all the way up)."""
    if not isinstance(tree, dict):
        return tree
    kept = {k: without_empty(v) for k, v in tree.items()}
    return {k: v for k, v in kept.items() if v != {}}


def spread(parts: Sequence[Sequence[int]], lengths: Sequence[int]) -> int:
    sums = [sum(lengths[i] for i in p) for p in parts]
    return max(sums) - min(sums)


# --------------------------------------------------------------------------- strategies


@st.composite
def arrivals(draw: st.DrawFn, max_groups: int = 8, max_n: int = 4) -> tuple[int, list[int]]:
    """(n, samples produced in arrival order): a random subset of n * groups indexes, shuffled."""
    n = draw(st.integers(1, max_n))
    groups = draw(st.integers(1, max_groups))
    present = draw(st.lists(st.booleans(), min_size=n * groups, max_size=n * groups))
    produced = [i for i, here in enumerate(present) if here]
    return n, draw(st.permutations(produced))


# --------------------------------------------------------------------------- SequentialSampler


@SETTINGS
@given(case=arrivals(), batch_size=st.integers(0, 12), calls=st.integers(1, 4))
def test_sequential_agrees(case: tuple[int, list[int]], batch_size: int, calls: int) -> None:
    _, produced = case
    ours, theirs = World(SequentialSampler()), World(tq.SequentialSampler())
    for world in (ours, theirs):
        world.produced = list(produced)
    for _ in range(calls):
        assert ours.ask(batch_size) == theirs.ask(batch_size)
    # Called directly with too few ready, both hand out what there is.
    assert SequentialSampler().sample(produced, batch_size + 3) == tq.SequentialSampler().sample(
        produced, batch_size + 3
    )


# --------------------------------------------------------------------------- GRPOGroupNSampler


@SETTINGS
@given(
    case=arrivals(),
    groups_per_batch=st.integers(0, 3),
    with_rank=st.booleans(),
    batch_indexes=st.lists(st.integers(0, 3), min_size=1, max_size=5),
)
def test_grpo_agrees_unless_their_scan_mixes_prompts(
    case: tuple[int, list[int]], groups_per_batch: int, with_rank: bool, batch_indexes: list[int]
) -> None:
    n, produced = case
    batch_size = n * groups_per_batch
    ours, theirs = World(GRPOGroupNSampler(n)), World(tq.GRPOGroupNSampler(n_samples_per_prompt=n))
    for world in (ours, theirs):
        world.produced = list(produced)
    for batch_index in batch_indexes:
        config = {"dp_rank": 0, "batch_index": batch_index} if with_rank else {}
        ready = ours.ready("p", "t")
        got, want = ours.ask(batch_size, **config), theirs.ask(batch_size, **config)
        if got == want:
            continue
        # The one way they may differ: their scan took n consecutive indexes across a prompt boundary.
        assert mixes_prompts(want[0], n), (got, want)
        assert not mixes_prompts(got[0], n)
        assert got[0] == first_complete_groups(ready, n, groups_per_batch) and got[0] == got[1]
        return  # the two worlds have consumed different samples from here on


def test_grpo_defaults_and_messages_match() -> None:
    assert GRPOGroupNSampler().n_samples_per_prompt == tq.GRPOGroupNSampler().n_samples_per_prompt == 1
    for make in (GRPOGroupNSampler, tq.GRPOGroupNSampler):
        with pytest.raises(ValueError, match="must be positive"):
            make(n_samples_per_prompt=0)
        with pytest.raises(ValueError, match="must be a multiple of n_samples_per_prompt"):
            make(n_samples_per_prompt=4).sample(list(range(8)), 6)
        assert make(n_samples_per_prompt=2).sample(list(range(8)), 0) == ([], [])


# --------------------------------------------------------------------------- RankAwareSampler


@SETTINGS
@given(
    case=arrivals(max_groups=12, max_n=1),
    batch_size=st.integers(1, 4),
    calls=st.lists(
        st.tuples(
            st.sampled_from(["p", "q"]), st.sampled_from(["t", "u"]), st.integers(0, 2), st.integers(0, 3)
        ),
        min_size=1,
        max_size=16,
    ),
    late=st.lists(st.integers(0, 40), max_size=6, unique=True),
)
def test_rank_aware_agrees_across_tasks_partitions_ranks_and_batches(
    case: tuple[int, list[int]], batch_size: int, calls: list[tuple[str, str, int, int]], late: list[int]
) -> None:
    _, produced = case
    ours, theirs = World(RankAwareSampler()), World(tq.RankAwareSampler())
    for world in (ours, theirs):
        world.produced = list(produced)
    for step, (pid, task, dp_rank, batch_index) in enumerate(calls):
        if step == len(calls) // 2:  # more samples arrive half-way
            for world in (ours, theirs):
                world.produced += [i + 100 for i in late]
        config = {"dp_rank": dp_rank, "batch_index": batch_index}
        assert ours.ask(batch_size, pid, task, **config) == theirs.ask(batch_size, pid, task, **config)
        assert ours.sampler.has_cached_result(pid, task, config) == theirs.sampler.has_cached_result(
            pid, task, config
        )
    # Same cache layout: _states[partition][task][dp_rank][batch_index] = sampled (theirs also
    # leaves empty dicts behind after a call that found too few).
    assert without_empty(ours.sampler._states) == without_empty(theirs.sampler._states)


def test_rank_aware_messages_match() -> None:
    for sampler in (RankAwareSampler(), tq.RankAwareSampler()):
        with pytest.raises(ValueError, match="greater than or equal to 0"):
            sampler.sample([0, 1], 1, -1, 0, "t", "p")


# --------------------------------------------------------------------------- SeqlenBalancedSampler


@SETTINGS
@given(
    n=st.integers(1, 3),
    dp_size=st.integers(1, 4),
    groups_per_rank=st.integers(1, 3),
    lengths=st.lists(st.integers(0, 2000), min_size=48, max_size=48),
    missing=st.sets(st.integers(0, 47), max_size=8),
    unknown=st.sets(st.integers(0, 47), max_size=4),
    order=st.randoms(use_true_random=False),
    batches=st.integers(1, 3),
    lengths_from=st.sampled_from(["custom_meta", "nowhere", "no partition"]),
)
def test_seqlen_balanced_agrees_in_selection_and_balances_at_least_as_well(
    n: int,
    dp_size: int,
    groups_per_rank: int,
    lengths: list[int],
    missing: set[int],
    unknown: set[int],
    order: Any,
    batches: int,
    lengths_from: str,
) -> None:
    batch_size = n * groups_per_rank
    total = n * (48 // n)
    produced = [i for i in range(total) if i not in missing]
    order.shuffle(produced)
    known = {i: lengths[i] for i in range(total) if i not in unknown}  # a sample without one counts as 1
    partition = {"custom_meta": CustomMeta(known), "nowhere": CustomMeta({}), "no partition": None}[
        lengths_from
    ]
    ours = World(SeqlenBalancedSampler(n, dp_size), partition)
    theirs = World(tq.SeqlenBalancedSampler(n_samples_per_prompt=n, dp_size=dp_size), partition)
    for world in (ours, theirs):
        world.produced = list(produced)
    for batch_index in range(batches):
        ranks = list(range(dp_size))
        order.shuffle(ranks)  # ranks ask in any order
        selection = first_complete_groups(ours.ready("p", "t"), n, groups_per_rank * dp_size)
        got = {r: ours.ask(batch_size, dp_rank=r, batch_index=batch_index) for r in ranks}
        want = {r: theirs.ask(batch_size, dp_rank=r, batch_index=batch_index) for r in ranks}
        ours_all = sorted(i for s, _ in got.values() for i in s)
        theirs_all = sorted(i for s, _ in want.values() for i in s)
        if not theirs_all:
            assert not ours_all
            return
        if mixes_prompts(sorted(theirs_all), n):
            assert ours_all == sorted(selection)  # their GRPO scan mixed prompts; ours takes whole groups
            return
        assert ours_all == theirs_all
        for r in ranks:
            assert len(got[r][0]) == len(want[r][0]) == batch_size
            assert not mixes_prompts(sorted(got[r][0]), n)
        # Consumed: theirs marks each rank's own portion as it asks; ours the whole batch at once.
        assert sorted(i for _, c in want.values() for i in c) == theirs_all
        assert sorted(got[ranks[0]][1]) == ours_all
        assert sorted(ours.consumed[("p", "t")]) == sorted(theirs.consumed[("p", "t")])
        if lengths_from == "custom_meta":
            weight = [known.get(i, 1) for i in range(total)]
            assert spread([got[r][0] for r in ranks], weight) <= spread([want[r][0] for r in ranks], weight)
        else:  # no lengths anywhere: both split by count the same way (runs, or weight 1 each)
            assert all(sorted(got[r][0]) == sorted(want[r][0]) for r in ranks)


def test_seqlen_messages_match() -> None:
    for make in (SeqlenBalancedSampler, tq.SeqlenBalancedSampler):
        with pytest.raises(ValueError, match="dp_size must be positive"):
            make(dp_size=0)
        with pytest.raises(ValueError, match="must be a multiple of n_samples_per_prompt"):
            make(n_samples_per_prompt=4, dp_size=2).sample(
                list(range(20)), 3, "t", "p", dp_rank=0, batch_index=0
            )


# --------------------------------------------------------------------------- balancing


@st.composite
def balancing_inputs(draw: st.DrawFn) -> tuple[list[int], int, bool]:
    k = draw(st.integers(1, 6))
    equal_size = draw(st.booleans())
    count = draw(st.integers(k, 24))
    if equal_size:
        count -= count % k
    big = draw(st.booleans())
    lengths = draw(st.lists(st.integers(0, 5000 if big else 12), min_size=count, max_size=count))
    return lengths, k, equal_size


@settings(max_examples=400, deadline=None)
@given(case=balancing_inputs())
def test_balancing_is_valid_and_never_wider_than_theirs(case: tuple[list[int], int, bool]) -> None:
    lengths, k, equal_size = case
    for ours, theirs in (
        (our_kk(lengths, k, equal_size), tq_seqlen.karmarkar_karp(lengths, k, equal_size)),
        (
            our_partitions(lengths, k, equal_size),
            tq_seqlen.get_seqlen_balanced_partitions(lengths, k, equal_size),
        ),
    ):
        assert len(ours) == len(theirs) == k
        assert sorted(i for p in ours for i in p) == list(range(len(lengths)))
        assert all(p == sorted(p) and p for p in ours)
        if equal_size:
            assert [len(p) for p in ours] == [len(lengths) // k] * k
        assert spread(ours, lengths) <= spread(theirs, lengths)


def test_balancing_is_strictly_better_where_a_swap_helps() -> None:
    lengths = [8, 7, 6, 5, 4]  # largest differencing alone gives 16 / 14; 15 / 15 exists
    assert spread(tq_seqlen.karmarkar_karp(lengths, 2, False), lengths) == 2
    assert spread(our_kk(lengths, 2, False), lengths) == 0


@pytest.mark.parametrize(("lengths", "k", "equal_size"), [([1, 2, 3], 2, True), ([1], 3, False)])
def test_balancing_refuses_what_theirs_refuses(lengths: list[int], k: int, equal_size: bool) -> None:
    with pytest.raises(AssertionError):
        tq_seqlen.get_seqlen_balanced_partitions(lengths, k, equal_size)
    with pytest.raises(ValueError):
        our_partitions(lengths, k, equal_size)


# ----------------------------------------------------------------- TransferQueue's samplers in our controller


def test_their_samplers_run_in_our_controller(shared_workers: list[WorkerProcess]) -> None:
    """Their classes, unchanged, behind our Controller: rank-aware caching, custom_meta lengths."""
    node = shared_workers[0].node
    lengths = [50, 50, 5, 5, 50, 50, 5, 5]  # groups of 2: 100, 10, 100, 10
    for ours in (False, True):
        ids = [f"tqc-{uuid.uuid4().hex[:8]}-{i}" for i in range(8)]
        batch = DistributedBatchMemory.from_dict(
            {"input_ids": [torch.arange(n) for n in lengths]}, task_ids=ids
        ).to_remote(node)
        sampler = (
            SeqlenBalancedSampler(2, 2)
            if ours
            else tq.SeqlenBalancedSampler(n_samples_per_prompt=2, dp_size=2)
        )
        ctl = Controller(sampler)
        ctl.put("p", batch)
        ctl.set_custom_meta("p", {t: {"total_lengths": n} for t, n in zip(ids, lengths, strict=True)})
        r0 = ctl.get_meta("p", "train", ["input_ids"], 4, dp_rank=0, batch_index=0)
        r1 = ctl.get_meta("p", "train", ["input_ids"], 4, dp_rank=1, batch_index=0)
        again = ctl.get_meta("p", "train", ["input_ids"], 4, dp_rank=0, batch_index=0)  # a TP peer of rank 0
        assert again.task_ids == r0.task_ids
        assert sorted(r0.task_ids + r1.task_ids) == sorted(ids)
        totals = [sum(lengths[ids.index(t)] for t in r.task_ids) for r in (r0, r1)]
        assert totals == [110, 110], (ours, totals)
        assert ctl.all_consumed("p", "train")
        if not ours:  # their classes keep their cache in a layout only they read back
            with pytest.raises(InvalidArgumentError, match="has no state_dict"):
                ctl.state_dict()
        assert ctl.clear_partition("p") == 8  # their sampler's clear_cache is what the clear calls


def test_their_checkpoint_loads_into_ours() -> None:
    theirs = tq.SeqlenBalancedSampler(n_samples_per_prompt=2, dp_size=2)
    part = CustomMeta({i: 10 * i for i in range(8)})
    portions = [
        theirs.sample(list(range(8)), 4, "t", "p", dp_rank=r, batch_index=0, partition=part)[0]
        for r in (0, 1)
    ]
    ours = SeqlenBalancedSampler(2, 2)
    ours.load_checkpoint(theirs.save_checkpoint())
    for r in (0, 1):
        assert ours.has_cached_result("p", "t", {"dp_rank": r, "batch_index": 0})
        assert ours.sample([], 4, "t", "p", dp_rank=r, batch_index=0)[0] == portions[r]


def test_a_ported_sampler_is_not_called_short_of_a_batch(shared_workers: list[WorkerProcess]) -> None:
    """TransferQueue lets a sampler raise when too few are ready; ours never asks it then."""
    node = shared_workers[0].node

    class Drawing(SequentialSampler):
        def sample(
            self, ready_indexes: Sequence[int], batch_size: int, *a: Any, **k: Any
        ) -> tuple[list, list]:
            picked = random.Random(0).sample(list(ready_indexes), batch_size)  # ValueError when too few
            return picked, picked

    ids = [f"draw-{uuid.uuid4().hex[:8]}-{i}" for i in range(3)]
    batch = DistributedBatchMemory.from_dict({"x": torch.zeros(3, 1)}, task_ids=ids).to_remote(node)
    ctl = Controller(Drawing())
    ctl.put("p", batch[:2])
    assert len(ctl.get_meta("p", "train", ["x"], 3)) == 0
    ctl.put("p", batch[2:])
    assert sorted(ctl.get_meta("p", "train", ["x"], 3).task_ids) == sorted(ids)
    ctl.clear_partition("p")


def test_controller_asks_a_sampler_only_once_a_batch_is_ready(shared_workers: list[WorkerProcess]) -> None:
    """As theirs: SequentialSampler's 'what there is' never reaches a consumer of our Controller.

    Short of a batch, a sampler that overrides `sample` is not called at all (ours check their
    arguments through `check_call`, which probes only samplers known to have no side effects)."""
    node = shared_workers[0].node
    seen: list[list[int]] = []

    class Recording(SequentialSampler):
        def sample(
            self, ready_indexes: Sequence[int], batch_size: int, *a: Any, **k: Any
        ) -> tuple[list, list]:
            seen.append(list(ready_indexes))
            return super().sample(ready_indexes, batch_size, *a, **k)

    ids = [f"seq-{uuid.uuid4().hex[:8]}-{i}" for i in range(3)]
    batch = DistributedBatchMemory.from_dict({"x": torch.zeros(3, 1)}, task_ids=ids).to_remote(node)
    ctl = Controller(Recording())
    ctl.put("p", batch[:2])
    assert len(ctl.get_meta("p", "train", ["x"], 3)) == 0
    assert seen == []
    ctl.put("p", batch[2:])
    assert ctl.get_meta("p", "train", ["x"], 3).task_ids == ids
    assert seen[-1] == [0, 1, 2]
    ctl.clear_partition("p")


# --------------------------------------------------------------------------- deliberate differences


def test_difference_grpo_groups_are_aligned_blocks_their_scan_mixes_prompts() -> None:
    # Prompt 0 is samples 0-3, prompt 1 is samples 4-7; sample 0 is still being generated.
    ready = [1, 2, 3, 4, 5, 6, 7]
    theirs, _ = tq.GRPOGroupNSampler(n_samples_per_prompt=4).sample(ready, 4)
    ours, _ = GRPOGroupNSampler(4).sample(ready, 4)
    assert theirs == [1, 2, 3, 4]  # three answers to prompt 0 and one to prompt 1, normalised together
    assert ours == [4, 5, 6, 7]  # prompt 1, whole


def test_difference_seqlen_consumes_the_whole_batch_at_once_theirs_serves_a_sample_twice() -> None:
    # Two ranks; rank 0 prefetches batch 1 before rank 1 has asked for batch 0.
    def run(sampler: Any) -> dict[tuple[int, int], list[int]]:
        world = World(sampler, CustomMeta({i: 1 for i in range(8)}))
        world.produced = list(range(8))
        got = {}
        for rank, batch_index in ((0, 0), (0, 1), (1, 0), (1, 1)):
            got[(rank, batch_index)] = world.ask(2, dp_rank=rank, batch_index=batch_index)[0]
        return got

    theirs = run(tq.SeqlenBalancedSampler(n_samples_per_prompt=1, dp_size=2))
    ours = run(SeqlenBalancedSampler(1, 2))
    served = [i for got in theirs.values() for i in got]
    assert len(served) > len(set(served))  # their rank 1's batch-0 samples went into batch 1 too
    served = [i for got in ours.values() for i in got]
    assert sorted(served) == list(range(8))  # every sample once


def test_difference_negative_batch_size_is_refused_theirs_slices() -> None:
    assert tq.SequentialSampler().sample([0, 1, 2, 3], -1) == ([0, 1, 2], [0, 1, 2])  # "-1" hands out 3
    with pytest.raises(InvalidArgumentError, match="greater than or equal to 0"):
        SequentialSampler().sample([0, 1, 2, 3], -1)


def test_difference_seqlen_rank_outside_dp_size_is_refused_theirs_returns_nothing() -> None:
    theirs = tq.SeqlenBalancedSampler(n_samples_per_prompt=1, dp_size=2)
    theirs.sample([0, 1, 2, 3], 2, "t", "p", dp_rank=0, batch_index=0)
    assert theirs.sample([0, 1, 2, 3], 2, "t", "p", dp_rank=5, batch_index=0) == ([], [])  # waits forever
    with pytest.raises(InvalidArgumentError, match=r"dp_rank 5 is not in \[0, 2\)"):
        SeqlenBalancedSampler(1, 2).sample([0, 1, 2, 3], 2, dp_rank=5, batch_index=0, lengths={})


def test_difference_rank_keys_needed_theirs_default_or_cache_partial_keys() -> None:
    # Their SeqlenBalancedSampler defaults to dp_rank 0, batch_index 0: every call is batch 0 again.
    theirs = tq.SeqlenBalancedSampler(n_samples_per_prompt=1, dp_size=1)
    assert theirs.sample([0, 1], 2)[0] == theirs.sample([2, 3], 2)[0] == [0, 1]
    with pytest.raises(InvalidArgumentError, match="needs dp_rank and batch_index"):
        SeqlenBalancedSampler(1, 1).sample([0, 1], 2)
    # Their GRPO sampler caches under dp_rank alone (batch_index None): the same batch forever.
    grpo = tq.GRPOGroupNSampler(n_samples_per_prompt=1)
    assert grpo.sample([0, 1], 2, dp_rank=0)[0] == grpo.sample([2, 3], 2, dp_rank=0)[0] == [0, 1]
    with pytest.raises(InvalidArgumentError, match="go together"):
        GRPOGroupNSampler(1).sample([0, 1], 2, dp_rank=0)


def test_difference_rank_aware_caches_nothing_for_batch_size_zero_and_checks_the_size() -> None:
    theirs = tq.RankAwareSampler()
    assert theirs.sample([0, 1], 0, 0, 0, "t", "p") == ([], [])
    assert theirs.sample([0, 1], 2, 0, 0, "t", "p") == ([], [])  # the empty answer was cached
    ours = RankAwareSampler()
    assert ours.sample([0, 1], 0, 0, 0, "t", "p") == ([], [])
    assert ours.sample([0, 1], 2, 0, 0, "t", "p") == ([0, 1], [0, 1])
    # A TP peer configured with another batch size: theirs returns the sibling's batch silently.
    assert tq.RankAwareSampler().sample([0, 1, 2], 1, 0, 0, "t", "p") == ([0], [0])
    with pytest.raises(InvalidArgumentError, match="was sampled with batch_size 2"):
        ours.sample([0, 1, 2], 1, 0, 0, "t", "p")


# TransferQueue's sampler modules alone, without its package's __init__ (which imports Ray and
# torch: a new interpreter under -O has no bytecode for them and compiled them for 11 CPU-s).
THEIR_SAMPLERS_ALONE = """
import importlib.util, sys, types
from pathlib import Path
root = Path(importlib.util.find_spec("transfer_queue").origin).parent
for name, path in (("transfer_queue", root), ("transfer_queue.sampler", root / "sampler")):
    package = types.ModuleType(name)
    package.__path__ = [str(path)]
    sys.modules[name] = package
sys.modules["transfer_queue.sampler"].BaseSampler = importlib.import_module(
    "transfer_queue.sampler.base"
).BaseSampler
"""


def test_difference_errors_are_value_errors_theirs_vanish_under_python_O() -> None:
    code = THEIR_SAMPLERS_ALONE + (
        "from transfer_queue.sampler.seqlen_balanced_sampler import get_seqlen_balanced_partitions as g\n"
        "print(g([1], 3, False))\n"
        "assert 'torch' not in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "[[0], [], []]" in out.stdout, out.stderr[
        -2000:
    ]  # an empty rank, silently
    code_ours = (
        "from distbatch.batch.balance import get_seqlen_balanced_partitions as g\n"
        "try:\n    g([1], 3, False)\n"
        "except ValueError as exc:\n    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run([sys.executable, "-O", "-c", code_ours], capture_output=True, text=True, timeout=120)
    # A ValueError (ours: InvalidArgumentError, also a DistBatchError), under -O too.
    assert "InvalidArgumentError 1 items cannot fill 3 partitions" in out.stdout, out.stderr[-2000:]


SAMPLER_PAIRS: list[tuple[str, Callable[[], Any], Callable[[], Any]]] = [
    ("sequential", SequentialSampler, tq.SequentialSampler),
    ("grpo", lambda: GRPOGroupNSampler(2), lambda: tq.GRPOGroupNSampler(n_samples_per_prompt=2)),
    ("rank-aware", RankAwareSampler, tq.RankAwareSampler),
]


@pytest.mark.parametrize("name, ours, theirs", SAMPLER_PAIRS, ids=[p[0] for p in SAMPLER_PAIRS])
def test_batch_size_zero_gives_nothing_in_both(name: str, ours: Callable, theirs: Callable) -> None:
    args = {"dp_rank": 0, "batch_index": 0, "task_name": "t", "partition_id": "p"}
    assert ours().sample([0, 1, 2, 3], 0, **args) == theirs().sample([0, 1, 2, 3], 0, **args) == ([], [])


@SETTINGS
@given(lengths=st.lists(st.integers(0, 100), min_size=4, max_size=4))
def test_balanced_group_partitions_matches_their_group_split(lengths: list[int]) -> None:
    """The group split inside SeqlenBalancedSampler is never wider than theirs (4 groups, 2 ranks)."""
    theirs = tq_seqlen.get_seqlen_balanced_partitions(lengths, 2, equal_size=True)
    ours = balanced_group_partitions(lengths, 2)
    assert spread(ours, lengths) <= spread(theirs, lengths)
