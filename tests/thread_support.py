"""Test helper: run a blocking call on a thread and learn when and how it ended."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


def run_in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run `fn` on a daemon thread; the dict gets `value` or `error`, and `at` (monotonic) when done."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # handed to the test thread
            outcome["error"] = exc
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome
