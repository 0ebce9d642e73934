"""Sync methods and their async twins come from one body (`distbatch.twins`), so the two forms of
a verb can never drift apart: same checks, same work, same signature."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Coroutine
from typing import Any

import pytest

from distbatch import ShardClient, WorkerGroup
from distbatch.twins import AWAITED, BLOCKING, Twin, awaiting, blocking, done, first_result, run_blocking


def _pairs(cls: type) -> list[str]:
    """Public names `x` of `cls` that have an async twin `ax` (`run` / `arun` excepted: they are
    the loop runner the twins stand on)."""
    return sorted(
        n
        for n in dir(cls)
        if not n.startswith("_") and n != "run" and hasattr(cls, "a" + n) and callable(getattr(cls, n))
    )


@pytest.mark.parametrize("cls", [ShardClient, WorkerGroup], ids=lambda c: c.__name__)
def test_every_sync_async_pair_is_generated_from_one_verb(cls: type) -> None:
    pairs = _pairs(cls)
    assert len(pairs) >= (11 if cls is ShardClient else 3), pairs
    for name in pairs:
        sync, twin = getattr(cls, name), getattr(cls, "a" + name)
        assert sync.__wrapped__ is twin.__wrapped__, f"{cls.__name__}.{name} and a{name} have two bodies"
        assert inspect.iscoroutinefunction(twin) and not inspect.iscoroutinefunction(sync)
        assert inspect.signature(sync).parameters == inspect.signature(twin).parameters
        assert sync.__doc__ and sync.__doc__ == twin.__doc__


class _Runner:
    """A loop thread of its own, as a client has: the verbs must run there, not on the caller's."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.checked_in: list[str] = []

    @property
    def loop_runner(self) -> _Runner:
        return self

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(5)

    async def arun(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def _where_verb(self, label: str) -> Coroutine[Any, Any, tuple[str, str]]:
        """Checks run in the caller; the work on the runner's loop thread."""
        if not label:
            raise ValueError("label must not be empty")
        self.checked_in.append(threading.current_thread().name)

        async def work() -> tuple[str, str]:
            return label, threading.current_thread().name

        return work()

    where = blocking(_where_verb)
    awhere = awaiting(_where_verb)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def test_both_twins_check_in_the_caller_and_work_on_the_loop_thread() -> None:
    runner = _Runner()
    try:
        caller = threading.current_thread().name
        assert runner.where("sync") == ("sync", runner.thread.name)
        assert asyncio.run(runner.awhere("async")) == ("async", runner.thread.name)
        assert runner.checked_in == [caller, caller]
        with pytest.raises(ValueError, match="must not be empty"):
            runner.where("")
        with pytest.raises(ValueError, match="must not be empty"):
            asyncio.run(runner.awhere(""))
        assert len(runner.checked_in) == 2  # refused before any work was built
    finally:
        runner.close()


def test_helpers_for_verbs_with_nothing_to_do_or_one_target() -> None:
    async def many() -> list[int]:
        return [7, 8]

    assert asyncio.run(done(3)) == 3
    assert asyncio.run(first_result(many())) == 7


def test_a_twin_body_runs_to_its_end_without_a_loop_when_blocking_and_awaits_when_awaited() -> None:
    """`Twin` bodies (a batch's verbs): blocking steps run in the caller's thread, no event loop."""
    calls: list[str] = []

    def fetch(x: int) -> int:
        calls.append(f"blocking in {threading.current_thread().name}")
        return x + 1

    async def afetch(x: int) -> int:
        calls.append("awaited")
        await asyncio.sleep(0)
        return x + 1

    async def body(twin: Twin) -> int:
        first = await twin.call(fetch, afetch, 1)
        return await twin.offload(lambda: first * 10)

    assert run_blocking(body(BLOCKING)) == 20
    assert calls == [f"blocking in {threading.current_thread().name}"]
    assert asyncio.run(body(AWAITED)) == 20
    assert calls[-1] == "awaited"


def test_a_twin_body_that_suspends_under_blocking_is_an_error() -> None:
    async def body(twin: Twin) -> None:
        await asyncio.sleep(0)  # not through the twin: would need a loop

    with pytest.raises(RuntimeError, match="suspended under BLOCKING"):
        run_blocking(body(BLOCKING))
