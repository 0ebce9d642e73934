"""The bulk-loop GC pause never takes control of the collector away from the application."""

from __future__ import annotations

import gc
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
