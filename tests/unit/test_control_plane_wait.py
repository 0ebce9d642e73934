"""The control-plane run is judged by progress: it fails on a stall, never on a slow machine."""

from __future__ import annotations

import threading
import time

from tqdm import tqdm

from bench.control_plane import _Progress, _wait


def _bar() -> tqdm:
    return tqdm(disable=True)


def test_a_run_with_no_delivery_for_the_stall_bound_fails_as_stalled() -> None:
    progress = _Progress(["g"], tasks=4)
    progress.add("g", 1)
    started = time.monotonic()
    why = _wait(progress, deadline=started + 60, stall_seconds=0.3, bar=_bar())
    assert why is not None and "no task delivered for 0.3 s (1 delivered)" in why
    assert time.monotonic() - started < 30  # it did not wait for the backstop


def test_a_slow_run_that_keeps_delivering_outlasts_the_stall_bound() -> None:
    progress = _Progress(["g"], tasks=8)

    def deliver() -> None:
        for _ in range(8):
            time.sleep(0.15)  # each gap a quarter of the bound, the whole run twice it
            progress.add("g", 1)

    thread = threading.Thread(target=deliver)
    thread.start()
    why = _wait(progress, deadline=time.monotonic() + 60, stall_seconds=0.6, bar=_bar())
    thread.join()
    assert why is None and progress.finished()
