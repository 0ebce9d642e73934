"""The README's Python sessions run as written (they start and stop their own workers).

Blocks fenced as ```python are runnable sessions and run here; ```py marks an
illustrative excerpt that needs the reader's own engine or data.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_python_sessions() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index: int, capsys: pytest.CaptureFixture[str]) -> None:
    namespace: dict[str, object] = {"__name__": f"readme_block_{index}"}
    exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), namespace)  # noqa: S102 - our own README
    assert capsys.readouterr().out.strip(), "a README session should print what it shows"
