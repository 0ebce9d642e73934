"""The documentation site (mkdocs + mkdocstrings, `scripts/docs`): the guide and the API reference
build as one site, its links resolve, and a docstring that names nothing, or documents a parameter
the signature lacks, fails the strict build."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

if os.environ.get("DISTBATCH_REQUIRE_DOCS") == "1":
    importlib.import_module("mkdocstrings_handlers.python")
else:
    pytest.importorskip("mkdocstrings_handlers.python")
yaml = importlib.import_module("yaml")  # mkdocs' own dependency


def build(tmp_path: Path, source: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Build the site with the repository's config, reading the packages from `source`."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config["docs_dir"] = str(ROOT / "docs")
    config["site_dir"] = str(tmp_path / "site")
    python = config["plugins"][1]["mkdocstrings"]["handlers"]["python"]
    python["paths"] = [str(source)]
    python["options"]["extensions"] = [str(ROOT / "docs" / "griffe_refs.py") + ":BacktickReferences"]
    path = tmp_path / "mkdocs.yml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ""},
    )
    return done, tmp_path / "site"


def copy_packages(tmp_path: Path, edit: dict[str, Any]) -> Path:
    """distbatch and rpc_server copied under tmp_path/src, with (path, old, new) edits applied."""
    source = tmp_path / "src"
    for package in ("distbatch", "rpc_server"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    for rel, (old, new) in edit.items():
        file = source / rel
        text = file.read_text()
        assert text.count(old) == 1, (rel, old)
        file.write_text(text.replace(old, new))
    return source


def test_the_site_builds_and_links_resolve(tmp_path: Path) -> None:
    done, site = build(tmp_path, ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    api = site / "api"
    controller = (api / "controller.html").read_text()
    # A backticked name became a link into another page.
    assert 'href="samplers.html#distbatch.samplers.SequentialSampler"' in controller
    assert 'id="distbatch.controller.server.ControllerServer.shutdown"' in controller
    workers = (api / "workers.html").read_text()
    assert re.search(r"call_timeout", workers)
    assert 'id="rpc_server.engine.WorkerContext"' in (api / "engines.html").read_text()
    samplers = (api / "samplers.html").read_text()
    assert 'id="distbatch.samplers.SeqlenBalancedSampler"' in samplers
    # The guide is in the same site: every guide page is built, linked to the reference, and
    # files that are not pages (raw results, the dashboard, the griffe extensions) are left out.
    guide = {page.stem for page in (ROOT / "docs" / "guide").glob("*.md")}
    assert guide and {page.stem for page in (site / "guide").glob("*.html")} == guide
    assert 'href="../api/batch.html"' in (site / "guide" / "batches.html").read_text()
    assert (site / "guide" / "architecture.svg").exists() and (site / "bench" / "bench.png").exists()
    assert not [*site.glob("bench/*.json"), *site.glob("*.py"), *site.glob("grafana")]


# Docstrings broken on purpose, with what the strict build must say of each: all in one build (a
# strict build reports every warning before it aborts; a build of the whole site costs 10-30 s).
BROKEN_DOCSTRINGS = {
    "distbatch/controller/core.py": (  # a docstring naming nothing
        "(default `SequentialSampler`)",
        "(default `SequentialSamplr`)",
        "`SequentialSamplr` in the docstring of distbatch.controller.core.Controller names nothing",
    ),
    "distbatch/client/shard_client.py": (  # a documented parameter the signature lacks
        "        retries: extra attempts",
        "        retry: extra attempts",
        "Parameter 'retry' does not appear in the function signature",
    ),
}


def test_broken_docstrings_fail_the_build(tmp_path: Path) -> None:
    edits = {path: (old, new) for path, (old, new, _) in BROKEN_DOCSTRINGS.items()}
    done, _ = build(tmp_path, copy_packages(tmp_path, edits))
    assert done.returncode != 0
    for _, _, error in BROKEN_DOCSTRINGS.values():
        assert error in done.stderr
