"""The README is a front page: short, set-up first, and its Python session runs as written
(it starts and stops its own workers). The rest lives in the guide (docs/guide, test_guide.py).
"""

from __future__ import annotations

import re

import pytest
from docs_support import README, python_blocks, run_blocks

MAX_LINES = 250


def test_readme_is_a_front_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/guide"


def test_readme_starts_its_set_up_with_the_two_scripts() -> None:
    first_block = re.search(r"^```(\w*)\n(.*?)^```", README.read_text(), re.S | re.M)
    assert first_block is not None and first_block.group(1) == "bash"
    commands = [line.split("#", 1)[0].strip() for line in first_block.group(2).splitlines()]
    assert [c for c in commands if c] == ["scripts/demo", "scripts/test"]


def test_readme_says_which_python_has_distbatch() -> None:
    """scripts/demo installs into .venv: a plain `python` there has no distbatch."""
    text = README.read_text()
    assert "Paste it into `.venv/bin/python`" in text and "source .venv/bin/activate" in text
    assert "Paste it into `python`" not in text


def test_readme_has_one_python_session() -> None:
    assert len(python_blocks(README)) == 1


def test_readme_session_runs(capsys: pytest.CaptureFixture[str]) -> None:
    run_blocks(README)
    assert capsys.readouterr().out.strip(), "a README session should print what it shows"
