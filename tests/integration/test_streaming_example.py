"""The streaming example runs end to end in separate rank processes and checks itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "streaming_pipeline.py"


@pytest.mark.parametrize("sampler", ["seqlen", "rank"])
def test_streaming_example_peers_identical_ranks_disjoint(sampler: str) -> None:
    """Long (15-35 s): the example as a user runs it, a new interpreter whose producer and
    consumer processes each import torch and start their own workers."""
    args = ["--sampler", sampler, "--prompts-per-producer", "4", "--batch-size", "4", "--produce-delay", "0"]
    run = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 TP peers identical: True" in run.stdout
    assert "ranks disjoint: True; every task delivered once: True" in run.stdout
    assert "shards left on workers: 0" in run.stdout
