"""`chunk_balanced` balances by the lengths a trainer means: given per-task values (`lengths=`), a
per-task length field (`length_field` naming integers, e.g. `seqlen`), or a ragged field's
first dimension; a padded (fixed-shape) field would only balance task counts, and says so."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from distbatch import DistributedBatchMemory

DBM = DistributedBatchMemory
TRUE_LENGTHS = [100, 1, 1, 1, 90, 2, 3, 2]


def padded() -> DBM:
    """A padded batch (width 128) whose real lengths are TRUE_LENGTHS, as AReaL's trainers hold it."""
    n, width = len(TRUE_LENGTHS), 128
    mask = torch.arange(width)[None, :] < torch.tensor(TRUE_LENGTHS)[:, None]
    return DBM.from_dict(
        {
            "input_ids": torch.zeros(n, width, dtype=torch.int64),
            "attention_mask": mask,
            "seqlen": torch.tensor(TRUE_LENGTHS, dtype=torch.int32),
            "seqlen_json": list(TRUE_LENGTHS),
        }
    )


def totals(chunks: list[DBM]) -> list[int]:
    by_id = dict(zip(padded_ids, TRUE_LENGTHS))
    return sorted(sum(by_id[t] for t in c.task_ids) for c in chunks)


padded_ids: list[str] = []


@pytest.fixture
def batch(convert: Callable[..., Any]) -> DBM:
    local = padded()
    padded_ids[:] = local.task_ids
    return convert(local)


BALANCED = [97, 103]  # {100, 1, 1, 1} and {90, 2, 3, 2}: the best split into two chunks of 4 tasks


@pytest.mark.parametrize(
    "how",
    [
        {"lengths": torch.tensor(TRUE_LENGTHS)},
        {"lengths": TRUE_LENGTHS},
        {"lengths": np.asarray(TRUE_LENGTHS, dtype=np.int16)},
        {"length_field": "seqlen"},
        {"length_field": "seqlen_json"},
    ],
    ids=["tensor", "list", "numpy", "scalar-field", "json-field"],
)
def test_balance_by_true_lengths(batch: DBM, how: dict[str, Any]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chunks = batch.chunk_balanced(2, **how)
    assert totals(chunks) == BALANCED


def test_mask_sums_as_lengths(batch: DBM) -> None:
    chunks = batch.chunk_balanced(2, lengths=batch["attention_mask"].sum(-1))
    assert totals(chunks) == BALANCED


def test_a_padded_field_warns_and_says_what_to_pass(batch: DBM) -> None:
    with pytest.warns(UserWarning, match=r"'input_ids' is fixed-shape \(padded\).*lengths=.*length_field="):
        chunks = batch.chunk_balanced(2)
    assert [len(c) for c in chunks] == [4, 4]  # counts, not tokens
    with warnings.catch_warnings():  # naming the padded field means it: no warning
        warnings.simplefilter("error")
        batch.chunk_balanced(2, length_field="input_ids")


def test_a_batch_of_per_task_scalars_warns_that_it_has_no_length_not_that_it_is_padded(
    convert: Callable[..., Any],
) -> None:
    """A scalar field is not padded: the warning says no field gives a length, and what to use."""
    batch = convert(DBM.from_dict({"x": torch.rand(8), "uid": [f"u{i}" for i in range(8)]}))
    with pytest.warns(UserWarning) as caught:
        chunks = batch.chunk_balanced(2)
    message = str(caught[0].message)
    assert message.startswith(
        "chunk_balanced: no field gives a task's length (the default, 'x', holds one scalar per task), "
        "so chunks balance task counts only: use chunk(n) for that, or pass lengths="
    )
    assert "padded" not in message and "length_field=" in message
    assert [len(c) for c in chunks] == [4, 4]


def test_the_default_prefers_a_ragged_field() -> None:
    b = DBM.from_dict(
        {"reward": torch.ones(4), "tokens": [torch.zeros(n) for n in (9, 1, 1, 9)]}, task_ids=list("abcd")
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert b.lengths() == [9, 1, 1, 9]
        chunks = b.chunk_balanced(2)
    assert sorted(sum(c.lengths("tokens")) for c in chunks) == [10, 10]


@pytest.mark.parametrize(
    "how, message",
    [
        ({"lengths": [1, 2]}, "one length per task: 8"),
        ({"lengths": [1.5] * 8}, "must be integers"),
        ({"lengths": [-1] + [1] * 7}, "non-negative"),
        ({"lengths": torch.ones(8, 2, dtype=torch.int64)}, "one length per task"),
        ({"lengths": TRUE_LENGTHS, "length_field": "seqlen"}, "not both"),
    ],
)
def test_bad_lengths_are_refused(batch: DBM, how: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        batch.chunk_balanced(2, **how)


def test_a_float_scalar_field_is_not_a_length() -> None:
    local = DBM.from_dict({"score": torch.rand(4)})
    with pytest.raises(ValueError, match="field 'score' must be integers"):
        local.chunk_balanced(2, length_field="score")
