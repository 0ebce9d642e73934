"""distbatch as a TransferQueue storage backend: `import distbatch.transferqueue`, then
`tq.init({"backend": {"storage_backend": "Distbatch", "Distbatch": {...}}})`.

Importing registers the backend (TransferQueue's bootstrap provider and storage manager) in
this process; every process that calls `tq.init` or a TransferQueue client must import it
first (or have Ray run the import in its workers: `runtime_env={"worker_process_setup_hook":
"distbatch.transferqueue.register"}`). The registration itself waits for `transfer_queue`: it
runs when this process imports TransferQueue (at once if it has already), so a Ray worker of
the job that never touches TransferQueue does not load it, tensordict and torch for nothing
(about 5 CPU-seconds each). Options under `backend.Distbatch`: see `BackendOptions`. With none,
`tq.init` starts one worker per Ray node; `tq.close()` stops them (as `close()` here does, which
also says how many).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from types import ModuleType
from typing import TYPE_CHECKING, Any

import wrapt

if TYPE_CHECKING:
    from distbatch.transferqueue.manager import DistbatchStorageManager
    from distbatch.transferqueue.options import BACKEND_NAME, BackendOptions
    from distbatch.transferqueue.provider import STARTED as STARTED  # a test stops what it started
    from distbatch.transferqueue.provider import bootstrap

SUPPORTED_VERSIONS = ("0.1.11",)
_INSTALL = "pip install transferqueue==0.1.11 (or distbatch[tq])"


def _refuse(version: str) -> ImportError:
    return ImportError(
        f"distbatch.transferqueue supports TransferQueue {', '.join(SUPPORTED_VERSIONS)}, "
        f"this is {version}: its backend API changes between releases; install a supported one"
    )


def _check_installed() -> None:
    """TransferQueue is installed, at a supported version (read from its metadata: nothing imported)."""
    if importlib.util.find_spec("transfer_queue") is None:
        raise ImportError(f"distbatch.transferqueue needs TransferQueue: {_INSTALL}")
    try:
        version = importlib.metadata.version("transferqueue")
    except importlib.metadata.PackageNotFoundError:
        return  # a source checkout without metadata: `_register` checks its __version__
    if version not in SUPPORTED_VERSIONS:
        raise _refuse(version)


def _register(transfer_queue: ModuleType) -> None:
    """Once `transfer_queue` is imported: check its version, then import the modules whose
    decorators register the bootstrap provider and the storage manager with it."""
    version = getattr(transfer_queue, "__version__", "unknown")
    if version not in SUPPORTED_VERSIONS:
        raise _refuse(version)
    # Either may be half-imported already (its own import of TransferQueue got us here): then
    # its decorator registers it once it finishes; neither imports the other.
    importlib.import_module("distbatch.transferqueue.manager")
    provider = importlib.import_module("distbatch.transferqueue.provider")
    provider.hook_interface(importlib.import_module("transfer_queue.interface"))


_check_installed()
wrapt.register_post_import_hook(_register, "transfer_queue")

# Imported on first use (`manager` and `provider` import TransferQueue, which registers both).
_LAZY = {
    "BACKEND_NAME": "options",
    "DistbatchStorageManager": "manager",
    "STARTED": "provider",
    "bootstrap": "provider",
    "BackendOptions": "options",
    "fast_schema": None,
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = _LAZY[name]
    if module is None:
        return importlib.import_module(f"{__name__}.{name}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def register() -> None:
    """Nothing to do once imported (importing registers, when TransferQueue is imported); for
    Ray's `worker_process_setup_hook`."""


def close() -> int:
    """`tq.close()`, which stops the workers `tq.init` started in this process; returns how many
    were stopped. Safe to call twice."""
    import transfer_queue as tq

    from distbatch.transferqueue import fast_schema
    from distbatch.transferqueue.provider import STARTED

    stopped = STARTED.stop_all()  # first, to count them (tq.close() finds none left)
    try:
        tq.close()
    finally:
        fast_schema.uninstall()
    return stopped + STARTED.stop_all()


__all__ = [
    "BACKEND_NAME",
    "SUPPORTED_VERSIONS",
    "BackendOptions",
    "DistbatchStorageManager",
    "bootstrap",
    "close",
    "register",
]
