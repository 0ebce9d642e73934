"""The unit tier: library code in this process only.

A unit test that started a worker or a server would be an integration test in the wrong place
(slow, and flaky on a busy machine), so listening on a socket or starting `rpc_server` fails it.
A fresh interpreter to check what an import pulls in (`python -c "import ..."`) is allowed.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def no_servers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def listen(self: socket.socket, *args: Any) -> None:
        raise AssertionError("a unit test listens on a socket: it belongs in tests/integration")

    real_popen_init = subprocess.Popen.__init__

    def popen_init(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        command = " ".join(map(str, args if isinstance(args, (list, tuple)) else [args]))
        if "-m rpc_server" in command or "distbatch-worker" in command:
            raise AssertionError("a unit test starts a worker: it belongs in tests/integration")
        real_popen_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(socket.socket, "listen", listen)
    monkeypatch.setattr(subprocess.Popen, "__init__", popen_init)
    yield
