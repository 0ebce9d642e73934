"""Launchers: start workers (local processes or Ray actors), group them, call their engines.

Owns worker processes and their lifetimes: `local` starts `python -m rpc_server` processes on
this machine and stops them reliably, `ray_actors` runs the same workers as Ray actors (it
imports `ray`; import it only when Ray is wanted), `group` is `WorkerGroup` over either, and
`flags` is the worker's command line, checked here before anything starts. May import
`distbatch.client`, `distbatch.batch.calls` and below; never the controller.
"""

from distbatch.launch.local import (
    LOG_TAIL_LINES,
    WorkerLogs,
    WorkerProcess,
    controller_import_path,
    log_tail,
    read_first_line,
    spawn_worker,
    spawn_workers,
)

__all__ = [
    "LOG_TAIL_LINES",
    "WorkerLogs",
    "WorkerProcess",
    "controller_import_path",
    "log_tail",
    "read_first_line",
    "spawn_worker",
    "spawn_workers",
]
