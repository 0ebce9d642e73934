"""The traffic job, examples/grpo_pipeline.py, end to end on real workers: the controller moves
metadata only."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

TINY = [
    "--steps",
    "2",
    "--prompts",
    "4",
    "--n",
    "4",
    "--mean-len",
    "4096",
    "--max-len",
    "8192",
    "--rollout-workers",
    "2",
    "--train-workers",
    "2",
]


@pytest.fixture(scope="module")
def reports(grpo: ModuleType) -> tuple[object, object]:
    """(distributed, centralised) reports of the same tiny job."""
    args = grpo.parse_args(TINY)
    distributed = grpo.run_pipeline(args, centralised=False, quiet=True)
    centralised = grpo.run_pipeline(args, centralised=True, quiet=True)
    return distributed, centralised


def test_distributed_controller_moves_metadata_only(reports: tuple) -> None:
    distributed, _ = reports
    assert distributed.mode == "distributed"
    assert len(distributed.steps) == 2
    for step in distributed.steps:
        ratio = step.controller_bytes / step.worker_bytes
        print(
            f"step {step.step}: controller {step.controller_bytes:,} B, workers {step.worker_bytes:,} B, "
            f"ratio {ratio:.4%}, rank tokens {step.rank_tokens}, loss {step.mean_loss:+.5f}"
        )
        assert step.worker_bytes > 0
        assert ratio < 0.01, f"step {step.step}: controller moved {ratio:.2%} of the worker bytes"


def test_stores_are_empty_after_the_run(reports: tuple) -> None:
    for report in reports:
        assert report.shards_left == 0, report.mode


def test_steps_are_complete_balanced_and_finite(reports: tuple) -> None:
    for report in reports:
        for step in report.steps:
            assert step.tasks == 4 * 4
            assert step.tokens > 4 * 4 * 32  # every sequence has at least its prompt
            assert len(step.rank_tokens) == 2 and sum(step.rank_tokens) == step.tokens
            assert min(step.rank_tokens) > 0
            assert step.balance < 1.5, f"{report.mode} step {step.step}: rank tokens {step.rank_tokens}"
            assert math.isfinite(step.mean_loss)
            assert step.seconds > 0


def test_centralised_mode_moves_the_data_through_the_controller(reports: tuple) -> None:
    distributed, centralised = reports
    assert centralised.mode == "centralised"
    for d, c in zip(distributed.steps, centralised.steps):
        print(
            f"step {c.step}: centralised controller {c.controller_bytes:,} B vs distributed "
            f"{d.controller_bytes:,} B (worker bytes {d.worker_bytes:,} B)"
        )
        assert (c.tasks, c.tokens) == (d.tasks, d.tokens)
        assert sorted(c.rank_tokens) == sorted(d.rank_tokens)
        assert c.controller_bytes > d.worker_bytes / 2
        assert c.controller_bytes > 50 * d.controller_bytes
        # the same computation, wherever the data went
        assert c.mean_loss == pytest.approx(d.mean_loss, rel=1e-4, abs=1e-6)


def test_the_comparison_says_what_one_host_can_and_cannot_show(reports: tuple, grpo: ModuleType) -> None:
    """The demo's words: the controller's bytes (what it proves), why time shows no win on one
    host, and what to try next, whichever mode was faster this time."""
    distributed, centralised = reports
    text = "\n".join(grpo.what_it_shows([distributed, centralised]))
    ratio = centralised.totals()[1] / distributed.totals()[1]
    assert f"({ratio:,.0f}x more):\n  distributed, it handles metadata only" in text
    assert "On one host both modes share the same\n  cores and the same loopback" in text
    assert "nothing to win\n  here" in text
    assert "Try next" in text and "examples/streaming_pipeline.py" in text
    alone = "\n".join(grpo.what_it_shows([distributed]))
    assert "Try next" in alone and "x more" not in alone


def test_try_next_names_the_venv_and_what_ray_needs(reports: tuple, grpo: ModuleType) -> None:
    """After scripts/demo, plain `python` has no distbatch and the venv has no Ray: the lines say
    .venv/bin/... (or activate it), and to install Ray before --launcher ray."""
    text = "\n".join(grpo.what_it_shows(list(reports)))
    tried = text.split("Try next", 1)[1].splitlines()
    assert "source .venv/bin/activate" in tried[0]
    commands = [line.split("#", 1)[0].strip() for line in tried[1:]]
    assert commands == [
        ".venv/bin/python examples/streaming_pipeline.py",
        '.venv/bin/pip install -e ".[ray]"',
        ".venv/bin/python examples/grpo_pipeline.py --launcher ray",
        ".venv/bin/distbatch status HOST:PORT",
    ]


def test_launcher_ray_without_ray_says_what_to_install_in_one_line(
    grpo: ModuleType, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed (scripts/demo installs no Ray)
    assert grpo.main(["--launcher", "ray", "--steps", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing started
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("grpo_pipeline.py: --launcher ray needs Ray") and 'pip install -e ".[ray]"' in err


def test_the_docs_show_what_the_job_prints_now(grpo: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engines guide pastes the traffic job's output (--compare, default sizes). Its byte
    counts are deterministic, so step 0's line of each mode must be what a run prints today
    (they went stale once: 56.8 kB, 0.88%, after the controller's traffic grew). As users run
    it: same-host gathers over shared memory (the suite turns them off).

    Long (20-90 s): it runs the job itself, both modes, to compare its output with the docs."""
    monkeypatch.delenv("DISTBATCH_SHM")
    args = grpo.parse_args(["--steps", "1"])
    for centralised in (False, True):
        report = grpo.run_pipeline(args, centralised=centralised, quiet=True)
        step = report.steps[0]
        share = step.controller_bytes / (step.worker_bytes + step.controller_bytes)
        line = (
            f"[{report.mode}] step 0: {step.tasks} tasks, {step.tokens:,} tokens | "
            f"worker->worker {grpo._mb(step.worker_bytes)} | "
            f"through controller {grpo._mb(step.controller_bytes)} ({share:.2%}) |"
        )
        page = ROOT / "docs" / "guide" / "engines.md"
        assert line in page.read_text(), f"{page.name} does not show the job's {line!r}"


def test_the_main_job_over_shared_memory_gives_the_same_steps(
    grpo: ModuleType, reports: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers on one host gather from each other through shared memory (the suite runs with
    `DISTBATCH_SHM=0`; here it is on): same tasks, tokens, balance and loss as over HTTP, and
    the controller still moves metadata only.

    Long (10-40 s): the traffic job runs twice, over shared memory and over HTTP, to compare every
    step."""
    monkeypatch.delenv("DISTBATCH_SHM")
    over_shm = grpo.run_pipeline(grpo.parse_args(TINY), centralised=False, quiet=True)
    over_http, _ = reports
    assert over_shm.shards_left == 0
    for s, h in zip(over_shm.steps, over_http.steps, strict=True):
        assert (s.tasks, s.tokens, s.rank_tokens) == (h.tasks, h.tokens, h.rank_tokens)
        assert math.isclose(s.mean_loss, h.mean_loss, rel_tol=1e-5)
        # The same shard bytes, served by reference (HTTP also counts its containers' headers).
        assert h.worker_bytes * 0.98 <= s.worker_bytes <= h.worker_bytes
        assert s.controller_bytes / s.worker_bytes < 0.01
