"""A large gather shows a tqdm bar when stderr is a terminal, and stays silent otherwise."""

from __future__ import annotations

import io
import sys

import pytest
import torch

from distbatch import DistributedBatchMemory
from distbatch.launch import WorkerProcess


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def remote_batch(worker: WorkerProcess) -> DistributedBatchMemory:
    local = DistributedBatchMemory.from_dict(
        {"x": [torch.arange(n, dtype=torch.float32) for n in (1000, 3000)]}
    )
    return local.to_remote(worker.node)


def test_gather_over_threshold_on_a_terminal_shows_a_bar(
    remote_batch: DistributedBatchMemory, monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(DistributedBatchMemory, "progress_min_bytes", 1000)
    values = remote_batch["x"]
    assert [len(v) for v in values] == [1000, 3000]
    shown = terminal.getvalue()
    assert "gather 2 tasks" in shown and "16.0k" in shown  # 16,000 bytes, tqdm's unit scale


def test_small_gather_or_no_terminal_shows_nothing(
    remote_batch: DistributedBatchMemory, monkeypatch: pytest.MonkeyPatch
) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    remote_batch["x"]  # under the default 64 MiB threshold
    assert terminal.getvalue() == ""
    not_a_terminal = io.StringIO()
    monkeypatch.setattr(sys, "stderr", not_a_terminal)
    monkeypatch.setattr(DistributedBatchMemory, "progress_min_bytes", 0)
    DistributedBatchMemory.from_meta(remote_batch.meta).to_local()
    assert not_a_terminal.getvalue() == ""
