"""`scripts/_setup.sh` (what `scripts/demo` and `scripts/test` run first): it says which torch it
installs and from where, and does what it says.

It runs in a copy of the repository's scripts with a stand-in `.venv/bin/python` that has no
torch and records every `pip install` instead of downloading anything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAND_IN = """#!/usr/bin/env bash
if [ "$1" = "-c" ]; then exit 1; fi   # `import torch` fails: no torch yet
if [ "$1 $2" = "-m pip" ]; then shift 2; echo "$*" >> "$(dirname "$0")/pip.log"; exit 0; fi
exit 0
"""


def run_setup(tmp_path: Path, **env: str) -> tuple[str, list[str]]:
    """Source the setup script in a scratch copy; (what it printed, the pip installs it ran)."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "_setup.sh", tmp_path / "scripts" / "_setup.sh")
    for name in ("setup.cfg", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(STAND_IN)
    python.chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DISTBATCH_")}
    done = subprocess.run(
        ["bash", "-c", "source scripts/_setup.sh"],
        cwd=tmp_path,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout, (python.parent / "pip.log").read_text().splitlines()


def test_without_an_index_it_says_the_package_index_picks_the_build(tmp_path: Path) -> None:
    out, installs = run_setup(tmp_path)
    assert "installing torch==2.13.0 from your package index" in out and "CUDA build" in out
    assert installs[0] == "install -q torch==2.13.0"
    assert installs[1].startswith("install -q --disable-pip-version-check -e .[dev]")


def test_an_index_of_ones_choice_is_said_and_used(tmp_path: Path) -> None:
    index = "https://download.pytorch.org/whl/cpu"
    out, installs = run_setup(tmp_path, DISTBATCH_TORCH_INDEX=index)
    assert f"installing torch==2.13.0 from {index}" in out
    assert installs[0] == f"install -q --index-url {index} torch==2.13.0"
