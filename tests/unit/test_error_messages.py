"""Errors a user meets by mistake: each says what to do, and names a bad value without echoing it."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch
from source_support import parsed

from distbatch import DistributedBatchMemory, InvalidIdError, errors
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


# ----------------------------------------------------------------------------- one error policy

BARE = {"ValueError", "TypeError", "KeyError", "RuntimeError", "IndexError"}
PACKAGE = Path(__file__).resolve().parents[2] / "distbatch"


def bare_raises(tree: ast.Module, where: str) -> list[str]:
    """`raise ValueError(...)` and the like in `tree`: builtins raised as they are, which
    `except DistBatchError` would not catch."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            called = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(called, ast.Name) and called.id in BARE:
                found.append(f"{where}:{node.lineno}: raise {called.id}")
    return found


def test_the_package_raises_no_bare_builtin_error() -> None:
    """Every error of ours is a `DistBatchError` and also the builtin users catch today
    (`InvalidArgumentError` is a `ValueError`, `InvalidTypeError` a `TypeError`, ...)."""
    found = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        for hit in bare_raises(parsed(path), str(path.relative_to(PACKAGE.parent)))
    ]
    assert not found, "bare builtin errors (raise a distbatch.errors class instead):\n" + "\n".join(found)


def test_the_walk_sees_bare_raises_and_lets_ours_and_re_raises_pass() -> None:
    source = (
        "def f(x):\n"
        "    if x: raise ValueError('a')\n"
        "    try: g()\n"
        "    except OSError: raise\n"
        "    raise KeyError\n"
        "def h(): raise InvalidArgumentError('b')\n"
    )
    assert sorted(bare_raises(ast.parse(source), "m")) == ["m:2: raise ValueError", "m:5: raise KeyError"]


@pytest.mark.parametrize(
    ("error", "builtin"),
    [
        (errors.InvalidArgumentError, ValueError),
        (errors.InvalidTypeError, TypeError),
        (errors.NotFoundError, KeyError),
        (errors.OutOfRangeError, IndexError),
        (errors.StateError, RuntimeError),
    ],
)
def test_each_error_is_ours_and_the_builtin_users_catch(
    error: type[Exception], builtin: type[Exception]
) -> None:
    with pytest.raises(builtin) as caught:
        raise error("what went wrong")
    assert isinstance(caught.value, errors.DistBatchError)
    assert str(caught.value) == "what went wrong"  # a KeyError's message is not quoted


def test_a_wrong_argument_is_caught_as_ours_and_as_the_builtin() -> None:
    batch = DistributedBatchMemory.from_dict({"x": torch.zeros(2, 1)})
    for call, builtin in ((lambda: batch["nope"], KeyError), (lambda: batch.chunk(0), ValueError)):
        with pytest.raises(builtin) as caught:
            call()
        assert isinstance(caught.value, errors.DistBatchError)


def test_numpy_string_arrays_are_per_task_values_and_other_dtypes_name_the_field() -> None:
    """A numpy array of strings (or objects) is a column of per-task values, as a list would be;
    one torch cannot take (bytes) is refused naming the field, not with torch's bare message."""
    batch = DistributedBatchMemory.from_dict(
        {"text": np.array(["a", "bb"]), "meta": np.array([{"k": 1}, 2], dtype=object), "x": np.arange(2.0)}
    )
    assert batch["text"] == ["a", "bb"] and batch["meta"] == [{"k": 1}, 2]
    assert batch["x"].dtype == torch.float64
    with pytest.raises(ValueError, match=r"field 'raw': a numpy array of dtype \|S1 cannot be a column"):
        DistributedBatchMemory.from_dict({"raw": np.array([b"a", b"b"])})


@pytest.mark.parametrize(
    "bad",
    ["has space", "new\nline", "", "x" * 201, 7, None, b"bytes"],
    ids=["space", "newline", "empty", "long", "int", "none", "bytes"],
)
def test_one_bad_id_among_many_is_named_wherever_ids_are_checked_at_once(bad: object) -> None:
    """Task ids are checked with one regex pass over the whole list (a batch's, a clear's, a
    controller call's), not a call per id: a bad one anywhere, even one that would join two
    lines into a valid-looking pair, is still named, and the same way in each place."""
    from distbatch.client.deletes import check_delete_args
    from distbatch.controller.arguments import id_list

    ids = [f"t{i}" for i in range(1000)]
    ids[617] = bad  # type: ignore[call-overload]
    checks = [
        lambda: DistributedBatchMemory.from_dict({"x": torch.zeros(1000)}, task_ids=ids),
        lambda: check_delete_args(ids, None, None),
        lambda: id_list(ids, "task_ids", "task_id"),
    ]
    for check in checks:
        with pytest.raises(InvalidIdError, match="invalid task_id") as info:
            check()
        assert repr(bad)[:20] in str(info.value)
