"""Write the bytecode (.pyc) of what distbatch's processes import, once, after uv installs.

uv writes no .pyc files. Without them every worker, Ray actor and test process compiles torch,
numpy, Flask, Ray ... again on import where PYTHONDONTWRITEBYTECODE is set, and where it is not,
the first processes all compile the same modules at once. Importing here what those processes
import compiles just that: about 2,600 of the 12,600 modules a full install holds, 17 CPU-s
where `compileall` of everything took 62 (and 33 s of a 2-core machine's wall time). A module
imported later that is not warmed here is compiled by its first importer, as usual.

Run by scripts/_setup.sh with the venv's python; every import is optional (extras differ).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

# Beyond distbatch's own modules (all of them are imported, and with them what they import at
# the top): the peers, the tests' tools, and what is imported only inside functions.
OTHERS = (
    "torch",
    "torch.nested",
    "numpy",
    "flask",
    "werkzeug",
    "aiohttp",
    "safetensors.torch",
    "requests",
    "ray",
    "ray.util",
    "ray.util.placement_group",
    "ray.cluster_utils",
    "transfer_queue",
    "tensordict",
    "hypothesis",
    "hypothesis.stateful",
    "pytest",
    "xdist",
)
OWN = ("distbatch", "rpc_server")


def _import(name: str) -> bool:
    try:
        importlib.import_module(name)
    except Exception:  # an extra not installed, or a module that needs what is not: skip it
        return False
    return True


def main() -> None:
    sys.dont_write_bytecode = False  # this is the one process that should write them
    for package in OWN:
        if _import(package):
            root = sys.modules[package]
            for module in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
                if not module.name.endswith("__main__"):
                    _import(module.name)
    for name in OTHERS:
        _import(name)
    if "torch" in sys.modules:  # torch imports its jagged nested tensor's code on first use
        torch = sys.modules["torch"]
        torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)


if __name__ == "__main__":
    main()
