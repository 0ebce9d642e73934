"""The client's progress watchdog (`http_recv.until_stalled`), which gathers and puts share, and
how a put in staged parts stops once one part finds the worker unreachable; asyncio only, no
socket. Across real hosts with a pulled cable: tests/system/test_cluster_faults.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from distbatch.client.http_recv import StalledTransfer, until_stalled
from distbatch.client.shard_paths import _failures_until_unreachable
from distbatch.errors import ServerError, WorkerUnavailableError

STALL = 0.2
SLACK = 0.5  # seconds, for a loaded machine


class Transfer:
    """A fake transfer: `work()` waits for `seconds`, moving `position` by `step` every `tick`
    (None while not begun); records whether it was cut and cancelled, in which order."""

    def __init__(self, seconds: float, step: int = 1, tick: float = 0.05, begins_after: float = 0.0):
        self.seconds, self.step, self.tick, self.begins_after = seconds, step, tick, begins_after
        self.position: int | None = None
        self.events: list[str] = []

    async def work(self) -> str:
        try:
            await asyncio.sleep(self.begins_after)
            self.position = 0
            end = time.monotonic() + self.seconds
            while time.monotonic() < end:
                await asyncio.sleep(self.tick)
                self.position += self.step
            return "done"
        except asyncio.CancelledError:
            self.events.append("cancelled")
            raise

    def cut(self) -> None:
        self.events.append("cut")

    def watched(self, stall: float = STALL, sending: bool = False) -> Any:
        return until_stalled(self.work(), lambda: self.position, stall, sending=sending, cut=self.cut)


def test_a_transfer_that_keeps_moving_is_never_cut_however_long_it_takes() -> None:
    transfer = Transfer(seconds=STALL * 3)
    assert asyncio.run(transfer.watched()) == "done"
    assert transfer.events == []


@pytest.mark.parametrize("sending", [False, True])
def test_a_transfer_that_stops_moving_is_cut_then_cancelled_after_the_stall_timeout(sending: bool) -> None:
    transfer = Transfer(seconds=60, step=0)  # connected, but nothing ever moves
    start = time.monotonic()
    with pytest.raises(StalledTransfer, match="stalled") as info:
        asyncio.run(transfer.watched(sending=sending))
    elapsed = time.monotonic() - start
    assert STALL <= elapsed <= STALL * 1.25 + SLACK, elapsed
    assert transfer.events == ["cut", "cancelled"]  # its queued bytes dropped before it ends
    assert info.value.seconds == STALL and info.value.moved == 0 and info.value.sending is sending
    assert ("went out" in str(info.value)) is sending


def test_progress_then_a_stall_reports_what_moved() -> None:
    async def run() -> None:
        transfer = Transfer(seconds=60, step=0)
        watched = asyncio.ensure_future(transfer.watched())
        await asyncio.sleep(0.1)
        transfer.position = 1234  # some bytes moved, then nothing more
        with pytest.raises(StalledTransfer) as info:
            await watched
        assert info.value.moved == 1234

    asyncio.run(run())


def test_the_clock_does_not_run_before_the_transfer_begins() -> None:
    """A position of None (a connection being made, under its own timeout) is not a stall."""
    transfer = Transfer(seconds=STALL, begins_after=STALL * 3)
    assert asyncio.run(transfer.watched()) == "done"


def test_a_caller_giving_up_cuts_the_transfer_too() -> None:
    async def run() -> Transfer:
        transfer = Transfer(seconds=60)
        watched = asyncio.ensure_future(transfer.watched())
        await asyncio.sleep(0.1)
        watched.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watched
        await asyncio.sleep(0)  # the work sees its cancellation
        return transfer

    assert asyncio.run(run()).events == ["cut", "cancelled"]


def test_errors_of_the_work_pass_through() -> None:
    async def fails() -> None:
        raise ConnectionResetError("reset")

    with pytest.raises(ConnectionResetError):
        asyncio.run(until_stalled(fails(), lambda: 0, STALL))


def test_staged_parts_stop_once_one_finds_the_worker_unreachable() -> None:
    """The parts still running or queued are cancelled at once: they would each wait out their
    own timeouts on the same silent worker. Other failures leave the other parts to finish."""
    finished: list[str] = []

    async def part(name: str, seconds: float, error: Exception | None = None) -> str:
        await asyncio.sleep(seconds)
        if error is not None:
            raise error
        finished.append(name)
        return name

    async def run() -> tuple[list[BaseException], float]:
        start = time.monotonic()
        unreachable = WorkerUnavailableError("10.0.0.1:1", "stalled")
        failures = await _failures_until_unreachable(
            [part("fast", 0.0), part("stalled", 0.05, unreachable), part("queued", 30.0)]
        )
        return failures, time.monotonic() - start

    failures, elapsed = asyncio.run(run())
    assert [type(f) for f in failures] == [WorkerUnavailableError] and elapsed < 5.0
    assert finished == ["fast"]

    async def answered() -> list[BaseException]:
        broken = ServerError("10.0.0.1:1", 500, "internal_error", "boom")
        return await _failures_until_unreachable([part("a", 0.0, broken), part("b", 0.1)])

    finished.clear()
    failures = asyncio.run(answered())
    assert [type(f) for f in failures] == [ServerError] and finished == ["b"]
    assert asyncio.run(_failures_until_unreachable([part("c", 0.0)])) == []
