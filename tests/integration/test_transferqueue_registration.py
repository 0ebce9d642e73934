"""Importing distbatch.transferqueue registers the backend once TransferQueue is imported, in
either order, and loads nothing heavy before that: a Ray worker whose setup hook imports it but
never touches TransferQueue does not pay for TransferQueue, tensordict and torch. (The other
order, TransferQueue first, is how every backend test module imports them.)"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("transfer_queue") is None and os.environ.get("DISTBATCH_REQUIRE_TQ") != "1":
    pytest.skip("TransferQueue is not installed", allow_module_level=True)

import distbatch.transferqueue as dtq  # noqa: E402  (after the skip)

# Prints what is loaded after our import, then what TransferQueue's registries hold once it is.
PROBE = """
import sys
{first}
print(sorted(m for m in ("transfer_queue", "tensordict", "torch") if m in sys.modules))
import transfer_queue
from transfer_queue.storage.bootstrap.provider import StorageBootstrapProvider
from transfer_queue.storage.managers.base import StorageManagerFactory
import distbatch.transferqueue as dtq
print(StorageBootstrapProvider.get_provider("Distbatch") is dtq.bootstrap,
      StorageManagerFactory._registry.get("Distbatch") is dtq.DistbatchStorageManager)
"""


def _probe(first: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(first=first)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_importing_it_loads_nothing_heavy_and_registers_when_transferqueue_comes() -> None:
    loaded, registered = _probe("import distbatch.transferqueue")
    assert loaded == "[]"
    assert registered == "True True"


def test_an_unsupported_transferqueue_is_refused_naming_the_supported_ones() -> None:
    with pytest.raises(ImportError, match=r"supports TransferQueue 0\.1\.11, this is 0\.2\.0"):
        dtq._register(SimpleNamespace(__version__="0.2.0"))  # type: ignore[arg-type]


def test_public_names_resolve_and_unknown_ones_are_attribute_errors() -> None:
    assert dtq.BACKEND_NAME == "Distbatch" and callable(dtq.bootstrap)
    assert dtq.BackendOptions.__module__ == "distbatch.transferqueue.options"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        dtq.nope  # noqa: B018
