"""The bulk-loop GC pause never takes control of the collector away from the application."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading

import pytest

from distbatch.gc_pause import GcPause, paused_gc


@pytest.fixture(autouse=True)
def restore_gc_state():
    """Each test may switch the collector off or change thresholds; put the process back."""
    enabled, threshold = gc.isenabled(), gc.get_threshold()
    yield
    gc.set_threshold(*threshold)
    (gc.enable if enabled else gc.disable)()


def _collections_during(body) -> int:
    """How many automatic collections start while `body()` runs."""
    seen = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(callback)
    try:
        body()
    finally:
        gc.callbacks.remove(callback)
    return len(seen)


def _allocate_containers() -> list:
    return [[i] for i in range(20_000)]  # 20k tracked objects: 28 gen-0 collections unpaused


def test_no_automatic_collection_inside_the_pause():
    gc.enable()
    gc.set_threshold(700, 10, 10)  # Python's defaults (the suite's processes collect less often)
    assert _collections_during(_allocate_containers) > 0  # the probe does see collections
    with paused_gc():
        assert _collections_during(_allocate_containers) == 0
    assert _collections_during(_allocate_containers) > 0  # and they come back after


def test_an_application_that_disables_gc_meanwhile_keeps_it_disabled():
    gc.enable()
    with paused_gc():
        gc.disable()  # a trainer that manages GC itself, e.g. from its main thread
    assert not gc.isenabled()


def test_a_collector_disabled_before_stays_disabled_and_enabled_stays_enabled():
    gc.disable()
    with paused_gc():
        pass
    assert not gc.isenabled()
    gc.enable()
    with paused_gc():
        pass
    assert gc.isenabled()


def test_thresholds_the_application_sets_meanwhile_are_kept():
    gc.set_threshold(700, 10, 10)
    with paused_gc():
        gc.set_threshold(5000, 20, 30)
    assert gc.get_threshold() == (5000, 20, 30)


def test_overlapping_pauses_restore_the_original_threshold_once_all_end():
    gc.set_threshold(700, 10, 10)
    pause = GcPause()  # a private instance: no other test's pause can overlap
    inside = threading.Barrier(3)
    release = threading.Event()

    def hold() -> None:
        with pause.paused():
            inside.wait(timeout=10)
            release.wait(timeout=10)

    threads = [threading.Thread(target=hold) for _ in range(2)]
    for thread in threads:
        thread.start()
    inside.wait(timeout=10)
    with pause.paused():
        assert gc.get_threshold()[0] > 700
    assert gc.get_threshold()[0] > 700  # two pauses still hold
    release.set()
    for thread in threads:
        thread.join(timeout=10)
    assert gc.get_threshold() == (700, 10, 10)


def test_a_threshold_of_zero_is_left_alone():
    gc.set_threshold(0)
    with paused_gc():
        assert gc.get_threshold()[0] == 0
    assert gc.get_threshold()[0] == 0


FREEZE_SCRIPT = """
import gc, json, sys
from distbatch.gc_pause import freeze_long_lived
if sys.argv[1] == "app-froze-first":
    gc.freeze()
before = gc.get_freeze_count()
first = freeze_long_lived()
after = gc.get_freeze_count()
second = freeze_long_lived()
print(json.dumps({"before": before, "first": first, "after": after, "second": second,
                  "again": gc.get_freeze_count()}))
"""


@pytest.mark.parametrize("case", ["alone", "app-froze-first"])
def test_freeze_long_lived_freezes_once_and_never_over_the_applications_own(case: str) -> None:
    """In a process of its own (a freeze lasts for the process): the first call freezes what is
    alive, a second does nothing; where the application froze first, nothing is done at all."""
    done = subprocess.run(
        [sys.executable, "-c", FREEZE_SCRIPT, case], capture_output=True, text=True, timeout=60, check=True
    )
    got = json.loads(done.stdout)
    if case == "alone":
        assert got["before"] == 0 and got["first"] is True and got["after"] > 1000
    else:
        assert got["before"] > 0 and got["first"] is False and got["after"] == got["before"]
    assert got["second"] is False and got["again"] == got["after"]
