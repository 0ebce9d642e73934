"""examples/gather_demo.py runs as its docstring says (it used to say `scripts/demo`, which runs
another example)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "gather_demo.py"


def test_the_docstring_says_how_to_run_it_and_that_runs() -> None:
    doc = ast.get_docstring(ast.parse(DEMO.read_text())) or ""
    assert "Run with `scripts/demo`" not in doc
    assert "`.venv/bin/python examples/gather_demo.py`" in doc and "--tasks 512" in doc
    done = subprocess.run(
        [sys.executable, "examples/gather_demo.py", "--tasks", "16", "--mean-len", "64"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env={**os.environ},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "from 2 workers, all bit-exact" in done.stdout and "shards left per worker: [0, 0]" in done.stdout
