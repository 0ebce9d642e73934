"""The project's own source files, parsed once per test process (ast).

The layout, fixture and error-policy checks read the code instead of running it, and walk the
same few hundred files many times; parsing each once keeps them quick. Callers only read the
trees they get.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path


@functools.cache
def parsed(path: Path) -> ast.Module:
    """`path`'s module, parsed (cached: do not change the tree)."""
    return ast.parse(path.read_text(), str(path))
