"""Token-budget micro-batches (`split_micro_batches`, `micro_batch_count`): every task once, in
order inside each micro-batch, each under the budget, balanced by tokens, and the same count on
every rank of a data-parallel group."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distbatch import DistributedBatchMemory, InvalidArgumentError

LENGTHS = st.lists(st.integers(1, 300), min_size=0, max_size=60)


def ragged(lengths: list[int], prefix: str = "t") -> DistributedBatchMemory:
    return DistributedBatchMemory.from_dict(
        {"input_ids": [torch.arange(n, dtype=torch.int32) for n in lengths]},
        task_ids=[f"{prefix}{i}" for i in range(len(lengths))],
    )


def tokens(batch: DistributedBatchMemory) -> int:
    return sum(batch.lengths("input_ids")) if len(batch) else 0


@settings(max_examples=60, deadline=None)
@given(lengths=LENGTHS, budget=st.integers(300, 2000))
def test_every_task_once_in_order_under_the_budget(lengths: list[int], budget: int) -> None:
    batch = ragged(lengths)
    parts = batch.split_micro_batches(budget)
    ids = [t for part in parts for t in part.task_ids]
    assert sorted(ids) == sorted(batch.task_ids)
    for part in parts:
        positions = [batch.task_ids.index(t) for t in part.task_ids]
        assert positions == sorted(positions)
        assert tokens(part) <= budget
    assert len(parts) >= max(1, -(-sum(lengths) // budget))


def test_micro_batches_are_balanced_by_tokens() -> None:
    lengths = [300, 20, 280, 40, 150, 150, 260, 60, 100, 200]  # 1,560 tokens
    parts = ragged(lengths).split_micro_batches(800)
    # The fewest micro-batches that fit (contiguous packing would need three), near-equal.
    assert len(parts) == 2
    assert sum(tokens(p) for p in parts) == 1560 and abs(tokens(parts[0]) - tokens(parts[1])) <= 20


def test_a_given_count_is_kept_and_one_too_small_is_refused() -> None:
    batch = ragged([100] * 6)
    parts = batch.split_micro_batches(300, count=4)
    assert len(parts) == 4 and sorted(len(p) for p in parts) == [1, 1, 2, 2]
    assert [len(p) for p in batch.split_micro_batches(600, count=8)] == [1] * 6 + [0, 0]  # empty ones last
    with pytest.raises(InvalidArgumentError, match="do not fit 1 micro-batches of at most 300"):
        batch.split_micro_batches(300, count=1)


def test_a_task_over_the_budget_is_named() -> None:
    with pytest.raises(InvalidArgumentError, match="task 2 has 900 tokens, more than max_tokens=500"):
        ragged([10, 20, 900]).split_micro_batches(500)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidArgumentError, match="max_tokens"):
            ragged([10]).split_micro_batches(bad)  # type: ignore[arg-type]


@settings(max_examples=40, deadline=None)
@given(ranks=st.lists(LENGTHS, min_size=1, max_size=4), budget=st.integers(300, 1500))
def test_every_rank_splits_into_the_groups_count(ranks: list[list[int]], budget: int) -> None:
    chunks = [ragged(lengths, prefix=f"r{r}-") for r, lengths in enumerate(ranks)]
    count = DistributedBatchMemory.micro_batch_count(chunks, budget)
    fewest = max(len(chunk.split_micro_batches(budget)) for chunk in chunks)
    assert count >= fewest
    for chunk in chunks:
        parts = chunk.split_micro_batches(budget, count=count)
        assert len(parts) == count and all(tokens(p) <= budget for p in parts)


def test_lengths_can_come_from_a_field_or_be_given() -> None:
    batch = DistributedBatchMemory.from_dict(
        {"input_ids": torch.zeros(4, 8, dtype=torch.int32), "seqlen": torch.tensor([8, 1, 7, 2])}
    )
    by_field = batch.split_micro_batches(9, length_field="seqlen")
    assert sorted(int(p["seqlen"].sum()) for p in by_field) == [9, 9]
    given_lengths = batch.split_micro_batches(9, lengths=np.array([8, 1, 7, 2]))
    assert [p.task_ids for p in given_lengths] == [p.task_ids for p in by_field]
