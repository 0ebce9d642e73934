"""`init_local_ray` starts a new cluster again when Ray says its node timed out starting (Ray
gives a new node a fixed 30 s to register, which a busy machine can miss), and only then.
Ray's `init` and `shutdown` are stand-ins here: no cluster starts. (Not a unit test only because
importing Ray costs every unit-tier process a second.)"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("ray")

from distbatch.launch import ray_actors  # noqa: E402

TIMED_OUT = (
    "The current node timed out during startup. This could happen because some of the raylet "
    "failed to startup or the GCS has become overloaded."
)


class FakeRay:
    def __init__(self, failures: list[Exception]) -> None:
        self.failures, self.inits, self.shutdowns = failures, [], 0

    def init(self, **options: Any) -> str:
        self.inits.append(options)
        if self.failures:
            raise self.failures.pop(0)
        return "context"

    def shutdown(self) -> None:
        self.shutdowns += 1


def started(monkeypatch: pytest.MonkeyPatch, failures: list[Exception]) -> FakeRay:
    fake = FakeRay(failures)
    monkeypatch.setattr(ray_actors.ray, "init", fake.init)
    monkeypatch.setattr(ray_actors.ray, "shutdown", fake.shutdown)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for name in ("RAY_USAGE_STATS_ENABLED", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        monkeypatch.setenv(name, "")  # restored after the test, whatever prepare_ray_environment sets
    return fake


def test_a_node_that_timed_out_starting_is_started_again(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = started(monkeypatch, [Exception(TIMED_OUT), Exception(TIMED_OUT)])
    assert ray_actors.init_local_ray(num_cpus=4) == "context"
    assert len(fake.inits) == 3 and fake.shutdowns == 2
    assert all(options["address"] == "local" and options["num_cpus"] == 4 for options in fake.inits)


def test_it_gives_up_after_its_attempts_and_other_errors_are_not_retried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = started(monkeypatch, [Exception(TIMED_OUT)] * ray_actors.NEW_CLUSTER_ATTEMPTS)
    with pytest.raises(Exception, match="timed out during startup"):
        ray_actors.init_local_ray()
    assert len(fake.inits) == ray_actors.NEW_CLUSTER_ATTEMPTS
    fake = started(monkeypatch, [ValueError("bad option")])
    with pytest.raises(ValueError, match="bad option"):
        ray_actors.init_local_ray()
    assert len(fake.inits) == 1 and fake.shutdowns == 0
