"""The package layout's import rules, checked on the source (ast), not by running it.

- Imports flow one way: `rpc_server` (the worker) may import `distbatch` (the library), but
  `distbatch` never imports `rpc_server`, not even lazily inside a function.
- `rpc_server`'s modules import each other without circles.
- The worker's data path (store, routes) imports neither torch nor aiohttp.
- `distbatch`'s modules sit in layers (`LAYERS`, drawn in docs/guide/architecture.md): a module imports
  its own layer and those below, never one above; the package has no import circle; the worker
  imports only the parts of the library it needs.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from source_support import parsed

ROOT = Path(__file__).resolve().parents[2]
SERVER = "rpc_server"


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"


def _imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The absolute module names an import statement names (relative imports: none here)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level or node.module is None:
        return []
    # `from rpc_server import app` imports rpc_server.app: count the names as submodules too.
    return [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.Module, *, top_level_only: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements that run: all of them, or only those at module level (inside module-level
    `if`/`try` included); `if TYPE_CHECKING:` blocks never run and are skipped."""
    pending: list[ast.AST] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            pending.extend(node.orelse)
        elif top_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        else:
            pending.extend(ast.iter_child_nodes(node))


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(
    package: str, *, top_level_only: bool, type_checking: bool = False
) -> dict[str, dict[str, str]]:
    """For each module of `package`, the package's modules it imports, each with where (the
    imports that run; with `type_checking`, every import statement, those only a type checker
    reads included)."""
    paths = {_module_name(p): p for p in _modules(package)}
    graph: dict[str, dict[str, str]] = {name: {} for name in paths}
    for name, path in paths.items():
        tree = parsed(path)
        nodes = (
            [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
            if type_checking
            else _runtime_imports(tree, top_level_only=top_level_only)
        )
        for node in nodes:
            targets = _imported(node)
            if isinstance(node, ast.ImportFrom) and all(t in paths for t in targets[1:]) and len(targets) > 1:
                targets = targets[1:]  # `from pkg import sub`: the submodules, not pkg's own __init__
            for target in targets:
                if target in paths and target != name:
                    graph[name].setdefault(target, _where(path, node))
    return graph


def _cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
    """One import circle as `a (file:line) -> b ...`, or None if the graph is acyclic."""
    done: set[str] = set()
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        if name in path:
            loop = [*path[path.index(name) :], name]
            return [f"{a} ({graph[a][b]})" for a, b in zip(loop, loop[1:])] + [name]
        if name in done:
            return None
        path.append(name)
        for target in sorted(graph[name]):
            found = visit(target)
            if found:
                return found
        path.pop()
        done.add(name)
        return None

    for name in sorted(graph):
        found = visit(name)
        if found:
            return found
    return None


def test_distbatch_never_imports_rpc_server() -> None:
    offenders = []
    for path in _modules("distbatch"):
        tree = parsed(path)
        for node in ast.walk(tree):  # everywhere: top level, functions, TYPE_CHECKING blocks
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = _imported(node)
                if any(name == SERVER or name.startswith(SERVER + ".") for name in names):
                    offenders.append(f"{_where(path, node)}: {ast.unparse(node)}")
    assert not offenders, "distbatch must not import rpc_server:\n" + "\n".join(offenders)


def test_the_layout_checks_see_imports_everywhere() -> None:
    """The helpers find function-level imports and skip TYPE_CHECKING ones (no false passes)."""
    tree = ast.parse(
        "import a\nif TYPE_CHECKING:\n    import b\ndef f():\n    from c import d\n"
        "try:\n    import e\nexcept ImportError:\n    pass\n"
    )
    top = {n for node in _runtime_imports(tree, top_level_only=True) for n in _imported(node)}
    every = {n for node in _runtime_imports(tree, top_level_only=False) for n in _imported(node)}
    assert top == {"a", "e"}
    assert every == {"a", "c", "c.d", "e"}
    assert _cycle({"x": {"y": "x.py:1"}, "y": {"x": "y.py:2"}}) == ["x (x.py:1)", "y (y.py:2)", "x"]
    assert _cycle({"x": {"y": "x.py:1"}, "y": {}}) is None


def test_rpc_server_module_level_imports_have_no_circle() -> None:
    graph = _import_graph(SERVER, top_level_only=True)
    assert "rpc_server.context" in graph and "rpc_server.routes" in graph
    cycle = _cycle(graph)
    assert cycle is None, "import circle in rpc_server: " + " -> ".join(cycle or [])


def test_rpc_server_has_no_circle_even_through_function_level_imports() -> None:
    """No circle hidden by a lazy import either: `app` imports `routes` and `engine` inside
    `create_app`, so neither may import `app` back (they take `rpc_server.context`)."""
    cycle = _cycle(_import_graph(SERVER, top_level_only=False))
    assert cycle is None, "import circle in rpc_server: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("package", ["distbatch", SERVER])
def test_no_circle_even_through_imports_only_a_type_checker_reads(package: str) -> None:
    """A circle hidden behind `if TYPE_CHECKING:` is still two modules that need each other;
    a Protocol names what one needs of the other instead."""
    cycle = _cycle(_import_graph(package, top_level_only=False, type_checking=True))
    assert cycle is None, f"import circle in {package}: " + " -> ".join(cycle or [])


@pytest.mark.parametrize(
    "modules",
    [
        "rpc_server.store, rpc_server.routes",  # the worker's data path serves bytes
        "distbatch.batch.balance, distbatch.transport.shm",  # leaves the batch package's root lazy
        "rpc_server.engine, distbatch.batch.calls",  # until a batch or a tensor travels
    ],
)
def test_these_modules_import_neither_torch_nor_aiohttp(modules: str) -> None:
    code = f"import {modules}, sys; print('torch' in sys.modules, 'aiohttp' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"], f"torch, aiohttp imported: {out.stdout.strip()}"


# ----------------------------------------------------------------------------- the layers
# docs/guide/architecture.md draws these. A module may import its own layer and the layers below it,
# never one above (function-level imports included): the rule that keeps each concern in one room.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("distbatch.errors", "distbatch.ids", "distbatch.checks", "distbatch.protocol",
                    "distbatch.auth", "distbatch.atomic", "distbatch.gc_pause", "distbatch.twins")),
    ("wire", ("distbatch.wire",)),
    ("transport pieces", ("distbatch.transport", "distbatch.serving")),
    ("client", ("distbatch.client",)),
    ("batch", ("distbatch.batch",)),
    ("samplers", ("distbatch.samplers",)),
    ("controller", ("distbatch.controller",)),
    ("launch", ("distbatch.launch", "distbatch.ray_group")),
    ("applications", ("distbatch.dataloader", "distbatch.cli", "distbatch.transferqueue", "distbatch.areal")),
]
# What the worker may use of the library: its data path needs the bytes and the shared pieces;
# only the engine host (rpc_server.engine) reaches for batches, the client and engine calls.
WORKER_MAY_IMPORT = ("distbatch.errors", "distbatch.ids", "distbatch.protocol", "distbatch.auth",
                     "distbatch.atomic", "distbatch.gc_pause", "distbatch.wire", "distbatch.transport",
                     "distbatch.serving", "distbatch.launch.flags")
ENGINE_HOST_MAY_ALSO_IMPORT = ("distbatch.batch", "distbatch.client")


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _layer(name: str) -> int | None:
    for rank, (_, prefixes) in enumerate(LAYERS):
        if _within(name, prefixes):
            return rank
    return None


def test_every_library_module_has_a_layer() -> None:
    modules = _import_graph("distbatch", top_level_only=False)
    unplaced = [m for m in modules if m != "distbatch" and _layer(m) is None]
    assert not unplaced, (
        f"modules in no layer (add them to LAYERS and docs/guide/architecture.md): {unplaced}"
    )


def test_imports_never_go_up_a_layer() -> None:
    upward = []
    for module, targets in _import_graph("distbatch", top_level_only=False).items():
        if module == "distbatch":
            continue
        for target, where in targets.items():
            if target == "distbatch":  # the package root: importing any submodule runs it anyway
                continue
            source_rank, target_rank = _layer(module), _layer(target)
            if source_rank is not None and target_rank is not None and target_rank > source_rank:
                upward.append(f"{where}: {module} ({LAYERS[source_rank][0]}) imports {target} "
                              f"({LAYERS[target_rank][0]})")
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


def test_the_package_root_imports_only_the_foundation_at_run_time() -> None:
    """`import distbatch` stays cheap: the rest comes on first use (`distbatch._LAZY`)."""
    targets = _import_graph("distbatch", top_level_only=True)["distbatch"]
    assert all(_layer(t) == 0 for t in targets), targets


def test_distbatch_has_no_import_circle() -> None:
    cycle = _cycle(_import_graph("distbatch", top_level_only=True))
    assert cycle is None, "import circle in distbatch: " + " -> ".join(cycle or [])


def test_the_worker_imports_only_what_the_worker_needs_of_the_library() -> None:
    offenders = []
    for path in _modules(SERVER):
        module = _module_name(path)
        allowed = WORKER_MAY_IMPORT + (ENGINE_HOST_MAY_ALSO_IMPORT if module == "rpc_server.engine" else ())
        tree = parsed(path)
        for node in _runtime_imports(tree, top_level_only=False):
            for name in _imported(node):
                if name.startswith("distbatch.") and not _within(name, allowed):
                    # `from distbatch.wire import bundle` names distbatch.wire.bundle: judged by its module.
                    if isinstance(node, ast.ImportFrom) and _within(node.module or "", allowed):
                        continue
                    offenders.append(f"{_where(path, node)}: {name}")
    assert not offenders, "the worker imports library modules it must not:\n" + "\n".join(offenders)


# ----------------------------------------------------------------------------- the written map
# docs/guide/architecture.md draws the layers as a diagram: a row label (the layer's name, maybe
# over two lines), then the modules in it, named relative to `distbatch` (a package stands for
# its modules). The page must draw what LAYERS enforces, and name only what exists.
ARCHITECTURE = ROOT / "docs" / "guide" / "architecture.md"
LABEL_WIDTH = 16


def _drawn_names(text: str) -> list[str]:
    """The module names in a row's text: parenthesised notes and `code` taken out."""
    text = re.sub(r"`[^`]*`", " ", text)
    while re.search(r"\([^()]*\)", text):
        text = re.sub(r"\([^()]*\)", " ", text)
    return [word for word in text.split() if re.fullmatch(r"[a-z_]+(\.[a-z_]+)*", word)]


def _drawn_layers() -> list[tuple[str, list[str]]]:
    """(label, module names) of each layer drawn, top to bottom; the worker's row ends it."""
    block = ARCHITECTURE.read_text().split("## Layers: who imports whom", 1)[1].split("```")[1]
    layers: list[tuple[str, list[str]]] = []
    labels: list[str] = []
    rows: list[str] = []
    for line in [*block.splitlines(), ""]:
        if line.startswith(" rpc_server"):
            break
        if line.strip() and set(line.strip()) != {"│"}:
            labels.append(line[:LABEL_WIDTH].strip())
            rows.append(line[LABEL_WIDTH:])
        elif rows:
            layers.append((" ".join(label for label in labels if label), _drawn_names(" ".join(rows))))
            labels, rows = [], []
    return layers


def test_the_page_draws_the_layers_test_layout_enforces() -> None:
    drawn = _drawn_layers()
    assert [label for label, _ in drawn] == [name for name, _ in reversed(LAYERS)]
    modules = set(_import_graph("distbatch", top_level_only=True)) - {"distbatch"}
    for label, names in drawn:
        for name in names:
            module = f"distbatch.{name}"
            assert module in modules, f"the page draws {name!r} in {label!r}: no such module"
            rank = _layer(module)
            assert rank is not None and LAYERS[rank][0] == label, (
                f"the page draws {name!r} in {label!r}; test_layout puts it in "
                f"{LAYERS[rank][0] if rank is not None else 'no layer'!r}"
            )
    drawn_names = [f"distbatch.{name}" for _, names in drawn for name in names]
    packages = {m for m in modules if any(other.startswith(m + ".") for other in modules)}
    undrawn = sorted(m for m in modules - packages if not _within(m, tuple(drawn_names)))
    assert not undrawn, f"modules the page does not draw: {undrawn}"


def test_every_module_the_page_names_exists() -> None:
    """Dotted names in `code` on the page (`distbatch.x.y`, `rpc_server.x`) are modules, or names
    defined in one."""
    import importlib

    named = set(re.findall(r"`((?:distbatch|rpc_server)(?:\.[A-Za-z_]+)+)`", ARCHITECTURE.read_text()))
    assert named
    missing = []
    for dotted in sorted(named):
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            path = ROOT.joinpath(*parts[:cut])
            if path.with_suffix(".py").exists() or (path / "__init__.py").exists():
                module = importlib.import_module(".".join(parts[:cut]))
                target: Any = module
                try:
                    for attribute in parts[cut:]:
                        target = getattr(target, attribute)
                except AttributeError:
                    missing.append(dotted)
                break
        else:
            missing.append(dotted)
    assert not missing, f"the page names what does not exist: {missing}"


def test_the_drawing_check_reads_rows_as_drawn() -> None:
    """The parser takes names out of notes and code, and a label over two lines (no false pass)."""
    assert _drawn_names("calls (engine-call envelopes: a batch)  cli (`distbatch ls`)  wire.bundle") == [
        "calls",
        "cli",
        "wire.bundle",
    ]
    nested = "transferqueue (the backend: bootstrap, options (checked)) x.y"
    assert _drawn_names(nested) == ["transferqueue", "x.y"]


def _stated_imports(package: str) -> tuple[set[str], bool] | None:
    """What a package's docstring says it may import of distbatch ("May import `a`, `b` ...; "),
    and whether it adds "and below"; None when it says nothing."""
    doc = ast.get_docstring(parsed(ROOT / package.replace(".", "/") / "__init__.py")) or ""
    match = re.search(r"May import (.*?)(?:;|$)", " ".join(doc.split()))
    if not match:
        return None
    return set(re.findall(r"`(distbatch(?:\.\w+)+)`", match.group(1))), "and below" in match.group(1)


STATING_PACKAGES = ("wire", "transport", "serving", "client", "batch", "controller", "launch")


def test_each_package_imports_what_its_docstring_says() -> None:
    graph = _import_graph("distbatch", top_level_only=False)
    wrong = []
    for short in STATING_PACKAGES:
        package = f"distbatch.{short}"
        stated = _stated_imports(package)
        assert stated is not None, f"{package}'s docstring says nothing of what it may import"
        names, and_below = stated
        ceiling = max(_layer(name) or 0 for name in names)
        for module, targets in graph.items():
            if not _within(module, (package,)):
                continue
            for target, where in targets.items():
                if _within(target, (package,)) or target == "distbatch":
                    continue
                rank = _layer(target)
                below = and_below and rank is not None and rank <= ceiling
                if not (_within(target, tuple(names)) or below):
                    wrong.append(f"{where}: {module} imports {target}, not allowed by {package}'s docstring")
    assert not wrong, "\n".join(wrong)


# ----------------------------------------------------------------------------- beside the package
# Not installed, at the repo root: `bench` (the benchmarks) and `simcluster` (the simulated hosts
# the cluster benchmarks and tests run on). simcluster is plain process and network plumbing, so it
# depends on nothing it is used to measure or test: the standard library only.


def test_simcluster_imports_only_the_standard_library() -> None:
    paths = _modules("simcluster")
    assert paths, "no simcluster/ at the repo root"
    offenders = []
    for path in paths:
        tree = parsed(path)
        for node in ast.walk(tree):  # everywhere: top level, functions, TYPE_CHECKING blocks
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in _imported(node):
                    top = name.split(".")[0]
                    if top != "simcluster" and top not in sys.stdlib_module_names:
                        offenders.append(f"{_where(path, node)}: {name}")
    assert not offenders, "simcluster imports beyond the standard library:\n" + "\n".join(offenders)


def test_bench_docstring_names_every_module() -> None:
    """bench/__init__.py's docstring is the harness's map: it names each module (`cluster.job` for
    one in a subpackage)."""
    doc = ast.get_docstring(parsed(ROOT / "bench" / "__init__.py")) or ""
    named = set(re.findall(r"`([a-z_]+(?:\.[a-z_]+)*)`", doc))
    modules = {_module_name(p).removeprefix("bench.") for p in _modules("bench")} - {"bench"}
    unnamed = sorted(modules - named)
    assert not unnamed, f"bench/__init__.py's docstring does not name: {unnamed}"
