"""`Controller` and `RemoteController` both implement `ControllerAPI`, with the same signatures,
so code written against one runs against the other."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

from distbatch import Controller, ControllerAPI, DistributedBatchMemory, RemoteController
from distbatch.controller.server import ControllerServer
from distbatch.dataloader import StreamingDataLoader, StreamingDataset


def _members() -> list[str]:
    return sorted(
        name
        for name in dir(ControllerAPI)
        if not name.startswith("_") and callable(getattr(ControllerAPI, name, None))
    )


def _parameters(function: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    """(name, kind, default) per parameter: what a caller relies on (annotations aside)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("implementation", [Controller, RemoteController], ids=lambda c: c.__name__)
def test_every_protocol_method_exists_with_the_same_signature(implementation: type) -> None:
    members = _members()
    assert "get_meta" in members and "put" in members
    for name in members:
        assert _parameters(getattr(implementation, name)) == _parameters(getattr(ControllerAPI, name)), name


def test_the_protocol_is_exactly_what_both_controllers_offer() -> None:
    """A method both controllers grow belongs in the protocol too, or code cannot rely on it."""

    def public(cls: type) -> set[str]:
        return {n for n in vars(cls) if not n.startswith("_") and callable(getattr(cls, n))}

    assert public(Controller) & public(RemoteController) == set(_members())


def test_real_instances_satisfy_the_protocol(serve: Callable[..., ControllerServer]) -> None:
    local = Controller()
    server = serve(local)
    remote = RemoteController(server.address)
    assert isinstance(local, ControllerAPI) and isinstance(remote, ControllerAPI)
    assert local.process_local is True and remote.process_local is False
    # The same calls through either give the same answers.
    local.create_partition("p", expected_fields=["x"])
    assert remote.partitions() == local.partitions() == ["p"]
    for controller in (local, remote):
        assert controller.production_status("p") == local.production_status("p")
        assert controller.get_meta("p", "train", ["x"], 1).status.name == "EMPTY"
    assert not isinstance(object(), ControllerAPI)


def test_the_loader_takes_either_and_refuses_a_local_one_in_worker_processes(
    serve: Callable[..., ControllerServer],
) -> None:
    local = Controller()
    remote = RemoteController(serve(local).address)
    for controller in (local, remote):
        dataset = StreamingDataset(controller, "p", "train", ["x"], batch_size=1)
        assert isinstance(next(iter([dataset])).controller, ControllerAPI)
    with pytest.raises(ValueError, match="cannot serve DataLoader worker processes") as refused:
        StreamingDataLoader(StreamingDataset(local, "p", "train", ["x"], batch_size=1), num_workers=1)
    # It names what a user imports (the public name), not the module it lives in.
    assert "(distbatch.serve_controller)" in str(refused.value)
    assert "distbatch.controller.server" not in str(refused.value)
    loader = StreamingDataLoader(StreamingDataset(remote, "p", "train", ["x"], batch_size=1), num_workers=1)
    assert loader.num_workers == 1
    assert DistributedBatchMemory().status.name == "EMPTY"
