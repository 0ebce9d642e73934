"""The controller's memory of `get_meta` answers by request id, so a retry (after a lost reply or a
failed gather) gets the same tasks instead of new ones. Bounded in count and in age."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from distbatch.errors import InvalidArgumentError

DEFAULT_REQUEST_MEMORY = 4096
DEFAULT_REQUEST_TTL = 600.0


@dataclass
class Answer:
    """What one `get_meta` request id was answered: the request, the tasks handed out, when."""

    request: tuple[Any, ...]
    partition_id: str
    task_ids: list[str]
    at: float


class AnswerMemory:
    """At most `capacity` answers, each for `ttl` seconds, oldest forgotten first. Not
    thread-safe: the controller calls it with its lock held."""

    def __init__(self, capacity: int = DEFAULT_REQUEST_MEMORY, ttl: float = DEFAULT_REQUEST_TTL) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise InvalidArgumentError(f"request_memory must be an int >= 0, got {capacity!r}")
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl >= 0:  # NaN too
            raise InvalidArgumentError(f"request_ttl must be a number of seconds >= 0, got {ttl!r}")
        self.capacity = capacity
        self.ttl = float(ttl)
        self._answers: OrderedDict[str, Answer] = OrderedDict()  # by request id, oldest first

    def lookup(self, request_id: str, request: tuple[Any, ...]) -> Answer | None:
        """The answer remembered for `request_id` (None if none); an id reused for another
        request is an `InvalidArgumentError`."""
        self._expire()
        answer = self._answers.get(request_id)
        if answer is not None and answer.request != request:
            raise InvalidArgumentError(
                f"request_id {request_id!r} was already used for another get_meta request "
                "(another partition, task, fields, batch size or sampling config): use a new id per request"
            )
        return answer

    def remember(
        self, request_id: str, request: tuple[Any, ...], partition_id: str, task_ids: list[str]
    ) -> None:
        if self.capacity == 0:
            return
        self._answers[request_id] = Answer(request, partition_id, list(task_ids), time.monotonic())
        self._answers.move_to_end(request_id)
        while len(self._answers) > self.capacity:
            self._answers.popitem(last=False)

    def drop(self, request_id: str) -> None:
        self._answers.pop(request_id, None)

    def forget(self, partition_id: str, task_ids: Iterable[str] | None = None) -> None:
        """Drop remembered answers of the partition (those naming any of `task_ids`, if given)."""
        gone = None if task_ids is None else set(task_ids)
        for request_id, answer in list(self._answers.items()):
            if answer.partition_id == partition_id and (gone is None or gone.intersection(answer.task_ids)):
                del self._answers[request_id]

    def clear(self) -> None:
        self._answers.clear()

    def _expire(self) -> None:
        limit = time.monotonic() - self.ttl
        while self._answers:
            oldest = next(iter(self._answers.values()))
            if oldest.at >= limit:
                break
            self._answers.popitem(last=False)
