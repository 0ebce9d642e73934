"""`scripts/_setup.sh` (what `scripts/demo` and `scripts/test` run first): it says which torch it
installs and from where, and does what it says.

It runs in a copy of the repository's scripts with a stand-in `.venv/bin/python` that has no
torch and records every `pip` command instead of downloading anything; installing uv through it
leaves a stand-in `.venv/bin/uv` that records its commands too (or none: then pip does the work).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAND_IN = """#!/usr/bin/env bash
if [ "$1" = "-c" ]; then exit 1; fi   # `import torch` fails: no torch yet
if [ "$1 $2" = "-m pip" ]; then
  shift 2; echo "pip $*" >> "$(dirname "$0")/pip.log"
  case "$*" in
    *"install"*"uv=="*)
      [ -n "${FAKE_UV:-}" ] || exit 1   # no uv to be had
      printf '#!/usr/bin/env bash\necho "uv $*" >> "$(dirname "$0")/pip.log"\n' > "$(dirname "$0")/uv"
      chmod +x "$(dirname "$0")/uv" ;;
  esac
  exit 0
fi
case "$1" in *warm_bytecode.py) echo "python warm_bytecode.py" >> "$(dirname "$0")/pip.log" ;; esac
exit 0
"""


def run_setup(tmp_path: Path, **env: str) -> tuple[str, list[str]]:
    """Source the setup script in a scratch copy; (what it printed, the pip installs it ran, and
    after uv's the run of warm_bytecode.py that writes the .pyc files uv does not)."""
    (tmp_path / "scripts").mkdir()
    for name in ("_setup.sh", "constraints.txt", "warm_bytecode.py"):
        shutil.copy(ROOT / "scripts" / name, tmp_path / "scripts" / name)
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
    log = (python.parent / "pip.log").read_text().splitlines()
    installs = [line for line in log if " install " in f" {line} " and "uv==" not in line]
    return done.stdout, [line for line in log if line in installs or line == WARM]


UV = "uv pip install -q --python "
WARM = "python warm_bytecode.py"
PIP = "pip install -q --disable-pip-version-check "


@pytest.mark.parametrize("uv", [True, False], ids=["uv", "pip"])
def test_without_an_index_it_says_the_package_index_picks_the_build(tmp_path: Path, uv: bool) -> None:
    out, commands = run_setup(tmp_path, **({"FAKE_UV": "1"} if uv else {}))
    assert "installing torch==2.13.0 from your package index" in out and "CUDA build" in out
    # uv writes no .pyc files: once it has installed, warm_bytecode.py writes those the processes
    # need (pip compiles at install).
    warms = [c == WARM for c in commands]
    assert warms == ([False, False, True] if uv else [False, False]), commands
    installs = [c for c, warm in zip(commands, warms) if not warm]
    assert len(installs) == 2
    assert installs[0].startswith(UV if uv else PIP) and installs[0].endswith(" torch==2.13.0")
    # The package with its extras, every version pinned by the one list.
    pinned = f"-c {tmp_path}/scripts/constraints.txt -e .[dev]"
    assert installs[1].startswith(UV if uv else PIP) and installs[1].endswith(pinned)
    assert ("uv could not be installed" in out) is not uv


def test_an_index_of_ones_choice_is_said_and_used(tmp_path: Path) -> None:
    index = "https://download.pytorch.org/whl/cpu"
    out, installs = run_setup(tmp_path, DISTBATCH_TORCH_INDEX=index, FAKE_UV="1")
    assert f"installing torch==2.13.0 from {index}" in out
    assert installs[0].startswith(UV) and installs[0].endswith(f" --index-url {index} torch==2.13.0")
