#!/usr/bin/env python3
"""Run TransferQueue's own end-to-end tests against its SimpleStorage and against `Distbatch`.

    .venv/bin/python scripts/tq_own_tests.py /path/to/TransferQueue [--backends SimpleStorage,Distbatch]

TransferQueue's tests know what its users pass (strided nested tensors, NonTensorData, partial
updates, checkpoints ...). This copies its `tests/e2e/` files and `tests/test_streaming_dataset.py`
from a TransferQueue checkout into a scratch directory (nothing of theirs is committed here),
unchanged, beside a conftest that:

- imports `distbatch.transferqueue` (which registers the backend);
- adds a `Distbatch` entry (two workers) to each module's `BACKEND_CONFIGS`, which the tests
  choose from with `TQ_TEST_BACKEND`, and points the checkpoint test's `_TQ_CONFIG` at it;
- makes the tests' `ray.init()` start a cluster of their own (not join one another program left
  running) with eight logical CPUs: TransferQueue's controller and storage units each take one,
  and on a 2-core machine they would never start.

Then it runs the files once per backend, each in its own pytest process, and prints passed /
failed / skipped per file and backend (`--json FILE` writes them too). It needs no network:
point it at a checkout (e.g. the one `git clone https://github.com/Ascend/TransferQueue` makes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

FILES = (
    "tests/e2e/test_kv_interface_e2e.py",
    "tests/e2e/test_e2e_lifecycle_consistency.py",
    "tests/e2e/test_checkpoint_e2e.py",
    "tests/test_streaming_dataset.py",
)
BACKENDS = ("SimpleStorage", "Distbatch")
# Tests that read SimpleStorage's own checkpoint files: not run for Distbatch, which writes its
# own (`distbatch/` with `index.json`) and restores onto any number of workers; each is listed
# in the report with this reason, never counted as passed.
SIMPLE_STORAGE_FILES = {
    "test_checkpoint_e2e.py::TestCheckpointRoundtrip::test_tensor_fields": (
        "asserts SimpleStorage's simple_storage/storage_unit_info.json exists (the rest of it, the "
        "round trip, is what the file's other tests check and pass)"
    ),
    "test_checkpoint_e2e.py::TestIncludeStorageFalse::test_storage_saved_is_true": (
        "asserts SimpleStorage's simple_storage/ directory exists (storage_saved is True on both)"
    ),
    "test_checkpoint_e2e.py::TestCheckpointErrors::test_load_raises_on_storage_unit_count_mismatch": (
        "edits storage_unit_info.json and expects a refusal to restore onto another number of "
        "storage units; Distbatch restores onto any number of workers "
        "(tests/system/test_transferqueue_backend_options.py)"
    ),
}

CONFTEST = '''"""Written by distbatch's scripts/tq_own_tests.py: TransferQueue's tests, with Distbatch among
the backends TQ_TEST_BACKEND chooses from. The test files beside it are TransferQueue's, unchanged."""

import os

import ray
from omegaconf import OmegaConf

import distbatch.transferqueue  # noqa: F401  (registers the backend)

_ray_init = ray.init


def _init_with_cpus(*args, **kwargs):
    if not args and "address" not in kwargs:
        # A cluster of its own (not one another program left running on this machine), with
        # CPUs enough for TransferQueue's actors, which each ask for one.
        kwargs.update(address="local", num_cpus=kwargs.get("num_cpus") or 8)
    return _ray_init(*args, **kwargs)


ray.init = _init_with_cpus


def _distbatch(controller):
    backend = {"storage_backend": "Distbatch", "Distbatch": {"workers": 2}}
    return {"controller": dict(controller), "backend": backend}


def pytest_collection_finish(session):
    chosen = os.environ.get("TQ_TEST_BACKEND", "SimpleStorage")
    for module in {item.module for item in session.items if getattr(item, "module", None)}:
        configs = getattr(module, "BACKEND_CONFIGS", None)
        if configs is not None and "Distbatch" not in configs:
            configs["Distbatch"] = _distbatch(configs.get("SimpleStorage", {}).get("controller", {}))
        fixed = getattr(module, "_TQ_CONFIG", None)
        if fixed is not None and chosen == "Distbatch":
            controller = OmegaConf.to_container(fixed).get("controller", {})
            module._TQ_CONFIG = OmegaConf.create(_distbatch(controller))
'''


def counts(report: Path) -> dict[str, dict[str, int]]:
    """passed / failed / skipped per test file, from pytest's JUnit XML report."""
    out: dict[str, dict[str, int]] = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        module = (case.get("classname") or "").split(".")[0] + ".py"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        row = out.setdefault(module, {"passed": 0, "failed": 0, "skipped": 0})
        row[outcome] += 1
    return out


OUTCOMES = ("passed", "failed", "skipped", "not applicable")
Counts = dict[str, dict[str, dict[str, int]]]  # backend -> test file -> outcome -> tests


def run(source: Path, backends: list[str], timeout: float, keep: bool) -> Counts:
    scratch = Path(tempfile.mkdtemp(prefix="tq-own-tests-"))
    try:
        names = []
        for relative in FILES:
            path = source / relative
            if not path.exists():
                print(f"[tq tests] {relative}: not in {source}, skipped", file=sys.stderr)
                continue
            shutil.copy(path, scratch / path.name)
            names.append(path.name)
        (scratch / "conftest.py").write_text(CONFTEST)
        results = {}
        for backend in backends:
            report = scratch / f"{backend}.xml"
            env = {**os.environ, "TQ_TEST_BACKEND": backend}
            not_ours = [] if backend == "SimpleStorage" else list(SIMPLE_STORAGE_FILES)
            print(f"[tq tests] {backend}: pytest {' '.join(names)}", file=sys.stderr, flush=True)
            for test in not_ours:
                print(f"[tq tests] {backend}: not run: {test}: {SIMPLE_STORAGE_FILES[test]}", file=sys.stderr)
            subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
                + [f"--deselect={test}" for test in not_ours]
                + names,
                cwd=scratch,
                env=env,
                timeout=timeout,
                check=False,
            )
            results[backend] = counts(report) if report.exists() else {}
            for test in not_ours:
                row = results[backend].setdefault(test.split("::")[0], dict.fromkeys(OUTCOMES[:3], 0))
                row["not applicable"] = row.get("not applicable", 0) + 1
        return results
    finally:
        if keep:
            print(f"[tq tests] kept {scratch}", file=sys.stderr)
        else:
            shutil.rmtree(scratch, ignore_errors=True)


def table(results: Counts) -> str:
    lines = [f"| file | backend | {' | '.join(OUTCOMES)} |", "| --- | --- | --- | --- | --- | --- |"]
    for backend, files in results.items():
        for name, row in [*sorted(files.items()), ("all", {})]:
            row = row or {k: sum(r.get(k, 0) for r in files.values()) for k in OUTCOMES}
            lines.append(f"| {name} | {backend} | {' | '.join(str(row.get(k, 0)) for k in OUTCOMES)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("source", type=Path, help="a TransferQueue checkout (its tests/ are read)")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per backend's run")
    parser.add_argument("--json", type=Path, help="also write the counts here")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = parser.parse_args(argv)
    results = run(args.source, [b for b in args.backends.split(",") if b], args.timeout, args.keep)
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    failed = sum(row["failed"] for files in results.values() for row in files.values())
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
