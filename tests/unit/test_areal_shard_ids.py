"""The RTensor shard ids distbatch.areal hands AReaL: each names its worker and task, and
anything else (another backend's id, a damaged one) is refused before any request."""

from __future__ import annotations

import pytest

from distbatch.areal import parse_shard_id, shard_id
from distbatch.errors import InvalidArgumentError


@pytest.mark.parametrize("node", ["127.0.0.1:40001", "[::1]:1", "worker-3.cluster.local:65535"])
def test_a_shard_id_names_its_worker_and_task(node: str) -> None:
    made = shard_id(node, "0f3a9c")
    assert made.startswith("distbatch://") and parse_shard_id(made) == (node, "0f3a9c")


@pytest.mark.parametrize(
    "value",
    [
        "6f1c2d3e-4b5a-6978-8a9b-0c1d2e3f4a5b",  # AReaL's HTTP backend: a uuid
        None,  # the Ray backend's ObjectRef is not a string either
        "distbatch://127.0.0.1:40001",  # no task
        "distbatch://127.0.0.1:40001/",  # an empty task
        "distbatch://127.0.0.1:0/t",  # port 0 names no peer
        "distbatch://127.0.0.1:40001/t with space",
        "distbatch:/127.0.0.1:40001/t",
    ],
)
def test_anything_else_is_refused_naming_what_to_do(value: object) -> None:
    with pytest.raises(InvalidArgumentError, match=r"was not made by distbatch.*install\(\)"):
        parse_shard_id(value)
