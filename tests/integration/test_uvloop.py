"""The client under uvloop. AReaL installs uvloop's event-loop policy when it is imported, so a
distbatch client made afterwards runs its loop on uvloop, which asks a protocol for a buffer
again after a body is complete and calls an empty one a fatal transport error (each such
response was logged as `Fatal error on transport` and its connection dropped)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import pytest
import torch

from distbatch import ShardClient
from distbatch.launch import WorkerProcess

uvloop = pytest.importorskip("uvloop")


@pytest.fixture
def uvloop_policy() -> Iterator[None]:
    """uvloop's policy for loops made in the test (as `import areal` sets it); the default after."""
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    yield
    asyncio.set_event_loop_policy(None)


async def _running_loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


def test_gathers_of_every_size_complete_on_uvloop_with_no_transport_error(
    uvloop_policy: None, shared_workers: list[WorkerProcess], caplog: pytest.LogCaptureFixture
) -> None:
    node = shared_workers[0].node
    values = {
        (f"uv-{i}", "x"): torch.arange(n, dtype=torch.int64) for i, n in enumerate((0, 1, 700, 300_000))
    }
    with (
        caplog.at_level(logging.ERROR, logger="asyncio"),
        ShardClient(timeout=30.0, same_host=False) as client,
    ):
        assert isinstance(client.run(_running_loop()), uvloop.Loop)
        client.put(node, values)
        for _ in range(3):  # connections are reused between requests
            got = client.fetch([(node, task, field) for task, field in values])
            assert all(torch.equal(g, w) for g, w in zip(got, values.values()))
        client.delete(node, task_ids=[task for task, _ in values])
    assert not [r for r in caplog.records if "Fatal error" in r.getMessage()], caplog.text
