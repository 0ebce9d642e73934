"""The guide (docs/guide/*.md): every page's ```python blocks run, in order, in one namespace
(each page starts and stops its own workers), and every relative link in the README, the site's
home page, the guide and the API reference's pages points at a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from areal_support import areal_imported
from docs_support import GUIDE, README, ROOT, python_blocks, relative_links, run_blocks

PAGES = sorted(GUIDE.glob("*.md"))
# Pages whose session starts a Ray cluster: run by the module named, in a Ray chain of the
# suite's scheduler (tests/conftest.py), not beside two Ray modules already running.
RUN_ELSEWHERE = {"transferqueue-backend": "tests/system/test_transferqueue_example.py"}
SESSIONS = [page for page in PAGES if python_blocks(page) and page.stem not in RUN_ELSEWHERE]
LINKED = [README, ROOT / "docs" / "index.md", *PAGES, *sorted((ROOT / "docs" / "api").glob("*.md"))]


def test_the_guide_has_its_pages_and_sessions() -> None:
    names = {page.stem for page in PAGES}
    assert {"index", "batches", "engines", "controller", "streaming", "operating"} <= names
    assert len(SESSIONS) >= 5
    for stem, module in RUN_ELSEWHERE.items():
        assert python_blocks(GUIDE / f"{stem}.md") and f'"{stem}.md"' in (ROOT / module).read_text()


@pytest.mark.parametrize("page", SESSIONS, ids=[page.stem for page in SESSIONS])
def test_guide_page_sessions_run(page: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if "from areal" in page.read_text():  # the AReaL backend's session: AReaL, then undone
        with areal_imported():
            run_blocks(page)
    else:
        run_blocks(page)
    assert capsys.readouterr().out.strip(), f"{page.name}'s sessions should print what they show"


@pytest.mark.parametrize("page", LINKED, ids=[str(page.relative_to(ROOT)) for page in LINKED])
def test_relative_links_resolve(page: Path) -> None:
    missing = [t for t in relative_links(page) if t and not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


@pytest.mark.parametrize("page", [README, *PAGES], ids=["README", *[page.stem for page in PAGES]])
def test_code_blocks_say_whether_they_run(page: Path) -> None:
    """```python runs (above); anything that cannot run here is ```text or ```bash, never ```py."""
    fences = re.findall(r"^```(\S*)$", page.read_text(), re.M)
    openings = fences[::2]
    assert set(openings) <= {"python", "bash", "text", ""}, f"{page.name}: {sorted(set(openings))}"


def test_the_operating_session_prints_what_its_comments_say(capsys: pytest.CaptureFixture[str]) -> None:
    """`distbatch ls` lists a task's fields in name order: `t0 hidden,uid` (the comment said uid,hidden)."""
    page = GUIDE / "operating.md"
    first = python_blocks(page)[0]
    assert "# t0 hidden,uid / t1 hidden,uid," in first
    namespace = run_blocks(page, [first])
    try:
        out = capsys.readouterr().out
        assert "t0\thidden,uid\nt1\thidden,uid\n" in out
        assert "deleted 4 shard(s)" in out
    finally:
        namespace["workers"].shutdown()


def test_the_batches_session_prints_what_its_nested_comments_say(capsys: pytest.CaptureFixture[str]) -> None:
    """`nested()` shares its values where one node holds the field, and is a new join where two
    do (the page used to print `True 8 True` for its two-node batch, which printed `... False`)."""
    page = GUIDE / "batches.md"
    blocks = python_blocks(page)
    index = next(i for i, block in enumerate(blocks) if ".nested(" in block)
    assert "# True 4 True: " in blocks[index] and "# 8 False: " in blocks[index]
    namespace = run_blocks(page, blocks[: index + 1])
    try:
        out = capsys.readouterr().out.splitlines()
        assert "True 4 True" in out and "8 False" in out
        assert out[-1] == "True"  # a batch made from a nested tensor shares its values
    finally:
        namespace["workers"].shutdown()
