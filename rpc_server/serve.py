"""Bind a worker app to a socket and serve it (used by the CLI and by in-process hosts)."""

from __future__ import annotations

import logging
import socket
import threading

from flask import Flask
from werkzeug.serving import BaseWSGIServer, make_server

WILDCARD_HOSTS = {"0.0.0.0", "::", ""}


def format_node(host: str, port: int) -> str:
    """`host:port`, with IPv6 literals bracketed."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def advertised_host(bind_host: str) -> str:
    """The host peers should dial: the bind host, or this machine's address for a wildcard."""
    if bind_host not in WILDCARD_HOSTS:
        return bind_host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class WorkerServer:
    """A threaded WSGI server around an app, bound at construction (port 0 allowed).

    The app may register `extensions["on_bound"](node)` to learn its address
    and `extensions["on_close"]()` to release resources at shutdown.
    """

    def __init__(self, app: Flask, host: str = "127.0.0.1", port: int = 0) -> None:
        # Werkzeug logs every request at INFO; keep the hot path quiet.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        self._server: BaseWSGIServer = make_server(host, port, app, threaded=True)
        self._server.daemon_threads = True
        self.node = format_node(advertised_host(host), self._server.server_port)
        on_bound = app.extensions.get("on_bound")
        if on_bound is not None:
            on_bound(self.node)
        self._on_close = app.extensions.get("on_close")
        self._thread: threading.Thread | None = None

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def stop_serving(self) -> None:
        """Make `serve_forever` return; call from a thread other than the one serving."""
        self._server.shutdown()

    def start_background(self) -> WorkerServer:
        """Serve on a daemon thread (for hosting a worker inside another process)."""
        self._thread = threading.Thread(target=self.serve_forever, name="rpc-server", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()
        if self._on_close is not None:
            self._on_close()
