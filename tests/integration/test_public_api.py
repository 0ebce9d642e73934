"""The public names: every one in `distbatch.__all__` works at run time, and type checkers see the
real classes behind the lazily imported ones (`py.typed`, `if TYPE_CHECKING:` imports)."""

from __future__ import annotations

import ast
import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import distbatch

ROOT = Path(__file__).resolve().parents[2]
INIT = ROOT / "distbatch" / "__init__.py"


def _type_checking_imports() -> dict[str, str]:
    """name -> module of each import under `if TYPE_CHECKING:` in distbatch/__init__.py."""
    tree = ast.parse(INIT.read_text())
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom) and stmt.module, ast.unparse(stmt)
                for alias in stmt.names:
                    found[alias.asname or alias.name] = stmt.module
    return found


def test_every_public_name_resolves_to_an_object_of_that_name() -> None:
    for name in distbatch.__all__:
        value = getattr(distbatch, name)
        assert getattr(value, "__name__", name) == name, f"distbatch.{name} is {value!r}"


def test_lazy_names_and_type_checking_imports_are_the_same_table() -> None:
    """A name added to one but not the other would be `object` to type checkers (or missing)."""
    assert _type_checking_imports() == distbatch._LAZY


def test_each_lazy_name_comes_from_the_module_that_defines_it() -> None:
    for name, module in distbatch._LAZY.items():
        value = getattr(importlib.import_module(module), name)
        assert value.__module__ == module, f"{name} is defined in {value.__module__}, not {module}"


def test_importing_distbatch_imports_neither_torch_nor_aiohttp() -> None:
    code = "import distbatch, sys; print('torch' in sys.modules, 'aiohttp' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_both_packages_ship_py_typed() -> None:
    for package in ("distbatch", "rpc_server"):
        assert (ROOT / package / "py.typed").is_file()
    cfg = (ROOT / "setup.cfg").read_text()
    assert "distbatch = py.typed" in cfg and "rpc_server = py.typed" in cfg


def _mypy() -> str:
    mypy = shutil.which("mypy", path=str(Path(sys.executable).parent))
    if mypy is None:
        pytest.skip("mypy is not installed (it comes with the [dev] extra)")
    return mypy


def test_the_project_type_checks() -> None:
    """mypy over what pyproject names (the package, the worker, the examples, the benchmarks,
    the simulated cluster): no error. Long from a cold cache (20-60 s: it reads torch's stubs);
    it runs here, beside the other tests, rather than before them all in `scripts/test`, where
    it kept one core idle; the next test reuses its cache."""
    out = subprocess.run([_mypy()], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_type_checker_sees_the_real_classes(tmp_path: Path) -> None:
    """mypy over a probe that imports the package, with the repo's settings and its incremental
    cache (`.mypy_cache`): after the test above it checks the probe alone (about 2 s); run alone,
    from a cold cache, it checks the package and torch's stubs first (15-115 s)."""
    mypy = _mypy()
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import distbatch\n"
        "from distbatch import DistributedBatchMemory, WorkerGroup\n"
        "reveal_type(distbatch.DistributedBatchMemory)\n"
        "reveal_type(WorkerGroup.local)\n"
        "batch = DistributedBatchMemory.from_dict({'x': [1, 2]})\n"
        "reveal_type(batch.chunk(2))\n"
    )
    out = subprocess.run(
        [mypy, str(probe)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    notes = [line for line in out.stdout.splitlines() if "Revealed type" in line]
    assert len(notes) == 3, out.stdout + out.stderr
    assert "def (" in notes[0] and "distbatch.batch.memory.DistributedBatchMemory" in notes[0], notes[0]
    assert "distbatch.launch.group.WorkerGroup" in notes[1], notes[1]
    assert "list[distbatch.batch.memory.DistributedBatchMemory]" in notes[2], notes[2]
    assert "error" not in out.stdout, out.stdout


def test_module_paths_users_imported_before_the_restructure_still_work() -> None:
    """Documented sessions and user code written against the flat layout keep importing."""
    ray_group = importlib.import_module("distbatch.ray_group")  # now distbatch.launch.ray_actors
    ray_actors = importlib.import_module("distbatch.launch.ray_actors")
    assert ray_group.init_local_ray is ray_actors.init_local_ray
    assert ray_group.start_ray_workers is ray_actors.start_ray_workers
    launch = importlib.import_module("distbatch.launch")
    local = importlib.import_module("distbatch.launch.local")
    assert launch.spawn_worker is local.spawn_worker and launch.WorkerProcess is local.WorkerProcess
    samplers = importlib.import_module("distbatch.samplers")
    assert samplers.SeqlenBalancedSampler.__module__ == "distbatch.samplers"
    for module, name in [
        ("distbatch.controller", "Controller"),
        ("distbatch.client", "ShardClient"),
        ("distbatch.batch", "DistributedBatchMemory"),
    ]:
        assert getattr(importlib.import_module(module), name) is not None
