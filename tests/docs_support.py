"""What the README and guide tests share: a page's runnable sessions and its relative links.

A block fenced as ```python is a runnable session: the tests run every such block of a page in
order, in one namespace, as a reader pasting them would. Blocks that cannot run here (they need
a cluster, the reader's own engine or data) are fenced as ```text or ```bash instead.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "guide"

_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_ANY_BLOCK = re.compile(r"^```.*?^```", re.S | re.M)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def python_blocks(page: Path) -> list[str]:
    """The page's ```python blocks, in order."""
    return _PYTHON_BLOCK.findall(page.read_text())


def run_blocks(page: Path, blocks: list[str] | None = None) -> dict[str, Any]:
    """Run the page's python blocks in order in one namespace (as a reader pasting them would)."""
    page = page.resolve()
    namespace: dict[str, Any] = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    for index, block in enumerate(python_blocks(page) if blocks is None else blocks):
        code = compile(block, f"{page.relative_to(ROOT)} block {index}", "exec")
        exec(code, namespace)  # noqa: S102 - our own documentation
    return namespace


def relative_links(page: Path) -> list[str]:
    """Targets of the page's relative links and images (outside code blocks), anchors dropped."""
    text = _ANY_BLOCK.sub("", page.read_text())
    targets = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # https:, mailto:, or a link within the page
        targets.append(target.split("#", 1)[0])
    return targets
