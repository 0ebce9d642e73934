"""distbatch as a TransferQueue storage backend: `import distbatch.transferqueue`, then
`tq.init({"backend": {"storage_backend": "Distbatch", "Distbatch": {...}}})`.

Importing registers the backend (TransferQueue's bootstrap provider and storage manager) in
this process; every process that calls `tq.init` or a TransferQueue client must import it
first (or have Ray run the import in its workers: `runtime_env={"worker_process_setup_hook":
"distbatch.transferqueue.register"}`). Options under `backend.Distbatch`: see
`BackendOptions`. With none, `tq.init` starts one worker per Ray node; `close()` stops them
(`tq.close()` alone does not stop a backend it did not bring).
"""

from __future__ import annotations

SUPPORTED_VERSIONS = ("0.1.11",)


def _check_version() -> None:
    try:
        import transfer_queue
    except ImportError as exc:
        raise ImportError(
            "distbatch.transferqueue needs TransferQueue: pip install transferqueue==0.1.11 "
            "(or distbatch[tq])"
        ) from exc
    version = getattr(transfer_queue, "__version__", "unknown")
    if version not in SUPPORTED_VERSIONS:
        raise ImportError(
            f"distbatch.transferqueue supports TransferQueue {', '.join(SUPPORTED_VERSIONS)}, "
            f"this is {version}: its backend API changes between releases; install a supported one"
        )


_check_version()

from distbatch.transferqueue import fast_schema  # noqa: E402
from distbatch.transferqueue.bootstrap import STARTED, bootstrap  # noqa: E402  (after the check)
from distbatch.transferqueue.manager import BACKEND_NAME, DistbatchStorageManager  # noqa: E402
from distbatch.transferqueue.options import BackendOptions  # noqa: E402


def register() -> None:
    """Nothing to do once imported (importing registers); for Ray's `worker_process_setup_hook`."""


def close() -> int:
    """`tq.close()`, then stop the workers `tq.init` started in this process; returns how many
    were stopped. Safe to call twice."""
    import transfer_queue as tq

    try:
        tq.close()
    finally:
        fast_schema.uninstall()
        stopped = STARTED.stop_all()
    return stopped


__all__ = [
    "BACKEND_NAME",
    "SUPPORTED_VERSIONS",
    "BackendOptions",
    "DistbatchStorageManager",
    "bootstrap",
    "close",
    "register",
]
