"""The test suite's fixtures, checked on the source (ast).

A test module that defines a fixture with a conftest fixture's name silently replaces it for
that module, with whatever scope it chose: a module-scoped `fresh_workers` once handed a
worker that an earlier test had killed to the next test, which failed only in the order CI
ran them. So a conftest fixture's name is defined nowhere else. (Two test modules may each
define a fixture of one name, e.g. a `capped` worker of their own size: neither sees the other.)
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

from source_support import parsed

TESTS = Path(__file__).resolve().parents[1]


def _fixture_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(parsed(path)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for decorator in node.decorator_list:
            target = decorator.func if isinstance(decorator, ast.Call) else decorator
            if ast.unparse(target) in ("pytest.fixture", "fixture"):
                names.add(node.name)
    return names


@functools.cache
def _definitions() -> dict[str, list[str]]:
    where: dict[str, list[str]] = defaultdict(list)
    for path in sorted(TESTS.rglob("*.py")):
        if "fixture" not in path.read_text():
            continue  # defines none: most test modules, and parsing them all took a second
        for name in _fixture_names(path):
            where[name].append(str(path.relative_to(TESTS)))
    return where


def test_the_check_finds_fixtures() -> None:
    where = _definitions()
    assert where["fresh_workers"] == ["integration/conftest.py"]
    assert "shared_workers" in where and "no_servers" in where


def test_no_conftest_fixture_is_shadowed() -> None:
    shadowed = {
        name: paths
        for name, paths in _definitions().items()
        if len(paths) > 1 and any(Path(path).name == "conftest.py" for path in paths)
    }
    assert not shadowed, f"conftest fixtures defined again (one shadows the other): {shadowed}"
