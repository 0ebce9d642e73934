"""AReaL imported for a while, and the process as it was afterwards.

Importing AReaL reconfigures the whole process: its `getLogger` replaces Python's root logger
and logger manager and applies a logging config that disables every logger that existed before
(ours included, so a test reading our log lines saw none), and it installs uvloop's event-loop
policy. A test process runs hundreds of other tests after the AReaL ones, so `areal_imported()`
imports AReaL only when entered, and on exit puts logging (root, manager, each logger's level,
handlers and switches) and the loop policy back. `scripts/test` requires AReaL
(`DISTBATCH_REQUIRE_AREAL=1`): a broken install fails instead of skipping.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
from collections.abc import Iterator
from types import SimpleNamespace

import pytest


def _loggers() -> list[logging.Logger]:
    known = logging.Logger.manager.loggerDict.values()
    return [logger for logger in known if isinstance(logger, logging.Logger)]


@contextlib.contextmanager
def areal_imported() -> Iterator[SimpleNamespace]:
    """AReaL's RTensor modules (`rtensor`, `serialization`, `RTensor`, `TensorShardInfo`), or a
    skip where AReaL is not installed and not required."""
    root, manager, module_root = logging.Logger.root, logging.Logger.manager, logging.root
    saved = {
        logger: (logger.level, list(logger.handlers), logger.propagate, logger.disabled)
        for logger in [root, *_loggers()]
    }
    policy = asyncio.get_event_loop_policy()
    try:
        if os.environ.get("DISTBATCH_REQUIRE_AREAL") == "1":
            rtensor = importlib.import_module("areal.infra.rpc.rtensor")
        else:
            rtensor = pytest.importorskip("areal.infra.rpc.rtensor")
        serialization = importlib.import_module("areal.infra.rpc.serialization")
        yield SimpleNamespace(
            rtensor=rtensor,
            serialization=serialization,
            RTensor=rtensor.RTensor,
            TensorShardInfo=rtensor.TensorShardInfo,
        )
    finally:
        logging.Logger.root, logging.Logger.manager, logging.root = root, manager, module_root
        for logger, (level, handlers, propagate, disabled) in saved.items():
            logger.setLevel(level)
            logger.handlers[:] = handlers
            logger.propagate, logger.disabled = propagate, disabled
        asyncio.set_event_loop_policy(policy)
