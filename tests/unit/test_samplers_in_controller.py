"""Samplers inside a controller: a simulated streaming run, and the real `Controller` reading lengths
from metadata.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sampler_support import LEN_A, PID, TASK, FakePartition, roundtrip

from distbatch.samplers import (
    BaseSampler,
    GRPOGroupNSampler,
    RankAwareSampler,
    SeqlenBalancedSampler,
)

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


