"""Security defaults: no code path that executes data, and a worker that binds loopback unless told."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distbatch.launch import spawn_worker

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("distbatch", "rpc_server")
# Scanned as well: the benchmark harness at the repo root (not installed, but run by people).
SCANNED = (*PACKAGES, "bench")

# Calls that turn bytes or text into running code or arbitrary objects.
FORBIDDEN_CALLS = {
    "pickle.load",
    "pickle.loads",
    "pickle.Unpickler",
    "cPickle.loads",
    "torch.load",
    "marshal.load",
    "marshal.loads",
    "yaml.load",
    "yaml.unsafe_load",
    "dill.loads",
    "eval",
    "exec",
}

# file (relative to the repo root) -> the forbidden calls it may make, and why.
ALLOWED: dict[str, tuple[set[str], str]] = {
    "bench/baselines.py": (
        {"pickle.loads"},
        "benchmark baseline only: the pickle-over-HTTP comparison unpickles bytes that the same "
        "benchmark pickled itself and served on loopback; no worker or library path imports it",
    ),
    "bench/scaling.py": (
        {"pickle.loads"},
        "benchmark only: times the pickle round trip of a REMOTE batch (metadata) it pickled itself "
        "in memory, as passing a batch to another process costs; nothing from a network is unpickled",
    ),
}


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _forbidden_uses(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every forbidden call, resolving `import x as y` / `from x import f`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                aliases[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name is None:
                continue
            head, _, rest = name.partition(".")
            resolved = aliases.get(head, head) + (f".{rest}" if rest else "")
            if resolved in FORBIDDEN_CALLS or name in FORBIDDEN_CALLS:
                found.append((node.lineno, resolved))
    return found


def _sources(packages: tuple[str, ...] = SCANNED) -> list[Path]:
    files = [p for package in packages for p in sorted((ROOT / package).rglob("*.py"))]
    assert len(files) > 20, files  # the scan really looked at the packages
    return files


def test_no_code_executing_deserialisation_in_library_worker_or_bench() -> None:
    offenders = []
    used_allowances: dict[str, set[str]] = {}
    for path in _sources():
        relative = path.relative_to(ROOT).as_posix()
        allowed, _reason = ALLOWED.get(relative, (set(), ""))
        for line, name in _forbidden_uses(path):
            if name in allowed:
                used_allowances.setdefault(relative, set()).add(name)
            else:
                offenders.append(f"{relative}:{line}: {name}(...)")
    assert not offenders, "code that executes data:\n" + "\n".join(offenders)
    # the allow-list stays honest: drop an entry once its file no longer needs it
    assert used_allowances == {k: v for k, (v, _) in ALLOWED.items()}


def test_scanner_catches_aliases(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import pickle as p\nfrom yaml import load\nimport torch\n"
        "p.loads(b'')\nload('x')\ntorch.load('f')\neval('1')\nexec('x=1')\n"
    )
    assert [name for _, name in _forbidden_uses(sample)] == [
        "pickle.loads",
        "yaml.load",
        "torch.load",
        "eval",
        "exec",
    ]


def test_the_benchmark_harness_is_not_imported_by_library_or_worker() -> None:
    for path in _sources(PACKAGES):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n == "bench" or n.startswith("bench.") for n in names), (path, node.lineno)
        assert "baselines" not in path.read_text(), path


def test_cli_default_host_is_loopback() -> None:
    from rpc_server.__main__ import parse_args

    assert parse_args([]).host == "127.0.0.1"
    result = subprocess.run(
        [sys.executable, "-m", "rpc_server", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=True,
    )
    said = " ".join(result.stdout.split())
    assert "--host HOST bind address; 0.0.0.0 for every interface (default: 127.0.0.1)" in said


@pytest.mark.parametrize("token", ["", "t0ken"])
def test_worker_spawned_without_host_binds_loopback(token: str) -> None:
    # No --host at all: spawn the CLI directly rather than through spawn_worker (which passes one).
    process = subprocess.Popen(
        [sys.executable, "-m", "rpc_server", "--port", "0", "--exit-with-parent", str(os.getpid())],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        cwd=ROOT,
        env={**os.environ, "DISTBATCH_TOKEN": token},
    )
    try:
        assert process.stdout is not None
        node = process.stdout.readline().decode().strip()
        host, _, port = node.rpartition(":")
        assert host == "127.0.0.1" and 0 < int(port) < 65536, node
        # and what it listens on is loopback only (from the kernel's view: /proc/net/tcp)
        listening = _listening_addresses(process.pid)
        assert listening == {("127.0.0.1", int(port))}, listening
    finally:
        process.terminate()
        process.communicate(timeout=10)


def _listening_addresses(pid: int) -> set[tuple[str, int]]:
    """IPv4/IPv6 TCP sockets in LISTEN state owned by `pid`, as (address, port)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            address_hex, port_hex = local.split(":")
            if len(address_hex) == 8:
                address = ".".join(str(b) for b in reversed(bytes.fromhex(address_hex)))
            else:
                address = address_hex  # IPv6: any listener here is a failure anyway
            found.add((address, int(port_hex, 16)))
    return found


def test_spawn_worker_defaults_to_loopback() -> None:
    worker = spawn_worker()
    try:
        assert worker.node.startswith("127.0.0.1:")
    finally:
        worker.stop()
