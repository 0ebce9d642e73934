"""The main job, examples/grpo_train.py: a policy learns through distbatch, and the data plane
changes nothing it carries (distributed and centralised, shared memory and HTTP: the same
rewards at every step and bit-identical weights)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from distbatch import set_default_client

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS = 30


@pytest.fixture(scope="module")
def job() -> Iterator[ModuleType]:
    sys.path.insert(0, str(EXAMPLES))
    try:
        import grpo_train

        yield grpo_train
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.fixture(scope="module")
def runs(job: ModuleType) -> tuple[object, object]:
    """The same seed twice: distributed over shared memory, then centralised over HTTP only."""
    args = job.parse_args(["--steps", str(STEPS), "--prompts", "24", "--max-tokens", "512"])
    with pytest.MonkeyPatch.context() as env:
        env.delenv("DISTBATCH_SHM")  # the suite runs on HTTP unless a test says otherwise
        set_default_client(None)  # a client that sees it
        try:
            distributed = job.run(args, centralised=False, quiet=True)
        finally:
            set_default_client(None)
    args.http = True
    centralised = job.run(args, centralised=True, quiet=True)
    return distributed, centralised


def test_the_policy_learns(runs: tuple) -> None:
    """From chance (0.1: one digit in ten) to well above it in a few dozen steps."""
    rewards = runs[0].rewards
    print(" ".join(f"{r:.3f}" for r in rewards))
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert 0.07 < first < 0.13, rewards
    assert last > first + 0.06, rewards


def test_the_data_plane_changes_nothing_it_carries(job: ModuleType, runs: tuple) -> None:
    distributed, centralised = runs
    assert len(distributed.steps) == len(centralised.steps) == STEPS
    assert job.identical(distributed, centralised)
    assert all(math.isfinite(s.loss) for s in distributed.steps)
    # The identity is not vacuous: the weights moved, and another seed's are elsewhere.
    assert distributed.rewards[0] != distributed.rewards[-1]


def test_each_run_took_the_path_it_says(runs: tuple) -> None:
    distributed, centralised = runs
    assert sum(s.shm_bytes for s in distributed.steps) > 0
    assert sum(s.http_bytes for s in centralised.steps) > 0
    assert sum(s.shm_bytes for s in centralised.steps) == 0
    # Distributed, the controller moves metadata; centralised, every batch, gradient and weight.
    ours = sum(s.controller_bytes for s in distributed.steps)
    theirs = sum(s.controller_bytes for s in centralised.steps)
    assert theirs > 20 * ours, (ours, theirs)
    for report in runs:
        assert report.shards_left == 0, report.mode


def test_micro_batches_are_cut_by_tokens(runs: tuple) -> None:
    """24 prompts x 8 responses of 3-6 digits (sequences of 7-13 tokens, about 1,000 per rank)
    over 2 ranks, under 512 tokens a micro-batch: at least two micro-batches per rank, the same
    count on both (else the ranks would not sum the same gradients, which `identical` checks)."""
    for step in runs[0].steps:
        assert 24 * 8 * 3 <= step.tokens <= 24 * 8 * 6  # response tokens
        assert 2 <= step.micro_batches <= 4


def test_the_script_runs_as_scripts_demo_runs_it(tmp_path: Path) -> None:
    """`--compare` in a process of its own, workers and all: the table, the check, the plot."""
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "grpo_train.py"),
            "--compare",
            "--steps",
            "3",
            "--prompts",
            "4",
            "--out",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env={**os.environ},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert out.splitlines()[1].split() == ["step", "0", "1", "2"]
    assert "identical rewards at every step and bit-identical final weights" in out
    assert out.count("stores empty: yes") == 2
    assert (tmp_path / "run" / "reward.png").stat().st_size > 10_000
    curves = json.loads((tmp_path / "run" / "reward.json").read_text())
    assert curves["distributed"] == curves["centralised"] and len(curves["distributed"]) == 3
