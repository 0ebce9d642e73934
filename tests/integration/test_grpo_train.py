"""The main job, examples/grpo_train.py: its GRPO learns, and the data plane changes nothing it
carries (distributed and centralised, shared memory and HTTP: the same rewards at every step and
bit-identical weights), so the job learns through distbatch what it learns without it. The
demo (`scripts/demo`) shows the whole curve; here the learning runs in this process, without
workers (a few dozen steps of two runs of four workers would cost the suite a minute of CPU)."""

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
STEPS = 3


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
    args = job.parse_args(["--steps", str(STEPS), "--prompts", "8", "--max-tokens", "160"])
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


def test_the_grpo_of_the_job_learns(job: ModuleType) -> None:
    """The job's policy, sampling, reward and loss (`toy_policy`), in one process: from chance
    (0.1, one digit in ten) to well above it in 30 steps of 24 prompts x 8 responses."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the job's workers run; more threads spin on a busy machine
    try:
        means = _learn()
    finally:
        torch.set_num_threads(threads)
    first, last = sum(means[:5]) / 5, sum(means[-5:]) / 5
    assert 0.07 < first < 0.13, means
    assert last > first + 0.06, means


def _learn() -> list[float]:
    """30 steps of the job's GRPO in this process; the mean reward of each step."""
    import torch
    from toy_policy import grpo_advantages, grpo_token_loss, make_policy, prompt_for, reward, sample

    torch.manual_seed(0)
    policy = make_policy(0)
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    means = []
    for step in range(30):
        prompts = [prompt_for(0, step, p) for p in range(24)]
        ids, logprobs, advantages, rewards = [], [], [], []
        for length in sorted({len(d) for d, _ in prompts}):
            group = [(d, g) for d, g in prompts if len(d) == length]
            digits = torch.stack([d for d, _ in group]).repeat_interleave(8, 0)
            uniforms = torch.cat([torch.rand((8, length), generator=g) for _, g in group])
            responses, old = sample(policy, digits, uniforms, 1.0)
            scored = reward(digits, responses)
            rewards.append(scored)
            advantages.append(grpo_advantages(scored, 8))
            ids += list(torch.cat([digits, torch.full((len(digits), 1), 10), responses], 1))
            logprobs += list(old)
        lengths = torch.tensor([len(x) for x in ids])
        response_lengths = torch.tensor([len(x) for x in logprobs])
        loss = grpo_token_loss(
            policy,
            torch.cat(ids),
            torch.nn.functional.pad(lengths.cumsum(0), (1, 0)),
            torch.cat(logprobs),
            torch.nn.functional.pad(response_lengths.cumsum(0), (1, 0)),
            torch.cat(advantages),
            1.0,
        ) / int(response_lengths.sum())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        means.append(float(torch.cat(rewards).mean()))
    return means


def test_the_data_plane_changes_nothing_it_carries(job: ModuleType, runs: tuple) -> None:
    distributed, centralised = runs
    assert len(distributed.steps) == len(centralised.steps) == STEPS
    assert job.identical(distributed, centralised)
    assert all(math.isfinite(s.loss) for s in distributed.steps)
    # The identity is not vacuous: the policy changed from step to step.
    assert len(set(distributed.rewards)) == STEPS


def test_a_rollout_worker_killed_mid_step_changes_nothing(
    job: ModuleType, runs: tuple, tmp_path: Path
) -> None:
    """`--data-dir --kill-rollout 1`: durable workers; rollout worker 0 is SIGKILLed in the middle
    of step 1, holding its half of the step's samples, and started again on its directory. The
    step goes on with every sample (gathered from the new address) and the run is the run
    without the kill: the same rewards at every step, bit-identical weights."""
    args = job.parse_args(
        ["--steps", str(STEPS), "--prompts", "8", "--max-tokens", "160"]
        + ["--data-dir", str(tmp_path), "--kill-rollout", "1"]
    )
    killed = job.run(args, quiet=True)
    assert killed.restarts == 1 and killed.shards_left == 0
    assert job.identical(killed, runs[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollout0", "rollout1", "train0", "train1"]
    assert (tmp_path / "rollout0" / "node").read_text().count("\n") == 2  # served at two addresses


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
    """8 prompts x 8 responses of 3-6 digits (sequences of 7-13 tokens, about 320 per rank) over
    2 ranks, under 160 tokens a micro-batch: at least two micro-batches per rank, the same count
    on both (else the ranks would not sum the same gradients, which `identical` checks)."""
    for step in runs[0].steps:
        assert 8 * 8 * 3 <= step.tokens <= 8 * 8 * 6  # response tokens
        assert 2 <= step.micro_batches <= 5


def test_the_script_runs_as_scripts_demo_runs_it(tmp_path: Path) -> None:
    """The script in a process of its own, workers and all: the table, the summary, the plot
    (`scripts/demo` adds `--compare`, whose check the tests above make in this process)."""
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "grpo_train.py"),
            "--steps",
            "2",
            "--prompts",
            "2",
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
    assert out.splitlines()[1].split() == ["step", "0", "1"]
    assert "mean reward:" in out and "steps/s" in out
    assert out.count("stores empty: yes") == 1
    assert (tmp_path / "run" / "reward.png").stat().st_size > 10_000
    curves = json.loads((tmp_path / "run" / "reward.json").read_text())
    assert list(curves) == ["distributed"] and len(curves["distributed"]) == 2


def test_the_asynchronous_job_trains_on_policies_at_most_k_versions_old(job: ModuleType) -> None:
    """`--async 1 --partial 2`: rollout one step ahead of training through the controller, two
    digits per generation call (put as partial until whole); every step trains on a step's worth
    of tasks at most one version old, nothing is dropped (oldest first), and every store is empty
    at the end."""
    args = job.parse_args(
        ["--steps", "4", "--prompts", "4", "--async", "1", "--partial", "2"]
        + ["--rollout-workers", "1", "--train-workers", "1"]
    )
    report = job.run(args, quiet=True)
    assert report.mode == "async-1-partial-2" and len(report.steps) == 4
    served = {int(age): n for age, n in report.staleness["served"].items()}
    assert set(served) <= {0, 1} and sum(served.values()) == 4 * 4 * 8
    assert report.staleness["dropped"] == 0
    assert all(math.isfinite(s.loss) and 0 <= s.reward <= 1 for s in report.steps)
    assert report.shards_left == 0


def test_the_asynchronous_job_trains_on_every_task_of_a_rollout_worker_killed_between_steps(
    job: ModuleType, tmp_path: Path
) -> None:
    """`--async 1 --kill-rollout 2`: rollout worker 0 is SIGKILLed before training step 2, with
    rollout steps it made queued in the controller; started again on its directory, the
    controller is told where it went (`move_node`), and every task is trained on exactly once,
    none dropped, none lost; every store is empty at the end."""
    args = job.parse_args(
        ["--steps", "4", "--prompts", "4", "--async", "1", "--kill-rollout", "2"]
        + ["--rollout-workers", "2", "--train-workers", "1", "--data-dir", str(tmp_path)]
    )
    report = job.run(args, quiet=True)
    assert report.restarts == 1 and report.moved_tasks > 0
    assert sum(report.staleness["served"].values()) == 4 * 4 * 8 and report.staleness["dropped"] == 0
    assert report.shards_left == 0


def test_a_generation_resumed_chunk_by_chunk_is_the_generation_made_at_once(job: ModuleType) -> None:
    """`--partial`'s engine calls, with no weight update between them: `start` and `resume`, two
    digits a call, each growing the tasks' fields where they are (`extend`), give exactly what
    one `generate` call gives: the same tokens, log-probabilities, rewards and advantages."""
    import torch

    from distbatch import WorkerGroup

    env = {"PYTHONPATH": str(EXAMPLES)}
    kwargs = {"seed": 0, "temperature": 1.0}
    with WorkerGroup.local(1, "grpo_train:Rollout", engine_kwargs=kwargs, env=env) as rollout:
        common = {"step": 3, "n": 4, "seed": 0}
        generated = rollout.call("generate", [[0, 1, 2]], **common)[0]
        whole = generated.to_local()
        generated.clear()  # `start` puts the same task ids
        parts = rollout.call("start", [[0, 1, 2]], max_new=2, **common)
        calls = 1
        while "advantages" not in parts[0].fields:
            parts = rollout.call("resume", parts, max_new=2, **common)
            calls += 1
        resumed = parts[0]
        assert calls >= 3 and resumed.task_ids == whole.task_ids  # 3 to 6 digits: 2 to 3 calls more
        for name in ("input_ids", "logprobs"):
            assert all(torch.equal(a, b) for a, b in zip(resumed[name], whole[name])), name
        for name in ("rewards", "advantages"):
            assert torch.equal(resumed[name], whole[name]), name
        resumed.clear()
        assert rollout.stats()[0]["shards"] == 0
