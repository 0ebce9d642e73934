"""examples/transferqueue_backend.py runs as a user would run it: a GRPO step through
TransferQueue's API with Distbatch as its storage, workers started and stopped by it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "transferqueue_backend.py"

if os.environ.get("DISTBATCH_REQUIRE_TQ") != "1":
    pytest.importorskip("transfer_queue")
    pytest.importorskip("ray")


def test_the_example_runs_a_grpo_step_through_transferqueue() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--prompts", "4", "--n", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("[Distbatch]")]
    assert "8 samples" in lines[0] and "torch.jagged, torch.int64" in lines[0]
    assert lines[1].endswith("keys left: 0")
    assert lines[2].endswith("distbatch workers stopped: 1")
