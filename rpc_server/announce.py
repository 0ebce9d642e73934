"""A durable worker started again at a new address tells a served controller where it now is.

With `--controller HOST:PORT`, the worker asks the controller (`serve_controller`) to move the
tasks it knew at each of the worker's earlier addresses to the new one (`POST
/v1/controller/move_node`, with the worker's token), so trainers find them without anyone
calling `Controller.move_node`. It runs beside the worker, retried for a while (the controller
may be restarting too); what came of it is in `/v1/stats` (`durable.controller`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from typing import Any

logger = logging.getLogger(__name__)

ATTEMPTS = 30  # about a minute of tries, backing off to 4 s
FIRST_BACKOFF = 0.1
MAX_BACKOFF = 4.0
TIMEOUT = 10.0


class ControllerNotice:
    """Tells `controller` that the worker at each of `earlier` now serves at `node` (in a thread)."""

    def __init__(self, controller: str, token: str | None, earlier: list[str], node: str) -> None:
        self.controller, self.token, self.earlier, self.node = controller, token, list(earlier), node
        self.moved: dict[str, int] = {}
        self.error: str | None = None
        self.done = threading.Event()

    def start(self) -> ControllerNotice:
        threading.Thread(target=self._run, name="controller-notice", daemon=True).start()
        return self

    def as_dict(self) -> dict[str, Any]:
        return {
            "address": self.controller,
            "moved": dict(self.moved),
            "done": self.done.is_set(),
            "error": self.error,
        }

    def _run(self) -> None:
        backoff = FIRST_BACKOFF
        try:
            for old in self.earlier:
                for attempt in range(ATTEMPTS):
                    try:
                        self.moved[old] = self._move(old)
                        self.error = None
                        break
                    except (OSError, ValueError) as exc:  # unreachable, or an answer we cannot use
                        self.error = f"{type(exc).__name__}: {exc}"
                        if attempt + 1 == ATTEMPTS or _refused(exc):
                            logger.warning(
                                "could not tell the controller at %s that %s is now %s: %s",
                                self.controller,
                                old,
                                self.node,
                                self.error,
                            )
                            return
                        time.sleep(backoff)
                        backoff = min(backoff * 2, MAX_BACKOFF)
                logger.info(
                    "told the controller at %s: %d task(s) of %s are now at %s",
                    self.controller,
                    self.moved[old],
                    old,
                    self.node,
                )
        finally:
            self.done.set()

    def _move(self, old: str) -> int:
        body = json.dumps({"old": old, "new": self.node}).encode()
        request = urllib.request.Request(
            f"http://{self.controller}/v1/controller/move_node",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=TIMEOUT) as response:
            answer = json.loads(response.read())
        moved = answer.get("moved") if isinstance(answer, dict) else None
        if not isinstance(moved, int):
            raise ValueError(f"the controller answered {answer!r}")
        return moved


def _refused(error: Exception) -> bool:
    """An answer that trying again will not change (a 4xx: a wrong token, a bad address)."""
    return isinstance(error, urllib.error.HTTPError) and 400 <= error.code < 500
