"""Helpers the sampler tests share: drivers that run a sampler as the controller does, and checks of
its answers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from distbatch.samplers import (
    BaseSampler,
)

PID, TASK = "p", "t"
LEN_A = {0: 10, 1: 10, 2: 1, 3: 1, 4: 1, 5: 1, 6: 10, 7: 10}  # groups of 2: [20, 2, 2, 20]
LEN_ODD = dict(enumerate([2, 1, 1, 1, 1, 0, 0, 0, 3, 2, 2, 2]))  # groups of 4: [5, 1, 9]
LEN_C = dict(enumerate([3, 8, 1, 7, 2, 6]))  # groups of 1, three ranks: 9 / 9 / 9

# --------------------------------------------------------------------------- helpers


class FakePartition:
    """Stands in for the controller's partition: lengths per index for one field, calls recorded."""

    def __init__(self, lengths: Mapping[int, int], field: str = "input_ids") -> None:
        self.lengths = dict(lengths)
        self.field = field
        self.calls: list[tuple[list[int], str]] = []

    def sample_lengths(self, indexes: Sequence[int], field: str) -> list[int]:
        self.calls.append((list(indexes), field))
        if field != self.field:
            raise ValueError(f"no tensor field {field!r}")
        return [self.lengths[i] for i in indexes]


class Stream:
    """A minimal controller: ready = produced - consumed (per task); feeds samplers keyword args."""

    def __init__(self, sampler: BaseSampler, batch_size: int, lengths: Mapping[int, int] | None = None):
        self.sampler = sampler
        self.batch_size = batch_size
        self.produced: set[int] = set()
        self.consumed: dict[str, set[int]] = {}
        self.partition = FakePartition(lengths or {})

    def ready(self, task: str = TASK) -> list[int]:
        return sorted(self.produced - self.consumed.get(task, set()))

    def call(self, **cfg: Any) -> tuple[list[int], list[int]]:
        task = cfg.pop("task_name", TASK)
        pid = cfg.pop("partition_id", PID)
        ready = self.ready(task)
        # As the controller (and TransferQueue's): a batch's worth ready, or an answer in the cache.
        if len(ready) < self.batch_size and not self.sampler.has_cached_result(pid, task, cfg):
            return [], []
        sampled, consumed = self.sampler(
            ready,
            self.batch_size,
            partition_id=pid,
            task_name=task,
            partition=self.partition,
            **cfg,
        )
        self.consumed.setdefault(task, set()).update(consumed)
        return sampled, consumed

    def run(self, script: Sequence[tuple[Any, ...]]) -> None:
        """Steps: ("produce", idx) | ("clear", idx) | (cfg, sampled, consumed) expected for a call."""
        for step in script:
            if step[0] == "produce":
                self.produced.update(step[1])
            elif step[0] == "clear":  # what Controller.clear_tasks does: forget tasks, drop the cache
                self.produced.difference_update(step[1])
                for seen in self.consumed.values():
                    seen.difference_update(step[1])
                self.sampler.clear_cache(PID)
            else:
                cfg, want_sampled, want_consumed = step
                got = self.call(**cfg)
                assert got == (want_sampled, want_consumed), f"step {step}: got {got}"


def r(i: int) -> list[int]:
    return list(range(i))


def json_safe(value: Any) -> bool:
    """Only str keys, lists, ints and strs (what the state_dict contract promises)."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and json_safe(v) for k, v in value.items())
    if isinstance(value, list):
        return all(json_safe(v) for v in value)
    return isinstance(value, (str, int)) and not isinstance(value, bool)


def roundtrip(sampler: BaseSampler, make: Callable[[], BaseSampler]) -> BaseSampler:
    state = sampler.state_dict()
    assert json_safe(state), state
    fresh = make()
    fresh.load_state_dict(json.loads(json.dumps(state)))
    assert fresh.state_dict() == state
    return fresh

