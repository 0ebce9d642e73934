"""Errors a user meets by mistake: each says what to do, and names a bad value without echoing it."""

from __future__ import annotations

import pytest
import torch

from distbatch import DistributedBatchMemory, InvalidIdError
from distbatch.ids import validate_id, validate_key, validate_node


def test_a_long_id_is_named_not_echoed() -> None:
    long = "x" * 5000
    with pytest.raises(InvalidIdError) as info:
        validate_id(long + "/", "task_id")
    message = str(info.value)
    assert len(message) < 200 and "5,001 characters" in message and "task_id" in message
    for call in (lambda: validate_key((long, "f")), lambda: validate_key([long] * 3)):
        with pytest.raises(InvalidIdError) as info:
            call()
        assert len(str(info.value)) < 200
    with pytest.raises(ValueError) as bad_node:
        validate_node("h" * 5000)
    assert len(str(bad_node.value)) < 200 and "host:port" in str(bad_node.value)
    batch = DistributedBatchMemory.from_dict({"x": torch.zeros(2, 1)})
    with pytest.raises(KeyError) as missing:
        batch[long]
    assert len(str(missing.value)) < 200 and "fields: ['x']" in str(missing.value)


def test_a_short_id_is_quoted_whole() -> None:
    with pytest.raises(InvalidIdError, match=r"invalid field 'a b': must be 1-200 characters"):
        validate_id("a b", "field")


def test_del_of_a_task_index_says_how_to_drop_tasks() -> None:
    batch = DistributedBatchMemory.from_dict({"x": torch.arange(3)})
    with pytest.raises(TypeError, match=r"del removes a field, by name; to drop tasks.*batch\[mask\]"):
        del batch[0]
    assert batch.fields == ["x"] and len(batch) == 3  # nothing changed
    kept = batch[torch.tensor([True, False, True])]
    assert kept["x"].tolist() == [0, 2]
    del batch["x"]
    assert batch.fields == []
