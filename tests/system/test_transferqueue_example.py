"""examples/transferqueue_backend.py runs as a user would run it: a GRPO step through
TransferQueue's API with Distbatch as its storage, workers started and stopped by it; and so
does the session of the guide's "Inside verl" page, which starts Ray with plain `ray.init()`
as verl does (here, in a Ray chain of the suite's scheduler, not among the guide's pages)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
from docs_support import GUIDE, python_blocks, run_blocks

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


@contextlib.contextmanager
def plain_ray_init_allowed() -> Iterator[None]:
    """For a page whose session calls plain `ray.init()`, as its readers do: skipped where Ray
    or TransferQueue is missing (unless `scripts/test` requires them); meanwhile, Ray's settings
    for a closed machine in the environment (no usage stats, no auth token written to ~) and
    `RAY_ADDRESS=local`; anything the page left running stopped."""
    if os.environ.get("DISTBATCH_REQUIRE_TQ") != "1":
        pytest.importorskip("transfer_queue")
        pytest.importorskip("ray")
    import ray

    from distbatch.launch.ray_actors import prepare_ray_environment

    with mock.patch.dict(os.environ):
        # A cluster of its own: plain `ray.init()` joins a local one that is running, and the
        # suite's other processes start theirs (which then stop under it).
        os.environ["RAY_ADDRESS"] = "local"
        prepare_ray_environment()
        try:
            yield
        finally:
            import distbatch.transferqueue as dtq

            dtq.close()
            ray.shutdown()


def test_the_verl_pages_session_runs_with_plain_ray_init(capsys: pytest.CaptureFixture[str]) -> None:
    """Each print's output is the comment under it."""
    page = GUIDE / "transferqueue-backend.md"
    with plain_ray_init_allowed():
        run_blocks(page)
    expected = re.findall(r"^print\(.*\n# (.*)$", "".join(python_blocks(page)), re.M)
    out = capsys.readouterr().out
    assert expected and out.splitlines()[-len(expected) :] == expected, out
